//! RemoteIO behind the engine seam: anything touching another node.

use super::Engine;
use crate::endpoint::HostMemory;
use crate::error::{CoreError, Result};
use crate::outcome::{RemoteVia, Route};
use crate::route::{HostDst, HostSrc, RemoteAt, RemoteTransfer, StagedEnd};
use gpuio_hal::check_range;
use gpuio_hal::sync::MutexExt;
use gpuio_transport_memio::{HostPlacement, MemIo};
use std::fmt;
use std::sync::{Arc, Mutex};

/// Bytes per staging buffer of a RemoteIO transfer between another node and GPU memory or a
/// file.
const REMOTE_STAGE: usize = 8 << 20;

/// RemoteIO as an [`Engine`]. Host memory is read into and written from directly (the peer
/// stripes it over its connections; over RDMA, the memory is registered through a
/// [`RegistrationCache`](crate::regcache::RegistrationCache) and the NIC moves it in place;
/// over NIXL, the peer's channels keep shared memory registered and UCX moves it in place).
/// GPU memory moves GPU to GPU over NIXL where the export is GPU memory too; otherwise GPU
/// memory and files go through two pinned staging buffers, so that the network moves one
/// while MemIO or LocalIO moves the other.
pub struct RemoteIoEngine {
    memio: Arc<MemIo>,
    /// Idle staging buffers, kept for the next transfer.
    staging: Mutex<Vec<HostMemory>>,
    /// One registration cache per RDMA device the peers use.
    #[cfg(feature = "rdma")]
    rdma: Mutex<Vec<Arc<RdmaCache>>>,
}

#[cfg(feature = "rdma")]
type RdmaCache = crate::regcache::RegistrationCache<crate::regcache::RdmaRegistrar>;

impl fmt::Debug for RemoteIoEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteIoEngine").finish_non_exhaustive()
    }
}

impl RemoteIoEngine {
    /// The engine; it stages through memory MemIO allocates and moves.
    pub fn new(memio: Arc<MemIo>) -> Self {
        Self {
            memio,
            staging: Mutex::new(Vec::new()),
            #[cfg(feature = "rdma")]
            rdma: Mutex::new(Vec::new()),
        }
    }

    /// The counters of the RDMA registration caches (one per device in use).
    #[cfg(feature = "rdma")]
    pub fn rdma_registrations(&self) -> Vec<crate::regcache::RegCacheStats> {
        let caches = self.rdma.lock_unpoisoned();
        caches.iter().map(|c| c.stats()).collect()
    }

    /// Reads `len` bytes of `r` into host memory: in place where the memory is shared and
    /// the peer's RDMA device registers it, else through the connection's buffers.
    fn read_to_host(&self, r: RemoteAt<'_>, dst: HostDst<'_>, len: usize) -> Result<RemoteVia> {
        let peer = r.res.peer();
        #[cfg(feature = "rdma")]
        if let HostDst::Memory(mem, offset) = &dst
            && let Some(reg) = self.register(peer, mem, *offset, len)
        {
            dst.with(len, |d| {
                Ok(peer.read_registered(r.res.export(), r.offset, reg.handle(), d)?)
            })?;
            return Ok(RemoteVia::Registered);
        }
        match dst {
            // The peer keeps shared memory registered where its transport registers (NIXL).
            HostDst::Memory(mem, offset) => {
                check_range("destination", offset, len, mem.len())?;
                peer.read_memory(r.res.export(), r.offset, mem.shared(), offset, len)?
            }
            HostDst::Slice(_) => {
                dst.with(len, |d| Ok(peer.read(r.res.export(), r.offset, d)?))?
            }
        }
        Ok(RemoteVia::Connection)
    }

    /// Writes `len` bytes of host memory to `r`, in place where it can (see
    /// [`read_to_host`](Self::read_to_host)).
    fn write_from_host(&self, src: HostSrc<'_>, r: RemoteAt<'_>, len: usize) -> Result<RemoteVia> {
        let peer = r.res.peer();
        #[cfg(feature = "rdma")]
        if let HostSrc::Memory(mem, offset) = src
            && let Some(reg) = self.register(peer, mem, offset, len)
        {
            src.with(len, |s| {
                Ok(peer.write_registered(r.res.export(), r.offset, reg.handle(), s)?)
            })?;
            return Ok(RemoteVia::Registered);
        }
        match src {
            HostSrc::Memory(mem, offset) => {
                check_range("source", offset, len, mem.len())?;
                peer.write_memory(r.res.export(), r.offset, mem.shared(), offset, len)?
            }
            HostSrc::Slice(_) => {
                src.with(len, |s| Ok(peer.write(r.res.export(), r.offset, s)?))?
            }
        }
        Ok(RemoteVia::Connection)
    }

    /// A registration of `mem`'s range with the peer's RDMA device; `None` for a TCP peer, or
    /// where registering fails (the range overlaps one in use, the memlock limit): the bytes
    /// then go through the channel's own registered buffer.
    #[cfg(feature = "rdma")]
    fn register(
        &self,
        peer: &gpuio_transport_remoteio::RemotePeer,
        mem: &HostMemory,
        offset: usize,
        len: usize,
    ) -> Option<crate::regcache::Registered<gpuio_rdma::HostRegion>> {
        let device = match peer.rdma_device()? {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(error = %e, "no RDMA device to register with");
                return None;
            }
        };
        let cache = {
            let mut caches = self.rdma.lock_unpoisoned();
            let found = caches
                .iter()
                .find(|c| Arc::ptr_eq(&c.registrar().device, &device))
                .cloned();
            found.unwrap_or_else(|| {
                let registrar = crate::regcache::RdmaRegistrar { device };
                let c = Arc::new(RdmaCache::new(registrar, Default::default()));
                caches.push(c.clone());
                c
            })
        };
        match cache.get(mem, offset, len) {
            Ok(reg) => Some(reg),
            Err(e) => {
                tracing::debug!(error = %e, "RDMA registration refused: staged instead");
                None
            }
        }
    }

    fn take_stage(&self) -> Result<HostMemory> {
        if let Some(b) = self.staging.lock_unpoisoned().pop() {
            return Ok(b);
        }
        let buf = self
            .memio
            .alloc_host(HostPlacement::Dram { numa: None }, REMOTE_STAGE, true)?;
        Ok(HostMemory::new(buf))
    }

    fn give_stage(&self, b: HostMemory) {
        let mut idle = self.staging.lock_unpoisoned();
        if idle.len() < 4 {
            idle.push(b);
            return;
        }
        drop(idle);
        // Not kept: its registrations go with it.
        #[cfg(feature = "rdma")]
        for cache in self.rdma.lock_unpoisoned().iter() {
            cache.purge(&b);
        }
    }

    /// Moves `len` bytes from `from` to `to` in stages: a reader thread fills one staging
    /// buffer while this thread drains another (at most three are in use). Staging buffers
    /// are registered with the peer's RDMA device, so the network moves them in place.
    fn staged(&self, from: StagedEnd<'_>, to: StagedEnd<'_>, len: usize) -> Result<()> {
        for end in [from, to] {
            if let StagedEnd::Device(d) = end {
                check_range("device range", d.offset, len, d.buf.len())?;
            }
        }
        let (full_tx, full_rx) = crossbeam_channel::bounded::<(usize, usize, HostMemory)>(1);
        // Both ends as they stand `at` bytes into the transfer.
        let fill = |at: usize, stage: &HostMemory, n: usize| -> Result<()> {
            let stage = HostDst::Memory(stage, 0);
            match from.advanced(at) {
                StagedEnd::Remote(r) => self.read_to_host(r, stage, n).map(|_| ()),
                StagedEnd::Device(d) => stage.with(n, |s| {
                    Ok(self.memio.download(d.buf, d.offset, s).map(|_| ())?)
                }),
                StagedEnd::File(f) => stage.with(n, |s| Ok(f.file.read_exact_at(f.offset, s)?)),
            }
        };
        let drain = |at: usize, stage: &HostMemory, n: usize| -> Result<()> {
            let stage = HostSrc::Memory(stage, 0);
            match to.advanced(at) {
                StagedEnd::Remote(r) => self.write_from_host(stage, r, n).map(|_| ()),
                StagedEnd::Device(d) => stage.with(n, |s| {
                    Ok(self.memio.upload(s, d.buf, d.offset).map(|_| ())?)
                }),
                StagedEnd::File(f) => stage.with(n, |s| Ok(f.file.write_all_at(f.offset, s)?)),
            }
        };
        std::thread::scope(|scope| {
            let reader = scope.spawn(move || -> Result<()> {
                let mut at = 0;
                while at < len {
                    let stage = self.take_stage()?;
                    let n = REMOTE_STAGE.min(len - at);
                    fill(at, &stage, n)?;
                    // A closed channel: the drainer failed, and reports why.
                    if full_tx.send((at, n, stage)).is_err() {
                        return Ok(());
                    }
                    at += n;
                }
                Ok(())
            });
            let mut drained = Ok(());
            for (at, n, stage) in full_rx.iter() {
                drained = drain(at, &stage, n);
                self.give_stage(stage);
                if drained.is_err() {
                    break;
                }
            }
            drop(full_rx);
            let read = reader
                .join()
                .unwrap_or_else(|_| Err(CoreError::Internal("a staging thread panicked".into())));
            read.and(drained)
        })
    }
}

impl Engine for RemoteIoEngine {
    type Transfer<'a> = RemoteTransfer<'a>;

    fn transfer(&self, t: RemoteTransfer<'_>, len: usize) -> Result<Route> {
        Ok(match t {
            RemoteTransfer::ToHost(r, dst) => Route::RemoteRead {
                peer: r.res.peer().addr(),
                via: self.read_to_host(r, dst, len)?,
            },
            RemoteTransfer::FromHost(src, r) => Route::RemoteWrite {
                peer: r.res.peer().addr(),
                via: self.write_from_host(src, r, len)?,
            },
            RemoteTransfer::StagedRead(r, to) => {
                #[cfg(feature = "nixl")]
                if let StagedEnd::Device(d) = to {
                    let (peer, range) = (r.res.peer(), d.offset..d.offset.saturating_add(len));
                    if let Some(done) = peer.read_device(r.res.export(), r.offset, d.buf, range) {
                        done?;
                        let peer = peer.addr();
                        let via = RemoteVia::GpuToGpu;
                        return Ok(Route::RemoteRead { peer, via });
                    }
                }
                self.staged(StagedEnd::Remote(r), to, len)?;
                Route::RemoteRead {
                    peer: r.res.peer().addr(),
                    via: RemoteVia::Staged,
                }
            }
            RemoteTransfer::StagedWrite(from, r) => {
                #[cfg(feature = "nixl")]
                if let StagedEnd::Device(d) = from {
                    let (peer, range) = (r.res.peer(), d.offset..d.offset.saturating_add(len));
                    if let Some(done) = peer.write_device(r.res.export(), r.offset, d.buf, range) {
                        done?;
                        let peer = peer.addr();
                        let via = RemoteVia::GpuToGpu;
                        return Ok(Route::RemoteWrite { peer, via });
                    }
                }
                self.staged(from, StagedEnd::Remote(r), len)?;
                Route::RemoteWrite {
                    peer: r.res.peer().addr(),
                    via: RemoteVia::Staged,
                }
            }
        })
    }
}
