# kvikio as a user runs it, for gpuio-bench: read a file into GPU memory with KVIKIO_NTHREADS
# threads (warm page cache, or cold after dropping the file's pages), or random 4 KiB reads
# through pread futures. Prints one JSON line: {"bytes_per_s": ..., "iops": ...}.
import json
import os
import random
import sys
import time

import cupy
import kvikio

path, size, mode, reps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])


def drop_cache():
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn):
    fn()  # warm-up: CUDA context, kvikio thread pool, buffers
    times = []
    for _ in range(reps):
        if mode == "cold":
            drop_cache()
        cupy.cuda.runtime.deviceSynchronize()
        t = time.perf_counter()
        fn()
        cupy.cuda.runtime.deviceSynchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


with kvikio.CuFile(path, "r") as f:
    if mode in ("warm", "cold"):
        buf = cupy.empty(size, dtype=cupy.uint8)
        t = timed(lambda: f.read(buf))
        print(json.dumps({"bytes_per_s": size / t, "iops": 0}))
    elif mode == "rand4k":
        n = 65536
        blocks = size // 4096
        buf = cupy.empty(n * 4096, dtype=cupy.uint8)
        rng = random.Random(1)
        offsets = [rng.randrange(blocks) * 4096 for _ in range(n)]

        def run():
            futures = [f.pread(buf[i * 4096:(i + 1) * 4096], 4096, off) for i, off in enumerate(offsets)]
            for fut in futures:
                fut.get()

        t = timed(run)
        print(json.dumps({"bytes_per_s": n * 4096 / t, "iops": n / t}))
    else:
        sys.exit(f"unknown mode {mode}")
