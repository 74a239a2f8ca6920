//! Kernels that issue IO through a request ring (`kernels/ring_bench.cu`): many threads reading
//! blocks with `gpuio_read`, one thread timing round trips, and the layout report that the GPU
//! test compares with [`crate::ring::layout()`]. The checks live here; the host backend runs no
//! kernels and refuses them (its producer is [`crate::ring::HostProducer`]).

use super::backend::RingLaunch;
use super::{DeviceBuffer, Stream};
use crate::error::{HalError, Result};
use crate::ring::RingMemory;

/// Timestamps [`Stream::ring_ping`] records per round trip.
pub const RING_PING_PHASES: usize = 4;

impl Stream {
    /// Launches `threads` GPU threads that read `count` blocks of `block` bytes of ring
    /// resource `resource` at `offsets` (`count` little-endian u64s on this device) through
    /// `ring`, block `i` into `dst` at `i * block`, and store each request's result (an i64:
    /// bytes or a negative `GPUIO_ERROR_*`) in `results`. Waits for the kernel, which waits
    /// for the ring's host proxy: the proxy must be serving the ring (shutting the ring down
    /// ends every wait).
    #[allow(clippy::too_many_arguments)]
    pub fn ring_read_blocks(
        &self,
        ring: &RingMemory,
        resource: u32,
        offsets: &DeviceBuffer,
        count: usize,
        block: usize,
        dst: &DeviceBuffer,
        results: &DeviceBuffer,
        threads: u32,
    ) -> Result<()> {
        for b in [offsets, dst, results] {
            self.gpu.check_owns("ring kernel buffer", b)?;
        }
        let words = count
            .checked_mul(8)
            .ok_or_else(|| HalError::InvalidArgument("too many blocks".into()))?;
        let bytes = count
            .checked_mul(block)
            .ok_or_else(|| HalError::InvalidArgument("blocks overflow".into()))?;
        let launch = RingLaunch::ReadBlocks {
            ring: self.ring_device(ring)?,
            resource,
            offsets: offsets.range("ring read offsets", 0, words)?,
            count: count as u64,
            block: block as u64,
            dst: dst.range("ring read destination", 0, bytes)?,
            results: results.range("ring read results", 0, words)?,
            threads: threads.max(1),
        };
        // SAFETY: `ring` is borrowed (mapped and registered) until this synchronous call ends.
        unsafe { self.inner.ring_kernel(launch) }
    }

    /// One GPU thread reads `len` bytes at offset 0 of ring resource `resource` into `dst`,
    /// `iters` times one after another, timing each by phase on the GPU's global timer: `ns`
    /// gets [`RING_PING_PHASES`] u64s per read, the nanoseconds from its start to its ticket
    /// claimed, its request posted, its completion seen and its slot handed back (the round
    /// trip); all `u64::MAX` where the read failed.
    pub fn ring_ping(
        &self,
        ring: &RingMemory,
        resource: u32,
        iters: usize,
        len: usize,
        dst: &DeviceBuffer,
        ns: &DeviceBuffer,
    ) -> Result<()> {
        self.gpu.check_owns("ring ping destination", dst)?;
        self.gpu.check_owns("ring ping timings", ns)?;
        let words = iters
            .checked_mul(8 * RING_PING_PHASES)
            .ok_or_else(|| HalError::InvalidArgument("too many round trips".into()))?;
        let launch = RingLaunch::Ping {
            ring: self.ring_device(ring)?,
            resource,
            iters: iters as u64,
            len: len as u64,
            dst: dst.range("ring ping destination", 0, len)?,
            ns: ns.range("ring ping timings", 0, words)?,
        };
        // SAFETY: as for ring_read_blocks.
        unsafe { self.inner.ring_kernel(launch) }
    }

    /// The ring's shared layout as this device's compiler sees it, in the order of
    /// [`crate::ring::RingLayout::words`].
    pub fn ring_layout_words(&self) -> Result<Vec<u64>> {
        let n = crate::ring::layout().words().len();
        let out = self.gpu.alloc(n * 8)?;
        let launch = RingLaunch::Layout {
            out: out.range("ring layout", 0, n * 8)?,
        };
        // SAFETY: no ring memory is involved; `out` lives until after the download below.
        unsafe { self.inner.ring_kernel(launch)? };
        self.download_u64s(&out, n)
    }

    fn ring_device(&self, ring: &RingMemory) -> Result<crate::ring::RingDevice> {
        if !ring.gpu().same_device(&self.gpu) {
            return Err(HalError::WrongDevice {
                what: "request ring",
                owner: ring.gpu().to_string(),
                expected: self.gpu.to_string(),
            });
        }
        ring.device()
    }
}
