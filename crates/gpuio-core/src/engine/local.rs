//! LocalIO behind the engine seam: a file and memory, or two files.

use super::Engine;
use crate::error::{CoreError, Result};
use crate::outcome::Route;
use crate::route::{FileAt, LocalTransfer};
use gpuio_hal::{HostAllocOptions, HostBuffer};
use gpuio_transport_localio::{Durability, LocalIo};
use std::sync::Arc;

/// LocalIO as an [`Engine`] (host staging for file-to-file copies).
#[derive(Debug)]
pub struct LocalIoEngine(pub Arc<LocalIo>);

impl Engine for LocalIoEngine {
    type Transfer<'a> = LocalTransfer<'a>;

    fn transfer(&self, t: LocalTransfer<'_>, len: usize) -> Result<Route> {
        self.run(t, len, Durability::None)
    }
}

impl LocalIoEngine {
    /// Moves `len` bytes, writes to a file made durable as `durability` says.
    pub(crate) fn run(
        &self,
        t: LocalTransfer<'_>,
        len: usize,
        durability: Durability,
    ) -> Result<Route> {
        let io = &self.0;
        Ok(match t {
            LocalTransfer::FileToHost(f, dst) => {
                Route::FileToHost(dst.with(len, |d| Ok(io.read_to_host(f.file, f.offset, d)?))?)
            }
            LocalTransfer::HostToFile(src, f) => Route::HostToFile(src.with(len, |s| {
                Ok(io.write_from_host(s, f.file, f.offset, durability)?)
            })?),
            LocalTransfer::FileToDevice(f, d) => {
                let t = io.read_to_device(f.file, f.offset, d.buf, d.offset, len)?;
                if d.buf.gpu().info().page_cache_dma.available {
                    crate::metrics::page_cache(&io.page_cache_stats());
                }
                Route::FileToDevice(t)
            }
            LocalTransfer::DeviceToFile(d, f) => Route::DeviceToFile(
                io.write_from_device(d.buf, d.offset, f.file, f.offset, len, durability)?,
            ),
            LocalTransfer::FileToFile(src, dst) => {
                self.file_to_file(src, dst, len)?;
                if durability == Durability::DataSync {
                    dst.file.sync_data()?;
                }
                Route::FileCopy
            }
        })
    }

    /// Copies through one host buffer of a chunk; a copy within one file with overlapping
    /// ranges is refused (it would read bytes it has already overwritten).
    fn file_to_file(&self, src: FileAt<'_>, dst: FileAt<'_>, len: usize) -> Result<()> {
        let (soff, doff) = (src.offset, dst.offset);
        let overlap =
            soff < doff.saturating_add(len as u64) && doff < soff.saturating_add(len as u64);
        if overlap && src.file.same_inode(dst.file)? {
            return Err(CoreError::InvalidRequest(format!(
                "copy within {} with overlapping ranges {soff}+{len} and {doff}+{len}",
                src.file.path().display()
            )));
        }
        let chunk = self.0.config().chunk_size.min(len.max(1));
        let mut buf = HostBuffer::alloc(chunk, &HostAllocOptions::default())?;
        let mut done = 0;
        while done < len {
            let n = chunk.min(len - done);
            src.file.read_exact_at(soff + done as u64, &mut buf[..n])?;
            dst.file.write_all_at(doff + done as u64, &buf[..n])?;
            done += n;
        }
        Ok(())
    }
}
