//! Launches of a device-planned load (`gpu/swap_in.rs`): the plan kernel (`kernels/ai.cu`),
//! then the tiered gather kernel (`kernels/gather.cu`) over the codes it wrote, then the
//! report's download and reset — one wait for all of it.

use super::driver::{self, cuda_err};
use super::rows::{WaitOnDrop, event_time, row_fn, widest_piece};
use super::stream::CudaStreamBackend;
use crate::error::Result;
use crate::gpu::backend::{StreamBackend, SwapInLaunch, SwapInRan};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// `gpuio_swap_in_plan`'s position in `kernels::AI.functions`.
const PLAN: usize = 4;
/// The plan's block: one per job (ai.cu's `GPUIO_SWAP_THREADS`).
const PLAN_THREADS: u32 = 1024;

impl CudaStreamBackend {
    /// Runs a device-planned load: [`StreamBackend::swap_in`](crate::gpu::backend::StreamBackend::swap_in).
    ///
    /// # Safety
    /// That of `StreamBackend::swap_in`.
    pub(super) unsafe fn run_swap_in(&self, launch: SwapInLaunch<'_>) -> Result<SwapInRan> {
        let plan_fn = &self.shared.ai_kernels()?[PLAN];
        let gather_fns = self.shared.row_kernels()?;
        self.shared.bind()?;
        let rb = launch.row_bytes as u64;
        let starts = launch
            .parts
            .iter()
            .flat_map(|p| [p.hot.addr(), p.warm.addr(), p.dst.addr()]);
        let (slot, width) = widest_piece(rb, starts);
        let jobs = launch.parts.len();
        let base = launch.table.addr();
        let (plans, codes) = (base + launch.plans_at as u64, base + launch.codes_at as u64);
        let report = base + launch.report_at as u64;
        let gather_report = report + 8;
        let words_len = 8 * (2 + jobs);
        // The failure and job words all ones before the plan, in stream order: whatever an
        // earlier call left (one that failed before its download) never reads as this one's.
        // SAFETY: the report range is 2 + jobs u64s of the table's device memory (its layout).
        unsafe { driver::memset_d8_async(report, 0xff, words_len, self.raw())? };
        let start = launch.timed.then(|| self.record(true)).transpose()?;
        let running = WaitOnDrop(Some(self));
        let mut l = self.stream.launch_builder(plan_fn);
        l.arg(&plans).arg(&codes).arg(&report);
        let config = LaunchConfig {
            grid_dim: (jobs as u32, 1, 1),
            block_dim: (PLAN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gpuio_swap_in_plan(const gpuio_swap_job*, u64* codes, u64* report).
        // Each plan job (written by the table, in its device memory) names a selection,
        // state, gather entry and code range the HAL checked and the table keeps alive, and
        // pinned control words registered for the call; the kernel touches only those
        // (positions are checked against the length, which the HAL bounds by the state's
        // positions) and the report words. We wait below before returning.
        unsafe { l.launch(config) }.map_err(cuda_err("cuLaunchKernel(gpuio_swap_in_plan)"))?;
        let most = launch
            .parts
            .iter()
            .map(|p| p.dst.len as u64 / rb)
            .max()
            .unwrap_or(0);
        let mut config = self.shared.launch_config((most * (rb / width)).div_ceil(4));
        config.grid_dim.1 = jobs as u32;
        let mut g = self
            .stream
            .launch_builder(&gather_fns[row_fn::TIERED + slot]);
        g.arg(&base).arg(&codes).arg(&rb).arg(&gather_report);
        // SAFETY: matches gpuio_gather_tiered_W(const void* jobs, const u64* codes, u64
        // row_bytes, u64* err). The gather table at the table's start names per job its
        // checked hot range, registered warm pool and checked destination, and a count the
        // plan wrote (at most the destination's rows, 0 where it failed); the kernel checks
        // every code against the tiers, so it touches only those ranges and its report word.
        unsafe { g.launch(config) }.map_err(cuda_err("cuLaunchKernel(gpuio_gather_tiered)"))?;
        let end = start.is_some().then(|| self.record(true)).transpose()?;
        let mut words = vec![0u64; 2 + jobs];
        // SAFETY: `words` holds 2 + jobs writable u64s, untouched until the wait below; the
        // report range is that long (the table's layout).
        unsafe {
            driver::memcpy_dtoh_async(words.as_mut_ptr().cast(), report, words_len, self.raw())?
        };
        running.wait()?;
        Ok(SwapInRan {
            report: words,
            device_time: event_time(start, end)?,
        })
    }
}
