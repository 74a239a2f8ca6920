//! What only the crate can see of the scheduler: the tickets' lifetimes.

use super::Scheduler;
use super::ticket::TicketInner;
use crate::endpoint::{Endpoint, HostMemory};
use crate::engine::Engines;
use crate::request::{Request, Status};
use crate::retry::RetryPolicy;
use crate::sched::SchedulerConfig;
use gpuio_hal::{BackendPreference, HostAllocOptions, HostBuffer, pattern, probe};
use gpuio_transport_localio::{LocalIo, LocalIoConfig};
use gpuio_transport_memio::{MemIo, MemIoConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

fn engines() -> Engines {
    let p = probe(BackendPreference::Host).unwrap();
    let memio = MemIo::new(p.gpus, MemIoConfig::default()).unwrap();
    let localio = LocalIo::new(LocalIoConfig::default()).unwrap();
    Engines::new(Arc::new(memio), Arc::new(localio))
}

fn memory(len: usize, seed: Option<u64>) -> HostMemory {
    let mut b = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    if let Some(seed) = seed {
        pattern::fill(&mut b, 0, seed);
    }
    HostMemory::new(b)
}

/// Workers hand settled tickets back to be freed by a submitting thread; none stay behind:
/// once the workers sleep, every finished request's ticket is gone, with no further
/// submission.
#[test]
fn settled_tickets_are_let_go() {
    let cfg = SchedulerConfig {
        workers: 2,
        ..SchedulerConfig::default()
    };
    let s = Scheduler::new(engines(), cfg, RetryPolicy::NONE).unwrap();
    let (src, dst) = (memory(1 << 20, Some(3)), memory(1 << 20, None));
    let reqs: Vec<Request> = (0..256)
        .map(|i| {
            let (s, d) = (
                Endpoint::host(&src, i * 4096),
                Endpoint::host(&dst, i * 4096),
            );
            Request::new(s, d, 4096).unwrap()
        })
        .collect();
    let done = Arc::new(AtomicU64::new(0));
    let d = done.clone();
    let tickets = s
        .submit_each(reqs, move |r| {
            assert!(r.is_ok());
            d.fetch_add(1, Ordering::AcqRel);
        })
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while done.load(Ordering::Acquire) < 256 {
        assert!(Instant::now() < until, "requests never finished");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(tickets.iter().all(|t| t.status() == Status::Completed));
    let kept: Vec<Weak<TicketInner>> = tickets.iter().map(|t| Arc::downgrade(&t.inner)).collect();
    drop(tickets);
    // A worker may still be between a completion and going idle.
    while kept.iter().any(|t| t.strong_count() > 0) {
        assert!(Instant::now() < until, "settled tickets were kept");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(pattern::first_deviation(&dst.read(), 0, 3), None);
}
