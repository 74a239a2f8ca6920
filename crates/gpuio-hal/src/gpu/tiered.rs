//! Tiered row gathers: output rows read from a hot tier (rows of a device buffer) or a warm
//! tier (rows of pinned host memory, read by the device's threads over the bus), a warm row
//! optionally also written into a hot row on the way — a cache miss served and installed by
//! the same read. Several jobs (one per destination) go in one launch (`kernels/gather.cu`'s
//! `gpuio_gather_tiered_<W>`): one upload of their codes, one kernel, one wait. This is what a
//! tiered cache's load (the KV pool's decode step) needs instead of a gather of the misses, a
//! gather of the output and a scatter of the misses into their slots, each with its own round
//! trip. The host backend does the same on the CPU.

use super::op::check_disjoint;
#[cfg(feature = "cuda")]
use super::op::{WaitOnDrop, device_time, widest_piece};
use crate::error::{HalError, Result};
#[cfg(feature = "cuda")]
use crate::gpu::KernelArgs;
use crate::gpu::{Access, CudaRun, DevArg, DeviceBuffer, DeviceOp, HostArg, HostRun, Stream};
#[cfg(feature = "cuda")]
use crate::kernels::GatherKernel;
use crate::memory::HostBuffer;
use crate::sys;
use std::mem::offset_of;
use std::time::{Duration, Instant};

/// Most hot rows a job's hot buffer may have: a code keeps 23 bits for the hot row a warm row
/// is installed into (all ones meaning none).
pub const TIER_MAX_HOT_ROWS: u64 = (1 << 23) - 1;
/// Most warm rows a job's host pool may have: a warm code keeps 40 bits for its row.
pub const TIER_MAX_WARM_ROWS: u64 = 1 << 40;
/// Most jobs of one call: the grid's second dimension.
pub const TIER_MAX_JOBS: usize = 65_535;

const WARM: u64 = 1 << 63;
const ROW_BITS: u32 = 40;
const NO_SLOT: u64 = TIER_MAX_HOT_ROWS;
/// Bytes of one job in the table the device reads ([`TierJob`]).
const JOB_BYTES: usize = 64;

/// The kernel for each piece width slot of `widest_piece`.
#[cfg(feature = "cuda")]
const KERNELS: [GatherKernel; 4] = [
    GatherKernel::GatherTiered16,
    GatherKernel::GatherTiered8,
    GatherKernel::GatherTiered4,
    GatherKernel::GatherTiered1,
];

/// Where one output row of a tiered gather comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TieredSource {
    /// This row of the job's hot buffer.
    Hot(u64),
    /// Row `row` of the job's warm pool, also written to hot row `install` where given.
    Warm {
        /// The warm row.
        row: u64,
        /// The hot row it is installed into.
        install: Option<u64>,
    },
}

impl TieredSource {
    /// The code the device reads (a little-endian u64 in the stage), or `None` where a row
    /// is beyond what a code holds ([`TIER_MAX_HOT_ROWS`], [`TIER_MAX_WARM_ROWS`]).
    pub fn code(self) -> Option<u64> {
        match self {
            Self::Hot(slot) => (slot < TIER_MAX_HOT_ROWS).then_some(slot),
            Self::Warm { row, install } => {
                // All ones means no install: a real slot is below it.
                let fits = row < TIER_MAX_WARM_ROWS && install.is_none_or(|s| s < NO_SLOT);
                fits.then(|| WARM | install.unwrap_or(NO_SLOT) << ROW_BITS | row)
            }
        }
    }

    /// The source a code names (the inverse of [`code`](Self::code)).
    pub fn from_code(code: u64) -> Self {
        if code & WARM == 0 {
            return Self::Hot(code);
        }
        let slot = (code >> ROW_BITS) & NO_SLOT;
        Self::Warm {
            row: code & ((1 << ROW_BITS) - 1),
            install: (slot != NO_SLOT).then_some(slot),
        }
    }
}

/// One destination of a tiered gather: `count` rows into `dst` from `dst_offset`, their
/// codes the next `count` of the stage's.
#[derive(Debug, Clone, Copy)]
pub struct TieredRows<'a> {
    /// The hot tier: rows of the row size (a tail shorter than a row is not used). Written
    /// where warm rows are installed, so no other job's hot buffer or destination may overlap
    /// it.
    pub hot: &'a DeviceBuffer,
    /// The warm tier, pinned.
    pub warm: &'a HostBuffer,
    /// Where the rows go.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
    /// Rows.
    pub count: usize,
}

/// Bytes a stage (host and device) needs for `rows` codes of `jobs` jobs: the codes, then
/// the jobs' table at the next 64-byte boundary.
pub fn tiered_stage_len(rows: usize, jobs: usize) -> usize {
    table_offset(rows).saturating_add(jobs.saturating_mul(JOB_BYTES))
}

fn table_offset(rows: usize) -> usize {
    rows.checked_mul(8)
        .and_then(|b| b.checked_next_multiple_of(JOB_BYTES))
        .unwrap_or(usize::MAX)
}

/// One job of the table the kernel reads: gather.cu's `gpuio_tier_job`, whose size and
/// offsets are asserted there too.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct TierJob {
    /// The hot tier's device address, and its whole rows.
    hot: u64,
    hot_rows: u64,
    /// The warm pool's address as the device reaches it, and its whole rows.
    warm: u64,
    warm_rows: u64,
    /// The destination's device address.
    dst: u64,
    /// The job's first code's position among all codes, and its rows.
    first: u64,
    count: u64,
    unused: u64,
}

const _: () = assert!(size_of::<TierJob>() == JOB_BYTES);
const _: () = assert!(offset_of!(TierJob, hot) == 0);
const _: () = assert!(offset_of!(TierJob, hot_rows) == 8);
const _: () = assert!(offset_of!(TierJob, warm) == 16);
const _: () = assert!(offset_of!(TierJob, warm_rows) == 24);
const _: () = assert!(offset_of!(TierJob, dst) == 32);
const _: () = assert!(offset_of!(TierJob, first) == 40);
const _: () = assert!(offset_of!(TierJob, count) == 48);
const _: () = assert!(offset_of!(TierJob, unused) == 56);

impl TierJob {
    /// Its bytes as the device reads them: little-endian, in field order (the offsets
    /// asserted above).
    fn to_le_bytes(self) -> [u8; JOB_BYTES] {
        let words = [
            self.hot,
            self.hot_rows,
            self.warm,
            self.warm_rows,
            self.dst,
            self.first,
            self.count,
            self.unused,
        ];
        let mut out = [0; JOB_BYTES];
        for (b, w) in out.chunks_exact_mut(8).zip(words) {
            b.copy_from_slice(&w.to_le_bytes());
        }
        out
    }
}

/// Gathers every job's rows in one launch on `stream` and waits: output row `i` of a job is
/// the row its code names ([`TieredSource`]), a warm row also written to the hot row it
/// names. The codes are the first `Σ count` little-endian u64s of `stage` (pinned), job after
/// job; the call writes the jobs' table after them ([`tiered_stage_len`]) and copies both to
/// `device` before the kernel.
///
/// A hot row that is installed into must not be read by the same call (it would be written
/// while read), nor installed into twice with different rows: what lands there is then
/// unspecified. Hot buffers, destination ranges and `device` must not overlap. A code naming
/// a row outside its tier is an error, its output row left unwritten.
pub fn gather_tiered(
    stream: &Stream,
    row_bytes: usize,
    jobs: &[TieredRows<'_>],
    stage: &mut HostBuffer,
    device: &DeviceBuffer,
) -> Result<()> {
    tiered(stream, row_bytes, jobs, stage, device, false).map(drop)
}

/// [`gather_tiered`], timed on the device: how long its upload and kernel took there (CUDA
/// events; on the host backend, the copy's time).
pub fn gather_tiered_timed(
    stream: &Stream,
    row_bytes: usize,
    jobs: &[TieredRows<'_>],
    stage: &mut HostBuffer,
    device: &DeviceBuffer,
) -> Result<Duration> {
    tiered(stream, row_bytes, jobs, stage, device, true).map(|t| t.unwrap_or_default())
}

fn tiered(
    stream: &Stream,
    row_bytes: usize,
    jobs: &[TieredRows<'_>],
    stage: &mut HostBuffer,
    device: &DeviceBuffer,
    timed: bool,
) -> Result<Option<Duration>> {
    let bad = |why: String| Err(HalError::InvalidArgument(format!("tiered gather: {why}")));
    if row_bytes == 0 {
        return bad("rows of 0 bytes".into());
    }
    if jobs.len() > TIER_MAX_JOBS {
        return bad(format!("{} jobs, more than {TIER_MAX_JOBS}", jobs.len()));
    }
    let total = jobs
        .iter()
        .try_fold(0usize, |t, j| t.checked_add(j.count))
        .filter(|&t| t.checked_mul(8).is_some());
    let Some(total) = total else {
        return bad("the jobs' rows overflow".into());
    };
    if total == 0 {
        return Ok(timed.then_some(Duration::ZERO));
    }
    let stage_len = tiered_stage_len(total, jobs.len());
    crate::check_range("tiered gather stage", 0, stage_len, stage.len())?;
    if !stage.is_pinned() {
        return bad("the stage must be pinned".into());
    }
    let stage_dev = stream.arg("tiered gather stage", device, 0, stage_len)?;
    let mut parts = Vec::with_capacity(jobs.len());
    let mut spans = vec![(stage_dev.addr(), stage_len)];
    let mut first = 0;
    for j in jobs {
        let hot_rows = (j.hot.len() / row_bytes) as u64;
        let warm_rows = (j.warm.len() / row_bytes) as u64;
        if hot_rows > TIER_MAX_HOT_ROWS || warm_rows > TIER_MAX_WARM_ROWS {
            return bad(format!(
                "{hot_rows} hot and {warm_rows} warm rows; at most {TIER_MAX_HOT_ROWS} and \
                 {TIER_MAX_WARM_ROWS}"
            ));
        }
        let Some(len) = j.count.checked_mul(row_bytes) else {
            return bad(format!("{} rows of {row_bytes} B", j.count));
        };
        let hot = stream.arg(
            "tiered gather hot tier",
            j.hot,
            0,
            hot_rows as usize * row_bytes,
        )?;
        let dst = stream.arg("tiered gather destination", j.dst, j.dst_offset, len)?;
        spans.push((hot.addr(), hot.len()));
        spans.push((dst.addr(), dst.len()));
        parts.push(TieredPart {
            hot,
            warm: stream.host_arg("tiered gather warm tier", j.warm, 0, j.warm.len())?,
            dst,
            first,
            count: j.count,
        });
        first += j.count;
    }
    check_disjoint(
        spans,
        "tiered gather: hot buffers, destinations and the device stage",
    )?;
    write_table(stage, total, row_bytes, &parts);
    let done = stream.run(&Gather {
        row_bytes,
        parts,
        upload: &stage[..stage_len],
        stage: stage_dev,
        table_offset: table_offset(total),
        total,
        timed,
    })?;
    match done.bad_index {
        Some(i) => bad(format!(
            "code {i} names a row outside its tier ({:?})",
            stage
                .get(8 * i as usize..8 * i as usize + 8)
                .and_then(|b| b.try_into().ok())
                .map(|b| TieredSource::from_code(u64::from_le_bytes(b)))
        )),
        None => Ok(done.device_time),
    }
}

/// The jobs' table after the codes ([`TierJob`]s).
fn write_table(stage: &mut HostBuffer, total: usize, row_bytes: usize, parts: &[TieredPart<'_>]) {
    let at = table_offset(total);
    let table = &mut stage[at..at + parts.len() * JOB_BYTES];
    for (entry, p) in table.chunks_exact_mut(JOB_BYTES).zip(parts) {
        let job = TierJob {
            hot: p.hot.addr(),
            hot_rows: (p.hot.len() / row_bytes) as u64,
            warm: p.warm.addr(),
            warm_rows: (p.warm.len() / row_bytes) as u64,
            dst: p.dst.addr(),
            first: p.first as u64,
            count: p.count as u64,
            unused: 0,
        };
        entry.copy_from_slice(&job.to_le_bytes());
    }
}

/// One checked job of a tiered copy on the CPU ([`copy_tiered`]): its whole hot tier (whole
/// rows), its warm pool, its destination (`count` rows) and its first code's position among
/// all codes.
pub struct TieredPart<'a> {
    /// The hot tier.
    pub hot: DevArg<'a>,
    /// The warm pool.
    pub warm: HostArg<'a>,
    /// Where the rows go.
    pub dst: DevArg<'a>,
    /// Its first code's position among all codes.
    pub first: usize,
    /// Its rows.
    pub count: usize,
}

/// Copies each part's rows as its codes name them (a tiered gather on the CPU); the position
/// of the first code outside its tier, whose row is skipped.
///
/// # Safety
/// The parts' warm pools are borrowed host memory; their hot and destination ranges are
/// host-backend memory locked for writing by the caller ([`HostRun::lock`]) and disjoint.
pub unsafe fn copy_tiered(parts: &[TieredPart<'_>], codes: &[u64], rb: usize) -> Option<u64> {
    let mut bad = None;
    for p in parts {
        let (hot_rows, warm_rows) = ((p.hot.len() / rb) as u64, (p.warm.len() / rb) as u64);
        let (hot, warm, dst) = (p.hot.host_ptr(), p.warm.ptr(), p.dst.host_ptr());
        for r in 0..p.count {
            let (from, install) = match TieredSource::from_code(codes[p.first + r]) {
                TieredSource::Hot(s) if s < hot_rows => (hot.wrapping_add(s as usize * rb), None),
                TieredSource::Warm { row, install }
                    if row < warm_rows && install.is_none_or(|s| s < hot_rows) =>
                {
                    let to = install.map(|s| hot.wrapping_add(s as usize * rb));
                    (warm.wrapping_add(row as usize * rb), to)
                }
                _ => {
                    bad = bad.or(Some((p.first + r) as u64));
                    continue;
                }
            };
            // SAFETY: rows below their tier's row count lie inside the hot range or the warm
            // pool (borrowed, by the caller's contract); output row r < count inside the
            // checked destination; the hot and destination ranges are locked for writing and,
            // like the warm pool, disjoint (the caller's contract).
            unsafe {
                sys::copy_raw(from, dst.wrapping_add(r * rb), rb);
                if let Some(to) = install {
                    sys::copy_raw(from, to, rb);
                }
            }
        }
    }
    bad
}

/// What a gather reports.
struct Gathered {
    /// The position of the first code naming a row outside its tier (its row left
    /// unwritten).
    bad_index: Option<u64>,
    /// The device's time, when asked.
    device_time: Option<Duration>,
}

/// A checked tiered gather: the `total` codes at the start of `upload` (pinned) and the jobs'
/// table at `table_offset` after them, both copied into `stage` before the kernel.
struct Gather<'a> {
    row_bytes: usize,
    parts: Vec<TieredPart<'a>>,
    upload: &'a [u8],
    stage: DevArg<'a>,
    table_offset: usize,
    total: usize,
    /// Time the device's work (events around the upload and the kernel).
    timed: bool,
}

impl DeviceOp for Gather<'_> {
    type Output = Gathered;

    fn host(&self, host: &HostRun<'_>) -> Result<Gathered> {
        let t = Instant::now();
        host.upload(self.upload, self.stage)?;
        let mut uses = vec![(self.stage, Access::Read)];
        for p in &self.parts {
            uses.extend([(p.hot, Access::Write), (p.dst, Access::Write)]);
        }
        let _locks = host.lock(&uses)?;
        // SAFETY: the first `total` codes of the stage range (8 * total <= its length), locked
        // for reading above; the stage starts its allocation (page-aligned host memory), so
        // the u64s are aligned.
        let codes =
            unsafe { std::slice::from_raw_parts(self.stage.host_ptr() as *const u64, self.total) };
        // SAFETY: the warm pools are borrowed by this op; the hot and destination ranges are
        // locked for writing above, and disjoint (checked).
        let bad_index = unsafe { copy_tiered(&self.parts, codes, self.row_bytes) };
        Ok(Gathered {
            bad_index,
            device_time: self.timed.then(|| t.elapsed()),
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<Gathered> {
        cuda.never()
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<Gathered> {
        let rb = self.row_bytes as u64;
        let starts = self
            .parts
            .iter()
            .flat_map(|p| [p.hot.addr(), p.warm.addr(), p.dst.addr()]);
        let (slot, width) = widest_piece(rb, starts);
        // The stream's report words (mapped host memory, reset), this op's until it returns.
        let reports = cuda.stream.reports()?;
        let report = reports.device_word(0);
        let start = self.timed.then(|| cuda.record(true)).transpose()?;
        // SAFETY: the upload is pinned host memory as long as the stage range, borrowed by
        // this op, which waits for the stream before returning (below, or on the way out).
        unsafe { cuda.upload(self.upload.as_ptr(), self.stage)? };
        let running = WaitOnDrop::new(cuda);
        let most = self.parts.iter().map(|p| p.count as u64).max().unwrap_or(0);
        // GPUIO_UNROLL (4) pieces in flight per thread; the grid's rows are the jobs.
        let shape = cuda
            .grid_stride((most * (rb / width)).div_ceil(4))
            .rows(self.parts.len() as u32);
        let table = self
            .stage
            .part(self.table_offset, self.parts.len() * JOB_BYTES)?;
        let args = KernelArgs::new()
            .ptr(&table)
            .ptr(&self.stage)
            .u64(rb)
            .u64(report);
        // SAFETY: matches gpuio_gather_tiered_W(const void* jobs, const u64* codes, u64
        // row_bytes, u64* err). The table (written after the codes, and copied with them just
        // before, in stream order) names per job its checked hot range, its pinned warm pool
        // (borrowed, so registered) and its checked destination range with their row counts;
        // the kernel checks every code against them, so it reads and writes only inside those
        // (disjoint) ranges and the report word (mapped host memory the stream keeps); we wait
        // before returning.
        unsafe { cuda.launch(KERNELS[slot], shape, &args)? };
        let end = start.is_some().then(|| cuda.record(true)).transpose()?;
        running.wait()?;
        Ok(Gathered {
            bad_index: reports.word(0),
            device_time: device_time(start, end)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_refuse_what_they_cannot_hold() {
        for s in [
            TieredSource::Hot(0),
            TieredSource::Hot(TIER_MAX_HOT_ROWS - 1),
            TieredSource::Warm {
                row: 0,
                install: None,
            },
            TieredSource::Warm {
                row: TIER_MAX_WARM_ROWS - 1,
                install: Some(TIER_MAX_HOT_ROWS - 1),
            },
            TieredSource::Warm {
                row: 12345,
                install: Some(0),
            },
        ] {
            let code = s.code().expect("encodable");
            assert_eq!(TieredSource::from_code(code), s);
        }
        assert_eq!(TieredSource::Hot(TIER_MAX_HOT_ROWS).code(), None);
        let too_far = TieredSource::Warm {
            row: TIER_MAX_WARM_ROWS,
            install: None,
        };
        assert_eq!(too_far.code(), None);
        let bad_slot = TieredSource::Warm {
            row: 1,
            install: Some(TIER_MAX_HOT_ROWS),
        };
        assert_eq!(bad_slot.code(), None);
    }

    #[test]
    fn the_table_starts_on_a_job_boundary_after_the_codes() {
        assert_eq!(tiered_stage_len(1, 1), 128);
        assert_eq!(tiered_stage_len(8, 2), 64 + 128);
        assert_eq!(tiered_stage_len(9, 1), 128 + 64);
        assert_eq!(tiered_stage_len(usize::MAX, 1), usize::MAX);
    }
}
