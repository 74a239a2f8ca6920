//! A peer: a pool of pre-authenticated connections to one agent, shared by every thread that
//! talks to it. Small transfers take one connection; large ones are cut into stripes spread
//! over several connections, each pipelined, so one transfer uses several TCP streams (and
//! cores) at once.
//!
//! A connection that fails is dropped, not returned to the pool (nor is an idle one the agent
//! has closed); the next transfer connects afresh, retrying the connect with exponential
//! backoff. A transfer that fails is not retried here: the caller (the core's retry policy
//! and replica failover) decides.
//!
//! Transfers name a [`RemoteExport`], which remembers the agent instance it first met: a
//! transfer whose connections reach another instance (the agent was restarted, and its memory
//! exports started afresh) fails with [`RemoteIoError::Restarted`] before it moves a byte
//! through them, so no transfer ever mixes two instances' bytes.

use crate::connection::{Connection, Credentials, ExportInfo, split, split_mut};
use crate::tls::TlsClient;
use crate::{RemoteIoError, Result};
use gpuio_hal::SharedHostBuffer;
use gpuio_hal::sync::MutexExt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How a peer connects and stripes.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// The agent's address.
    pub addr: SocketAddr,
    /// The key to present.
    pub credentials: Credentials,
    /// Connections one transfer may stripe over, and idle connections kept for reuse.
    pub connections: usize,
    /// Bytes per stripe (and per message) of a large transfer; transfers up to this size use
    /// one connection.
    pub stripe_bytes: usize,
    /// Bound on a connect and on every wait for the agent.
    pub timeout: Duration,
    /// Connect attempts before a transfer fails (with backoff between them).
    pub connect_attempts: u32,
    /// The first backoff; it doubles per attempt up to one second.
    pub backoff: Duration,
    /// TLS: the CA certificates to trust (`None`: plain TCP).
    pub tls: Option<TlsClient>,
    /// The agent's name as its certificate has it (`None`: its IP address).
    pub server_name: Option<String>,
    /// RDMA: memory exports are read and written over RDMA verbs through this device (files,
    /// which RDMA cannot reach, still go over TCP). `None`: TCP only.
    #[cfg(feature = "rdma")]
    pub rdma: Option<crate::rdma::RdmaOptions>,
    /// NIXL: memory exports that the agent offers over NIXL (those this key may write) move
    /// with NIXL one-sided transfers; the rest go over TCP. `false`: TCP only.
    #[cfg(feature = "nixl")]
    pub nixl: bool,
}

impl PeerConfig {
    /// Defaults for an agent at `addr`: 4 connections, 1 MiB stripes, 10 s timeout, 3 connect
    /// attempts from 20 ms backoff.
    pub fn new(addr: SocketAddr, credentials: Credentials) -> Self {
        Self {
            addr,
            credentials,
            connections: 4,
            stripe_bytes: 1 << 20,
            timeout: Duration::from_secs(10),
            connect_attempts: 3,
            backoff: Duration::from_millis(20),
            tls: None,
            server_name: None,
            #[cfg(feature = "rdma")]
            rdma: None,
            #[cfg(feature = "nixl")]
            nixl: false,
        }
    }
}

/// What a peer has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerStats {
    /// Connections opened (including reconnections).
    pub connects: u64,
    /// Connections dropped after a failure.
    pub broken: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
}

/// An export of one agent as transfers see it: its name and, from its first use on, what the
/// agent instance serving it said of it (instance, size, capacity). Every transfer through it
/// checks each connection against that instance; once the agent has restarted, transfers
/// fail with [`RemoteIoError::Restarted`] until a new `RemoteExport` is made (which meets the
/// new instance). Share it between threads freely.
#[derive(Debug)]
pub struct RemoteExport {
    name: String,
    pinned: OnceLock<ExportInfo>,
}

impl RemoteExport {
    /// Export `name`, not yet met.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            pinned: OnceLock::new(),
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the agent said of it at first use (`None` before).
    pub fn pinned(&self) -> Option<ExportInfo> {
        self.pinned.get().copied()
    }
}

/// A pool of connections to one agent. Thread-safe.
#[derive(Debug)]
pub struct RemotePeer {
    cfg: PeerConfig,
    idle: Mutex<Vec<Connection>>,
    #[cfg(feature = "rdma")]
    rdma: crate::rdma::ChannelPool,
    #[cfg(feature = "nixl")]
    pub(crate) nixl: crate::nixl::ChannelPool,
    connects: AtomicU64,
    broken: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
}

impl RemotePeer {
    /// A peer; nothing connects until the first transfer (or [`connect`](Self::connect)).
    pub fn new(cfg: PeerConfig) -> Self {
        Self {
            cfg,
            idle: Mutex::new(Vec::new()),
            #[cfg(feature = "rdma")]
            rdma: crate::rdma::ChannelPool::default(),
            #[cfg(feature = "nixl")]
            nixl: crate::nixl::ChannelPool::default(),
            connects: AtomicU64::new(0),
            broken: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
        }
    }

    /// A peer with one connection opened now, so that a wrong address or key fails here.
    pub fn connect(cfg: PeerConfig) -> Result<Self> {
        let peer = Self::new(cfg);
        let c = peer.checkout()?;
        peer.checkin(c);
        Ok(peer)
    }

    /// Its configuration.
    pub fn config(&self) -> &PeerConfig {
        &self.cfg
    }

    /// The agent's address.
    pub fn addr(&self) -> SocketAddr {
        self.cfg.addr
    }

    /// What it has done so far.
    pub fn stats(&self) -> PeerStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PeerStats {
            connects: get(&self.connects),
            broken: get(&self.broken),
            bytes_read: get(&self.bytes_read),
            bytes_written: get(&self.bytes_written),
        }
    }

    /// The size of `export` and whether this session may write it, asked now (and the
    /// instance pinned, on first use).
    pub fn stat(&self, export: &RemoteExport) -> Result<ExportInfo> {
        let mut c = self.checkout()?;
        let r = c.stat(&export.name).and_then(|info| {
            let pinned = *export.pinned.get_or_init(|| info);
            self.same_instance(export, &pinned, info.instance)?;
            Ok(info)
        });
        self.checkin(c);
        r
    }

    /// What `export`'s agent instance said of it, asked on its first use.
    pub(crate) fn pin(&self, export: &RemoteExport) -> Result<ExportInfo> {
        match export.pinned.get() {
            Some(info) => Ok(*info),
            None => self.stat(export),
        }
    }

    /// Fails with [`RemoteIoError::Restarted`] where `instance` is not the one `export` met.
    fn same_instance(
        &self,
        export: &RemoteExport,
        pinned: &ExportInfo,
        instance: u64,
    ) -> Result<()> {
        if pinned.instance == instance {
            return Ok(());
        }
        Err(RemoteIoError::Restarted {
            agent: self.cfg.addr,
            export: export.name.clone(),
            was: pinned.instance,
            now: instance,
        })
    }

    /// A connection for a transfer on `export`: pooled or new, and to the instance it met.
    fn checkout_for(&self, export: &RemoteExport, pinned: &ExportInfo) -> Result<Connection> {
        self.for_instance(export, pinned, self.checkout()?)
    }

    /// `c`, if it reached the instance `export` met.
    fn for_instance(
        &self,
        export: &RemoteExport,
        pinned: &ExportInfo,
        c: Connection,
    ) -> Result<Connection> {
        match self.same_instance(export, pinned, c.instance()) {
            Ok(()) => Ok(c),
            Err(e) => {
                // Still a good connection, to the agent as it is now.
                self.checkin(c);
                Err(e)
            }
        }
    }

    /// Reads `buf.len()` bytes of `export` at `offset`: over RDMA where configured and the
    /// export is memory, else striped over the pool's TCP connections.
    pub fn read(&self, export: &RemoteExport, offset: u64, buf: &mut [u8]) -> Result<()> {
        let pinned = self.pin(export)?;
        #[cfg(feature = "rdma")]
        if let Some(done) = self.over_rdma(export, &pinned, |ch| ch.read(offset, buf)) {
            done?;
            self.bytes_read
                .fetch_add(buf.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
        #[cfg(feature = "nixl")]
        if let Some(done) = self.nixl_striped(
            export,
            &pinned,
            stripes_mut(offset, buf, self.lanes(buf.len())),
            |ch, at, b| ch.read(at, b),
            |c, at, b| c.read(export.name(), at, b, self.cfg.stripe_bytes),
        ) {
            done?;
            self.bytes_read
                .fetch_add(buf.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
        let stripe = self.cfg.stripe_bytes;
        let lanes = self.lanes(buf.len());
        let len = buf.len() as u64;
        let name = export.name();
        if lanes == 1 {
            self.with_connection(export, &pinned, |c| c.read(name, offset, buf, stripe))?;
        } else {
            let mut shares: Vec<Vec<_>> = (0..lanes).map(|_| Vec::new()).collect();
            for (i, piece) in split_mut(offset, buf, stripe)?.into_iter().enumerate() {
                shares[i % lanes].push(piece);
            }
            self.in_parallel(export, &pinned, shares, |c, share| {
                c.read_pieces(name, share)
            })?;
        }
        self.bytes_read.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Writes `data` to `export` at `offset`: over RDMA where configured and the export is
    /// memory, else striped over the pool's TCP connections. A write that the export cannot
    /// take whole (past its capacity, or not writable) is refused before any byte is sent.
    pub fn write(&self, export: &RemoteExport, offset: u64, data: &[u8]) -> Result<()> {
        let pinned = self.pin(export)?;
        check_write(export, &pinned, offset, data.len())?;
        #[cfg(feature = "rdma")]
        if let Some(done) = self.over_rdma(export, &pinned, |ch| ch.write(offset, data)) {
            done?;
            self.bytes_written
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
        #[cfg(feature = "nixl")]
        if let Some(done) = self.nixl_striped(
            export,
            &pinned,
            stripes(offset, data, self.lanes(data.len())),
            |ch, at, b| ch.write(at, b),
            |c, at, b| c.write(export.name(), at, b, self.cfg.stripe_bytes),
        ) {
            done?;
            self.bytes_written
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            return Ok(());
        }
        let stripe = self.cfg.stripe_bytes;
        let lanes = self.lanes(data.len());
        let name = export.name();
        if lanes == 1 {
            self.with_connection(export, &pinned, |c| c.write(name, offset, data, stripe))?;
        } else {
            let mut shares: Vec<Vec<_>> = (0..lanes).map(|_| Vec::new()).collect();
            for (i, piece) in split(offset, data, stripe)?.into_iter().enumerate() {
                shares[i % lanes].push(piece);
            }
            self.in_parallel(export, &pinned, shares, |c, share| {
                c.write_pieces(name, share)
            })?;
        }
        self.bytes_written
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Reads `len` bytes of `export` at `offset` into `at..at+len` of the shared buffer `mem`
    /// (holding that range's write guard meanwhile). Over NIXL they land in place and the
    /// channels keep `mem`'s buffer registered, so later transfers into it cost no
    /// registration; otherwise as [`read`](Self::read).
    pub fn read_memory(
        &self,
        export: &RemoteExport,
        offset: u64,
        mem: &SharedHostBuffer,
        at: usize,
        len: usize,
    ) -> Result<()> {
        let mut guard = mem.write_range(at, len)?;
        #[cfg(feature = "nixl")]
        if self.kept_over_nixl(export, len) {
            let (whole, pinned) = (guard.buffer(), self.pin(export)?);
            if let Some(done) = self.nixl_striped(
                export,
                &pinned,
                stripes_mut(offset, &mut guard, self.lanes(len)),
                |ch, o, b| ch.read_kept(o, &whole, b),
                |c, o, b| c.read(export.name(), o, b, self.cfg.stripe_bytes),
            ) {
                done?;
                self.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
                return Ok(());
            }
        }
        self.read(export, offset, &mut guard)
    }

    /// Writes `at..at+len` of the shared buffer `mem` to `export` at `offset` (holding that
    /// range's read guard meanwhile), as [`read_memory`](Self::read_memory) reads.
    pub fn write_memory(
        &self,
        export: &RemoteExport,
        offset: u64,
        mem: &SharedHostBuffer,
        at: usize,
        len: usize,
    ) -> Result<()> {
        let guard = mem.read_range(at, len)?;
        #[cfg(feature = "nixl")]
        if self.kept_over_nixl(export, len) {
            let (whole, pinned) = (guard.buffer(), self.pin(export)?);
            check_write(export, &pinned, offset, len)?;
            if let Some(done) = self.nixl_striped(
                export,
                &pinned,
                stripes(offset, &guard, self.lanes(len)),
                |ch, o, b| ch.write_kept(o, &whole, b),
                |c, o, b| c.write(export.name(), o, b, self.cfg.stripe_bytes),
            ) {
                done?;
                self.bytes_written.fetch_add(len as u64, Ordering::Relaxed);
                return Ok(());
            }
        }
        self.write(export, offset, &guard)
    }

    /// Whether [`read_memory`](Self::read_memory) tries NIXL for `len` bytes of `export`
    /// (RDMA, where configured, goes first, as in [`read`](Self::read)).
    #[cfg(feature = "nixl")]
    fn kept_over_nixl(&self, export: &RemoteExport, len: usize) -> bool {
        #[cfg(feature = "rdma")]
        if self.cfg.rdma.is_some() {
            return false;
        }
        len > 0 && self.cfg.nixl && self.nixl.may_serve(export.name())
    }

    /// Makes what was written to `export` durable: the agent `fdatasync`s a file export.
    /// Refused (`Unsupported`) for memory, which starts afresh when the agent restarts.
    pub fn sync(&self, export: &RemoteExport) -> Result<()> {
        let pinned = self.pin(export)?;
        self.with_connection(export, &pinned, |c| c.sync(export.name()))
    }

    /// Reserves room for the first `len` bytes of `export` before writing them (the agent
    /// allocates a file export's blocks), so that a copy its disk cannot hold is refused
    /// before anything is overwritten.
    pub fn reserve(&self, export: &RemoteExport, len: u64) -> Result<()> {
        let pinned = self.pin(export)?;
        self.with_connection(export, &pinned, |c| c.reserve(export.name(), len))
    }

    /// The RDMA device this peer's channels use (opened now if need be); `None` for a TCP
    /// peer. Memory registered with it ([`HostRegion`](gpuio_rdma::HostRegion)) can be
    /// read into and written from in place.
    #[cfg(feature = "rdma")]
    pub fn rdma_device(&self) -> Option<Result<std::sync::Arc<gpuio_rdma::RdmaDevice>>> {
        let opts = self.cfg.rdma.as_ref()?;
        Some(self.rdma.device(opts))
    }

    /// [`read`](Self::read) into `buf`, which lies in `region` (registered with
    /// [`rdma_device`](Self::rdma_device)): RDMA reads land in place, with no staging copy.
    /// Exports RDMA cannot reach are read over TCP as usual.
    #[cfg(feature = "rdma")]
    pub fn read_registered(
        &self,
        export: &RemoteExport,
        offset: u64,
        region: &gpuio_rdma::HostRegion,
        buf: &mut [u8],
    ) -> Result<()> {
        let pinned = self.pin(export)?;
        match self.over_rdma(export, &pinned, |ch| ch.read_into(offset, region, buf)) {
            Some(done) => {
                done?;
                self.bytes_read
                    .fetch_add(buf.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            None => self.read(export, offset, buf),
        }
    }

    /// [`write`](Self::write) from `data`, which lies in `region`: RDMA writes go out of it in
    /// place.
    #[cfg(feature = "rdma")]
    pub fn write_registered(
        &self,
        export: &RemoteExport,
        offset: u64,
        region: &gpuio_rdma::HostRegion,
        data: &[u8],
    ) -> Result<()> {
        let pinned = self.pin(export)?;
        check_write(export, &pinned, offset, data.len())?;
        match self.over_rdma(export, &pinned, |ch| ch.write_from(offset, region, data)) {
            Some(done) => {
                done?;
                self.bytes_written
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                Ok(())
            }
            None => self.write(export, offset, data),
        }
    }

    /// Atomic compare-and-swap of the 8-byte word of `export` at `offset` (RDMA only): if it
    /// holds `expect` it becomes `swap`; returns the word it held.
    #[cfg(feature = "rdma")]
    pub fn compare_swap(
        &self,
        export: &RemoteExport,
        offset: u64,
        expect: u64,
        swap: u64,
    ) -> Result<u64> {
        let pinned = self.pin(export)?;
        self.over_rdma(export, &pinned, |ch| ch.compare_swap(offset, expect, swap))
            .unwrap_or_else(|| Err(no_atomics(export.name())))
    }

    /// Atomic fetch-and-add on the 8-byte word of `export` at `offset` (RDMA only); returns
    /// the word it held.
    #[cfg(feature = "rdma")]
    pub fn fetch_add(&self, export: &RemoteExport, offset: u64, add: u64) -> Result<u64> {
        let pinned = self.pin(export)?;
        self.over_rdma(export, &pinned, |ch| ch.fetch_add(offset, add))
            .unwrap_or_else(|| Err(no_atomics(export.name())))
    }

    /// Runs `f` on a pooled RDMA channel to `export` (to the instance it met); `None` where
    /// the peer has no RDMA or the export cannot be reached over it (a file export: TCP
    /// serves it).
    #[cfg(feature = "rdma")]
    fn over_rdma<T>(
        &self,
        export: &RemoteExport,
        pinned: &ExportInfo,
        f: impl FnOnce(&mut crate::rdma::RdmaChannel) -> Result<T>,
    ) -> Option<Result<T>> {
        let opts = self.cfg.rdma.as_ref()?;
        let timeout = self.cfg.timeout;
        let name = export.name();
        let checked = |ch: &mut crate::rdma::RdmaChannel| {
            self.same_instance(export, pinned, ch.instance())?;
            f(ch)
        };
        self.rdma.run(name, checked, || {
            let control = self.checkout()?;
            let dev = self.rdma.device(opts)?;
            crate::rdma::RdmaChannel::open(control, &dev, name, self.cfg.stripe_bytes, timeout)
        })
    }

    /// Runs `f` on a pooled NIXL channel to `export` (to the instance it met); `None` where
    /// the peer does not use NIXL or the agent does not offer the export over it.
    #[cfg(feature = "nixl")]
    pub(crate) fn over_nixl<T>(
        &self,
        export: &RemoteExport,
        pinned: &ExportInfo,
        f: impl FnOnce(&mut crate::nixl::NixlChannel) -> Result<T>,
    ) -> Option<Result<T>> {
        if !self.cfg.nixl || !nixl_loaded() {
            return None;
        }
        let name = export.name();
        let checked = |ch: &mut crate::nixl::NixlChannel| {
            self.same_instance(export, pinned, ch.instance())?;
            f(ch)
        };
        self.nixl.run(name, checked, || {
            let control = self.checkout()?;
            crate::nixl::NixlChannel::open(control, name, self.cfg.stripe_bytes)
        })
    }

    /// Moves a transfer's `stripes` (each piece with its offset; as many as the transfer would
    /// use connections) over NIXL side by side, on a channel each: one NIXL transfer runs on
    /// one UCX worker, on loopback a core's worth of copying, about a third of what four TCP
    /// connections move. `nixl` moves a stripe over a channel, `tcp` over a connection where
    /// the agent does not offer NIXL. `None` where NIXL serves no stripe.
    #[cfg(feature = "nixl")]
    fn nixl_striped<B: Send>(
        &self,
        export: &RemoteExport,
        pinned: &ExportInfo,
        stripes: Vec<(u64, B)>,
        nixl: impl Fn(&mut crate::nixl::NixlChannel, u64, B) -> Result<()> + Sync,
        tcp: impl Fn(&mut Connection, u64, &mut B) -> Result<()> + Sync,
    ) -> Option<Result<()>> {
        if !self.cfg.nixl || !self.nixl.may_serve(export.name()) || !nixl_loaded() {
            return None;
        }
        let (nixl, tcp) = (&nixl, &tcp);
        let lanes = stripes.len();
        // One stripe, on this thread; each gives its buffer back when NIXL would not take it.
        let one = |(at, b): (u64, B)| {
            let mut b = Some(b);
            let r = self.over_nixl(export, pinned, |ch| {
                nixl(ch, at, b.take().expect("one call"))
            });
            (at, if r.is_none() { b } else { None }, r)
        };
        let mut stripes = stripes.into_iter();
        let results: Vec<_> = std::thread::scope(|scope| {
            let mine = stripes.next();
            let others: Vec<_> = stripes.map(|s| scope.spawn(move || one(s))).collect();
            mine.map(one)
                .into_iter()
                .chain(others.into_iter().filter_map(|h| h.join().ok()))
                .collect()
        });
        if results.len() < lanes {
            return Some(Err(RemoteIoError::InvalidArgument(
                "a stripe's thread panicked".into(),
            )));
        }
        if results.iter().all(|(_, _, r)| r.is_none()) && lanes > 0 {
            // Nothing moved: the caller's TCP path takes the whole transfer.
            return None;
        }
        let mut outcome = Ok(());
        for (at, back, r) in results {
            let r = match (r, back) {
                (Some(r), _) => r,
                (None, Some(mut b)) => self.with_connection(export, pinned, |c| tcp(c, at, &mut b)),
                (None, None) => Ok(()),
            };
            if outcome.is_ok() {
                outcome = r;
            }
        }
        Some(outcome)
    }

    /// Connections a transfer of `len` bytes uses.
    fn lanes(&self, len: usize) -> usize {
        let stripes = len.div_ceil(self.cfg.stripe_bytes.max(1));
        stripes.clamp(1, self.cfg.connections.max(1))
    }

    /// Runs `f` on each share with a connection of its own: the caller's thread runs the
    /// first, scoped threads the others. Every share's connection is taken before any share
    /// starts, so a share that finishes early cannot hand its connection to a later one: the
    /// shares really run side by side. The first error wins; every share is finished or
    /// failed before this returns.
    fn in_parallel<S: Send>(
        &self,
        export: &RemoteExport,
        pinned: &ExportInfo,
        shares: Vec<S>,
        f: impl Fn(&mut Connection, S) -> Result<()> + Sync,
    ) -> Result<()> {
        let mut conns = Vec::with_capacity(shares.len());
        for _ in 0..shares.len() {
            match self.checkout_for(export, pinned) {
                Ok(c) => conns.push(c),
                Err(e) => {
                    conns.into_iter().for_each(|c| self.checkin(c));
                    return Err(e);
                }
            }
        }
        let f = &f;
        let mut work = conns.into_iter().zip(shares);
        let Some((mut mine, my_share)) = work.next() else {
            return Ok(());
        };
        std::thread::scope(|scope| {
            let others: Vec<_> = work
                .map(|(mut c, share)| {
                    scope.spawn(move || {
                        let r = f(&mut c, share);
                        self.checkin(c);
                        r
                    })
                })
                .collect();
            let mut result = f(&mut mine, my_share);
            self.checkin(mine);
            for h in others {
                let r = h.join().unwrap_or_else(|_| {
                    Err(RemoteIoError::InvalidArgument(
                        "a stripe's thread panicked".into(),
                    ))
                });
                if result.is_ok() {
                    result = r;
                }
            }
            result
        })
    }

    /// Runs `f` on a pooled connection to `export`'s instance; a connection that breaks is
    /// dropped. A pooled one that fails on the network runs `f` once more on a new connection:
    /// the agent closes connections it finds idle (past its idle timeout, or to give the
    /// place to another key) and may do so just as a request leaves, and every request is
    /// idempotent (a read, a write of the same bytes, a stat, a sync, a reservation).
    fn with_connection<T>(
        &self,
        export: &RemoteExport,
        pinned: &ExportInfo,
        mut f: impl FnMut(&mut Connection) -> Result<T>,
    ) -> Result<T> {
        let pooled = !self.idle.lock_unpoisoned().is_empty();
        let mut c = self.checkout_for(export, pinned)?;
        let r = f(&mut c);
        let again = pooled && c.is_broken() && matches!(r, Err(RemoteIoError::Network(_)));
        self.checkin(c);
        if !again {
            return r;
        }
        let mut c = self.for_instance(export, pinned, self.connect_new()?)?;
        let r = f(&mut c);
        self.checkin(c);
        r
    }

    /// An idle connection that is still alive, else a new one.
    fn checkout(&self) -> Result<Connection> {
        loop {
            let idle = self.idle.lock_unpoisoned().pop();
            match idle {
                Some(c) if c.is_alive() => return Ok(c),
                // Closed by the agent (idle too long, or gone): never handed out.
                Some(_) => {
                    self.broken.fetch_add(1, Ordering::Relaxed);
                }
                None => break,
            }
        }
        self.connect_new()
    }

    /// A new connection, with the configured attempts and backoff.
    fn connect_new(&self) -> Result<Connection> {
        let mut backoff = self.cfg.backoff;
        let deadline = Instant::now() + self.cfg.timeout;
        let mut attempt = 1;
        let name = self
            .cfg
            .server_name
            .clone()
            .unwrap_or_else(|| self.cfg.addr.ip().to_string());
        let tls = self.cfg.tls.as_ref().map(|t| (t, name.as_str()));
        loop {
            let c = Connection::connect_with(
                self.cfg.addr,
                &self.cfg.credentials,
                self.cfg.timeout,
                tls,
            );
            match c {
                Ok(c) => {
                    self.connects.fetch_add(1, Ordering::Relaxed);
                    return Ok(c);
                }
                // A refused key will be refused again; a network failure may pass.
                Err(e @ RemoteIoError::Auth(_)) => return Err(e),
                Err(e) if attempt >= self.cfg.connect_attempts.max(1) => return Err(e),
                Err(e) if Instant::now() + backoff > deadline => return Err(e),
                Err(e) => {
                    tracing::debug!(addr = %self.cfg.addr, attempt, error = %e, "reconnecting");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    attempt += 1;
                }
            }
        }
    }

    fn checkin(&self, c: Connection) {
        if c.is_broken() {
            self.broken.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut idle = self.idle.lock_unpoisoned();
        if idle.len() < self.cfg.connections.max(1) {
            idle.push(c);
        }
    }
}

/// Refuses a write that `export` cannot take whole, before anything is sent.
pub(crate) fn check_write(
    export: &RemoteExport,
    pinned: &ExportInfo,
    offset: u64,
    len: usize,
) -> Result<()> {
    if !pinned.writable {
        return Err(RemoteIoError::Remote {
            code: gpuio_hal::ErrorCode::Permission,
            message: format!("writing export {:?} is not permitted", export.name()),
        });
    }
    match offset.checked_add(len as u64) {
        Some(end) if end <= pinned.capacity => Ok(()),
        _ => Err(RemoteIoError::InvalidArgument(format!(
            "{offset}+{len} is outside export {:?} ({} bytes)",
            export.name(),
            pinned.capacity
        ))),
    }
}

#[cfg(feature = "rdma")]
fn no_atomics(export: &str) -> RemoteIoError {
    RemoteIoError::Remote {
        code: gpuio_hal::ErrorCode::Unsupported,
        message: format!("atomics on {export:?} need RDMA to a memory export"),
    }
}

/// Whether this process has NIXL; where a peer asks for it and there is none, TCP serves
/// (said once per process).
#[cfg(feature = "nixl")]
fn nixl_loaded() -> bool {
    match gpuio_nixl::library() {
        Ok(_) => true,
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| tracing::warn!("transport=nixl served over TCP: {e}"));
            false
        }
    }
}

/// `buf` cut into `lanes` near-equal stripes, each with its offset.
#[cfg(feature = "nixl")]
fn stripes_mut(offset: u64, buf: &mut [u8], lanes: usize) -> Vec<(u64, &mut [u8])> {
    let step = buf.len().div_ceil(lanes.max(1)).max(1);
    buf.chunks_mut(step)
        .enumerate()
        .map(|(i, c)| (offset + (i * step) as u64, c))
        .collect()
}

/// `data` cut into `lanes` near-equal stripes, each with its offset.
#[cfg(feature = "nixl")]
fn stripes(offset: u64, data: &[u8], lanes: usize) -> Vec<(u64, &[u8])> {
    let step = data.len().div_ceil(lanes.max(1)).max(1);
    data.chunks(step)
        .enumerate()
        .map(|(i, c)| (offset + (i * step) as u64, c))
        .collect()
}
