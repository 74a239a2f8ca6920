//! Lookups in several tables at once ([`EngramTable::lookup_tables`]): a model knows every
//! Engram layer's ids of a step together, and where the tables keep hot rows on the step's
//! device, one gather moves them all — one launch and one wait, where a lookup per table
//! waits once per table (the fixed cost that dominates a decode step's small lookups).

use super::{EngramTable, HotTier, Lookup};
use crate::{AiError, Result};
use gpuio_api::{DeviceBuffer, Session};
use gpuio_hal::HOT_MAX_JOBS;
use gpuio_hal::gpu::check_disjoint;
use gpuio_transport_memio::{GatherOptions, HotLookup};
use std::sync::{Arc, PoisonError};

/// One table's part of [`EngramTable::lookup_tables`]: row `ids[i]` of `table` into `dst` at
/// `dst_offset + i * row_bytes`.
#[derive(Debug, Clone, Copy)]
pub struct TableLookup<'a> {
    /// The table.
    pub table: &'a EngramTable,
    /// Its rows to read.
    pub ids: &'a [u64],
    /// Where they go.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
}

impl EngramTable {
    /// Runs every lookup of `lookups`, as [`lookup`](Self::lookup) would, together. Where
    /// each table keeps hot rows ([`keep_hot`](Self::keep_hot)) on its destination's device,
    /// its rows are of one size and the destinations are on one device, the lookups are one
    /// gather (eight tables per gather at most); otherwise they run one by one. Every id and
    /// destination is checked before anything moves (lookups writing the same bytes are
    /// refused). The call holds one lease, of the most urgent work
    /// among the tables' ([`set_work`](Self::set_work)), and each table's locks (taken in
    /// one order by every caller) for its whole length.
    pub fn lookup_tables(session: &Session, lookups: &[TableLookup<'_>]) -> Result<Vec<Lookup>> {
        // Everything checked before anything moves (groups of eight run one after another):
        // the ids, the destinations' room, and that no two lookups write the same bytes.
        let mut spans = Vec::with_capacity(lookups.len());
        for l in lookups {
            l.table.check_ids(l.ids)?;
            let bytes =
                l.ids.len().checked_mul(l.table.row_bytes).ok_or_else(|| {
                    AiError::InvalidArgument("Engram lookup size overflows".into())
                })?;
            gpuio_hal::check_range("lookup destination", l.dst_offset, bytes, l.dst.len())
                .map_err(gpuio_api::Error::from)?;
            spans.push((l.dst.device_addr() + l.dst_offset as u64, bytes));
        }
        check_disjoint(spans, "the lookups' destinations").map_err(gpuio_api::Error::from)?;
        let Some(work) = lookups
            .iter()
            .map(|l| l.table.work)
            .min_by_key(|w| w.priority())
        else {
            return Ok(Vec::new());
        };
        let _lease = work.lease_in(session)?;
        // Each table locked once (a table may appear twice), in the order of its hot tier's
        // address, so two calls naming the same tables in other orders cannot deadlock.
        let mut tables: Vec<&EngramTable> = lookups.iter().map(|l| l.table).collect();
        tables.sort_by_key(|t| Arc::as_ptr(&t.hot));
        tables.dedup_by_key(|t| Arc::as_ptr(&t.hot));
        let locked: Vec<_> = tables
            .iter()
            .map(|t| {
                let hot = t.hot.read().unwrap_or_else(PoisonError::into_inner);
                (hot, t.mem.read())
            })
            .collect();
        let held = |t: &EngramTable| {
            let at = tables
                .binary_search_by_key(&Arc::as_ptr(&t.hot), |u| Arc::as_ptr(&u.hot))
                .unwrap_or(0);
            (locked[at].0.as_ref(), &*locked[at].1)
        };
        let first = lookups[0];
        let together = lookups.len() > 1
            && lookups.iter().all(|l| {
                let (hot, _) = held(l.table);
                l.table.row_bytes == first.table.row_bytes
                    && l.dst.gpu().same_device(first.dst.gpu())
                    && hot.is_some_and(|t| t.serves(l.dst.gpu()))
            });
        if !together {
            return lookups
                .iter()
                .map(|l| {
                    let (hot, table) = held(l.table);
                    l.table
                        .gather_held(session, hot, table, l.ids, l.dst, l.dst_offset)
                })
                .collect();
        }
        let mut out = Vec::with_capacity(lookups.len());
        for group in lookups.chunks(HOT_MAX_JOBS) {
            let jobs = group
                .iter()
                .map(|l| {
                    let (hot, table) = held(l.table);
                    Some(HotLookup {
                        pool: table,
                        hot: hot.map(HotTier::rows)?,
                        indices: l.ids,
                        dst: l.dst,
                        dst_offset: l.dst_offset,
                    })
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| AiError::Internal("a hot tier went while locked".into()))?;
            let reports = session
                .memio()
                .gather_hot_jobs(&jobs, &GatherOptions::default())
                .map_err(gpuio_api::Error::from)?;
            out.extend(reports.into_iter().map(|r| Lookup {
                rows: r.rows,
                rows_fetched: r.rows_fetched,
                strategy: r.strategy,
                hot: true,
            }));
        }
        Ok(out)
    }
}
