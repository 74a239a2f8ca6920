# A CPU gather as a PyTorch user runs it, for gpuio-bench: torch.index_select on a pinned host
# pool (all cores, torch's default intra-op threads) into pinned memory, then one copy to the
# GPU. Arguments: pool_bytes, comma-separated row sizes, max output bytes, max rows, reps, and
# latency rows (0: none). Prints one JSON line per row size:
# {"row": B, "rows": N, "bytes_per_s": ..., "latency_p50_s": ... (latency line only)}.
import json
import sys
import time

import torch

pool_bytes, rows_arg, max_bytes, max_rows, reps, lat_rows = sys.argv[1:7]
pool_bytes, max_bytes, max_rows, reps, lat_rows = map(int, (pool_bytes, max_bytes, max_rows, reps, lat_rows))
pool = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)
pool.fill_(7)
gen = torch.Generator().manual_seed(int(time.time_ns()) & 0xFFFFFFFF)


def run(rb, n, reps):
    rows = pool_bytes // rb
    table = pool[: rows * rb].view(rows, rb)
    idx = torch.randint(rows, (n,), generator=gen)
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


for rb in map(int, rows_arg.split(",")):
    n = min(max_rows, max_bytes // rb)
    t = run(rb, n, reps)
    print(json.dumps({"row": rb, "rows": n, "bytes_per_s": n * rb / t}), flush=True)
if lat_rows:
    rb = int(rows_arg.split(",")[0])
    t = run(rb, lat_rows, max(reps * 20, 100))
    print(json.dumps({"row": rb, "rows": lat_rows, "latency_p50_s": t}), flush=True)
