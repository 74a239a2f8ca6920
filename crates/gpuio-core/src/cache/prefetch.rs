//! Prefetching for the block cache (docs/REFERENCE.md#prefetch): a [`Predictor`] that watches
//! the block access stream, and one background thread that loads what it predicts.
//!
//! The predictor is a pure function of the access sequence, so it is tested on its own; the
//! runtime half (the crate-private `Prefetcher`) only filters and forwards its hints. Hints
//! travel over a bounded channel and are dropped when it is full: a prefetch that arrives late
//! is worth nothing, and the reader must never wait for the prefetcher.

use crate::{CoreError, Result};
use crossbeam_channel::{Sender, TrySendError};
use gpuio_hal::sync::MutexExt;
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Mutex;
use std::thread::JoinHandle;

/// Largest accepted [`PrefetchConfig::depth`].
pub const MAX_DEPTH: usize = 1024;
/// Largest accepted [`PrefetchConfig::history`].
pub const MAX_HISTORY: usize = 1 << 20;

/// How the cache prefetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefetchConfig {
    /// Run the prefetcher (one background thread per cache).
    pub enabled: bool,
    /// Blocks predicted ahead of a sequential or strided run (at most [`MAX_DEPTH`]).
    pub depth: usize,
    /// Entries of the history table: block → the block that followed it last time (at most
    /// [`MAX_HISTORY`]).
    pub history: usize,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            depth: 8,
            history: 4096,
        }
    }
}

impl PrefetchConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        if self.depth > MAX_DEPTH || self.history > MAX_HISTORY {
            return Err(CoreError::InvalidRequest(format!(
                "prefetch depth {} / history {} exceed the limits {MAX_DEPTH} / {MAX_HISTORY}",
                self.depth, self.history
            )));
        }
        Ok(())
    }
}

/// Predicts the blocks about to be accessed from the blocks accessed so far.
///
/// Three patterns, in this order of trust:
/// - a **constant stride** confirmed by two equal steps in a row (`a, a+s, a+2s`) predicts the
///   next `depth` blocks of the run; a sequential run (stride 1) is trusted after one step,
///   since it is by far the most common pattern;
/// - otherwise the **history** table (a first-order Markov table: block → the block that
///   followed it last time, bounded FIFO) predicts the chain of successors, up to `depth`.
#[derive(Debug, Clone)]
pub struct Predictor {
    depth: usize,
    capacity: usize,
    last: Option<u64>,
    stride: i64,
    /// How many times in a row `stride` was the step.
    run: u32,
    next: HashMap<u64, u64>,
    /// Keys of `next` in insertion order, to forget the oldest first.
    order: VecDeque<u64>,
}

impl Predictor {
    /// A predictor looking `depth` blocks ahead with `history` entries of history.
    pub fn new(depth: usize, history: usize) -> Self {
        Self {
            depth,
            capacity: history,
            last: None,
            stride: 0,
            run: 0,
            next: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Records an access to `block` and returns the blocks predicted to follow it, nearest
    /// first, without duplicates and never `block` itself.
    pub fn observe(&mut self, block: u64) -> Vec<u64> {
        if let Some(last) = self.last {
            let stride = (block as i64).wrapping_sub(last as i64);
            if stride == self.stride {
                self.run = self.run.saturating_add(1);
            } else {
                self.stride = stride;
                self.run = 1;
            }
            if stride != 0 {
                self.learn(last, block);
            }
        }
        self.last = Some(block);

        let mut out = Vec::new();
        let confirmed = self.stride != 0 && (self.run >= 2 || self.stride == 1);
        if confirmed {
            let mut at = block;
            for _ in 0..self.depth {
                match at.checked_add_signed(self.stride) {
                    Some(next) => {
                        out.push(next);
                        at = next;
                    }
                    None => break,
                }
            }
        } else {
            let mut at = block;
            while out.len() < self.depth {
                match self.next.get(&at) {
                    Some(&next) if next != block && !out.contains(&next) => {
                        out.push(next);
                        at = next;
                    }
                    _ => break,
                }
            }
        }
        out
    }

    /// Whether the history table remembers a successor of `block`.
    pub fn remembers(&self, block: u64) -> Option<u64> {
        self.next.get(&block).copied()
    }

    fn learn(&mut self, from: u64, to: u64) {
        if self.capacity == 0 {
            return;
        }
        if self.next.insert(from, to).is_none() {
            self.order.push_back(from);
            while self.next.len() > self.capacity {
                match self.order.pop_front() {
                    Some(old) => {
                        self.next.remove(&old);
                    }
                    None => break,
                }
            }
        }
    }
}

/// The runtime half: feeds accesses to the predictor and hands fresh predictions to the
/// loader thread. Dropping it stops the thread (after the hint it is loading).
pub(crate) struct Prefetcher {
    front: Mutex<Front>,
    nblocks: u64,
    tx: Option<Sender<u64>>,
    worker: Option<JoinHandle<()>>,
    /// The process that started the worker, in its line of forks.
    generation: u64,
}

struct Front {
    predictor: Predictor,
    /// Blocks hinted lately: a run predicts mostly what it predicted one access earlier.
    recent: VecDeque<u64>,
    recent_cap: usize,
}

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher")
            .field("nblocks", &self.nblocks)
            .finish_non_exhaustive()
    }
}

impl Prefetcher {
    /// Starts the loader thread; `load(block)` brings one predicted block into the cache.
    pub(crate) fn start(
        cfg: &PrefetchConfig,
        nblocks: u64,
        load: impl Fn(u64) + Send + 'static,
    ) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::bounded::<u64>((cfg.depth * 2).clamp(1, 4096));
        let worker = std::thread::Builder::new()
            .name("gpuio-prefetch".into())
            .spawn(move || {
                for block in rx {
                    load(block);
                }
            })
            .map_err(|e| CoreError::Internal(format!("cannot start the prefetch thread: {e}")))?;
        Ok(Self {
            front: Mutex::new(Front {
                predictor: Predictor::new(cfg.depth, cfg.history),
                recent: VecDeque::new(),
                recent_cap: cfg.depth * 4,
            }),
            nblocks,
            tx: Some(tx),
            worker: Some(worker),
            generation: gpuio_hal::sys::fork_generation(),
        })
    }

    /// Records an access to `blocks` (one request, in order) and hints what follows, except
    /// what `cached` removes from the candidates (the blocks cached already: hinting them
    /// would only wake the loader to find them there, and make it contend with the readers
    /// for the directory).
    pub(crate) fn observe(&self, blocks: Range<u64>, cached: impl FnOnce(&mut Vec<u64>)) {
        let Some(tx) = &self.tx else { return };
        // The predictor's state is a hint: after a panic elsewhere it is still usable.
        let mut f = self.front.lock_unpoisoned();
        let f = &mut *f;
        let mut hints = Vec::new();
        for b in blocks.clone() {
            for p in f.predictor.observe(b) {
                if p >= self.nblocks || blocks.contains(&p) || f.recent.contains(&p) {
                    continue;
                }
                // Considered now: not again while it is recent, hinted or found cached.
                f.recent.push_back(p);
                if f.recent.len() > f.recent_cap {
                    f.recent.pop_front();
                }
                hints.push(p);
            }
        }
        if hints.is_empty() {
            return;
        }
        cached(&mut hints);
        for p in hints {
            match tx.try_send(p) {
                Ok(()) => {}
                // Full: the loader is behind, and later hints would be later still.
                Err(TrySendError::Full(_)) => break,
                Err(TrySendError::Disconnected(_)) => return,
            }
        }
    }

    /// Stops the loader thread and waits for it.
    pub(crate) fn stop(&mut self) {
        self.tx = None;
        if gpuio_hal::sys::fork_generation() != self.generation {
            // A forked child: the worker is the parent's.
            if let Some(worker) = self.worker.take() {
                std::mem::forget(worker);
            }
            return;
        }
        if let Some(worker) = self.worker.take()
            && worker.join().is_err()
        {
            tracing::error!("the cache prefetch thread panicked");
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &mut Predictor, seq: &[u64]) -> Vec<u64> {
        seq.iter().map(|&b| p.observe(b)).last().unwrap_or_default()
    }

    #[test]
    fn sequential_runs_predict_the_next_depth_blocks() {
        let mut p = Predictor::new(4, 16);
        assert!(p.observe(10).is_empty());
        assert_eq!(p.observe(11), vec![12, 13, 14, 15]);
        assert_eq!(p.observe(12), vec![13, 14, 15, 16]);
    }

    #[test]
    fn strides_need_two_equal_steps() {
        let mut p = Predictor::new(3, 16);
        assert!(p.observe(0).is_empty());
        assert!(p.observe(3).is_empty(), "one step of 3 is no pattern yet");
        assert_eq!(p.observe(6), vec![9, 12, 15]);
        assert_eq!(p.observe(9), vec![12, 15, 18]);
        // Backwards, stopping at block 0.
        let mut p = Predictor::new(4, 16);
        assert_eq!(run(&mut p, &[9, 7, 5]), vec![3, 1]);
        // A broken stride stops predicting it.
        let mut p = Predictor::new(2, 0);
        assert!(run(&mut p, &[0, 3, 6, 20]).is_empty());
    }

    #[test]
    fn history_predicts_the_chain_seen_last_time() {
        let mut p = Predictor::new(4, 16);
        // An irregular pattern, seen once.
        assert!(run(&mut p, &[40, 5, 77, 13]).is_empty());
        // Back at its start: the rest of it is predicted, in order.
        assert_eq!(p.observe(40), vec![5, 77, 13]);
        // The table follows the latest successor.
        run(&mut p, &[5, 90]);
        assert_eq!(p.remembers(5), Some(90));
        assert_eq!(run(&mut p, &[60, 5]), vec![90, 60]);
    }

    #[test]
    fn history_is_bounded_oldest_first() {
        let mut p = Predictor::new(2, 2);
        run(&mut p, &[100, 7, 300, 40]);
        // Three transitions learned, two kept: 100→7 was forgotten.
        assert_eq!(p.remembers(100), None);
        assert_eq!(p.remembers(7), Some(300));
        assert_eq!(p.remembers(300), Some(40));
        let mut p = Predictor::new(2, 0);
        run(&mut p, &[100, 7, 300]);
        assert_eq!(p.remembers(100), None);
    }

    #[test]
    fn repeated_blocks_predict_nothing_new() {
        let mut p = Predictor::new(4, 16);
        assert!(run(&mut p, &[8, 8, 8]).is_empty());
    }

    #[test]
    fn prefetcher_hints_each_block_once_and_stops() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let cfg = PrefetchConfig {
            enabled: true,
            depth: 2,
            history: 8,
        };
        let mut pf = Prefetcher::start(&cfg, 6, move |b| tx.send(b).unwrap()).unwrap();
        for b in 0..6 {
            pf.observe(b..b + 1, |_| {});
        }
        pf.stop();
        let got: Vec<u64> = rx.try_iter().collect();
        // 0 predicts nothing; then each run step adds one new block; nothing past the end.
        assert_eq!(got, vec![2, 3, 4, 5]);
    }

    #[test]
    fn cached_blocks_are_not_hinted() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let cfg = PrefetchConfig {
            enabled: true,
            depth: 4,
            history: 8,
        };
        let mut pf = Prefetcher::start(&cfg, 100, move |b| tx.send(b).unwrap()).unwrap();
        let mut offered = Vec::new();
        pf.observe(10..11, |_| {});
        pf.observe(11..12, |h| {
            offered = h.clone();
            h.retain(|&b| b != 13);
        });
        pf.stop();
        // 11 predicts 12-15; 13 was taken out as cached, the rest went to the loader.
        assert_eq!(offered, vec![12, 13, 14, 15]);
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![12, 14, 15]);
    }
}
