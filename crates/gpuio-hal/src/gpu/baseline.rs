//! What gpuio is measured against, kept here so benchmarks can race it in the same run without
//! leaving the HAL's safe interface: the copies a user would make without gpuio (synchronous
//! `cudaMemcpy` through the driver; a plain memcpy on the host backend), and loading a kernel
//! module by one way alone (embedded PTX, or NVRTC as every module was loaded before PTX was
//! embedded).

use super::backend::BaselineCopy;
use super::{DeviceBuffer, Gpu};
use crate::error::{HalError, Result};
use crate::kernels::{KernelLoad, KernelOrigin, KernelPath, KernelSource};

impl Gpu {
    /// Loads `src` (one of [`crate::kernels::MODULES`]) for this device's kernels as they load it
    /// on first use — its embedded PTX through the driver, NVRTC where none fits or the driver
    /// refuses it — and says where its code came from. The module stays loaded for the
    /// device's own use; a later call returns at once. The host backend has no modules
    /// ([`HalError::Unsupported`]).
    pub fn load_kernels(&self, src: &'static KernelSource) -> Result<KernelOrigin> {
        self.inner.load_kernels(src)
    }

    /// Loads a fresh copy of `src` by `path` alone (no fallback: an error where that way cannot
    /// serve this device), then unloads it, and returns what each step took: how benchmarks
    /// time first use. The device's own copy of the module is not touched. Unless the driver's
    /// JIT cache is off (`CUDA_CACHE_DISABLE=1`), a PTX the driver has JIT-compiled before
    /// loads from its cache.
    pub fn time_kernel_load(&self, src: &KernelSource, path: KernelPath) -> Result<KernelLoad> {
        self.inner.time_kernel_load(src, path)
    }

    /// `cudaMemcpy(dst + dst_offset, src, HostToDevice)`: synchronous; pageable sources are
    /// staged by the driver.
    pub fn baseline_upload(&self, src: &[u8], dst: &DeviceBuffer, dst_offset: usize) -> Result<()> {
        self.check_owns("baseline destination", dst)?;
        let dst = dst.range("baseline destination", dst_offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let src = src.as_ptr();
        // SAFETY: src is borrowed for the whole synchronous copy; dst was range-checked.
        unsafe {
            self.inner
                .baseline_copy(BaselineCopy::HostToDevice { src, dst })
        }
    }

    /// `cudaMemcpy(dst, src + src_offset, DeviceToHost)`: synchronous.
    pub fn baseline_download(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        self.check_owns("baseline source", src)?;
        let src = src.range("baseline source", src_offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let dst = dst.as_mut_ptr();
        // SAFETY: dst is borrowed mutably for the whole synchronous copy; src was range-checked.
        unsafe {
            self.inner
                .baseline_copy(BaselineCopy::DeviceToHost { src, dst })
        }
    }

    /// `cudaMemcpy(dst, src, DeviceToDevice)` followed by a device synchronize.
    pub fn baseline_copy_device(
        &self,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        len: usize,
    ) -> Result<()> {
        self.check_owns("baseline source", src)?;
        self.check_owns("baseline destination", dst)?;
        if src.same_buffer(dst) && len > 0 {
            return Err(HalError::InvalidArgument(
                "baseline device copy within one buffer".into(),
            ));
        }
        let s = src.range("baseline source", 0, len)?;
        let d = dst.range("baseline destination", 0, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges were checked against live, distinct buffers of this device.
        unsafe {
            self.inner
                .baseline_copy(BaselineCopy::DeviceToDevice { src: s, dst: d })
        }
    }
}
