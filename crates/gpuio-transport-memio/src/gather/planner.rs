//! [`GatherStrategy::Auto`]: the shape classes of gathers (device, row size, pool size, row
//! count, index list place) and, per class, the rates each path reached (the median of its last
//! three calls, after one uncounted warm-up), the path exploited now, and the balanced GPU
//! share of a hybrid call.

use super::{GatherPlan, GatherStrategy, IndexPlace};
use crate::MemIo;
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{Gpu, HostBuffer, RowKernel};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Shape class of a gather, for the strategy choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct ShapeKey {
    gpu: u32,
    row_bytes_log2: u32,
    pool_log2: u32,
    /// A 2048-row call and a million-row one from the same pool can want different paths:
    /// the hybrid's second side costs more than it brings on a small call.
    rows_log2: u32,
    indices: IndexPlace,
    /// Through hot rows ([`MemIo::gather_hot`]): the GPU's paths read kept rows from device
    /// memory, and there is no sorted path.
    hot: bool,
    /// Pools gathered together ([`MemIo::gather_hot_jobs`]): one launch and one wait serve
    /// them all, so the paths compare otherwise than for one pool's rows.
    jobs: usize,
}

impl ShapeKey {
    /// The class of a call gathering `jobs` pools' rows together.
    pub(super) fn of_jobs(self, jobs: usize) -> Self {
        Self { jobs, ..self }
    }

    /// Whether `Auto` may choose path `i` of [`STRATEGIES`] for this shape.
    fn offers(&self, i: usize) -> bool {
        !(self.hot && i == SORTED)
    }
}

/// Measured rates per shape class.
#[derive(Debug, Default)]
pub(crate) struct Planner {
    shapes: Mutex<HashMap<ShapeKey, Shape>>,
}

#[derive(Debug, Default)]
struct Shape {
    calls: u64,
    /// Recent bytes/s of each of [`STRATEGIES`].
    rate: [Recent; 4],
    /// The path being exploited.
    current: usize,
    /// The GPU's share of a hybrid call's rows, from the rates the two sides reached while
    /// sharing the link in earlier hybrid calls.
    gpu_share: Option<f64>,
    /// Hybrid calls so far, and whether the last one left the share where it was.
    hybrid_calls: u32,
    share_settled: bool,
}

/// The last three rates measured of one path. Its estimate is their median, so that one
/// slow call (a burst of page faults, a descheduled thread) does not move the choice. A
/// path's first call is not counted: it pays one-time costs (scratch and staging memory
/// allocated, pages of device memory first touched) that would make one sample an outlier
/// the choice then never revisits.
#[derive(Debug, Default, Clone, Copy)]
struct Recent {
    last: [f64; 3],
    count: usize,
    warmed: bool,
}

impl Recent {
    fn push(&mut self, rate: f64) {
        if !std::mem::replace(&mut self.warmed, true) {
            return;
        }
        self.last[self.count % 3] = rate;
        self.count += 1;
    }

    fn estimate(&self) -> Option<f64> {
        let [a, b, c] = self.last;
        match self.count {
            0 => None,
            1 => Some(a),
            2 => Some((a + b) / 2.0),
            _ => Some(a.max(b).min(a.min(b).max(c))),
        }
    }
}

/// How much faster another path must measure before the choice moves to it.
const SWITCH_MARGIN: f64 = 1.1;

/// The paths `Auto` chooses from, in the order it first tries them: the GPU's two orders
/// before the hybrid, which uses the faster of them.
const STRATEGIES: [GatherStrategy; 4] = [
    GatherStrategy::ZeroCopy,
    GatherStrategy::Sorted,
    GatherStrategy::CpuStaged,
    GatherStrategy::Hybrid,
];

const ZERO_COPY: usize = 0;

const SORTED: usize = 1;

const CPU_STAGED: usize = 2;

/// The least share of a hybrid call's rows either side gets, so both rates stay measured.
const MIN_SHARE: f64 = 0.02;

/// A hybrid share is balanced once its two sides finish within this part of the call's
/// time of each other.
const SETTLED_IMBALANCE: f64 = 0.1;

/// Most hybrid calls spent balancing the share before the paths are compared.
const MAX_BALANCING_CALLS: u32 = 8;

/// Re-measure the slower path once every this many calls of a shape.
const RECHECK_EVERY: u64 = 32;

impl Planner {
    /// The path for the next call of this shape: each one twice (a warm-up, then a measured
    /// call), then the fastest, with a slower one re-measured every [`RECHECK_EVERY`] calls.
    pub(super) fn choose(&self, key: ShapeKey) -> GatherStrategy {
        let mut shapes = self.shapes.lock_unpoisoned();
        let s = shapes.entry(key).or_default();
        s.calls += 1;
        let offered = |i: &usize| key.offers(*i);
        if let Some(i) = (0..STRATEGIES.len())
            .filter(offered)
            .find(|&i| s.rate[i].count == 0)
        {
            return STRATEGIES[i];
        }
        // A hybrid call with an unbalanced share understates the hybrid: balance it first.
        if !s.share_settled && s.hybrid_calls < MAX_BALANCING_CALLS {
            return GatherStrategy::Hybrid;
        }
        let rate = |i: usize| s.rate[i].estimate().unwrap_or(0.0);
        let mut best = (0..STRATEGIES.len())
            .filter(offered)
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)))
            .unwrap_or(0);
        // Stay with the current path unless another is clearly faster: noise is not a reason
        // to switch.
        if rate(s.current) * SWITCH_MARGIN >= rate(best) {
            best = s.current;
        }
        s.current = best;
        if s.calls.is_multiple_of(RECHECK_EVERY) {
            let others: Vec<usize> = (0..STRATEGIES.len())
                .filter(|i| offered(i) && *i != best)
                .collect();
            let turn = (s.calls / RECHECK_EVERY) as usize;
            STRATEGIES[others
                .get(turn % others.len().max(1))
                .copied()
                .unwrap_or(best)]
        } else {
            STRATEGIES[best]
        }
    }

    pub(super) fn plan(&self, key: ShapeKey) -> Option<GatherPlan> {
        let gpu_share = self.gpu_share(key);
        let shapes = self.shapes.lock_unpoisoned();
        let s = shapes.get(&key)?;
        Some(GatherPlan {
            strategy: STRATEGIES[s.current],
            rates: s.rate.map(|r| r.estimate()),
            gpu_share,
        })
    }

    /// The share of rows a hybrid call gives the GPU: what balanced the two sides in earlier
    /// hybrid calls, or at first the GPU's part of the two paths' total rate alone.
    pub(super) fn gpu_share(&self, key: ShapeKey) -> f64 {
        let shapes = self.shapes.lock_unpoisoned();
        let Some(s) = shapes.get(&key) else {
            return 0.5;
        };
        let gpu = s.rate[ZERO_COPY]
            .estimate()
            .into_iter()
            .chain(s.rate[SORTED].estimate())
            .reduce(f64::max);
        match (s.gpu_share, gpu, s.rate[CPU_STAGED].estimate()) {
            (Some(share), _, _) => share,
            (None, Some(z), Some(c)) if z + c > 0.0 => z / (z + c),
            _ => 0.5,
        }
    }

    /// The kernel order of a hybrid call's GPU side: sorted where sorted calls measured
    /// faster than zero-copy ones.
    pub(super) fn gpu_kernel(&self, key: ShapeKey) -> RowKernel {
        let shapes = self.shapes.lock_unpoisoned();
        let sorted_faster = shapes.get(&key).is_some_and(|s| {
            match (s.rate[ZERO_COPY].estimate(), s.rate[SORTED].estimate()) {
                (Some(z), Some(o)) => o > z,
                _ => false,
            }
        });
        if sorted_faster {
            RowKernel::Sorted
        } else {
            RowKernel::Tuned
        }
    }

    /// Moves the hybrid share most of the way to what would have had both sides of a hybrid
    /// call with share `old` finish together, given the time each side took; not all the way, so one call's noise does not swing it. The share is
    /// settled once the sides finish within [`SETTLED_IMBALANCE`] of each other.
    pub(super) fn balance(&self, key: ShapeKey, old: f64, gpu: Duration, cpu: Duration) {
        let (g, c) = (gpu.as_secs_f64(), cpu.as_secs_f64());
        if !(g > 0.0 && c > 0.0) {
            // One side had no rows (a share that rounds to none of a short list): nothing to
            // balance, but the call counts, so `choose` stops asking for hybrid calls that
            // cannot move the share.
            if let Some(s) = self.shapes.lock_unpoisoned().get_mut(&key) {
                s.hybrid_calls += 1;
            }
            return;
        }
        // Rates per unit share; their ratio is the balanced split.
        let (gpu_rate, cpu_rate) = (old / g, (1.0 - old) / c);
        let balanced = gpu_rate / (gpu_rate + cpu_rate);
        if let Some(s) = self.shapes.lock_unpoisoned().get_mut(&key) {
            let share = old + 0.75 * (balanced - old);
            s.gpu_share = Some(share.clamp(MIN_SHARE, 1.0 - MIN_SHARE));
            s.hybrid_calls += 1;
            s.share_settled = (g - c).abs() / g.max(c) < SETTLED_IMBALANCE;
        }
    }

    pub(super) fn record(&self, key: ShapeKey, strategy: GatherStrategy, bytes: usize, secs: f64) {
        let Some(i) = STRATEGIES.iter().position(|s| *s == strategy) else {
            return;
        };
        if let Some(s) = self.shapes.lock_unpoisoned().get_mut(&key) {
            s.rate[i].push(bytes as f64 / secs.max(1e-9));
        }
    }
}

impl MemIo {
    /// The shape class of a gather, which `Auto` learns about.
    pub(super) fn shape(
        &self,
        pool: &HostBuffer,
        gpu: &Gpu,
        row_bytes: usize,
        rows: usize,
        indices: IndexPlace,
        hot: bool,
    ) -> ShapeKey {
        ShapeKey {
            gpu: gpu.ordinal(),
            row_bytes_log2: log2(row_bytes),
            pool_log2: log2(pool.len()),
            rows_log2: log2(rows),
            indices,
            hot,
            jobs: 1,
        }
    }

    /// The path of a call that asked for `asked`: `Auto` chooses; an unpinned pool can only
    /// be gathered by the CPU.
    pub(super) fn resolve(
        &self,
        asked: GatherStrategy,
        pool: &HostBuffer,
        key: ShapeKey,
    ) -> GatherStrategy {
        if !pool.is_pinned() {
            // The device cannot reach pageable memory; only the CPU can gather it.
            return GatherStrategy::CpuStaged;
        }
        match asked {
            GatherStrategy::Auto => self.planner.choose(key),
            other => other,
        }
    }
}

fn log2(x: usize) -> u32 {
    usize::BITS - x.max(1).leading_zeros()
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: ShapeKey = ShapeKey {
        gpu: 0,
        row_bytes_log2: 7,
        pool_log2: 32,
        rows_log2: 20,
        indices: IndexPlace::Host,
        hot: false,
        jobs: 1,
    };

    /// One `Auto` call: choose, then report what the chosen path reached; a hybrid call
    /// also reports how long each side took at the rates (rows' bytes/s) of `sides`.
    fn call(p: &Planner, rates: [f64; 4], sides: (f64, f64)) -> GatherStrategy {
        let s = p.choose(KEY);
        if s == GatherStrategy::Hybrid {
            let share = p.gpu_share(KEY);
            let secs = |part: f64, rate: f64| Duration::from_secs_f64(part / rate);
            p.balance(KEY, share, secs(share, sides.0), secs(1.0 - share, sides.1));
        }
        let i = STRATEGIES.iter().position(|x| *x == s).unwrap();
        p.record(KEY, s, 1000, 1000.0 / rates[i]);
        s
    }

    /// Hot shapes never get the sorted path: not while the paths are tried, not as the
    /// fastest (even where sorted calls of the same shape measured fastest), not as a
    /// re-check.
    #[test]
    fn a_hot_shape_is_never_offered_the_sorted_path() {
        let p = Planner::default();
        let hot = ShapeKey { hot: true, ..KEY };
        for _ in 0..300 {
            let s = p.choose(hot);
            assert_ne!(s, GatherStrategy::Sorted);
            if s == GatherStrategy::Hybrid {
                let share = p.gpu_share(hot);
                p.balance(
                    hot,
                    share,
                    Duration::from_millis(1),
                    Duration::from_millis(1),
                );
            }
            p.record(hot, s, 1000, 1.0);
            p.record(hot, GatherStrategy::Sorted, 1000, 1e-6);
        }
    }

    #[test]
    fn the_median_of_three_ignores_one_outlier() {
        let mut r = Recent::default();
        assert_eq!(r.estimate(), None);
        // The first call warms the path up and is not counted.
        r.push(1.0);
        assert_eq!(r.estimate(), None);
        r.push(30.0);
        assert_eq!(r.estimate(), Some(30.0));
        r.push(10.0);
        assert_eq!(r.estimate(), Some(20.0));
        r.push(31.0);
        assert_eq!(r.estimate(), Some(30.0));
        r.push(29.0);
        assert_eq!(r.estimate(), Some(29.0));
    }

    #[test]
    fn auto_explores_balances_the_hybrid_then_keeps_the_fastest() {
        let p = Planner::default();
        // [zero-copy, sorted, CPU-staged, hybrid]
        let rates = [3.0, 4.0, 23.0, 31.0];
        // Each path twice (warm-up, measured), then hybrid calls until the share stops moving.
        for path in [
            GatherStrategy::ZeroCopy,
            GatherStrategy::Sorted,
            GatherStrategy::CpuStaged,
        ] {
            assert_eq!(call(&p, rates, (0.0, 0.0)), path);
            assert_eq!(call(&p, rates, (0.0, 0.0)), path);
        }
        // The hybrid starts from the faster GPU order's rate, and uses that order.
        let first = p.gpu_share(KEY);
        assert!((first - 4.0 / 27.0).abs() < 1e-9, "{first}");
        assert_eq!(p.gpu_kernel(KEY), RowKernel::Sorted);
        for _ in 0..7 {
            assert_eq!(call(&p, rates, (3.0, 28.0)), GatherStrategy::Hybrid);
        }
        let share = p.gpu_share(KEY);
        assert!((share - 3.0 / 31.0).abs() < 0.01, "{share}");
        // Hybrid is the fastest: exploited, with a slower path re-measured now and then.
        let used: Vec<_> = (0..64).map(|_| call(&p, rates, (3.0, 28.0))).collect();
        let hybrid = used
            .iter()
            .filter(|s| **s == GatherStrategy::Hybrid)
            .count();
        assert!(hybrid >= 60, "{used:?}");
        // One slow hybrid call does not hand the choice to the CPU path.
        let slow = [3.0, 4.0, 23.0, 15.0];
        call(&p, slow, (1.0, 10.0));
        assert_eq!(call(&p, rates, (3.0, 28.0)), GatherStrategy::Hybrid);
        assert_eq!(p.plan(KEY).unwrap().strategy, GatherStrategy::Hybrid);
    }

    #[test]
    fn a_slower_hybrid_is_balanced_a_few_calls_then_left() {
        let p = Planner::default();
        let rates = [49.0, 40.0, 33.0, 47.0];
        for _ in 0..6 {
            call(&p, rates, (0.0, 0.0));
        }
        assert_eq!(p.gpu_kernel(KEY), RowKernel::Tuned);
        // The sides' rates swing between calls, so the share never settles.
        let hybrid = (0..40)
            .map(|i| call(&p, rates, (40.0, if i % 2 == 0 { 2.0 } else { 20.0 })))
            .filter(|s| *s == GatherStrategy::Hybrid)
            .count();
        assert!(hybrid <= MAX_BALANCING_CALLS as usize + 2, "{hybrid}");
        assert_eq!(p.plan(KEY).unwrap().strategy, GatherStrategy::ZeroCopy);
    }
}
