//! gpuio-cli's integration tests: one test binary, a module per area, so that the crate's
//! dependencies are linked once and `cargo test -p gpuio-cli --test it <module>::` runs one
//! area. Each module's docs say what it covers. Tests that need a device or a privilege this
//! machine may lack skip with a printed reason, unless `GPUIO_REQUIRE_<X>=1` makes that a
//! failure (`gpuio_testkit::Requirement`).

mod common;
mod hosts;

mod agent;
mod bench_memory;
mod cache;
mod cli;
mod cp_faults;
#[cfg(feature = "registry")]
mod multinode;
#[cfg(feature = "nixl")]
mod nixl;
#[cfg(all(feature = "nixl", feature = "registry"))]
mod nixl_replicas;
mod nvme;
mod stat_endpoints;
