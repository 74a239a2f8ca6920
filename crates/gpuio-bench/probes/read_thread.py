"""Whether a fresh process's first read of a warm 4 GiB file into cuda:0 runs faster from a
thread of its own than from the main thread (a safetensors load gained ~12 ms when its read
moved off the calling thread). Fresh processes alternate between the two; each times from
`gpuio.Session()` to the read's end, then a second read in the same process.

    python read_thread.py [FILE] [ROUNDS]

Prints one JSON line per process: where the read ran, GB/s of the first and second reads.
"""

import json
import os
import sys

from scratch import random_file, run_child

SIZE = 4 << 30

CHILD = r"""
import json, sys, threading, time, torch
import gpuio
t = torch.empty(int(sys.argv[2]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
where = sys.argv[3]
def read(s):
    s.read(s.open(sys.argv[1]), t)
def run(f, *a):
    if where == "main":
        f(*a)
    else:
        th = threading.Thread(target=f, args=a)
        th.start()
        th.join()
t0 = time.perf_counter()
s = gpuio.Session()
run(read, s)
t1 = time.perf_counter()
run(read, s)
t2 = time.perf_counter()
print(json.dumps({where: [round(t.numel() / (t1 - t0) / 1e9, 2), round(t.numel() / (t2 - t1) / 1e9, 2)]}))
"""


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/read_thread.bin"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    random_file(path, SIZE)
    with open(path, "rb") as f:  # into the page cache
        while f.read(64 << 20):
            pass
    for r in range(rounds):
        for where in ("main", "thread") if r % 2 == 0 else ("thread", "main"):
            print(run_child(CHILD, path, str(SIZE), where), flush=True)


if __name__ == "__main__":
    main()
