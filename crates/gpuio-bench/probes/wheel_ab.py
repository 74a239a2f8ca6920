"""Two gpuio builds on one machine, alternating in fresh processes: a 4 GiB file read into
cuda:0 warm (the process's first read, from `import gpuio`, then its second), and cold (page
cache dropped first: needs root; then the next read of the same file, now cached); then 4 GiB
of cuda:0 written to a new file, durable. Each build is a directory its wheel was installed
into (`pip install --target DIR`).

    python wheel_ab.py DIR_A DIR_B [ROUNDS] [FILE]

Prints one line per process: the build, the case, and GB/s (of both reads, or the write).
"""

import os
import sys

from scratch import drop_cache, random_file, run_child

SIZE = 4 << 30

CHILD = r"""
import sys, time, torch
t = torch.empty(int(sys.argv[2]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
t0 = time.perf_counter()
import gpuio
s = gpuio.Session()
s.read(s.open(sys.argv[1]), t)
t1 = time.perf_counter()
s.read(s.open(sys.argv[1]), t)
t2 = time.perf_counter()
print(round(t.numel() / (t1 - t0) / 1e9, 2), round(t.numel() / (t2 - t1) / 1e9, 2))
"""

WRITE = r"""
import sys, time, torch
t = torch.randint(0, 256, (int(sys.argv[2]),), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
import gpuio
s = gpuio.Session()
f = s.open(sys.argv[1], write=True)
t0 = time.perf_counter()
s.write(f, t, durable=True)
print(round(t.numel() / (time.perf_counter() - t0) / 1e9, 2))
"""


def child(build, script, *args):
    """`run_child` with `build` first on the module path."""
    path_now = os.environ.get("PYTHONPATH")
    return run_child(script, *args,
                     env={"PYTHONPATH": os.pathsep.join(filter(None, [build, path_now]))})


def read(build, path, cold):
    if cold:
        drop_cache()
    case = "cold, then cached" if cold else "warm first, second"
    print(f"{build} {case}: {child(build, CHILD, path, str(SIZE))}", flush=True)


def write(build, path):
    if os.path.exists(path):
        os.remove(path)
    drop_cache()
    print(f"{build} write, durable: {child(build, WRITE, path, str(SIZE))}", flush=True)


def main():
    a, b = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    path = sys.argv[4] if len(sys.argv) > 4 else "/tmp/wheel_ab.bin"
    random_file(path, SIZE)
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    for _ in range(rounds):
        for build in (a, b):
            read(build, path, cold=False)
    for build in (b, a, b, a):
        read(build, path, cold=True)
    for _ in range(3):
        for build in (a, b):
            write(build, path + ".written")
    os.remove(path + ".written")


if __name__ == "__main__":
    main()
