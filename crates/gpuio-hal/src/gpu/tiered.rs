//! Tiered row gathers: output rows read from a hot tier (rows of a device buffer) or a warm
//! tier (rows of pinned host memory, read by the device's threads over the bus), a warm row
//! optionally also written into a hot row on the way — a cache miss served and installed by
//! the same read. Several jobs (one per destination) go in one launch: one upload of their
//! codes, one kernel, one wait. This is what a tiered cache's load (the KV pool's decode step)
//! needs instead of a gather of the misses, a gather of the output and a scatter of the misses
//! into their slots, each with its own round trip.

use super::backend::{TieredJob, TieredPart};
use super::{DeviceBuffer, Stream};
use crate::error::{HalError, Result};
use crate::memory::HostBuffer;
use std::time::Duration;

/// Most hot rows a job's hot buffer may have: a code keeps 23 bits for the hot row a warm row
/// is installed into (all ones meaning none).
pub const TIER_MAX_HOT_ROWS: u64 = (1 << 23) - 1;
/// Most warm rows a job's host pool may have: a warm code keeps 40 bits for its row.
pub const TIER_MAX_WARM_ROWS: u64 = 1 << 40;

const WARM: u64 = 1 << 63;
const ROW_BITS: u32 = 40;
const NO_SLOT: u64 = TIER_MAX_HOT_ROWS;
/// Bytes of one job in the table the device reads (gather.cu's `gpuio_tier_job`).
const JOB_BYTES: usize = 64;
/// Most jobs of one call: the grid's second dimension.
pub const TIER_MAX_JOBS: usize = 65_535;

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

/// Refuses device ranges (address, length) of one call that overlap: a kernel writing one
/// while reading another would give unspecified bytes.
pub(super) fn check_disjoint(mut spans: Vec<(u64, usize)>, what: &str) -> Result<()> {
    spans.retain(|&(_, len)| len > 0);
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[0].0 + w[0].1 as u64 > w[1].0) {
        return Err(HalError::InvalidArgument(format!("{what} overlap")));
    }
    Ok(())
}

impl Stream {
    /// Gathers every job's rows in one launch and waits: output row `i` of a job is the row
    /// its code names ([`TieredSource`]), a warm row also written to the hot row it names.
    /// The codes are the first `Σ count` little-endian u64s of `stage` (pinned), job after
    /// job; the call writes the jobs' table after them ([`tiered_stage_len`]) and copies both
    /// to `device` before the kernel.
    ///
    /// A hot row that is installed into must not be read by the same call (it would be
    /// written while read), nor installed into twice with different rows: what lands there
    /// is then unspecified. Hot buffers, destination ranges and `device` must not overlap. A
    /// code naming a row outside its tier is an error, its output row left unwritten.
    pub fn gather_tiered(
        &self,
        row_bytes: usize,
        jobs: &[TieredRows<'_>],
        stage: &mut HostBuffer,
        device: &DeviceBuffer,
    ) -> Result<()> {
        self.tiered(row_bytes, jobs, stage, device, false).map(drop)
    }

    /// [`gather_tiered`](Self::gather_tiered), timed on the device: how long its upload and
    /// kernel took there (CUDA events; on the host backend, the copy's time).
    pub fn gather_tiered_timed(
        &self,
        row_bytes: usize,
        jobs: &[TieredRows<'_>],
        stage: &mut HostBuffer,
        device: &DeviceBuffer,
    ) -> Result<Duration> {
        self.tiered(row_bytes, jobs, stage, device, true)
            .map(|t| t.unwrap_or_default())
    }

    fn tiered(
        &self,
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
        self.gpu.check_owns("tiered gather stage", device)?;
        let stage_dev = device.range("tiered gather stage", 0, stage_len)?;
        let mut parts = Vec::with_capacity(jobs.len());
        let mut spans = vec![(stage_dev.addr(), stage_len)];
        let mut first = 0;
        for j in jobs {
            self.gpu.check_owns("tiered gather hot tier", j.hot)?;
            self.gpu.check_owns("tiered gather destination", j.dst)?;
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
            let hot = j
                .hot
                .range("tiered gather hot tier", 0, hot_rows as usize * row_bytes)?;
            let dst = j
                .dst
                .range("tiered gather destination", j.dst_offset, len)?;
            spans.push((hot.addr(), hot.len));
            spans.push((dst.addr(), dst.len));
            parts.push(TieredPart {
                hot,
                warm: self.host_pool(j.warm)?,
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
        let job = TieredJob {
            row_bytes,
            parts: &parts,
            upload: stage.base_ptr() as *const u8,
            stage: stage_dev,
            table_offset: table_offset(total),
            total,
            timed,
        };
        // SAFETY: the warm pools and the stage are pinned host memory borrowed (registered and
        // valid) until this call returns, which waits for the kernel.
        let done = unsafe { self.inner.tiered_rows(job)? };
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
}

/// The jobs' table after the codes, as gather.cu's `gpuio_tier_job`: hot, hot rows, warm
/// (its device address), warm rows, destination, first code, count.
fn write_table(stage: &mut HostBuffer, total: usize, row_bytes: usize, parts: &[TieredPart<'_>]) {
    let at = table_offset(total);
    let table = &mut stage[at..at + parts.len() * JOB_BYTES];
    for (entry, p) in table.chunks_exact_mut(JOB_BYTES).zip(parts) {
        let words = [
            p.hot.addr(),
            (p.hot.len / row_bytes) as u64,
            p.warm.addr(),
            (p.warm.len() / row_bytes) as u64,
            p.dst.addr(),
            p.first as u64,
            p.count as u64,
            0,
        ];
        for (b, w) in entry.chunks_exact_mut(8).zip(words) {
            b.copy_from_slice(&w.to_le_bytes());
        }
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
