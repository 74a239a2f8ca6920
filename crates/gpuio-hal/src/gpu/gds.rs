//! GPUDirect Storage through cuFile: file IO straight into and out of device memory. With the
//! nvidia-fs driver the NVMe device DMAs to the GPU ([`GdsMode::Native`]); without it cuFile
//! still works, in compat mode, through its own host bounce buffers ([`GdsMode::Compat`]).

use super::backend::GdsFileBackend;
use super::{DeviceBuffer, Gpu};
use crate::error::Result;
use std::fs::File;
use std::sync::Arc;

/// How cuFile reaches storage on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GdsMode {
    /// nvidia-fs is loaded: storage DMAs to and from GPU memory.
    Native,
    /// No nvidia-fs: cuFile reads into its own pinned host buffers and copies (POSIX IO).
    Compat,
}

impl std::fmt::Display for GdsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Native => "native (nvidia-fs)",
            Self::Compat => "compat mode (no nvidia-fs)",
        })
    }
}

impl Gpu {
    /// cuFile for this GPU: its mode and the library serving it, or why it cannot run here
    /// (no libcufile, the driver refused to open, the host backend). Opens the cuFile driver
    /// once per process.
    pub fn gds(&self) -> Result<(GdsMode, String)> {
        self.inner.gds()
    }
}

/// An open file registered with cuFile for one GPU; deregistered when dropped. Reads and
/// writes may run from many threads at once.
pub struct GdsFile {
    gpu: Gpu,
    inner: Box<dyn GdsFileBackend>,
}

impl std::fmt::Debug for GdsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GdsFile")
            .field("gpu", &self.gpu.ordinal())
            .finish()
    }
}

impl GdsFile {
    /// Registers `file` (kept open as long as the registration) with cuFile for `gpu`.
    pub fn register(gpu: &Gpu, file: Arc<File>) -> Result<Self> {
        Ok(Self {
            gpu: gpu.clone(),
            inner: gpu.inner.gds_register(file)?,
        })
    }

    /// Reads `len` bytes at file `offset` into `dst` at `dst_offset`; returns the count, short
    /// only at end of file.
    pub fn read(
        &self,
        offset: u64,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<usize> {
        self.gpu.check_owns("cuFile read destination", dst)?;
        let range = dst.range("cuFile read destination", dst_offset, len)?;
        self.inner.read(range, offset)
    }

    /// Writes `len` bytes of `src` from `src_offset` to file `offset`; returns the count,
    /// short only when the file system filled up.
    pub fn write(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
        offset: u64,
    ) -> Result<usize> {
        self.gpu.check_owns("cuFile write source", src)?;
        let range = src.range("cuFile write source", src_offset, len)?;
        self.inner.write(range, offset)
    }
}
