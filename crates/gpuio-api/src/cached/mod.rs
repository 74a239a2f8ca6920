//! Cached files: [`Session::open_cached`] puts a file behind a `BlockCache`
//! (docs/REFERENCE.md#block-cache) built from the session's `[cache]` configuration and GPUs:
//! L1 in GPU memory, L2 in host memory, L3 in a file on a local SSD, write-back or
//! write-through, with prefetching. Reads and writes of a [`CachedFile`] go through the cache;
//! the session's transfers and copies do not.

#[cfg(test)]
mod tests;

use crate::error::{Error, Result};
use crate::session::{Access, Session};
use crate::uri::Uri;
use gpuio_core::cache::{BlockCache, CacheStats};
use gpuio_hal::DeviceBuffer;
use gpuio_transport_localio::{FileHandle, OpenOptions};
use std::sync::Arc;

/// A file read and written through a block cache, from [`Session::open_cached`].
///
/// It serves exactly the bytes the file had when it was opened: reads and writes must lie
/// within them (a write cannot grow the file). Share it behind an `Arc`: every method but
/// [`close`](Self::close) takes `&self`. Dirty blocks are written back by [`flush`](Self::flush),
/// by evictions, and when the file is closed or dropped (a failure on drop is only logged:
/// call `close` to see it).
///
/// ```
/// use gpuio_api::{Access, Config, Session, Uri};
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("data");
/// std::fs::write(&path, vec![7u8; 300_000]).unwrap();
/// let session = Session::new(Config::default()).unwrap();
/// let uri = Uri::parse(path.to_str().unwrap()).unwrap();
/// let file = session.open_cached(&uri, Access::Read).unwrap();
/// let mut buf = vec![0u8; 100_000];
/// file.read(70_000, &mut buf).unwrap();
/// assert!(buf.iter().all(|&b| b == 7));
/// file.read(70_000, &mut buf).unwrap(); // served by the cache
/// assert!(file.stats().levels[0].hits > 0);
/// ```
#[derive(Debug)]
pub struct CachedFile {
    cache: BlockCache,
    file: FileHandle,
    uri: Uri,
}

impl Session {
    /// Opens the file `uri` names behind a block cache built from this session's `[cache]`
    /// configuration ([`Config::cache_config`](crate::Config::cache_config): the levels are
    /// checked against what the machine can back now, and a level it cannot back is refused
    /// with [`Error::Config`] naming the key).
    ///
    /// [`Access::Read`] opens the file read-only; [`Access::Write`] (or [`Access::Update`])
    /// opens it for reading and writing — unlike [`Session::open`] with `Write`, it must exist
    /// and keeps its bytes and size. Only
    /// file URIs (paths, `file://`, `localio://`) can be cached: memory URIs name memory
    /// already, and remote exports are not cached ([`Error::Unsupported`]).
    pub fn open_cached(&self, uri: &Uri, access: Access) -> Result<CachedFile> {
        let Uri::File { path, direct, .. } = uri else {
            return Err(Error::Unsupported {
                what: format!("caching {uri}"),
                reason: "the block cache sits in front of files; memory URIs name memory \
                         already, and remote exports are not cached"
                    .into(),
            });
        };
        let opts = OpenOptions {
            write: access != Access::Read,
            direct: *direct,
            ..OpenOptions::READ
        };
        let file = self.open_file(path, opts)?;
        let cfg = self.config().cache_config(self.gpus())?;
        let cache = BlockCache::new(Arc::new(file.clone()), cfg)?;
        tracing::debug!(%uri, len = cache.len(), "opened cached");
        Ok(CachedFile {
            cache,
            file,
            uri: uri.clone(),
        })
    }
}

impl CachedFile {
    /// The URI it was opened with.
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// The file underneath (reads and writes made through it bypass the cache).
    pub fn file(&self) -> &FileHandle {
        &self.file
    }

    /// Bytes it serves: the file's length when it was opened.
    pub fn len(&self) -> u64 {
        self.cache.len()
    }

    /// Whether it serves no bytes.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Bytes per cache block.
    pub fn block_size(&self) -> usize {
        self.cache.block_size()
    }

    /// Reads `buf.len()` bytes at `offset` through the cache.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        Ok(self.cache.read(offset, buf)?)
    }

    /// Reads `len` bytes at `offset` through the cache into `dst` at `dst_offset`. Blocks held
    /// in L1 are copied device to device where `dst` is on (or can reach) L1's GPU; the rest
    /// are uploaded from host memory.
    pub fn read_to_device(
        &self,
        offset: u64,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        Ok(self.cache.read_to_device(offset, len, dst, dst_offset)?)
    }

    /// Writes `data` at `offset` through the cache: under write-back it reaches the file at
    /// the next flush or eviction, under write-through before this returns. The file must
    /// have been opened with [`Access::Write`].
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        if !self.file.is_writable() {
            return Err(Error::Invalid(format!(
                "{} was opened cached for reading; open it with Access::Write to write",
                self.uri
            )));
        }
        Ok(self.cache.write(offset, data)?)
    }

    /// Writes every block that was dirty when the call began to the file and syncs it.
    pub fn flush(&self) -> Result<()> {
        Ok(self.cache.flush()?)
    }

    /// A snapshot of the cache's counters: per level (top first) capacity, resident blocks,
    /// hits, misses and evictions; write-backs; prefetched blocks and how many were used.
    pub fn stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Stops prefetching, writes the dirty blocks back and syncs the file, saying whether that
    /// worked (dropping the file does the same, but can only log a failure).
    pub fn close(mut self) -> Result<()> {
        Ok(self.cache.close()?)
    }
}
