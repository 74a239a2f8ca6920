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
mod hot_jobs;
mod memory;
mod module;
mod nvrtc;
mod probe;
mod report;
mod resident;
mod rows;
mod run;
mod stream;

pub(crate) use device::devices;

/// Runs `f` with no context current on this thread, then makes the previous one current
/// again, even if `f` panics (where the driver was never set up in this process, just runs
/// `f`).
pub(crate) fn without_context<R>(f: impl FnOnce() -> R) -> R {
    /// Makes its context current again when dropped.
    struct Restore(cudarc::driver::sys::CUcontext);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: the context was current on this thread when `without_context` was
            // called: whoever made it current, up this thread's stack, keeps it alive across
            // the call, and `f` (a memory registration, in gpuio) destroys no context.
            if let Err(e) = unsafe { driver::ctx_set_current(self.0) } {
                tracing::warn!(error = %e, "could not make the thread's CUDA context current again");
            }
        }
    }
    if !probe::driver_ready() || probe::driver_forked() {
        return f();
    }
    let prev = match driver::ctx_current() {
        Ok(c) if !c.is_null() => c,
        _ => return f(),
    };
    // SAFETY: null means no context.
    if let Err(e) = unsafe { driver::ctx_set_current(std::ptr::null_mut()) } {
        tracing::debug!(error = %e, "could not unset the thread's CUDA context");
        return f();
    }
    let _restore = Restore(prev);
    f()
}
/// Makes `prev` current on this thread again where another context is.
///
/// `prev` was current on this thread when the caller took it, and whoever made it current,
/// up this thread's stack, keeps it alive meanwhile (gpuio destroys a context only when its
/// last device handle goes, and the callers never drop one between taking and restoring;
/// [`releasing`], which does, checks first).
fn make_current_again(prev: cudarc::driver::sys::CUcontext) {
    if driver::ctx_current().is_ok_and(|now| now == prev) {
        return;
    }
    // SAFETY: `prev` is alive and was current on this thread (above).
    if let Err(e) = unsafe { driver::ctx_set_current(prev) } {
        tracing::warn!(error = %e, "could not make the thread's CUDA context current again");
    }
}

/// The context current on this thread, where the driver is set up in this process.
fn current_context() -> Option<cudarc::driver::sys::CUcontext> {
    if !probe::driver_ready() || probe::driver_forked() {
        return None;
    }
    driver::ctx_current().ok()
}

/// Runs `f`, then makes the thread's previous context current again where `f` changed it.
pub(crate) fn keeping_context<R>(f: impl FnOnce() -> R) -> R {
    /// Makes its context current again when dropped, where another one is.
    struct Restore(cudarc::driver::sys::CUcontext);
    impl Drop for Restore {
        fn drop(&mut self) {
            make_current_again(self.0);
        }
    }
    let Some(prev) = current_context() else {
        return f();
    };
    let _restore = Restore(prev);
    f()
}

/// Runs `f`, which releases the primary contexts of `released` (devices and their context
/// handles; a cudarc context binds itself to release), then makes the thread's previous context
/// current again, unless that was one of them and it is gone (no one else retained it): then
/// no context is left current rather than a dead one.
pub(super) fn releasing(released: &[(cudarc::driver::sys::CUdevice, usize)], f: impl FnOnce()) {
    let Some(prev) = current_context() else {
        return f();
    };
    f();
    let dead = released.iter().any(|&(device, ctx)| {
        ctx == prev as usize && !matches!(driver::primary_context_active(device), Ok(true))
    });
    if !dead {
        return make_current_again(prev);
    }
    // SAFETY: null means no context.
    if let Err(e) = unsafe { driver::ctx_set_current(std::ptr::null_mut()) } {
        tracing::warn!(error = %e, "could not unset a released CUDA context");
    }
}

/// [`keeping_context`] for a type's whole drop, its fields' included (a cudarc stream or
/// event binds its context to destroy itself): declared after the fields it covers and
/// [`armed`](Self::arm) in the owner's `Drop`, it makes the context that was current then
/// current again once they are gone.
#[derive(Default)]
pub(super) struct RestoreOnDrop {
    /// The context to restore, as an address (a `CUcontext` is not `Send`); `None` until
    /// armed, and null is a context to restore too.
    ctx: Option<usize>,
}

impl RestoreOnDrop {
    /// Remembers the context current now, to make it current again when this drops.
    pub(super) fn arm(&mut self) {
        self.ctx = current_context().map(|prev| prev as usize);
    }
}

impl Drop for RestoreOnDrop {
    fn drop(&mut self) {
        if let Some(ctx) = self.ctx {
            make_current_again(ctx as cudarc::driver::sys::CUcontext);
        }
    }
}

pub use nvrtc::{NVRTC_ARCHS, compile_ptx, compile_ptx_for, kernel_problems, nvrtc_problems};
pub(crate) use stream::CudaStreamBackend;

#[cfg(test)]
mod tests {
    use crate::{BackendPreference, probe};

    /// On a CUDA machine: inside, no context is current; after, the caller's is again.
    #[test]
    fn without_context_unsets_and_restores_the_threads_context() {
        let gpus = match probe(BackendPreference::Cuda) {
            Ok(p) => p.gpus,
            Err(e) => {
                eprintln!("skipped: {e}");
                return;
            }
        };
        gpus[0].bind_thread().unwrap();
        let before = super::driver::ctx_current().unwrap();
        assert!(!before.is_null());
        let inside = super::without_context(|| super::driver::ctx_current().unwrap());
        assert!(inside.is_null());
        assert_eq!(super::driver::ctx_current().unwrap(), before);
    }

    /// On a CUDA machine: an event dropped after its stream is destroyed, not pooled, which
    /// binds its context; the caller's (here none) is current again after.
    #[test]
    fn an_event_dropped_after_its_stream_leaves_the_callers_context() {
        let gpus = match probe(BackendPreference::Cuda) {
            Ok(p) => p.gpus,
            Err(e) => {
                eprintln!("skipped: {e}");
                return;
            }
        };
        let stream = gpus[0].stream().unwrap();
        let event = stream.record_event().unwrap();
        event.synchronize().unwrap();
        drop(stream);
        let after = super::without_context(|| {
            drop(event);
            super::driver::ctx_current().unwrap()
        });
        assert!(after.is_null(), "the event's context was left current");
    }

    /// On a CUDA machine: a probe's devices going (their modules unloaded, their contexts
    /// released, each bound to do so) leave the caller's context current where it lives on,
    /// and never a context that is gone.
    #[test]
    fn dropping_devices_leaves_a_live_context_or_none() {
        let (keep, gone) = match (
            probe(BackendPreference::Cuda),
            probe(BackendPreference::Cuda),
        ) {
            (Ok(a), Ok(b)) => (a.gpus, b.gpus),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("skipped: {e}");
                return;
            }
        };
        let device = super::driver::device_get(0).unwrap();
        // Both probes hold GPU 0's primary context: the kept one's stays current.
        keep[0].bind_thread().unwrap();
        gone[0].bind_thread().unwrap();
        let ctx = super::driver::ctx_current().unwrap();
        drop(gone);
        assert_eq!(super::driver::ctx_current().unwrap(), ctx);
        // The last holder in this test goes: the context stays current only if another test
        // of this process still holds it.
        drop(keep);
        let now = super::driver::ctx_current().unwrap();
        let live = super::driver::primary_context_active(device).unwrap();
        assert!(
            now.is_null() || (now == ctx && live),
            "a released context is current"
        );
    }
}
