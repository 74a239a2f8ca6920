//! Coverage-guided fuzz targets for every parser of input that strangers and devices control:
//! the RemoteIO wire protocol, resource URIs, configuration files and `GPUIO_*` values, what
//! a metrics endpoint sends `gpuio stat`, NVMe controller data, file-extent text, gpuio-ai's
//! compressed frames, the system files gpuio reads, and the arguments cuFile programs pass to
//! gpuio's `libcufile.so.0`.
//!
//! Each target takes the fuzzer's bytes and panics when what must hold does not: no panic in
//! the parser, a typed error or a value that encodes back to the same bytes, agreement where
//! two decoders read the same input. Every input runs under [`ALLOC_LIMIT`]: a parser that
//! allocates past it aborts, which AFL++ records as a crash and the replay test as a failure.
//!
//! `cargo xtask fuzz` builds `src/main.rs` with AFL++ (cargo-afl) and runs the targets;
//! `tests/replay.rs` replays every committed corpus and regression input in the test suite.

#![forbid(unsafe_code)]

mod targets;

use cap::Cap;
use std::alloc::System;

/// Every allocation of the process goes through this counter, so a target can bound what one
/// input makes a parser allocate.
#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// The most bytes one input may make the code under test hold at once (live, above what was
/// held before it). The largest legitimate buffer of any target is a 16 MiB wire payload.
pub const ALLOC_LIMIT: usize = 256 << 20;

/// A fuzz target.
pub struct Target {
    /// Its name: `cargo xtask fuzz NAME`, `fuzz/corpus/NAME/`.
    pub name: &'static str,
    /// What it parses.
    pub parses: &'static str,
    /// The source files of the parsers it reaches, for the coverage report.
    pub sources: &'static [&'static str],
    /// Runs one input; panics on a violated property.
    pub run: fn(&[u8]),
    /// Inputs to start from, built with the encoders and the test vectors of the parsers.
    pub seeds: fn() -> Vec<Vec<u8>>,
}

/// Every target.
pub const TARGETS: &[Target] = &[
    targets::wire::TARGET,
    targets::uri::TARGET,
    targets::config::TARGET,
    targets::config::ENV_TARGET,
    targets::metrics::TARGET,
    targets::nvme::TARGET,
    targets::nvme_controller::TARGET,
    targets::extents::TARGET,
    targets::frames::TARGET,
    targets::sysfs::TARGET,
    targets::safetensors::TARGET,
    targets::cufile::TARGET,
];

/// The target named `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// Runs `input` through `target` with at most [`ALLOC_LIMIT`] more bytes allocatable.
pub fn run(target: &Target, input: &[u8]) {
    let before = ALLOCATOR.limit();
    ALLOCATOR
        .set_limit(ALLOCATOR.allocated().saturating_add(ALLOC_LIMIT))
        .expect("the limit is above what is allocated");
    (target.run)(input);
    // Back to no limit: what the harness itself allocates between inputs is not bounded.
    let _ = ALLOCATOR.set_limit(before);
}
