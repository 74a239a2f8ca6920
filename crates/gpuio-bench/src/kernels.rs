//! The `kernels` suite: what first use of gpuio's kernel modules costs a process (GPU machine
//! only). Each module of `kernels/` is loaded fresh, again and again, the way gpuio loads it
//! (its embedded machine code where it has some for the device, else its embedded PTX, which
//! the driver JIT-compiles) against the way every module was loaded before device code was
//! embedded: NVRTC compiling the source, then the driver loading NVRTC's PTX. The embedded
//! PTX's load is timed beside them (what a device without machine code pays). `all` loads
//! every module, which is what a process that uses every GPU feature pays once.
//!
//! The driver keeps what it JIT-compiles in its cache (`~/.nv/ComputeCache`), so after the
//! warm-up PTX loads find compiled code there and NVRTC's difference is its compile; run with
//! `CUDA_CACHE_DISABLE=1` to time the JIT itself too, as on a machine's first run or in a
//! fresh container. The warm-up also absorbs what a process pays once whichever way it loads
//! (opening libnvrtc, the driver's JIT compiler): the figures are per module.

use crate::{Budget, Record, Result, Target, race};
use gpuio_api::Session;
use gpuio_hal::kernels::{KernelPath, KernelSource};
use gpuio_hal::{Backend, Gpu};
use std::time::Duration;

/// The suite's name.
pub const SUITE: &str = "kernels";

/// The peer's name in the records.
const PEER: &str = "NVRTC + driver load";

/// How many loads the suite times.
#[derive(Debug, Clone)]
pub struct Options {
    /// Timed loads of each side per case (after one untimed), the median recorded. A fixed
    /// count rather than a time budget: the embedded side is so much faster that a minimum
    /// time for it would run NVRTC hundreds of times.
    pub reps: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self { reps: 9 }
    }
}

impl Options {
    /// A short run.
    pub fn quick() -> Self {
        Self { reps: 3 }
    }

    fn budget(&self) -> Budget {
        Budget {
            warmup: 1,
            min_reps: self.reps.max(1),
            max_reps: self.reps.max(1),
            min_time: Duration::ZERO,
        }
    }
}

/// One module (or `all`) raced both ways.
fn case(
    gpu: &Gpu,
    name: &str,
    modules: &[&KernelSource],
    budget: &Budget,
    notes: &mut Vec<String>,
) -> Result<Record> {
    let cc = gpu.info().compute_capability.unwrap_or((0, 0));
    // The way gpuio's own load goes: the machine code where some fits and the driver takes
    // it, else the PTX.
    let embedded = |src: &KernelSource| match src.cubin_for(cc) {
        Some(_) => gpu
            .time_kernel_load(src, KernelPath::EmbeddedCubin)
            .or_else(|_| gpu.time_kernel_load(src, KernelPath::EmbeddedPtx)),
        None => gpu.time_kernel_load(src, KernelPath::EmbeddedPtx),
    };
    let (mut nvrtc_compile, mut nvrtc_load) = (Vec::new(), Vec::new());
    let mut route = String::new();
    let (ours, peer) = race(
        budget,
        |_| {
            for src in modules {
                route = embedded(src)?.origin.to_string();
            }
            Ok(())
        },
        |_| {
            let (mut compile, mut load) = (Duration::ZERO, Duration::ZERO);
            for src in modules {
                let l = gpu.time_kernel_load(src, KernelPath::Nvrtc)?;
                compile += l.compile;
                load += l.load;
            }
            nvrtc_compile.push(compile);
            nvrtc_load.push(load);
            Ok(())
        },
    )?;
    // The embedded PTX alone, as many times (its JIT is what machine code saves).
    let mut ptx_load = Vec::new();
    for _ in 0..budget.warmup + ours.reps {
        let mut load = Duration::ZERO;
        for src in modules {
            load += gpu.time_kernel_load(src, KernelPath::EmbeddedPtx)?.load;
        }
        ptx_load.push(load);
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // The closures ran for the warm-up first; the split is over the timed runs alone.
    let timed = |v: Vec<Duration>| ms(median(v.into_iter().skip(budget.warmup).collect()));
    notes.push(format!(
        "{name}: loaded as gpuio does ({route}) {:.1} ms; embedded PTX: driver load {:.1} ms; \
         NVRTC: compile {:.1} ms + driver load {:.1} ms (medians of {} timed runs each)",
        ms(ours.median),
        timed(ptx_load),
        timed(nvrtc_compile),
        timed(nvrtc_load),
        ours.reps
    ));
    let (value, peer_value) = (ms(ours.median), ms(peer.median));
    Ok(Record {
        suite: SUITE.into(),
        case: name.into(),
        metric: "first-use load".into(),
        value,
        unit: "ms".into(),
        peer: PEER.into(),
        peer_value,
        // Lower is better; a zero is floored so the ratio stays finite.
        ratio: peer_value / value.max(0.001),
        bytes: modules
            .iter()
            .map(|m| match (m.cubin_for(cc), m.ptx_for(cc)) {
                (Some(c), _) => c.image.len(),
                (None, Some(p)) => p.text.len(),
                (None, None) => 0,
            })
            .sum(),
        route,
        device: gpu.info().name.clone(),
        reps: ours.reps,
        rows: None,
    })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Runs the suite; on the host backend (no modules to load) it says so and records nothing.
/// Records carry the loaded code's size in bytes and, as the route, which embedded code was
/// loaded.
pub fn run(
    session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let budget = &opts.budget();
    let gpu = session.gpu(0)?.clone();
    if gpu.backend() == Backend::Host {
        return Ok((
            Vec::new(),
            Vec::new(),
            vec!["kernels: needs a CUDA device (the host backend runs its kernels as Rust)".into()],
        ));
    }
    let mut notes = vec![format!(
        "kernels: the driver's JIT cache is {}",
        if std::env::var("CUDA_CACHE_DISABLE").is_ok_and(|v| v == "1") {
            "off (CUDA_CACHE_DISABLE=1): every load JIT-compiles, as on a machine's first run"
        } else {
            "on: after the warm-up, loads find JIT-compiled code in it (CUDA_CACHE_DISABLE=1 \
             times the JIT too)"
        }
    )];
    let mut records = Vec::new();
    // Every crate's modules: the HAL's, the ring's, NVMe's, the AI tier's.
    let modules: Vec<&'static KernelSource> = [
        gpuio_hal::kernels::MODULES,
        gpuio_ring::kernels::MODULES,
        gpuio_nvme::kernels::MODULES,
        gpuio_ai_device::kernels::MODULES,
    ]
    .concat();
    for src in &modules {
        progress(src.name);
        records.push(case(&gpu, src.name, &[*src], budget, &mut notes)?);
    }
    progress("all");
    records.push(case(&gpu, "all", &modules, budget, &mut notes)?);
    Ok((records, Vec::new(), notes))
}
