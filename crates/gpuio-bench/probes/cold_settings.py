"""Cold reads of a 4 GiB file: into cuda:0 through gpuio under several LocalIO settings (lanes,
chunk size, slots per lane, the pread engine, O_DIRECT) and through kvikio where installed;
into host memory by `dd` (buffered, one stream with the kernel's readahead, and O_DIRECT) and
by Python threads reading in the patterns a loader might (4 MiB chunks taken in turn, as
gpuio's lanes took them before each read a contiguous run, against contiguous ranges per
thread). The page cache is dropped
before each (needs root). Writes the file first where missing.

    python cold_settings.py [FILE]

Prints the disk's queue settings, then one JSON line per case: GB/s.
"""

import json
import os
import subprocess
import sys
import time

from scratch import (GPUIO_READ, disk_settings, drop_cache, random_file, run_child,
                     timed_threads)

SIZE = 4 << 30
CHUNK = 4 << 20

KVIKIO = r"""
import os, sys, time, torch
os.environ["KVIKIO_NTHREADS"] = sys.argv[2]
import kvikio
t = torch.empty(int(sys.argv[3]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
t0 = time.perf_counter()
with kvikio.CuFile(sys.argv[1], "r") as f:
    f.pread(t, t.numel(), 0).get()
print(round(t.numel() / (time.perf_counter() - t0) / 1e9, 2))
"""


def report(name, value):
    print(json.dumps({name: value}), flush=True)


def child(name, script, *args):
    drop_cache()
    report(name, run_child(script, *args))


def threads(name, path, ranges, chunk=CHUNK, advice=None):
    """Each thread preads `chunk` bytes at the offsets its range yields, into its own buffer."""
    drop_cache()
    fd = os.open(path, os.O_RDONLY)
    if advice is not None:
        os.posix_fadvise(fd, 0, 0, advice)

    def work(offsets):
        buf = bytearray(chunk)
        return sum(os.preadv(fd, [buf], off) for off in offsets)

    report(name, timed_threads(work, [(r,) for r in ranges]))
    os.close(fd)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cold_settings.bin"
    random_file(path, SIZE)
    report("disk", disk_settings(path))
    direct = f"localio://{os.path.abspath(path)}?direct=1"
    cases = [
        ("default", path, ""),
        ("lanes 16", path, "[localio]\nlanes = 16\n"),
        ("chunk 16 MiB", path, '[localio]\nchunk_size = "16 MiB"\n'),
        ("slots 4", path, "[localio]\nslots_per_lane = 4\n"),
        ("pread engine", path, '[localio]\nengine = "posix"\n'),
        ("pread engine, lanes 16", path, '[localio]\nengine = "posix"\nlanes = 16\n'),
        ("O_DIRECT", direct, ""),
        ("O_DIRECT, slots 4", direct, "[localio]\nslots_per_lane = 4\n"),
    ]
    for name, target, toml in cases:
        child(name, GPUIO_READ, target, toml, str(SIZE))
    for n in (8, 16):
        child(f"kvikio {n} threads", KVIKIO, path, str(n), str(SIZE))
    for name, extra in (("dd buffered", []), ("dd O_DIRECT", ["iflag=direct"])):
        drop_cache()
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", *extra],
                       capture_output=True, check=True)
        report(name, round(SIZE / (time.perf_counter() - t0) / 1e9, 2))
    for n in (8, 16):
        threads(f"{n} threads, chunks in turn", path,
                [range(t * CHUNK, SIZE, n * CHUNK) for t in range(n)])
        threads(f"{n} threads, contiguous ranges", path,
                [range(t * SIZE // n, (t + 1) * SIZE // n, CHUNK) for t in range(n)])
    threads("16 threads, chunks in turn, FADV_SEQUENTIAL", path,
            [range(t * CHUNK, SIZE, 16 * CHUNK) for t in range(16)],
            advice=os.POSIX_FADV_SEQUENTIAL)
    threads("1 thread, 16 MiB reads", path, [range(0, SIZE, 16 << 20)], chunk=16 << 20)
    child("default again", GPUIO_READ, path, "", str(SIZE))


if __name__ == "__main__":
    main()
