//! Batch planning (docs/REFERENCE.md#batches): sort requests by address for locality, coalesce
//! adjacent ones into single transfers, group the transfers by engine.

use crate::endpoint::{Endpoint, ResourceKey};
use crate::request::Request;
use crate::route::EngineKind;
use std::collections::BTreeMap;

/// One transfer a batch issues: one request, or several adjacent ones merged.
#[derive(Debug, Clone)]
pub struct Segment {
    /// Where the merged bytes come from.
    pub src: Endpoint,
    /// Where they go.
    pub dst: Endpoint,
    /// Total bytes.
    pub len: usize,
    /// Flush to stable storage after writing.
    pub durable: bool,
    /// Fail at the first error instead of retrying.
    pub no_retry: bool,
    /// Indices (into the planned slice of requests) of the requests it carries.
    pub members: Vec<usize>,
}

/// The transfers of a batch, grouped by engine.
#[derive(Debug, Clone, Default)]
pub struct BatchPlan {
    /// Segments per engine, each list in address order.
    pub groups: BTreeMap<EngineKind, Vec<Segment>>,
}

impl BatchPlan {
    /// Number of transfers after coalescing.
    pub fn segments(&self) -> usize {
        self.groups.values().map(Vec::len).sum()
    }
}

/// Whether `next` continues `seg` exactly, on both sides, with the same options.
fn continues(seg: &Segment, next: &Request) -> bool {
    let end = |e: &Endpoint| e.offset().checked_add(seg.len as u64);
    seg.src.resource() == next.src.resource()
        && seg.dst.resource() == next.dst.resource()
        && end(&seg.src) == Some(next.src.offset())
        && end(&seg.dst) == Some(next.dst.offset())
        && seg.durable == next.flags.durable
        && seg.no_retry == next.flags.no_retry
        && next.alternates.is_empty()
        && seg.len.checked_add(next.len).is_some()
}

/// Plans a batch: requests sorted by (engine, source resource, destination resource,
/// source offset); runs where each request starts exactly where the previous ended, on both
/// sides, merge into one segment.
pub fn plan(requests: &[Request]) -> BatchPlan {
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| {
        let r = &requests[i];
        (
            r.engine,
            r.src.resource(),
            r.dst.resource(),
            r.src.offset(),
            r.dst.offset(),
        )
    });
    let mut plan = BatchPlan::default();
    for i in order {
        let r = &requests[i];
        let group = plan.groups.entry(r.engine).or_default();
        match group.last_mut() {
            Some(seg) if continues(seg, r) => {
                seg.len += r.len;
                seg.members.push(i);
            }
            _ => group.push(Segment {
                src: r.src.clone(),
                dst: r.dst.clone(),
                len: r.len,
                durable: r.flags.durable,
                no_retry: r.flags.no_retry,
                members: vec![i],
            }),
        }
    }
    plan
}

/// What decides whether whole requests can run merged: the resources on both sides, the
/// options, and where each side starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct MergeKey {
    src: ResourceKey,
    dst: ResourceKey,
    durable: bool,
    no_retry: bool,
    src_off: u64,
    dst_off: u64,
}

impl MergeKey {
    /// Whether `next` starts exactly where a run of `run_len` bytes starting at `self` ends,
    /// on both sides, with the same options.
    pub(crate) fn continued_by(&self, next: &MergeKey, run_len: usize) -> bool {
        let end = |off: u64| off.checked_add(run_len as u64);
        self.src == next.src
            && self.dst == next.dst
            && self.durable == next.durable
            && self.no_retry == next.no_retry
            && end(self.src_off) == Some(next.src_off)
            && end(self.dst_off) == Some(next.dst_off)
    }
}

/// The merge key of a request that may run merged with others (none with alternates).
pub(crate) fn merge_key(r: &Request) -> Option<MergeKey> {
    r.alternates.is_empty().then(|| MergeKey {
        src: r.src.resource(),
        dst: r.dst.resource(),
        durable: r.flags.durable,
        no_retry: r.flags.no_retry,
        src_off: r.src.offset(),
        dst_off: r.dst.offset(),
    })
}
