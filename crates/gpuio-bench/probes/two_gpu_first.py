"""Why two GPUs' first reads do not run at twice one GPU's: a 4 GiB warm file read through the
lanes (page-cache path off, so every read is staged) onto one GPU whole and onto two GPUs
half each, side by side, four times in one fresh process per case; then what the lanes'
staging costs to make: populating 256 MiB of fresh anonymous memory (transparent huge pages
and 4 KiB pages) on 1, 2 and 8 threads, and registering it with the driver.

    python two_gpu_first.py [SCRATCH_DIR]

Prints one JSON line per case: GB/s and each device's milliseconds per read (the first is a
fresh process's first transfer; the later ones find the lanes made), and the staging costs
in milliseconds.
"""

import json
import os
import subprocess
import sys

from scratch import random_file

READS = r"""
import json, os, sys, threading, time, torch
path, ndev, toml = sys.argv[1], int(sys.argv[2]), sys.argv[3]
devs = [f"cuda:{i}" for i in range(ndev)]
n = os.path.getsize(path) // ndev // 4096 * 4096
bufs = [torch.empty(n, dtype=torch.uint8, device=d) for d in devs]
torch.cuda.synchronize()
import gpuio
s = gpuio.Session(toml=toml)
f = s.open(path)
out = {}
def one(i, ms):
    t = time.perf_counter()
    s.read(f, bufs[i], offset=i * n)
    ms[i] = round((time.perf_counter() - t) * 1e3, 1)
for rep in range(4):
    ms = [0.0] * ndev
    threads = [threading.Thread(target=one, args=(i, ms)) for i in range(ndev)]
    t = time.perf_counter()
    for th in threads: th.start()
    for th in threads: th.join()
    out[f"read{rep}"] = {"GBps": round(n * ndev / (time.perf_counter() - t) / 1e9, 1), "ms": ms}
print(json.dumps(out))
"""

STAGING = r"""
import ctypes, json, mmap, threading, time, torch
torch.empty(1, device="cuda:0")
cuda = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
LEN, COUNT, HUGE = 16 << 20, 16, 2 << 20
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23
def anon(huge):
    p = libc.mmap(None, LEN + HUGE, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert p not in (None, 2**64 - 1), "mmap failed"
    p = (p + HUGE - 1) & ~(HUGE - 1)
    if huge:
        libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(LEN), MADV_HUGEPAGE)
    return p
def populate(ptrs):
    for p in ptrs:
        assert libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(LEN), MADV_POPULATE_WRITE) == 0
def register(ptrs):
    assert cuda.cuCtxSetCurrent(ctx) == 0
    for p in ptrs:
        assert cuda.cuMemHostRegister_v2(ctypes.c_void_p(p), ctypes.c_size_t(LEN), 3) == 0
def on_threads(work, ptrs, k):
    threads = [threading.Thread(target=work, args=(ptrs[i::k],)) for i in range(k)]
    t = time.perf_counter()
    for th in threads: th.start()
    for th in threads: th.join()
    return round((time.perf_counter() - t) * 1e3, 2)
out = {}
for huge in (True, False):
    for k in (1, 2, 8):
        ptrs = [anon(huge) for _ in range(COUNT)]
        name = f"{'thp' if huge else '4k'}_{k}_threads"
        out[name + "_populate_ms"] = on_threads(populate, ptrs, k)
        out[name + "_register_ms"] = on_threads(register, ptrs, k)
print(json.dumps(out))
"""


def main():
    scratch = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    path = os.path.join(scratch, "two_gpu_first.bin")
    random_file(path, 4 << 30)
    staged = '[localio]\npage_cache = "off"\n'
    for name, toml in (("4 MiB chunks", staged), ("2 MiB chunks", staged + 'chunk_size = "2 MiB"\n')):
        for ndev in (1, 2):
            r = subprocess.run([sys.executable, "-c", READS, path, str(ndev), toml],
                               capture_output=True, text=True, timeout=300)
            print(json.dumps({"case": name, "gpus": ndev,
                              "reads": json.loads(r.stdout) if r.returncode == 0 else r.stderr[-500:]}),
                  flush=True)
    r = subprocess.run([sys.executable, "-c", STAGING], capture_output=True, text=True, timeout=300)
    print(r.stdout.strip() if r.returncode == 0 else r.stderr[-500:], flush=True)
    os.unlink(path)


if __name__ == "__main__":
    main()
