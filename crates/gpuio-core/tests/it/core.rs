//! The core over real transports on the probed backend: routing, dispatch (blocking, future,
//! callback), cancellation, shutdown, batches.

use crate::common;

use common::{engines, host, sched};
use gpuio_core::*;
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_localio::OpenOptions;
use proptest::prelude::*;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

#[test]
fn transfers_route_to_their_engine() {
    let e = engines();
    let gpu = e.memio().gpu(0).unwrap().clone();
    let dev = gpu.alloc(1 << 20).unwrap();
    let mut src = vec![0u8; 1 << 20];
    pattern::fill(&mut src, 0, 4);
    let o = e
        .transfer(Source::Host(&src), Dest::Device(&dev, 0), 1 << 20)
        .unwrap();
    assert_eq!(o.engine, EngineKind::MemIo);
    let dir = tempfile::tempdir().unwrap();
    let f = e
        .localio()
        .open(dir.path().join("x"), OpenOptions::CREATE)
        .unwrap();
    let o = e
        .transfer(Source::Device(&dev, 0), Dest::File(&f, 0), 1 << 20)
        .unwrap();
    assert_eq!(o.engine, EngineKind::LocalIo);
    let mut back = vec![0u8; 1 << 20];
    e.transfer(Source::File(&f, 0), Dest::Host(&mut back), 1 << 20)
        .unwrap();
    assert_eq!(back, src);
    // A host slice shorter than the length is refused, not truncated.
    let err = e
        .transfer(Source::Host(&src[..10]), Dest::Device(&dev, 0), 11)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg);
}

/// Durable transfers land the same bytes as plain ones, from host memory, GPU memory and files
/// (memory destinations need nothing more), and refuse what a plain one refuses.
#[test]
fn durable_transfers_land_their_bytes() {
    let e = engines();
    let gpu = e.memio().gpu(0).unwrap().clone();
    let len = (4 << 20) + 123;
    let mut src = vec![0u8; len];
    pattern::fill(&mut src, 0, 6);
    let dir = tempfile::tempdir().unwrap();
    let open = |name: &str| {
        e.localio()
            .open(dir.path().join(name), OpenOptions::CREATE)
            .unwrap()
    };
    let (a, b, c) = (open("a"), open("b"), open("c"));
    e.transfer_durable(Source::Host(&src), Dest::File(&a, 0), len)
        .unwrap();
    let dev = gpu.alloc(len).unwrap();
    e.transfer_durable(Source::File(&a, 0), Dest::Device(&dev, 0), len)
        .unwrap();
    e.transfer_durable(Source::Device(&dev, 0), Dest::File(&b, 0), len)
        .unwrap();
    e.transfer_durable(Source::File(&b, 0), Dest::File(&c, 0), len)
        .unwrap();
    for name in ["a", "b", "c"] {
        assert_eq!(std::fs::read(dir.path().join(name)).unwrap(), src, "{name}");
    }
    let ro = e
        .localio()
        .open(dir.path().join("a"), OpenOptions::READ)
        .unwrap();
    let err = e
        .transfer_durable(Source::Host(&src), Dest::File(&ro, 0), len)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Permission);
}

/// The routing of data (`Transfer::new`, over real endpoints of every kind) and the routing of
/// queued requests (`EngineKind::serving`, over kinds) are one table, for all sixteen pairs.
#[test]
fn every_pair_of_endpoint_kinds_meets_the_engine_that_serves_it() {
    use gpuio_transport_remoteio::{Credentials, PeerConfig, RemotePeer};
    let e = engines();
    let gpu = e.memio().gpu(0).unwrap().clone();
    let dev = gpu.alloc(64).unwrap();
    let mem = host(64, 1);
    let dir = tempfile::tempdir().unwrap();
    let f = e
        .localio()
        .open(dir.path().join("x"), OpenOptions::CREATE)
        .unwrap();
    // Never connected: routing does not touch the peer.
    let peer = RemotePeer::new(PeerConfig::new(
        "127.0.0.1:9".parse().unwrap(),
        Credentials {
            key_id: "k".into(),
            secret: vec![0; 32],
        },
    ));
    let res = RemoteResource::new(Arc::new(peer), "x");
    let ends = [
        Endpoint::host(&mem, 0),
        Endpoint::device(&dev, 0),
        Endpoint::file(&f, 0),
        Endpoint::remote(&res, 0),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for s in &ends {
        for d in &ends {
            let routed = Transfer::new(s.source(), d.dest()).engine();
            assert_eq!(
                routed,
                EngineKind::serving(s.kind(), d.kind()),
                "{:?} -> {:?}",
                s.kind(),
                d.kind()
            );
            seen.insert((s.kind(), d.kind(), routed));
        }
    }
    assert_eq!(seen.len(), 16);
}

#[test]
fn requests_complete_by_wait_future_and_callback() {
    let e = engines();
    let d = sched(&e, 2, RetryPolicy::default()).unwrap();
    let dev = e.memio().gpu(0).unwrap().alloc(4 << 20).unwrap();
    let src = host(4 << 20, 12);
    let dst = HostMemory::new(HostBuffer::alloc(4 << 20, &HostAllocOptions::default()).unwrap());

    let up = Request::new(Endpoint::host(&src, 0), Endpoint::device(&dev, 0), 4 << 20).unwrap();
    assert_eq!(up.ty, RequestType::Copy);
    // Requests describe their regions in the HAL's vocabulary.
    let region = up.dst.region(up.len).unwrap();
    assert!(region.location.is_device());
    assert_eq!(region.len, 4 << 20);
    assert!(up.src.region((4 << 20) + 1).is_none());
    let h = d.submit(up).unwrap();
    let c = h.wait().unwrap();
    assert_eq!(c.outcome.bytes, 4 << 20);

    let down = Request::new(Endpoint::device(&dev, 0), Endpoint::host(&dst, 0), 4 << 20).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let c = rt.block_on(d.submit(down).unwrap()).unwrap();
    assert_eq!(c.outcome.engine, EngineKind::MemIo);
    assert_eq!(pattern::first_deviation(&dst.read(), 0, 12), None);

    let (tx, rx) = mpsc::channel();
    let again = Request::new(Endpoint::device(&dev, 0), Endpoint::host(&dst, 0), 4 << 20).unwrap();
    let ticket = d
        .submit_with(again, move |r| tx.send(r.map(|c| c.outcome.bytes)).unwrap())
        .unwrap();
    assert_eq!(rx.recv().unwrap().unwrap(), 4 << 20);
    assert_eq!(ticket.status(), Status::Completed);
    // Once no request holds it, the caller can take the buffer back.
    let buf = dst.into_inner().expect("last handle");
    assert_eq!(pattern::first_deviation(&buf, 0, 12), None);
}

#[test]
fn queued_requests_can_be_cancelled_and_running_ones_cannot() {
    let e = engines();
    let d = sched(&e, 1, RetryPolicy::default()).unwrap();
    let dev = e.memio().gpu(0).unwrap().alloc(4096).unwrap();
    let src = host(4096, 1);
    // Hold the source exclusively: the single worker blocks inside the first request.
    let guard = src.write();
    let first = d
        .submit(Request::new(Endpoint::host(&src, 0), Endpoint::device(&dev, 0), 4096).unwrap())
        .unwrap();
    let second = d
        .submit(Request::new(Endpoint::host(&src, 0), Endpoint::device(&dev, 0), 4096).unwrap())
        .unwrap();
    while first.status() != Status::InProgress {
        std::thread::yield_now();
    }
    assert!(!first.cancel(), "a running request cannot be cancelled");
    assert!(second.cancel());
    drop(guard);
    assert!(first.wait().is_ok());
    let err = second.wait().unwrap_err();
    assert_eq!(err.code(), ErrorCode::Canceled);
}

#[test]
fn shutdown_finishes_what_was_acknowledged() {
    let e = engines();
    let mut d = sched(&e, 2, RetryPolicy::default()).unwrap();
    let dev = e.memio().gpu(0).unwrap().alloc(64 << 20).unwrap();
    let src = host(1 << 20, 3);
    let handles: Vec<_> = (0..64)
        .map(|i| {
            let r = Request::new(
                Endpoint::host(&src, 0),
                Endpoint::device(&dev, i << 20),
                1 << 20,
            )
            .unwrap();
            d.submit(r).unwrap()
        })
        .collect();
    d.shutdown();
    for h in handles {
        assert_eq!(h.wait().unwrap().outcome.bytes, 1 << 20);
    }
    let r = Request::new(Endpoint::host(&src, 0), Endpoint::device(&dev, 0), 1).unwrap();
    assert!(matches!(d.submit(r), Err(CoreError::ShutDown)));
}

#[test]
fn failures_are_typed_and_final() {
    let e = engines();
    let d = sched(&e, 1, RetryPolicy::default()).unwrap();
    let dev = e.memio().gpu(0).unwrap().alloc(100).unwrap();
    let src = host(100, 3);
    let r = Request::new(Endpoint::host(&src, 0), Endpoint::device(&dev, 50), 100).unwrap();
    let h = d.submit(r).unwrap();
    let ticket = h.ticket().clone();
    let err = h.wait().unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg);
    assert_eq!(ticket.status(), Status::Error);
}

#[test]
fn adjacent_requests_coalesce_into_one_transfer() {
    let e = engines();
    let gpu = e.memio().gpu(0).unwrap().clone();
    let dev = gpu.alloc(1 << 20).unwrap();
    let src = host(1 << 20, 8);
    // 256 requests of 4 KiB, submitted in a shuffled order.
    let mut order: Vec<usize> = (0..256).collect();
    order.reverse();
    order.swap(3, 200);
    let reqs: Vec<Request> = order
        .iter()
        .map(|&i| {
            Request::new(
                Endpoint::host(&src, i * 4096),
                Endpoint::device(&dev, i * 4096),
                4096,
            )
            .unwrap()
        })
        .collect();
    let plan = batch::plan(&reqs);
    assert_eq!(plan.segments(), 1);
    let d = sched(&e, 2, RetryPolicy::default()).unwrap();
    let batch = d.submit_batch(reqs).unwrap();
    let tickets = batch.tickets().to_vec();
    let report = batch.wait().unwrap();
    assert_eq!(report.requests, 256);
    assert_eq!(report.segments, 1);
    assert_eq!(report.bytes, 1 << 20);
    assert!(tickets.iter().all(|t| t.status() == Status::Completed));
    let mut back = vec![0u8; 1 << 20];
    gpu.stream().unwrap().download(&dev, 0, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 8), None);
}

#[test]
fn batches_group_by_engine_and_report_failures() {
    let e = engines();
    let dev = e.memio().gpu(0).unwrap().alloc(8192).unwrap();
    let src = host(8192, 2);
    let dir = tempfile::tempdir().unwrap();
    let f = e
        .localio()
        .open(dir.path().join("b"), OpenOptions::CREATE)
        .unwrap();
    let reqs = vec![
        Request::new(Endpoint::host(&src, 0), Endpoint::device(&dev, 0), 4096).unwrap(),
        Request::new(Endpoint::host(&src, 0), Endpoint::file(&f, 0), 8192).unwrap(),
        // Gap: does not coalesce with the first.
        Request::new(
            Endpoint::host(&src, 5000),
            Endpoint::device(&dev, 5000),
            100,
        )
        .unwrap(),
        // Out of range: fails alone.
        Request::new(
            Endpoint::host(&src, 8000),
            Endpoint::device(&dev, 8100),
            1000,
        )
        .unwrap(),
    ];
    let bad = reqs[3].id;
    let plan = batch::plan(&reqs);
    assert_eq!(plan.groups[&EngineKind::MemIo].len(), 3);
    assert_eq!(plan.groups[&EngineKind::LocalIo].len(), 1);
    let d = sched(&e, 2, RetryPolicy::NONE).unwrap();
    let err = d.submit_batch(reqs).unwrap().wait().unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    let CoreError::Batch(report) = err else {
        panic!("expected a batch error");
    };
    assert_eq!(report.segments, 4);
    assert_eq!(report.bytes, 4096 + 8192 + 100);
    assert_eq!(report.failed.len(), 1);
    assert_eq!(report.failed[0].0, bad);
}

#[test]
fn opposite_host_transfers_do_not_deadlock() {
    let e = engines();
    let d = sched(&e, 4, RetryPolicy::default()).unwrap();
    let a = host(1 << 16, 1);
    let b = host(1 << 16, 2);
    let handles: Vec<_> = (0..200)
        .map(|i| {
            let (from, to) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
            d.submit(Request::new(Endpoint::host(from, 0), Endpoint::host(to, 0), 1 << 16).unwrap())
                .unwrap()
        })
        .collect();
    for h in handles {
        h.wait().unwrap();
    }
}

/// Transfers lock only the bytes they touch: one into a part of a buffer runs while the
/// caller holds another part; one into the held part waits for it.
#[test]
fn transfers_wait_only_for_the_bytes_they_touch() {
    let e = engines();
    let src = host(1 << 20, 3);
    let dst = common::zeroed(1 << 20);
    let run = |to: usize| {
        let (tx, rx) = mpsc::channel();
        let (e, from, into) = (
            e.clone(),
            Endpoint::host(&src, to),
            Endpoint::host(&dst, to),
        );
        std::thread::spawn(move || tx.send(e.execute(&from, &into, 4096).map(|o| o.bytes)));
        rx
    };
    let held = dst.write_range(0, 4096).unwrap();
    let apart = run(512 << 10)
        .recv_timeout(Duration::from_secs(20))
        .expect("a transfer into another part of the buffer waited for the held part");
    assert_eq!(apart.unwrap(), 4096);
    let inside = run(1024);
    assert!(
        inside.recv_timeout(Duration::from_millis(200)).is_err(),
        "a transfer into held bytes ran"
    );
    drop(held);
    assert_eq!(
        inside
            .recv_timeout(Duration::from_secs(20))
            .unwrap()
            .unwrap(),
        4096
    );
    let (s, d) = (src.read(), dst.read());
    for at in [1024, 512 << 10] {
        assert_eq!(d[at..at + 4096], s[at..at + 4096]);
    }
    assert!(d[..1024].iter().all(|&b| b == 0));
}

/// A range past the end of host memory is refused naming its side, also where one buffer is
/// both (whose move locks one span over both ranges).
#[test]
fn host_range_errors_name_their_side() {
    let e = engines();
    let (a, b) = (host(64 << 10, 1), common::zeroed(64 << 10));
    let err = |s: Endpoint, d: Endpoint| e.execute(&s, &d, 4096).unwrap_err().to_string();
    let cases = [
        (
            Endpoint::host(&a, 62 << 10),
            Endpoint::host(&b, 0),
            "source",
        ),
        (
            Endpoint::host(&a, 0),
            Endpoint::host(&b, 62 << 10),
            "destination",
        ),
        (
            Endpoint::host(&a, 0),
            Endpoint::host(&a, 62 << 10),
            "destination",
        ),
        (
            Endpoint::host(&a, 62 << 10),
            Endpoint::host(&a, 0),
            "source",
        ),
    ];
    for (s, d, side) in cases {
        let msg = err(s, d);
        assert!(
            msg.starts_with(side) || msg.contains(&format!(" {side}")),
            "{side}: {msg}"
        );
    }
}

#[test]
fn a_request_that_cannot_be_queued_is_refused_once() {
    let e = engines();
    let mut d = sched(&e, 1, RetryPolicy::default()).unwrap();
    d.shutdown();
    let dev = e.memio().gpu(0).unwrap().alloc(16).unwrap();
    let src = host(16, 1);
    let r = Request::new(Endpoint::host(&src, 0), Endpoint::device(&dev, 0), 16).unwrap();
    let called = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c = called.clone();
    let err = d
        .submit_with(r, move |_| {
            c.store(true, std::sync::atomic::Ordering::SeqCst)
        })
        .unwrap_err();
    assert!(matches!(err, CoreError::ShutDown));
    assert!(
        !called.load(std::sync::atomic::Ordering::SeqCst),
        "callback ran too"
    );
}

#[test]
fn cancelling_one_member_of_a_coalesced_segment_runs_the_rest() {
    let e = engines();
    let d = sched(&e, 1, RetryPolicy::default()).unwrap();
    let gpu = e.memio().gpu(0).unwrap().clone();
    let dev = gpu.alloc(4 * 4096).unwrap();
    let src = host(4 * 4096, 6);
    // Block the only worker so the batch stays queued while we cancel.
    let blocker = d
        .submit(Request::new(Endpoint::host(&src, 0), Endpoint::device(&dev, 0), 16).unwrap())
        .unwrap();
    let guard = src.write();
    let reqs: Vec<Request> = (0..4)
        .map(|i| {
            Request::new(
                Endpoint::host(&src, i * 4096),
                Endpoint::device(&dev, i * 4096),
                4096,
            )
            .unwrap()
        })
        .collect();
    let batch = d.submit_batch(reqs).unwrap();
    let cancelled = batch.tickets()[2].clone();
    let others: Vec<_> = [0, 1, 3]
        .iter()
        .map(|&i| batch.tickets()[i].clone())
        .collect();
    assert!(cancelled.cancel());
    drop(guard);
    blocker.wait().unwrap();
    let err = batch.wait().unwrap_err();
    let CoreError::Batch(report) = err else {
        panic!("expected a batch error");
    };
    assert_eq!(report.failed.len(), 1);
    assert_eq!(report.failed[0].1, ErrorCode::Canceled);
    assert_eq!(report.bytes, 3 * 4096);
    assert!(others.iter().all(|t| t.status() == Status::Completed));
    assert_eq!(cancelled.status(), Status::Cancelled);
}

#[test]
fn overlapping_copies_within_one_file_are_refused() {
    let e = engines();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, vec![7u8; 10_000]).unwrap();
    let f = e
        .localio()
        .open(
            &path,
            OpenOptions {
                write: true,
                ..OpenOptions::READ
            },
        )
        .unwrap();
    let g = e.localio().open(&path, OpenOptions::READ).unwrap();
    let err = e
        .transfer(Source::File(&g, 0), Dest::File(&f, 100), 1000)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    e.transfer(Source::File(&g, 0), Dest::File(&f, 5000), 1000)
        .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// However requests are sliced and ordered, the plan covers each exactly once, segments
    /// are contiguous on both sides, and no two adjacent segments could have merged.
    #[test]
    fn plans_cover_every_request_once(cuts in proptest::collection::vec(1usize..5000, 1..40),
                                      gaps in proptest::collection::vec(0usize..3, 40),
                                      seed: u64) {
        let e = engines();
        let total: usize = cuts.iter().sum::<usize>() + 3 * 40;
        let dev = e.memio().gpu(0).unwrap().alloc(total).unwrap();
        let src = host(total, 1);
        let mut reqs = Vec::new();
        let mut off = 0;
        for (i, len) in cuts.iter().enumerate() {
            off += gaps[i];
            reqs.push(Request::new(Endpoint::host(&src, off), Endpoint::device(&dev, off), *len).unwrap());
            off += len;
        }
        // Shuffle deterministically.
        let n = reqs.len();
        for i in 0..n {
            let j = (gpuio_hal::pattern::mix64(seed ^ i as u64) as usize) % n;
            reqs.swap(i, j);
        }
        let plan = batch::plan(&reqs);
        let mut seen = vec![0; n];
        let segs: Vec<_> = plan.groups.values().flatten().collect();
        for s in &segs {
            let mut expect_src = s.src.offset();
            let mut sum = 0;
            for &m in &s.members {
                seen[m] += 1;
                prop_assert_eq!(reqs[m].src.offset(), expect_src);
                expect_src += reqs[m].len as u64;
                sum += reqs[m].len;
            }
            prop_assert_eq!(sum, s.len);
        }
        prop_assert!(seen.iter().all(|&c| c == 1));
        let expected_segments = 1 + gaps[1..n].iter().filter(|&&g| g > 0).count();
        prop_assert_eq!(segs.len(), expected_segments);
    }
}
