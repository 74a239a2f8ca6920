//! A CUDA stream ([`CudaStreamBackend`]): the [`StreamBackend`] the public `Stream` drives —
//! async copies (host↔device, device↔device and between peers), the pattern kernels, the
//! request-ring kernels, events and synchronization. Row gathers and scatters, with their
//! per-stream scratch, are in `rows.rs`; driver calls go through [`driver`].

use super::device::{CudaDevice, Shared};
use super::driver::{self, cuda_err};
use super::event::{CudaEventBackend, EventPool};
use super::report::StreamReports;
use super::resident::StreamResident;
use super::rows::OrderScratch;
use crate::error::{HalError, Result};
use crate::gpu::backend::{DevRange, DeviceBackend, EventBackend, StreamBackend, StreamTarget};
use crate::sync::MutexExt;
use cudarc::driver::{CudaStream, sys};
use std::sync::{Arc, Mutex};

/// A stream of one device, with the scratch its row jobs keep between calls.
pub(crate) struct CudaStreamBackend {
    pub(super) stream: Arc<CudaStream>,
    /// Idle events, reused: creating and destroying one per copy doubled the driver calls of
    /// the staging pipeline, whose lanes contend for the driver's context lock.
    events: Arc<EventPool>,
    /// Device memory for sorting index lists (sorted gathers), kept at its largest size.
    pub(super) order: Mutex<OrderScratch>,
    /// The gather kernels' report words, in mapped host memory, made on first use (a free
    /// per call would cost more than the call).
    pub(super) reports: StreamReports,
    /// The resident row server's call block, made on its first call (`resident.rs`).
    pub(super) resident: StreamResident,
    /// The caller's context, current again once the stream and its events are destroyed
    /// (the fields above). Declared before `shared`: where this was the device's last
    /// handle, its context is released after, and is never made current again here.
    restore: super::RestoreOnDrop,
    pub(super) shared: Arc<Shared>,
}

impl CudaStreamBackend {
    /// A new stream of `shared`'s device, whose context the calling thread has bound.
    pub(super) fn new(shared: Arc<Shared>) -> Result<Self> {
        let stream = shared
            .ctx()?
            .new_stream()
            .map_err(cuda_err("cuStreamCreate"))?;
        Ok(Self {
            shared,
            stream,
            events: Arc::new(EventPool::default()),
            order: Mutex::new(OrderScratch::default()),
            reports: StreamReports::default(),
            resident: StreamResident::default(),
            restore: Default::default(),
        })
    }

    /// The driver's handle of the stream.
    pub(super) fn raw(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }
}

impl Drop for CudaStreamBackend {
    fn drop(&mut self) {
        if super::probe::driver_forked() {
            // The driver's stream and events are the parent's: kept, never destroyed here.
            std::mem::forget(Arc::clone(&self.stream));
            std::mem::forget(Arc::clone(&self.events));
            std::mem::forget(self.reports.take());
            std::mem::forget(self.resident.take());
            return;
        }
        self.restore.arm();
        // Work queued on this stream may still use its scratch: drain first.
        let report = self.reports.take();
        // A resident kernel would hold the drain for its linger: sent home first.
        let resident = self.resident.stop();
        if let Err(e) = self.shared.bind() {
            tracing::error!(error = %e, "binding a stream's context to free its scratch failed");
            // Kernels may still write the report: leaked, as the other scratch is.
            std::mem::forget(report);
            std::mem::forget(resident);
            return;
        }
        let _ = self.stream.synchronize();
        drop(report);
        drop(resident);
        self.order.get_mut_unpoisoned().release(&self.shared);
    }
}

impl StreamBackend for CudaStreamBackend {
    fn target(&self) -> StreamTarget<'_> {
        StreamTarget::Cuda(self)
    }

    unsafe fn copy_h2d(&self, src: *const u8, dst: DevRange<'_>) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: the caller keeps src readable and dst's allocation live until completion;
        // this stream belongs to the bound context.
        unsafe { driver::memcpy_htod_async(dst.addr(), src, dst.len, self.raw()) }
    }

    unsafe fn copy_d2h(&self, src: DevRange<'_>, dst: *mut u8) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: the caller keeps dst writable and untouched, and src's allocation live, until
        // completion; this stream belongs to the bound context.
        unsafe { driver::memcpy_dtoh_async(dst, src.addr(), src.len, self.raw()) }
    }

    unsafe fn copy_d2d(
        &self,
        src_dev: &dyn DeviceBackend,
        src: DevRange<'_>,
        dst_dev: &dyn DeviceBackend,
        dst: DevRange<'_>,
    ) -> Result<()> {
        self.shared.bind()?;
        let ctx_of = |d: &dyn DeviceBackend| {
            d.as_any()
                .downcast_ref::<CudaDevice>()
                .ok_or_else(|| HalError::InvalidArgument("peer is not a CUDA device".into()))
                .and_then(|d| d.shared.ctx().cloned())
        };
        let (sctx, dctx) = (ctx_of(src_dev)?, ctx_of(dst_dev)?);
        if sctx.cu_ctx() == dctx.cu_ctx() {
            // SAFETY: both are live, non-overlapping ranges of this context (caller's contract).
            unsafe { driver::memcpy_dtod_async(dst.addr(), src.addr(), dst.len, self.raw()) }
        } else {
            // SAFETY: both are live ranges of their contexts (caller's contract), which the
            // Arcs held here keep alive for the call.
            unsafe {
                driver::memcpy_peer_async(
                    dst.addr(),
                    dctx.cu_ctx(),
                    src.addr(),
                    sctx.cu_ctx(),
                    dst.len,
                    self.raw(),
                )
            }
        }
    }

    fn record(&self, timing: bool) -> Result<Box<dyn EventBackend>> {
        let event = self
            .events
            .record(self.shared.ctx()?, &self.stream, timing)?;
        Ok(Box::new(event))
    }

    fn wait_for(&self, event: &dyn EventBackend) -> Result<()> {
        let event = event
            .as_any()
            .downcast_ref::<CudaEventBackend>()
            .ok_or_else(|| {
                HalError::InvalidArgument("a stream waits for an event of another backend".into())
            })?;
        self.shared.bind()?;
        event.wait_on(&self.stream)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }
}
