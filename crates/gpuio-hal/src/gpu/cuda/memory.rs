//! What the CUDA backend owns in memory and gives back on drop: device allocations
//! ([`CudaMemory`], freed with `cuMemFree`) and host ranges registered with the driver
//! ([`CudaPin`], unregistered with `cuMemHostUnregister`), each in its device's context; and
//! device memory other libraries own ([`ForeignMemory`]), which it never frees.

use super::device::Shared;
use super::driver;
use crate::gpu::Allocation;
use crate::gpu::backend::{DeviceMemory, HostPin, Owner};
use cudarc::driver::sys;
use std::any::Any;
use std::sync::Arc;

/// A device allocation, freed when dropped.
#[derive(Debug)]
pub(super) struct CudaMemory {
    shared: Arc<Shared>,
    ptr: sys::CUdeviceptr,
}

impl CudaMemory {
    /// Takes ownership of `ptr`, to free it when dropped.
    ///
    /// # Safety
    /// `ptr` came from `cuMemAlloc` in `shared`'s context and nothing else frees it.
    pub(super) unsafe fn new(shared: Arc<Shared>, ptr: sys::CUdeviceptr) -> Self {
        Self { shared, ptr }
    }
}

impl DeviceMemory for CudaMemory {
    fn addr(&self) -> u64 {
        self.ptr
    }

    fn allocation(&self) -> crate::Result<Allocation> {
        driver::allocation(self.ptr)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        if super::probe::driver_forked() {
            return;
        }
        // A free waits for the device: a resident kernel would hold it for its linger.
        let _waiting = super::resident::send_home(self.shared.device);
        // The caller's context stays current (a framework's current device rests on it).
        let freed = super::keeping_context(|| {
            self.shared.bind().and_then(|()| {
                // SAFETY: ptr came from cuMemAlloc in this context and is freed once, here.
                // No queued work can still use it: async operations (Inflight) hold the
                // DeviceBuffer until they complete, and every other operation waits before
                // returning.
                unsafe { driver::mem_free(self.ptr) }
            })
        });
        if let Err(e) = freed {
            tracing::error!(error = %e, "freeing device memory failed");
        }
    }
}

/// Device memory another library allocated (a framework's tensor): gpuio reads and writes it
/// but never frees it, and holds what keeps it allocated for as long as any transfer can use
/// it.
pub(super) struct ForeignMemory {
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) _owner: Owner,
}

impl std::fmt::Debug for ForeignMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignMemory")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .finish_non_exhaustive()
    }
}

impl DeviceMemory for ForeignMemory {
    fn addr(&self) -> u64 {
        self.ptr
    }

    fn borrowed(&self) -> bool {
        true
    }

    fn allocation(&self) -> crate::Result<Allocation> {
        driver::allocation(self.ptr)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Host memory registered with the driver, unregistered when dropped.
#[derive(Debug)]
pub(super) struct CudaPin {
    shared: Arc<Shared>,
    ptr: *mut u8,
}

impl CudaPin {
    /// Takes over the registration of the range starting at `ptr`, to unregister it when
    /// dropped.
    ///
    /// # Safety
    /// The range was registered by `cuMemHostRegister` in `shared`'s context, nothing else
    /// unregisters it, and it stays mapped until the pin drops.
    pub(super) unsafe fn new(shared: Arc<Shared>, ptr: *mut u8) -> Self {
        Self { shared, ptr }
    }
}

// SAFETY: the pointer is only an identifier handed back to cuMemHostUnregister; it is never
// dereferenced here.
unsafe impl Send for CudaPin {}
// SAFETY: as above.
unsafe impl Sync for CudaPin {}

impl HostPin for CudaPin {}

impl Drop for CudaPin {
    fn drop(&mut self) {
        if super::probe::driver_forked() {
            return;
        }
        // An unregistration may wait for the device, as a free does.
        let _waiting = super::resident::send_home(self.shared.device);
        let done = super::keeping_context(|| {
            self.shared.bind().and_then(|()| {
                // SAFETY: ptr was registered by cuMemHostRegister and is still mapped (the
                // pin's contract), and is unregistered exactly once.
                unsafe { driver::mem_host_unregister(self.ptr) }
            })
        });
        if let Err(e) = done {
            tracing::error!(error = %e, "unregistering host memory failed");
        }
    }
}
