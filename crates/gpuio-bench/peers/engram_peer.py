# The Engram lookup peers for gpuio-bench's `ai` suite (B2): two tables of 256-byte rows in
# pinned host memory, and per step a batch of ids into each, gathered into device memory:
#   triton UVA: a Triton kernel reads the rows straight from the pinned tables over unified
#     addressing (vLLM's default Engram design);
#   CPU gather + copy: torch index_select on the CPU into a pinned staging buffer, then one
#     bulk copy to the device.
# Arguments: rows (per table), row_bytes, warmup, steps, then one trace file per batch:
# (warmup + steps) x 2 tables x n little-endian int64 ids. Prints one JSON line per trace and
# peer: {"trace": i, "mode": ..., "p50_us": ..., "p99_us": ...}; a peer that cannot run says
# why: {"error": ...}.
import json
import sys
import time

import numpy as np
import torch

rows, row_bytes, warmup, steps = map(int, sys.argv[1:5])
traces = sys.argv[5:]
dev = torch.device("cuda")
total = warmup + steps
words = row_bytes // 4

# The tables: allocated pinned and left as they are (only the rows' movement is timed; the
# Triton view is checked on rows written for it).
tables = [torch.empty((rows, words), dtype=torch.int32, pin_memory=True) for _ in range(2)]


def make_cpu_step(n):
    staged = [torch.empty((n, words), dtype=torch.int32, pin_memory=True) for _ in range(2)]
    outs = [torch.empty((n, words), dtype=torch.int32, device=dev) for _ in range(2)]

    def step(ids):
        for t in range(2):
            torch.index_select(tables[t], 0, ids[t], out=staged[t])
            outs[t].copy_(staged[t], non_blocking=True)
        torch.cuda.synchronize()

    return step


def make_triton_step():
    import cupy
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows(src, dst, ids, n, WORDS: tl.constexpr, ROWS: tl.constexpr):
        # ROWS rows per program, a row's words across the lanes.
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        m = r < n
        row = tl.load(ids + r, mask=m, other=0)
        w = tl.arange(0, WORDS)
        v = tl.load(src + row[:, None] * WORDS + w[None, :], mask=m[:, None])
        tl.store(dst + r[:, None] * WORDS + w[None, :], v, mask=m[:, None])

    def uva(t):
        # Under unified addressing a pinned allocation's device address is its host address.
        n = t.numel()
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), n * 4, t)
        arr = cupy.ndarray((n,), dtype=cupy.int32, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device=dev)

    views = [uva(t) for t in tables]
    # Check the view: rows the kernel gathers must be the table's rows.
    probe = torch.tensor([rows - 1, 0, rows // 2], dtype=torch.int64)
    for t in tables:
        t[probe] = torch.arange(3 * words, dtype=torch.int32).view(3, words) * 7 + 1
    out = torch.empty((3, words), dtype=torch.int32, device=dev)
    gather_rows[(1,)](views[0], out, probe.to(dev), 3, WORDS=words, ROWS=4)
    torch.cuda.synchronize()
    if not torch.equal(out.cpu(), tables[0][probe]):
        raise RuntimeError("the unified-addressing view of pinned memory read wrong bytes")

    def make(n):
        outs = [torch.empty((n, words), dtype=torch.int32, device=dev) for _ in range(2)]
        grid = ((n + 3) // 4,)

        def step(ids):
            for t in range(2):
                di = ids[t].to(dev, non_blocking=True)
                gather_rows[grid](views[t], outs[t], di, n, WORDS=words, ROWS=4)
            torch.cuda.synchronize()

        return step

    return make


makers = [("CPU gather + copy", make_cpu_step)]
try:
    makers.append(("triton UVA", make_triton_step()))
except Exception as e:  # noqa: BLE001 - any reason the peer cannot run is reported
    print(json.dumps({"error": f"triton UVA peer unavailable: {type(e).__name__}: {e}"}), flush=True)

for i, path in enumerate(traces):
    ids_all = np.fromfile(path, dtype="<i8").reshape(total, 2, -1)
    n = ids_all.shape[2]
    # The ids as pinned tensors, made before the clock starts.
    batches = [
        [torch.from_numpy(ids_all[s, t].copy()).pin_memory() for t in range(2)] for s in range(total)
    ]
    for name, make in makers:
        step = make(n)
        times = []
        for s in range(total):
            t0 = time.perf_counter()
            step(batches[s])
            if s >= warmup:
                times.append((time.perf_counter() - t0) * 1e6)
        times.sort()
        p99 = times[min(len(times) - 1, round((len(times) - 1) * 0.99))]
        print(
            json.dumps({"trace": i, "mode": name, "p50_us": times[len(times) // 2], "p99_us": p99}),
            flush=True,
        )
