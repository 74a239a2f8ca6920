//! `cargo xtask cufile-sdk`: NVIDIA's cuFile SDK from PyPI — `cufile.h`, `libcufile.so.0`, and
//! the CUDA runtime's `cuda.h` that `cufile.h` includes — under `target/cufile-sdk`, for
//! gpuio-cufile's tests (which compile a C program against NVIDIA's header and compare
//! symbol sets with NVIDIA's library). Fetched from the registry, never committed.

use crate::{Result, root};
use std::path::PathBuf;

/// Pinned: the cuFile API gpuio-cufile implements (1.20) and the runtime the GPU machine has.
const WHEELS: &[&str] = &["nvidia-cufile==1.20.0.107", "nvidia-cuda-runtime==13.0.96"];

/// Installs the SDK (once) and returns its directory, what `GPUIO_CUFILE_SDK` names.
pub fn sdk() -> Result<PathBuf> {
    let dir = root().join("target/cufile-sdk");
    crate::python::pip_target(&dir, WHEELS, "install NVIDIA's cuFile SDK from PyPI")?;
    Ok(dir)
}

/// `cargo xtask cufile-sdk`: installs it and prints where.
pub fn cufile_sdk() -> Result {
    println!("{}", sdk()?.display());
    Ok(())
}
