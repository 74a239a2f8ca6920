//! Launches of the on-demand array kernels (`kernels/ondemand.cu`).

use super::driver::cuda_err;
use super::stream::CudaStreamBackend;
use crate::error::Result;
use crate::gpu::backend::ArrayLaunch;
use crate::ondemand::{ArrayDevice, ResidentDevice};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

// SAFETY: ArrayDevice is `#[repr(C)]` of plain integers with no padding (its const asserts
// pin every offset), the exact bytes `struct gpuio_array_desc` expects by value.
unsafe impl DeviceRepr for ArrayDevice {}
// SAFETY: as ArrayDevice: `#[repr(C)]` integers without padding, `struct gpuio_resident_desc`.
unsafe impl DeviceRepr for ResidentDevice {}

impl CudaStreamBackend {
    /// Runs one on-demand array kernel and waits for it.
    ///
    /// # Safety
    /// As `StreamBackend::array_kernel`: the cache, tables and ring the descriptor names stay
    /// allocated (the ring mapped and served) until this returns.
    pub(super) unsafe fn launch_array(&self, launch: ArrayLaunch<'_>) -> Result<()> {
        let module = self.shared.module(&crate::kernels::ONDEMAND)?;
        let kernels = &module.functions;
        self.shared.bind()?;
        match launch {
            ArrayLaunch::Pages {
                array,
                flush,
                first,
                count,
            } => {
                let cfg = self.shared.launch_config(count);
                let mut l = self
                    .stream
                    .launch_builder(&kernels[if flush { 1 } else { 0 }]);
                l.arg(&array).arg(&first).arg(&count);
                // SAFETY: the arguments match gpuio_array_touch / gpuio_array_flush; they
                // touch the pages first..first+count of the array (the caller checked the
                // range) and the cache's memory, alive until the synchronize below.
                unsafe { l.launch(cfg) }.map_err(cuda_err("cuLaunchKernel(gpuio_array_pages)"))?;
            }
            ArrayLaunch::TestRead {
                array,
                reads,
                salt,
                seed,
                every,
                written,
                out,
                threads,
            } => {
                let cfg = self.shared.launch_config(u64::from(threads.max(1)));
                let o = out.addr();
                let mut l = self.stream.launch_builder(&kernels[2]);
                l.arg(&array).arg(&reads).arg(&salt).arg(&seed);
                l.arg(&every).arg(&written).arg(&o);
                // SAFETY: matches gpuio_array_test_read, which writes three u64s at `out` (a
                // range checked to hold them) and reads through the array as above.
                unsafe { l.launch(cfg) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_array_test_read)"))?;
            }
            ArrayLaunch::TestStore {
                array,
                every,
                written,
            } => {
                let count = (array.bytes / 8).div_ceil(every.max(1));
                let cfg = self.shared.launch_config(count);
                let mut l = self.stream.launch_builder(&kernels[3]);
                l.arg(&array).arg(&every).arg(&written);
                // SAFETY: matches gpuio_array_test_store, which stores through the array only.
                unsafe { l.launch(cfg) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_array_test_store)"))?;
            }
            ArrayLaunch::Bench {
                array,
                plain,
                rows,
                n,
                row_words,
                out,
                threads,
            } => {
                let cfg = self.shared.launch_config(u64::from(threads.max(32)));
                let (r, o) = (rows.addr(), out.addr());
                let plain = plain.map(|p| (p.addr(), (p.len / 8) as u64));
                let mut l;
                match (&array, &plain) {
                    (Some(a), _) => {
                        l = self
                            .stream
                            .launch_builder(&kernels[if row_words > 0 { 5 } else { 6 }]);
                        l.arg(a);
                    }
                    (None, Some(p)) if row_words == 0 => {
                        l = self.stream.launch_builder(&kernels[7]);
                        l.arg(&p.0).arg(&p.1);
                    }
                    _ => {
                        return Err(crate::HalError::InvalidArgument(
                            "benchmark reads: rows through an array, elements through either"
                                .into(),
                        ));
                    }
                }
                l.arg(&r).arg(&n);
                if row_words > 0 {
                    l.arg(&row_words);
                }
                l.arg(&o);
                // SAFETY: the arguments match the gpuio_*_bench_* kernel chosen above; it
                // reads `n` checked entries of `rows`, the array or the checked plain range
                // (indices past it read 0), and writes `n` rows or elements into the checked
                // `out` range.
                unsafe { l.launch(cfg) }.map_err(cuda_err("cuLaunchKernel(gpuio bench reads)"))?;
            }
            ArrayLaunch::Hold {
                array,
                frames,
                hold,
            } => {
                let (first, count) = (0u64, array.pages);
                let cfg = self.shared.launch_config(count);
                let f = frames.addr();
                let mut l = self
                    .stream
                    .launch_builder(&kernels[if hold { 8 } else { 9 }]);
                l.arg(&array).arg(&first).arg(&count).arg(&f);
                // SAFETY: matches gpuio_array_hold / gpuio_array_let_go, which touch the
                // array's pages and `count` u32s at `frames` (a range the caller checked to
                // hold one per page).
                unsafe { l.launch(cfg) }.map_err(cuda_err("cuLaunchKernel(gpuio_array_hold)"))?;
            }
            ArrayLaunch::ResidentBench {
                array,
                idx,
                n,
                out,
                threads,
            } => {
                let cfg = self.shared.launch_config(u64::from(threads.max(32)));
                let (i, o) = (idx.addr(), out.addr());
                let mut l = self.stream.launch_builder(&kernels[10]);
                l.arg(&array).arg(&i).arg(&n).arg(&o);
                // SAFETY: matches gpuio_resident_bench_elements: it reads `n` indices and
                // writes `n` u64s (checked ranges) and reads the held array's frames, which
                // stay allocated and pinned while the caller's hold lives.
                unsafe { l.launch(cfg) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_resident_bench_elements)"))?;
            }
            ArrayLaunch::Layout { out } => {
                let o = out.addr();
                let one = LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut l = self.stream.launch_builder(&kernels[4]);
                l.arg(&o);
                // SAFETY: the kernel writes ondemand::constants().len() u64s at `out`, a range
                // checked to hold them.
                unsafe { l.launch(one) }.map_err(cuda_err("cuLaunchKernel(gpuio_array_layout)"))?;
            }
        }
        self.stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }
}
