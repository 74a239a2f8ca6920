# A GPU-to-GPU copy as torch users write it, for gpuio-bench: dst.copy_(src) from cuda:0 to the
# last GPU in one process (peer access over NVLink where the GPUs have it), synchronized after
# each call as gpuio's calls are. For each size given, runs for about `seconds` and prints one
# JSON line: {"size": ..., "bytes_per_s": ...}.
import json
import sys
import time

import torch

seconds, sizes = float(sys.argv[1]), [int(s) for s in sys.argv[2:]]
last = torch.cuda.device_count() - 1
src = torch.empty(max(sizes), dtype=torch.uint8, device="cuda:0")
dst = torch.empty(max(sizes), dtype=torch.uint8, device=f"cuda:{last}")
for size in sizes:
    a, b = src[:size], dst[:size]
    b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(last)
    n, start = 0, time.perf_counter()
    while n == 0 or time.perf_counter() - start < seconds:
        b.copy_(a)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(last)
        n += 1
    elapsed = time.perf_counter() - start
    print(json.dumps({"size": size, "bytes_per_s": n * size / elapsed}), flush=True)
