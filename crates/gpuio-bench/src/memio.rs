//! The MemIO suite: host↔GPU (pinned and pageable) and GPU↔GPU copies through gpuio against
//! `cudaMemcpy` called directly through the driver on the same buffers (a plain memcpy on the
//! host backend). Inputs rotate among buffers totalling at least 512 MiB so that neither side
//! is measured out of the CPU caches; every case is checked on fresh random data.

use crate::{Budget, Record, Result, Target, human, race};
use gpuio_api::Session;
use gpuio_hal::{Backend, HostAllocOptions, HostBuffer, pattern};
use rayon::prelude::*;
use std::cell::RefCell;

/// The sizes measured by default on a backend.
pub fn default_sizes(backend: Backend) -> Vec<usize> {
    let mut sizes = vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20];
    if backend == Backend::Cuda {
        sizes.push(1 << 30);
    }
    sizes
}

/// The suite's name in records and file names.
pub const SUITE: &str = "memio";

const ROTATE_BYTES: usize = 512 << 20;

/// How many buffers of `size` the inputs rotate among.
fn rotation(size: usize) -> usize {
    ROTATE_BYTES.div_ceil(size).clamp(1, 8)
}

/// Host memory the buffers of one size hold at once, in bytes: `(pinned, total)`. The inputs
/// rotate among as many pinned as pageable buffers; on the host backend the two "device"
/// buffers are host memory too.
pub fn host_bytes(size: usize, backend: Backend) -> (u64, u64) {
    let size = size as u64;
    let pinned = size.saturating_mul(rotation(size as usize) as u64);
    let device = match backend {
        Backend::Host => size.saturating_mul(2),
        Backend::Cuda => 0,
    };
    (pinned, pinned.saturating_mul(2).saturating_add(device))
}

/// Refuses `sizes` where one size's buffers together need more host memory than the machine
/// can back: `room` (memory and swap) for all of them, `pinned_room` (memory alone: pinned
/// pages cannot be swapped out) for the pinned ones; `None` where unknown. Checked before
/// anything is allocated, since each buffer alone may fit where their sum does not. Each
/// size's buffers are freed before the next size's are made, so sizes do not add up.
pub fn check_host_memory(
    sizes: &[usize],
    backend: Backend,
    room: Option<u64>,
    pinned_room: Option<u64>,
) -> Result<()> {
    for &size in sizes {
        let (pinned, total) = host_bytes(size, backend);
        let short = [
            (total, room, "memory and swap"),
            (pinned, pinned_room, "memory alone, for pinned buffers"),
        ]
        .into_iter()
        .find(|&(need, have, _)| have.is_some_and(|have| need > have));
        if let Some((need, have, what)) = short {
            let k = rotation(size);
            let device = if backend == Backend::Host {
                ", and its 2 device buffers in host memory"
            } else {
                ""
            };
            return Err(gpuio_api::Error::Core(gpuio_core::CoreError::Failed {
                code: gpuio_core::ErrorCode::NoMem,
                message: format!(
                    "out of memory: memio at {} needs {need} bytes of host memory at once \
                     ({k} pinned and {k} pageable input buffers{device}), but this machine can \
                     back about {} bytes now ({what}); nothing was allocated: choose smaller \
                     --sizes",
                    human(size),
                    have.unwrap_or(0),
                ),
            })
            .into());
        }
    }
    Ok(())
}

fn fill_par(buf: &mut [u8], seed: u64) {
    const PIECE: usize = 1 << 20;
    buf.par_chunks_mut(PIECE)
        .enumerate()
        .for_each(|(i, c)| pattern::fill(c, (i * PIECE) as u64, seed));
}

fn deviation_par(buf: &[u8], seed: u64) -> Option<u64> {
    const PIECE: usize = 16 << 20;
    buf.par_chunks(PIECE)
        .enumerate()
        .filter_map(|(i, c)| {
            pattern::first_deviation(c, (i * PIECE) as u64, seed).map(|o| (i * PIECE + o) as u64)
        })
        .min()
}

fn corrupt(case: &str, size: usize, offset: u64) -> crate::BenchError {
    crate::BenchError::Corrupt {
        case: case.into(),
        size,
        offset,
    }
}

/// Runs the suite on GPU 0; `progress` hears about each case as it starts.
pub fn run(
    session: &Session,
    sizes: &[usize],
    budget: &Budget,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>)> {
    let gpu = session.gpu(0)?.clone();
    let memio = session.memio();
    let backend = gpu.backend();
    check_host_memory(
        sizes,
        backend,
        gpuio_hal::memory::backing::backable_bytes(true),
        gpuio_hal::memory::backing::backable_bytes(false),
    )?;
    let peer = match backend {
        Backend::Cuda => "cudaMemcpy",
        Backend::Host => "memcpy",
    };
    let device = gpu.info().name.clone();
    let stream = gpu.stream()?;
    let mut records = Vec::new();
    let mut extra = Vec::new();

    for &size in sizes {
        let k = rotation(size);
        let dev_a = gpu.alloc(size)?;
        let dev_b = gpu.alloc(size)?;
        let mut pinned = (0..k)
            .map(|_| HostBuffer::alloc_pinned(size, &HostAllocOptions::default(), &gpu))
            .collect::<gpuio_hal::Result<Vec<_>>>()?;
        let mut pageable: Vec<Vec<u8>> = (0..k).map(|_| vec![0u8; size]).collect();
        let seed = crate::fresh_seed();
        for b in &mut pageable {
            fill_par(b, seed);
        }
        for b in &mut pinned {
            fill_par(b, seed);
        }
        let mut record =
            |case: &str, route: String, (ours, theirs): (crate::Timing, crate::Timing)| {
                let gbps = |t: crate::Timing| size as f64 / t.median.as_secs_f64().max(1e-12) / 1e9;
                let (value, peer_value) = (gbps(ours), gbps(theirs));
                records.push(Record {
                    suite: SUITE.into(),
                    case: format!("{case}/{}", human(size)),
                    metric: "bandwidth".into(),
                    value,
                    unit: "GB/s".into(),
                    peer: peer.into(),
                    peer_value,
                    ratio: value / peer_value,
                    bytes: size,
                    route,
                    device: device.clone(),
                    reps: ours.reps,
                    rows: None,
                });
            };

        // Host to device, pinned and pageable.
        for case in ["h2d_pinned", "h2d_pageable"] {
            progress(&format!("{case} {}", human(size)));
            let src = |i: usize| -> &[u8] {
                if case == "h2d_pinned" {
                    &pinned[i % k]
                } else {
                    &pageable[i % k]
                }
            };
            let mut route = String::new();
            let t = race(
                budget,
                |i| {
                    route = memio
                        .upload(src(i), &dev_a, 0)
                        .map_err(gpuio_api::Error::from)?
                        .to_string();
                    Ok(())
                },
                |i| Ok(gpu.baseline_upload(src(i), &dev_a, 0)?),
            )?;
            let seed = crate::fresh_seed();
            let first = if case == "h2d_pinned" {
                &mut pinned[0][..]
            } else {
                &mut pageable[0][..]
            };
            fill_par(first, seed);
            memio
                .upload(first, &dev_a, 0)
                .map_err(gpuio_api::Error::from)?;
            stream.fill_pattern(&dev_b, 0, size, seed)?;
            if let Some(off) = stream.find_mismatch(&dev_a, 0, &dev_b, 0, size)? {
                return Err(corrupt(case, size, off));
            }
            record(case, route, t);
        }

        // Device to host, pinned and pageable.
        for case in ["d2h_pinned", "d2h_pageable"] {
            progress(&format!("{case} {}", human(size)));
            stream.fill_pattern(&dev_a, 0, size, seed)?;
            stream.synchronize()?;
            let outs: Vec<&mut [u8]> = if case == "d2h_pinned" {
                pinned.iter_mut().map(|b| &mut b[..]).collect()
            } else {
                pageable.iter_mut().map(|b| &mut b[..]).collect()
            };
            // The two sides run alternately, never at once: a RefCell lends each the buffers.
            let outs = RefCell::new(outs);
            let mut route = String::new();
            let t = race(
                budget,
                |i| {
                    let mut o = outs.borrow_mut();
                    route = memio
                        .download(&dev_a, 0, o[i % k])
                        .map_err(gpuio_api::Error::from)?
                        .to_string();
                    Ok(())
                },
                |i| Ok(gpu.baseline_download(&dev_a, 0, outs.borrow_mut()[i % k])?),
            )?;
            let check_seed = crate::fresh_seed();
            stream.fill_pattern(&dev_a, 0, size, check_seed)?;
            stream.synchronize()?;
            let mut outs = outs.into_inner();
            memio
                .download(&dev_a, 0, outs[0])
                .map_err(gpuio_api::Error::from)?;
            if let Some(off) = deviation_par(outs[0], check_seed) {
                return Err(corrupt(case, size, off));
            }
            record(case, route, t);
        }

        // Pageable memory registered for one copy (register, one DMA, unregister) against the
        // staged pipeline on 4 threads and on the configured ones: where registering pays, a
        // one-off copy could skip staging. (The driver serializes registration with copies,
        // so pipelining registrations of chunks gains nothing over one.)
        if backend == Backend::Cuda && size >= 64 << 20 {
            progress(&format!("pageable registered {}", human(size)));
            let four = gpuio_transport_memio::MemIo::new(
                session.gpus().to_vec(),
                gpuio_transport_memio::MemIoConfig {
                    threads: 4,
                    ..memio.config().clone()
                },
            )
            .map_err(gpuio_api::Error::from)?;
            let buf = RefCell::new(&mut pageable[0]);
            let up = |registered: bool| -> Result<()> {
                let mut b = buf.borrow_mut();
                if registered {
                    gpu.with_registered(&mut b[..], |b| stream.upload(b, &dev_a, 0))??;
                } else {
                    four.upload(&b[..], &dev_a, 0)
                        .map_err(gpuio_api::Error::from)?;
                }
                Ok(())
            };
            let h2d = race(budget, |_| up(true), |_| up(false))?;
            let down = |registered: bool| -> Result<()> {
                let mut b = buf.borrow_mut();
                if registered {
                    gpu.with_registered(&mut b[..], |b| stream.download(&dev_a, 0, b))??;
                } else {
                    four.download(&dev_a, 0, &mut b[..])
                        .map_err(gpuio_api::Error::from)?;
                }
                Ok(())
            };
            let d2h = race(budget, |_| down(true), |_| down(false))?;
            let gbps = |t: crate::Timing| size as f64 / t.median.as_secs_f64().max(1e-12) / 1e9;
            for (case, (ours, theirs)) in [
                ("h2d_pageable_registered", h2d),
                ("d2h_pageable_registered", d2h),
            ] {
                extra.push(Record {
                    suite: SUITE.into(),
                    case: format!("{case}/{}", human(size)),
                    metric: "bandwidth".into(),
                    value: gbps(ours),
                    unit: "GB/s".into(),
                    peer: "gpuio staged pipeline (4 threads)".into(),
                    peer_value: gbps(theirs),
                    ratio: gbps(ours) / gbps(theirs),
                    bytes: size,
                    route: "cuMemHostRegister, one DMA, cuMemHostUnregister".into(),
                    device: device.clone(),
                    reps: ours.reps,
                    rows: None,
                });
            }
        }

        // Device to device.
        progress(&format!("d2d {}", human(size)));
        let mut route = String::new();
        let t = race(
            budget,
            |_| {
                route = memio
                    .copy_device(&dev_a, 0, &dev_b, 0, size)
                    .map_err(gpuio_api::Error::from)?
                    .to_string();
                Ok(())
            },
            |_| Ok(gpu.baseline_copy_device(&dev_a, &dev_b, size)?),
        )?;
        let check_seed = crate::fresh_seed();
        stream.fill_pattern(&dev_a, 0, size, check_seed)?;
        stream.synchronize()?;
        memio
            .copy_device(&dev_a, 0, &dev_b, 0, size)
            .map_err(gpuio_api::Error::from)?;
        if let Some(off) = stream.find_mismatch(&dev_a, 0, &dev_b, 0, size)? {
            return Err(corrupt("d2d", size, off));
        }
        record("d2d", route, t);
    }
    let targets = if backend == Backend::Cuda {
        targets(&records)
    } else {
        Vec::new()
    };
    records.extend(extra);
    Ok((records, targets))
}

/// The foundation issue's targets, judged on this run's records.
pub fn targets(records: &[Record]) -> Vec<Target> {
    let ratio = |case: &'static str, min: usize| {
        move |r: &Record| r.case.starts_with(case) && r.bytes >= min
    };
    vec![
        Target::judge(
            "pinned H2D >= 0.97x cudaMemcpy, sizes >= 16 MiB",
            records,
            ratio("h2d_pinned/", 16 << 20),
            |r| r.ratio,
            0.97,
            "x",
        ),
        Target::judge(
            "pinned D2H >= 0.97x cudaMemcpy, sizes >= 16 MiB",
            records,
            ratio("d2h_pinned/", 16 << 20),
            |r| r.ratio,
            0.97,
            "x",
        ),
        Target::judge(
            "pageable H2D >= 3x pageable cudaMemcpy, sizes >= 64 MiB",
            records,
            ratio("h2d_pageable/", 64 << 20),
            |r| r.ratio,
            3.0,
            "x",
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--sizes 2G` on the host backend holds 8 GiB at once (one pinned and one pageable
    /// input, two device buffers): refused where 6 GiB can be backed although each 2 GiB
    /// buffer alone fits, and the error names what is needed and what is there.
    #[test]
    fn the_sum_of_a_sizes_buffers_is_checked_not_each_buffer() {
        let gib = 1u64 << 30;
        assert_eq!(host_bytes(2 << 30, Backend::Host), (2 * gib, 8 * gib));
        assert_eq!(host_bytes(2 << 30, Backend::Cuda), (2 * gib, 4 * gib));
        // Small sizes rotate among 8 buffers of each kind.
        assert_eq!(host_bytes(1 << 20, Backend::Cuda), (8 << 20, 16 << 20));

        let err =
            check_host_memory(&[1 << 20, 2 << 30], Backend::Host, Some(6 * gib), None).unwrap_err();
        let shown = err.to_string();
        assert!(
            shown.contains("needs 8589934592 bytes") && shown.contains("about 6442450944 bytes"),
            "{shown}"
        );
        match err {
            crate::BenchError::Gpuio(e) => assert_eq!(e.code(), gpuio_core::ErrorCode::NoMem),
            other => panic!("{other}"),
        }
        assert!(check_host_memory(&[2 << 30], Backend::Host, Some(8 * gib), None).is_ok());
        // Pinned buffers cannot be swapped: memory alone must hold them.
        let err = check_host_memory(&[2 << 30], Backend::Cuda, Some(8 * gib), Some(gib));
        assert!(err.unwrap_err().to_string().contains("pinned"));
        // Unknown room: nothing to check against.
        assert!(check_host_memory(&[usize::MAX], Backend::Host, None, None).is_ok());
    }
}
