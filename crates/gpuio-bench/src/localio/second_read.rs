//! The LocalIO suite's second-read part: reads of 4 KiB, 64 MiB and 1 GiB of the page-cached
//! test file into GPU memory, three times each on an engine of its own. The second read of a
//! file asks for its whole registration (made in the background), so it must run as fast as
//! the same second read through the lanes (a fresh engine that keeps nothing); the third,
//! after the registration is made, is one copy from pinned pages.

use super::{api, median};
use crate::{Record, Result, human};
use gpuio_api::{FileHandle, OpenOptions};
use gpuio_hal::Gpu;
use gpuio_transport_localio::{LocalIo, LocalIoConfig};
use std::path::Path;
use std::time::{Duration, Instant};

const SIZES: [usize; 3] = [4 << 10, 64 << 20, 1 << 30];

/// Runs the part on `path` (`size` bytes, page cached) with engines configured as `base`;
/// `warmup` is another file of at least 256 MiB, read first by each engine so that its lanes
/// exist before the timed reads.
pub(super) fn run(
    gpu: &Gpu,
    base: &LocalIoConfig,
    path: &Path,
    size: u64,
    warmup: &Path,
    reps: usize,
    device: &str,
) -> Result<Vec<Record>> {
    let dev = gpu.alloc(SIZES[2].min(size as usize))?;
    let warm_engine = |keep: u64| -> Result<(LocalIo, FileHandle)> {
        let io = LocalIo::new(LocalIoConfig {
            page_cache_keep: keep,
            ..base.clone()
        })
        .map_err(api)?;
        let w = io.open(warmup, OpenOptions::READ).map_err(api)?;
        let n = (w.len().map_err(api)? as usize).min(dev.len());
        io.read_to_device(&w, 0, &dev, 0, n).map_err(api)?;
        let f = io.open(path, OpenOptions::READ).map_err(api)?;
        Ok((io, f))
    };
    let timed = |io: &LocalIo, f: &FileHandle, n: usize| -> Result<Duration> {
        let t = Instant::now();
        io.read_to_device(f, 0, &dev, 0, n).map_err(api)?;
        Ok(t.elapsed())
    };
    let mut records = Vec::new();
    for n in SIZES.into_iter().filter(|&n| n as u64 <= size) {
        // Medians over `reps` rounds of fresh engines: the second read of one that keeps
        // nothing, and the first, second and third reads of one that keeps registrations.
        let mut order = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        let mut route = String::new();
        for _ in 0..reps.max(1) {
            let (plain, plain_file) = warm_engine(0)?;
            timed(&plain, &plain_file, n)?;
            order[3].push(timed(&plain, &plain_file, n)?);
            drop(plain);
            let (io, f) = warm_engine(base.page_cache_keep)?;
            order[0].push(timed(&io, &f, n)?);
            order[1].push(timed(&io, &f, n)?);
            io.wait_for_page_cache();
            order[2].push(timed(&io, &f, n)?);
            route = io
                .read_to_device(&f, 0, &dev, 0, n)
                .map_err(api)?
                .to_string();
        }
        let [first, second, third, through_lanes] = order.map(median);
        let gbps = |t: Duration| n as f64 / t.as_secs_f64().max(1e-9) / 1e9;
        let case = format!("second_read/{}", human(n));
        for (peer, t) in [
            ("the same read through the lanes", through_lanes),
            ("first read", first),
            ("third read (after the registration)", third),
        ] {
            records.push(Record {
                bytes: n,
                route: route.clone(),
                device: device.into(),
                reps,
                ..Record::versus(
                    super::SUITE,
                    (&case, "bandwidth", "GB/s"),
                    gbps(second),
                    peer,
                    gbps(t),
                    true,
                )
            });
        }
    }
    Ok(records)
}
