//! The least a scheduler with worker threads can add to one request: the same engine call
//! handed to a thread that spins for it (a state word, and a slot the endpoints go through)
//! and its end handed back on the state word, with nothing else (no queue, ticket, budget,
//! callback or clock). The `core` suite times it
//! beside the scheduler, so that the scheduler's own share of its overhead is measured on the
//! machine that runs it: what crossing between two cores costs there is the floor.

use gpuio_core::{CoreError, Endpoint, Engines};
use gpuio_hal::sync::MutexExt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

const IDLE: u8 = 0;
const JOB: u8 = 1;
const DONE: u8 = 2;
const FAILED: u8 = 3;
const STOP: u8 = 4;

/// One job at a time: its state word and the endpoints, and why the last one failed (read
/// only after a failure).
#[repr(align(64))]
struct Slot {
    state: AtomicU8,
    job: Mutex<Option<(Endpoint, Endpoint, usize)>>,
    failure: Mutex<Option<CoreError>>,
}

/// A thread that runs engine calls handed to it ([`Relay::run`]); it spins while it lives.
pub struct Relay {
    slot: Arc<Slot>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    /// Starts the thread over `engines`.
    pub fn start(engines: Engines) -> std::io::Result<Self> {
        let slot = Arc::new(Slot {
            state: AtomicU8::new(IDLE),
            job: Mutex::new(None),
            failure: Mutex::new(None),
        });
        let s = slot.clone();
        let thread = std::thread::Builder::new()
            .name("gpuio-bench-relay".into())
            .spawn(move || {
                loop {
                    match s.state.load(Ordering::Acquire) {
                        JOB => {
                            let job = s.job.lock_unpoisoned().take();
                            // A panicking engine fails the call rather than leave `run`
                            // spinning on a thread that is gone.
                            let done = std::panic::catch_unwind(AssertUnwindSafe(|| {
                                let (src, dst, len) = job.ok_or_else(|| {
                                    CoreError::Internal("a relay job without endpoints".into())
                                })?;
                                engines.execute(&src, &dst, len).map(drop)
                            }))
                            .unwrap_or_else(|_| {
                                Err(CoreError::Internal("the engine call panicked".into()))
                            });
                            let state = match done {
                                Ok(()) => DONE,
                                Err(e) => {
                                    *s.failure.lock_unpoisoned() = Some(e);
                                    FAILED
                                }
                            };
                            s.state.store(state, Ordering::Release);
                        }
                        STOP => return,
                        _ => std::hint::spin_loop(),
                    }
                }
            })?;
        Ok(Self {
            slot,
            thread: Some(thread),
        })
    }

    /// Hands `len` bytes from `src` to `dst` to the thread and spins until it has run them;
    /// the engine call's error where it failed. One call at a time (`&mut`): the slot holds
    /// one job.
    pub fn run(&mut self, src: Endpoint, dst: Endpoint, len: usize) -> Result<(), CoreError> {
        *self.slot.job.lock_unpoisoned() = Some((src, dst, len));
        self.slot.state.store(JOB, Ordering::Release);
        let end = loop {
            match self.slot.state.load(Ordering::Acquire) {
                JOB => std::hint::spin_loop(),
                s => break s,
            }
        };
        // Only a failure takes the lock: a success stays the bare hand-off and back.
        let failure = (end != DONE).then(|| self.slot.failure.lock_unpoisoned().take());
        self.slot.state.store(IDLE, Ordering::Release);
        match failure {
            None => Ok(()),
            Some(Some(e)) => Err(e),
            Some(None) => Err(CoreError::Internal("the relay stopped".into())),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.slot.state.store(STOP, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuio_api::{Config, Session};
    use gpuio_core::HostMemory;
    use gpuio_hal::{HostAllocOptions, HostBuffer};

    #[test]
    fn the_relay_runs_the_call_it_is_handed() {
        let session = Session::new(Config::default()).unwrap();
        let mem = |fill: u8| {
            let mut b = HostBuffer::alloc(8192, &HostAllocOptions::default()).unwrap();
            b.as_mut_slice().fill(fill);
            HostMemory::new(b)
        };
        let (src, dst) = (mem(7), mem(0));
        let mut relay = Relay::start(session.engines().clone()).unwrap();
        for off in [0, 4096] {
            relay
                .run(Endpoint::host(&src, off), Endpoint::host(&dst, off), 4096)
                .unwrap();
        }
        assert!(dst.read().iter().all(|&b| b == 7));
        // A call past the end fails with the engine's own error; the relay runs on.
        let e = relay
            .run(Endpoint::host(&src, 8192), Endpoint::host(&dst, 0), 4096)
            .unwrap_err();
        assert!(!matches!(e, CoreError::Internal(_)), "{e}");
        relay
            .run(Endpoint::host(&dst, 0), Endpoint::host(&src, 0), 8192)
            .unwrap();
    }
}
