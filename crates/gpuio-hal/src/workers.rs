//! Running a transfer's workers (MemIO's and LocalIO's lanes, LocalIO's cuFile threads) all at
//! once on a rayon pool: [`run_workers`].
//!
//! The calling thread takes the first worker itself (no wake-up to wait for) and the others
//! are handed to the pool together, so that their threads wake in parallel: waking parked pool
//! threads one by one, as a splitting parallel iterator does, cost ~270 us per transfer on the
//! H200 machine. The threads are the pool's, started once; a transfer starts none.
//!
//! ```
//! use gpuio_hal::workers::{WorkerPanic, run_workers};
//! use std::sync::atomic::{AtomicBool, Ordering};
//!
//! #[derive(Debug)]
//! struct Failed(String);
//! impl From<WorkerPanic> for Failed {
//!     fn from(p: WorkerPanic) -> Self {
//!         Failed(p.to_string())
//!     }
//! }
//!
//! let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
//! let mut sums = vec![0u64; 3];
//! run_workers(&pool, &mut sums, |sum, _abort: &AtomicBool| {
//!     *sum = (1..=10).sum();
//!     Ok::<(), Failed>(())
//! })
//! .unwrap();
//! assert_eq!(sums, [55, 55, 55]);
//!
//! // A panic is the worker's error, and the others are told to stop.
//! let err = run_workers(&pool, &mut [0, 1], |n, abort| {
//!     if *n == 1 {
//!         panic!("lane {n} broke");
//!     }
//!     while !abort.load(Ordering::Relaxed) {
//!         std::thread::yield_now();
//!     }
//!     Ok::<(), Failed>(())
//! })
//! .unwrap_err();
//! assert!(err.0.contains("lane 1 broke"), "{err:?}");
//! ```

use crate::sync::MutexExt;
use std::any::Any;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// A worker that panicked, as the error [`run_workers`] returns for it (each crate turns it
/// into its own error type through `From`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerPanic {
    message: String,
}

impl WorkerPanic {
    fn new(payload: Box<dyn Any + Send>) -> Self {
        let message = match payload.downcast::<String>() {
            Ok(s) => *s,
            Err(payload) => match payload.downcast::<&'static str>() {
                Ok(s) => (*s).to_string(),
                Err(_) => "a panic without a message".to_string(),
            },
        };
        Self { message }
    }

    /// The panic's message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for WorkerPanic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a transfer worker panicked: {}", self.message)
    }
}

impl std::error::Error for WorkerPanic {}

/// Runs `work` on every worker at once, on `pool`'s threads and the calling one, and returns
/// when all are done. The first failure sets the abort flag each call gets (so the others stop
/// taking work) and is the result; later ones are dropped. A worker that panics fails with its
/// [`WorkerPanic`] in the caller's error type, and the others stop as for any failure: the
/// panic is not propagated.
pub fn run_workers<W, E>(
    pool: &rayon::ThreadPool,
    workers: &mut [W],
    work: impl Fn(&mut W, &AtomicBool) -> Result<(), E> + Sync,
) -> Result<(), E>
where
    W: Send,
    E: Send + From<WorkerPanic>,
{
    let Some((first, rest)) = workers.split_first_mut() else {
        return Ok(());
    };
    let run = Run::new(work);
    pool.in_place_scope(|scope| {
        for worker in rest {
            let run = &run;
            scope.spawn(move |_| run.one(worker));
        }
        run.one(first);
    });
    run.result()
}

/// What [`run_arriving_workers`] asks for while its workers run.
pub enum Arrival<W> {
    /// One more worker, to run at once.
    Worker(W),
    /// None within the wait; more may come.
    NotYet,
    /// No more will come.
    NoMore,
}

/// [`run_workers`] for workers that keep arriving while the first ones run (lanes still being
/// made for a process's first transfer): `arrive(wait)` is asked, waiting up to `wait` each
/// time, until the running workers are all done, and each worker it gives runs at once.
/// Every worker runs on `pool` (so it needs a thread for each at once); the calling thread
/// only asks for arrivals. Returns the result and every worker that ran, to keep.
pub fn run_arriving_workers<W, E>(
    pool: &rayon::ThreadPool,
    workers: Vec<W>,
    mut arrive: impl FnMut(Duration) -> Arrival<W>,
    work: impl Fn(&mut W, &AtomicBool) -> Result<(), E> + Sync,
) -> (Result<(), E>, Vec<W>)
where
    W: Send,
    E: Send + From<WorkerPanic>,
{
    let run = Run::new(work);
    let running = AtomicUsize::new(0);
    let done = Mutex::new(Vec::with_capacity(workers.len()));
    pool.in_place_scope(|scope| {
        let start = |mut worker: W| {
            running.fetch_add(1, Ordering::AcqRel);
            let (run, running, done) = (&run, &running, &done);
            scope.spawn(move |_| {
                run.one(&mut worker);
                done.lock_unpoisoned().push(worker);
                running.fetch_sub(1, Ordering::AcqRel);
            });
        };
        for w in workers {
            start(w);
        }
        while running.load(Ordering::Acquire) > 0 && !run.abort.load(Ordering::Relaxed) {
            match arrive(Duration::from_micros(200)) {
                Arrival::Worker(w) => start(w),
                Arrival::NotYet => {}
                Arrival::NoMore => break,
            }
        }
    });
    (run.result(), done.into_inner_unpoisoned())
}

/// One transfer's workers' shared state: the abort flag and the first failure.
struct Run<F, E> {
    work: F,
    /// Set by the first worker that fails, so the others stop taking work.
    abort: AtomicBool,
    failure: Mutex<Option<E>>,
}

impl<F, E> Run<F, E> {
    fn new(work: F) -> Self {
        Self {
            work,
            abort: AtomicBool::new(false),
            failure: Mutex::new(None),
        }
    }

    fn one<W>(&self, worker: &mut W)
    where
        F: Fn(&mut W, &AtomicBool) -> Result<(), E>,
        E: From<WorkerPanic>,
    {
        // AssertUnwindSafe: after a panic the worker is only dropped or given back to pools
        // that check it (a lane missing a buffer is dropped), and what the workers share is
        // behind poison-tolerant locks whose data survives a panicking holder (crate::sync).
        let result = catch_unwind(AssertUnwindSafe(|| (self.work)(worker, &self.abort)))
            .unwrap_or_else(|payload| {
                let panic = WorkerPanic::new(payload);
                tracing::error!(%panic, "a transfer worker panicked");
                Err(E::from(panic))
            });
        if let Err(e) = result {
            self.abort.store(true, Ordering::Relaxed);
            self.failure.lock_unpoisoned().get_or_insert(e);
        }
    }

    fn result(self) -> Result<(), E> {
        match self.failure.into_inner_unpoisoned() {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    enum Failed {
        At(usize),
        Panic(String),
    }

    impl From<WorkerPanic> for Failed {
        fn from(p: WorkerPanic) -> Self {
            Self::Panic(p.message().to_string())
        }
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn every_worker_runs_once_and_none_is_nothing() {
        let pool = pool(3);
        let mut none: [usize; 0] = [];
        run_workers(&pool, &mut none, |_, _| Err::<(), _>(Failed::At(0))).unwrap();
        let mut runs = vec![0usize; 7];
        run_workers(&pool, &mut runs, |n, _| {
            *n += 1;
            Ok::<(), Failed>(())
        })
        .unwrap();
        assert_eq!(runs, [1; 7]);
    }

    #[test]
    fn the_first_failure_stops_the_others_and_is_returned() {
        let pool = pool(4);
        // Work items shared by four workers; worker 2 fails on its first, the others stop
        // taking more once it has.
        let next = AtomicUsize::new(0);
        let mut ids: Vec<usize> = (0..4).collect();
        let err = run_workers(&pool, &mut ids, |id, abort| {
            while !abort.load(Ordering::Relaxed) {
                let item = next.fetch_add(1, Ordering::Relaxed);
                if item >= 1_000_000 {
                    break;
                }
                if *id == 2 {
                    return Err(Failed::At(item));
                }
                std::thread::yield_now();
            }
            Ok(())
        })
        .unwrap_err();
        assert!(matches!(err, Failed::At(_)), "{err:?}");
        assert!(
            next.load(Ordering::Relaxed) < 1_000_000,
            "the others stopped"
        );
        // Only the first of several failures is kept; a panic is one.
        let err = run_workers(&pool, &mut [0, 1, 2], |id, _| match id {
            0 => panic!("worker {id}"),
            _ => Err(Failed::At(*id)),
        })
        .unwrap_err();
        assert!(
            matches!(&err, Failed::At(1 | 2)) || err == Failed::Panic("worker 0".into()),
            "{err:?}"
        );
    }

    #[test]
    fn arriving_workers_run_beside_the_first_and_asking_ends_with_them() {
        let pool = pool(4);
        let started = AtomicUsize::new(0);
        let mut later = vec![3usize, 2];
        let (result, mut all) = run_arriving_workers(
            &pool,
            vec![1usize],
            |_| later.pop().map_or(Arrival::NotYet, Arrival::Worker),
            |w, _| {
                started.fetch_add(1, Ordering::SeqCst);
                // Worker 1 runs until the others have started: they run beside it.
                let t = std::time::Instant::now();
                while *w == 1 && started.load(Ordering::SeqCst) < 3 && t.elapsed().as_secs() < 10 {
                    std::thread::yield_now();
                }
                Ok::<(), Failed>(())
            },
        );
        result.unwrap();
        all.sort_unstable();
        assert_eq!((all, started.into_inner()), (vec![1, 2, 3], 3));
        // `NotYet` for ever: the call still returns once its workers are done.
        let (result, all) = run_arriving_workers(
            &pool,
            vec![7],
            |_| Arrival::NotYet,
            |_, _| Ok::<(), Failed>(()),
        );
        assert_eq!((result, all), (Ok(()), vec![7]));
    }
}
