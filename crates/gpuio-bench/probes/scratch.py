"""What the probes share: a file of random bytes to read, dropping the page cache, a fresh
process reading a file into cuda:0 through gpuio, reader threads timed together, and the
disk's queue settings."""

import os
import subprocess
import sys
import threading
import time

# argv: the file (a path or URI), a session's TOML, the bytes to read. Prints GB/s.
GPUIO_READ = r"""
import sys, time, torch, gpuio
t = torch.empty(int(sys.argv[3]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
s = gpuio.Session(toml=sys.argv[2])
t0 = time.perf_counter()
s.read(s.open(sys.argv[1]), t)
print(round(t.numel() / (time.perf_counter() - t0) / 1e9, 2))
"""


def random_file(path, size):
    """Writes `size` bytes (a multiple of 16 MiB) of one random 16 MiB block repeated to
    `path`, durably, unless a file of that size is there already."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    block = os.urandom(16 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        os.fsync(f.fileno())


def drop_cache():
    """Writes dirty pages back, then drops the page cache (needs root)."""
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run_child(script, *args, env=None):
    """Runs `script` in a fresh Python with `args` (and `env` over this one's): what it
    printed, or the tail of its errors."""
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, **(env or {})})
    return r.stdout.strip() or r.stderr[-300:]


def timed_threads(work, args):
    """Runs `work(*a)` on a thread per `a` of `args`, all started together; each returns the
    bytes it read. GB/s over all of them."""
    got = []
    ts = [threading.Thread(target=lambda a=a: got.append(work(*a))) for a in args]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return round(sum(got) / (time.perf_counter() - t0) / 1e9, 2)


def disk_settings(path):
    """The queue settings of the block device holding `path`."""
    dev = os.stat(path).st_dev
    block = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    q = block + "/queue" if os.path.isdir(block + "/queue") else os.path.dirname(block) + "/queue"
    keys = ("read_ahead_kb", "max_sectors_kb", "nr_requests", "scheduler", "rotational")
    return {k: open(f"{q}/{k}").read().strip() for k in keys if os.path.exists(f"{q}/{k}")}
