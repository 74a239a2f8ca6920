//! Batch planning (SDD §8.1): sort requests by address for locality, coalesce adjacent ones
//! into single transfers, group the transfers by engine.

use crate::endpoint::Endpoint;
use crate::request::{EngineKind, Request};
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
