//! Row gathers and scatters run by the device itself (zero-copy): rows of a pinned host pool
//! (or a device pool) picked by an index list, moved to or from a dense device buffer by the
//! `kernels/gather.cu` kernels. The checks live here, once, for every backend.

use super::backend::{RowHooks, RowJob, RowMem, RowsDone};
use super::hot_rows::HotRefs;
use super::op::{CudaRun, DeviceOp, HostRun};
use super::{DeviceBuffer, Stream};
use crate::error::{HalError, Result};
use crate::memory::HostBuffer;
use std::cell::RefCell;
use std::ops::Range;
use std::time::Duration;

/// Where a row job's index list (little-endian u64s) lives.
pub enum RowIndices<'a> {
    /// In device memory of the stream's device.
    Device(&'a DeviceBuffer),
    /// In pinned host memory, read by the kernel over PCIe as it goes (no separate copy).
    Pinned(&'a HostBuffer),
    /// In pinned host memory, copied to the device buffer by DMA just before the kernel, in
    /// the same stream (no wait in between): the kernel's index loads stay on the device.
    Staged {
        /// The indices (the first `count` u64s).
        host: &'a HostBuffer,
        /// Where they are copied to (at least `count * 8` bytes of this device).
        device: &'a DeviceBuffer,
    },
    /// Written into pinned host memory while the device works, piece after piece (the first
    /// of 4 Ki indices, the next ones longer): the rows of a piece are moved as soon as its
    /// indices are written, so the device starts after microseconds instead of after the
    /// whole list, and writing the rest overlaps it.
    Streamed {
        /// Pinned memory for the indices (at least `count * 8` bytes).
        stage: &'a mut HostBuffer,
        /// Writes indices `range` (8 little-endian bytes each) into the bytes given.
        encode: &'a mut dyn FnMut(Range<usize>, &mut [u8]),
        /// Where each piece's indices are copied (DMA, in stream order) before its rows are
        /// moved, so the kernel's index loads stay on the device; `None`: the kernel reads
        /// them from `stage` over PCIe.
        device: Option<&'a DeviceBuffer>,
    },
}

impl std::fmt::Debug for RowIndices<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Device(b) => f.debug_tuple("Device").field(b).finish(),
            Self::Pinned(h) => f.debug_tuple("Pinned").field(h).finish(),
            Self::Staged { host, device } => f
                .debug_struct("Staged")
                .field("host", host)
                .field("device", device)
                .finish(),
            Self::Streamed { stage, device, .. } => f
                .debug_struct("Streamed")
                .field("stage", stage)
                .field("device", device)
                .finish(),
        }
    }
}

/// A streamed index list cut into its pieces' bytes (each taken when written), and its
/// encoder.
type StreamedParts<'a> = (
    Vec<Option<&'a mut [u8]>>,
    &'a mut dyn FnMut(Range<usize>, &mut [u8]),
);

/// The first streamed piece's length in indices: a few microseconds of one core's writing.
const FIRST_PIECE: usize = 4 << 10;

/// Most pieces of one call (the last takes whatever is left).
pub(crate) const MAX_PIECES: usize = 16;

/// The shortest piece of a sorted gather's list: a piece costs a copy and a launch.
const SORTED_PIECE_MIN: usize = 16 << 10;

/// How `count` indices of rows of `row_bytes` are cut into the pieces that are written and
/// moved one after another. Each piece is as long as the CPU can write while the device
/// moves the one before (writing an index takes ~1 ns, moving a row ~row_bytes / 40 GB/s):
/// twice the one before for 64-byte rows, up to 64 times for 2 KiB and more. Few pieces
/// matter: each launch boundary drains the loads in flight.
///
/// A sorted gather's rows wait for the whole list, so its pieces only overlap writing one
/// with copying the one before: eight of the same length, the last copy short.
fn index_pieces(count: usize, row_bytes: usize, kernel: RowKernel) -> Vec<Range<usize>> {
    if kernel == RowKernel::Sorted {
        let len = count.div_ceil(8).max(SORTED_PIECE_MIN);
        return (0..count)
            .step_by(len)
            .map(|at| at..count.min(at + len))
            .collect();
    }
    let growth = (row_bytes / 32).clamp(2, 64);
    let mut pieces = Vec::new();
    let (mut at, mut len) = (0, FIRST_PIECE);
    while at < count {
        let end = if pieces.len() + 1 == MAX_PIECES {
            count
        } else {
            count.min(at + len)
        };
        pieces.push(at..end);
        at = end;
        len = len.saturating_mul(growth);
    }
    pieces
}

impl<'a> From<&'a DeviceBuffer> for RowIndices<'a> {
    fn from(b: &'a DeviceBuffer) -> Self {
        Self::Device(b)
    }
}

impl<'a> From<&'a HostBuffer> for RowIndices<'a> {
    fn from(b: &'a HostBuffer) -> Self {
        Self::Pinned(b)
    }
}

/// Which kernel moves the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowKernel {
    /// One thread per 4 to 16-byte piece, several loads in flight per thread.
    #[default]
    Tuned,
    /// The tuned kernel over the rows in pool address order (gathers from a host pool only):
    /// the device first sorts the index list by address (a counting sort in device memory),
    /// so that the loads in flight together fall on few pages and neighbouring rows share
    /// read requests. Where the device's address translation limits random loads (small rows
    /// from pools of gigabytes) this multiplies the rate; rows picked twice are read once.
    /// The whole index list must be on the device before the first row moves (a `Device`,
    /// `Staged` or `Streamed`-with-device list).
    Sorted,
    /// The baseline: one warp per row, one load in flight per lane (gathers only).
    Naive,
}

impl Stream {
    /// Gathers `count` rows of `row_bytes` from the pinned host `pool` into `dst` at
    /// `dst_offset`: row `i` of the output is pool row `indices[i]` (`count` little-endian
    /// u64s in device memory or pinned host memory). Waits for it. An index past the pool's last row fails the call
    /// with [`HalError::IndexOutOfRange`]; the other rows are gathered.
    #[allow(clippy::too_many_arguments)]
    pub fn gather(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: RowIndices<'_>,
        count: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        kernel: RowKernel,
    ) -> Result<()> {
        let pool = self.host_pool(pool)?;
        // SAFETY: the pool is borrowed (so mapped and registered) until this call returns.
        unsafe {
            self.run_rows(
                pool, row_bytes, indices, count, dst, dst_offset, false, kernel, false, None,
            )
        }
        .map(drop)
    }

    /// Like [`gather`](Self::gather); returns how long the device worked on it (timed by
    /// events): its rate while other work shares the link, such as the CPU's share of a
    /// hybrid gather.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_timed(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: RowIndices<'_>,
        count: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        kernel: RowKernel,
    ) -> Result<Duration> {
        let pool = self.host_pool(pool)?;
        // SAFETY: the pool is borrowed (so mapped and registered) until this call returns.
        let device_time = unsafe {
            self.run_rows(
                pool, row_bytes, indices, count, dst, dst_offset, false, kernel, true, None,
            )?
        };
        Ok(device_time.unwrap_or_default())
    }

    /// Like [`gather`](Self::gather), from a pool in device memory of this device (the second
    /// step of a deduplicated gather, or an on-device cache).
    pub fn gather_device(
        &self,
        pool: &DeviceBuffer,
        row_bytes: usize,
        indices: RowIndices<'_>,
        count: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        self.gpu.check_owns("gather pool", pool)?;
        if pool.same_buffer(dst) {
            return Err(HalError::InvalidArgument(
                "a gather's pool and destination must be different buffers".into(),
            ));
        }
        let range = pool.range("gather pool", 0, pool.len())?;
        // SAFETY: no host memory involved; the device ranges are borrowed for the call.
        unsafe {
            self.run_rows(
                RowMem::Device(range),
                row_bytes,
                indices,
                count,
                dst,
                dst_offset,
                false,
                RowKernel::Tuned,
                false,
                None,
            )
        }
        .map(drop)
    }

    /// Scatters `count` rows of `row_bytes` from `src` at `src_offset` into the pinned host
    /// `pool`: pool row `indices[i]` becomes row `i` of the source. Waits for it. With
    /// duplicate indices one of their rows lands, unspecified which.
    pub fn scatter(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        row_bytes: usize,
        indices: RowIndices<'_>,
        count: usize,
        pool: &mut HostBuffer,
    ) -> Result<()> {
        let pool = self.host_pool(pool)?;
        // SAFETY: the pool is borrowed mutably (so nothing else touches it) until this call
        // returns, and is registered with a device.
        unsafe {
            self.run_rows(
                pool,
                row_bytes,
                indices,
                count,
                src,
                src_offset,
                true,
                RowKernel::Tuned,
                false,
                None,
            )
        }
        .map(drop)
    }

    pub(super) fn host_pool(&self, pool: &HostBuffer) -> Result<RowMem<'static>> {
        let pin = pool.pinned().ok_or_else(|| {
            HalError::InvalidArgument(
                "zero-copy host memory (a row pool or index list) must be pinned \
                 (HostBuffer::pin) so the device reaches it"
                    .into(),
            )
        })?;
        Ok(RowMem::Host {
            ptr: pool.base_ptr(),
            addr: pin.device_addr(),
            len: pool.len(),
        })
    }

    /// Checks the job and runs it (through `hot` rows where given). (A host index list is
    /// borrowed by `indices` for the call.)
    ///
    /// # Safety
    /// A host pool stays valid and registered until this returns; for a scatter, nothing else
    /// touches it meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run_rows(
        &self,
        pool: RowMem<'_>,
        row_bytes: usize,
        indices: RowIndices<'_>,
        count: usize,
        rows: &DeviceBuffer,
        rows_offset: usize,
        scatter: bool,
        kernel: RowKernel,
        timed: bool,
        hot: Option<HotRefs<'_>>,
    ) -> Result<Option<Duration>> {
        if row_bytes == 0 {
            return Err(HalError::InvalidArgument(
                "row size must be at least 1 byte".into(),
            ));
        }
        if scatter && kernel != RowKernel::Tuned {
            return Err(HalError::InvalidArgument(format!(
                "the {kernel:?} row kernel only gathers"
            )));
        }
        if kernel == RowKernel::Sorted && !matches!(pool, RowMem::Host { .. }) {
            return Err(HalError::InvalidArgument(
                "sorted gathers read a host pool".into(),
            ));
        }
        if kernel == RowKernel::Sorted && u32::try_from(count).is_err() {
            return Err(HalError::InvalidArgument(format!(
                "a sorted gather takes fewer than 2^32 rows, not {count}"
            )));
        }
        self.gpu.check_owns("rows", rows)?;
        let overflow = || HalError::InvalidArgument(format!("{count} rows of {row_bytes} B"));
        let idx_len = count.checked_mul(8).ok_or_else(overflow)?;
        let rows_len = count.checked_mul(row_bytes).ok_or_else(overflow)?;
        let mut idx_upload = None;
        // A streamed list's pieces, each written just before its rows are moved.
        let mut streamed: Option<StreamedParts<'_>> = None;
        let pieces = match &indices {
            RowIndices::Streamed { .. } => index_pieces(count, row_bytes, kernel),
            _ => std::iter::once(0..count).collect(),
        };
        let idx = match indices {
            RowIndices::Device(b) => {
                self.gpu.check_owns("row indices", b)?;
                if b.same_buffer(rows) {
                    return Err(HalError::InvalidArgument(
                        "row indices and rows must be different buffers".into(),
                    ));
                }
                RowMem::Device(b.range("row indices", 0, idx_len)?)
            }
            RowIndices::Pinned(h) => {
                crate::check_range("row indices", 0, idx_len, h.len())?;
                self.host_pool(h)?
            }
            RowIndices::Staged { host, device } => {
                crate::check_range("row indices", 0, idx_len, host.len())?;
                self.gpu.check_owns("row indices", device)?;
                if device.same_buffer(rows) {
                    return Err(HalError::InvalidArgument(
                        "row indices and rows must be different buffers".into(),
                    ));
                }
                if !host.is_pinned() {
                    return Err(HalError::InvalidArgument(
                        "staged row indices must be in pinned memory".into(),
                    ));
                }
                idx_upload = Some(host.base_ptr() as *const u8);
                RowMem::Device(device.range("row indices", 0, idx_len)?)
            }
            RowIndices::Streamed {
                stage,
                encode,
                device,
            } => {
                crate::check_range("row indices", 0, idx_len, stage.len())?;
                let mut mem = self.host_pool(stage)?;
                if let Some(device) = device {
                    self.gpu.check_owns("row indices", device)?;
                    if device.same_buffer(rows) {
                        return Err(HalError::InvalidArgument(
                            "row indices and rows must be different buffers".into(),
                        ));
                    }
                    idx_upload = Some(stage.base_ptr() as *const u8);
                    mem = RowMem::Device(device.range("row indices", 0, idx_len)?);
                }
                // Disjoint pieces: the CPU writes one while the device reads those before.
                let mut rest = &mut stage.as_mut_slice()[..idx_len];
                let mut parts = Vec::with_capacity(pieces.len());
                for p in &pieces {
                    let (part, tail) = std::mem::take(&mut rest).split_at_mut(p.len() * 8);
                    parts.push(Some(part));
                    rest = tail;
                }
                streamed = Some((parts, encode));
                mem
            }
        };
        if kernel == RowKernel::Sorted && !matches!(idx, RowMem::Device(_)) {
            return Err(HalError::InvalidArgument(
                "a sorted gather needs its index list on the device (a Device, Staged, or \
                 Streamed-with-device list)"
                    .into(),
            ));
        }
        let dense = rows.range("rows", rows_offset, rows_len)?;
        if count == 0 {
            return Ok(timed.then_some(Duration::ZERO));
        }
        let streaming = streamed.is_some();
        let mut stage = |k: usize| {
            if let Some((parts, encode)) = streamed.as_mut()
                && let Some(part) = parts.get_mut(k).and_then(Option::take)
            {
                encode(pieces[k].clone(), part);
            }
        };
        if pool.len() < row_bytes {
            return Err(HalError::InvalidArgument(format!(
                "the pool ({} B) holds no row of {row_bytes} B",
                pool.len()
            )));
        }
        let stage = streaming.then_some(&mut stage as &mut dyn FnMut(usize));
        let job = RowJob {
            pool,
            row_bytes,
            count,
            idx,
            idx_upload,
            rows: dense,
            scatter,
            kernel,
            pieces: &pieces,
            hot,
        };
        // Every range was checked against its live, borrowed allocation; the host pool's
        // contract is the caller's. A streamed list's pieces are written only through
        // `stage`, each before the device reads it.
        let done = self.run(&RowsOp {
            job,
            stage: RefCell::new(stage),
            timed,
        })?;
        match done.bad_index {
            None => Ok(done.device_time),
            Some(position) => Err(HalError::IndexOutOfRange {
                position,
                rows: (pool.len() / row_bytes) as u64,
            }),
        }
    }
}

/// A checked row job as an op. Built only by `run_rows`, whose contract (a host pool valid,
/// registered with the device and, for a scatter, untouched by others until the call
/// returns) is what makes running it sound.
struct RowsOp<'a, 's> {
    job: RowJob<'a>,
    /// Writes a streamed list's piece before the device reads it (taken by the one run).
    stage: RefCell<Option<&'s mut dyn FnMut(usize)>>,
    timed: bool,
}

impl DeviceOp for RowsOp<'_, '_> {
    type Output = RowsDone;

    fn host(&self, _host: &HostRun<'_>) -> Result<RowsDone> {
        let hooks = RowHooks {
            stage: self.stage.borrow_mut().take(),
            timed: self.timed,
        };
        // SAFETY: run_rows's contract (see the struct); the host backend locks the device
        // ranges itself.
        unsafe { super::host::run_rows(self.job, hooks) }
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<RowsDone> {
        cuda.never()
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<RowsDone> {
        let hooks = RowHooks {
            stage: self.stage.borrow_mut().take(),
            timed: self.timed,
        };
        // SAFETY: run_rows's contract (see the struct).
        unsafe { cuda.stream.run_rows(self.job, hooks) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covers(pieces: &[Range<usize>], count: usize) {
        assert!(pieces.len() <= MAX_PIECES, "{pieces:?}");
        assert_eq!(pieces.first().map(|p| p.start), Some(0));
        assert_eq!(pieces.last().map(|p| p.end), Some(count));
        assert!(
            pieces
                .windows(2)
                .all(|w| w[0].end == w[1].start && !w[0].is_empty())
        );
    }

    #[test]
    fn streamed_pieces_grow_with_the_row_size_and_cover_the_list() {
        let small = index_pieces(1 << 20, 64, RowKernel::Tuned);
        covers(&small, 1 << 20);
        assert_eq!(small[0].len(), FIRST_PIECE);
        assert_eq!(small[1].len(), 2 * FIRST_PIECE);
        let large = index_pieces(1 << 20, 4096, RowKernel::Tuned);
        covers(&large, 1 << 20);
        assert_eq!(large[1].len(), 64 * FIRST_PIECE);
        covers(
            &index_pieces(usize::MAX / 2, 64, RowKernel::Tuned),
            usize::MAX / 2,
        );
    }

    #[test]
    fn a_sorted_list_comes_in_eight_even_pieces() {
        let pieces = index_pieces(1 << 20, 160, RowKernel::Sorted);
        covers(&pieces, 1 << 20);
        assert_eq!(pieces.len(), 8);
        assert!(pieces.iter().all(|p| p.len() == 1 << 17));
        // Short lists are not cut finer than SORTED_PIECE_MIN.
        let short = index_pieces(20_000, 160, RowKernel::Sorted);
        covers(&short, 20_000);
        assert_eq!(short.len(), 2);
    }
}
