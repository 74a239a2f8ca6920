//! `cargo xtask nixl`: NIXL from PyPI (the `nixl-cu13` wheel: `libnixl_capi.so`, its plugins
//! and UCX; its Python API) with NumPy, under `target/nixl`, for gpuio-nixl's tests and the
//! interoperability tests against NIXL's own Python API. Installed without the wheel's
//! dependencies (it asks for torch, which no test here needs). Fetched from the registry,
//! never committed.

use crate::{Result, root};
use std::path::PathBuf;

/// Pinned: the NIXL release gpuio is tested against, and the NumPy its Python API imports.
const WHEELS: &[&str] = &["nixl-cu13==1.5.1", "numpy==2.3.5"];

/// Installs NIXL (once) and returns its directory: the Python path, with the C API library in
/// [`lib_dir`] under it.
pub fn install() -> Result<PathBuf> {
    let dir = root().join("target/nixl");
    crate::python::pip_target(&dir, WHEELS, "install NIXL from PyPI")?;
    Ok(dir)
}

/// Where the wheel keeps `libnixl_capi.so` (what `GPUIO_NIXL_LIB` names).
pub fn lib_dir(install: &std::path::Path) -> PathBuf {
    install.join(".nixl_cu13.mesonpy.libs")
}

/// `cargo xtask nixl`: installs it and prints the variables the tests read.
pub fn nixl() -> Result {
    let dir = install()?;
    println!("GPUIO_NIXL_LIB={}", lib_dir(&dir).display());
    println!("GPUIO_NIXL_PYTHONPATH={}", dir.display());
    Ok(())
}
