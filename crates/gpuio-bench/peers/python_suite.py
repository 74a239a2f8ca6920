# gpuio's Python binding measured as users call it, for gpuio-bench's python suite. Prints one
# JSON line. Modes:
#   overhead PATH CALLS   4 KiB reads at scattered offsets of a page-cached file, one call at a
#                         time: into a gpuio host buffer (in place) and into a bytearray (copied
#                         over); per-call p50 and mean in ns.
#   load PATH REPS        the whole file into a torch CUDA tensor: gpuio's read, torch's way (read
#                         the bytes, then .cuda()), kvikio's read where installed; median B/s,
#                         each result checked against torch's.
import json
import os
import sys
import time

try:
    import gpuio
except ImportError as e:
    sys.exit(f"the gpuio Python package is not importable ({e}): pip install crates/gpuio-py")

mode, path = sys.argv[1], sys.argv[2]
s = gpuio.Session()
f = s.open(path)
size = f.size()

if mode == "overhead":
    calls = int(sys.argv[3])
    pages = max(size // 4096, 1)
    offsets = [(i * 7919 % pages) * 4096 for i in range(calls)]

    def per_call(dst):
        for o in offsets[: min(calls, 2000)]:
            s.read(f, dst, offset=o)
        lat = []
        clock = time.perf_counter_ns
        for o in offsets:
            t = clock()
            s.read(f, dst, offset=o)
            lat.append(clock() - t)
        lat.sort()
        return lat[len(lat) // 2], sum(lat) / len(lat)

    host_p50, host_mean = per_call(s.alloc_host(4096))
    copy_p50, copy_mean = per_call(bytearray(4096))
    print(json.dumps({"host_p50_ns": host_p50, "host_mean_ns": host_mean,
                      "bytearray_p50_ns": copy_p50, "bytearray_mean_ns": copy_mean}))
elif mode == "load":
    import torch

    reps = int(sys.argv[3])
    ours = torch.empty(size, dtype=torch.uint8, device="cuda")
    peer = torch.empty_like(ours)

    def timed(fn):
        fn()  # warm-up: allocations, the page cache
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        times.sort()
        return size / times[len(times) // 2]

    def torch_way():
        with open(path, "rb") as fh:
            data = bytearray(fh.read())
        peer.copy_(torch.frombuffer(data, dtype=torch.uint8).cuda())

    out = {"gpuio_bps": timed(lambda: s.read(f, ours)), "torch_bps": timed(torch_way)}
    out["gpuio_correct"] = bool(torch.equal(ours, peer))
    try:
        import kvikio

        other = torch.zeros_like(ours)

        def kvikio_read():
            with kvikio.CuFile(path, "r") as kf:
                kf.read(other)

        out["kvikio_bps"] = timed(kvikio_read)
        out["kvikio_correct"] = bool(torch.equal(other, peer))
    except ImportError as e:
        out["kvikio_absent"] = str(e)
    print(json.dumps(out))
else:
    sys.exit(f"unknown mode {mode}")
