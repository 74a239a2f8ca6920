//! The `Engine` abstraction and the transport manager. Each transport crate knows nothing of
//! the others; here each is adapted to [`Engine`], and [`Engines`] routes a transfer to the one
//! that serves its pair of endpoint kinds.

use crate::endpoint::{Dest, Endpoint, EndpointKind, HostMemory, RemoteResource, Source};
use crate::error::{CoreError, Result};
use crate::request::{EngineKind, Request};
use crate::resources::ResourceTracker;
use crate::retry::RetryPolicy;
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{DeviceBuffer, HostAllocOptions, HostBuffer, check_range};
use gpuio_transport_localio::{Durability, FileHandle, LocalIo};
use gpuio_transport_memio::{HostPlacement, MemIo};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What a finished transfer reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Bytes moved.
    pub bytes: usize,
    /// The engine that moved them.
    pub engine: EngineKind,
    /// How (e.g. "direct DMA (pinned memory)").
    pub route: String,
}

/// A transport adapted to the core: a blocking transfer between two borrowed endpoints.
pub trait Engine: Send + Sync + fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> EngineKind;

    /// Moves `len` bytes from `src` to `dst`. A host slice must hold at least `len` bytes; the
    /// first `len` are used.
    fn transfer(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome>;
}

/// The engine that serves transfers between these kinds of endpoint: anything touching
/// another node goes to RemoteIO, then anything touching a file to LocalIO, memory to memory
/// to MemIO.
pub fn route(src: EndpointKind, dst: EndpointKind) -> Result<EngineKind> {
    Ok(
        if src == EndpointKind::Remote || dst == EndpointKind::Remote {
            EngineKind::RemoteIo
        } else if src.is_storage() || dst.is_storage() {
            EngineKind::LocalIo
        } else {
            EngineKind::MemIo
        },
    )
}

fn host_prefix<'a>(what: &'static str, s: &'a [u8], len: usize) -> Result<&'a [u8]> {
    check_range(what, 0, len, s.len())?;
    Ok(&s[..len])
}

fn host_prefix_mut<'a>(what: &'static str, s: &'a mut [u8], len: usize) -> Result<&'a mut [u8]> {
    check_range(what, 0, len, s.len())?;
    Ok(&mut s[..len])
}

/// MemIO as an [`Engine`].
#[derive(Debug)]
pub struct MemIoEngine(pub Arc<MemIo>);

impl Engine for MemIoEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::MemIo
    }

    fn transfer(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome> {
        let io = &self.0;
        let route = match (src, dst) {
            (Source::Host(s), Dest::Device(d, off)) => {
                io.upload(host_prefix("source", s, len)?, d, off)?
            }
            (Source::Device(s, off), Dest::Host(d)) => {
                io.download(s, off, host_prefix_mut("destination", d, len)?)?
            }
            (Source::Device(s, so), Dest::Device(d, doff)) => {
                io.copy_device(s, so, d, doff, len)?
            }
            (Source::Host(s), Dest::Host(d)) => io.copy_host(
                host_prefix("source", s, len)?,
                host_prefix_mut("destination", d, len)?,
            )?,
            (s, d) => {
                return Err(CoreError::InvalidRequest(format!(
                    "MemIO does not move {:?} to {:?}",
                    s.kind(),
                    d.kind()
                )));
            }
        };
        Ok(Outcome {
            bytes: len,
            engine: EngineKind::MemIo,
            route: route.to_string(),
        })
    }
}

/// LocalIO as an [`Engine`] (host staging for file-to-file copies).
#[derive(Debug)]
pub struct LocalIoEngine(pub Arc<LocalIo>);

impl Engine for LocalIoEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::LocalIo
    }

    fn transfer(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome> {
        let io = &self.0;
        let route = match (src, dst) {
            (Source::File(f, off), Dest::Host(d)) => {
                f.read_exact_at(off, host_prefix_mut("destination", d, len)?)?;
                "pread"
            }
            (Source::Host(s), Dest::File(f, off)) => {
                f.write_all_at(off, host_prefix("source", s, len)?)?;
                "pwrite"
            }
            (Source::File(f, off), Dest::Device(d, doff)) => {
                return Ok(Outcome {
                    bytes: len,
                    engine: EngineKind::LocalIo,
                    route: format!("read: {}", io.read_to_device(f, off, d, doff, len)?),
                });
            }
            (Source::Device(s, soff), Dest::File(f, off)) => {
                let t = io.write_from_device(s, soff, f, off, len, Durability::None)?;
                return Ok(Outcome {
                    bytes: len,
                    engine: EngineKind::LocalIo,
                    route: format!("write: {t}"),
                });
            }
            (Source::File(sf, soff), Dest::File(df, doff)) => {
                let overlap = soff < doff.saturating_add(len as u64)
                    && doff < soff.saturating_add(len as u64);
                if overlap && sf.same_inode(df)? {
                    return Err(CoreError::InvalidRequest(format!(
                        "copy within {} with overlapping ranges {soff}+{len} and {doff}+{len}",
                        sf.path().display()
                    )));
                }
                let chunk = io.config().chunk_size.min(len.max(1));
                let mut buf = HostBuffer::alloc(chunk, &HostAllocOptions::default())?;
                let mut done = 0;
                while done < len {
                    let n = chunk.min(len - done);
                    sf.read_exact_at(soff + done as u64, &mut buf[..n])?;
                    df.write_all_at(doff + done as u64, &buf[..n])?;
                    done += n;
                }
                "pread + pwrite through host memory"
            }
            (s, d) => {
                return Err(CoreError::InvalidRequest(format!(
                    "LocalIO does not move {:?} to {:?}",
                    s.kind(),
                    d.kind()
                )));
            }
        };
        Ok(Outcome {
            bytes: len,
            engine: EngineKind::LocalIo,
            route: route.into(),
        })
    }
}

/// Bytes per staging buffer of a RemoteIO transfer between another node and GPU memory or a
/// file.
const REMOTE_STAGE: usize = 8 << 20;

/// RemoteIO as an [`Engine`]. Host memory is read into and written from directly (the peer
/// stripes it over its connections; over RDMA, the memory is registered through a
/// [`RegistrationCache`](crate::regcache::RegistrationCache) and the NIC moves it in place);
/// GPU memory and files go through two pinned staging buffers, so that the network moves one
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

/// Where staged bytes come from or go to, on this node.
enum Local<'a> {
    Device(&'a DeviceBuffer, usize),
    File(&'a FileHandle, u64),
    Remote(&'a RemoteResource, u64),
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

    /// Reads `len` bytes of `remote` at `roff` into `mem` at `offset`.
    pub fn read_to_host(
        &self,
        remote: &RemoteResource,
        roff: u64,
        mem: &HostMemory,
        offset: usize,
        len: usize,
    ) -> Result<String> {
        let peer = remote.peer();
        #[cfg(feature = "rdma")]
        if let Some(reg) = self.register(peer, mem, offset, len) {
            let mut g = mem.write();
            let dst = host_prefix_mut("destination", g.get_mut(offset..).unwrap_or_default(), len)?;
            peer.read_registered(remote.export(), roff, reg.handle(), dst)?;
            return Ok(format!(
                "read from {} in place (RDMA-registered)",
                peer.addr()
            ));
        }
        let mut g = mem.write();
        let dst = host_prefix_mut("destination", g.get_mut(offset..).unwrap_or_default(), len)?;
        peer.read(remote.export(), roff, dst)?;
        Ok(format!("read from {}", peer.addr()))
    }

    /// Writes `len` bytes of `mem` at `offset` to `remote` at `roff`.
    pub fn write_from_host(
        &self,
        mem: &HostMemory,
        offset: usize,
        remote: &RemoteResource,
        roff: u64,
        len: usize,
    ) -> Result<String> {
        let peer = remote.peer();
        #[cfg(feature = "rdma")]
        if let Some(reg) = self.register(peer, mem, offset, len) {
            let g = mem.read();
            let src = host_prefix("source", g.get(offset..).unwrap_or_default(), len)?;
            peer.write_registered(remote.export(), roff, reg.handle(), src)?;
            return Ok(format!(
                "write to {} in place (RDMA-registered)",
                peer.addr()
            ));
        }
        let g = mem.read();
        let src = host_prefix("source", g.get(offset..).unwrap_or_default(), len)?;
        peer.write(remote.export(), roff, src)?;
        Ok(format!("write to {}", peer.addr()))
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
    ) -> Option<crate::regcache::Registered<gpuio_hal::rdma::HostRegion>> {
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
    fn staged(&self, from: Local<'_>, to: Local<'_>, len: usize) -> Result<()> {
        let (full_tx, full_rx) = crossbeam_channel::bounded::<(usize, usize, HostMemory)>(1);
        let fill = |at: usize, stage: &HostMemory, n: usize| -> Result<()> {
            match &from {
                Local::Remote(r, off) => self
                    .read_to_host(r, off + at as u64, stage, 0, n)
                    .map(|_| ()),
                Local::Device(d, off) => self
                    .memio
                    .download(d, off + at, &mut stage.write()[..n])
                    .map(|_| ())
                    .map_err(CoreError::from),
                Local::File(f, off) => {
                    Ok(f.read_exact_at(off + at as u64, &mut stage.write()[..n])?)
                }
            }
        };
        let drain = |at: usize, stage: &HostMemory, n: usize| -> Result<()> {
            match &to {
                Local::Remote(r, off) => self
                    .write_from_host(stage, 0, r, off + at as u64, n)
                    .map(|_| ()),
                Local::Device(d, off) => self
                    .memio
                    .upload(&stage.read()[..n], d, off + at)
                    .map(|_| ())
                    .map_err(CoreError::from),
                Local::File(f, off) => Ok(f.write_all_at(off + at as u64, &stage.read()[..n])?),
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
    fn kind(&self) -> EngineKind {
        EngineKind::RemoteIo
    }

    fn transfer(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome> {
        let route = match (src, dst) {
            (Source::Remote(r, off), Dest::Host(d)) => {
                r.peer()
                    .read(r.export(), off, host_prefix_mut("destination", d, len)?)?;
                format!("read from {}", r.peer().addr())
            }
            (Source::Host(s), Dest::Remote(r, off)) => {
                r.peer()
                    .write(r.export(), off, host_prefix("source", s, len)?)?;
                format!("write to {}", r.peer().addr())
            }
            (Source::Remote(r, roff), d) => {
                let to = match d {
                    Dest::Device(d, off) => {
                        check_range("destination", off, len, d.len())?;
                        Local::Device(d, off)
                    }
                    Dest::File(f, off) => Local::File(f, off),
                    Dest::Remote(r, off) => Local::Remote(r, off),
                    Dest::Host(_) => return Err(CoreError::Internal("unreachable".into())),
                };
                self.staged(Local::Remote(r, roff), to, len)?;
                format!("read from {} staged through pinned memory", r.peer().addr())
            }
            (s, Dest::Remote(r, roff)) => {
                let from = match s {
                    Source::Device(d, off) => {
                        check_range("source", off, len, d.len())?;
                        Local::Device(d, off)
                    }
                    Source::File(f, off) => Local::File(f, off),
                    Source::Remote(..) | Source::Host(_) => {
                        return Err(CoreError::Internal("unreachable".into()));
                    }
                };
                self.staged(from, Local::Remote(r, roff), len)?;
                format!("write to {} staged through pinned memory", r.peer().addr())
            }
            (s, d) => {
                return Err(CoreError::InvalidRequest(format!(
                    "RemoteIO does not move {:?} to {:?}",
                    s.kind(),
                    d.kind()
                )));
            }
        };
        Ok(Outcome {
            bytes: len,
            engine: EngineKind::RemoteIo,
            route,
        })
    }
}

/// The transport manager: one engine per transport this build has, and the routing between
/// them.
#[derive(Debug, Clone)]
pub struct Engines {
    memio: Arc<MemIoEngine>,
    localio: Arc<LocalIoEngine>,
    remoteio: Arc<RemoteIoEngine>,
    tracker: ResourceTracker,
}

impl Engines {
    /// Engines over these transports (RemoteIO has no state of its own but its staging
    /// buffers: its peers travel with the endpoints).
    pub fn new(memio: Arc<MemIo>, localio: Arc<LocalIo>) -> Self {
        Self {
            remoteio: Arc::new(RemoteIoEngine::new(memio.clone())),
            memio: Arc::new(MemIoEngine(memio)),
            localio: Arc::new(LocalIoEngine(localio)),
            tracker: ResourceTracker::default(),
        }
    }

    /// The resource tracker the transfers report their load to.
    pub fn tracker(&self) -> &ResourceTracker {
        &self.tracker
    }

    /// The MemIO transport.
    pub fn memio(&self) -> &Arc<MemIo> {
        &self.memio.0
    }

    /// The LocalIO transport.
    pub fn localio(&self) -> &Arc<LocalIo> {
        &self.localio.0
    }

    /// The RemoteIO engine.
    pub fn remoteio(&self) -> &Arc<RemoteIoEngine> {
        &self.remoteio
    }

    /// The engine of a kind.
    pub fn engine(&self, kind: EngineKind) -> Result<&dyn Engine> {
        match kind {
            EngineKind::MemIo => Ok(self.memio.as_ref()),
            EngineKind::LocalIo => Ok(self.localio.as_ref()),
            EngineKind::RemoteIo => Ok(self.remoteio.as_ref()),
        }
    }

    /// A blocking transfer between borrowed endpoints, on the engine that serves them.
    pub fn transfer(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome> {
        let kind = route(src.kind(), dst.kind())?;
        self.engine(kind)?.transfer(src, dst, len)
    }

    /// Carries out an owned transfer (what a queued [`Request`] holds). Host memory is
    /// locked for the duration: shared for a source, exclusive for a destination; one buffer on
    /// both sides takes one exclusive lock; two buffers are locked in a global order, so that
    /// transfers in opposite directions cannot deadlock.
    pub fn execute(
        &self,
        src: &Endpoint,
        dst: &Endpoint,
        len: usize,
        durable: bool,
    ) -> Result<Outcome> {
        let engine = self.engine(route(src.kind(), dst.kind())?)?;
        let host = |g: &[u8], off: usize, what| -> Result<()> {
            check_range(what, off, len, g.len())?;
            Ok(())
        };
        let outcome = match (src, dst) {
            (
                Endpoint::Host { mem: a, offset: so },
                Endpoint::Host {
                    mem: b,
                    offset: doff,
                },
            ) if a.id() == b.id() => {
                let mut buf = a.write();
                host(&buf, *so, "source")?;
                host(&buf, *doff, "destination")?;
                buf.copy_within(*so..*so + len, *doff);
                Outcome {
                    bytes: len,
                    engine: EngineKind::MemIo,
                    route: "move within one host buffer".into(),
                }
            }
            (
                Endpoint::Host { mem: a, offset: so },
                Endpoint::Host {
                    mem: b,
                    offset: doff,
                },
            ) => {
                let (r, mut w) = if a.id() < b.id() {
                    let r = a.read();
                    (r, b.write())
                } else {
                    let w = b.write();
                    (a.read(), w)
                };
                host(&r, *so, "source")?;
                host(&w, *doff, "destination")?;
                engine.transfer(Source::Host(&r[*so..]), Dest::Host(&mut w[*doff..]), len)?
            }
            (Endpoint::Remote { res, offset: roff }, Endpoint::Host { mem, offset }) => Outcome {
                bytes: len,
                engine: EngineKind::RemoteIo,
                route: self.remoteio.read_to_host(res, *roff, mem, *offset, len)?,
            },
            (Endpoint::Host { mem, offset }, Endpoint::Remote { res, offset: roff }) => Outcome {
                bytes: len,
                engine: EngineKind::RemoteIo,
                route: self
                    .remoteio
                    .write_from_host(mem, *offset, res, *roff, len)?,
            },
            (Endpoint::Host { mem, offset }, other) => {
                let g = mem.read();
                host(&g, *offset, "source")?;
                engine.transfer(
                    Source::Host(&g[*offset..]),
                    storage_or_device_dest(other)?,
                    len,
                )?
            }
            (other, Endpoint::Host { mem, offset }) => {
                let mut g = mem.write();
                host(&g, *offset, "destination")?;
                engine.transfer(
                    storage_or_device_source(other)?,
                    Dest::Host(&mut g[*offset..]),
                    len,
                )?
            }
            (s, d) => engine.transfer(
                storage_or_device_source(s)?,
                storage_or_device_dest(d)?,
                len,
            )?,
        };
        if durable && let Endpoint::File { file, .. } = dst {
            file.sync_data()?;
        }
        Ok(outcome)
    }

    /// The fault-tolerant transfer: tries the sources (replicas of the same bytes) least
    /// loaded first, each with the retry policy (no retry starting after `until`); a source
    /// that still fails is left for the next (a short or damaged replica fails over too), and
    /// the last error is returned. With one source this is the retried transfer alone.
    #[allow(clippy::too_many_arguments)]
    pub fn execute_any(
        &self,
        sources: &[Endpoint],
        dst: &Endpoint,
        len: usize,
        policy: &RetryPolicy,
        until: Option<Instant>,
        on_retry: &mut dyn FnMut(),
        on_failover: &mut dyn FnMut(),
    ) -> Result<Outcome> {
        if let [src] = sources {
            return policy.run_until(until, &mut *on_retry, || self.execute(src, dst, len, false));
        }
        let names: Vec<String> = sources.iter().map(|s| s.resource_name()).collect();
        let mut order: Vec<usize> = (0..sources.len()).collect();
        order.sort_by_key(|&i| self.tracker.load(&names[i]).bytes);
        let mut last = None;
        for (n, &i) in order.iter().enumerate() {
            if n > 0 {
                on_failover();
            }
            let _load = self.tracker.begin(names[i].clone(), len as u64);
            let r = policy.run_until(until, &mut *on_retry, || {
                self.execute(&sources[i], dst, len, false)
            });
            match r {
                Ok(mut o) => {
                    if n > 0 {
                        o.route = format!("{} (failover to {})", o.route, sources[i]);
                    }
                    return Ok(o);
                }
                Err(e) => {
                    tracing::warn!(source = %sources[i], error = %e, "source failed");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| CoreError::InvalidRequest("no source".into())))
    }

    /// Carries out a request's transfer (status changes are the scheduler's business).
    pub fn execute_request(&self, req: &Request) -> Result<Outcome> {
        self.execute(&req.src, &req.dst, req.len, req.flags.durable)
    }
}

fn storage_or_device_source(e: &Endpoint) -> Result<Source<'_>> {
    match e {
        Endpoint::Device { buf, offset } => Ok(Source::Device(buf, *offset)),
        Endpoint::File { file, offset } => Ok(Source::File(file, *offset)),
        Endpoint::Remote { res, offset } => Ok(Source::Remote(res, *offset)),
        Endpoint::Host { .. } => Err(CoreError::Internal("host source taken unlocked".into())),
    }
}

fn storage_or_device_dest(e: &Endpoint) -> Result<Dest<'_>> {
    match e {
        Endpoint::Device { buf, offset } => Ok(Dest::Device(buf, *offset)),
        Endpoint::File { file, offset } => Ok(Dest::File(file, *offset)),
        Endpoint::Remote { res, offset } => Ok(Dest::Remote(res, *offset)),
        Endpoint::Host { .. } => Err(CoreError::Internal(
            "host destination taken unlocked".into(),
        )),
    }
}
