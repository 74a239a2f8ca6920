//! The copies a user would make without gpuio — synchronous `cudaMemcpy` through the driver
//! (a plain memcpy on the host backend) — kept here so benchmarks can measure gpuio against
//! them in the same run (DESIGN.md §6) without leaving the HAL's safe interface.

use super::DeviceBuffer;
use super::Gpu;
use super::backend::CopyDirection;
use crate::error::Result;

impl Gpu {
    /// `cudaMemcpy(dst + dst_offset, src, HostToDevice)`: synchronous; pageable sources are
    /// staged by the driver.
    pub fn baseline_upload(&self, src: &[u8], dst: &DeviceBuffer, dst_offset: usize) -> Result<()> {
        self.check_owns("baseline destination", dst)?;
        let d = dst.addr_at("baseline destination", dst_offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: src is borrowed for the whole synchronous copy; d was range-checked.
        unsafe {
            self.inner.baseline_copy(
                CopyDirection::HostToDevice,
                src.as_ptr() as u64,
                d,
                src.len(),
            )
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
        let s = src.addr_at("baseline source", src_offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: dst is borrowed mutably for the whole synchronous copy; s was range-checked.
        unsafe {
            self.inner.baseline_copy(
                CopyDirection::DeviceToHost,
                s,
                dst.as_mut_ptr() as u64,
                dst.len(),
            )
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
        let s = src.addr_at("baseline source", 0, len)?;
        let d = dst.addr_at("baseline destination", 0, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges were checked against live buffers of this device.
        unsafe {
            self.inner
                .baseline_copy(CopyDirection::DeviceToDevice, s, d, len)
        }
    }
}
