//! A CUDA stream ([`CudaStreamBackend`]): the [`StreamBackend`] the public `Stream` drives —
//! async copies (host↔device, device↔device and between peers), the pattern kernels, the
//! request-ring kernels, events and synchronization. Row gathers and scatters, with their
//! per-stream scratch, are in `rows.rs`; driver calls go through [`driver`].

use super::device::{CudaDevice, Shared};
use super::driver::{self, cuda_err};
use super::event::EventPool;
use super::rows::OrderScratch;
use crate::error::{HalError, Result};
use crate::gpu::backend::{
    ArrayLaunch, DevRange, DeviceBackend, EventBackend, NvmeLaunch, RowHooks, RowJob, RowsDone,
    StreamBackend, StreamTarget,
};
use crate::kernels::{NVME, PatternKernel};
use crate::sync::MutexExt;
use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg, sys};
use std::sync::{Arc, Mutex};

/// A stream of one device, with the scratch its row jobs keep between calls.
pub(crate) struct CudaStreamBackend {
    pub(super) shared: Arc<Shared>,
    pub(super) stream: Arc<CudaStream>,
    /// Idle events, reused: creating and destroying one per copy doubled the driver calls of
    /// the staging pipeline, whose lanes contend for the driver's context lock.
    events: Arc<EventPool>,
    /// Device memory for the row kernels' error reports (`REPORT_BYTES`), allocated on first use
    /// (cuMemFree synchronizes the device: not something to do per call).
    pub(super) scratch: Mutex<Option<sys::CUdeviceptr>>,
    /// Device memory for sorting index lists (sorted gathers), kept at its largest size.
    pub(super) order: Mutex<OrderScratch>,
}

impl CudaStreamBackend {
    /// A new stream of `shared`'s device, whose context the calling thread has bound.
    pub(super) fn new(shared: Arc<Shared>) -> Result<Self> {
        let stream = shared
            .ctx
            .new_stream()
            .map_err(cuda_err("cuStreamCreate"))?;
        Ok(Self {
            shared,
            stream,
            events: Arc::new(EventPool::default()),
            scratch: Mutex::new(None),
            order: Mutex::new(OrderScratch::default()),
        })
    }

    /// The driver's handle of the stream.
    pub(super) fn raw(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }
}

impl Drop for CudaStreamBackend {
    fn drop(&mut self) {
        // Work queued on this stream may still use its scratch: drain first.
        if let Err(e) = self.shared.bind() {
            tracing::error!(error = %e, "binding a stream's context to free its scratch failed");
            return;
        }
        let _ = self.stream.synchronize();
        self.order.get_mut_unpoisoned().release(&self.shared);
        let scratch = self.scratch.get_mut_unpoisoned().take();
        if let Some(ptr) = scratch {
            // SAFETY: allocated by cuMemAlloc in this context, freed once, unused now.
            if let Err(e) = unsafe { driver::mem_free(ptr) } {
                tracing::error!(error = %e, "freeing a stream's scratch memory failed");
            }
        }
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
                .map(|d| d.shared.ctx.clone())
                .ok_or_else(|| HalError::InvalidArgument("peer is not a CUDA device".into()))
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

    fn fill_pattern(&self, dst: DevRange<'_>, first: u64, seed: u64) -> Result<()> {
        let fill = self.shared.function(PatternKernel::FillPattern)?;
        self.shared.bind()?;
        let (addr, len) = (dst.addr(), dst.len as u64);
        let words = (first + len).div_ceil(8) - first / 8;
        let cfg = self.shared.launch_config(words);
        let mut launch = self.stream.launch_builder(&fill);
        launch.arg(&addr).arg(&len).arg(&first).arg(&seed);
        // SAFETY: the argument list matches gpuio_fill_pattern(u8*, u64, u64, u64); dst is a
        // checked range of a live allocation, which the caller's borrow keeps alive until the
        // synchronize below; the kernel writes only inside it.
        unsafe { launch.launch(cfg) }.map_err(cuda_err("cuLaunchKernel(gpuio_fill_pattern)"))?;
        self.synchronize()
    }

    fn find_mismatch(&self, a: DevRange<'_>, b: DevRange<'_>) -> Result<Option<u64>> {
        let mismatch = self.shared.function(PatternKernel::FindMismatch)?;
        self.shared.bind()?;
        // An 8-byte allocation owned by this function and freed below.
        let out = driver::mem_alloc(8)?;
        let run = || -> Result<u64> {
            // SAFETY: out is 8 live bytes of this context, used by nothing else.
            unsafe { driver::memset_d8_async(out, 0xff, 8, self.raw())? };
            let (pa, pb, len) = (a.addr(), b.addr(), a.len as u64);
            let cfg = self.shared.launch_config(len.div_ceil(16));
            let mut launch = self.stream.launch_builder(&mismatch);
            launch.arg(&pa).arg(&pb).arg(&len).arg(&out);
            // SAFETY: arguments match gpuio_find_mismatch(const u8*, const u8*, u64, u64*); the
            // ranges are checked and live for this call, which synchronizes before returning;
            // the kernel writes only *out.
            unsafe { launch.launch(cfg) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_find_mismatch)"))?;
            let mut first = [0u8; 8];
            // SAFETY: `first` is 8 writable bytes; we synchronize before reading it.
            unsafe { driver::memcpy_dtoh_async(first.as_mut_ptr(), out, 8, self.raw())? };
            self.synchronize()?;
            Ok(u64::from_le_bytes(first))
        };
        let first = run();
        // A failed run may have left the kernel queued: drain before freeing its output.
        let _ = self.synchronize();
        // SAFETY: out was allocated above and no queued work uses it any more.
        if let Err(e) = unsafe { driver::mem_free(out) } {
            tracing::error!(error = %e, "freeing compare scratch failed");
        }
        Ok(Some(first?).filter(|&i| i != u64::MAX))
    }

    unsafe fn rows(&self, job: RowJob<'_>, hooks: RowHooks<'_>) -> Result<RowsDone> {
        // SAFETY: the same contract, the caller's.
        unsafe { self.run_rows(job, hooks) }
    }

    unsafe fn nvme_kernel(&self, launch: NvmeLaunch<'_>) -> Result<()> {
        let kernels = self.shared.module(&NVME)?;
        self.shared.bind()?;
        match launch {
            NvmeLaunch::Io {
                queues,
                nqueues,
                opcode,
                nsid,
                lbas,
                count,
                blocks,
                block_bytes,
                data_iova,
                data,
                seed,
                statuses,
                mismatches,
                grid,
                threads,
            } => {
                let cfg = LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                let (q, l_, s_, m) = (
                    queues.addr(),
                    lbas.addr(),
                    statuses.addr(),
                    mismatches.addr(),
                );
                let mut l = self.stream.launch_builder(&kernels.functions[0]);
                l.arg(&q)
                    .arg(&nqueues)
                    .arg(&opcode)
                    .arg(&nsid)
                    .arg(&l_)
                    .arg(&count);
                l.arg(&blocks)
                    .arg(&block_bytes)
                    .arg(&data_iova)
                    .arg(&data)
                    .arg(&seed);
                l.arg(&s_).arg(&m);
                // SAFETY: the arguments match gpuio_nvme_io; the kernel reads the checked
                // descriptor and LBA ranges, writes the checked status and mismatch ranges and,
                // through the descriptors, queue memory, doorbells and data memory that stay
                // registered until this synchronous call returns (caller's contract); each warp
                // touches only its own data slots, which the caller checked fit `data`.
                unsafe { l.launch(cfg) }.map_err(cuda_err("cuLaunchKernel(gpuio_nvme_io)"))?;
            }
            NvmeLaunch::Layout { out } => {
                let one = LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1, 1, 1),
                    shared_mem_bytes: 0,
                };
                let o = out.addr();
                let mut l = self.stream.launch_builder(&kernels.functions[1]);
                l.arg(&o);
                // SAFETY: the kernel writes layout_words().len() u64s at `out`, a range checked
                // to hold them.
                unsafe { l.launch(one) }.map_err(cuda_err("cuLaunchKernel(gpuio_nvme_layout)"))?;
            }
        }
        self.synchronize()
    }

    unsafe fn array_kernel(&self, launch: ArrayLaunch<'_>) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.launch_array(launch) }
    }

    fn record(&self, timing: bool) -> Result<Box<dyn EventBackend>> {
        let event = self.events.record(&self.shared.ctx, &self.stream, timing)?;
        Ok(Box::new(event))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }
}
