"""Where a fresh process's first load of a warm file into GPU memory spends its time: each step
of ``gpuio.safetensors.load_file``'s path timed on its own, then the same read of a second file
(lanes made, nothing registered) and of the first again.

    python first_load.py FILE [SECOND_FILE]

FILEs are read whole from offset 0 into a CUDA tensor; prints one JSON line of milliseconds.
"""

import json
import sys
import time

import torch

torch.empty(1, device="cuda:0")  # the CUDA context, as a program that loads weights has it
ms = {}
t = time.perf_counter()


def step(name):
    global t
    now = time.perf_counter()
    ms[name] = round((now - t) * 1e3, 2)
    t = now


import gpuio  # noqa: E402

step("import")
s = gpuio.Session()
step("session")
f = s.open(sys.argv[1])
n = f.size()
step("open")
blob = torch.empty(n, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
step("alloc")
s.read(f, blob)
step("first_read")
if len(sys.argv) > 2:
    g = s.open(sys.argv[2])
    other = torch.empty(g.size(), dtype=torch.uint8, device="cuda:0")
    step("alloc_second")
    s.read(g, other)
    step("second_file_read")
s.read(f, blob)
step("same_file_again")
ms["gb"] = n / 1e9
print(json.dumps(ms))
