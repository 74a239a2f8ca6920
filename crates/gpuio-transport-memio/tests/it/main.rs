//! gpuio-transport-memio's integration tests: one test binary, a module per area, so that the
//! crate's dependencies are linked once and `cargo test -p gpuio-transport-memio --test it
//! <module>::` runs one area. Each module's docs say what it covers. Tests that need a device
//! or a privilege this machine may lack skip with a printed reason, unless
//! `GPUIO_REQUIRE_<X>=1` makes that a failure (`gpuio_testkit::Requirement`).

mod gather;
mod gather_jobs;
mod gather_resident;
mod memio;
mod staging;
