# A CPU gather as a PyTorch user runs it, for gpuio-bench: torch.index_select on a pinned host
# pool (all cores, torch's default intra-op threads) into pinned memory, then one copy to the
# GPU. Arguments: pool_bytes, comma-separated row sizes, the directory of gpuio's index lists
# (`<row>-uniform.u64` and `<row>-distinct.u64`: little-endian int64, so torch gathers the very
# rows gpuio did), reps, latency rows (0: none) and the latency case's row size. Prints one
# JSON line per row size and list: {"row": B, "list": "uniform"|"distinct", "rows": N,
# "bytes_per_s": ...}, then the latency line {"row": B, "rows": N, "latency_p50_s": ...}.
import json
import os
import sys
import time

import torch

pool_bytes, rows_arg, list_dir, reps, lat_rows, lat_row = sys.argv[1:7]
pool_bytes, reps, lat_rows, lat_row = map(int, (pool_bytes, reps, lat_rows, lat_row))
pool = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)
pool.fill_(7)
gen = torch.Generator().manual_seed(int(time.time_ns()) & 0xFFFFFFFF)


def run(rb, idx, reps):
    n = idx.numel()
    rows = pool_bytes // rb
    table = pool[: rows * rb].view(rows, rb)
    staged = torch.empty((n, rb), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty((n, rb), dtype=torch.uint8, device="cuda")

    def once():
        torch.index_select(table, 0, idx, out=staged)
        dst.copy_(staged, non_blocking=True)
        torch.cuda.synchronize()

    once()
    once()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def load(path):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.int64)


for rb in map(int, rows_arg.split(",")):
    for kind in ("uniform", "distinct"):
        idx = load(os.path.join(list_dir, f"{rb}-{kind}.u64"))
        t = run(rb, idx, reps)
        n = idx.numel()
        print(json.dumps({"row": rb, "list": kind, "rows": n, "bytes_per_s": n * rb / t}), flush=True)
if lat_rows:
    rb = lat_row
    t = run(rb, torch.randint(pool_bytes // rb, (lat_rows,), generator=gen), max(reps * 20, 100))
    print(json.dumps({"row": rb, "rows": lat_rows, "latency_p50_s": t}), flush=True)
