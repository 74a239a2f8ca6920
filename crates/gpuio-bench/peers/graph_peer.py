# The graph gather peer for gpuio-bench's `ai` suite (B4), torch-geometric style: per batch,
# the seeds' neighbourhoods sampled on the CPU with NumPy (2 hops, up to `fanout` neighbours
# per node, like NeighborSampler), the nodes made unique, their embeddings gathered on the CPU
# (index_select from a pinned tensor, or fancy indexing of a memory map of the file) and
# copied to the device in one transfer. Timed per batch, sampling included (wall clock).
# Arguments: offsets.u64, neighbors.u64, seeds.u64, embeddings file, row_bytes, seeds per
# batch, fanout, warmup, steps. Prints {"trace": 0, "mode": "host memory" | "file", "p50_us":
# ..., "p99_us": ...}; errors: {"error": ...}.
import json
import sys
import time

import numpy as np
import torch

offsets_p, neighbors_p, seeds_p, emb_p = sys.argv[1:5]
row_bytes, per_batch, fanout, warmup, steps = map(int, sys.argv[5:10])
dev = torch.device("cuda")
offsets = np.fromfile(offsets_p, dtype="<i8")
neighbors = np.fromfile(neighbors_p, dtype="<i8")
seeds_all = np.fromfile(seeds_p, dtype="<i8").reshape(-1, per_batch)
nodes = len(offsets) - 1
rng = np.random.default_rng(7)


def sample(seeds):
    frontier = np.unique(seeds)
    found = [frontier]
    for _ in range(2):
        starts, ends = offsets[frontier], offsets[frontier + 1]
        deg = ends - starts
        take = np.minimum(deg, fanout)
        # Up to `fanout` neighbours per node, drawn with replacement as NeighborSampler does
        # for speed; a node with fewer keeps all its draws within its own list.
        rows = np.repeat(np.arange(len(frontier)), take)
        pick = (rng.random(len(rows)) * np.repeat(deg, take)).astype(np.int64)
        nxt = neighbors[np.repeat(starts, take) + pick]
        frontier = np.unique(nxt)
        found.append(frontier)
    return np.unique(np.concatenate(found))


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * q))]


words = row_bytes // 4
raw = np.fromfile(emb_p, dtype=np.int32).reshape(nodes, words)
pinned = torch.from_numpy(raw).pin_memory()
mapped = np.memmap(emb_p, dtype=np.int32, mode="r", shape=(nodes, words))
# Gathered rows land in pinned staging (the best case of a pinned-memory loader), then one copy.
staging = torch.empty((per_batch * (1 + fanout + fanout * fanout), words), dtype=torch.int32).pin_memory()

for mode in ["host memory", "file"]:
    times = []
    for b in range(warmup + steps):
        t = time.perf_counter()
        idx = sample(seeds_all[b])
        st = staging[: len(idx)]
        if mode == "host memory":
            torch.index_select(pinned, 0, torch.from_numpy(idx), out=st)
        else:
            np.take(mapped, idx, axis=0, out=st.numpy())
        out = st.to(dev, non_blocking=True)
        torch.cuda.synchronize()
        if b >= warmup:
            times.append((time.perf_counter() - t) * 1e6)
        del out
    print(
        json.dumps({"trace": 0, "mode": mode, "p50_us": pct(times, 0.5), "p99_us": pct(times, 0.99)}),
        flush=True,
    )
