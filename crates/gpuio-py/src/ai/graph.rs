//! Graph RAG gathers: a CSR graph, its k-hop expansion from seeds, the subgraph's
//! embeddings gathered into device memory (from host memory or a file), and the top-k of a
//! score vector.

use super::{f32s, indices, settle, shared_gpus, to_py};
use crate::buffers::{DeviceBuffer, HostBuffer, Resource};
use crate::error::{DetachIn, invalid};
use crate::session::Session;
use gpuio_ai::graph::{self, Embeddings, Expansion, Subgraph};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn subgraph<'py>(py: Python<'py>, s: &Subgraph) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("nodes", &s.nodes)?;
    d.set_item("hop_starts", &s.hop_starts)?;
    d.set_item("edges", &s.edges)?;
    Ok(d)
}

fn expansion(hops: u32, fanout: Option<usize>, seed: u64, max_nodes: usize) -> Expansion {
    Expansion {
        hops,
        fanout,
        seed,
        max_nodes,
    }
}

/// Adjacency in compressed sparse row form: node `n`'s neighbours are
/// `neighbors[offsets[n]..offsets[n + 1]]`.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct CsrGraph {
    graph: graph::CsrGraph,
}

#[pymethods]
impl CsrGraph {
    /// From little-endian u64 `offsets` and `neighbors` (checked).
    #[new]
    fn new(offsets: &Bound<'_, PyAny>, neighbors: &Bound<'_, PyAny>) -> PyResult<Self> {
        let graph = graph::CsrGraph::new(
            indices(offsets, "offsets")?.into_vec(),
            indices(neighbors, "neighbors")?.into_vec(),
        )
        .map_err(to_py)?;
        Ok(Self { graph })
    }

    /// Nodes in the graph.
    #[getter]
    fn nodes(&self) -> usize {
        self.graph.nodes()
    }

    /// Edges in the graph.
    #[getter]
    fn edges(&self) -> usize {
        self.graph.edges()
    }

    /// Node `n`'s neighbours.
    fn neighbors(&self, n: u64) -> Vec<u64> {
        self.graph.neighbors(n).to_vec()
    }

    /// Grows `seeds` by `hops` hops, keeping `fanout` neighbours per
    /// node per hop (all where None; `seed` picks them); the subgraph: `nodes` in the order
    /// reached, `hop_starts`, and the `edges` followed as local (from, to) pairs.
    #[pyo3(signature = (seeds, hops=2, fanout=None, seed=0, max_nodes=1 << 20))]
    fn expand<'py>(
        &self,
        py: Python<'py>,
        seeds: &Bound<'_, PyAny>,
        hops: u32,
        fanout: Option<usize>,
        seed: u64,
        max_nodes: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        let seeds = indices(seeds, "seeds")?;
        let e = expansion(hops, fanout, seed, max_nodes);
        let s = py
            .detach_kept(|| graph::expand(&self.graph, &seeds, &e))
            .map_err(to_py)?;
        subgraph(py, &s)
    }
}

/// The `k` highest of `scores` (little-endian f32s), best first; ties to the lower index,
/// NaN never.
#[pyfunction]
pub(crate) fn graph_scatter(py: Python<'_>, scores: &[u8], k: usize) -> PyResult<Vec<u64>> {
    let scores = f32s(scores, "scores")?;
    Ok(py.detach_kept(|| graph::graph_scatter(&scores, k)))
}

/// Where a gather's embeddings are.
enum Source {
    Host(gpuio_api::HostMemory),
    File(gpuio_api::FileHandle),
}

/// Expands `seeds` over `graph` and gathers the subgraph's embeddings (rows of `row_bytes`,
/// node `n`'s at `n * row_bytes` of `embeddings`: a gpuio HostBuffer or an opened file) into
/// `dst` from `dst_offset`; the subgraph.
#[pyfunction]
#[pyo3(signature = (session, graph, seeds, embeddings, row_bytes, dst, dst_offset=0, hops=2,
                    fanout=None, seed=0, max_nodes=1 << 20))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn graph_gather<'py>(
    py: Python<'py>,
    session: &Session,
    graph: &CsrGraph,
    seeds: &Bound<'_, PyAny>,
    embeddings: &Bound<'py, PyAny>,
    row_bytes: usize,
    dst: &DeviceBuffer,
    dst_offset: usize,
    hops: u32,
    fanout: Option<usize>,
    seed: u64,
    max_nodes: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let seeds = indices(seeds, "seeds")?;
    let e = expansion(hops, fanout, seed, max_nodes);
    let source = if let Ok(h) = embeddings.cast::<HostBuffer>() {
        Source::Host(h.get().mem.clone())
    } else if let Ok(r) = embeddings.cast::<Resource>() {
        match &r.get().res {
            gpuio_api::Resource::File(f) => Source::File(f.clone()),
            _ => return Err(invalid("embeddings in a resource must be a file")),
        }
    } else {
        return Err(invalid(
            "embeddings are a gpuio HostBuffer or an opened file",
        ));
    };
    let wait = shared_gpus(&[dst]);
    let session = session.session();
    let s = py
        .detach_in(session, || {
            settle(&wait)?;
            let guard;
            let embeddings = match &source {
                Source::Host(h) => {
                    guard = h.read();
                    Embeddings::Host(&guard)
                }
                Source::File(f) => Embeddings::File(f),
            };
            graph::graph_gather(
                session,
                &graph.graph,
                &seeds,
                &e,
                embeddings,
                row_bytes,
                &dst.buf,
                dst_offset,
            )
        })?
        .map_err(to_py)?;
    subgraph(py, &s)
}
