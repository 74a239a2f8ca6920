//! [`CudaRun`]: what an op's CUDA side may do on a stream — launch a kernel by name (its module
//! loaded on first use), copy between host and device in stream order, record events, wait.

use super::driver::{self, cuda_err};
use crate::error::{HalError, Result};
use crate::gpu::Event;
use crate::gpu::op::{CudaRun, DevArg, KernelArg, KernelArgs, LaunchShape};
use crate::kernels::Kernel;
use cudarc::driver::{LaunchConfig, PushKernelArg};

impl<'s> CudaRun<'s> {
    /// A run on `stream`, its context bound to the calling thread once for the whole op
    /// (every launch and copy of the op is on this thread, in this context).
    pub(crate) fn bound(stream: &'s super::CudaStreamBackend) -> Result<Self> {
        stream.shared.bind()?;
        Ok(Self { stream })
    }

    /// A grid-stride shape for `items` work items: blocks of 256 threads, enough of them to
    /// fill the device and no more.
    pub fn grid_stride(&self, items: u64) -> LaunchShape {
        let cfg = self.stream.shared.launch_config(items);
        LaunchShape {
            grid: cfg.grid_dim.0,
            grid_y: 1,
            block: cfg.block_dim.0,
            shared_bytes: cfg.shared_mem_bytes,
        }
    }

    /// Enqueues `kernel` with `args` on the stream.
    ///
    /// # Safety
    /// `args` match the kernel's parameters in number, order and type, and what the kernel
    /// reads and writes through them (device ranges, mapped host memory, device registers)
    /// stays allocated and untouched by others until the launch completes: the op's `cuda`
    /// says why, next to its arguments.
    pub unsafe fn launch<K: Kernel>(
        &self,
        kernel: K,
        shape: LaunchShape,
        args: &KernelArgs,
    ) -> Result<()> {
        let function = self.stream.shared.function(kernel)?;
        let mut launch = self.stream.stream.launch_builder(&function);
        for value in &args.values {
            match value {
                KernelArg::U64(v) => launch.arg(v),
                KernelArg::U32(v) => launch.arg(v),
                KernelArg::I32(v) => launch.arg(v),
                KernelArg::F32(v) => launch.arg(v),
                // The driver copies the parameter's size from where its first byte is.
                KernelArg::Bytes(v) => match v.first() {
                    Some(first) => launch.arg(first),
                    None => {
                        return Err(HalError::InvalidArgument(format!(
                            "{}: an empty structure argument",
                            kernel.name()
                        )));
                    }
                },
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (shape.grid, shape.grid_y.max(1), 1),
            block_dim: (shape.block, 1, 1),
            shared_mem_bytes: shape.shared_bytes,
        };
        // SAFETY: the caller's contract: the arguments match the kernel and what it touches
        // stays valid until it completes.
        unsafe { launch.launch(cfg) }.map_err(|e| {
            let mut error = cuda_err("cuLaunchKernel")(e);
            if let HalError::Cuda { message, .. } = &mut error {
                *message = format!("{}: {message}", kernel.name());
            }
            error
        })?;
        Ok(())
    }

    /// Blocks until the stream's work is done.
    pub fn synchronize(&self) -> Result<()> {
        use crate::gpu::backend::StreamBackend;
        self.stream.synchronize()
    }

    /// Enqueues a copy of `dst.len()` bytes from host memory at `src` into `dst`.
    ///
    /// # Safety
    /// `src` is readable for `dst.len()` bytes (pinned, for the copy to be asynchronous) until
    /// the copy completes.
    pub unsafe fn upload(&self, src: *const u8, dst: DevArg<'_>) -> Result<()> {
        // SAFETY: the caller keeps `src` readable; `dst` is a checked range of a live
        // allocation of this stream's context.
        unsafe { driver::memcpy_htod_async(dst.addr(), src, dst.len(), self.stream.raw()) }
    }

    /// Enqueues a copy of `src` into host memory at `dst`.
    ///
    /// # Safety
    /// `dst` is writable for `src.len()` bytes, and touched by nothing else, until the copy
    /// completes.
    pub unsafe fn download(&self, src: DevArg<'_>, dst: *mut u8) -> Result<()> {
        // SAFETY: the caller keeps `dst` writable and untouched; `src` is a checked range of
        // a live allocation of this stream's context.
        unsafe { driver::memcpy_dtoh_async(dst, src.addr(), src.len(), self.stream.raw()) }
    }

    /// Records an event after the work enqueued so far (with timing if `timing`).
    pub fn record(&self, timing: bool) -> Result<Event> {
        use crate::gpu::backend::StreamBackend;
        Ok(Event {
            inner: self.stream.record(timing)?,
        })
    }
}
