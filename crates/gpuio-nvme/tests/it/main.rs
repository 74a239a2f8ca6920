//! gpuio-nvme's integration tests: one test binary, a module per area. Tests that need a
//! device or a privilege this machine may lack skip with a printed reason, unless
//! `GPUIO_REQUIRE_<X>=1` makes that a failure (`gpuio_testkit::Requirement`).

mod kernels;
mod nvme;
