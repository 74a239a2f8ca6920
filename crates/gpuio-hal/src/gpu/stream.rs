//! [`Stream`], an in-order queue of copies and kernels on one device: every copy's buffers and
//! ranges checked before the backend sees them; blocking copies borrow their host memory,
//! asynchronous ones take it by value and give it back from [`Inflight::wait`]. [`Event`]s
//! time the work.

use super::backend::{EventBackend, StreamBackend};
use super::{DeviceBuffer, Gpu};
use crate::error::{HalError, Result, check_range};
use crate::memory::HostBuffer;
use std::fmt;
use std::ops::Range;

/// An in-order queue of copies and kernels on one device.
pub struct Stream {
    pub(super) gpu: Gpu,
    pub(super) inner: Box<dyn StreamBackend>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream").field("gpu", &self.gpu).finish()
    }
}

impl Stream {
    /// The device this stream runs on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Copies host memory into `dst` at `dst_offset` and waits for it. Pinned sources go as
    /// direct DMA; pageable ones are staged by the driver (MemIO's pipeline is faster for
    /// those).
    pub fn upload(&self, src: &[u8], dst: &DeviceBuffer, dst_offset: usize) -> Result<()> {
        self.gpu.check_owns("upload destination", dst)?;
        let range = dst.range("upload destination", dst_offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` and `dst` are borrowed until we synchronize below; the range was
        // checked against the live allocation.
        unsafe { self.inner.copy_h2d(src.as_ptr(), range)? };
        self.inner.synchronize()
    }

    /// Copies `len` bytes at `src` into `dst` at `dst_offset` and waits for it.
    ///
    /// # Safety
    /// `src..src+len` must be host memory registered with this stream's device (pinned, so
    /// the copy engine reads it without faulting) until this call returns.
    pub(crate) unsafe fn copy_pinned_h2d(
        &self,
        src: *const u8,
        len: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        self.gpu.check_owns("copy destination", dst)?;
        let range = dst.range("copy destination", dst_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller keeps `src` registered through the wait below; `dst` is borrowed
        // until then and its range was checked against the live allocation.
        unsafe { self.inner.copy_h2d(src, range)? };
        self.inner.synchronize()
    }

    /// The first `n` little-endian u64s of `src` (a kernel's report).
    pub fn download_u64s(&self, src: &DeviceBuffer, n: usize) -> Result<Vec<u64>> {
        let mut bytes = vec![0u8; n * 8];
        self.download(src, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
            .collect())
    }

    /// Copies `dst.len()` bytes of `src` from `src_offset` into host memory and waits for it.
    pub fn download(&self, src: &DeviceBuffer, src_offset: usize, dst: &mut [u8]) -> Result<()> {
        self.gpu.check_owns("download source", src)?;
        let range = src.range("download source", src_offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` is borrowed mutably, and `src` shared, until we synchronize below.
        unsafe { self.inner.copy_d2h(range, dst.as_mut_ptr())? };
        self.inner.synchronize()
    }

    /// Enqueues a device-to-device copy of `len` bytes; one side must belong to this stream's
    /// device, the other may be a peer device of the same backend. Two ranges of one buffer
    /// must not overlap. Returns at once; the returned handle waits for it.
    pub fn copy_device_async(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<Inflight<()>> {
        // SAFETY: the returned Inflight holds both buffers until the copy is done.
        unsafe { self.enqueue_device_copy(src, src_offset, dst, dst_offset, len)? };
        self.inflight((), vec![src.clone(), dst.clone()])
    }

    /// Copies between device buffers (same device or peers) and waits for it.
    pub fn copy_device(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the borrows keep both buffers alive until the synchronize.
        unsafe { self.enqueue_device_copy(src, src_offset, dst, dst_offset, len)? };
        self.inner.synchronize()
    }

    /// Checks and enqueues a device copy.
    ///
    /// # Safety
    /// The caller keeps both buffers alive until the copy completes.
    unsafe fn enqueue_device_copy(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        if !src.gpu().same_device(&self.gpu) && !dst.gpu().same_device(&self.gpu) {
            return Err(HalError::WrongDevice {
                what: "device copy",
                owner: format!("{} and {}", src.gpu(), dst.gpu()),
                expected: self.gpu.to_string(),
            });
        }
        if src.gpu().backend() != dst.gpu().backend() {
            return Err(HalError::WrongDevice {
                what: "device copy destination",
                owner: dst.gpu().to_string(),
                expected: format!("a device of the {} backend", src.gpu().backend().name()),
            });
        }
        let s = src.range("copy source", src_offset, len)?;
        let d = dst.range("copy destination", dst_offset, len)?;
        if src.same_buffer(dst) && src_offset < dst_offset + len && dst_offset < src_offset + len {
            return Err(HalError::InvalidArgument(format!(
                "device copy within one buffer with overlapping ranges {src_offset}+{len} and {dst_offset}+{len}"
            )));
        }
        if len > 0 {
            // SAFETY: both ranges were checked against live buffers and do not overlap; the
            // caller keeps the buffers alive until the copy is done.
            unsafe {
                self.inner
                    .copy_d2d(src.gpu().inner.as_ref(), s, dst.gpu().inner.as_ref(), d)?
            };
        }
        Ok(())
    }

    /// Enqueues a copy of `src[range]` into `dst` at `dst_offset` and returns at once. The
    /// host buffer travels with the copy and comes back from [`Inflight::wait`]: ownership, not
    /// a borrow, is what keeps it untouched while the DMA reads it.
    pub fn upload_async(
        &self,
        src: HostBuffer,
        range: Range<usize>,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<Inflight<HostBuffer>> {
        self.gpu.check_owns("upload destination", dst)?;
        let bytes = host_range("upload source", &src, &range)?;
        let target = dst.range("upload destination", dst_offset, bytes.len())?;
        if !bytes.is_empty() {
            // SAFETY: the host buffer moves into the returned Inflight, which holds it (and
            // the device buffer) until the copy has completed.
            unsafe { self.inner.copy_h2d(bytes.as_ptr(), target)? };
        }
        self.inflight(src, vec![dst.clone()])
    }

    /// Enqueues a copy of `src[src_offset..]` into `dst[range]` and returns at once; the host
    /// buffer comes back, filled, from [`Inflight::wait`].
    pub fn download_async(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        mut dst: HostBuffer,
        range: Range<usize>,
    ) -> Result<Inflight<HostBuffer>> {
        self.gpu.check_owns("download source", src)?;
        host_range("download destination", &dst, &range)?;
        let source = src.range("download source", src_offset, range.len())?;
        if !range.is_empty() {
            let bytes = &mut dst.as_mut_slice()[range];
            // SAFETY: the host buffer moves into the returned Inflight, which holds it until
            // the copy has completed, so nothing else reads or frees it meanwhile.
            unsafe { self.inner.copy_d2h(source, bytes.as_mut_ptr())? };
        }
        self.inflight(dst, vec![src.clone()])
    }

    /// Records a timing event after the work enqueued so far.
    pub fn record_event(&self) -> Result<Event> {
        Ok(Event {
            inner: self.inner.record(true)?,
        })
    }

    /// Makes the work enqueued on this stream from now on wait for the work before `event`
    /// (recorded on any stream of the same backend), without blocking the host: how one
    /// stream's result is handed to another in device order.
    pub fn wait_for(&self, event: &Event) -> Result<()> {
        self.inner.wait_for(event.inner.as_ref())
    }

    /// Blocks until all work enqueued on this stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    fn inflight<T>(&self, payload: T, keep: Vec<DeviceBuffer>) -> Result<Inflight<T>> {
        let event = match self.inner.record(false) {
            Ok(event) => event,
            Err(e) => {
                // The copy may be queued: hold the payload until the stream drains, and leak it
                // if even that cannot be confirmed.
                if self.inner.synchronize().is_err() {
                    std::mem::forget(payload);
                }
                return Err(e);
            }
        };
        Ok(Inflight {
            event,
            payload: Some(payload),
            _keep: keep,
        })
    }
}

fn host_range<'a>(
    what: &'static str,
    buf: &'a HostBuffer,
    range: &Range<usize>,
) -> Result<&'a [u8]> {
    if range.start > range.end {
        return Err(HalError::InvalidArgument(format!(
            "{what}: reversed range {}..{}",
            range.start, range.end
        )));
    }
    check_range(what, range.start, range.len(), buf.len())?;
    Ok(&buf.as_slice()[range.clone()])
}

/// Work enqueued on a stream, holding what it uses until it is done. Dropping it waits.
#[must_use = "dropping an Inflight blocks until the copy is done"]
pub struct Inflight<T> {
    event: Box<dyn EventBackend>,
    payload: Option<T>,
    _keep: Vec<DeviceBuffer>,
}

impl<T> Inflight<T> {
    /// Waits for the work and returns what it held. If the wait fails (a broken context), the
    /// payload is leaked rather than freed: a DMA into freed memory must never be possible.
    pub fn wait(mut self) -> Result<T> {
        if let Err(e) = self.event.synchronize() {
            std::mem::forget(self.payload.take());
            return Err(e);
        }
        self.payload
            .take()
            .ok_or_else(|| HalError::InvalidArgument("in-flight payload already taken".into()))
    }

    /// Whether the work is done (so that [`Inflight::wait`] will not block).
    pub fn is_complete(&self) -> Result<bool> {
        self.event.is_complete()
    }
}

impl<T> Drop for Inflight<T> {
    fn drop(&mut self) {
        if self.payload.is_some()
            && let Err(e) = self.event.synchronize()
        {
            tracing::error!(error = %e, "in-flight copy failed while being dropped; leaking its buffer");
            std::mem::forget(self.payload.take());
        }
    }
}

/// A timing event recorded on a stream.
pub struct Event {
    pub(crate) inner: Box<dyn EventBackend>,
}

impl Event {
    /// Blocks until the work before the event is done.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    /// Milliseconds of device time from `start` to this event.
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32> {
        self.inner.elapsed_ms_since(start.inner.as_ref())
    }
}
