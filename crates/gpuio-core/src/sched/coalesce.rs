//! How requests become units of the shared queue, and how units become transfers again: a
//! request is cut into chunks of `chunk_size` when it is queued (its preemption points, and
//! what lets several workers run it), and whole small requests that continue each other on
//! both sides are merged into one transfer of at most `coalesce_max` bytes when a worker takes
//! them (coalescing).

use super::queue::Meta;
use super::ticket::TicketInner;
use super::{Shared, State};
use crate::batch;
use crate::error::{CoreError, Result};
use crate::request::Status;
use crate::route::EngineKind;
use gpuio_hal::sync::MutexExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// A unit of work in the queues.
pub(super) enum Unit {
    /// Bytes `off..off+len` of one request.
    Chunk {
        t: Arc<TicketInner>,
        off: usize,
        len: usize,
    },
    /// Whole requests, adjacent on both sides, run as one transfer.
    Group(Vec<Arc<TicketInner>>),
}

impl Unit {
    /// Fails the unit's requests as shut down (the scheduler closed with it queued). Settled
    /// here, not left to the tickets' drop: a handle may still hold one.
    pub(super) fn shut_down(self) {
        let fail = |t: &TicketInner| {
            if !t.fail_unstarted(CoreError::ShutDown) && t.cell.get() == Status::InProgress {
                t.chunk_done(Err(CoreError::ShutDown));
            }
        };
        match self {
            Unit::Chunk { t, .. } => fail(&t),
            Unit::Group(ts) => ts.iter().for_each(|t| fail(t)),
        }
    }

    /// Gives the unit up (its session closed): each request in it is cancelled, or if it
    /// already started, this chunk of it counts down as cancelled.
    pub(super) fn abandon(self) {
        match self {
            Unit::Chunk { t, .. } => t.abandon_chunk(),
            Unit::Group(ts) => ts.iter().for_each(|t| t.abandon_chunk()),
        }
    }
}

impl Shared {
    /// What the ready queue orders a unit of `t` by; `cost` is the unit's bytes.
    pub(super) fn meta(&self, t: &TicketInner, cost: usize) -> Meta {
        Meta {
            seq: 0,
            session: t.session.id,
            weight: t.session.weight,
            class: t.class,
            deadline: t.deadline,
            engine: t.engine,
            cost: cost as u64,
            arrival: t.submitted,
        }
    }

    /// Queues units; wakes sleeping workers.
    fn push(&self, st: &mut State, units: Vec<(Meta, Unit)>) {
        let n = units.len();
        let mut counts = super::ClassCounts::default();
        for (meta, unit) in units {
            counts.count(meta.class);
            st.queue.push(meta, unit);
        }
        self.queued_more(&counts);
        self.queued.fetch_add(n, Ordering::AcqRel);
        self.acct.metrics.queue_depth.set(st.queue.len() as f64);
        let sleeping = self.sleepers.load(Ordering::Acquire);
        if sleeping > 0 {
            if n >= sleeping {
                self.work.notify_all();
            } else {
                (0..n).for_each(|_| self.work.notify_one());
            }
        }
    }

    /// Queues admitted tickets (one unit per chunk); refuses them all if shutting down.
    ///
    /// A lone single-chunk request meeting an empty queue goes straight to a worker spinning
    /// for work, through the worker's slot: one compare-and-swap on one cache line instead of
    /// the shared queue's lock, its ordering structures and its count (each a line the worker
    /// would then fetch from this core: on a 16-core server, about a microsecond of a small
    /// request's latency). Ordering is not bypassed: the queue was empty, and the worker idle.
    pub(super) fn enqueue(&self, tickets: &[Arc<TicketInner>]) -> Result<()> {
        // Nothing queued; or, while a lease holds less urgent classes back, nothing queued
        // that this unit would pass (it is let through, and the held-back units wait).
        let passes = |t: &TicketInner| match self.gate.floor() {
            None => self.queued.load(Ordering::Acquire) == 0,
            Some(f) => t.class <= f && !self.queued_at_or_above(t.class),
        };
        if let [t] = tickets
            && t.len <= self.cfg.chunk_size
            && passes(t)
            && !self.closing.load(Ordering::Acquire)
        {
            // Counted before a worker can finish it.
            self.account_queued(tickets);
            // One clone, passed from slot to slot until one takes it.
            let mut item = t.clone();
            for h in &self.handoffs {
                match h.offer(item) {
                    Ok(()) => return Ok(()),
                    Err(back) => item = back,
                }
            }
            return self.queue_units(tickets, self.units(tickets));
        }
        self.enqueue_units(tickets, self.units(tickets))
    }

    /// A unit per chunk of each ticket.
    fn units(&self, tickets: &[Arc<TicketInner>]) -> Vec<(Meta, Unit)> {
        tickets
            .iter()
            .flat_map(|t| {
                let chunk = if t.chunks == 1 {
                    t.len.max(1)
                } else {
                    self.cfg.chunk_size.max(1)
                };
                (0..t.chunks).map(move |i| {
                    let off = i * chunk;
                    let len = chunk.min(t.len - off.min(t.len));
                    (
                        self.meta(t, len),
                        Unit::Chunk {
                            t: t.clone(),
                            off,
                            len,
                        },
                    )
                })
            })
            .collect()
    }

    /// Queues units made of `tickets` (already admitted); refuses them all if shutting down.
    pub(super) fn enqueue_units(
        &self,
        tickets: &[Arc<TicketInner>],
        units: Vec<(Meta, Unit)>,
    ) -> Result<()> {
        // Counted before a worker can finish them (a refused one counts as failed too).
        self.account_queued(tickets);
        self.queue_units(tickets, units)
    }

    /// [`enqueue_units`](Self::enqueue_units) for tickets already counted.
    fn queue_units(&self, tickets: &[Arc<TicketInner>], units: Vec<(Meta, Unit)>) -> Result<()> {
        let mut st = self.state.lock_unpoisoned();
        if st.closing {
            drop(st);
            for t in tickets {
                t.disarm();
                t.fail_unstarted(CoreError::ShutDown);
            }
            return Err(CoreError::ShutDown);
        }
        self.push(&mut st, units);
        Ok(())
    }

    /// Counts tickets as submitted (statistics and metrics).
    fn account_queued(&self, tickets: &[Arc<TicketInner>]) {
        let m = &self.acct.metrics;
        for t in tickets {
            m.class(t.engine, t.class).submitted.increment(1);
        }
        self.acct.counters.submitted.add(tickets.len() as u64);
    }

    /// Sets the in-flight gauges from the budgets. Workers do it per grab and before they
    /// sleep, so the gauge settles once the work does; submitters never do: summing the
    /// budgets' stripes fetches lines the workers write.
    pub(super) fn publish_in_flight(&self) {
        for e in [EngineKind::MemIo, EngineKind::LocalIo, EngineKind::RemoteIo] {
            self.acct
                .metrics
                .engine(e)
                .in_flight
                .set(self.acct.budgets.in_flight(e) as f64);
        }
    }
    /// Merges whole small requests that continue each other on both sides. A merged group
    /// takes the place of its earliest member, so the policy's order otherwise stands.
    pub(super) fn coalesce(&self, taken: Vec<Unit>) -> Vec<Unit> {
        let max = self.cfg.coalesce_max;
        if taken.len() < 2 || max == 0 {
            return taken;
        }
        // Most grabs hold nothing to merge: look at the sorted keys before rebuilding.
        let mut keys: Vec<(batch::MergeKey, usize)> = taken
            .iter()
            .filter_map(|u| match u {
                Unit::Chunk { t, off: 0, len } if *len == t.len && *len > 0 && *len <= max => {
                    t.merge.map(|k| (k, *len))
                }
                _ => None,
            })
            .collect();
        keys.sort_unstable_by_key(|(k, _)| *k);
        let mergeable = keys
            .windows(2)
            .any(|w| w[0].0.continued_by(&w[1].0, w[0].1) && w[0].1 + w[1].1 <= max);
        if !mergeable {
            return taken;
        }
        let mut out: Vec<(usize, Unit)> = Vec::with_capacity(taken.len());
        let mut cands = Vec::new();
        for (i, u) in taken.into_iter().enumerate() {
            match u {
                Unit::Chunk { t, off: 0, len } if len == t.len && len > 0 && len <= max => {
                    match t.merge {
                        Some(key) => cands.push((key, i, t)),
                        None => out.push((i, Unit::Chunk { t, off: 0, len })),
                    }
                }
                other => out.push((i, other)),
            }
        }
        cands.sort_unstable_by_key(|(k, _, _)| *k);
        let mut run: Vec<(usize, Arc<TicketInner>)> = Vec::new();
        let mut run_key: Option<batch::MergeKey> = None;
        let mut run_len = 0;
        let flush = |run: &mut Vec<(usize, Arc<TicketInner>)>, out: &mut Vec<(usize, Unit)>| {
            let first = run.iter().map(|(i, _)| *i).min().unwrap_or(0);
            match run.len() {
                0 => {}
                1 => {
                    let (_, t) = run.pop().expect("one");
                    let len = t.len;
                    out.push((first, Unit::Chunk { t, off: 0, len }));
                }
                n => {
                    self.acct.counters.coalesced.add(n as u64);
                    let ts = run.drain(..).map(|(_, t)| t).collect();
                    out.push((first, Unit::Group(ts)));
                }
            }
        };
        for (key, i, t) in cands {
            let joins =
                run_key.is_some_and(|k| k.continued_by(&key, run_len)) && run_len + t.len <= max;
            if !joins {
                flush(&mut run, &mut out);
                run_len = 0;
                run_key = Some(key);
            }
            run_len += t.len;
            run.push((i, t));
        }
        flush(&mut run, &mut out);
        out.sort_unstable_by_key(|(i, _)| *i);
        out.into_iter().map(|(_, u)| u).collect()
    }
}
