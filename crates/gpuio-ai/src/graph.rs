//! Graph RAG gathers: a vector top-k gives candidate nodes ([`graph_scatter`]), a k-hop
//! expansion over CSR adjacency in host memory grows them into a subgraph ([`expand`]), and the
//! subgraph's node embeddings are gathered into one contiguous device buffer
//! ([`graph_gather`]) — from a host or CXL pool by MemIO's row gather, or from a file by
//! LocalIO's block reads.
//!
//! Expansion is breadth-first and deterministic: nodes are numbered in the order first
//! reached (seeds first, in the order given; then each hop's new nodes in the order their
//! parents and edges list them). With a fanout, each node keeps at most that many of its
//! neighbours, picked by a seeded hash of (node, neighbour) — the same pick every time.

use crate::{AiError, Result};
use gpuio_api::{DeviceBuffer, Session};
use gpuio_hal::HostBuffer;
use gpuio_hal::pattern::mix64;
use gpuio_transport_memio::GatherOptions;
use std::collections::HashMap;

/// Adjacency in compressed sparse row form: node `n`'s neighbours are
/// `neighbors[offsets[n]..offsets[n + 1]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsrGraph {
    offsets: Vec<u64>,
    neighbors: Vec<u64>,
}

impl CsrGraph {
    /// Checks and wraps the arrays: `offsets` starts at 0, never decreases and ends at
    /// `neighbors.len()`; every neighbour is a node (`< offsets.len() - 1`).
    pub fn new(offsets: Vec<u64>, neighbors: Vec<u64>) -> Result<Self> {
        let bad = |why: String| Err(AiError::InvalidArgument(format!("CSR graph: {why}")));
        if offsets.first() != Some(&0) {
            return bad("offsets must start at 0".into());
        }
        if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
            return bad(format!("offsets decrease at node {i}"));
        }
        if offsets.last() != Some(&(neighbors.len() as u64)) {
            return bad(format!(
                "offsets end at {:?}, not at the {} neighbours",
                offsets.last(),
                neighbors.len()
            ));
        }
        let nodes = (offsets.len() - 1) as u64;
        if let Some(n) = neighbors.iter().find(|&&n| n >= nodes) {
            return bad(format!("neighbour {n} is not one of the {nodes} nodes"));
        }
        Ok(Self { offsets, neighbors })
    }

    /// Nodes in the graph.
    pub fn nodes(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Edges in the graph.
    pub fn edges(&self) -> usize {
        self.neighbors.len()
    }

    /// Node `n`'s neighbours (empty for a node that is not there).
    pub fn neighbors(&self, n: u64) -> &[u64] {
        let n = n as usize;
        match (self.offsets.get(n), self.offsets.get(n + 1)) {
            (Some(&a), Some(&b)) => &self.neighbors[a as usize..b as usize],
            _ => &[],
        }
    }
}

/// The `k` nodes with the highest scores (score `i` is node `i`'s similarity to the query),
/// best first; ties go to the lower id. NaN scores are never picked. A brute-force top-k: the
/// vector index that scores the nodes is the caller's.
pub fn graph_scatter(scores: &[f32], k: usize) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..scores.len() as u64)
        .filter(|&i| !scores[i as usize].is_nan())
        .collect();
    let by_score = |a: &u64, b: &u64| {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    };
    let k = k.min(ids.len());
    if k < ids.len() && k > 0 {
        ids.select_nth_unstable_by(k - 1, by_score);
    }
    ids.truncate(k);
    ids.sort_by(by_score);
    ids
}

/// How far and how wide an expansion goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expansion {
    /// Hops from the seeds (0: the seeds alone).
    pub hops: u32,
    /// Neighbours kept per node per hop (`None`: all).
    pub fanout: Option<usize>,
    /// The seed of the fanout's pick.
    pub seed: u64,
    /// The most nodes the subgraph may hold; an expansion that would grow past it is an error
    /// (a subgraph buffer is sized for it).
    pub max_nodes: usize,
}

impl Default for Expansion {
    fn default() -> Self {
        Self {
            hops: 2,
            fanout: None,
            seed: 0,
            max_nodes: 1 << 20,
        }
    }
}

/// A subgraph: its nodes in the order reached, and its edges (those the expansion followed)
/// between local indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subgraph {
    /// Global node ids; local index `i` is `nodes[i]`.
    pub nodes: Vec<u64>,
    /// Where each hop's nodes start in `nodes` (`hop_starts[0]` = 0: the seeds), and its end.
    pub hop_starts: Vec<usize>,
    /// Edges followed, as (from, to) local indices.
    pub edges: Vec<(u32, u32)>,
}

/// Grows `seeds` by `expansion.hops` hops over `graph`. Seeds that are not nodes are an error;
/// a seed given twice counts once.
pub fn expand(graph: &CsrGraph, seeds: &[u64], expansion: &Expansion) -> Result<Subgraph> {
    if let Some(s) = seeds.iter().find(|&&s| s >= graph.nodes() as u64) {
        return Err(AiError::InvalidArgument(format!(
            "seed {s} is not one of the graph's {} nodes",
            graph.nodes()
        )));
    }
    let mut local: HashMap<u64, u32> = HashMap::new();
    let mut sub = Subgraph {
        nodes: Vec::new(),
        hop_starts: vec![0],
        edges: Vec::new(),
    };
    let mut add = |n: u64, sub: &mut Subgraph| -> Result<u32> {
        if let Some(&i) = local.get(&n) {
            return Ok(i);
        }
        if sub.nodes.len() >= expansion.max_nodes {
            return Err(AiError::InvalidArgument(format!(
                "the expansion reaches more than {} nodes (Expansion::max_nodes)",
                expansion.max_nodes
            )));
        }
        let i = sub.nodes.len() as u32;
        local.insert(n, i);
        sub.nodes.push(n);
        Ok(i)
    };
    for &s in seeds {
        add(s, &mut sub)?;
    }
    let mut frontier = 0..sub.nodes.len();
    for _ in 0..expansion.hops {
        sub.hop_starts.push(sub.nodes.len());
        for from in frontier.clone() {
            let node = sub.nodes[from];
            for to in picked(graph.neighbors(node), node, expansion) {
                let t = add(to, &mut sub)?;
                sub.edges.push((from as u32, t));
            }
        }
        frontier = frontier.end..sub.nodes.len();
    }
    sub.hop_starts.push(sub.nodes.len());
    Ok(sub)
}

/// The neighbours a node keeps: all, or the `fanout` with the smallest seeded hash, in their
/// adjacency order.
fn picked(neighbors: &[u64], node: u64, e: &Expansion) -> Vec<u64> {
    match e.fanout {
        Some(f) if f < neighbors.len() => {
            let hash = |n: u64| mix64(e.seed ^ mix64(node ^ mix64(n)));
            let mut ranked: Vec<(u64, usize)> = neighbors
                .iter()
                .enumerate()
                .map(|(i, &n)| (hash(n), i))
                .collect();
            ranked.select_nth_unstable(f - 1);
            let mut keep: Vec<usize> = ranked[..f].iter().map(|&(_, i)| i).collect();
            keep.sort_unstable();
            keep.into_iter().map(|i| neighbors[i]).collect()
        }
        _ => neighbors.to_vec(),
    }
}

/// Where node embeddings live: rows of `row_bytes`, node `n`'s at byte `n * row_bytes`.
#[derive(Debug, Clone, Copy)]
pub enum Embeddings<'a> {
    /// A host (DRAM or CXL) pool, pinned for the GPU's gather paths or not.
    Host(&'a HostBuffer),
    /// A file.
    File(&'a gpuio_api::FileHandle),
}

/// Expands `seeds` and gathers the subgraph's embeddings into `dst` from `dst_offset`: local
/// node `i`'s row lands at `dst_offset + i * row_bytes`. Returns the subgraph.
#[allow(clippy::too_many_arguments)]
pub fn graph_gather(
    session: &Session,
    graph: &CsrGraph,
    seeds: &[u64],
    expansion: &Expansion,
    embeddings: Embeddings<'_>,
    row_bytes: usize,
    dst: &DeviceBuffer,
    dst_offset: usize,
) -> Result<Subgraph> {
    let sub = expand(graph, seeds, expansion)?;
    if sub.nodes.is_empty() {
        return Ok(sub);
    }
    // A retrieval serves a request: the realtime class.
    let _lease = crate::AiWork::Decode.lease_in(session)?;
    match embeddings {
        Embeddings::Host(pool) => {
            session
                .memio()
                .gather(
                    pool,
                    row_bytes,
                    &sub.nodes[..],
                    dst,
                    dst_offset,
                    &GatherOptions::default(),
                )
                .map_err(gpuio_api::Error::from)?;
        }
        Embeddings::File(file) => {
            let offsets: Vec<u64> = sub
                .nodes
                .iter()
                .map(|&n| n.checked_mul(row_bytes as u64))
                .collect::<Option<_>>()
                .ok_or_else(|| AiError::InvalidArgument("embedding offset overflows".into()))?;
            session
                .localio()
                .read_blocks_to_device(file, &offsets, row_bytes, dst, dst_offset)
                .map_err(gpuio_api::Error::from)?;
        }
    }
    Ok(sub)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 0 → 1, 2; 1 → 3; 2 → 3, 4; 3 → 0; 4 → (none); 5 → 4.
    fn small() -> CsrGraph {
        CsrGraph::new(vec![0, 2, 3, 5, 6, 6, 7], vec![1, 2, 3, 3, 4, 0, 4]).unwrap()
    }

    #[test]
    fn expansion_is_breadth_first_in_order_reached() {
        let g = small();
        let sub = expand(&g, &[5, 0, 5], &Expansion::default()).unwrap();
        assert_eq!(sub.nodes, vec![5, 0, 4, 1, 2, 3]);
        assert_eq!(sub.hop_starts, vec![0, 2, 5, 6]);
        assert_eq!(
            sub.edges,
            vec![(0, 2), (1, 3), (1, 4), (3, 5), (4, 5), (4, 2)]
        );
        let none = expand(
            &g,
            &[1],
            &Expansion {
                hops: 0,
                ..Expansion::default()
            },
        )
        .unwrap();
        assert_eq!(none.nodes, vec![1]);
        let capped = Expansion {
            max_nodes: 3,
            ..Expansion::default()
        };
        assert!(expand(&g, &[0], &capped).is_err());
        assert!(expand(&g, &[6], &Expansion::default()).is_err());
    }

    #[test]
    fn fanout_keeps_the_same_subset_every_time() {
        let n = 50u64;
        let offsets: Vec<u64> = (0..=n).map(|i| i * (n - 1)).collect();
        let neighbors: Vec<u64> = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i))
            .collect();
        let g = CsrGraph::new(offsets, neighbors).unwrap();
        let e = Expansion {
            hops: 1,
            fanout: Some(5),
            seed: 9,
            ..Expansion::default()
        };
        let a = expand(&g, &[3], &e).unwrap();
        assert_eq!(a, expand(&g, &[3], &e).unwrap());
        assert_eq!(a.nodes.len(), 6);
        assert!(a.nodes[1..].iter().all(|m| g.neighbors(3).contains(m)));
        let b = expand(&g, &[3], &Expansion { seed: 10, ..e }).unwrap();
        assert_ne!(a.nodes, b.nodes, "the seed picks");
    }

    #[test]
    fn top_k_is_best_first_and_skips_nan() {
        let s = [0.1, 0.9, f32::NAN, 0.9, -1.0, 0.5];
        assert_eq!(graph_scatter(&s, 3), vec![1, 3, 5]);
        assert_eq!(graph_scatter(&s, 10), vec![1, 3, 5, 0, 4]);
        assert!(graph_scatter(&s, 0).is_empty());
    }

    #[test]
    fn bad_csr_is_refused() {
        assert!(CsrGraph::new(vec![], vec![]).is_err());
        assert!(CsrGraph::new(vec![1, 1], vec![0]).is_err());
        assert!(CsrGraph::new(vec![0, 2, 1], vec![0, 0]).is_err());
        assert!(CsrGraph::new(vec![0, 1], vec![1]).is_err());
        assert!(CsrGraph::new(vec![0, 1], vec![0, 0]).is_err());
        assert_eq!(CsrGraph::new(vec![0], vec![]).unwrap().nodes(), 0);
    }
}
