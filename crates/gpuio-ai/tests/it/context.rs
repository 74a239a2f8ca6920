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
