//! B4 — graph gather: a power-law graph (out-degrees mostly small, a few hubs; edges pointing
//! at Zipf-popular nodes) in CSR, node embeddings of 256 B and 4 KiB in pinned host memory and
//! in a file, and per batch 1024 Zipf-chosen seeds expanded 2 hops with a fanout of 10, every
//! node's embedding gathered into one device buffer.
//!
//! gpuio's `graph_gather` (expansion on the host, then MemIO's row gather from memory or
//! LocalIO's block reads from the file) races a torch-geometric-style peer: neighbours sampled
//! on the CPU with NumPy, `index_select` from a pinned tensor (or fancy indexing of a memory
//! map of the same file) and one copy to the device. Both time the whole batch (sampling
//! included), wall clock, p50.

use super::{ai, engram::zipf_ids, percentile};
use crate::{BenchError, Record, Result, Target};
use gpuio_ai::graph::{CsrGraph, Embeddings, Expansion, graph_gather};
use gpuio_api::{HostPlacement, OpenOptions, Session};
use gpuio_hal::pattern::{fill, mix64};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// B4's sizes.
#[derive(Debug, Clone)]
pub struct GraphOptions {
    /// Nodes.
    pub nodes: u64,
    /// Embedding row sizes.
    pub row_bytes: Vec<usize>,
    /// Seeds per batch.
    pub seeds: usize,
    /// Neighbours kept per node and hop.
    pub fanout: usize,
    /// Untimed batches, then timed ones.
    pub warmup: usize,
    /// Timed batches.
    pub steps: usize,
}

impl Default for GraphOptions {
    fn default() -> Self {
        Self {
            nodes: 1 << 20,
            row_bytes: vec![256, 4096],
            seeds: 1024,
            fanout: 10,
            warmup: 3,
            steps: 10,
        }
    }
}

impl GraphOptions {
    /// A small run.
    pub fn quick() -> Self {
        Self {
            nodes: 1 << 16,
            row_bytes: vec![256],
            seeds: 256,
            warmup: 1,
            steps: 3,
            ..Self::default()
        }
    }
}

/// A power-law graph: out-degree 2..17, one node in 64 a hub of 200; targets Zipf-popular.
fn power_law(nodes: u64, seed: u64) -> Result<CsrGraph> {
    let mut offsets = Vec::with_capacity(nodes as usize + 1);
    offsets.push(0u64);
    let mut degrees = Vec::with_capacity(nodes as usize);
    for n in 0..nodes {
        let h = mix64(n ^ seed);
        let d = if h.is_multiple_of(64) {
            200
        } else {
            2 + h % 16
        };
        degrees.push(d);
        offsets.push(offsets[n as usize] + d);
    }
    let edges = offsets[nodes as usize] as usize;
    let neighbors = zipf_ids(nodes, 0.8, edges, seed ^ 0x9e37, seed ^ 0x9e37);
    CsrGraph::new(offsets, neighbors).map_err(ai)
}

fn write_u64s(path: &Path, words: impl Iterator<Item = u64>) -> Result<()> {
    let err = |e: std::io::Error| BenchError::Output {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(err)?);
    for w in words {
        f.write_all(&w.to_le_bytes()).map_err(err)?;
    }
    f.flush().map_err(err)
}

/// Runs B4.
pub(super) fn run(
    session: &Session,
    opts: &GraphOptions,
    scratch: &Path,
    device: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let seed = crate::fresh_seed();
    progress(&format!("graph: {} nodes, power law", opts.nodes));
    let graph = power_law(opts.nodes, seed)?;
    let dir = scratch.join(format!("gpuio-graph-{}", std::process::id()));
    let io = |e: std::io::Error| BenchError::Output {
        path: dir.display().to_string(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let (offsets, neighbors) = (dir.join("offsets.u64"), dir.join("neighbors.u64"));
    let mut at = 0u64;
    let mut offs = vec![0u64];
    for n in 0..graph.nodes() as u64 {
        at += graph.neighbors(n).len() as u64;
        offs.push(at);
    }
    write_u64s(&offsets, offs.into_iter())?;
    write_u64s(
        &neighbors,
        (0..graph.nodes() as u64).flat_map(|n| graph.neighbors(n).iter().copied()),
    )?;
    let batches: Vec<Vec<u64>> = (0..(opts.warmup + opts.steps) as u64)
        .map(|b| zipf_ids(opts.nodes, 0.8, opts.seeds, seed ^ b << 20, seed ^ b << 20))
        .collect();
    let seeds_file = dir.join("seeds.u64");
    write_u64s(&seeds_file, batches.iter().flatten().copied())?;
    let expansion = Expansion {
        hops: 2,
        fanout: Some(opts.fanout),
        seed,
        max_nodes: usize::MAX,
    };
    let most = opts.seeds * (1 + opts.fanout + opts.fanout * opts.fanout);
    let (mut records, mut notes) = (Vec::new(), Vec::new());
    for &row in &opts.row_bytes {
        progress(&format!("graph: {row} B embeddings"));
        let len = opts.nodes as usize * row;
        let pool = session.alloc_host(HostPlacement::Dram { numa: None }, len, true)?;
        fill(&mut pool.write(), 0, seed ^ row as u64);
        let path = dir.join(format!("emb-{row}.bin"));
        std::fs::write(&path, &pool.read()[..]).map_err(io)?;
        let file = session.open_file(&path, OpenOptions::READ)?;
        let dst = session.alloc_device(0, most * row)?;
        let mut ours = Vec::new();
        for (name, source) in [
            ("host memory", Embeddings::Host(&pool.read())),
            ("file", Embeddings::File(&file)),
        ] {
            let mut times = Vec::new();
            let mut rows = 0;
            for (b, seeds) in batches.iter().enumerate() {
                let t = Instant::now();
                let sub = graph_gather(session, &graph, seeds, &expansion, source, row, &dst, 0)
                    .map_err(ai)?;
                if b >= opts.warmup {
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                    rows += sub.nodes.len();
                }
                if b + 1 == batches.len() {
                    check(&dst, &sub.nodes, row, seed ^ row as u64)?;
                }
            }
            ours.push((name, percentile(&mut times, 0.5), rows / opts.steps.max(1)));
        }
        progress(&format!("graph: {row} B embeddings: peer"));
        let peer = crate::peers::graph(&offsets, &neighbors, &seeds_file, &path, row, opts);
        for (name, p50, rows) in ours {
            let case = format!("graph 2-hop, {row} B rows from {name}");
            let peer_p50 = match &peer {
                Ok(found) => found.iter().find(|p| p.mode == name).map(|p| p.p50_us),
                Err(why) => {
                    notes.push(format!("{case}: {why}"));
                    None
                }
            };
            let mut r = Record::versus(
                super::SUITE,
                (&case, "batch p50", "µs"),
                p50,
                "torch-geometric style (CPU sampling + index_select + copy)",
                peer_p50.unwrap_or(0.0),
                false,
            );
            r.route = format!("{rows} nodes per batch");
            r.device = device.to_string();
            r.reps = opts.steps;
            r.bytes = rows * row;
            records.push(r);
        }
        let _ = std::fs::remove_file(&path);
    }
    let _ = std::fs::remove_dir_all(&dir);
    notes.push(format!(
        "B4: {} nodes, {} edges; the file case reads through gpuio's LocalIO path, the peer \
         through the page cache (the file was just written, so it is cached)",
        graph.nodes(),
        graph.edges()
    ));
    Ok((records, Vec::new(), notes))
}

/// The last batch's rows must be the nodes' embeddings.
fn check(dst: &gpuio_api::DeviceBuffer, nodes: &[u64], row: usize, seed: u64) -> Result<()> {
    let mut got = vec![0u8; nodes.len() * row];
    dst.gpu().stream()?.download(dst, 0, &mut got)?;
    let mut want = vec![0u8; row];
    for (i, &n) in nodes.iter().enumerate() {
        fill(&mut want, n * row as u64, seed);
        if got[i * row..(i + 1) * row] != want[..] {
            return Err(BenchError::Corrupt {
                case: format!("graph gather of node {n}"),
                size: nodes.len() * row,
                offset: (i * row) as u64,
            });
        }
    }
    Ok(())
}
