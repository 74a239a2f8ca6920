//! The host backend: always available. "Device memory" is host memory, copies are memcpy done
//! at enqueue time (so every event is already complete), and device functions run as Rust.
//! It runs gpuio's logic for real on machines without a GPU (CI); it simulates no PCIe.

use super::backend::{
    CopyDirection, DeviceBackend, DeviceMemory, EventBackend, HostPin, StreamBackend,
};
use super::info::{Backend, Capability, DeviceInfo, cxl_capability};
use crate::error::{HalError, Result};
use crate::memory::{HostAllocOptions, HostBuffer};
use crate::{pattern, sys};
use std::any::Any;
use std::time::Instant;

#[derive(Debug)]
pub(crate) struct HostDevice {
    info: DeviceInfo,
}

impl HostDevice {
    pub(crate) fn new(ordinal: u32) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let total_memory = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("MemTotal:"))?.to_owned();
                line.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .map_or(0, |kb| kb * 1024);
        Self {
            info: DeviceInfo {
                ordinal,
                backend: Backend::Host,
                vendor: "host".into(),
                name: "host memory (no GPU)".into(),
                total_memory,
                compute_capability: None,
                multiprocessors: threads,
                copy_engines: 0,
                pci_bus_id: None,
                numa_node: None,
                pcie: None,
                driver_version: None,
                can_map_host_memory: true,
                gds: Capability::no("host backend: no GPU to DMA into"),
                gdr: Capability::no("host backend: no GPU to DMA into"),
                cxl: cxl_capability(true),
            },
        }
    }
}

/// Host memory standing in for device memory.
#[derive(Debug)]
struct HostDeviceMemory {
    buf: HostBuffer,
}

impl DeviceMemory for HostDeviceMemory {
    fn addr(&self) -> u64 {
        self.buf.as_slice().as_ptr() as u64
    }
}

#[derive(Debug)]
struct NoPin;

impl HostPin for NoPin {}

impl DeviceBackend for HostDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn DeviceMemory>> {
        let opts = HostAllocOptions {
            populate: false,
            ..HostAllocOptions::default()
        };
        Ok(Box::new(HostDeviceMemory {
            buf: HostBuffer::alloc(len, &opts)?,
        }))
    }

    fn new_stream(&self) -> Result<Box<dyn StreamBackend>> {
        Ok(Box::new(HostStream))
    }

    unsafe fn pin(&self, _ptr: *mut u8, _len: usize) -> Result<Box<dyn HostPin>> {
        // Host memory is already where "device" memory is; there is nothing to lock.
        Ok(Box::new(NoPin))
    }

    fn is_pinned(&self, _ptr: *const u8, _len: usize) -> bool {
        false
    }

    fn can_access_peer(&self, other: &dyn DeviceBackend) -> bool {
        other.as_any().is::<HostDevice>()
    }

    unsafe fn baseline_copy(
        &self,
        _dir: CopyDirection,
        src: u64,
        dst: u64,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller guarantees both ranges are live; host "device" memory never
        // overlaps a host buffer.
        unsafe { sys::copy_raw(src as *const u8, dst as *mut u8, len) };
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct HostStream;

impl StreamBackend for HostStream {
    unsafe fn copy_h2d(&self, src: *const u8, dst: u64, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees both ranges are live for `len` bytes; device memory of
        // this backend is a separate host mapping, so they do not overlap.
        unsafe { sys::copy_raw(src, dst as *mut u8, len) };
        Ok(())
    }

    unsafe fn copy_d2h(&self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        // SAFETY: as for copy_h2d.
        unsafe { sys::copy_raw(src as *const u8, dst, len) };
        Ok(())
    }

    unsafe fn copy_d2d(
        &self,
        _src_dev: &dyn DeviceBackend,
        src: u64,
        _dst_dev: &dyn DeviceBackend,
        dst: u64,
        len: usize,
    ) -> Result<()> {
        // Device-to-device ranges may overlap (same buffer): memmove semantics.
        // SAFETY: the caller guarantees both ranges are live device memory of `len` bytes.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        Ok(())
    }

    unsafe fn fill_pattern(&self, dst: u64, len: usize, first: u64, seed: u64) -> Result<()> {
        // SAFETY: the caller guarantees a live device range; device memory is never borrowed
        // as a Rust reference outside the HAL, so this slice is the only one.
        let out = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
        pattern::fill(out, first, seed);
        Ok(())
    }

    unsafe fn find_mismatch(&self, a: u64, b: u64, len: usize) -> Result<Option<u64>> {
        // SAFETY: the caller guarantees both ranges are live device memory; reading them
        // through shared slices while no copy runs (host copies finish at enqueue) is sound.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(a as *const u8, len),
                std::slice::from_raw_parts(b as *const u8, len),
            )
        };
        Ok(pattern::first_mismatch(a, b).map(|i| i as u64))
    }

    fn record(&self, _timing: bool) -> Result<Box<dyn EventBackend>> {
        Ok(Box::new(HostEvent { at: Instant::now() }))
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

struct HostEvent {
    at: Instant,
}

impl EventBackend for HostEvent {
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn is_complete(&self) -> Result<bool> {
        Ok(true)
    }

    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32> {
        let start = start
            .as_any()
            .downcast_ref::<HostEvent>()
            .ok_or_else(|| HalError::InvalidArgument("events of different backends".into()))?;
        Ok(self.at.duration_since(start.at).as_secs_f32() * 1e3)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
