//! gpuio-staging's integration tests: one test binary, a module per area (`cargo test -p
//! gpuio-staging --test it pool::` runs one). They run on the probed backend: the host backend
//! where there is no GPU, so CI needs none.

mod pool;
