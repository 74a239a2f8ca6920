//! Hot rows: copies of chosen rows of a pinned host pool kept in device memory, found by pool
//! row through an open-addressed index that the gather kernel probes (`kernels/gather.cu`,
//! `gpuio_gather_hot_*`). A gather through them reads each kept row from device memory and
//! every other row from the pool over the bus, in one kernel: for row reads that favour few
//! rows (Zipf-distributed Engram ids), most of them never cross the bus.
//!
//! The rows are copies taken when [`Stream::keep_hot`] runs. Whoever writes pool rows after
//! that re-copies the kept ones among them ([`Stream::refresh_hot`]); a gather never reads a
//! copy that names another row, and it refuses a pool other than the one the copies came from.

use super::backend::DevRange;
use super::{DeviceBuffer, RowIndices, RowKernel, Stream, TieredRows, TieredSource};
use crate::error::{HalError, Result};
use crate::memory::{HostAllocOptions, HostBuffer};
use std::time::Duration;

/// Most rows one [`HotRows`] keeps (a hot row is installed by the tiered gather, whose codes
/// keep 23 bits for it): 2 GiB of 256-byte rows.
pub const HOT_MAX_ROWS: usize = super::TIER_MAX_HOT_ROWS as usize;
/// Pools of this many rows or more cannot keep hot rows: an index word keeps 40 bits for the
/// pool row, all ones meaning an empty word.
pub const HOT_MAX_POOL_ROWS: u64 = (1 << ROW_BITS) - 1;

const ROW_BITS: u32 = 40;
const ROW_MASK: u64 = (1 << ROW_BITS) - 1;
const EMPTY: u64 = u64::MAX;

/// The hash the index is built and probed with (gather.cu's `gpuio_hot_hash`).
fn hot_hash(row: u64) -> u64 {
    let mut x = row;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The hot row holding pool row `row` in an index of `words` (a power of two of them),
/// probed at most `probes` words from its hash, as the kernel probes it; a hot row at or past
/// `hot_rows` is not followed.
pub(crate) fn hot_slot(words: &[u64], probes: u32, hot_rows: u64, row: u64) -> Option<u64> {
    let mask = words.len().checked_sub(1)? as u64;
    let mut at = hot_hash(row) & mask;
    for _ in 0..probes {
        let word = *words.get(at as usize)?;
        if word == EMPTY {
            return None;
        }
        if word & ROW_MASK == row {
            return Some(word >> ROW_BITS).filter(|&s| s < hot_rows);
        }
        at = (at + 1) & mask;
    }
    None
}

/// `rows` with repeats dropped, in first-seen order; it stops one past [`HOT_MAX_ROWS`] (the
/// caller refuses that many), so a long list costs no more than the most that can be kept.
fn distinct(rows: &[u64]) -> Vec<u64> {
    let mut seen = std::collections::HashSet::with_capacity(rows.len().min(HOT_MAX_ROWS + 1));
    let mut out = Vec::with_capacity(rows.len().min(HOT_MAX_ROWS + 1));
    for &r in rows {
        if seen.insert(r) {
            out.push(r);
            if out.len() > HOT_MAX_ROWS {
                break;
            }
        }
    }
    out
}

/// An index over distinct `rows`, each at the hot row of its rank: its words (four per row,
/// rounded up to a power of two, so most probes end at the first word) and the longest probe
/// run.
fn build_index(rows: &[u64]) -> (Vec<u64>, u32) {
    let capacity = rows.len().saturating_mul(4).next_power_of_two().max(2);
    let mask = (capacity - 1) as u64;
    let mut words = vec![EMPTY; capacity];
    let mut probes = 1u32;
    for (slot, &row) in rows.iter().enumerate() {
        let mut at = hot_hash(row) & mask;
        let mut run = 1u32;
        while words[at as usize] != EMPTY {
            at = (at + 1) & mask;
            run += 1;
        }
        words[at as usize] = (slot as u64) << ROW_BITS | row;
        probes = probes.max(run);
    }
    (words, probes)
}

/// Copies of chosen rows of one pinned host pool, kept in device memory of one device, with
/// the index that finds them (see the module docs). Made by [`Stream::keep_hot`].
#[derive(Debug)]
pub struct HotRows {
    pub(super) rows: DeviceBuffer,
    index: DeviceBuffer,
    /// The index's words as the device has them, for re-copying rows.
    words: Vec<u64>,
    probes: u32,
    kept: usize,
    row_bytes: usize,
    /// The pool the copies came from: its address and length.
    pool: (usize, usize),
}

/// What a gather through hot rows needs of them, checked (see `backend::RowJob`).
#[derive(Clone, Copy)]
pub(crate) struct HotRefs<'a> {
    /// The kept rows (`hot_rows` of the job's row size).
    pub(crate) rows: DevRange<'a>,
    pub(crate) hot_rows: u64,
    /// The index's words (a power of two of them).
    pub(crate) index: DevRange<'a>,
    pub(crate) probes: u32,
}

impl HotRows {
    /// Rows kept.
    pub fn len(&self) -> usize {
        self.kept
    }

    /// Whether no row is kept.
    pub fn is_empty(&self) -> bool {
        self.kept == 0
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Device memory they take: the rows and the index.
    pub fn device_bytes(&self) -> usize {
        self.rows.len() + self.index.len()
    }

    /// The hot row holding pool row `row`, if it is kept.
    pub fn slot_of(&self, row: u64) -> Option<usize> {
        hot_slot(&self.words, self.probes, self.kept as u64, row).map(|s| s as usize)
    }

    /// The longest run of index words a lookup probes.
    pub fn probes(&self) -> u32 {
        self.probes
    }

    /// The device holding the copies.
    pub fn gpu(&self) -> &super::Gpu {
        self.rows.gpu()
    }

    /// Whether these are copies of `pool`'s rows (the pool they were taken from: its address
    /// and length).
    pub fn copies_of(&self, pool: &HostBuffer) -> bool {
        (pool.base_ptr() as usize, pool.len()) == self.pool
    }

    pub(super) fn check_pool(&self, pool: &HostBuffer) -> Result<()> {
        if !self.copies_of(pool) {
            return Err(HalError::InvalidArgument(
                "hot rows are copies of another pool's rows".into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn refs(&self) -> Result<HotRefs<'_>> {
        let hot_rows = self.kept as u64;
        Ok(HotRefs {
            rows: self.rows.range("hot rows", 0, self.kept * self.row_bytes)?,
            hot_rows,
            index: self.index.range("hot row index", 0, self.words.len() * 8)?,
            probes: self.probes,
        })
    }
}

fn le_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

impl Stream {
    /// Copies pool rows `rows` (repeats kept once) into device memory of this stream's device
    /// and indexes them, for [`gather_hot`](Self::gather_hot). Waits for it. A row past the
    /// pool fails the call with [`HalError::IndexOutOfRange`]; more than [`HOT_MAX_ROWS`]
    /// distinct rows, or a pool of [`HOT_MAX_POOL_ROWS`] rows or more, is refused.
    pub fn keep_hot(&self, pool: &HostBuffer, row_bytes: usize, rows: &[u64]) -> Result<HotRows> {
        if row_bytes == 0 {
            return Err(HalError::InvalidArgument(
                "row size must be at least 1 byte".into(),
            ));
        }
        self.host_pool(pool)?;
        let pool_rows = (pool.len() / row_bytes) as u64;
        if pool_rows >= HOT_MAX_POOL_ROWS {
            return Err(HalError::InvalidArgument(format!(
                "a pool of {pool_rows} rows cannot keep hot rows (at most {})",
                HOT_MAX_POOL_ROWS - 1
            )));
        }
        if let Some(position) = rows.iter().position(|&r| r >= pool_rows) {
            return Err(HalError::IndexOutOfRange {
                position: position as u64,
                rows: pool_rows,
            });
        }
        let kept = distinct(rows);
        if kept.len() > HOT_MAX_ROWS {
            return Err(HalError::InvalidArgument(format!(
                "{} distinct hot rows, more than {HOT_MAX_ROWS}",
                kept.len()
            )));
        }
        let (words, probes) = build_index(&kept);
        let bytes = kept.len() * row_bytes;
        let hot = HotRows {
            rows: self.gpu.alloc(bytes)?,
            index: self.gpu.alloc(words.len() * 8)?,
            probes,
            kept: kept.len(),
            row_bytes,
            pool: (pool.base_ptr() as usize, pool.len()),
            words,
        };
        self.upload(&le_bytes(&hot.words), &hot.index, 0)?;
        if !kept.is_empty() {
            let ids = self.gpu.alloc(kept.len() * 8)?;
            self.upload(&le_bytes(&kept), &ids, 0)?;
            let indices = RowIndices::Device(&ids);
            self.gather(
                pool,
                row_bytes,
                indices,
                kept.len(),
                &hot.rows,
                0,
                RowKernel::Tuned,
            )?;
        }
        Ok(hot)
    }

    /// Gathers `count` rows of `pool` into `dst` at `dst_offset`, as [`gather`](Self::gather)
    /// does, reading each row `hot` keeps from its copy in device memory instead. Waits for
    /// it. `hot` must have been taken from `pool`. An index past the pool fails the call with
    /// [`HalError::IndexOutOfRange`]; the other rows are gathered.
    pub fn gather_hot(
        &self,
        pool: &HostBuffer,
        hot: &HotRows,
        indices: RowIndices<'_>,
        count: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        self.hot_rows_job(pool, hot, indices, count, dst, dst_offset, false)
            .map(drop)
    }

    /// Like [`gather_hot`](Self::gather_hot); returns how long the device worked on it
    /// (events around its copies and launches; on the host backend, the copy's time).
    pub fn gather_hot_timed(
        &self,
        pool: &HostBuffer,
        hot: &HotRows,
        indices: RowIndices<'_>,
        count: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<Duration> {
        self.hot_rows_job(pool, hot, indices, count, dst, dst_offset, true)
            .map(Option::unwrap_or_default)
    }

    #[allow(clippy::too_many_arguments)]
    fn hot_rows_job(
        &self,
        pool: &HostBuffer,
        hot: &HotRows,
        indices: RowIndices<'_>,
        count: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        timed: bool,
    ) -> Result<Option<Duration>> {
        hot.check_pool(pool)?;
        self.gpu.check_owns("hot rows", &hot.rows)?;
        let refs = hot.refs()?;
        let pool = self.host_pool(pool)?;
        // SAFETY: the pool is borrowed (so mapped and registered) until this call returns.
        unsafe {
            self.run_rows(
                pool,
                hot.row_bytes,
                indices,
                count,
                dst,
                dst_offset,
                false,
                RowKernel::Tuned,
                timed,
                Some(refs),
            )
        }
    }

    /// Copies again, from `pool`, the rows among `rows` that `hot` keeps (after they were
    /// written in the pool), and waits; returns how many were kept. `hot` must have been
    /// taken from `pool`. Rows `hot` does not keep are ignored; rows past the pool too. No
    /// gather may read through `hot` while this runs: the copies are written meanwhile (the
    /// caller's locks order them, as Engram tables do).
    pub fn refresh_hot(&self, pool: &HostBuffer, hot: &HotRows, rows: &[u64]) -> Result<usize> {
        hot.check_pool(pool)?;
        let mut slots: Vec<(u64, u64)> = rows
            .iter()
            .filter_map(|&r| hot.slot_of(r).map(|s| (s as u64, r)))
            .collect();
        slots.sort_unstable();
        slots.dedup();
        if slots.is_empty() {
            return Ok(0);
        }
        let count = slots.len();
        let len = super::tiered_stage_len(count, 1);
        let mut stage = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), &self.gpu)?;
        for (word, &(slot, row)) in stage.as_u64s_mut().iter_mut().zip(&slots) {
            let source = TieredSource::Warm {
                row,
                install: Some(slot),
            };
            // Both fit a code: slot < HOT_MAX_ROWS and row < HOT_MAX_POOL_ROWS.
            *word = source.code().ok_or_else(|| {
                HalError::InvalidArgument(format!("hot row {slot} of pool row {row}"))
            })?;
        }
        let device = self.gpu.alloc(len)?;
        let scratch = self.gpu.alloc(count * hot.row_bytes)?;
        let job = TieredRows {
            hot: &hot.rows,
            warm: pool,
            dst: &scratch,
            dst_offset: 0,
            count,
        };
        super::tiered::gather_tiered(self, hot.row_bytes, &[job], &mut stage, &device)?;
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_empty_index_finds_nothing_and_probes_one_word() {
        let (words, probes) = build_index(&[]);
        assert_eq!((words.len(), probes), (2, 1));
        assert_eq!(hot_slot(&words, probes, 0, 0), None);
    }

    #[test]
    fn a_word_naming_a_hot_row_past_the_kept_ones_is_not_followed() {
        let (words, probes) = build_index(&[7, 9]);
        assert_eq!(hot_slot(&words, probes, 2, 9), Some(1));
        assert_eq!(hot_slot(&words, probes, 1, 9), None);
    }

    proptest! {
        /// Every kept row is found at the hot row of its first appearance, within the
        /// probe bound; no other row is found.
        #[test]
        fn the_index_finds_exactly_the_kept_rows(
            rows in proptest::collection::vec(0u64..5_000, 0..600),
            others in proptest::collection::vec(0u64..5_000, 0..200),
        ) {
            let kept = distinct(&rows);
            let (words, probes) = build_index(&kept);
            let mut first = Vec::new();
            for &r in &rows {
                if !first.contains(&r) {
                    first.push(r);
                }
            }
            prop_assert_eq!(&kept, &first);
            prop_assert!(words.len() >= 4 * kept.len());
            for (slot, &r) in kept.iter().enumerate() {
                prop_assert_eq!(hot_slot(&words, probes, kept.len() as u64, r), Some(slot as u64));
            }
            for &r in &others {
                let want = kept.iter().position(|&k| k == r).map(|s| s as u64);
                prop_assert_eq!(hot_slot(&words, probes, kept.len() as u64, r), want);
            }
        }
    }
}
