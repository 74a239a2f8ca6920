//! gpuio-ring's integration tests: one test binary, a module per area. The protocol's own
//! tests are unit tests beside it; what needs a GPU runs in gpuio-core's tests, with a proxy.

mod kernels;
