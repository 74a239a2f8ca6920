//! The copies a user would make without gpuio — synchronous `cudaMemcpy` through the driver
//! (a plain memcpy on the host backend) — kept here so benchmarks can measure gpuio against
//! them in the same run without leaving the HAL's safe interface.

use super::backend::BaselineCopy;
use super::{DeviceBuffer, Gpu};
use crate::error::{HalError, Result};

impl Gpu {
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
