# A model load as torch users write it, for gpuio-bench: each file read whole into host memory
# (what safetensors' load_file does for a CPU load), then moved to the GPU with .cuda(). With
# "cold", the files' pages are dropped before each load. Prints one JSON line:
# {"bytes_per_s": ..., "iops": 0}.
import json
import os
import sys
import time

import torch

mode, reps, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
total = sum(os.path.getsize(p) for p in paths)


def drop_cache():
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load():
    tensors = []
    for p in paths:
        with open(p, "rb") as f:
            data = bytearray(f.read())
        tensors.append(torch.frombuffer(data, dtype=torch.uint8).cuda())
    torch.cuda.synchronize()
    return tensors


load()  # warm-up: CUDA context, allocator
times = []
for _ in range(reps):
    if mode == "cold":
        drop_cache()
    t = time.perf_counter()
    out = load()
    times.append(time.perf_counter() - t)
    del out
times.sort()
print(json.dumps({"bytes_per_s": total / times[len(times) // 2], "iops": 0}))
