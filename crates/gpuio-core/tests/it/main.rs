//! gpuio-core's integration tests: one test binary, a module per area, so that the crate's
//! dependencies are linked once and `cargo test -p gpuio-core --test it <module>::` runs one
//! area. Each module's docs say what it covers. Tests that need a device or a privilege this
//! machine may lack skip with a printed reason, unless `GPUIO_REQUIRE_<X>=1` makes that a
//! failure (`gpuio_testkit::Requirement`).

mod common;

mod cache;
mod core;
mod lease;
mod memory;
mod ondemand;
mod ondemand_gpu;
mod ondemand_in_place;
mod remote;
mod ring;
mod ring_gpu;
mod sched;
