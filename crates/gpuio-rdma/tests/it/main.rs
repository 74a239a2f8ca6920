//! gpuio-rdma's integration tests: one test binary, a module per area, so that the crate's
//! dependencies are linked once and `cargo test -p gpuio-rdma --test it <module>::` runs one
//! area. Each module's docs say what it covers. They need an RDMA device: without one they
//! print why and pass, unless `GPUIO_REQUIRE_RDMA=1` makes that a failure
//! (`gpuio_testkit::Requirement`); `cargo xtask qemu-rdma` runs the whole binary so, on
//! soft-RoCE in a QEMU guest.

mod verbs;
