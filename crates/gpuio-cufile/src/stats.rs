//! `cuFileGetStatsL1/L2/L3`: counters kept by every call (relaxed atomics), reported at the
//! level `cuFileSetStatsLevel` (or the `PROFILE_STATS` parameter) asks for, once
//! `cuFileStatsStart` has been called.

use crate::abi::{
    CUfileOpCounter_t, CUfileStatsLevel1_t, CUfileStatsLevel2_t, CUfileStatsLevel3_t,
    STATS_MAX_GPUS,
};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Successes and failures of one kind of call.
#[derive(Default)]
pub struct Counter {
    ok: AtomicU64,
    err: AtomicU64,
}

impl Counter {
    /// Counts one call.
    pub fn count(&self, ok: bool) {
        if ok { &self.ok } else { &self.err }.fetch_add(1, Relaxed);
    }

    fn get(&self) -> CUfileOpCounter_t {
        CUfileOpCounter_t {
            ok: self.ok.load(Relaxed),
            err: self.err.load(Relaxed),
        }
    }

    fn reset(&self) {
        self.ok.store(0, Relaxed);
        self.err.store(0, Relaxed);
    }
}

/// Bytes, time and a size histogram of one direction.
#[derive(Default)]
pub struct Flow {
    pub calls: Counter,
    bytes: AtomicU64,
    micros: AtomicU64,
    /// Calls by size: bucket k holds sizes below 2^k KiB.
    hist: [AtomicU64; 32],
    /// Bytes and calls per GPU (the last entry: host memory).
    gpu_bytes: [AtomicU64; STATS_MAX_GPUS],
    gpu_calls: [AtomicU64; STATS_MAX_GPUS],
}

impl Flow {
    /// Counts one call that moved `bytes` (or failed) in `took`, to GPU `gpu` (None: host).
    pub fn record(&self, result: Result<usize, ()>, took: Duration, gpu: Option<u32>) {
        self.calls.count(result.is_ok());
        let Ok(bytes) = result else { return };
        self.bytes.fetch_add(bytes as u64, Relaxed);
        self.micros.fetch_add(took.as_micros() as u64, Relaxed);
        let kib = (bytes as u64).div_ceil(1024);
        let bucket = (u64::BITS - kib.leading_zeros()).min(31) as usize;
        self.hist[bucket].fetch_add(1, Relaxed);
        if let Some(g) = gpu.map(|g| g as usize).filter(|&g| g < STATS_MAX_GPUS) {
            self.gpu_bytes[g].fetch_add(bytes as u64, Relaxed);
            self.gpu_calls[g].fetch_add(1, Relaxed);
        }
    }

    fn totals(&self) -> (u64, u64, u64, u64) {
        let (ok, bytes, micros) = (
            self.calls.ok.load(Relaxed),
            self.bytes.load(Relaxed),
            self.micros.load(Relaxed),
        );
        let bw = (bytes as f64 / (micros.max(1) as f64 / 1e6)) as u64;
        (
            bytes,
            micros,
            micros / ok.max(1),
            if micros > 0 { bw } else { 0 },
        )
    }

    fn reset(&self) {
        self.calls.reset();
        for a in [&self.bytes, &self.micros]
            .into_iter()
            .chain(&self.hist)
            .chain(&self.gpu_bytes)
            .chain(&self.gpu_calls)
        {
            a.store(0, Relaxed);
        }
    }
}

/// Every counter.
#[derive(Default)]
pub struct Stats {
    pub level: AtomicI32,
    pub started: AtomicBool,
    pub read: Flow,
    pub write: Flow,
    pub readv: Flow,
    pub writev: Flow,
    pub handle_register: Counter,
    pub handle_deregister: Counter,
    pub buf_register: Counter,
    pub buf_deregister: Counter,
    pub batch_setup: Counter,
    pub batch_submit: Counter,
    pub batch_complete: Counter,
    pub batch_cancel: Counter,
    pub batch_destroy: Counter,
    pub batch_enqueued: Counter,
    pub batch_read_bytes: AtomicU64,
    pub batch_write_bytes: AtomicU64,
}

impl Stats {
    /// Zeroes every counter.
    pub fn reset(&self) {
        for f in [&self.read, &self.write, &self.readv, &self.writev] {
            f.reset();
        }
        for c in [
            &self.handle_register,
            &self.handle_deregister,
            &self.buf_register,
            &self.buf_deregister,
            &self.batch_setup,
            &self.batch_submit,
            &self.batch_complete,
            &self.batch_cancel,
            &self.batch_destroy,
            &self.batch_enqueued,
        ] {
            c.reset();
        }
        self.batch_read_bytes.store(0, Relaxed);
        self.batch_write_bytes.store(0, Relaxed);
    }

    /// Level 1.
    pub fn level1(&self) -> CUfileStatsLevel1_t {
        let (read_bytes, read_us, read_avg, read_bw) = self.read.totals();
        let (write_bytes, write_us, write_avg, write_bw) = self.write.totals();
        let (readv_bytes, readv_us, readv_avg, readv_bw) = self.readv.totals();
        let (writev_bytes, writev_us, writev_avg, writev_bw) = self.writev.totals();
        let per_sec = |n: u64, us: u64| (n * 1_000_000).checked_div(us).unwrap_or(0);
        let (r, w) = (self.read.calls.get(), self.write.calls.get());
        let submit = self.batch_submit.get();
        CUfileStatsLevel1_t {
            read_ops: r,
            write_ops: w,
            hdl_register_ops: self.handle_register.get(),
            hdl_deregister_ops: self.handle_deregister.get(),
            buf_register_ops: self.buf_register.get(),
            buf_deregister_ops: self.buf_deregister.get(),
            read_bytes,
            write_bytes,
            read_bw_bytes_per_sec: read_bw,
            write_bw_bytes_per_sec: write_bw,
            read_lat_avg_us: read_avg,
            write_lat_avg_us: write_avg,
            read_ops_per_sec: per_sec(r.ok, read_us),
            write_ops_per_sec: per_sec(w.ok, write_us),
            read_lat_sum_us: read_us,
            write_lat_sum_us: write_us,
            batch_submit_ops: submit,
            batch_complete_ops: self.batch_complete.get(),
            batch_setup_ops: self.batch_setup.get(),
            batch_cancel_ops: self.batch_cancel.get(),
            batch_destroy_ops: self.batch_destroy.get(),
            batch_enqueued_ops: self.batch_enqueued.get(),
            batch_posix_enqueued_ops: self.batch_enqueued.get(),
            batch_total_submit_ops: submit,
            batch_read_bytes: self.batch_read_bytes.load(Relaxed),
            batch_write_bytes: self.batch_write_bytes.load(Relaxed),
            readv_ops: self.readv.calls.get(),
            writev_ops: self.writev.calls.get(),
            readv_bytes,
            writev_bytes,
            readv_bw_bytes_per_sec: readv_bw,
            writev_bw_bytes_per_sec: writev_bw,
            readv_lat_avg_us: readv_avg,
            writev_lat_avg_us: writev_avg,
            readv_lat_sum_us: readv_us,
            writev_lat_sum_us: writev_us,
            ..Default::default()
        }
    }

    /// Level 2: level 1 and the size histograms.
    pub fn level2(&self) -> CUfileStatsLevel2_t {
        CUfileStatsLevel2_t {
            basic: self.level1(),
            read_size_kb_hist: std::array::from_fn(|k| self.read.hist[k].load(Relaxed)),
            write_size_kb_hist: std::array::from_fn(|k| self.write.hist[k].load(Relaxed)),
        }
    }

    /// Level 3: level 2 and per-GPU bytes and calls for the session's `gpus` GPUs.
    pub fn level3(&self, gpus: usize) -> CUfileStatsLevel3_t {
        let mut s = CUfileStatsLevel3_t {
            detailed: self.level2(),
            num_gpus: gpus.min(STATS_MAX_GPUS) as u32,
            ..Default::default()
        };
        for (g, e) in s.per_gpu_stats.iter_mut().enumerate().take(gpus) {
            e.read_bytes = self.read.gpu_bytes[g].load(Relaxed);
            e.n_total_reads = self.read.gpu_calls[g].load(Relaxed);
            e.n_posix_reads = e.n_total_reads;
            e.writes_bytes = self.write.gpu_bytes[g].load(Relaxed);
            e.n_total_writes = self.write.gpu_calls[g].load(Relaxed);
            e.n_posix_writes = e.n_total_writes;
        }
        s
    }
}
