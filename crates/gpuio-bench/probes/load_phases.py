"""Where a fresh process's first load of a safetensors checkpoint spends its time: each phase of
``gpuio.safetensors.load_file``'s path timed on its own (header into rows, allocation, read,
views, the sorted dict), then the same load again in the process, then ``load_file`` itself.
Writes the load suite's two checkpoints first where missing (4096 small tensors; 64 large).

    python load_phases.py [DIR]

Prints one JSON line of milliseconds per fresh process, three per checkpoint.
"""

import os
import subprocess
import sys

import torch

CHILD = r"""
import json, sys, time
import torch
torch.empty(1, device="cuda:0")  # the CUDA context, as a program that loads weights has it
ms = {}
t = time.perf_counter()
def step(name):
    global t
    now = time.perf_counter()
    ms[name] = round((now - t) * 1e3, 2)
    t = now
import gpuio.safetensors as st
from gpuio import _gpuio
step("import")
session = st._default_session()
step("session")
for rnd in ("first", "again"):
    t = time.perf_counter()
    start, _, rows = _gpuio.safetensors_header(sys.argv[1])
    step(rnd + "_header")
    fw = st._Framework("pt", "cuda:0")
    total = rows[-1][4]
    blob = fw.empty(total)
    step(rnd + "_alloc")
    st._read_side_by_side(session, sys.argv[1], [(blob, start)], st._Progress(None, total))
    step(rnd + "_read")
    views = fw.views(blob, rows)
    step(rnd + "_views")
    out = {k: views[k] for k in sorted(views)}
    torch.cuda.synchronize()
    step(rnd + "_dict")
    t0 = time.perf_counter()
    st.load_file(sys.argv[1], device="cuda:0")
    torch.cuda.synchronize()
    ms[rnd + "_load_file"] = round((time.perf_counter() - t0) * 1e3, 2)
print(json.dumps(ms))
"""

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def write(path, sizes, dtypes):
    from safetensors.torch import save_file

    tensors = {}
    for i, n in enumerate(sizes):
        dt = DTYPES[dtypes[i % len(dtypes)]]
        k = n // torch.empty(0, dtype=dt).element_size()
        tensors[f"layer{i // 8}.t{i}"] = torch.ones(k // 256, 256, dtype=dt)
    save_file(tensors, path)


def checkpoints(folder):
    """The paths of the two checkpoints in `folder` (4096 small tensors; 64 large), written
    where missing."""
    small = os.path.join(folder, "phases-small.safetensors")
    large = os.path.join(folder, "phases-large.safetensors")
    if not os.path.exists(small):
        write(small, [s << 10 for s in (256, 512, 1024, 2048)] * 1024, ["F32", "BF16", "F16"])
    if not os.path.exists(large):
        write(large, [64 << 20] * 64, ["BF16"])
    return small, large


def main():
    small, large = checkpoints(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
    for _ in range(3):
        for path in (small, large):
            r = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True)
            print(os.path.basename(path), r.stdout.strip() or r.stderr[-800:])


if __name__ == "__main__":
    main()
