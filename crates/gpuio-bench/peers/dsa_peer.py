# The DSA decode peers for gpuio-bench's `ai` suite: the hot-buffer scheme gpuio's KvPool runs
# (per request a pool of KV entries in pinned host memory and a buffer of `hot_slots` device
# slots; each step's misses replace the slots selected longest ago, never one this step
# selected), planned here in NumPy before any clock starts, so that the peers are timed only
# moving data:
#   torch index_select: the misses gathered on the CPU from the pinned pool, copied to the GPU
#     and put in their slots, then the selection gathered from the slots on the device;
#   triton UVA: a Triton kernel reads the misses straight from the pinned pool over unified
#     addressing into their slots (vLLM's design), then the same device gather.
# Each step is timed twice: on the device (CUDA events around its work: the time the GPU's
# timeline spends on it, gaps while the host launches included) and by the wall clock.
# Arguments: ctx, batch, topk, hot_slots, warmup, steps, then one trace file per overlap:
# (warmup + steps) x batch x topk little-endian int64 positions. Prints one JSON line per
# trace and peer: {"trace": i, "mode": ..., "p50_us": ..., "p99_us": ..., "wall_p50_us": ...,
# "wall_p99_us": ...} (p50/p99: device time); a peer that cannot run says why: {"error": ...}.
import json
import sys
import time

import numpy as np
import torch

ENTRY = 656
ctx, batch, topk, hot, warmup, steps = map(int, sys.argv[1:7])
traces = sys.argv[7:]
dev = torch.device("cuda")
total = warmup + steps

pools = [torch.empty((ctx, ENTRY), dtype=torch.uint8, pin_memory=True) for _ in range(batch)]
staged = [torch.empty((topk, ENTRY), dtype=torch.uint8, pin_memory=True) for _ in range(batch)]
hots = [torch.empty((hot, ENTRY), dtype=torch.uint8, device=dev) for _ in range(batch)]
outs = [torch.empty((topk, ENTRY), dtype=torch.uint8, device=dev) for _ in range(batch)]


def plan(path):
    """Per step, per request: the distinct misses, the slots they take, and each selected
    entry's slot afterwards."""
    sel_all = np.fromfile(path, dtype="<i8").reshape(total, batch, topk)
    state = [
        (np.full(ctx, -1, np.int64), np.full(hot, -1, np.int64), np.zeros(hot, np.int64))
        for _ in range(batch)
    ]
    plans = []
    for s in range(total):
        step = s + 1
        row = []
        for r in range(batch):
            slot_of, pos_of, last = state[r]
            sel = sel_all[s, r]
            slots = slot_of[sel]
            hit = slots >= 0
            last[slots[hit]] = step
            miss = np.unique(sel[~hit])
            m = len(miss)
            victims = np.empty(0, np.int64)
            if m:
                cand = np.nonzero(last != step)[0]
                if m < len(cand):
                    victims = cand[np.argpartition(last[cand], m - 1)[:m]]
                else:
                    victims = cand[:m]
                old = pos_of[victims]
                slot_of[old[old >= 0]] = -1
                pos_of[victims] = miss
                slot_of[miss] = victims
                last[victims] = step
            row.append((miss, victims, slot_of[sel].copy()))
        plans.append(row)
    return plans


def torch_step(row):
    for r, (miss, victims, out_slots) in enumerate(row):
        if len(miss):
            st = staged[r][: len(miss)]
            torch.index_select(pools[r], 0, torch.from_numpy(miss), out=st)
            vi = torch.from_numpy(victims).to(dev, non_blocking=True)
            hots[r].index_copy_(0, vi, st.to(dev, non_blocking=True))
        oi = torch.from_numpy(out_slots).to(dev, non_blocking=True)
        torch.index_select(hots[r], 0, oi, out=outs[r])


def make_triton_step():
    import cupy
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows(src, dst, src_rows, dst_rows, row_bytes, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        s = tl.load(src_rows + i)
        d = tl.load(dst_rows + i)
        o = tl.arange(0, BLOCK)
        m = o < row_bytes
        v = tl.load(src + s * row_bytes + o, mask=m)
        tl.store(dst + d * row_bytes + o, v, mask=m)

    def uva(t):
        # Under unified addressing a pinned allocation's device address is its host address.
        n = t.numel()
        mem = cupy.cuda.UnownedMemory(t.data_ptr(), n, t)
        arr = cupy.ndarray((n,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        return torch.as_tensor(arr, device=dev)

    views = [uva(p) for p in pools]
    # Check the view once: two rows copied by the kernel must be the pool's rows.
    pools[0][:2].copy_(torch.arange(2 * ENTRY, dtype=torch.int64).remainder(251).view(2, ENTRY))
    rows = torch.tensor([1, 0], device=dev)
    copy_rows[(2,)](views[0], hots[0], rows, torch.tensor([0, 1], device=dev), ENTRY, BLOCK=1024)
    torch.cuda.synchronize()
    if not torch.equal(hots[0][:2].cpu(), pools[0][[1, 0]]):
        raise RuntimeError("the unified-addressing view of pinned memory read wrong bytes")

    def step(row):
        for r, (miss, victims, out_slots) in enumerate(row):
            if len(miss):
                mi = torch.from_numpy(miss).to(dev, non_blocking=True)
                vi = torch.from_numpy(victims).to(dev, non_blocking=True)
                copy_rows[(len(miss),)](views[r], hots[r], mi, vi, ENTRY, BLOCK=1024)
            oi = torch.from_numpy(out_slots).to(dev, non_blocking=True)
            torch.index_select(hots[r], 0, oi, out=outs[r])

    return step


modes = [("torch index_select", torch_step)]
try:
    modes.append(("triton UVA", make_triton_step()))
except Exception as e:  # noqa: BLE001 - any reason the peer cannot run is reported
    print(json.dumps({"error": f"triton UVA peer unavailable: {type(e).__name__}: {e}"}), flush=True)

def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, round((len(v) - 1) * q))]


start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for i, path in enumerate(traces):
    plans = plan(path)
    for name, step in modes:
        device, wall = [], []
        for s, row in enumerate(plans):
            t = time.perf_counter()
            start.record()
            step(row)
            end.record()
            end.synchronize()
            if s >= warmup:
                wall.append((time.perf_counter() - t) * 1e6)
                device.append(start.elapsed_time(end) * 1e3)
        print(
            json.dumps(
                {
                    "trace": i,
                    "mode": name,
                    "p50_us": pct(device, 0.5),
                    "p99_us": pct(device, 0.99),
                    "wall_p50_us": pct(wall, 0.5),
                    "wall_p99_us": pct(wall, 0.99),
                }
            ),
            flush=True,
        )
