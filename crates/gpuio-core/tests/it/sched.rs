//! The scheduler's invariants: the ready queue as a state machine (nothing lost or served
//! twice, EDF among deadline requests, bounded wait for the lowest class), and the running
//! scheduler under random submissions, cancels, session drops and shutdown (every request
//! completes exactly once; what is acknowledged landed), plus backpressure, timeouts,
//! chunking and failover.

use crate::common;

use common::{engines, host, sched, sched_with, zeroed};
use gpuio_core::sched::{Meta, QueueConfig, ReadyQueue, SessionId};
use gpuio_core::*;
use gpuio_hal::pattern;
use gpuio_transport_localio::OpenOptions;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CLASSES: [Priority; 6] = [
    Priority::InferenceRealtime,
    Priority::TrainingForward,
    Priority::TrainingBackward,
    Priority::Checkpoint,
    Priority::EngramSync,
    Priority::Background,
];

#[derive(Debug, Clone)]
enum Op {
    Push {
        session: u64,
        class: usize,
        deadline_ms: Option<u64>,
        cost: u64,
        engine: usize,
    },
    Pop,
    /// A pop while a lease holds this class.
    PopAbove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..4, 0usize..6, proptest::option::of(0u64..50), 1u64..(1 << 20), 0usize..2)
            .prop_map(|(session, class, deadline_ms, cost, engine)| Op::Push {
                session, class, deadline_ms, cost, engine
            }),
        2 => Just(Op::Pop),
        1 => (0usize..6).prop_map(Op::PopAbove),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::Fifo),
        Just(Policy::Priority),
        Just(Policy::Deadline),
        Just(Policy::Adaptive)
    ]
}

/// What the ready-queue test knows of the queue: each item's deadline and sequence number,
/// and, per engine's class queue (units without a deadline, or every unit under PRIORITY), how
/// many units it holds and since when it has waited (the queue's own starvation clock: since
/// it became non-empty or was last served).
#[derive(Default)]
struct Model {
    queued: BTreeMap<u32, (Option<Instant>, u64)>,
    seen: std::collections::HashSet<u32>,
    in_class: [[usize; 6]; 2],
    waiting: [[Option<Instant>; 6]; 2],
}

fn engine_of(meta: &Meta) -> usize {
    usize::from(meta.engine == EngineKind::LocalIo)
}

fn in_class_queue(policy: Policy, deadline: Option<Instant>) -> bool {
    match policy {
        Policy::Fifo => false,
        Policy::Priority => true,
        Policy::Deadline | Policy::Adaptive => deadline.is_none(),
    }
}

impl Model {
    fn pushed(&mut self, policy: Policy, item: u32, meta: &Meta, seq: u64) {
        self.queued.insert(item, (meta.deadline, seq));
        if in_class_queue(policy, meta.deadline) {
            let (e, c) = (engine_of(meta), meta.class as usize);
            if self.in_class[e][c] == 0 {
                self.waiting[e][c] = Some(meta.arrival);
            }
            self.in_class[e][c] += 1;
        }
    }

    fn check_pop(
        &mut self,
        q: &mut ReadyQueue<u32>,
        policy: Policy,
        max_wait: Duration,
        now: Instant,
        floor: Option<Priority>,
    ) -> Result<(), TestCaseError> {
        let Some((meta, item)) = q.pop_above(now, floor) else {
            prop_assert!(self.queued.is_empty() || floor.is_some());
            return Ok(());
        };
        prop_assert!(self.seen.insert(item), "item {} served twice", item);
        let (deadline, seq) = self
            .queued
            .remove(&item)
            .expect("popped an item never queued");
        prop_assert_eq!(meta.seq, seq);
        let (e, c) = (engine_of(&meta), meta.class as usize);
        let class_queue = in_class_queue(policy, deadline);
        if let Some(f) = floor
            && policy != Policy::Fifo
            && meta.class > f
        {
            let since = if class_queue {
                self.waiting[e][c]
            } else {
                Some(meta.arrival)
            };
            let waited = since.map(|t| now.duration_since(t)).unwrap_or_default();
            prop_assert!(
                waited >= max_wait,
                "a {:?} unit ran under a {:?} lease after {:?}",
                meta.class,
                f,
                waited
            );
        }
        if class_queue {
            self.in_class[e][c] -= 1;
            self.waiting[e][c] = (self.in_class[e][c] > 0).then_some(now);
        }
        match policy {
            Policy::Fifo => {
                let oldest = self.queued.values().map(|v| v.1).min();
                prop_assert!(oldest.is_none_or(|o| o > seq), "FIFO out of order");
            }
            // Under a floor, EDF holds among the units it lets through.
            Policy::Deadline if floor.is_none() => {
                if let Some(d) = deadline {
                    let earliest = self.queued.values().filter_map(|v| v.0).min();
                    prop_assert!(earliest.is_none_or(|e| e >= d), "EDF violated");
                }
            }
            _ => {}
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Random pushes and pops (virtual time advancing 1 ms per pop), some under a floor (a
    /// lease's class): every item comes out exactly once; under DEADLINE each popped deadline
    /// item is the earliest queued (unless a starving class preempted it, or a floor held the
    /// earlier back); FIFO pops in arrival order; under a floor, a less urgent unit runs only
    /// once it (a deadline unit) or its class (the others) has waited `max_wait`.
    #[test]
    fn the_ready_queue_loses_nothing_and_keeps_edf(ops in proptest::collection::vec(op(), 1..300),
                                                   policy in policy()) {
        let t0 = Instant::now();
        let max_wait = Duration::from_millis(40);
        let mut q = ReadyQueue::new(QueueConfig { policy, max_wait, urgent_window: Duration::from_millis(5) });
        let mut now = t0;
        let mut m = Model::default();
        let mut next = 0u32;
        for op in ops {
            match op {
                Op::Push { session, class, deadline_ms, cost, engine } => {
                    let deadline = deadline_ms.map(|ms| now + Duration::from_millis(ms));
                    let meta = Meta {
                        seq: 0,
                        session: SessionId(session),
                        weight: 1,
                        class: CLASSES[class],
                        deadline,
                        engine: [EngineKind::MemIo, EngineKind::LocalIo][engine],
                        cost,
                        arrival: now,
                    };
                    let seq = q.push(meta, next);
                    m.pushed(policy, next, &meta, seq);
                    next += 1;
                }
                Op::Pop => {
                    now += Duration::from_millis(1);
                    m.check_pop(&mut q, policy, max_wait, now, None)?;
                }
                Op::PopAbove(class) => {
                    now += Duration::from_millis(1);
                    m.check_pop(&mut q, policy, max_wait, now, Some(CLASSES[class]))?;
                }
            }
            prop_assert_eq!(q.len(), m.queued.len());
        }
        while !m.queued.is_empty() {
            now += Duration::from_millis(1);
            m.check_pop(&mut q, policy, max_wait, now, None)?;
        }
        prop_assert!(q.is_empty());
    }

    /// Under a sustained stream of realtime work, a background request waits at most about
    /// `max_wait`, under every policy.
    #[test]
    fn the_lowest_class_does_not_starve(policy in policy(), backlog in 1usize..50, with_deadlines: bool) {
        let max_wait = Duration::from_millis(20);
        let step = Duration::from_millis(1);
        let mut q = ReadyQueue::new(QueueConfig { policy, max_wait, urgent_window: Duration::from_millis(5) });
        let t0 = Instant::now();
        let mut now = t0;
        let meta = |class: Priority, now: Instant, deadline: Option<Instant>| Meta {
            seq: 0, session: SessionId(1), weight: 1, class, deadline,
            engine: EngineKind::MemIo, cost: 4096, arrival: now,
        };
        for i in 0..backlog {
            q.push(meta(Priority::InferenceRealtime, now, None), i as u32);
        }
        q.push(meta(Priority::Background, now, None), u32::MAX);
        let mut served_at = None;
        for i in 0..10_000u32 {
            // One realtime arrival per step, as urgent as it gets.
            let d = with_deadlines.then_some(now + step);
            q.push(meta(Priority::InferenceRealtime, now, d), 1_000 + i);
            now += step;
            if q.pop(now).is_some_and(|(_, item)| item == u32::MAX) {
                served_at = Some(now);
                break;
            }
        }
        let waited = served_at.expect("the background request was never served") - t0;
        let bound = match policy {
            // FIFO serves by arrival: the backlog, then it.
            Policy::Fifo => step * (backlog as u32 + 1),
            _ => max_wait + 2 * step,
        };
        prop_assert!(waited <= bound, "waited {:?} > {:?}", waited, bound);
    }
}

/// What happened to each request in a randomized run.
#[derive(Default)]
struct Outcomes {
    done: Mutex<HashMap<RequestId, Vec<std::result::Result<usize, ErrorCode>>>>,
}

impl Outcomes {
    fn record(&self, id: RequestId, r: Result<Completion>) {
        let mut g = self.done.lock().unwrap();
        g.entry(id)
            .or_default()
            .push(r.map(|c| c.outcome.bytes).map_err(|e| e.code()));
    }
}

#[derive(Debug, Clone)]
enum Act {
    Submit {
        session: usize,
        class: usize,
        deadline: bool,
        slot: usize,
        len: usize,
    },
    Cancel(usize),
    DropSession(usize),
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        6 => (0usize..3, 0usize..6, any::<bool>(), 0usize..64, 1usize..(64 << 10))
            .prop_map(|(session, class, deadline, slot, len)| Act::Submit { session, class, deadline, slot, len }),
        2 => (0usize..1000).prop_map(Act::Cancel),
        1 => (0usize..3).prop_map(Act::DropSession),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// The running scheduler: random submissions over three sessions (with chunking: the
    /// chunk size is small), random cancels and session drops, then shutdown. Every request
    /// completes exactly once; a successful one's bytes are at its destination; a cancelled
    /// one never ran.
    #[test]
    fn every_request_completes_exactly_once(acts in proptest::collection::vec(act(), 1..120),
                                            policy in policy(), workers in 1usize..4) {
        let e = engines();
        let cfg = SchedulerConfig { workers, policy, chunk_size: 16 << 10, ..SchedulerConfig::default() };
        let mut s = sched_with(&e, cfg, RetryPolicy::NONE).unwrap();
        let src = host(64 << 10, 77);
        // One destination buffer per request slot, so results can be checked independently.
        let dsts: Vec<HostMemory> = (0..64).map(|_| zeroed(64 << 10)).collect();
        let outcomes = Arc::new(Outcomes::default());
        let mut sessions: Vec<Option<SchedSession>> =
            (0..3).map(|_| Some(s.session(SessionOptions::default()))).collect();
        let mut tickets: Vec<(Ticket, usize, usize)> = Vec::new();
        let mut slot_owner: HashMap<usize, usize> = HashMap::new();
        for a in acts {
            match a {
                Act::Submit { session, class, deadline, slot, len } => {
                    // One live request per destination slot, so its final bytes are known.
                    if slot_owner.contains_key(&slot) { continue; }
                    let Some(sess) = sessions[session].as_ref() else { continue };
                    let mut r = Request::new(Endpoint::host(&src, 0), Endpoint::host(&dsts[slot], 0), len)
                        .unwrap()
                        .with_priority(CLASSES[class]);
                    if deadline { r = r.with_deadline(Instant::now() + Duration::from_millis(1)); }
                    let o = outcomes.clone();
                    let id = r.id;
                    let t = sess.submit_with(r, move |c| o.record(id, c)).unwrap();
                    slot_owner.insert(slot, tickets.len());
                    tickets.push((t, slot, len));
                }
                Act::Cancel(i) => if let Some((t, _, _)) = tickets.get(i % tickets.len().max(1)) {
                    t.cancel();
                },
                Act::DropSession(i) => { sessions[i] = None; }
            }
        }
        drop(sessions);
        s.shutdown();
        let done = outcomes.done.lock().unwrap();
        for (t, slot, len) in &tickets {
            let rs = done.get(&t.id()).map(Vec::as_slice).unwrap_or(&[]);
            prop_assert_eq!(rs.len(), 1, "request {} completed {} times", t.id(), rs.len());
            match rs[0] {
                Ok(n) => {
                    prop_assert_eq!(n, *len);
                    prop_assert_eq!(t.status(), Status::Completed);
                    let g = dsts[*slot].read();
                    prop_assert_eq!(pattern::first_deviation(&g[..*len], 0, 77), None);
                }
                Err(code) => {
                    prop_assert_eq!(code, ErrorCode::Canceled);
                    // Cancelled before it started; or, chunked and under way when its session
                    // closed, failed with the cancellation.
                    prop_assert!(matches!(t.status(), Status::Cancelled | Status::Error));
                }
            }
        }
        let st = s.stats();
        prop_assert_eq!(st.submitted as usize, tickets.len());
        prop_assert_eq!((st.completed + st.cancelled) as usize, tickets.len());
        prop_assert_eq!(st.in_flight_bytes, [0, 0, 0]);
    }
}

/// Blocks the only worker of `s` until the returned guard drops: a request reading `src`
/// holds it while the guard holds `src` for writing.
fn occupy(s: &SchedSession, src: &HostMemory, dst: &HostMemory) -> RequestHandle {
    s.submit(Request::new(Endpoint::host(src, 0), Endpoint::host(dst, 0), 16).unwrap())
        .unwrap()
}

#[test]
fn dropping_a_session_cancels_its_queued_work_and_keeps_what_ran() {
    let e = engines();
    let s = sched(&e, 1, RetryPolicy::NONE).unwrap();
    let gate = host(4096, 1);
    let src = host(1 << 20, 5);
    let dst = zeroed(1 << 20);
    let guard = gate.write();
    let blocker = occupy(&s, &gate, &dst);
    while blocker.status() != Status::InProgress {
        std::thread::yield_now();
    }
    let tenant = s.session(SessionOptions::default());
    let queued: Vec<RequestHandle> = (0..8)
        .map(|i| {
            tenant
                .submit(
                    Request::new(
                        Endpoint::host(&src, i * 4096),
                        Endpoint::host(&dst, i * 4096),
                        4096,
                    )
                    .unwrap(),
                )
                .unwrap()
        })
        .collect();
    drop(tenant);
    for h in queued {
        assert_eq!(h.wait().unwrap_err().code(), ErrorCode::Canceled);
    }
    drop(guard);
    blocker.wait().unwrap();
    // Nothing of the cancelled requests reached the destination.
    assert!(dst.read()[16..8 * 4096].iter().all(|&b| b == 0));
}

#[test]
fn backpressure_bounds_a_session_and_frees_on_completion() {
    let e = engines();
    let s = sched(&e, 1, RetryPolicy::NONE).unwrap();
    let gate = host(4096, 1);
    let src = host(1 << 20, 5);
    let dst = zeroed(1 << 20);
    let tenant = s.session(SessionOptions {
        weight: 1,
        max_in_flight: Some(64 << 10),
    });
    let guard = gate.write();
    let blocker = occupy(&tenant, &gate, &dst);
    let req = |i: usize| {
        Request::new(
            Endpoint::host(&src, i * 4096),
            Endpoint::host(&dst, i * 4096),
            32 << 10,
        )
        .unwrap()
    };
    let first = tenant.try_submit(req(1)).unwrap();
    // 16 + 32 KiB in flight: another 32 KiB does not fit in 64 KiB.
    let err = tenant.try_submit(req(20)).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Busy, "{err}");
    assert!(tenant.in_flight_bytes() <= 64 << 10);
    // A blocking submit waits until the blocker and the first finish.
    let waiter = std::thread::scope(|sc| {
        let h = sc.spawn(|| tenant.submit(req(40)).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!h.is_finished(), "submit should wait for room");
        drop(guard);
        h.join().unwrap()
    });
    blocker.wait().unwrap();
    first.wait().unwrap();
    waiter.wait().unwrap();
    assert_eq!(tenant.in_flight_bytes(), 0);
}

#[test]
fn a_request_past_its_timeout_fails_without_running() {
    let e = engines();
    let s = sched(&e, 1, RetryPolicy::NONE).unwrap();
    let gate = host(4096, 1);
    let src = host(4096, 5);
    let dst = zeroed(8192);
    let guard = gate.write();
    let blocker = occupy(&s, &gate, &dst);
    let late = s
        .submit(
            Request::new(Endpoint::host(&src, 0), Endpoint::host(&dst, 4096), 4096)
                .unwrap()
                .with_timeout(Duration::from_millis(5)),
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    drop(guard);
    blocker.wait().unwrap();
    let err = late.wait().unwrap_err();
    assert_eq!(err.code(), ErrorCode::Timeout, "{err}");
    assert!(dst.read()[4096..].iter().all(|&b| b == 0));
}

#[test]
fn large_requests_run_as_chunks_and_urgent_work_passes_them() {
    let e = engines();
    let cfg = SchedulerConfig {
        workers: 1,
        chunk_size: 64 << 10,
        ..SchedulerConfig::default()
    };
    let s = sched_with(&e, cfg, RetryPolicy::NONE).unwrap();
    let gate = host(4096, 1);
    let big_src = host(8 << 20, 9);
    let big_dst = zeroed(8 << 20);
    let guard = gate.write();
    let blocker = occupy(&s, &gate, &big_dst);
    let order = Arc::new(Mutex::new(Vec::new()));
    let o = order.clone();
    s.submit_with(
        Request::new(
            Endpoint::host(&big_src, 0),
            Endpoint::host(&big_dst, 0),
            8 << 20,
        )
        .unwrap()
        .with_priority(Priority::Checkpoint),
        move |r| o.lock().unwrap().push(("bulk", r.is_ok())),
    )
    .unwrap();
    let small_dst = zeroed(4096);
    let o = order.clone();
    s.submit_with(
        Request::new(
            Endpoint::host(&big_src, 0),
            Endpoint::host(&small_dst, 0),
            4096,
        )
        .unwrap()
        .with_priority(Priority::InferenceRealtime)
        .with_deadline(Instant::now() + Duration::from_millis(50)),
        move |r| o.lock().unwrap().push(("urgent", r.is_ok())),
    )
    .unwrap();
    drop(guard);
    blocker.wait().unwrap();
    while order.lock().unwrap().len() < 2 {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        *order.lock().unwrap(),
        [("urgent", true), ("bulk", true)],
        "the urgent request should pass the queued chunks"
    );
    assert_eq!(
        pattern::first_deviation(&big_dst.read()[..], 0, 9),
        None,
        "the chunked copy is complete"
    );
}

#[test]
fn a_failed_source_fails_over_to_its_replica() {
    let e = engines();
    let s = sched(&e, 2, RetryPolicy::NONE).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    let mut data = vec![0u8; 1 << 20];
    pattern::fill(&mut data, 0, 31);
    std::fs::write(&good, &data).unwrap();
    let broken = dir.path().join("broken");
    std::fs::write(&broken, b"short").unwrap();
    let open = |p| e.localio().open(p, OpenOptions::READ).unwrap();
    let (primary, replica) = (open(&broken), open(&good));
    let dst = zeroed(1 << 20);
    let c = s
        .submit(
            Request::new(
                Endpoint::file(&primary, 0),
                Endpoint::host(&dst, 0),
                1 << 20,
            )
            .unwrap()
            .with_alternate_source(Endpoint::file(&replica, 0))
            .unwrap(),
        )
        .unwrap()
        .wait()
        .unwrap();
    assert!(c.outcome.failover.is_some(), "{}", c.outcome);
    assert_eq!(s.stats().failovers, 1);
    assert_eq!(pattern::first_deviation(&dst.read()[..], 0, 31), None);
    // With no good replica the error is the last source's, typed.
    let err = s
        .submit(
            Request::new(
                Endpoint::file(&primary, 0),
                Endpoint::host(&dst, 0),
                1 << 20,
            )
            .unwrap()
            .with_alternate_source(Endpoint::file(&primary, 0))
            .unwrap(),
        )
        .unwrap()
        .wait()
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
}

#[test]
fn small_adjacent_requests_are_merged_by_the_workers() {
    let e = engines();
    let s = sched(&e, 1, RetryPolicy::NONE).unwrap();
    let gate = host(4096, 1);
    let src = host(1 << 20, 12);
    let dst = zeroed(1 << 20);
    let guard = gate.write();
    let blocker = occupy(&s, &gate, &zeroed(16));
    let count = Arc::new(AtomicU64::new(0));
    let c = count.clone();
    let reqs: Vec<Request> = (0..64)
        .map(|i| {
            Request::new(
                Endpoint::host(&src, i * 4096),
                Endpoint::host(&dst, i * 4096),
                4096,
            )
            .unwrap()
        })
        .collect();
    s.submit_each(reqs, move |r| {
        assert!(r.is_ok());
        c.fetch_add(1, Ordering::Relaxed);
    })
    .unwrap();
    drop(guard);
    blocker.wait().unwrap();
    while count.load(Ordering::Relaxed) < 64 {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(s.stats().coalesced >= 2, "{:?}", s.stats());
    assert_eq!(
        pattern::first_deviation(&dst.read()[..256 << 10], 0, 12),
        None
    );
}

/// Durable writes coalesced into one transfer land whole in their file, and a durable request
/// lets go of its buffers before its completion is delivered (the file it flushes included).
#[test]
fn durable_requests_flush_their_file_and_let_go_before_completing() {
    let e = engines();
    let s = sched(&e, 1, RetryPolicy::NONE).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = e
        .localio()
        .open(dir.path().join("journal"), OpenOptions::CREATE)
        .unwrap();
    let gate = host(4096, 1);
    let src = host(64 << 10, 21);
    let guard = gate.write();
    let blocker = occupy(&s, &gate, &zeroed(16));
    let durable = RequestFlags {
        durable: true,
        ..RequestFlags::default()
    };
    let reqs: Vec<Request> = (0..16)
        .map(|i| {
            Request::new(
                Endpoint::host(&src, i * 4096),
                Endpoint::file(&file, (i * 4096) as u64),
                4096,
            )
            .unwrap()
            .with_flags(durable)
        })
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    s.submit_each(reqs, move |r| {
        tx.send(r.map(|c| c.outcome.coalesced)).unwrap()
    })
    .unwrap();
    drop(guard);
    blocker.wait().unwrap();
    let merged: Vec<usize> = (0..16).map(|_| rx.recv().unwrap().unwrap()).collect();
    assert!(
        merged.iter().any(|&n| n > 1),
        "nothing coalesced: {merged:?}"
    );
    let mut back = vec![0u8; 64 << 10];
    file.read_exact_at(0, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 21), None);

    // A durable request to host memory: nothing to flush, and the buffer is free again once
    // the completion arrives.
    let dst = zeroed(4096);
    let (tx, rx) = std::sync::mpsc::channel();
    let req = Request::new(Endpoint::host(&src, 0), Endpoint::host(&dst, 0), 4096)
        .unwrap()
        .with_flags(durable);
    s.submit_with(req, move |r| {
        tx.send(r.is_ok()).unwrap();
        // Slow to return: whatever the worker still holds now, it holds past the completion.
        std::thread::sleep(Duration::from_millis(50));
    })
    .unwrap();
    assert!(rx.recv().unwrap());
    let buf = dst
        .into_inner()
        .expect("the completed request let go of its destination");
    assert_eq!(pattern::first_deviation(&buf, 0, 21), None);
}

/// A batch larger than its session's in-flight limit runs (admitted as a whole while the
/// session is idle) instead of waiting for room only its own unqueued members would free.
#[test]
fn a_batch_larger_than_the_session_limit_runs() {
    let e = engines();
    let s = sched(&e, 2, RetryPolicy::NONE).unwrap();
    let tenant = s.session(SessionOptions {
        max_in_flight: Some(1 << 20),
        ..SessionOptions::default()
    });
    let src = host(4 << 20, 33);
    let dst = zeroed(4 << 20);
    let reqs: Vec<Request> = (0..4)
        .map(|i| {
            Request::new(
                Endpoint::host(&src, i << 20),
                Endpoint::host(&dst, i << 20),
                1 << 20,
            )
            .unwrap()
        })
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let report = tenant.submit_batch(reqs).and_then(|h| h.wait());
        tx.send(report.map(|r| r.bytes)).unwrap();
    });
    let bytes = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the batch waited for room only it could free")
        .unwrap();
    assert_eq!(bytes, 4 << 20);
    assert_eq!(pattern::first_deviation(&dst.read(), 0, 33), None);
}

/// A request whose source and destination overlap runs whole, as one `memmove` (host memory)
/// or refused (device memory): chunks on several workers in any order would read bytes an
/// earlier chunk had already overwritten, and report success with wrong data.
#[test]
fn overlapping_ends_run_whole_or_are_refused_never_corrupted() {
    let e = engines();
    let s = sched(&e, 4, RetryPolicy::NONE).unwrap();
    let (len, shift) = (3 << 20, 1 << 20);
    let mem = host(4 << 20, 5);
    let mut expect = mem.read().to_vec();
    expect.copy_within(0..len, shift);
    let forward = Request::new(Endpoint::host(&mem, 0), Endpoint::host(&mem, shift), len).unwrap();
    assert_eq!(
        s.submit(forward).unwrap().wait().unwrap().outcome.bytes,
        len
    );
    assert!(
        mem.read()[..] == expect[..],
        "the overlapping copy moved the wrong bytes"
    );
    let mut expect = mem.read().to_vec();
    expect.copy_within(shift..shift + len, 0);
    let back = Request::new(Endpoint::host(&mem, shift), Endpoint::host(&mem, 0), len).unwrap();
    let batch = s.submit_batch(vec![back]).unwrap().wait().unwrap();
    assert_eq!(batch.bytes, len as u64);
    assert!(
        mem.read()[..] == expect[..],
        "the batched overlapping copy moved the wrong bytes"
    );

    let gpu = e.memio().gpu(0).unwrap();
    let dev = gpu.alloc(4 << 20).unwrap();
    let r = Request::new(
        Endpoint::device(&dev, 0),
        Endpoint::device(&dev, shift),
        len,
    )
    .unwrap();
    let err = s.submit(r).unwrap().wait().unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
}

/// A length far past the memory it names fails at once with a typed error, not after a chunk
/// list sized by that length (which, at 2^62 bytes, could not even be allocated).
#[test]
fn a_length_past_its_memory_fails_whole_and_at_once() {
    let e = engines();
    let s = sched(&e, 2, RetryPolicy::NONE).unwrap();
    let (src, dst) = (host(1 << 20, 1), zeroed(1 << 20));
    let t = Instant::now();
    for len in [(1 << 20) + 1, 1 << 40, 1 << 62] {
        let r = Request::new(Endpoint::host(&src, 0), Endpoint::host(&dst, 0), len).unwrap();
        let err = s.submit(r).unwrap().wait().unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidArg, "{len}: {err}");
        let r = Request::new(Endpoint::host(&src, 0), Endpoint::host(&dst, 0), len).unwrap();
        assert!(s.submit_batch(vec![r]).unwrap().wait().is_err());
    }
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert!(
        dst.read().iter().all(|&b| b == 0),
        "a failed request wrote its destination"
    );
}

/// Chunks bounded by count, not bytes: with 4 KiB chunks, a file request far past the file's
/// end runs whole and fails at once; a copy between two opens of one file whose ranges
/// overlap across chunks runs whole and is refused, leaving the file as it was.
#[test]
fn file_requests_are_cut_within_bounds_and_never_across_an_overlap() {
    let e = engines();
    let cfg = SchedulerConfig {
        workers: 2,
        chunk_size: 4096,
        ..SchedulerConfig::default()
    };
    let s = sched_with(&e, cfg, RetryPolicy::NONE).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 13) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let rw = OpenOptions {
        write: true,
        ..OpenOptions::READ
    };
    let (f, g) = (
        e.localio().open(&path, rw).unwrap(),
        e.localio().open(&path, OpenOptions::READ).unwrap(),
    );
    let t = Instant::now();
    let r = Request::new(Endpoint::file(&g, 0), Endpoint::file(&f, 1 << 40), 1 << 40).unwrap();
    assert!(s.submit(r).unwrap().wait().is_err());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    let r = Request::new(Endpoint::file(&g, 0), Endpoint::file(&f, 5000), 20_000).unwrap();
    let err = s.submit(r).unwrap().wait().unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), data);
}

/// A completion callback that panics is the caller's bug: the worker survives it, and the
/// requests after it complete.
#[test]
fn a_panicking_callback_does_not_take_the_worker_down() {
    let e = engines();
    let s = sched(&e, 1, RetryPolicy::NONE).unwrap();
    let (src, dst) = (host(8192, 4), zeroed(8192));
    let r = Request::new(Endpoint::host(&src, 0), Endpoint::host(&dst, 0), 4096).unwrap();
    s.submit_with(r, |_| panic!("the caller's bug")).unwrap();
    let r = Request::new(Endpoint::host(&src, 4096), Endpoint::host(&dst, 4096), 4096).unwrap();
    assert_eq!(s.submit(r).unwrap().wait().unwrap().outcome.bytes, 4096);
    assert_eq!(pattern::first_deviation(&dst.read(), 0, 4), None);
}
