//! Kernels that issue IO through a request ring (`kernels/ring_bench.cu`), as ops: many
//! threads reading blocks with `gpuio_read`, one thread timing round trips, and the layout
//! report that the GPU test compares with [`super::layout()`]. The host backend runs no
//! kernels; its producer is [`super::HostProducer`].

use super::{RingDevice, RingMemory};
use crate::kernels::RingBenchKernel;
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::gpu::{
    CudaRun, DevArg, DeviceBuffer, DeviceOp, HostRun, KernelArgs, LaunchShape, Stream, report_words,
};

/// Timestamps [`ping`] records per round trip.
pub const RING_PING_PHASES: usize = 4;

/// Launches `threads` GPU threads that read `count` blocks of `block` bytes of ring resource
/// `resource` at `offsets` (`count` little-endian u64s on this device) through `ring`, block
/// `i` into `dst` at `i * block`, and store each request's result (an i64: bytes or a negative
/// `GPUIO_ERROR_*`) in `results`. Waits for the kernel, which waits for the ring's host proxy:
/// the proxy must be serving the ring (shutting the ring down ends every wait).
#[allow(clippy::too_many_arguments)]
pub fn read_blocks(
    stream: &Stream,
    ring: &RingMemory,
    resource: u32,
    offsets: &DeviceBuffer,
    count: usize,
    block: usize,
    dst: &DeviceBuffer,
    results: &DeviceBuffer,
    threads: u32,
) -> Result<()> {
    let words = count
        .checked_mul(8)
        .ok_or_else(|| HalError::InvalidArgument("too many blocks".into()))?;
    let bytes = count
        .checked_mul(block)
        .ok_or_else(|| HalError::InvalidArgument("blocks overflow".into()))?;
    stream.run(&ReadBlocks {
        ring: device_of(stream, ring)?,
        resource,
        offsets: stream.arg("ring read offsets", offsets, 0, words)?,
        count: count as u64,
        block: block as u64,
        dst: stream.arg("ring read destination", dst, 0, bytes)?,
        results: stream.arg("ring read results", results, 0, words)?,
        threads: threads.max(1),
        _ring: ring,
    })
}

/// One GPU thread reads `len` bytes at offset 0 of ring resource `resource` into `dst`,
/// `iters` times one after another, timing each by phase on the GPU's global timer: `ns` gets
/// [`RING_PING_PHASES`] u64s per read, the nanoseconds from its start to its ticket claimed,
/// its request posted, its completion seen and its slot handed back (the round trip); all
/// `u64::MAX` where the read failed.
pub fn ping(
    stream: &Stream,
    ring: &RingMemory,
    resource: u32,
    iters: usize,
    len: usize,
    dst: &DeviceBuffer,
    ns: &DeviceBuffer,
) -> Result<()> {
    let words = iters
        .checked_mul(8 * RING_PING_PHASES)
        .ok_or_else(|| HalError::InvalidArgument("too many round trips".into()))?;
    stream.run(&Ping {
        ring: device_of(stream, ring)?,
        resource,
        iters: iters as u64,
        len: len as u64,
        dst: stream.arg("ring ping destination", dst, 0, len)?,
        ns: stream.arg("ring ping timings", ns, 0, words)?,
        _ring: ring,
    })
}

/// The ring's shared layout as this device's compiler sees it, in the order of
/// [`super::RingLayout::words`].
pub fn layout_words(stream: &Stream) -> Result<Vec<u64>> {
    let n = super::layout().words().len();
    // SAFETY: gpuio_ring_layout takes one u64* and writes RingLayout::words().len() u64s.
    unsafe {
        report_words(
            stream,
            RingBenchKernel::RingLayout,
            n,
            "the ring layout report",
            NO_KERNELS,
        )
    }
}

fn device_of(stream: &Stream, ring: &RingMemory) -> Result<RingDevice> {
    if !ring.gpu().same_device(stream.gpu()) {
        return Err(HalError::WrongDevice {
            what: "request ring",
            owner: ring.gpu().to_string(),
            expected: stream.gpu().to_string(),
        });
    }
    ring.device()
}

const NO_KERNELS: &str = "ring::HostProducer plays the GPU's part";

/// The ring's arguments, as every ring kernel takes them first.
fn ring_args(ring: &RingDevice, resource: u32) -> KernelArgs {
    KernelArgs::new()
        .u64(ring.header)
        .u64(ring.slots)
        .u64(ring.claim)
        .u32(ring.mask)
        .u32(ring.nslots)
        .u64(ring.bounce)
        .u64(ring.bounce_bytes)
        .u32(resource)
}

struct ReadBlocks<'a> {
    ring: RingDevice,
    resource: u32,
    offsets: DevArg<'a>,
    count: u64,
    block: u64,
    dst: DevArg<'a>,
    results: DevArg<'a>,
    threads: u32,
    /// Borrowed so that the ring stays mapped and registered while the kernel runs.
    _ring: &'a RingMemory,
}

impl DeviceOp for ReadBlocks<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("kernel-issued ring IO", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let args = ring_args(&self.ring, self.resource)
            .ptr(&self.offsets)
            .u64(self.count)
            .u64(self.block)
            .ptr(&self.dst)
            .ptr(&self.results);
        // SAFETY: the arguments match gpuio_ring_read_blocks; the kernel reads the checked
        // offsets range, writes the checked results range, and touches the ring's memory,
        // which `_ring` keeps mapped and registered until the synchronize below. dst is
        // written by the host proxy, not by the kernel.
        unsafe {
            cuda.launch(
                RingBenchKernel::RingReadBlocks,
                LaunchShape::threads(self.threads, 128),
                &args,
            )?
        };
        cuda.synchronize()
    }
}

struct Ping<'a> {
    ring: RingDevice,
    resource: u32,
    iters: u64,
    len: u64,
    dst: DevArg<'a>,
    ns: DevArg<'a>,
    _ring: &'a RingMemory,
}

impl DeviceOp for Ping<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("kernel-issued ring IO", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let args = ring_args(&self.ring, self.resource)
            .u64(self.iters)
            .u64(self.len)
            .ptr(&self.dst)
            .ptr(&self.ns);
        // SAFETY: as for ReadBlocks; the kernel writes only the checked ns range.
        unsafe { cuda.launch(RingBenchKernel::RingPing, LaunchShape::ONE, &args)? };
        cuda.synchronize()
    }
}
