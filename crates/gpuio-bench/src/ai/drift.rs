//! B1's second trace: selections from an indexer's scores that drift from step to step, so
//! that the positions a step takes in come from near the top-k's boundary, as a model's do
//! (its query changes a little each step). Each position's score follows a stationary AR(1)
//! walk, `s ← ρ·s + √(1 − ρ²)·z` with `z` standard normal, and a step selects the top-k by
//! score, then writes the next `ahead` ranks after them: the candidates a prefetch takes.
//! `ρ` is found by bisection so that consecutive top-ks overlap as asked. The uniform trace
//! (`ai.rs`) draws the positions a step takes in from anywhere: the worst case for a hot
//! buffer and for any prefetch.

use gpuio_hal::pattern::mix64;
use std::collections::HashSet;

/// A drifting-score trace: per step and request, the top-k then the candidates ahead.
pub(super) struct DriftTrace {
    /// `steps * batch` selections of `topk + ahead` positions, step-major.
    pub(super) selections: Vec<Vec<u64>>,
    /// The AR(1) coefficient found.
    pub(super) rho: f64,
    /// Mean overlap of consecutive top-ks.
    pub(super) overlap: f64,
    /// Per depth asked for: of the positions a top-k took in, the share that were among the
    /// last step's first `depth` candidates.
    pub(super) covered: Vec<f64>,
}

/// A standard normal draw from a key (Box-Muller over two hashes of it).
fn normal(key: u64) -> f64 {
    let (a, b) = (mix64(key), mix64(key ^ 0x9e37_79b9_7f4a_7c15));
    let u1 = ((a >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let u2 = ((b >> 11) as f64) / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The top `n` positions by score, best first.
fn ranked(scores: &[f64], n: usize, order: &mut Vec<u64>) -> Vec<u64> {
    order.clear();
    order.extend(0..scores.len() as u64);
    let by_score = |a: &u64, b: &u64| scores[*b as usize].total_cmp(&scores[*a as usize]);
    let n = n.min(order.len());
    if n < order.len() {
        order.select_nth_unstable_by(n, by_score);
    }
    let mut top = order[..n].to_vec();
    top.sort_unstable_by(by_score);
    top
}

/// One request's walk: `steps` selections of the top `topk` and `ahead` candidates.
fn walk(ctx: u64, steps: usize, topk: usize, ahead: usize, rho: f64, seed: u64) -> Vec<Vec<u64>> {
    let noise = (1.0 - rho * rho).sqrt();
    let mut scores: Vec<f64> = (0..ctx).map(|p| normal(mix64(seed ^ p))).collect();
    let mut order = Vec::with_capacity(ctx as usize);
    let mut out = Vec::with_capacity(steps);
    for step in 0..steps {
        if step > 0 {
            let salt = mix64(seed ^ (step as u64) << 40);
            for (p, s) in scores.iter_mut().enumerate() {
                *s = rho * *s + noise * normal(salt ^ p as u64);
            }
        }
        out.push(ranked(&scores, topk + ahead, &mut order));
    }
    out
}

/// Mean overlap of consecutive top-ks, and the share of the positions taken in that were among
/// the step before's first `depth` candidates.
fn overlap_and_cover(walk: &[Vec<u64>], topk: usize, depth: usize) -> (f64, f64) {
    let (mut kept, mut pairs, mut new, mut covered) = (0usize, 0usize, 0usize, 0usize);
    for w in walk.windows(2) {
        let before: HashSet<u64> = w[0][..topk].iter().copied().collect();
        let end = (topk + depth).min(w[0].len());
        let ahead: HashSet<u64> = w[0][topk..end].iter().copied().collect();
        for p in &w[1][..topk] {
            if before.contains(p) {
                kept += 1;
            } else {
                new += 1;
                covered += usize::from(ahead.contains(p));
            }
        }
        pairs += 1;
    }
    let overlap = kept as f64 / (pairs * topk).max(1) as f64;
    (overlap, covered as f64 / new.max(1) as f64)
}

/// The trace of `batch` requests over `steps` steps whose top-ks overlap by about `overlap`,
/// each selection followed by the most of `depths` candidates.
pub(super) fn drift_trace(
    ctx: u64,
    batch: usize,
    steps: usize,
    topk: usize,
    depths: &[usize],
    overlap: f64,
    seed: u64,
) -> DriftTrace {
    let ahead = depths.iter().copied().max().unwrap_or(0);
    // Bisection on log(1 - ρ): the overlap falls as 1 - ρ grows.
    let (mut lo, mut hi) = ((1e-7f64).ln(), (0.5f64).ln());
    for _ in 0..16 {
        let mid = 0.5 * (lo + hi);
        let w = walk(ctx, 6, topk, 0, 1.0 - mid.exp(), seed ^ 0x5eed);
        if overlap_and_cover(&w, topk, 0).0 > overlap {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let rho = 1.0 - (0.5 * (lo + hi)).exp();
    let walks: Vec<Vec<Vec<u64>>> = (0..batch)
        .map(|r| walk(ctx, steps, topk, ahead, rho, seed ^ (r as u64) << 48))
        .collect();
    let per_request = |depth| {
        let sums = walks.iter().map(|w| overlap_and_cover(w, topk, depth));
        sums.fold((0.0, 0.0), |(o, c), (wo, wc)| (o + wo, c + wc))
    };
    let n = batch.max(1) as f64;
    let covered = depths.iter().map(|&d| per_request(d).1 / n).collect();
    let selections = (0..steps)
        .flat_map(|s| walks.iter().map(move |w| w[s].clone()))
        .collect();
    DriftTrace {
        selections,
        rho,
        overlap: per_request(0).0 / n,
        covered,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drifting_traces_keep_the_overlap_asked_for_and_take_in_their_candidates() {
        let (ctx, topk, ahead) = (20_000, 1000, 250);
        let t = drift_trace(ctx, 2, 8, topk, &[ahead / 2, ahead], 0.9, 3);
        assert_eq!(t.selections.len(), 16);
        for sel in &t.selections {
            let set: HashSet<u64> = sel.iter().copied().collect();
            assert_eq!(set.len(), topk + ahead, "a position twice");
            assert!(sel.iter().all(|&p| p < ctx));
        }
        assert!((t.overlap - 0.9).abs() < 0.03, "overlap {}", t.overlap);
        assert!(t.rho > 0.9 && t.rho < 1.0, "rho {}", t.rho);
        // Churn near the boundary: most positions taken in were ranked just below it, more
        // of them the deeper the candidates go.
        assert!(t.covered[1] > 0.7, "covered {:?}", t.covered);
        assert!(t.covered[0] < t.covered[1], "covered {:?}", t.covered);
    }
}
