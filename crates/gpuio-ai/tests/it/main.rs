//! gpuio-ai's integration tests: one test binary, a module per area (`cargo test -p gpuio-ai
//! --test it <module>::`). They run on whatever backend the session probes: the host backend
//! in CI, CUDA on the GPU machine.

mod compressed;
mod context;
mod engram;
mod graph;
mod kv;
mod quant;
mod swap_in;
