//! The CUDA backend, on cudarc with run-time loading: the binary builds with no CUDA installed,
//! and the device probe checks for libcuda (and every driver symbol gpuio calls) before the first
//! call, because cudarc panics where a library or symbol is missing.
//!
//! Contexts are the devices' primary contexts (shared with the CUDA runtime, PyTorch, CuPy).
//! Every operation binds the context to the calling thread first, so any thread may use any
//! device.
//!
//! - `driver.rs`: every raw driver call the backend makes, as thin functions returning the
//!   HAL's error, each with its safety contract: the one place the backend crosses into
//!   libcuda.
//! - `device.rs`: a device (`CudaDevice`: context, kernels, what it reports) and its
//!   `DeviceBackend`; `memory.rs`: the allocations and host registrations it owns.
//! - `stream.rs`: a stream's copies, pattern and ring kernels; `rows.rs`: its row gathers and
//!   scatters; `report.rs`: its gather kernels' report words, in mapped host memory;
//!   `event.rs`: its pooled events; `run.rs`: what an op's CUDA side may do on a stream.
//! - `module.rs`: loading a module of `kernels/`: its embedded PTX through the driver, or
//!   NVRTC's build of its source where no PTX fits or the driver refuses it; `nvrtc.rs`:
//!   compiling `kernels/` with NVRTC.
//! - `probe.rs`: what the installation can do, checked without letting cudarc panic;
//!   `cufile.rs`: GPUDirect Storage.

mod cufile;
mod device;
mod driver;
mod event;
mod memory;
mod module;
mod nvrtc;
mod probe;
mod report;
mod rows;
mod run;
mod stream;

pub(crate) use device::devices;
pub use nvrtc::{NVRTC_ARCHS, compile_ptx, compile_ptx_for, kernel_problems, nvrtc_problems};
pub(crate) use stream::CudaStreamBackend;
