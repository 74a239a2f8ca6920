//! Events of the CUDA backend: each stream keeps a pool of idle events ([`EventPool`]) and
//! records from it, and a recorded event ([`CudaEventBackend`]) goes back to the pool when
//! dropped. Creating and destroying one per copy doubled the driver calls of the staging
//! pipeline, whose lanes contend for the driver's context lock.

use super::driver::cuda_err;
use crate::error::{HalError, Result};
use crate::gpu::backend::EventBackend;
use crate::sync::MutexExt;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};
use std::any::Any;
use std::sync::{Arc, Mutex, Weak};

/// Idle events of one stream, by timing capability.
#[derive(Default)]
pub(super) struct EventPool {
    plain: Mutex<Vec<CudaEvent>>,
    timing: Mutex<Vec<CudaEvent>>,
}

impl EventPool {
    fn list(&self, timing: bool) -> &Mutex<Vec<CudaEvent>> {
        if timing { &self.timing } else { &self.plain }
    }

    /// Records an event after the work queued on `stream` so far: an idle one of the pool, or
    /// a new one of `ctx` (with timing if `timing`).
    pub(super) fn record(
        self: &Arc<Self>,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        timing: bool,
    ) -> Result<CudaEventBackend> {
        let pooled = self.list(timing).lock_unpoisoned().pop();
        let event = match pooled {
            Some(e) => e,
            None => {
                let flags = if timing {
                    sys::CUevent_flags::CU_EVENT_DEFAULT
                } else {
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
                };
                ctx.new_event(Some(flags))
                    .map_err(cuda_err("cuEventCreate"))?
            }
        };
        event.record(stream).map_err(cuda_err("cuEventRecord"))?;
        Ok(CudaEventBackend {
            event: Some(event),
            timing,
            pool: Arc::downgrade(self),
        })
    }
}

/// A recorded event; when dropped it goes back to its stream's pool (if the stream is still
/// there) instead of being destroyed.
pub(super) struct CudaEventBackend {
    /// Always `Some` until dropped.
    event: Option<CudaEvent>,
    timing: bool,
    pool: Weak<EventPool>,
}

impl CudaEventBackend {
    fn event(&self) -> Result<&CudaEvent> {
        self.event
            .as_ref()
            .ok_or_else(|| HalError::InvalidArgument("event already released".into()))
    }

    /// Makes `stream`'s later work wait for this event's (`cuStreamWaitEvent`).
    pub(super) fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        stream
            .wait(self.event()?)
            .map_err(cuda_err("cuStreamWaitEvent"))
    }
}

impl Drop for CudaEventBackend {
    fn drop(&mut self) {
        if super::probe::driver_forked() {
            std::mem::forget(self.event.take());
            return;
        }
        let Some(event) = self.event.take() else {
            return;
        };
        match self.pool.upgrade() {
            Some(pool) => pool.list(self.timing).lock_unpoisoned().push(event),
            // Its stream is gone: destroying it binds its context (the last holder of the
            // context releases it), so the caller's goes back after.
            None => {
                let ctx = event.context();
                let released = [(ctx.cu_device(), ctx.cu_ctx() as usize)];
                super::releasing(&released, || drop(event));
            }
        }
    }
}

impl EventBackend for CudaEventBackend {
    fn synchronize(&self) -> Result<()> {
        self.event()?
            .synchronize()
            .map_err(cuda_err("cuEventSynchronize"))
    }

    fn is_complete(&self) -> Result<bool> {
        self.event()?
            .try_is_complete()
            .map_err(cuda_err("cuEventQuery"))
    }

    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32> {
        let start = start
            .as_any()
            .downcast_ref::<CudaEventBackend>()
            .ok_or_else(|| HalError::InvalidArgument("events of different backends".into()))?;
        start
            .event()?
            .elapsed_ms(self.event()?)
            .map_err(cuda_err("cuEventElapsedTime"))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
