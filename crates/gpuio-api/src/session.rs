//! The session: configuration, devices, engines and the dispatcher in one handle, and the
//! explicit API (docs/REFERENCE.md#explicit-api) — blocking, asynchronous (futures, callbacks) and
//! batched.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::uri::Uri;
use crate::uri::{RemoteTarget, RemoteTransport};
use gpuio_core::ondemand::{PageCache, PageCacheConfig};
use gpuio_core::{
    BatchHandle, Completion, Dest, Endpoint, Engines, HostMemory, Lease, Lessor, Outcome, Priority,
    RemoteResource, Request, RequestHandle, Scheduler, Source, Ticket,
};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{DeviceBuffer, Gpu, Probe};
use gpuio_staging::StagingPool;
use gpuio_transport_localio::{FileHandle, LocalIo, NvmeDevice, OpenOptions};
use gpuio_transport_memio::{HostPlacement, MemIo};
#[cfg(feature = "registry")]
use gpuio_transport_remoteio::Registry;
use gpuio_transport_remoteio::{RemotePeer, SegmentMember};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
#[cfg(feature = "registry")]
use std::sync::OnceLock;

/// Why segment names cannot be resolved, in a build without the etcd registry.
pub const REGISTRY_ABSENT: &str = "this build has no etcd registry (cargo feature `registry`, \
                                   whose build needs protoc and protobuf's .proto files)";

/// A resource a URI names, opened or allocated.
#[derive(Debug, Clone)]
pub enum Resource {
    /// GPU memory.
    Device(DeviceBuffer),
    /// Host memory (DRAM or CXL).
    Host(HostMemory),
    /// A file or block device.
    File(FileHandle),
    /// An export of other nodes: one agent's, or every replica a registry segment names (in
    /// the registry's order; reads fail over among them, writes go to all).
    Remote(Vec<RemoteResource>),
}

impl Resource {
    /// The resource at `offset`, as a transfer endpoint.
    pub fn at(&self, offset: u64) -> Result<Endpoint> {
        let small = || {
            usize::try_from(offset)
                .map_err(|_| Error::Invalid(format!("offset {offset} too large")))
        };
        Ok(match self {
            Self::Device(b) => Endpoint::device(b, small()?),
            Self::Host(m) => Endpoint::host(m, small()?),
            Self::File(f) => Endpoint::file(f, offset),
            Self::Remote(replicas) => Endpoint::remote(first(replicas)?, offset),
        })
    }

    /// Every copy of the resource at `offset`: the replicas of a remote segment, or the one
    /// endpoint of anything else. Reads may use any; writes must reach all.
    pub fn replicas_at(&self, offset: u64) -> Result<Vec<Endpoint>> {
        match self {
            Self::Remote(replicas) => Ok(replicas
                .iter()
                .map(|r| Endpoint::remote(r, offset))
                .collect()),
            other => Ok(vec![other.at(offset)?]),
        }
    }

    /// Its length in bytes (a file's current size; a remote export's size from the first
    /// replica that answers).
    pub fn len(&self) -> Result<u64> {
        Ok(match self {
            Self::Device(b) => b.len() as u64,
            Self::Host(m) => m.len() as u64,
            Self::File(f) => f.len()?,
            Self::Remote(replicas) => {
                let mut last = None;
                for r in replicas {
                    match r.peer().stat(r.export()) {
                        Ok(info) => return Ok(info.size),
                        Err(e) => last = Some(e),
                    }
                }
                return Err(last.map_or_else(no_replica, Error::from));
            }
        })
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

fn no_replica() -> Error {
    Error::Invalid("a remote resource with no replica".into())
}

fn first(replicas: &[RemoteResource]) -> Result<&RemoteResource> {
    replicas.first().ok_or_else(no_replica)
}

/// The connection manager: one pooled peer per agent address (and transport), connected on first use and
/// shared by every resource on that agent; the registry, connected on first use.
#[derive(Debug, Default)]
struct RemotePeers {
    /// Keyed by address and whether memory exports go over RDMA.
    peers: Mutex<HashMap<(SocketAddr, RemoteTransport), Arc<RemotePeer>>>,
    #[cfg(feature = "registry")]
    registry: OnceLock<Arc<Registry>>,
}

/// Whether a resource is opened for reading or writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read only; files must exist.
    Read,
    /// Write; files are created or truncated.
    Write,
    /// Read and write in place; files must exist and keep their bytes (a read-write
    /// on-demand array's source, say).
    Update,
}

/// A gpuio session. Thread-safe: share it behind an `Arc`.
///
/// ```
/// use gpuio_api::{Config, Session};
/// let session = Session::new(Config::default()).unwrap();
/// let dev = session.alloc_device(0, 1 << 20).unwrap();
/// let data = vec![7u8; 1 << 20];
/// session.upload(&data, &dev, 0).unwrap();
/// let mut back = vec![0u8; 1 << 20];
/// session.download(&dev, 0, &mut back).unwrap();
/// assert_eq!(back, data);
/// ```
#[derive(Debug)]
pub struct Session {
    config: Config,
    probe: Probe,
    engines: Engines,
    scheduler: Scheduler,
    remote: RemotePeers,
    /// The process that opened it, in its line of forks ([`Session::check_process`]).
    generation: u64,
}

impl Session {
    /// Opens a session: probes devices (per `config.backend`), makes the staging pool MemIO
    /// and LocalIO share (`memory_pool_size`; it publishes its counters as metrics) and starts
    /// the engines and the scheduler's workers.
    pub fn new(config: Config) -> Result<Self> {
        let started = std::time::Instant::now();
        let generation = gpuio_hal::sys::fork_generation();
        let mut probe = gpuio_hal::probe_with(config.backend, config.host_devices)?;
        if config.max_gpus > 0 {
            probe.gpus.truncate(config.max_gpus as usize);
        }
        let probe_ms = started.elapsed().as_secs_f64() * 1e3;
        let staging = StagingPool::with_observer(
            config.pool_config(probe.gpus.first().cloned()),
            gpuio_core::metrics::pool_observer(),
        )?;
        let memio = MemIo::with_pool(probe.gpus.clone(), config.memio_config(), staging.clone())?;
        let localio = LocalIo::with_pool(config.localio_config(), staging)?;
        let engines = Engines::new(Arc::new(memio), Arc::new(localio));
        let scheduler = Scheduler::new(
            engines.clone(),
            config.scheduler_config(),
            config.retry.clone(),
        )?;
        tracing::debug!(
            gpus = probe.gpus.len(),
            cuda = %probe.cuda.detail,
            probe_ms,
            all_ms = started.elapsed().as_secs_f64() * 1e3,
            "session opened"
        );
        Ok(Self {
            config,
            probe,
            engines,
            scheduler,
            remote: RemotePeers::default(),
            generation,
        })
    }

    /// Refuses a process forked from the one that opened the session: the session's threads
    /// (its workers, its engines' pools) stayed in the parent, so a call would wait for them
    /// forever. A forked child opens a session of its own. Transfers and submissions check
    /// this themselves; callers that reach the engines directly check it first.
    pub fn check_process(&self) -> Result<()> {
        if gpuio_hal::sys::fork_generation() == self.generation {
            return Ok(());
        }
        Err(Error::Invalid(
            "this session was opened before fork(): its threads stayed in the parent process; \
             open a new session in the child"
                .into(),
        ))
    }

    /// Opens a session on the configuration in effect ([`Config::load`]).
    pub fn from_env() -> Result<Self> {
        Self::new(Config::load(None)?)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// What the device probe found (and why CUDA is unavailable, where it is).
    pub fn probe(&self) -> &Probe {
        &self.probe
    }

    /// The session's GPUs.
    pub fn gpus(&self) -> &[Gpu] {
        &self.probe.gpus
    }

    /// GPU `n`.
    pub fn gpu(&self, n: u32) -> Result<&Gpu> {
        Ok(self.probe.gpu(n)?)
    }

    /// The engines.
    pub fn engines(&self) -> &Engines {
        &self.engines
    }

    /// A page cache of `cfg.capacity` bytes in GPU `gpu`'s memory for on-demand arrays, its
    /// misses and write-backs carried out through this session's engines
    /// (docs/REFERENCE.md#on-demand-arrays). `cache.array::<T>(source, len, mode)` makes the
    /// arrays; their `device()` descriptors go to kernels that include `gpuio_array.cuh`
    /// ([`DEVICE_HEADER`](crate::DEVICE_HEADER) is the headers' text, for a run-time compiler).
    pub fn page_cache(&self, gpu: u32, cfg: PageCacheConfig) -> Result<PageCache> {
        Ok(PageCache::new(self.engines.clone(), self.gpu(gpu)?, cfg)?)
    }

    /// The MemIO transport.
    pub fn memio(&self) -> &MemIo {
        self.engines.memio()
    }

    /// The LocalIO transport.
    pub fn localio(&self) -> &LocalIo {
        self.engines.localio()
    }

    /// The pool of pinned staging memory MemIO's and LocalIO's lanes share
    /// (`memory_pool_size`), with its counters ([`StagingPool::stats`]).
    pub fn staging_pool(&self) -> &StagingPool {
        self.memio().staging_pool()
    }

    /// Allocates `len` bytes on GPU `gpu`.
    pub fn alloc_device(&self, gpu: u32, len: usize) -> Result<DeviceBuffer> {
        Ok(self.gpu(gpu)?.alloc(len)?)
    }

    /// Allocates host memory on a tier, pinned for DMA if asked.
    pub fn alloc_host(
        &self,
        placement: HostPlacement,
        len: usize,
        pinned: bool,
    ) -> Result<HostMemory> {
        Ok(HostMemory::new(
            self.memio().alloc_host(placement, len, pinned)?,
        ))
    }

    /// Opens a file.
    pub fn open_file(&self, path: impl AsRef<Path>, opts: OpenOptions) -> Result<FileHandle> {
        Ok(self.localio().open(path, opts)?)
    }

    /// Opens (files) or allocates `len` bytes of (memory) the resource a URI names.
    pub fn open(&self, uri: &Uri, len: usize, access: Access) -> Result<Resource> {
        match uri {
            Uri::Gpu(n) => Ok(Resource::Device(self.alloc_device(*n, len)?)),
            Uri::Dram { .. } | Uri::Cxl { .. } => {
                let placement = uri
                    .host_placement()
                    .ok_or_else(|| Error::Invalid(format!("{uri} is not host memory")))?;
                Ok(Resource::Host(self.alloc_host(placement, len, true)?))
            }
            Uri::File { path, direct, gds } => {
                let opts = match access {
                    Access::Read => OpenOptions::READ,
                    Access::Write => OpenOptions::CREATE,
                    Access::Update => OpenOptions {
                        write: true,
                        ..OpenOptions::READ
                    },
                };
                let opts = OpenOptions {
                    direct: *direct,
                    gds: *gds,
                    ..opts
                };
                Ok(Resource::File(self.open_file(path, opts)?))
            }
            Uri::Nvme { address, nsid } => {
                let device = NvmeDevice::open(address, *nsid)?;
                Ok(Resource::File(FileHandle::nvme(
                    device,
                    access != Access::Read,
                )))
            }
            Uri::Remote {
                target,
                resource,
                transport,
                gdr,
            } => {
                if *gdr {
                    // What the probe found (device support, nvidia-peermem, an RDMA NIC).
                    // Registering GPU memory with the NIC is not built: no machine this
                    // project runs on has the three, so it could not be tested.
                    let found = match self.gpu(0) {
                        Ok(g) if !g.info().gdr.available => g.info().gdr.detail.clone(),
                        Ok(_) => "registering GPU memory with the NIC is not built yet".into(),
                        Err(e) => e.to_string(),
                    };
                    return Err(Error::Unsupported {
                        what: uri.to_string(),
                        reason: format!(
                            "GPUDirect RDMA: {found}; without gdr=1, GPU memory is staged \
                             through pinned host memory"
                        ),
                    });
                }
                let rdma = *transport == RemoteTransport::Rdma;
                if rdma && !cfg!(feature = "rdma") {
                    return Err(Error::Unsupported {
                        what: uri.to_string(),
                        reason: "this build has no RDMA verbs (cargo feature `rdma`); use \
                                 transport=tcp"
                            .into(),
                    });
                }
                if *transport == RemoteTransport::Nixl && !cfg!(feature = "nixl") {
                    return Err(Error::Unsupported {
                        what: uri.to_string(),
                        reason: "this build has no NIXL (cargo feature `nixl`); use \
                                 transport=tcp"
                            .into(),
                    });
                }
                let addrs = match target {
                    RemoteTarget::Address { host, port } => {
                        let addr = (host.as_str(), *port)
                            .to_socket_addrs()
                            .map_err(|e| Error::Invalid(format!("{uri}: {host}: {e}")))?
                            .next()
                            .ok_or_else(|| {
                                Error::Invalid(format!("{uri}: {host} has no address"))
                            })?;
                        vec![addr]
                    }
                    RemoteTarget::Segment(segment) => {
                        let members = self.resolve_segment(uri, segment)?;
                        if members.is_empty() {
                            return Err(Error::NotFound(format!(
                                "{uri}: no agent serves segment {segment:?}"
                            )));
                        }
                        members.into_iter().map(|m| m.addr).collect()
                    }
                };
                let replicas = addrs
                    .into_iter()
                    .map(|a| {
                        Ok(RemoteResource::new(
                            self.peer(uri, a, *transport)?,
                            resource.clone(),
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Resource::Remote(replicas))
            }
        }
    }

    /// The pooled peer for the agent at `addr` (created on first use).
    fn peer(
        &self,
        uri: &Uri,
        addr: SocketAddr,
        transport: RemoteTransport,
    ) -> Result<Arc<RemotePeer>> {
        let mut peers = self.remote.peers.lock_unpoisoned();
        if let Some(p) = peers.get(&(addr, transport)) {
            return Ok(p.clone());
        }
        let creds = self.config.remote_credentials()?.ok_or_else(|| {
            Error::Invalid(format!(
                "{uri}: RemoteIO needs a key: set [remote] key_id and secret_env or secret_file"
            ))
        })?;
        let peer = Arc::new(RemotePeer::new(
            self.config.peer_config(addr, creds, transport)?,
        ));
        peers.insert((addr, transport), peer.clone());
        Ok(peer)
    }

    /// The agents serving `segment`, from the registry (connected on first use).
    #[cfg(feature = "registry")]
    fn resolve_segment(&self, uri: &Uri, segment: &str) -> Result<Vec<SegmentMember>> {
        let registry = match self.remote.registry.get() {
            Some(r) => r,
            None => {
                let cfg = self.config.registry_config().ok_or_else(|| {
                    Error::Invalid(format!(
                        "{uri}: segment names need a registry: set [remote] registry"
                    ))
                })?;
                let registry = Arc::new(Registry::connect(cfg)?);
                self.remote.registry.get_or_init(|| registry)
            }
        };
        Ok(registry.resolve(segment)?)
    }

    /// Without the registry, a segment name cannot be resolved.
    #[cfg(not(feature = "registry"))]
    fn resolve_segment(&self, uri: &Uri, _segment: &str) -> Result<Vec<SegmentMember>> {
        Err(Error::Unsupported {
            what: uri.to_string(),
            reason: REGISTRY_ABSENT.into(),
        })
    }

    /// Blocking transfer of `len` bytes between borrowed endpoints, on the engine that serves
    /// them.
    pub fn transfer(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome> {
        self.check_process()?;
        Ok(self.engines.transfer(src, dst, len)?)
    }

    /// [`transfer`](Self::transfer) whose written bytes are on stable storage when it returns
    /// (a file: `fdatasync`, its writeback started piece by piece as the bytes land; another
    /// node's export: flushed by its agent; memory: as `transfer`).
    pub fn transfer_durable(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome> {
        self.check_process()?;
        Ok(self.engines.transfer_durable(src, dst, len)?)
    }

    /// Blocking transfer between owned endpoints (host memory locked while it runs).
    pub fn transfer_owned(&self, src: &Endpoint, dst: &Endpoint, len: usize) -> Result<Outcome> {
        self.check_process()?;
        Ok(self.engines.execute(src, dst, len)?)
    }

    /// Copies host memory (pinned or pageable) to GPU memory, blocking.
    pub fn upload(&self, src: &[u8], dst: &DeviceBuffer, dst_offset: usize) -> Result<Outcome> {
        self.transfer(Source::Host(src), Dest::Device(dst, dst_offset), src.len())
    }

    /// Copies GPU memory to host memory, blocking.
    pub fn download(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &mut [u8],
    ) -> Result<Outcome> {
        let len = dst.len();
        self.transfer(Source::Device(src, src_offset), Dest::Host(dst), len)
    }

    /// Queues a request; the handle can be waited on, `.await`ed, or cancelled while queued.
    pub fn submit(&self, req: Request) -> Result<RequestHandle> {
        self.check_process()?;
        Ok(self.scheduler.submit(req)?)
    }

    /// Holds scheduler class `class` for IO this caller runs outside the scheduler's workers
    /// (a device gather, a scatter): less urgent queued requests and leases wait while it is
    /// held, at most the scheduler's `max_wait` ([`Lease`]). The AI tier takes one around each
    /// call, in its work's class. Leases do not nest: a thread that holds one and takes a
    /// less urgent one waits `max_wait` for itself.
    pub fn lease(&self, class: Priority, deadline: Option<std::time::Instant>) -> Lease {
        self.scheduler.lease(class, deadline)
    }

    /// A handle that takes [`lease`](Self::lease)s without the session (kept by the AI tier's
    /// pools and tables).
    pub fn lessor(&self) -> Lessor {
        self.scheduler.lessor()
    }

    /// Queues a transfer between owned endpoints; see [`Session::submit`].
    pub fn transfer_async(
        &self,
        src: Endpoint,
        dst: Endpoint,
        len: usize,
    ) -> Result<RequestHandle> {
        self.submit(Request::new(src, dst, len)?)
    }

    /// Queues a request; `callback` runs on a worker thread with its result.
    pub fn submit_with_callback(
        &self,
        req: Request,
        callback: impl FnOnce(gpuio_core::Result<Completion>) + Send + 'static,
    ) -> Result<Ticket> {
        self.check_process()?;
        Ok(self.scheduler.submit_with(req, callback)?)
    }

    /// The scheduler (sessions for tenants, statistics).
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Queues a batch: sorted, adjacent requests coalesced, grouped by engine
    /// (docs/REFERENCE.md#batches).
    pub fn submit_batch(&self, requests: Vec<Request>) -> Result<BatchHandle> {
        self.check_process()?;
        Ok(self.scheduler.submit_batch(requests)?)
    }
}
