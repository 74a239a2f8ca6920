//! On-demand array kernels (`kernels/ondemand.cu`): bringing pages in or writing them back
//! (what `OnDemandArray::prefetch` and `::synchronize` launch), the GPU tests' checked reads
//! and stores, and the layout report compared with [`crate::ondemand::constants()`]. The host
//! backend runs no kernels and refuses them ([`crate::ondemand::HostAccessor`] plays the
//! GPU's part there).

use super::Stream;
use super::backend::ArrayLaunch;
use crate::error::{HalError, Result};
use crate::ondemand::{PageCacheMemory, PageTable};
use crate::ring::RingMemory;
use std::ops::Range;

/// What the GPU test's checked reads found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayReadCheck {
    /// Reads made.
    pub reads: u64,
    /// Reads whose value was not the expected one.
    pub mismatches: u64,
    /// The smallest index read wrong, if any.
    pub first_bad: Option<u64>,
}

impl Stream {
    /// Brings pages `pages` of `table` into `cache` (`flush == false`) or writes back those
    /// of them that are dirty, with one GPU thread per page, misses and write-backs going
    /// through `ring` (whose proxy must be serving it). Waits for the kernel.
    pub(crate) fn array_pages(
        &self,
        cache: &PageCacheMemory,
        table: &PageTable,
        ring: &RingMemory,
        pages: Range<u64>,
        flush: bool,
    ) -> Result<()> {
        let array = self.array_device(cache, table, ring)?;
        if pages.start > pages.end || pages.end > table.pages() {
            return Err(HalError::InvalidArgument(format!(
                "pages {pages:?} of an array of {} pages",
                table.pages()
            )));
        }
        let launch = ArrayLaunch::Pages {
            array,
            flush,
            first: pages.start,
            count: pages.end - pages.start,
        };
        // SAFETY: cache, table and ring are borrowed (allocated, the ring mapped) until this
        // synchronous call returns; the caller keeps the proxy serving.
        unsafe { self.inner.array_kernel(launch) }
    }

    /// The GPU test's reads: `threads` GPU threads make `reads` reads of random u64 elements
    /// (from `salt`) of `table` and check each against word `i` of pattern `seed` (or of
    /// `written` where `i` is a multiple of `every`, `every > 0`). Waits for the kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn array_test_read(
        &self,
        cache: &PageCacheMemory,
        table: &PageTable,
        ring: &RingMemory,
        reads: u64,
        threads: u32,
        salt: u64,
        seed: u64,
        written: Option<(u64, u64)>,
    ) -> Result<ArrayReadCheck> {
        let array = self.array_device(cache, table, ring)?;
        let (every, written) = written.unwrap_or((0, 0));
        let out = self.gpu.alloc(24)?;
        let mut init = [0u8; 24];
        init[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        self.upload(&init, &out, 0)?;
        let launch = ArrayLaunch::TestRead {
            array,
            reads,
            salt,
            seed,
            every,
            written,
            out: out.range("array test counts", 0, 24)?,
            threads,
        };
        // SAFETY: as for array_pages; `out` lives until the download below.
        unsafe { self.inner.array_kernel(launch)? };
        let w = self.download_u64s(&out, 3)?;
        Ok(ArrayReadCheck {
            reads: w[2],
            mismatches: w[0],
            first_bad: (w[1] != u64::MAX).then_some(w[1]),
        })
    }

    /// The GPU test's stores: word `i` of pattern `written` into every element `i` of `table`
    /// that is a multiple of `every` (> 0). Waits for the kernel.
    pub fn array_test_store(
        &self,
        cache: &PageCacheMemory,
        table: &PageTable,
        ring: &RingMemory,
        every: u64,
        written: u64,
    ) -> Result<()> {
        if every == 0 {
            return Err(HalError::InvalidArgument("store every 0th element".into()));
        }
        let array = self.array_device(cache, table, ring)?;
        let launch = ArrayLaunch::TestStore {
            array,
            every,
            written,
        };
        // SAFETY: as for array_pages.
        unsafe { self.inner.array_kernel(launch) }
    }

    /// Benchmark reads (`gpuio bench ondemand`): `n` rows of `row_bytes` (a multiple of 8;
    /// 0: single u64 elements) named by `rows` (u64s on this device: row numbers, or element
    /// indices) into `out`, through the array (`source: Ok`), or, for elements, from a plain
    /// device array holding the same bytes (`source: Err`; an index past it reads 0), with
    /// `threads` GPU threads (a thread per row or element).
    /// Waits for the kernel. The caller checks the data.
    #[allow(clippy::too_many_arguments)]
    pub fn array_bench_reads(
        &self,
        source: std::result::Result<
            (&PageCacheMemory, &PageTable, &RingMemory),
            &super::DeviceBuffer,
        >,
        rows: &super::DeviceBuffer,
        n: usize,
        row_bytes: usize,
        out: &super::DeviceBuffer,
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
        let (array, plain) = match source {
            Ok((cache, table, ring)) => (Some(self.array_device(cache, table, ring)?), None),
            Err(buf) => {
                self.gpu.check_owns("plain bench source", buf)?;
                (None, Some(buf.range("plain bench source", 0, buf.len())?))
            }
        };
        let launch = ArrayLaunch::Bench {
            array,
            plain,
            rows: rows.range("bench rows", 0, n * 8)?,
            n: n as u64,
            row_words: (row_bytes / 8) as u64,
            out: out.range("bench output", 0, out_len)?,
            threads,
        };
        // SAFETY: as for array_pages; the buffers are borrowed until the kernel is done.
        unsafe { self.inner.array_kernel(launch) }
    }

    /// Holds every page of `array` (`hold`: one more pin each, frames into `frames`) or lets
    /// them go (the pages `frames` names). Waits for the kernel.
    pub(crate) fn array_hold(
        &self,
        array: crate::ondemand::ArrayDevice,
        frames: &super::DeviceBuffer,
        hold: bool,
    ) -> Result<()> {
        self.gpu.check_owns("held frame table", frames)?;
        let launch = ArrayLaunch::Hold {
            array,
            frames: frames.range("held frame table", 0, array.pages as usize * 4)?,
            hold,
        };
        // SAFETY: the caller (HeldPages) keeps the cache and the table allocated while the
        // hold lives, and the array's owner keeps the ring mapped and served (a hold's misses
        // go through it; letting go touches only the table); `frames` is borrowed until the
        // kernel is done.
        unsafe { self.inner.array_kernel(launch) }
    }

    /// Benchmark reads of `n` u64 elements (indices in `idx`, u64s on this device) of a held
    /// array into `out`, with `threads` GPU threads and no pin per read
    /// (`gpuio_resident_array`). Waits for the kernel. The caller checks the data.
    pub fn resident_bench_reads(
        &self,
        held: &crate::ondemand::HeldPages,
        idx: &super::DeviceBuffer,
        n: usize,
        out: &super::DeviceBuffer,
        threads: u32,
    ) -> Result<()> {
        let bytes = n
            .checked_mul(8)
            .ok_or_else(|| HalError::InvalidArgument("reads overflow".into()))?;
        let launch = ArrayLaunch::ResidentBench {
            array: held.device(),
            idx: idx.range("bench indices", 0, bytes)?,
            n: n as u64,
            out: out.range("bench output", 0, bytes)?,
            threads,
        };
        // SAFETY: `held` keeps every page of the array pinned and its frame table allocated
        // until the kernel is done; the ranges are checked.
        unsafe { self.inner.array_kernel(launch) }
    }

    /// The on-demand layout's constants as this device's compiler sees them, in the order of
    /// [`crate::ondemand::constants()`].
    pub fn array_layout_words(&self) -> Result<Vec<u64>> {
        let n = crate::ondemand::constants().len();
        let out = self.gpu.alloc(n * 8)?;
        let launch = ArrayLaunch::Layout {
            out: out.range("array layout", 0, n * 8)?,
        };
        // SAFETY: no cache or ring memory is involved; `out` lives until the download.
        unsafe { self.inner.array_kernel(launch)? };
        self.download_u64s(&out, n)
    }

    fn array_device(
        &self,
        cache: &PageCacheMemory,
        table: &PageTable,
        ring: &RingMemory,
    ) -> Result<crate::ondemand::ArrayDevice> {
        for (what, gpu) in [("page cache", cache.gpu()), ("request ring", ring.gpu())] {
            if !gpu.same_device(&self.gpu) {
                return Err(HalError::WrongDevice {
                    what,
                    owner: gpu.to_string(),
                    expected: self.gpu.to_string(),
                });
            }
        }
        Ok(cache.array_device(ring.device()?, table))
    }
}
