//! Copying between URIs (what `gpuio cp` runs): a source with content (a file, or another
//! node's export), a destination (a file, another node's export, or memory that holds the
//! bytes for the session's life), optionally staged through a memory tier (`--via gpu0`,
//! `--via memio://cpu/dram?numa=1`, ...).
//!
//! A remote source with several replicas (a registry segment) fails over: each window is read
//! from the least loaded replica, with the retry policy, and from the next when it still
//! fails. A remote destination with several replicas gets every window written to each.
//!
//! A file destination is written under a temporary name in the same directory and renamed
//! over the destination only when every byte is written (and verified, if asked): a failed copy
//! never leaves a partial file under the destination's name ([`crate::partial`]).
//!
//! A remote destination must take the whole copy (its capacity and the key's rights, asked of
//! every replica) before the first byte goes out. A remote source or destination whose agent
//! restarts during the copy fails it (`Restarted`) rather than mixing two instances' bytes.

use crate::error::{Error, Result};
use crate::partial::PendingFile;
use crate::session::{Access, Resource, Session};
use crate::uri::Uri;
use gpuio_hal::{ErrorCode, HostAllocOptions, HostBuffer};
use gpuio_transport_localio::OpenOptions;
use gpuio_transport_remoteio::RemoteIoError;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Options of [`Session::copy`].
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Stage through this memory tier.
    pub via: Option<Uri>,
    /// Compare crc32c checksums of source and destination before declaring success.
    pub verify: bool,
    /// Bytes moved per step (and the size of the `via` buffer).
    pub window: usize,
    /// Flush a file destination (or a remote agent's file export) to stable storage before
    /// completing; refused up front for a remote memory export.
    pub durable: bool,
}

impl Default for CopyOptions {
    fn default() -> Self {
        Self {
            via: None,
            verify: false,
            window: 64 << 20,
            durable: false,
        }
    }
}

/// What a copy did.
#[derive(Debug, Clone)]
pub struct CopyReport {
    /// Bytes copied.
    pub bytes: u64,
    /// Wall time of the copy (excluding verification).
    pub elapsed: Duration,
    /// Wall time of the verification, when asked for.
    pub verify_elapsed: Option<Duration>,
    /// How each stage of the first window went (its [`Display`](std::fmt::Display) reads
    /// e.g. `read: io_uring x 2 lane(s), pinned staging + DMA`).
    pub stages: Vec<gpuio_core::Outcome>,
    /// The crc32c both sides agreed on, when verified.
    pub checksum: Option<u32>,
    /// Where the bytes ended up, when the destination is memory (it lives as long as this
    /// report's resource).
    pub destination: Resource,
}

impl CopyReport {
    /// Throughput in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

impl Session {
    /// Reads `len` bytes from any of `sources` (replicas of the same bytes) into `dst`: the
    /// retry policy on each, failing over to the next (the engines' `execute_any`).
    pub fn read_any(
        &self,
        sources: &[gpuio_core::Endpoint],
        dst: &gpuio_core::Endpoint,
        len: usize,
    ) -> Result<gpuio_core::Outcome> {
        Ok(self.engines().execute_any(
            sources,
            dst,
            len,
            &self.config().retry,
            None,
            &mut || {},
            &mut || {},
        )?)
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

impl Session {
    /// Copies `src` to `dst`; `progress` is told the bytes done after every window.
    pub fn copy(
        &self,
        src: &Uri,
        dst: &Uri,
        opts: &CopyOptions,
        progress: &mut dyn FnMut(u64),
    ) -> Result<CopyReport> {
        let start = Instant::now();
        if src.is_memory() {
            return Err(Error::Invalid(format!(
                "{src} is memory, which has no content to copy from: use it as a destination or --via"
            )));
        }
        let src_path = match src {
            Uri::File { path, .. } => Some(path),
            _ => None,
        };
        let source = self.open(src, 0, Access::Read)?;
        let len = source.len()?;
        let len_usize = usize::try_from(len)
            .map_err(|_| Error::Invalid(format!("{src} is too large for this machine")))?;
        if let Some(via) = &opts.via
            && !via.is_memory()
        {
            return Err(Error::Invalid(format!(
                "--via {via}: staging needs a memory tier (gpu<N>, memio://cpu/dram, memio://cxl/...)"
            )));
        }

        let mut pending = None;
        let destination = match dst {
            Uri::File { path, direct, gds } => {
                if src_path.is_some_and(|s| same_file(s, path)) {
                    return Err(Error::Invalid(format!("{src} and {dst} are the same file")));
                }
                let opts = OpenOptions {
                    write: true,
                    direct: *direct,
                    gds: *gds,
                    ..OpenOptions::READ
                };
                let p = PendingFile::create(self, path, opts)?;
                let handle = p.handle.clone();
                pending = Some(p);
                Resource::File(handle)
            }
            Uri::Nvme { .. } if src == dst => {
                return Err(Error::Invalid(format!(
                    "{src} and {dst} are the same namespace"
                )));
            }
            // Host memory that receives a copy (whose source is storage or another node, never
            // memory) is not pinned: pinning a gigabyte costs the driver a tenth of a second,
            // and the CPU's copy from a file or socket gains nothing from it.
            Uri::Dram { .. } | Uri::Cxl { .. } => {
                let placement = dst
                    .host_placement()
                    .ok_or_else(|| Error::Invalid(format!("{dst} is not host memory")))?;
                Resource::Host(self.alloc_host(placement, len_usize, false)?)
            }
            other => self.open(other, len_usize, Access::Write)?,
        };
        if let Resource::File(f) = &destination
            && let Some(ns) = f.nvme_device()
            && len > ns.len()
        {
            return Err(Error::Invalid(format!(
                "{src} ({len} bytes) does not fit {dst} ({} bytes): nothing was written",
                ns.len()
            )));
        }
        if let Resource::Remote(replicas) = &destination {
            // Every replica must take the whole copy before the first byte goes out: a copy
            // that fails half-way would leave an export half overwritten.
            for r in replicas {
                let info = r.peer().stat(r.export())?;
                if !info.writable {
                    return Err(Error::Remote(RemoteIoError::Remote {
                        code: ErrorCode::Permission,
                        message: format!("{r} may not be written with this key"),
                    }));
                }
                if len > info.capacity {
                    return Err(Error::Invalid(format!(
                        "{src} ({len} bytes) does not fit {r} ({} bytes): nothing was written",
                        info.capacity
                    )));
                }
                if opts.durable && !info.durable {
                    return Err(Error::Unsupported {
                        what: format!("--durable to {r}"),
                        reason: "it is memory, which starts afresh when its agent restarts: \
                                 nothing was written"
                            .into(),
                    });
                }
            }
            // Room for the whole copy, on every replica, before the first byte: a disk that
            // cannot hold it refuses now rather than half-way through.
            for r in replicas {
                r.peer().reserve(r.export(), len)?;
            }
        }

        let window = opts.window.clamp(4096, len_usize.max(4096));
        let via = match &opts.via {
            Some(v) => Some(self.open(v, window, Access::Write)?),
            None => None,
        };
        let mut stages = Vec::new();
        let mut done: u64 = 0;
        while done < len {
            let n = (len - done).min(window as u64) as usize;
            let from = source.replicas_at(done)?;
            let to = destination.replicas_at(done)?;
            let routes = match &via {
                Some(v) => {
                    let v = v.at(0)?;
                    let mut routes = vec![self.read_any(&from, &v, n)?];
                    for t in &to {
                        routes.push(self.transfer_owned(&v, t, n)?);
                    }
                    routes
                }
                None => match to.as_slice() {
                    [t] => vec![self.read_any(&from, t, n)?],
                    many => {
                        // Several destinations: read once into host memory, write each.
                        let stage = Resource::Host(gpuio_core::HostMemory::new(HostBuffer::alloc(
                            n,
                            &HostAllocOptions::default(),
                        )?));
                        let s = stage.at(0)?;
                        let mut routes = vec![self.read_any(&from, &s, n)?];
                        for t in many {
                            routes.push(self.transfer_owned(&s, t, n)?);
                        }
                        routes
                    }
                },
            };
            if stages.is_empty() {
                stages = routes;
            }
            done += n as u64;
            progress(done);
        }
        if opts.durable {
            match &destination {
                Resource::File(f) => f.sync_data()?,
                Resource::Remote(replicas) => {
                    for r in replicas {
                        r.peer().sync(r.export())?;
                    }
                }
                Resource::Host(_) | Resource::Device(_) => {}
            }
        }
        let elapsed = start.elapsed();
        let verify_start = Instant::now();
        let checksum = if opts.verify {
            let a = self.checksum(&source, len)?;
            let b = self.checksum(&destination, len)?;
            if a != b {
                return Err(Error::VerifyMismatch { src: a, dst: b });
            }
            Some(a)
        } else {
            None
        };
        let destination = match pending {
            Some(p) => Resource::File(p.commit(opts.durable)?),
            None => destination,
        };
        Ok(CopyReport {
            bytes: len,
            elapsed,
            verify_elapsed: opts.verify.then(|| verify_start.elapsed()),
            stages,
            checksum,
            destination,
        })
    }

    /// The crc32c of the first `len` bytes of a resource, read independently of any copy.
    pub fn checksum(&self, resource: &Resource, len: u64) -> Result<u32> {
        const CHUNK: usize = 16 << 20;
        let mut buf =
            HostBuffer::alloc(CHUNK.min(len as usize).max(1), &HostAllocOptions::default())?;
        let mut crc = 0u32;
        let mut off = 0u64;
        while off < len {
            let n = (len - off).min(CHUNK as u64) as usize;
            let chunk = &mut buf[..n];
            match resource {
                Resource::File(f) => f.read_exact_at(off, chunk)?,
                Resource::Device(d) => {
                    self.memio().download(d, off as usize, chunk)?;
                }
                Resource::Host(m) => {
                    let g = m.read();
                    gpuio_hal::check_range("checksum", off as usize, n, g.len())?;
                    chunk.copy_from_slice(&g[off as usize..off as usize + n]);
                }
                Resource::Remote(replicas) => {
                    // Any replica that answers (they hold the same bytes).
                    let mut failed = None;
                    for r in replicas {
                        failed = r.peer().read(r.export(), off, chunk).err();
                        if failed.is_none() {
                            break;
                        }
                    }
                    if let Some(e) = failed {
                        return Err(e.into());
                    }
                }
            }
            crc = crc32c::crc32c_append(crc, chunk);
            off += n as u64;
        }
        Ok(crc)
    }
}
