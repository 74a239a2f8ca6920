//! Device work as data: a kernel family describes each thing it runs on a device as a
//! [`DeviceOp`] — what the CUDA backend launches, and beside it what the host backend does
//! instead (on the CPU, over the host memory that stands in for device memory, or an error
//! saying why it cannot) — and [`Stream::run`] runs it on the stream's device. The HAL keeps
//! no method per feature: a family adds kernels by adding ops in its own folder.
//!
//! An op's arguments are [`DevArg`]s, ranges of device buffers checked against the stream's
//! device by [`Stream::arg`] (or, by [`Stream::reachable_arg`], of another GPU's memory this
//! device's kernels reach), and plain values. A CUDA launch ([`CudaRun::launch`]) is
//! `unsafe` because of what the kernel does: the op's `cuda` says why its launch is sound,
//! next to the kernel's arguments. A host implementation locks the allocations it touches
//! ([`HostRun::lock`]: address order, exclusive where written), as every host-backend
//! operation does.

use super::Event;
use super::backend::{DevRange, StreamTarget};
use super::{DeviceBuffer, Stream};
use crate::error::{HalError, Result, check_range};
use crate::memory::HostBuffer;
use std::marker::PhantomData;
use std::time::Duration;

/// Work a [`Stream`] runs on its device: a CUDA launch, and what the host backend does.
pub trait DeviceOp {
    /// What the work gives back.
    type Output;

    /// On the host backend.
    fn host(&self, host: &HostRun<'_>) -> Result<Self::Output>;

    /// On a CUDA device.
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<Self::Output>;
}

impl Stream {
    /// Runs `op` on this stream's device.
    pub fn run<O: DeviceOp + ?Sized>(&self, op: &O) -> Result<O::Output> {
        match self.inner.target() {
            StreamTarget::Host => op.host(&HostRun {
                _stream: PhantomData,
            }),
            #[cfg(feature = "cuda")]
            StreamTarget::Cuda(stream) => op.cuda(&CudaRun::bound(stream)?),
        }
    }

    /// `len` bytes of `buf` from `offset`, as an op's argument: `buf` must be this stream's
    /// device's and hold the range.
    pub fn arg<'a>(
        &self,
        what: &'static str,
        buf: &'a DeviceBuffer,
        offset: usize,
        len: usize,
    ) -> Result<DevArg<'a>> {
        self.gpu.check_owns(what, buf)?;
        Ok(DevArg {
            range: buf.range(what, offset, len)?,
        })
    }

    /// As [`arg`](Self::arg), for a buffer of this device or one this device's kernels reach
    /// ([`Gpu::kernels_reach`](super::Gpu::kernels_reach)): an op given it may touch another
    /// GPU's memory. `None` where this device's kernels cannot reach `buf`.
    pub fn reachable_arg<'a>(
        &self,
        what: &'static str,
        buf: &'a DeviceBuffer,
        offset: usize,
        len: usize,
    ) -> Result<Option<DevArg<'a>>> {
        if !self.gpu.kernels_reach(buf) {
            return Ok(None);
        }
        let range = buf.range(what, offset, len)?;
        Ok(Some(DevArg { range }))
    }
}

impl Stream {
    /// `len` bytes of `buf` from `offset`, pinned host memory that kernels reach over the bus
    /// (zero-copy), as an op's argument: `buf` must be pinned ([`HostBuffer::pin`]).
    pub fn host_arg<'a>(
        &self,
        what: &'static str,
        buf: &'a HostBuffer,
        offset: usize,
        len: usize,
    ) -> Result<HostArg<'a>> {
        let pin = buf.pinned().ok_or_else(|| {
            HalError::InvalidArgument(format!(
                "{what}: zero-copy host memory must be pinned (HostBuffer::pin) so the device \
                 reaches it"
            ))
        })?;
        check_range(what, offset, len, buf.len())?;
        Ok(HostArg {
            ptr: buf.base_ptr().wrapping_add(offset),
            addr: pin.device_addr() + offset as u64,
            len,
            _buf: PhantomData,
        })
    }
}

/// A range of pinned host memory, an op's argument ([`Stream::host_arg`]): kernels reach it
/// at [`addr`](Self::addr), the CPU (the host backend) at [`ptr`](Self::ptr). The borrow of
/// its buffer keeps it mapped and registered.
#[derive(Clone, Copy)]
pub struct HostArg<'a> {
    ptr: *mut u8,
    addr: u64,
    len: usize,
    _buf: PhantomData<&'a HostBuffer>,
}

impl std::fmt::Debug for HostArg<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostArg({:#x}+{})", self.addr, self.len)
    }
}

impl HostArg<'_> {
    /// The address under which the device's kernels reach the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The CPU's pointer to the first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A checked range of a live device allocation, an op's argument ([`Stream::arg`]).
#[derive(Clone, Copy)]
pub struct DevArg<'a> {
    pub(crate) range: DevRange<'a>,
}

impl std::fmt::Debug for DevArg<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevArg({:#x}+{})", self.addr(), self.len())
    }
}

impl<'a> DevArg<'a> {
    /// The device address of the range's first byte (on the host backend, its CPU address).
    pub fn addr(&self) -> u64 {
        self.range.addr()
    }

    /// The CPU's pointer to the range on the host backend, where device memory is host
    /// memory (meaningless on a GPU). Touch it only under [`HostRun::lock`].
    pub fn host_ptr(&self) -> *mut u8 {
        self.range.addr() as *mut u8
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.range.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }

    /// `len` bytes of it from `offset`, checked.
    pub fn part(&self, offset: usize, len: usize) -> Result<Self> {
        Ok(Self {
            range: self.range.part(offset, len)?,
        })
    }

    /// Whether both lie in one allocation.
    pub fn same_allocation(&self, other: &DevArg<'_>) -> bool {
        self.range.same_allocation(&other.range)
    }
}

/// How a host implementation uses a range it locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read only: other readers may hold it too.
    Read,
    /// Written: held alone.
    Write,
}

/// The host backend running an op: device memory is host memory, and the CPU does the work.
pub struct HostRun<'s> {
    _stream: PhantomData<&'s Stream>,
}

impl HostRun<'_> {
    /// Locks the allocations of `uses` until the returned guard drops: each once, in address
    /// order (so that two ops cannot deadlock), exclusively where any use writes it. Within
    /// the guard's life the ranges' [`DevArg::host_ptr`]s may be read (and, where locked for
    /// writing, written) by this thread alone.
    pub fn lock<'a>(&self, uses: &[(DevArg<'a>, Access)]) -> Result<HostLocks<'a>> {
        super::host::lock_ranges(
            uses.iter()
                .map(|(a, use_)| (a.range, *use_ == Access::Write)),
        )
        .map(|held| HostLocks { _held: held })
    }

    /// Copies `src` into `dst` (of equal length), locking `dst`.
    pub fn upload(&self, src: &[u8], dst: DevArg<'_>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(HalError::InvalidArgument(format!(
                "upload of {} bytes into a range of {}",
                src.len(),
                dst.len()
            )));
        }
        let _lock = self.lock(&[(dst, Access::Write)])?;
        // SAFETY: `dst` is a checked range of a live host-backend allocation, locked for
        // writing above; `src` is a distinct borrowed slice of the same length.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.host_ptr(), src.len()) };
        Ok(())
    }

    /// The error for an op that needs a GPU's kernels: `what` cannot run on the host backend,
    /// and `instead` says what plays its part there.
    pub fn no_kernels(&self, what: &'static str, instead: &str) -> HalError {
        HalError::Unsupported {
            what,
            reason: format!("the host backend runs no kernels; {instead}"),
        }
    }
}

/// Locks [`HostRun::lock`] holds.
pub struct HostLocks<'a> {
    _held: Vec<super::host::HeldLock<'a>>,
}

/// A kernel launch's shape: `grid` blocks of `block` threads (in `grid_y` rows of `grid`
/// blocks where `grid_y > 1`), `shared_bytes` of dynamic shared memory a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    /// Blocks in the grid (in each of its rows).
    pub grid: u32,
    /// Rows of the grid (its second dimension, `blockIdx.y`): 1 for a line of blocks.
    pub grid_y: u32,
    /// Threads a block.
    pub block: u32,
    /// Dynamic shared memory a block, in bytes.
    pub shared_bytes: u32,
}

impl LaunchShape {
    /// One thread.
    pub const ONE: Self = Self {
        grid: 1,
        grid_y: 1,
        block: 1,
        shared_bytes: 0,
    };

    /// At least `threads` threads in blocks of `block`.
    pub fn threads(threads: u32, block: u32) -> Self {
        Self {
            grid: threads.div_ceil(block.max(1)).max(1),
            grid_y: 1,
            block: block.max(1),
            shared_bytes: 0,
        }
    }

    /// This shape in `rows` rows (the grid's second dimension; at least 1): kernels that take
    /// one job per row of blocks.
    pub fn rows(self, rows: u32) -> Self {
        Self {
            grid_y: rows.max(1),
            ..self
        }
    }
}

/// A kernel's arguments in order: values as the kernel's C parameters take them (a device
/// pointer is a `u64`).
#[derive(Debug, Clone, Default)]
pub struct KernelArgs {
    pub(crate) values: Vec<KernelArg>,
}

/// One kernel argument.
#[derive(Debug, Clone)]
pub(crate) enum KernelArg {
    U64(u64),
    U32(u32),
    I32(i32),
    F32(f32),
    Bytes(Vec<u8>),
}

impl KernelArgs {
    /// No arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A `u64` (or `size_t`, or a device pointer as an address).
    pub fn u64(mut self, v: u64) -> Self {
        self.values.push(KernelArg::U64(v));
        self
    }

    /// A `u32` (`unsigned`).
    pub fn u32(mut self, v: u32) -> Self {
        self.values.push(KernelArg::U32(v));
        self
    }

    /// An `int`.
    pub fn i32(mut self, v: i32) -> Self {
        self.values.push(KernelArg::I32(v));
        self
    }

    /// A `float`.
    pub fn f32(mut self, v: f32) -> Self {
        self.values.push(KernelArg::F32(v));
        self
    }

    /// A structure passed by value, as its bytes laid out as the kernel's parameter type
    /// (a `#[repr(C)]` descriptor's `to_bytes`, say).
    pub fn bytes(mut self, v: &[u8]) -> Self {
        self.values.push(KernelArg::Bytes(v.to_vec()));
        self
    }

    /// A pointer to the first byte of `range`.
    pub fn ptr(self, range: &DevArg<'_>) -> Self {
        self.u64(range.addr())
    }

    /// A pointer to the first byte of pinned host memory, as the device reaches it.
    pub fn host_ptr(self, range: &HostArg<'_>) -> Self {
        self.u64(range.addr())
    }
}

/// The CUDA backend running an op on one of its streams.
pub struct CudaRun<'s> {
    #[cfg(feature = "cuda")]
    pub(crate) stream: &'s super::cuda::CudaStreamBackend,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
    #[cfg(not(feature = "cuda"))]
    _stream: PhantomData<&'s Stream>,
}

/// Without the CUDA backend no `CudaRun` exists; these keep ops' code the same either way.
#[cfg(not(feature = "cuda"))]
impl CudaRun<'_> {
    /// For the HAL's own ops, whose CUDA side reaches the backend's internals.
    pub(crate) fn never(&self) -> ! {
        match self.never {}
    }

    /// See the CUDA backend's `CudaRun::grid_stride`.
    pub fn grid_stride(&self, _items: u64) -> LaunchShape {
        match self.never {}
    }

    /// See the CUDA backend's `CudaRun::launch`.
    ///
    /// # Safety
    /// Never callable: no value of this type exists.
    pub unsafe fn launch<K: crate::kernels::Kernel>(
        &self,
        _kernel: K,
        _shape: LaunchShape,
        _args: &KernelArgs,
    ) -> Result<()> {
        match self.never {}
    }

    /// See the CUDA backend's `CudaRun::synchronize`.
    pub fn synchronize(&self) -> Result<()> {
        match self.never {}
    }

    /// See the CUDA backend's `CudaRun::upload`.
    ///
    /// # Safety
    /// Never callable: no value of this type exists.
    pub unsafe fn upload(&self, _src: *const u8, _dst: DevArg<'_>) -> Result<()> {
        match self.never {}
    }

    /// See the CUDA backend's `CudaRun::download`.
    ///
    /// # Safety
    /// Never callable: no value of this type exists.
    pub unsafe fn download(&self, _src: DevArg<'_>, _dst: *mut u8) -> Result<()> {
        match self.never {}
    }

    /// See the CUDA backend's `CudaRun::record`.
    pub fn record(&self, _timing: bool) -> Result<super::Event> {
        match self.never {}
    }
}

/// Runs a one-thread kernel that writes `words` u64s at its only argument (a layout as the
/// device compiler sees it, say) and returns them; on the host backend, the error `what`
/// cannot run there, `instead` saying what plays its part.
///
/// # Safety
/// `kernel` takes one `u64*` and writes at most `words` u64s there, touching nothing else.
pub unsafe fn report_words<K: crate::kernels::Kernel>(
    stream: &Stream,
    kernel: K,
    words: usize,
    what: &'static str,
    instead: &str,
) -> Result<Vec<u64>> {
    let out = stream.gpu().alloc(words.saturating_mul(8).max(8))?;
    stream.run(&Report {
        kernel,
        out: stream.arg(what, &out, 0, words * 8)?,
        what,
        instead,
    })?;
    stream.download_u64s(&out, words)
}

/// [`report_words`]'s op.
struct Report<'a, K> {
    kernel: K,
    out: DevArg<'a>,
    what: &'static str,
    instead: &'a str,
}

impl<K: crate::kernels::Kernel> DeviceOp for Report<'_, K> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels(self.what, self.instead))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let args = KernelArgs::new().ptr(&self.out);
        // SAFETY: report_words's contract: the kernel writes at most `out.len() / 8` u64s at
        // `out`, a checked range of an allocation that lives until the download after this
        // op, which waits for the kernel below.
        unsafe { cuda.launch(self.kernel, LaunchShape::ONE, &args)? };
        cuda.synchronize()
    }
}

// ---------------------------------------------------------------------------------------------
// What ops share.

/// Refuses device ranges (address, length) of one call that overlap: a kernel writing one
/// while reading another would give unspecified bytes.
pub fn check_disjoint(mut spans: Vec<(u64, usize)>, what: &str) -> Result<()> {
    spans.retain(|&(_, len)| len > 0);
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[0].0 + w[0].1 as u64 > w[1].0) {
        return Err(HalError::InvalidArgument(format!("{what} overlap")));
    }
    Ok(())
}

/// The widest piece (16, 8, 4 or 1 bytes) that divides the row size and every address a row
/// kernel starts rows at: its kernels' slot among the `_16/_8/_4/_1` variants, and the width.
pub fn widest_piece(row_bytes: u64, addrs: impl IntoIterator<Item = u64> + Clone) -> (usize, u64) {
    [(0, 16u64), (1, 8), (2, 4), (3, 1)]
        .into_iter()
        .find(|&(_, w)| {
            row_bytes.is_multiple_of(w) && addrs.clone().into_iter().all(|a| a.is_multiple_of(w))
        })
        .unwrap_or((3, 1))
}

/// The device's time between two timing events, where both were recorded.
pub fn device_time(start: Option<Event>, end: Option<Event>) -> Result<Option<Duration>> {
    match (start, end) {
        (Some(start), Some(end)) => elapsed(&start, &end).map(Some),
        _ => Ok(None),
    }
}

/// The device's time from timing event `from` to timing event `to`.
pub fn elapsed(from: &Event, to: &Event) -> Result<Duration> {
    let ms = to.elapsed_ms_since(from)?;
    Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
}

/// Waits for the stream on every way out of an op's CUDA side (an error, a panic) unless
/// [`wait`](Self::wait) or [`disarm`](Self::disarm) ran: kernels and copies still using what
/// the op borrows must be done before the borrows end.
pub struct WaitOnDrop<'r, 's>(Option<&'r CudaRun<'s>>);

impl<'r, 's> WaitOnDrop<'r, 's> {
    /// Armed: waits for `cuda`'s stream when dropped.
    pub fn new(cuda: &'r CudaRun<'s>) -> Self {
        Self(Some(cuda))
    }

    /// Waits now, reporting an error the work ran into.
    pub fn wait(mut self) -> Result<()> {
        self.0.take().map_or(Ok(()), CudaRun::synchronize)
    }

    /// Lets the work run on: what it still uses outlives the op.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for WaitOnDrop<'_, '_> {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.0.map(CudaRun::synchronize) {
            tracing::error!(error = %e, "waiting for an op's device work failed");
        }
    }
}
