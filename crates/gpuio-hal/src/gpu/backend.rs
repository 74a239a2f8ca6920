//! The contract a GPU backend implements. Crate-private: the public types in [`super`] check
//! every argument (ownership, ranges, lengths) once, so a backend only ever sees valid raw
//! pointers and device addresses.

use super::DeviceInfo;
use crate::error::Result;
use std::any::Any;
use std::fmt;

/// One GPU (or, for the host backend, the CPU standing in for one).
pub(crate) trait DeviceBackend: Send + Sync + fmt::Debug {
    fn info(&self) -> &DeviceInfo;

    /// Allocates `len` bytes of device memory (`len > 0`).
    fn alloc(&self, len: usize) -> Result<Box<dyn DeviceMemory>>;

    fn new_stream(&self) -> Result<Box<dyn StreamBackend>>;

    /// Page-locks and registers host memory for DMA; the guard unregisters it when dropped.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped until the returned guard is dropped.
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<Box<dyn HostPin>>;

    /// Whether `ptr..ptr+len` lies inside one page-locked host allocation known to the driver.
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool;

    /// Whether this device can read and write `other`'s memory directly.
    fn can_access_peer(&self, other: &dyn DeviceBackend) -> bool;

    /// The plain synchronous driver copy (what `cudaMemcpy` does; a memcpy for the host
    /// backend): the peer that benchmarks measure gpuio against.
    ///
    /// # Safety
    /// `src` and `dst` must be live for `len` bytes: host pointers for the host side of `dir`,
    /// device addresses of this device for the device side.
    unsafe fn baseline_copy(
        &self,
        dir: CopyDirection,
        src: u64,
        dst: u64,
        len: usize,
    ) -> Result<()>;

    fn as_any(&self) -> &dyn Any;
}

/// The direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyDirection {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// An allocation of device memory; dropping it frees the memory.
pub(crate) trait DeviceMemory: Send + Sync + fmt::Debug {
    /// The device address of the first byte.
    fn addr(&self) -> u64;
}

/// A host registration; dropping it unregisters the memory.
pub(crate) trait HostPin: Send + Sync + fmt::Debug {}

/// An in-order queue of device work.
pub(crate) trait StreamBackend: Send + Sync {
    /// Enqueues a host-to-device copy.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes until the copy completes, and `dst..dst+len` must be
    /// live memory of this stream's device.
    unsafe fn copy_h2d(&self, src: *const u8, dst: u64, len: usize) -> Result<()>;

    /// Enqueues a device-to-host copy.
    ///
    /// # Safety
    /// `dst` must be writable for `len` bytes, and touched by nothing else, until the copy
    /// completes; `src..src+len` must be live memory of this stream's device.
    unsafe fn copy_d2h(&self, src: u64, dst: *mut u8, len: usize) -> Result<()>;

    /// Enqueues a copy between two device ranges, which may be on different devices of this
    /// backend (a peer copy).
    ///
    /// # Safety
    /// Both ranges must be live device memory of the named devices, `len` bytes each.
    unsafe fn copy_d2d(
        &self,
        src_dev: &dyn DeviceBackend,
        src: u64,
        dst_dev: &dyn DeviceBackend,
        dst: u64,
        len: usize,
    ) -> Result<()>;

    /// Enqueues the pattern-fill kernel (see [`crate::pattern`]) over `dst..dst+len`, writing the
    /// pattern bytes `first..first+len` of `seed`.
    ///
    /// # Safety
    /// `dst..dst+len` must be live memory of this stream's device.
    unsafe fn fill_pattern(&self, dst: u64, len: usize, first: u64, seed: u64) -> Result<()>;

    /// Compares two device ranges of `len` bytes; returns the first differing offset. Blocks.
    ///
    /// # Safety
    /// Both ranges must be live memory of this stream's device.
    unsafe fn find_mismatch(&self, a: u64, b: u64, len: usize) -> Result<Option<u64>>;

    /// Records an event after the work enqueued so far.
    fn record(&self, timing: bool) -> Result<Box<dyn EventBackend>>;

    /// Blocks until all enqueued work is done.
    fn synchronize(&self) -> Result<()>;
}

/// A point in a stream's work.
pub(crate) trait EventBackend: Send + Sync {
    /// Blocks until the work before the event is done.
    fn synchronize(&self) -> Result<()>;

    /// Whether the work before the event is done.
    fn is_complete(&self) -> Result<bool>;

    /// Milliseconds between `start` and this event (both timing events of one backend).
    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32>;

    fn as_any(&self) -> &dyn Any;
}
