//! Launches of a device-planned load (`gpu/swap_in.rs`): the control words' upload, the fetch
//! kernel and the report's download — the call waits for these — then the install kernel,
//! which the call leaves running (`kernels/ai.cu`).

use super::driver::{self, cuda_err};
use super::rows::{WaitOnDrop, elapsed, widest_piece};
use super::stream::CudaStreamBackend;
use crate::error::Result;
use crate::gpu::backend::{StreamBackend, SwapInLaunch, SwapInRan};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// `gpuio_swap_in_fetch`'s and `gpuio_swap_in_install`'s positions in `kernels::AI.functions`.
const FETCH: usize = 4;
const INSTALL: usize = 5;
/// The fetch's block and the selection entries each block looks up (ai.cu's
/// `GPUIO_SWAP_FETCH_THREADS`, `GPUIO_SWAP_FETCH_ENTRIES`).
const FETCH_THREADS: u32 = 256;
const FETCH_ENTRIES: u64 = 32;
/// The install's block, one per job (ai.cu's `GPUIO_SWAP_THREADS`).
const INSTALL_THREADS: u32 = 1024;

impl CudaStreamBackend {
    /// Runs a device-planned load: [`StreamBackend::swap_in`](crate::gpu::backend::StreamBackend::swap_in).
    ///
    /// # Safety
    /// That of `StreamBackend::swap_in`.
    pub(super) unsafe fn run_swap_in(&self, launch: SwapInLaunch<'_>) -> Result<SwapInRan> {
        let module = self.shared.module(&crate::kernels::AI)?;
        let kernels = &module.functions;
        let (fetch_fn, install_fn) = (&kernels[FETCH], &kernels[INSTALL]);
        self.shared.bind()?;
        let rb = launch.row_bytes as u64;
        let jobs = launch.parts.len();
        let base = launch.table.addr();
        let staging = base + launch.staging_at as u64;
        let starts = launch
            .parts
            .iter()
            .flat_map(|p| [p.hot.addr(), p.warm.addr(), p.dst.addr()])
            .chain([staging]);
        let (_, width) = widest_piece(rb, starts);
        let report = base + launch.report_at as u64;
        let words_len = 8 * (1 + 2 * jobs);
        let words_at = launch.report_host.as_mut_slice();
        if words_at.len() < words_len {
            return Err(crate::error::HalError::InvalidArgument(
                "swap-in: a report buffer shorter than its words".into(),
            ));
        }
        let running = WaitOnDrop(Some(self));
        // SAFETY: the control words are 16 bytes a job of pinned memory the caller keeps
        // until the call returns, which is after the fetch (behind this copy) is waited for;
        // the destination is the table's control range (its layout).
        unsafe {
            driver::memcpy_htod_async(
                base + launch.control_at as u64,
                launch.control.base_ptr(),
                16 * jobs,
                self.raw(),
            )?
        };
        // The upload goes ahead of the clock, as the peers' index lists do: the host knows
        // each length and count before the selection is there.
        let start = launch.timed.then(|| self.record(true)).transpose()?;
        let most = launch
            .parts
            .iter()
            .map(|p| p.load.count as u64)
            .max()
            .unwrap_or(0);
        let mut l = self.stream.launch_builder(fetch_fn);
        l.arg(&base).arg(&rb).arg(&width).arg(&report);
        let config = LaunchConfig {
            grid_dim: (most.div_ceil(FETCH_ENTRIES).max(1) as u32, jobs as u32, 1),
            block_dim: (FETCH_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gpuio_swap_in_fetch(jobs, u64 rb, u64 width, u64* report). The jobs
        // name only ranges the HAL checked and the table keeps alive, and a registered warm
        // pool; the kernel follows positions below the length and slots below the job's slots,
        // and writes only those rows and slot words, the report words and the table's own
        // words (the selection's copy, the hit bits). `width` divides every row and address.
        unsafe { l.launch(config) }.map_err(cuda_err("cuLaunchKernel(gpuio_swap_in_fetch)"))?;
        let end = start.is_some().then(|| self.record(true)).transpose()?;
        // SAFETY: `words_at` is pinned host memory of at least `words_len` bytes, borrowed
        // mutably for the call and untouched until the wait below (so the copy runs without
        // holding the host up, and the install queues right behind it); the report range is
        // that long (the table's layout).
        unsafe { driver::memcpy_dtoh_async(words_at.as_mut_ptr(), report, words_len, self.raw())? };
        let fetched = self.record(false)?;
        let mut l = self.stream.launch_builder(install_fn);
        l.arg(&base).arg(&rb).arg(&width).arg(&report);
        let config = LaunchConfig {
            grid_dim: (jobs as u32, 1, 1),
            block_dim: (INSTALL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gpuio_swap_in_install(const gpuio_swap_job*, u64 rb, u64 width,
        // u64* report). It reads the same jobs, control words and report words, follows
        // only positions and slots inside the state's tables (a victim's position outside
        // them flags the state instead), copies staging rows below max_count into slots
        // below the job's slots, and resets the report words. The table waits for it before
        // it lets the buffers go (the event returned below).
        unsafe { l.launch(config) }.map_err(cuda_err("cuLaunchKernel(gpuio_swap_in_install)"))?;
        let installed = self.record(launch.timed)?;
        fetched.synchronize()?;
        let words = words_at
            .chunks_exact(8)
            .take(1 + 2 * jobs)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
            .collect();
        // The fetch is done and nothing failed: the install may run on after the call.
        let mut running = running;
        running.0 = None;
        let (device_time, install_time, installing) = match (start, end) {
            (Some(start), Some(end)) => {
                installed.synchronize()?;
                let fetch = elapsed(start.as_ref(), end.as_ref())?;
                let install = elapsed(end.as_ref(), installed.as_ref())?;
                (Some(fetch), Some(install), None)
            }
            _ => (None, None, Some(installed)),
        };
        Ok(SwapInRan {
            report: words,
            device_time,
            install_time,
            installing,
        })
    }
}
