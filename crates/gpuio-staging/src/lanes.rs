//! A transport's cached lanes: [`LaneSet`] keeps the idle lanes of one GPU between transfers
//! and is the [`StagingHolder`] the pool asks for them; [`StagingLane`] is what a transport's
//! lane type tells it (how one is made from leased buffers, whether it came back whole, its
//! lease). MemIO's pipeline lanes and LocalIO's io_uring lanes are both kept in one.
//!
//! Pinning (and, for an io_uring ring, registering) staging memory costs milliseconds, so a
//! lane leases its buffers once, when it is made, and keeps them while it is idle here; they
//! go back to the pool only when the lane goes (one that came back broken, the pool asking for
//! idle buffers, the set dropped). A transfer takes its lanes once and gives them back once:
//! nothing here is locked or allocated per chunk, and nothing per transfer once its lanes
//! exist.

use crate::{StagingHolder, StagingLease, StagingPool};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::workers::{Arrival, WorkerPanic, run_arriving_workers, run_workers};
use gpuio_hal::{Gpu, HalError, HostBuffer};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How long a transfer that can get no lane at all waits for the staging pool to have room
/// (other transfers' lanes coming back) before it fails with `Busy`.
pub const LANE_WAIT: Duration = Duration::from_secs(60);

/// A lane kept in a [`LaneSet`]: a worker's staging buffers, leased from a [`StagingPool`],
/// with whatever the transport pairs them with (a stream, an IO queue).
///
/// The lane owns its [`StagingLease`] and gives its buffers back through it when it drops,
/// after undoing anything that still ties them (an io_uring ring's registration): a set drops
/// the lanes it lets go of, outside its lock.
pub trait StagingLane: Send + Sized + 'static {
    /// What every lane of a set is made with besides its buffers (an IO engine, a ring's
    /// depth; `()` where the GPU is enough).
    type Spec: Send + Sync + 'static;
    /// The transport's error, which the pool's errors convert into.
    type Error: From<HalError> + Send + std::fmt::Display;

    /// A lane of `gpu` over `buffers`, freshly leased with `lease`. Where it cannot be made,
    /// the buffers go back through the lease (or are dropped, which the lease then counts as
    /// gone) and the error is returned.
    fn make(
        spec: &Self::Spec,
        gpu: &Gpu,
        buffers: Vec<HostBuffer>,
        lease: StagingLease,
    ) -> Result<Self, Self::Error>;

    /// Whether the lane came back from a transfer fit to keep: all `buffers` of its staging
    /// in hand and nothing of its own still in flight. One that lost a buffer to an error is
    /// dropped instead.
    fn is_whole(&self, buffers: usize) -> bool;

    /// The lease of the lane's staging buffers (`None` once its drop has given them back).
    fn lease(&self) -> Option<&StagingLease>;

    /// Staging bytes the lane holds.
    fn staged_bytes(&self) -> u64 {
        self.lease().map_or(0, StagingLease::bytes)
    }
}

/// Lanes being made for a transfer, each sent when ready (or why it could not be made);
/// `None` where none are.
type Arriving<L> = Option<Receiver<Result<L, <L as StagingLane>::Error>>>;

/// The lanes of one GPU, made on demand from a [`StagingPool`] and kept idle between
/// transfers; registered with the pool as a [`StagingHolder`] of its idle lanes.
pub struct LaneSet<L: StagingLane> {
    gpu: Gpu,
    buffer_len: usize,
    buffers: usize,
    staging: StagingPool,
    spec: L::Spec,
    idle: Mutex<Vec<L>>,
}

impl<L: StagingLane> LaneSet<L> {
    /// A set of `gpu`'s lanes of `buffers` staging buffers of `buffer_len` bytes each (at
    /// least two buffers: a lane fills one while another's copy runs), leased from `staging`
    /// and made with `spec`; registered with `staging` as a holder of its idle lanes.
    pub fn new(
        gpu: Gpu,
        staging: StagingPool,
        buffer_len: usize,
        buffers: usize,
        spec: L::Spec,
    ) -> Arc<Self> {
        let set = Arc::new(Self {
            gpu,
            buffer_len,
            buffers: buffers.max(2),
            staging,
            spec,
            idle: Mutex::new(Vec::new()),
        });
        let holder: Weak<dyn StagingHolder> = Arc::downgrade(&set) as Weak<Self>;
        set.staging.add_holder(holder);
        set
    }

    /// The bytes of each staging buffer of a lane.
    pub fn buffer_len(&self) -> usize {
        self.buffer_len
    }

    /// Takes up to `n` lanes, creating the missing ones; at least one. The first lane a
    /// transfer makes may wait for room in the staging pool (up to [`LANE_WAIT`]), and takes
    /// other holders' idle buffers if it must; further ones are made only from room the pool
    /// has, so that where it is short a transfer runs on fewer lanes rather than tear down
    /// the lanes others keep. Staging memory lives on the GPU's NUMA node where the GPU
    /// reports one.
    pub fn take(self: &Arc<Self>, n: usize) -> Result<Vec<L>, L::Error> {
        let (mut taken, arriving) = self.take_arriving(n)?;
        let mut failed = None;
        for lane in arriving.into_iter().flatten() {
            match lane {
                Ok(lane) => taken.push(lane),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        if let Some(e) = failed {
            // Keep the lanes that exist for the next transfer.
            self.give_back(taken);
            return Err(e);
        }
        if taken.len() < n {
            tracing::debug!(
                lanes = taken.len(),
                wanted = n,
                "staging pool short: fewer lanes"
            );
        }
        Ok(taken)
    }

    /// Runs `work` on up to `n` lanes on `threads` and gives them back: the lanes idle now
    /// (or the one made first) start at once, and those still being made (pinning staging
    /// costs milliseconds a lane: a process's first transfers) join as each is ready, while
    /// work remains. Returns how many lanes were started (a lane that arrives as the work runs
    /// out starts and finds none). A lane that cannot be made is left out, logged at debug
    /// level, where [`take`](Self::take) fails: a transfer runs on fewer lanes rather than not
    /// at all (the first lane's failure still fails it).
    pub fn run(
        self: &Arc<Self>,
        n: usize,
        threads: &rayon::ThreadPool,
        work: impl Fn(&mut L, &AtomicBool) -> Result<(), L::Error> + Sync,
    ) -> Result<usize, L::Error>
    where
        L::Error: From<WorkerPanic>,
    {
        let (mut ready, arriving) = self.take_arriving(n)?;
        let (result, ran) = match &arriving {
            None => {
                let result = run_workers(threads, &mut ready, work);
                (result, ready)
            }
            Some(making) => {
                let next = |wait| match making.recv_timeout(wait) {
                    Ok(Ok(lane)) => Arrival::Worker(lane),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "a lane could not be made: fewer lanes");
                        Arrival::NotYet
                    }
                    Err(RecvTimeoutError::Timeout) => Arrival::NotYet,
                    Err(RecvTimeoutError::Disconnected) => Arrival::NoMore,
                };
                run_arriving_workers(threads, ready, next, work)
            }
        };
        // Lanes still being made are waited for (the transfer is done; its caller waits no
        // longer than all lanes up front would have made it) and stay idle here for the next
        // transfer: nothing outlives the call.
        let late = arriving.into_iter().flatten().filter_map(Result::ok);
        let count = ran.len();
        self.give_back(ran.into_iter().chain(late).collect());
        result.map(|()| count)
    }

    /// The lanes idle now (at most `n`; where there are none, one made here), and, where
    /// that is fewer than `n`, a channel on which the missing ones arrive, each made on a
    /// thread of its own (side by side: a process's first transfer would otherwise wait for
    /// them lane after lane). A lane made after the channel is dropped stays idle in the
    /// set. With all lanes idle nothing is allocated.
    fn take_arriving(self: &Arc<Self>, n: usize) -> Result<(Vec<L>, Arriving<L>), L::Error> {
        let asked = Instant::now();
        let mut taken = {
            let mut idle = self.idle.lock_unpoisoned();
            let keep = idle.len().saturating_sub(n);
            idle.split_off(keep)
        };
        if taken.is_empty() {
            taken.extend(self.new_lane(false)?);
        }
        if taken.len() >= n {
            return Ok((taken, None));
        }
        let (tx, rx) = mpsc::channel();
        for _ in taken.len()..n {
            let (set, tx) = (self.clone(), tx.clone());
            let make = move || {
                let made = set.new_lane(true).transpose();
                tracing::debug!(
                    ms = asked.elapsed().as_secs_f64() * 1e3,
                    outcome = match &made {
                        Some(Ok(_)) => "made",
                        Some(Err(_)) => "failed",
                        None => "no room in the staging pool",
                    },
                    "lane for a waiting transfer"
                );
                if let Some(Err(mpsc::SendError(Ok(lane)))) = made.map(|l| tx.send(l)) {
                    set.give_back(vec![lane]);
                }
            };
            if let Err(e) = std::thread::Builder::new()
                .name("gpuio-lane-make".into())
                .spawn(make)
            {
                // No thread to make it on: fewer lanes.
                tracing::debug!(error = %e, "no thread to make a lane on");
                break;
            }
        }
        Ok((taken, Some(rx)))
    }

    /// A new lane; `spare`: only from room the pool has now (`None` where it has none).
    fn new_lane(&self, spare: bool) -> Result<Option<L>, L::Error> {
        let (gpu, len, count) = (&self.gpu, self.buffer_len, self.buffers);
        let leased = if spare {
            self.staging.lease_spare_for(gpu, len, count)?
        } else {
            Some(self.staging.lease_for(gpu, len, count, LANE_WAIT)?)
        };
        let Some((buffers, lease)) = leased else {
            return Ok(None);
        };
        L::make(&self.spec, gpu, buffers, lease).map(Some)
    }

    /// Returns lanes to the set; one that is not whole ([`StagingLane::is_whole`]) is dropped
    /// (giving back what it has). While a request of the staging pool waits for room, the
    /// idle lanes go back to the staging pool instead of waiting here.
    pub fn give_back(&self, lanes: Vec<L>) {
        let whole: Vec<L> = lanes
            .into_iter()
            .filter(|l| l.is_whole(self.buffers))
            .collect();
        self.idle.lock_unpoisoned().extend(whole);
        // Asked after the lanes are idle here: a request that starts waiting later counts
        // itself a waiter before it asks this set for idle lanes, so either it finds them
        // or this sees it.
        if self.staging.is_waited_on() {
            self.release_idle(u64::MAX);
        }
    }

    /// Idle lanes.
    pub fn idle(&self) -> usize {
        self.idle.lock_unpoisoned().len()
    }

    /// Pinned staging memory held by idle lanes, in bytes.
    pub fn staged_bytes(&self) -> u64 {
        let idle = self.idle.lock_unpoisoned();
        idle.iter().map(L::staged_bytes).sum()
    }
}

impl<L: StagingLane> StagingHolder for LaneSet<L> {
    fn release_idle(&self, wanted: u64) -> u64 {
        let gone: Vec<L> = {
            let mut idle = self.idle.lock_unpoisoned();
            // The longest idle first (lanes are taken from the end).
            let (mut n, mut bytes) = (0, 0);
            while n < idle.len() && bytes < wanted {
                bytes += idle[n].staged_bytes();
                n += 1;
            }
            idle.drain(..n).collect()
        };
        let bytes = gone.iter().map(L::staged_bytes).sum();
        // Outside the lock: each lane undoes what ties its buffers and gives them back to the
        // staging pool as it drops.
        drop(gone);
        bytes
    }
}

impl<L: StagingLane> std::fmt::Debug for LaneSet<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneSet")
            .field("buffer_len", &self.buffer_len)
            .field("buffers", &self.buffers)
            .field("idle", &self.idle())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolConfig;
    use gpuio_hal::{BackendPreference, Result, probe};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Instant;

    const LEN: usize = 4 << 10;
    /// Staging bytes of one lane of the sets below (two buffers of the smallest class).
    const LANE: u64 = 2 * LEN as u64;

    /// What the fake lanes are made with: a count of the lanes made, and a switch that makes
    /// the next ones fail.
    #[derive(Default)]
    struct Spec {
        made: AtomicUsize,
        fail: AtomicBool,
    }

    /// A lane as a transport's: its buffers and their lease, given back together when it
    /// drops (`None` once given back).
    struct Fake(Option<(Vec<HostBuffer>, StagingLease)>);

    impl Drop for Fake {
        fn drop(&mut self) {
            if let Some((buffers, lease)) = self.0.take() {
                lease.give_back(buffers);
            }
        }
    }

    /// A transport's error: the pool's, a worker's panic, or a lane not made.
    #[derive(Debug)]
    struct Failed(String);

    impl From<HalError> for Failed {
        fn from(e: HalError) -> Self {
            Self(e.to_string())
        }
    }

    impl From<WorkerPanic> for Failed {
        fn from(p: WorkerPanic) -> Self {
            Self(p.to_string())
        }
    }

    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl StagingLane for Fake {
        type Spec = Spec;
        type Error = Failed;

        fn make(
            s: &Spec,
            _: &Gpu,
            bufs: Vec<HostBuffer>,
            lease: StagingLease,
        ) -> Result<Self, Failed> {
            if s.fail.load(Ordering::SeqCst) {
                lease.give_back(bufs);
                return Err(Failed("no lane today".into()));
            }
            s.made.fetch_add(1, Ordering::SeqCst);
            Ok(Self(Some((bufs, lease))))
        }

        fn is_whole(&self, buffers: usize) -> bool {
            self.0.as_ref().is_some_and(|(b, _)| b.len() == buffers)
        }

        fn lease(&self) -> Option<&StagingLease> {
            self.0.as_ref().map(|(_, lease)| lease)
        }
    }

    /// A pool with room for `lanes` lanes on the host backend, and `sets` sets of lanes that
    /// draw from it (each asks for one buffer a lane: it gets two, the least there is).
    fn sets(lanes: u64, sets: usize) -> (StagingPool, Vec<Arc<LaneSet<Fake>>>) {
        let gpu = probe(BackendPreference::Host).unwrap().gpus.remove(0);
        let pool = StagingPool::new(PoolConfig {
            limit: lanes * LANE,
            min_class: LEN,
            max_class: 64 << 10,
            huge_pages: false,
            gpu: Some(gpu.clone()),
            ..PoolConfig::default()
        })
        .unwrap();
        let sets = (0..sets)
            .map(|_| LaneSet::new(gpu.clone(), pool.clone(), LEN, 1, Spec::default()))
            .collect();
        (pool, sets)
    }

    #[test]
    fn lanes_are_made_once_kept_idle_and_dropped_when_broken() {
        let (pool, sets) = sets(4, 1);
        let set = &sets[0];
        let lanes = set.take(3).unwrap();
        assert_eq!(lanes.len(), 3);
        assert!(lanes.iter().all(|l| l.is_whole(2)));
        set.give_back(lanes);
        assert_eq!((set.idle(), set.staged_bytes()), (3, 3 * LANE));
        // Idle lanes serve the next transfer: nothing made, nothing leased.
        let before = pool.stats();
        let mut lanes = set.take(2).unwrap();
        assert_eq!(set.spec.made.load(Ordering::SeqCst), 3);
        assert_eq!(pool.stats(), before);
        assert_eq!(set.idle(), 1);
        // A lane that lost a buffer is dropped on return; what it has goes back to the pool.
        drop(lanes[0].0.as_mut().and_then(|(b, _)| b.pop()));
        set.give_back(lanes);
        assert_eq!((set.idle(), set.staged_bytes()), (2, 2 * LANE));
        let s = pool.stats();
        assert_eq!(s.in_use_bytes, 2 * LANE, "{s:?}");
        assert_eq!(
            s.pinned_bytes,
            3 * LANE - LEN as u64,
            "the lost buffer is gone: {s:?}"
        );
        // Asked for room, the longest idle lanes go first, as many as cover what is wanted.
        assert_eq!(set.release_idle(1), LANE);
        assert_eq!(set.idle(), 1);
        assert_eq!(set.release_idle(u64::MAX), LANE);
        assert_eq!((set.idle(), pool.stats().in_use_bytes), (0, 0));
    }

    #[test]
    fn a_run_starts_on_the_first_lane_and_keeps_every_lane_made_for_it() {
        let (pool, made) = sets(4, 1);
        let set = &made[0];
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let calls = AtomicUsize::new(0);
        let ran = set
            .run(3, &threads, |_, _| {
                calls.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
                Ok(())
            })
            .unwrap();
        assert!((1..=3).contains(&ran) && calls.into_inner() == ran, "{ran}");
        // Every lane made for it is idle afterwards, and the next run takes them all.
        assert_eq!((set.idle(), set.spec.made.load(Ordering::SeqCst)), (3, 3));
        assert_eq!(set.run(3, &threads, |_, _| Ok(())).unwrap(), 3);
        assert_eq!(pool.stats().failures, 0);
        // A lane that cannot be made leaves the run on fewer; the first one's failure fails it.
        let (_pool, failing) = sets(4, 1);
        failing[0].spec.fail.store(true, Ordering::SeqCst);
        assert!(failing[0].run(2, &threads, |_, _| Ok(())).is_err());
    }

    #[test]
    fn a_failed_lane_gives_back_what_the_transfer_took() {
        let (pool, sets) = sets(4, 1);
        let set = &sets[0];
        set.give_back(set.take(1).unwrap());
        set.spec.fail.store(true, Ordering::SeqCst);
        assert!(matches!(set.take(2), Err(Failed(m)) if m == "no lane today"));
        // The idle lane taken is idle again; the failed lane's buffers are back in the pool.
        assert_eq!(set.idle(), 1);
        assert_eq!(pool.stats().in_use_bytes, LANE);
    }

    #[test]
    fn the_first_lane_takes_room_from_others_and_the_rest_only_spare_room() {
        let (pool, sets) = sets(2, 2);
        let (a, b) = (&sets[0], &sets[1]);
        b.give_back(b.take(2).unwrap());
        assert_eq!(b.idle(), 2);
        // a's first lane needs room b keeps idle: b lets one lane go. Its second lane finds no
        // spare room and is not made: a runs on one lane and b keeps the other.
        let lanes = a.take(2).unwrap();
        assert_eq!((lanes.len(), b.idle()), (1, 1));
        let s = pool.stats();
        assert_eq!((s.reclaimed_bytes, s.failures), (LANE, 0), "{s:?}");
        a.give_back(lanes);
        assert_eq!((a.idle(), b.idle()), (1, 1));
    }

    #[test]
    fn lanes_coming_back_go_to_a_waiting_request() {
        let (pool, sets) = sets(1, 2);
        let (a, b) = (&sets[0], &sets[1]);
        let lanes = a.take(1).unwrap();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| b.take(1));
            let start = Instant::now();
            while !pool.is_waited_on() {
                assert!(start.elapsed() < Duration::from_secs(10), "b never waited");
                std::thread::yield_now();
            }
            // Someone waits: a's lane goes back to the pool rather than idle in a.
            a.give_back(lanes);
            let got = waiter.join().unwrap().unwrap();
            assert_eq!(got.len(), 1);
            b.give_back(got);
        });
        assert_eq!((a.idle(), b.idle()), (0, 1));
    }
}
