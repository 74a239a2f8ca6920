//! Helpers shared by the core's integration tests.
#![allow(dead_code)]

use gpuio_core::{Engines, HostMemory, Result, RetryPolicy, Scheduler, SchedulerConfig};
use gpuio_hal::{Backend, BackendPreference, Gpu, HostAllocOptions, HostBuffer, pattern, probe};
use gpuio_testkit::Requirement;
use gpuio_transport_localio::{LocalIo, LocalIoConfig};
use gpuio_transport_memio::{MemIo, MemIoConfig};
use std::sync::Arc;

/// Engines over the probed backend (the host backend without CUDA).
pub fn engines() -> Engines {
    let p = probe(BackendPreference::Auto).unwrap();
    let memio = MemIo::new(p.gpus, MemIoConfig::default()).unwrap();
    let localio = LocalIo::new(LocalIoConfig {
        chunk_size: 256 << 10,
        ..LocalIoConfig::default()
    })
    .unwrap();
    Engines::new(Arc::new(memio), Arc::new(localio))
}

/// Host memory filled with the pattern of `seed`.
pub fn host(len: usize, seed: u64) -> HostMemory {
    let mut b = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut b, 0, seed);
    HostMemory::new(b)
}

/// Zeroed host memory.
pub fn zeroed(len: usize) -> HostMemory {
    HostMemory::new(HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap())
}

/// A scheduler with `workers` threads and otherwise default settings.
pub fn sched(e: &Engines, workers: usize, retry: RetryPolicy) -> Result<Scheduler> {
    sched_with(
        e,
        SchedulerConfig {
            workers,
            ..SchedulerConfig::default()
        },
        retry,
    )
}

/// A scheduler with these settings.
pub fn sched_with(e: &Engines, cfg: SchedulerConfig, retry: RetryPolicy) -> Result<Scheduler> {
    Scheduler::new(e.clone(), cfg, retry)
}

/// CUDA engines and GPU 0, or None (noting that `what` needs a GPU) on the host backend.
pub fn cuda(what: &str) -> Option<(Engines, Gpu)> {
    let p = probe(BackendPreference::Auto).unwrap();
    if p.gpus[0].backend() == Backend::Host {
        Requirement::Cuda.missing(format_args!("{what} only on a GPU ({})", p.cuda.detail));
        return None;
    }
    let gpu = p.gpus[0].clone();
    let memio = MemIo::new(p.gpus, MemIoConfig::default()).unwrap();
    let localio = LocalIo::new(LocalIoConfig::default()).unwrap();
    Some((Engines::new(Arc::new(memio), Arc::new(localio)), gpu))
}
