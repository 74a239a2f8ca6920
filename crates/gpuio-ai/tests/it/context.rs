//! The AI context: AI work mapped onto priority classes and deadlines, requests submitted
//! through the session's scheduler landing their bytes, and sequences opened and closed.

use gpuio_ai::kv::KvPoolConfig;
use gpuio_ai::{AiContext, AiWork, Criticality, InferenceQos};
use gpuio_api::{Config, Endpoint, HostPlacement, Priority, Session};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn inference(deadline_ms: u64, compute_ms: u64, criticality: Criticality) -> AiWork {
    AiWork::Inference(InferenceQos {
        deadline: Duration::from_millis(deadline_ms),
        estimated_duration: Duration::from_millis(compute_ms),
        criticality,
    })
}

#[test]
fn work_maps_to_classes_and_deadlines() {
    let now = Instant::now();
    let classes = [
        (
            inference(50, 20, Criticality::Standard),
            Priority::InferenceRealtime,
        ),
        (
            inference(50, 20, Criticality::BestEffort),
            Priority::TrainingForward,
        ),
        (
            AiWork::TrainingStep { backward: false },
            Priority::TrainingForward,
        ),
        (
            AiWork::TrainingStep { backward: true },
            Priority::TrainingBackward,
        ),
        (AiWork::Checkpoint, Priority::Checkpoint),
        (AiWork::EngramSync, Priority::EngramSync),
        (AiWork::Prefetch, Priority::Background),
    ];
    for (work, class) in classes {
        assert_eq!(work.priority(), class, "{work:?}");
    }
    assert_eq!(
        inference(50, 20, Criticality::Standard)
            .io_deadline(now)
            .unwrap(),
        Some(now + Duration::from_millis(30))
    );
    assert_eq!(AiWork::Checkpoint.io_deadline(now).unwrap(), None);
    assert!(
        inference(10, 20, Criticality::Standard)
            .io_deadline(now)
            .is_err()
    );
}

#[test]
fn requests_carry_their_class_and_land_their_bytes() {
    let session = Arc::new(Session::new(Config::default()).unwrap());
    let mut ctx = AiContext::new(session.clone());
    let dram = HostPlacement::Dram { numa: None };
    let src = session.alloc_host(dram, 1 << 20, false).unwrap();
    src.write()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    let dst = session.alloc_host(dram, 1 << 20, false).unwrap();
    let work = inference(5000, 10, Criticality::Standard);
    let req = ctx
        .request(
            &work,
            Endpoint::host(&src, 0),
            Endpoint::host(&dst, 0),
            1 << 20,
        )
        .unwrap();
    assert_eq!(req.priority, Priority::InferenceRealtime);
    assert!(req.deadline.is_some());
    let done = ctx
        .submit(
            &work,
            Endpoint::host(&src, 0),
            Endpoint::host(&dst, 0),
            1 << 20,
        )
        .unwrap();
    done.wait().unwrap();
    assert!(dst.read()[..] == src.read()[..]);
    // Sequences: opened once, found, closed.
    let cfg = KvPoolConfig {
        layers: 1,
        entry_bytes: 64,
        max_tokens: 100,
        warm_entries: 100,
        hot_slots: 8,
        max_selection: 4,
        gpu: 0,
        placement: dram,
    };
    ctx.open_sequence(7, cfg).unwrap();
    assert!(ctx.open_sequence(7, cfg).is_err());
    assert!(ctx.sequence(7).is_some());
    assert!(ctx.close_sequence(7));
    assert!(ctx.sequence(7).is_none());
}

/// A session whose scheduler holds less urgent work back for as long as 30 s (the starvation
/// bound), under `policy`.
fn patient(policy: gpuio_api::Policy) -> Arc<Session> {
    let mut cfg = Config::default();
    cfg.scheduler.policy = policy;
    cfg.scheduler.max_wait_us = 30_000_000;
    Arc::new(Session::new(cfg).unwrap())
}

fn done_within(p: &gpuio_ai::engram::Pending<gpuio_ai::engram::Lookup>, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if p.is_done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

#[test]
fn the_tiers_io_runs_in_its_class() {
    let session = patient(gpuio_api::Policy::Deadline);
    let dram = HostPlacement::Dram { numa: None };
    let table = gpuio_ai::engram::EngramTable::new(&session, 64, 32, dram).unwrap();
    table
        .memory()
        .write()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 251) as u8);
    let dst = session.alloc_device(0, 64 * 32).unwrap();
    let ids: Vec<u64> = (0..64).rev().collect();
    // A decode step holds the realtime class: a prefetch (background) waits for it, and a
    // lookup of the decode's own class does not.
    let step = session.lease(Priority::InferenceRealtime, None);
    let prefetch = table
        .prefetch(&session, ids.clone(), dst.clone(), 0)
        .unwrap();
    assert_eq!(prefetch.work().priority(), Priority::Background);
    assert!(
        !done_within(&prefetch, Duration::from_millis(300)),
        "a prefetch ran during a realtime lease"
    );
    let other = session.alloc_device(0, 32).unwrap();
    let r = table.lookup(&session, &[5], &other, 0).unwrap();
    assert_eq!(r.rows, 1);
    drop(step);
    assert!(done_within(&prefetch, Duration::from_secs(10)));
    assert_eq!(prefetch.wait().unwrap().rows, 64);
    let mut got = vec![0u8; 64 * 32];
    session.download(&dst, 0, &mut got).unwrap();
    let table_bytes = table.memory().read().to_vec();
    for (i, &id) in ids.iter().enumerate() {
        let at = id as usize * 32;
        assert_eq!(got[i * 32..][..32], table_bytes[at..at + 32], "row {i}");
    }
    // Under FIFO the classes are off: the prefetch is not held back.
    let session = patient(gpuio_api::Policy::Fifo);
    let table = gpuio_ai::engram::EngramTable::new(&session, 64, 32, dram).unwrap();
    let dst = session.alloc_device(0, 64 * 32).unwrap();
    let _step = session.lease(Priority::InferenceRealtime, None);
    let prefetch = table.prefetch(&session, ids, dst, 0).unwrap();
    assert!(done_within(&prefetch, Duration::from_secs(10)));
}

#[test]
fn a_pool_counts_its_deadlines_in_the_schedulers_statistics() {
    let session = patient(gpuio_api::Policy::Deadline);
    let dram = HostPlacement::Dram { numa: None };
    let cfg = KvPoolConfig {
        layers: 1,
        entry_bytes: 64,
        max_tokens: 16,
        warm_entries: 16,
        hot_slots: 8,
        max_selection: 4,
        gpu: 0,
        placement: dram,
    };
    let mut pool = gpuio_ai::kv::KvPool::new(&session, cfg).unwrap();
    assert_eq!(pool.work(), AiWork::Decode);
    let src = session.alloc_device(0, 16 * 64).unwrap();
    pool.store(&session, 0, 0, 16, &src, 0, None).unwrap();
    let before = session.scheduler().stats();
    pool.set_work(inference(60_000, 1, Criticality::Standard))
        .unwrap();
    // Work that leaves no time for IO is refused, and the pool keeps what it had.
    assert!(
        pool.set_work(inference(1, 5, Criticality::Standard))
            .is_err()
    );
    let out = session.alloc_device(0, 4 * 64).unwrap();
    pool.load(0, &[1, 2, 3], &out, 0).unwrap();
    let after = session.scheduler().stats();
    assert_eq!(after.deadline_met - before.deadline_met, 1);
}
