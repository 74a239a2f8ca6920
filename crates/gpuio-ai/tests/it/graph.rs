//! Graph gathers against a CPU reference: a power-law graph, 2-hop expansions from top-k
//! candidates, every gathered embedding row compared with the pool's row of the node it
//! names — from host memory and from a file.

use gpuio_ai::graph::{CsrGraph, Embeddings, Expansion, graph_gather, graph_scatter};
use gpuio_api::{Config, OpenOptions, Session};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use std::collections::{HashSet, VecDeque};

/// `n` nodes whose out-degrees fall off as a power law (node `i` has about `n / (i + 1)`
/// neighbours, capped), the neighbours drawn from a seeded hash.
fn power_law(n: u64, seed: u64) -> CsrGraph {
    let mut offsets = vec![0u64];
    let mut neighbors = Vec::new();
    for i in 0..n {
        let degree = (n / (i + 1)).min(40);
        for k in 0..degree {
            neighbors.push(pattern::mix64(seed ^ i << 20 ^ k) % n);
        }
        offsets.push(neighbors.len() as u64);
    }
    CsrGraph::new(offsets, neighbors).unwrap()
}

/// Breadth-first, as the reference: the set of nodes within `hops` of `seeds`.
fn reference(g: &CsrGraph, seeds: &[u64], hops: u32) -> HashSet<u64> {
    let mut seen: HashSet<u64> = seeds.iter().copied().collect();
    let mut queue: VecDeque<(u64, u32)> = seeds.iter().map(|&s| (s, 0)).collect();
    while let Some((n, d)) = queue.pop_front() {
        if d == hops {
            continue;
        }
        for &m in g.neighbors(n) {
            if seen.insert(m) {
                queue.push_back((m, d + 1));
            }
        }
    }
    seen
}

#[test]
fn two_hop_subgraphs_gather_the_right_rows_from_memory_and_files() {
    let session = Session::new(Config::default()).unwrap();
    let nodes = 2000u64;
    let g = power_law(nodes, 7);
    let scores: Vec<f32> = (0..nodes)
        .map(|i| (pattern::mix64(i) % 1000) as f32)
        .collect();
    let seeds = graph_scatter(&scores, 8);
    let expansion = Expansion {
        hops: 2,
        ..Expansion::default()
    };
    for row_bytes in [256usize, 4096] {
        let mut pool =
            HostBuffer::alloc(nodes as usize * row_bytes, &HostAllocOptions::default()).unwrap();
        pattern::fill(&mut pool, 0, row_bytes as u64);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("embeddings");
        std::fs::write(&path, &pool[..]).unwrap();
        let file = session.open_file(&path, OpenOptions::READ).unwrap();
        let dst = session
            .alloc_device(0, nodes as usize * row_bytes + 64)
            .unwrap();
        for source in [Embeddings::Host(&pool), Embeddings::File(&file)] {
            let sub = graph_gather(
                &session, &g, &seeds, &expansion, source, row_bytes, &dst, 64,
            )
            .unwrap();
            let got: HashSet<u64> = sub.nodes.iter().copied().collect();
            assert_eq!(got.len(), sub.nodes.len(), "a node listed twice");
            assert_eq!(got, reference(&g, &seeds, 2));
            assert_eq!(&sub.nodes[..seeds.len()], &seeds[..]);
            let mut out = vec![0u8; sub.nodes.len() * row_bytes];
            dst.gpu()
                .stream()
                .unwrap()
                .download(&dst, 64, &mut out)
                .unwrap();
            for (i, &n) in sub.nodes.iter().enumerate() {
                let want = &pool[n as usize * row_bytes..(n as usize + 1) * row_bytes];
                assert!(
                    out[i * row_bytes..(i + 1) * row_bytes] == *want,
                    "row {i} (node {n})"
                );
            }
            // Every edge followed is an edge of the graph.
            for &(a, b) in &sub.edges {
                let (a, b) = (sub.nodes[a as usize], sub.nodes[b as usize]);
                assert!(g.neighbors(a).contains(&b), "{a} -> {b}");
            }
        }
    }
}
