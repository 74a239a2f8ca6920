//! Leases on the running scheduler: while IO of a class runs outside the workers (a lease),
//! queued units and leases of less urgent classes wait for it — at most `max_wait` — and
//! more urgent ones do not; under FIFO nothing waits.

use crate::common;

use common::{engines, host, sched_with, zeroed};
use gpuio_core::*;
use gpuio_hal::pattern;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn scheduler(policy: Policy, max_wait: Duration) -> Scheduler {
    let cfg = SchedulerConfig {
        workers: 2,
        policy,
        max_wait,
        ..SchedulerConfig::default()
    };
    sched_with(&engines(), cfg, RetryPolicy::NONE).unwrap()
}

fn copy(s: &Scheduler, class: Priority) -> (RequestHandle, HostMemory) {
    let (src, dst) = (host(64 << 10, 5), zeroed(64 << 10));
    let req = Request::new(Endpoint::host(&src, 0), Endpoint::host(&dst, 0), 64 << 10)
        .unwrap()
        .with_priority(class);
    (s.submit(req).unwrap(), dst)
}

fn finishes_within(h: &RequestHandle, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    while Instant::now() < until {
        if h.status().is_final() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

#[test]
fn a_lease_holds_back_less_urgent_queued_work_and_lets_more_urgent_through() {
    let s = scheduler(Policy::Deadline, Duration::from_secs(30));
    let lease = s.lease(Priority::TrainingForward, None);
    assert_eq!(lease.class(), Priority::TrainingForward);
    let (background, bg_dst) = copy(&s, Priority::Background);
    let (realtime, rt_dst) = copy(&s, Priority::InferenceRealtime);
    let (same, _) = copy(&s, Priority::TrainingForward);
    assert!(finishes_within(&realtime, Duration::from_secs(10)));
    assert!(finishes_within(&same, Duration::from_secs(10)));
    assert_eq!(pattern::first_deviation(&rt_dst.read(), 0, 5), None);
    assert!(
        !finishes_within(&background, Duration::from_millis(200)),
        "a background request ran while a more urgent lease was held"
    );
    drop(lease);
    assert!(finishes_within(&background, Duration::from_secs(10)));
    background.wait().unwrap();
    assert_eq!(pattern::first_deviation(&bg_dst.read(), 0, 5), None);
}

#[test]
fn held_back_work_waits_at_most_max_wait() {
    let s = scheduler(Policy::Priority, Duration::from_millis(50));
    let _lease = s.lease(Priority::InferenceRealtime, None);
    let start = Instant::now();
    let (background, _) = copy(&s, Priority::Background);
    background.wait().unwrap();
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(40) && waited < Duration::from_secs(5),
        "waited {waited:?}"
    );
    // A less urgent lease is admitted after max_wait too.
    let start = Instant::now();
    let late = s.lease(Priority::Checkpoint, None);
    assert!(start.elapsed() >= Duration::from_millis(40));
    drop(late);
}

#[test]
fn a_less_urgent_lease_waits_for_a_more_urgent_one() {
    let s = std::sync::Arc::new(scheduler(Policy::Deadline, Duration::from_secs(30)));
    let realtime = s.lease(Priority::InferenceRealtime, None);
    let (tx, rx) = mpsc::channel();
    let s2 = s.clone();
    let t = std::thread::spawn(move || {
        let l = s2.lease(Priority::Background, None);
        tx.send(Instant::now()).unwrap();
        drop(l);
    });
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
    // A more urgent or equal one is not held up.
    drop(s.lease(Priority::InferenceRealtime, None));
    let released = Instant::now();
    drop(realtime);
    let admitted = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(admitted >= released);
    t.join().unwrap();
}

#[test]
fn less_urgent_work_waits_out_the_linger_of_a_more_urgent_lease() {
    let cfg = SchedulerConfig {
        workers: 2,
        policy: Policy::Priority,
        max_wait: Duration::from_secs(30),
        lease_linger: Duration::from_millis(300),
        ..SchedulerConfig::default()
    };
    let s = sched_with(&engines(), cfg, RetryPolicy::NONE).unwrap();
    drop(s.lease(Priority::InferenceRealtime, None));
    let ended = Instant::now();
    // As urgent a class is not held: the linger is for the less urgent.
    drop(s.lease(Priority::InferenceRealtime, None));
    assert!(ended.elapsed() < Duration::from_millis(250));
    let realtime_again = Instant::now();
    let late = s.lease(Priority::Background, None);
    let waited = realtime_again.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(10),
        "a background lease waited {waited:?} after a realtime one ended"
    );
    drop(late);
    // Long after, nothing lingers.
    std::thread::sleep(Duration::from_millis(350));
    let start = Instant::now();
    drop(s.lease(Priority::Checkpoint, None));
    assert!(start.elapsed() < Duration::from_millis(250));

    // Queued units of a less urgent class wait out the linger too.
    let realtime = s.lease(Priority::InferenceRealtime, None);
    let (background, dst) = copy(&s, Priority::Background);
    drop(realtime);
    let ended = Instant::now();
    assert!(
        !finishes_within(&background, Duration::from_millis(200)),
        "a background request ran within a realtime lease's linger"
    );
    background.wait().unwrap();
    assert!(ended.elapsed() >= Duration::from_millis(250));
    assert_eq!(pattern::first_deviation(&dst.read(), 0, 5), None);
}

#[test]
fn fifo_leases_hold_nothing_back_and_deadlines_are_counted() {
    let s = scheduler(Policy::Fifo, Duration::from_secs(30));
    let _realtime = s.lease(Priority::InferenceRealtime, None);
    let (background, _) = copy(&s, Priority::Background);
    assert!(finishes_within(&background, Duration::from_secs(10)));
    let start = Instant::now();
    drop(s.lease(Priority::Background, None));
    assert!(start.elapsed() < Duration::from_secs(1));

    let before = s.stats();
    drop(s.lease(
        Priority::InferenceRealtime,
        Some(Instant::now() + Duration::from_secs(60)),
    ));
    drop(s.lease(Priority::InferenceRealtime, Some(Instant::now())));
    let after = s.stats();
    assert_eq!(after.deadline_met - before.deadline_met, 1);
    assert_eq!(after.deadline_missed - before.deadline_missed, 1);
}
