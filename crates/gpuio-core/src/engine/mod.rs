//! The engine seam and the transport manager. Each transport crate knows nothing of the
//! others; here each is adapted to [`Engine`], whose transfers are the ones routing gives it
//! (`route.rs`), and [`Engines`] is the one path every transfer takes: route, then the
//! engine. The scheduler, the ring proxy and blocking calls all come through
//! [`Engines::transfer`].

mod local;
mod mem;
mod remote;

pub use local::LocalIoEngine;
pub use mem::MemIoEngine;
pub use remote::RemoteIoEngine;

use crate::endpoint::{Dest, Endpoint, Source};
use crate::error::{CoreError, Result};
use crate::outcome::{Outcome, Route};
use crate::resources::ResourceTracker;
use crate::retry::RetryPolicy;
use crate::route::Transfer;
use gpuio_transport_localio::{Durability, LocalIo};
use gpuio_transport_memio::MemIo;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

/// A transport adapted to the core: a blocking transfer of the kind routing gives it.
pub trait Engine: Send + Sync + fmt::Debug {
    /// The transfers this engine serves (one variant per pair of endpoint kinds).
    type Transfer<'a>;

    /// Moves `len` bytes; says how. A host slice must hold at least `len` bytes; the first
    /// `len` are used.
    fn transfer(&self, t: Self::Transfer<'_>, len: usize) -> Result<Route>;
}

/// The transport manager: one engine per transport this build has.
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

    /// The load on replicated sources (what failover balances on).
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

    /// A blocking transfer: routed, then carried out by its engine. Shared host memory is
    /// locked by the engine while it touches it (shared for a source, exclusive for a
    /// destination).
    pub fn transfer(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome> {
        let t = Transfer::new(src, dst);
        let engine = t.engine();
        let route = match t {
            Transfer::Mem(t) => self.memio.transfer(t, len)?,
            Transfer::Local(t) => self.localio.transfer(t, len)?,
            Transfer::Remote(t) => self.remoteio.transfer(t, len)?,
        };
        Ok(Outcome::new(len, engine, route))
    }

    /// [`transfer`](Self::transfer) whose written bytes are on stable storage when it
    /// returns: a file is written with [`Durability::DataSync`] (each piece's writeback
    /// started as it lands, one `fdatasync`), another node's export is flushed by its agent;
    /// memory needs nothing.
    pub fn transfer_durable(&self, src: Source<'_>, dst: Dest<'_>, len: usize) -> Result<Outcome> {
        let remote = match &dst {
            Dest::Remote(r, _) => Some(*r),
            _ => None,
        };
        let t = Transfer::new(src, dst);
        let engine = t.engine();
        let route = match t {
            Transfer::Mem(t) => self.memio.transfer(t, len)?,
            Transfer::Local(t) => self.localio.run(t, len, Durability::DataSync)?,
            Transfer::Remote(t) => self.remoteio.transfer(t, len)?,
        };
        if let Some(r) = remote {
            r.peer().sync(r.export())?;
        }
        Ok(Outcome::new(len, engine, route))
    }

    /// A blocking transfer between owned endpoints (what a queued request holds).
    pub fn execute(&self, src: &Endpoint, dst: &Endpoint, len: usize) -> Result<Outcome> {
        self.transfer(src.source(), dst.dest(), len)
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
            return policy.run_until(until, &mut *on_retry, || self.execute(src, dst, len));
        }
        let keys: Vec<_> = sources.iter().map(Endpoint::resource).collect();
        let mut order: Vec<usize> = (0..sources.len()).collect();
        order.sort_by_key(|&i| self.tracker.load(keys[i]).bytes);
        let mut last = None;
        for (n, &i) in order.iter().enumerate() {
            if n > 0 {
                on_failover();
            }
            let _load = self.tracker.begin(keys[i], len as u64);
            let r = policy.run_until(until, &mut *on_retry, || {
                self.execute(&sources[i], dst, len)
            });
            match r {
                Ok(mut o) => {
                    if n > 0 {
                        o.failover = Some(sources[i].to_string());
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
}
