"""Graph RAG gathers from Python: the top-k nodes of a score vector, their k-hop expansion
over a CSR graph, and the subgraph's embeddings gathered from a file into GPU memory in the
order the nodes were reached.

    python graph_rag.py [--scratch DIR]

Runs on the host backend too. Checks every embedding against the file.
"""

import argparse
import os
import tempfile

import numpy as np

import gpuio
import gpuio.ai as ai

NODES, DEGREE, DIM = 10_000, 8, 64


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scratch", default=tempfile.gettempdir())
    args = p.parse_args()
    rng = np.random.default_rng(3)
    s = gpuio.Session()
    neighbors = rng.integers(0, NODES, NODES * DEGREE, dtype=np.int64)
    offsets = np.arange(0, NODES * DEGREE + 1, DEGREE, dtype=np.int64)
    graph = ai.CsrGraph(offsets, neighbors)
    emb = rng.standard_normal((NODES, DIM)).astype(np.float32)
    path = os.path.join(args.scratch, f"embeddings-{os.getpid()}.bin")
    emb.tofile(path)
    try:
        scores = emb @ rng.standard_normal(DIM).astype(np.float32)
        seeds = ai.graph_scatter(scores, 4)  # the vector index's top 4
        assert seeds[0] == int(np.argmax(scores))
        row = DIM * 4
        out = s.alloc_device(2048 * row)
        sub = ai.graph_gather(s, graph, seeds, path, out, row_bytes=row, hops=2, fanout=4,
                              max_nodes=2048)
    finally:
        os.remove(path)
    n = len(sub["nodes"])
    got = np.empty(n * DIM, dtype=np.float32)
    s.copy(out, got, size=n * row)
    assert np.array_equal(got.reshape(n, DIM), emb[sub["nodes"]])
    print(f"{n} nodes in {len(sub['hop_starts']) - 1} hops, {len(sub['edges'])} edges")
    print("graph_rag: ok")


if __name__ == "__main__":
    main()
