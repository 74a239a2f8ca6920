//! On-demand array kernels (`kernels/ondemand.cu`), as ops: bringing pages in or writing them
//! back (what `OnDemandArray::prefetch` and `::synchronize` launch), holding an array's pages,
//! the GPU tests' checked reads and stores, the benches' reads, and the layout report compared
//! with [`super::constants()`]. The host backend runs no kernels;
//! [`super::HostAccessor`] plays the GPU's part there.

use super::{ArrayDevice, PageCacheMemory, PageTable};
#[cfg(feature = "test-kernels")]
use super::{HeldPages, ResidentDevice};
use crate::RingMemory;
use crate::kernels::OndemandKernel;
use gpuio_hal::error::{HalError, Result};
#[cfg(feature = "test-kernels")]
use gpuio_hal::gpu::HostArg;
use gpuio_hal::gpu::{CudaRun, DevArg, DeviceBuffer, DeviceOp, HostRun, KernelArgs, Stream};
#[cfg(feature = "test-kernels")]
use gpuio_hal::memory::HostBuffer;
use std::ops::Range;

const NO_KERNELS: &str = "ondemand::HostAccessor plays the GPU's part";

/// What the GPU test's checked reads found ([`test_read`]).
#[cfg(feature = "test-kernels")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayReadCheck {
    /// Reads made.
    pub reads: u64,
    /// Reads whose value was not the expected one.
    pub mismatches: u64,
    /// The smallest index read wrong, if any.
    pub first_bad: Option<u64>,
}

/// An array's cache, page table and ring, checked to be the stream's device's, as one
/// descriptor; the borrows keep them allocated (the ring mapped) while a kernel uses them.
#[derive(Clone, Copy)]
struct Array<'a> {
    device: ArrayDevice,
    _parts: (&'a PageCacheMemory, &'a PageTable, &'a RingMemory),
}

impl<'a> Array<'a> {
    fn new(
        stream: &Stream,
        cache: &'a PageCacheMemory,
        table: &'a PageTable,
        ring: &'a RingMemory,
    ) -> Result<Self> {
        for (what, gpu) in [("page cache", cache.gpu()), ("request ring", ring.gpu())] {
            if !gpu.same_device(stream.gpu()) {
                return Err(HalError::WrongDevice {
                    what,
                    owner: gpu.to_string(),
                    expected: stream.gpu().to_string(),
                });
            }
        }
        Ok(Self {
            device: cache.array_device(ring.device()?, table),
            _parts: (cache, table, ring),
        })
    }

    fn args(&self) -> KernelArgs {
        KernelArgs::new().bytes(&self.device.to_bytes())
    }
}

/// Brings pages `pages` of `table` into `cache` (`flush == false`) or writes back those of
/// them that are dirty, with one GPU thread per page, misses and write-backs going through
/// `ring` (whose proxy must be serving it). Waits for the kernel.
pub(crate) fn pages(
    stream: &Stream,
    cache: &PageCacheMemory,
    table: &PageTable,
    ring: &RingMemory,
    pages: Range<u64>,
    flush: bool,
) -> Result<()> {
    let array = Array::new(stream, cache, table, ring)?;
    if pages.start > pages.end || pages.end > table.pages() {
        return Err(HalError::InvalidArgument(format!(
            "pages {pages:?} of an array of {} pages",
            table.pages()
        )));
    }
    stream.run(&Pages {
        array,
        flush,
        first: pages.start,
        count: pages.end - pages.start,
    })
}

#[cfg(feature = "test-kernels")]
/// The GPU test's reads: `threads` GPU threads make `reads` reads of random u64 elements
/// (from `salt`) of `table` and check each against word `i` of pattern `seed` (or of
/// `written` where `i` is a multiple of `every`, `every > 0`). Waits for the kernel.
#[allow(clippy::too_many_arguments)]
pub fn test_read(
    stream: &Stream,
    cache: &PageCacheMemory,
    table: &PageTable,
    ring: &RingMemory,
    reads: u64,
    threads: u32,
    salt: u64,
    seed: u64,
    written: Option<(u64, u64)>,
) -> Result<ArrayReadCheck> {
    let array = Array::new(stream, cache, table, ring)?;
    let (every, written) = written.unwrap_or((0, 0));
    let out = stream.gpu().alloc(24)?;
    let mut init = [0u8; 24];
    init[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    stream.upload(&init, &out, 0)?;
    stream.run(&TestRead {
        array,
        reads,
        salt,
        seed,
        every,
        written,
        out: stream.arg("array test counts", &out, 0, 24)?,
        threads,
    })?;
    let w = stream.download_u64s(&out, 3)?;
    Ok(ArrayReadCheck {
        reads: w[2],
        mismatches: w[0],
        first_bad: (w[1] != u64::MAX).then_some(w[1]),
    })
}

#[cfg(feature = "test-kernels")]
/// The GPU test's stores: word `i` of pattern `written` into every element `i` of `table`
/// that is a multiple of `every` (> 0). Waits for the kernel.
pub fn test_store(
    stream: &Stream,
    cache: &PageCacheMemory,
    table: &PageTable,
    ring: &RingMemory,
    every: u64,
    written: u64,
) -> Result<()> {
    if every == 0 {
        return Err(HalError::InvalidArgument("store every 0th element".into()));
    }
    let array = Array::new(stream, cache, table, ring)?;
    stream.run(&TestStore {
        array,
        every,
        written,
    })
}

#[cfg(feature = "test-kernels")]
/// Benchmark reads (`gpuio bench ondemand`): `n` rows of `row_bytes` (a multiple of 8; 0:
/// single u64 elements) named by `rows` (u64s on this device: row numbers, or element
/// indices) into `out`, through the array (`source: Ok`), or, for elements, from a plain
/// device array holding the same bytes (`source: Err`; an index past it reads 0), with
/// `threads` GPU threads (a thread per row or element). Waits for the kernel. The caller
/// checks the data.
#[allow(clippy::too_many_arguments)]
pub fn bench_reads(
    stream: &Stream,
    source: std::result::Result<(&PageCacheMemory, &PageTable, &RingMemory), &DeviceBuffer>,
    rows: &DeviceBuffer,
    n: usize,
    row_bytes: usize,
    out: &DeviceBuffer,
    threads: u32,
) -> Result<()> {
    if !row_bytes.is_multiple_of(8) {
        return Err(HalError::InvalidArgument(format!(
            "rows of {row_bytes} bytes: a multiple of 8"
        )));
    }
    let each = row_bytes.max(8);
    let out_len = n
        .checked_mul(each)
        .ok_or_else(|| HalError::InvalidArgument("rows overflow".into()))?;
    let source = match source {
        Ok((cache, table, ring)) => BenchSource::Array(Array::new(stream, cache, table, ring)?),
        Err(_) if row_bytes > 0 => {
            return Err(HalError::InvalidArgument(
                "benchmark reads: rows through an array, elements through either".into(),
            ));
        }
        Err(buf) => BenchSource::Plain(stream.arg("plain bench source", buf, 0, buf.len())?),
    };
    stream.run(&BenchReads {
        source,
        rows: stream.arg("bench rows", rows, 0, n.saturating_mul(8))?,
        n: n as u64,
        row_words: (row_bytes / 8) as u64,
        four_bytes: false,
        out: stream.arg("bench output", out, 0, out_len)?,
        threads,
    })
}

#[cfg(feature = "test-kernels")]
/// Benchmark reads of 4-byte elements (`gpuio bench ondemand`'s element cases): `n` of them
/// at the indices `idx` (u64s on this device) into `out` (`n` u32s), from `source`, with
/// `threads` GPU threads. Waits for the kernel. The caller checks the data.
pub fn bench_reads_u32(
    stream: &Stream,
    source: WordSource<'_>,
    idx: &DeviceBuffer,
    n: usize,
    out: &DeviceBuffer,
    threads: u32,
) -> Result<()> {
    let source = match source {
        WordSource::Array(cache, table, ring) => {
            BenchSource::Array(Array::new(stream, cache, table, ring)?)
        }
        WordSource::Device(buf) => {
            BenchSource::Plain(stream.arg("plain bench source", buf, 0, buf.len())?)
        }
        WordSource::Pinned(buf) => {
            BenchSource::Pinned(stream.host_arg("pinned bench source", buf, 0, buf.len())?)
        }
    };
    stream.run(&BenchReads {
        source,
        rows: stream.arg("bench indices", idx, 0, n.saturating_mul(8))?,
        n: n as u64,
        row_words: 0,
        four_bytes: true,
        out: stream.arg("bench output", out, 0, n.saturating_mul(4))?,
        threads,
    })
}

/// Holds every page of `array` (`hold`: one more pin each, frames into `frames`) or lets them
/// go (the pages `frames` names). Waits for the kernel.
///
/// The caller (`HeldPages`) keeps the cache and the table allocated while the hold lives, and
/// the array's owner keeps the ring mapped and served (a hold's misses go through it; letting
/// go touches only the table).
pub(crate) fn hold(
    stream: &Stream,
    array: ArrayDevice,
    frames: &DeviceBuffer,
    hold: bool,
) -> Result<()> {
    stream.run(&Hold {
        array,
        frames: stream.arg("held frame table", frames, 0, array.pages as usize * 4)?,
        hold,
    })
}

#[cfg(feature = "test-kernels")]
/// Benchmark reads of `n` u64 elements (indices in `idx`, u64s on this device) of a held
/// array into `out`, with `threads` GPU threads and no pin per read (`gpuio_resident_array`).
/// Waits for the kernel. The caller checks the data.
pub fn resident_bench_reads(
    stream: &Stream,
    held: &HeldPages,
    idx: &DeviceBuffer,
    n: usize,
    out: &DeviceBuffer,
    threads: u32,
) -> Result<()> {
    let bytes = n
        .checked_mul(8)
        .ok_or_else(|| HalError::InvalidArgument("reads overflow".into()))?;
    stream.run(&ResidentBench {
        array: held.device(),
        _held: held,
        idx: stream.arg("bench indices", idx, 0, bytes)?,
        n: n as u64,
        out: stream.arg("bench output", out, 0, bytes)?,
        threads,
    })
}

#[cfg(feature = "test-kernels")]
/// The on-demand layout's constants as this device's compiler sees them, in the order of
/// [`super::constants()`].
pub fn device_layout_words(stream: &Stream) -> Result<Vec<u64>> {
    let n = super::constants().len();
    // SAFETY: gpuio_array_layout takes one u64* and writes constants().len() u64s.
    unsafe {
        gpuio_hal::gpu::report_words(
            stream,
            OndemandKernel::ArrayLayout,
            n,
            "the on-demand layout report",
            NO_KERNELS,
        )
    }
}

struct Pages<'a> {
    array: Array<'a>,
    flush: bool,
    first: u64,
    count: u64,
}

impl DeviceOp for Pages<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("on-demand array kernels", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let kernel = if self.flush {
            OndemandKernel::ArrayFlush
        } else {
            OndemandKernel::ArrayTouch
        };
        let args = self.array.args().u64(self.first).u64(self.count);
        // SAFETY: the arguments match gpuio_array_touch / gpuio_array_flush; they touch pages
        // first..first+count of the array (checked against its page count) and the cache's
        // memory, which the array's borrows keep alive until the synchronize below.
        unsafe { cuda.launch(kernel, cuda.grid_stride(self.count), &args)? };
        cuda.synchronize()
    }
}

#[cfg(feature = "test-kernels")]
struct TestRead<'a> {
    array: Array<'a>,
    reads: u64,
    salt: u64,
    seed: u64,
    every: u64,
    written: u64,
    out: DevArg<'a>,
    threads: u32,
}

#[cfg(feature = "test-kernels")]
impl DeviceOp for TestRead<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("on-demand array kernels", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let args = self.array.args();
        let args = args.u64(self.reads).u64(self.salt).u64(self.seed);
        let args = args.u64(self.every).u64(self.written).ptr(&self.out);
        let shape = cuda.grid_stride(u64::from(self.threads.max(1)));
        // SAFETY: matches gpuio_array_test_read, which writes three u64s at `out` (a range
        // checked to hold them) and reads through the array as Pages does.
        unsafe { cuda.launch(OndemandKernel::ArrayTestRead, shape, &args)? };
        cuda.synchronize()
    }
}

#[cfg(feature = "test-kernels")]
struct TestStore<'a> {
    array: Array<'a>,
    every: u64,
    written: u64,
}

#[cfg(feature = "test-kernels")]
impl DeviceOp for TestStore<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("on-demand array kernels", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let count = (self.array.device.bytes / 8).div_ceil(self.every.max(1));
        let args = self.array.args().u64(self.every).u64(self.written);
        // SAFETY: matches gpuio_array_test_store, which stores through the array only.
        unsafe {
            cuda.launch(
                OndemandKernel::ArrayTestStore,
                cuda.grid_stride(count),
                &args,
            )?
        };
        cuda.synchronize()
    }
}

#[cfg(feature = "test-kernels")]
/// Where [`bench_reads_u32`] reads.
pub enum WordSource<'a> {
    /// An on-demand array of u32.
    Array(&'a PageCacheMemory, &'a PageTable, &'a RingMemory),
    /// Memory the kernel reads directly: a device array, or managed memory (an index past it
    /// reads 0).
    Device(&'a DeviceBuffer),
    /// Pinned host memory the kernel reads over the bus (zero-copy; an index past it reads 0).
    Pinned(&'a HostBuffer),
}

#[cfg(feature = "test-kernels")]
/// Where benchmark reads come from.
enum BenchSource<'a> {
    Array(Array<'a>),
    /// A plain device array (elements only).
    Plain(DevArg<'a>),
    /// Pinned host memory (4-byte elements only).
    Pinned(HostArg<'a>),
}

#[cfg(feature = "test-kernels")]
struct BenchReads<'a> {
    source: BenchSource<'a>,
    rows: DevArg<'a>,
    n: u64,
    row_words: u64,
    /// Elements are u32s (else u64s).
    four_bytes: bool,
    out: DevArg<'a>,
    threads: u32,
}

#[cfg(feature = "test-kernels")]
impl DeviceOp for BenchReads<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("on-demand array kernels", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let (kernel, args) = match &self.source {
            BenchSource::Array(a) if self.row_words > 0 => {
                (OndemandKernel::ArrayBenchRows, a.args())
            }
            BenchSource::Array(a) if self.four_bytes => (OndemandKernel::ArrayBenchWords, a.args()),
            BenchSource::Array(a) => (OndemandKernel::ArrayBenchElements, a.args()),
            BenchSource::Plain(p) if self.four_bytes => (
                OndemandKernel::PlainBenchWords,
                KernelArgs::new().ptr(p).u64((p.len() / 4) as u64),
            ),
            BenchSource::Plain(p) => (
                OndemandKernel::PlainBenchElements,
                KernelArgs::new().ptr(p).u64((p.len() / 8) as u64),
            ),
            BenchSource::Pinned(h) => (
                OndemandKernel::PlainBenchWords,
                KernelArgs::new().u64(h.addr()).u64((h.len() / 4) as u64),
            ),
        };
        let mut args = args.ptr(&self.rows).u64(self.n);
        if self.row_words > 0 {
            args = args.u64(self.row_words);
        }
        let args = args.ptr(&self.out);
        let shape = cuda.grid_stride(u64::from(self.threads.max(32)));
        // SAFETY: the arguments match the gpuio_*_bench_* kernel chosen above; it reads `n`
        // checked entries of `rows`, the array or the checked plain range (indices past it
        // read 0), and writes `n` rows or elements into the checked `out` range.
        unsafe { cuda.launch(kernel, shape, &args)? };
        cuda.synchronize()
    }
}

struct Hold<'a> {
    array: ArrayDevice,
    frames: DevArg<'a>,
    hold: bool,
}

impl DeviceOp for Hold<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("on-demand array kernels", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let kernel = if self.hold {
            OndemandKernel::ArrayHold
        } else {
            OndemandKernel::ArrayLetGo
        };
        let count = self.array.pages;
        let args = KernelArgs::new().bytes(&self.array.to_bytes());
        let args = args.u64(0).u64(count).ptr(&self.frames);
        // SAFETY: matches gpuio_array_hold / gpuio_array_let_go, which touch the array's
        // pages (kept allocated by the caller, `hold`'s contract) and `count` u32s at
        // `frames`, a range checked to hold one per page.
        unsafe { cuda.launch(kernel, cuda.grid_stride(count), &args)? };
        cuda.synchronize()
    }
}

#[cfg(feature = "test-kernels")]
struct ResidentBench<'a> {
    array: ResidentDevice,
    _held: &'a HeldPages,
    idx: DevArg<'a>,
    n: u64,
    out: DevArg<'a>,
    threads: u32,
}

#[cfg(feature = "test-kernels")]
impl DeviceOp for ResidentBench<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("on-demand array kernels", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let args = KernelArgs::new().bytes(&self.array.to_bytes());
        let args = args.ptr(&self.idx).u64(self.n).ptr(&self.out);
        let shape = cuda.grid_stride(u64::from(self.threads.max(32)));
        // SAFETY: matches gpuio_resident_bench_elements: it reads `n` indices and writes `n`
        // u64s (checked ranges) and reads the held array's frames, which stay allocated and
        // pinned while `_held` is borrowed.
        unsafe { cuda.launch(OndemandKernel::ResidentBenchElements, shape, &args)? };
        cuda.synchronize()
    }
}
