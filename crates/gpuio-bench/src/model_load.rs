//! The localio suite's model-load case: a directory of safetensors-sized files (8 × 1.1 GiB on
//! a GPU) loaded into GPU memory, one buffer per file, cold (pages dropped before each load),
//! warm (one-off reads) and hot (loaded again: kept page cache registrations), against torch
//! reading each file whole and moving it with `.cuda()` (what a safetensors CPU load and
//! `.cuda()` do), and kvikio where it is installed.

use crate::localio::{Cleanup, Options, SUITE, api, check_device, make_file, peer};
use crate::peers::{self, PeerResult};
use crate::{Record, Result, human};
use gpuio_api::{FileHandle, OpenOptions};
use gpuio_hal::{Backend, DeviceBuffer, Gpu};
use gpuio_transport_localio::{LocalIo, LocalIoConfig};
use std::path::PathBuf;
use std::time::Instant;

/// Files and the size of each.
fn shape(backend: Backend) -> (usize, usize) {
    if backend == Backend::Cuda {
        (8, 1100 << 20)
    } else {
        (4, 16 << 20)
    }
}

/// Runs the case on `gpu`; `io` is the session's engine (it keeps registrations).
pub(crate) fn run(
    gpu: &Gpu,
    io: &LocalIo,
    opts: &Options,
    notes: &mut Vec<String>,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Record>> {
    let (n, each) = shape(gpu.info().backend);
    let total = n * each;
    progress(&format!("model_load: writing {n} x {}", human(each)));
    let paths: Vec<PathBuf> = (0..n)
        .map(|i| {
            opts.scratch.join(format!(
                "gpuio-model-{}-{i}.safetensors",
                std::process::id()
            ))
        })
        .collect();
    let _cleanup = Cleanup(paths.clone());
    let seed = crate::fresh_seed();
    for (i, p) in paths.iter().enumerate() {
        make_file(p, each as u64, seed ^ i as u64)?;
    }
    let files: Vec<FileHandle> = paths
        .iter()
        .map(|p| io.open(p, OpenOptions::READ).map_err(api))
        .collect::<Result<_>>()?;
    let bufs: Vec<DeviceBuffer> = (0..n).map(|_| gpu.alloc(each)).collect::<Result<_, _>>()?;
    let once = LocalIo::new(LocalIoConfig {
        page_cache_keep: 0,
        ..io.config().clone()
    })
    .map_err(api)?;
    // GB/s of one load of every file, each into its own buffer.
    let load = |engine: &LocalIo, cold: bool| -> Result<f64> {
        if cold {
            for f in &files {
                f.drop_cache().map_err(api)?;
            }
        }
        let t = Instant::now();
        for (f, b) in files.iter().zip(&bufs) {
            engine.read_to_device(f, 0, b, 0, each).map_err(api)?;
        }
        Ok(total as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9)
    };
    let reps = opts.reps.max(1);
    // The median of `reps` loads after one unmeasured.
    let timed = |engine: &LocalIo, cold: bool| -> Result<f64> {
        load(engine, cold)?;
        let mut v = (0..reps)
            .map(|_| load(engine, cold))
            .collect::<Result<Vec<_>>>()?;
        v.sort_by(f64::total_cmp);
        Ok(v[v.len() / 2])
    };
    progress("model_load cold");
    let cold = timed(&once, true)?;
    progress("model_load warm");
    let warm = timed(&once, false)?;
    progress("model_load hot");
    // The second load asks for the registrations, made in the background; then every load
    // is hot.
    load(io, false)?;
    load(io, false)?;
    io.wait_for_page_cache();
    let hot = timed(io, false)?;
    let route = |engine: &LocalIo| -> Result<String> {
        Ok(engine
            .read_to_device(&files[0], 0, &bufs[0], 0, each)
            .map_err(api)?
            .to_string())
    };
    let (warm_route, hot_route) = (route(&once)?, route(io)?);
    io.release_page_cache();
    // Every buffer holds its file.
    let reference = gpu.alloc(each)?;
    for (i, b) in bufs.iter().enumerate() {
        check_device(gpu, b, &reference, each, seed ^ i as u64, "model_load")?;
    }
    drop(reference);
    let mut torch = |mode: &str| -> Option<PeerResult> {
        peer(
            notes,
            &format!("torch load {mode}"),
            peers::torch_load(&paths, mode, reps),
        )
    };
    let mut out = Vec::new();
    let device = gpu.info().name.clone();
    let case = format!("model_load_{n}x{}", human(each).replace(' ', ""));
    let mut add = |what: &str, ours: f64, route: &str, peer_name: &str, theirs: f64| {
        out.push(Record {
            suite: SUITE.into(),
            case: format!("{case}/{what}"),
            metric: "bandwidth".into(),
            value: ours,
            unit: "GB/s".into(),
            peer: peer_name.into(),
            peer_value: theirs,
            ratio: ours / theirs,
            bytes: total,
            route: route.into(),
            device: device.clone(),
            reps,
            rows: None,
        });
    };
    let lanes_route = format!("{} lanes", io.config().lanes);
    if let Some(t) = torch("cold") {
        add(
            "cold",
            cold,
            &lanes_route,
            "torch read + .cuda() (cold)",
            t.bytes_per_s / 1e9,
        );
    }
    if let Some(t) = torch("warm") {
        add(
            "warm",
            warm,
            &warm_route,
            "torch read + .cuda()",
            t.bytes_per_s / 1e9,
        );
        add(
            "hot",
            hot,
            &hot_route,
            "torch read + .cuda()",
            t.bytes_per_s / 1e9,
        );
    } else {
        add("hot", hot, &hot_route, "gpuio one-off warm load", warm);
    }
    Ok(out)
}
