//! gpuio-ai-device's integration tests: one test binary, a module per area (quantization and
//! scores, the device-planned load, the kernels). What needs a GPU skips here with a printed
//! reason unless `GPUIO_REQUIRE_CUDA=1`.

mod ai;
mod kernels;
mod swap_in;
