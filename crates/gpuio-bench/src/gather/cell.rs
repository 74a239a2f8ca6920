//! One cell of the grid: a pool, a row size, and the races run on each of its index lists.

use super::lists::distinct_count;
use crate::{BenchError, Budget, Result, RowBytes, Timing, race};
use gpuio_hal::{DeviceBuffer, Gpu, HostBuffer, RowKernel, Stream};
use gpuio_transport_memio::{GatherIndices, GatherOptions, GatherReport, GatherStrategy, MemIo};
use rayon::prelude::*;
use std::time::Duration;

/// The paths `Auto` chooses among, in the order the notes count them.
pub(super) const PATHS: [GatherStrategy; 4] = [
    GatherStrategy::ZeroCopy,
    GatherStrategy::Sorted,
    GatherStrategy::CpuStaged,
    GatherStrategy::Hybrid,
];

/// GB/s for `bytes` moved in `t`.
pub(super) fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

/// An index list in host memory and the same list in device memory.
pub(super) struct List {
    /// The list in host memory.
    pub host: Vec<u64>,
    /// The same, as little-endian u64s in device memory.
    pub device: DeviceBuffer,
    /// What one gather of it moves.
    pub bytes: RowBytes,
}

impl List {
    /// Uploads `host` and counts its distinct rows.
    pub fn new(gpu: &Gpu, stream: &Stream, host: Vec<u64>, row: usize) -> Result<Self> {
        let raw: Vec<u8> = host.iter().flat_map(|i| i.to_le_bytes()).collect();
        let device = gpu.alloc(raw.len())?;
        stream.upload(&raw, &device, 0)?;
        let bytes = RowBytes {
            delivered_bytes: (host.len() * row) as u64,
            unique_bytes: (distinct_count(&host) * row) as u64,
        };
        Ok(Self {
            host,
            device,
            bytes,
        })
    }

    /// Rows in the list.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Bytes one gather of it delivers.
    pub fn out(&self) -> usize {
        self.bytes.delivered_bytes as usize
    }

    /// The device copy, as gpuio's call takes it.
    fn on_device(&self) -> GatherIndices<'_> {
        GatherIndices::Device {
            list: &self.device,
            count: self.len(),
        }
    }
}

/// What `Auto` (list in host memory, then in device memory) and the naive kernel measured on
/// one list.
pub(super) struct AutoRun {
    /// `Auto`, host list.
    pub host: Timing,
    /// Calls of those by each of [`PATHS`].
    pub host_paths: [usize; 4],
    /// `Auto`, device list.
    pub device: Timing,
    /// Calls of those by each of [`PATHS`].
    pub device_paths: [usize; 4],
    /// The naive kernel, alternating with the host-list calls.
    pub naive: Timing,
}

/// The path taken most often, by name (empty if none was counted).
pub(super) fn most_taken(paths: &[usize; 4]) -> String {
    (0..PATHS.len())
        .filter(|&i| paths[i] > 0)
        .max_by_key(|&i| paths[i])
        .map_or(String::new(), |i| format!("{:?}", PATHS[i]))
}

/// A cell's fixed parts: the engine, the pool, the row size, the destination.
pub(super) struct Cell<'a> {
    pub io: &'a MemIo,
    pub gpu: &'a Gpu,
    pub stream: &'a Stream,
    pub pool: &'a HostBuffer,
    pub row: usize,
    pub dst: &'a DeviceBuffer,
    pub budget: &'a Budget,
    /// The cell's name, for errors.
    pub case: &'a str,
}

impl Cell<'_> {
    /// gpuio's gather of `list` (host or device) by `strategy`.
    fn call(&self, list: GatherIndices<'_>, strategy: GatherStrategy) -> Result<GatherReport> {
        let opts = GatherOptions {
            strategy,
            ..GatherOptions::default()
        };
        self.io
            .gather(self.pool, self.row, list, self.dst, 0, &opts)
            .map_err(|e| BenchError::Gpuio(e.into()))
    }

    /// One HAL kernel over the device copy of `list`.
    fn kernel(&self, list: &List, kernel: RowKernel) -> Result<()> {
        let (pool, row) = (self.pool, self.row);
        let indices = (&list.device).into();
        Ok(self
            .stream
            .gather(pool, row, indices, list.len(), self.dst, 0, kernel)?)
    }

    /// Checks the destination against a CPU gather of `list`'s rows.
    pub fn check(&self, list: &List) -> Result<()> {
        let rb = self.row;
        let mut got = vec![0u8; list.len() * rb];
        self.io
            .download(self.dst, 0, &mut got)
            .map_err(gpuio_api::Error::from)?;
        let bad = got
            .par_chunks(rb)
            .zip(list.host.par_iter())
            .position_first(|(row, &r)| row != &self.pool[r as usize * rb..(r as usize + 1) * rb]);
        match bad {
            None => Ok(()),
            Some(i) => Err(BenchError::Corrupt {
                case: self.case.into(),
                size: rb,
                offset: (i * rb) as u64,
            }),
        }
    }

    /// `Auto` on `list`, first from host memory, then from device memory, each race
    /// alternating with the naive kernel; checked after each.
    pub fn race_auto(&self, list: &List) -> Result<AutoRun> {
        // Auto measures each path in its first calls (a warm-up and a measured call each) and
        // balances the hybrid's share over a few more: give it those before timing (a user's
        // steady state is what counts). A list on the device is a shape of its own.
        let host = GatherIndices::Host(&list.host);
        for _ in 0..20 {
            self.call(host, GatherStrategy::Auto)?;
        }
        let mut host_paths = [0usize; 4];
        let (auto, naive) = race(
            self.budget,
            |_| {
                let r = self.call(host, GatherStrategy::Auto)?;
                count(&mut host_paths, r.strategy);
                Ok(())
            },
            |_| self.kernel(list, RowKernel::Naive),
        )?;
        self.check(list)?;
        for _ in 0..20 {
            self.call(list.on_device(), GatherStrategy::Auto)?;
        }
        let mut device_paths = [0usize; 4];
        let (device, _) = race(
            self.budget,
            |_| {
                let r = self.call(list.on_device(), GatherStrategy::Auto)?;
                count(&mut device_paths, r.strategy);
                Ok(())
            },
            |_| self.kernel(list, RowKernel::Naive),
        )?;
        self.check(list)?;
        Ok(AutoRun {
            host: auto,
            host_paths,
            device,
            device_paths,
            naive,
        })
    }

    /// Each path forced on `list` (host list) back to back, the hybrid once more alternating
    /// with the naive kernel, and the tuned and sorted kernels alone on the device list: the
    /// note that says where `Auto`'s figure comes from. Returns the note and the fastest
    /// forced path.
    pub fn paths_note(&self, list: &List, auto: &AutoRun) -> Result<(String, GatherStrategy)> {
        let host = GatherIndices::Host(&list.host);
        // Back to back: alternating with another path would charge each for the state the
        // other leaves (busy cores, a cold device).
        let forced = |strategy| -> Result<Timing> {
            let (t, _) = race(
                self.budget,
                |_| self.call(host, strategy).map(|_| ()),
                |_| Ok(()),
            )?;
            self.check(list)?;
            Ok(t)
        };
        let zero = forced(GatherStrategy::ZeroCopy)?;
        let sorted = forced(GatherStrategy::Sorted)?;
        let staged = forced(GatherStrategy::CpuStaged)?;
        let hybrid = forced(GatherStrategy::Hybrid)?;
        // The same, each call right after the naive kernel's (as Auto's calls run): what a
        // call pays for the idle CPU and the GPU state a long peer call leaves.
        let (hybrid_after, _) = race(
            self.budget,
            |_| self.call(host, GatherStrategy::Hybrid).map(|_| ()),
            |_| self.kernel(list, RowKernel::Naive),
        )?;
        self.check(list)?;
        let (tuned, tuned_sorted) = race(
            self.budget,
            |_| self.kernel(list, RowKernel::Tuned),
            |_| self.kernel(list, RowKernel::Sorted),
        )?;
        self.check(list)?;
        let g = |t: Timing| gbps(list.out(), t.median);
        let gpu_share = self
            .io
            .gather_plan(
                self.pool,
                self.gpu,
                self.row,
                list.len(),
                gpuio_transport_memio::IndexPlace::Host,
            )
            .map_or(0.0, |p| p.gpu_share);
        let note = format!(
            "{}: auto {:.1} (calls by zero-copy / sorted / CPU-staged / hybrid: {:?}), \
             auto with the list on the device {:.1} ({:?}), \
             zero-copy {:.1} (kernel alone, device indices {:.1}), sorted {:.1} (kernel \
             alone {:.1}), CPU-staged {:.1}, hybrid {:.1} (GPU share {:.2}; {:.1} \
             alternating with the naive kernel), naive kernel {:.1} GB/s",
            self.case,
            g(auto.host),
            auto.host_paths,
            g(auto.device),
            auto.device_paths,
            g(zero),
            g(tuned),
            g(sorted),
            g(tuned_sorted),
            g(staged),
            g(hybrid),
            gpu_share,
            g(hybrid_after),
            g(auto.naive)
        );
        let rates = [g(zero), g(sorted), g(staged), g(hybrid)];
        let fastest = PATHS
            .iter()
            .zip(rates)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(GatherStrategy::Auto, |(p, _)| *p);
        Ok((note, fastest))
    }
}

fn count(paths: &mut [usize; 4], taken: GatherStrategy) {
    if let Some(i) = PATHS.iter().position(|s| *s == taken) {
        paths[i] += 1;
    }
}
