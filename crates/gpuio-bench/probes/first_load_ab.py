"""Two gpuio builds' first load of a safetensors checkpoint, alternating in fresh processes:
wall time from importing `gpuio.safetensors` to the last tensor on cuda:0, as `gpuio bench
load` times a first load, for load_phases.py's two checkpoints (4096 small tensors; 64
large), page cache warm. Each build is a directory holding its `gpuio` package; make both
the same way (in one run, the large checkpoint, whose load the change measured left as it
was, loaded 10–14% faster from the directory pip installed than from a copy of it).

    python first_load_ab.py DIR_A DIR_B [ROUNDS] [DIR]

Prints one line per process: the build, the checkpoint, GB/s.
"""

import os
import sys

from load_phases import checkpoints
from wheel_ab import child

FIRST = r"""
import os, sys, time, torch
torch.empty(1, device="cuda:0")  # the CUDA context, as a program that loads weights has it
t0 = time.perf_counter()
from gpuio.safetensors import load_file
out = load_file(sys.argv[1], device="cuda:0")
torch.cuda.synchronize()
print(round(os.path.getsize(sys.argv[1]) / (time.perf_counter() - t0) / 1e9, 2))
"""


def main():
    a, b = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    small, large = checkpoints(sys.argv[4] if len(sys.argv) > 4 else "/tmp")
    for path in (small, large):  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    for r in range(rounds):
        for build in (a, b) if r % 2 == 0 else (b, a):
            for path in (small, large):
                print(build, os.path.basename(path), child(build, FIRST, path), flush=True)


if __name__ == "__main__":
    main()
