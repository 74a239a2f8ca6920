//! gpuio-hal's integration tests: one test binary, a module per area, so that the crate's
//! dependencies are linked once and `cargo test -p gpuio-hal --test it <module>::` runs one
//! area. Each module's docs say what it covers. Tests that need a device or a privilege this
//! machine may lack skip with a printed reason, unless `GPUIO_REQUIRE_<X>=1` makes that a
//! failure (`gpuio_testkit::Requirement`).

mod gpu;
mod hot_rows;
#[cfg(feature = "cuda")]
mod kernels;
mod ptx;
mod rows;
mod tiered;
