"""What a one-GPU load costs on a machine of several GPUs: torch's context on cuda:0, then
``gpuio.Session()`` and ``gpuio.safetensors.load_file`` of a 4 GiB checkpoint onto cuda:0,
in fresh processes with every GPU visible and with ``CUDA_VISIBLE_DEVICES=0``, two of each.
A session that made a context on every GPU paid for the others here.

    python contexts.py [SCRATCH_DIR]

Prints one JSON line per process: the session's and the load's milliseconds, and GB/s from
``Session()`` to the last tensor.
"""

import json
import os
import struct
import subprocess
import sys
import time


def child(path):
    import torch

    torch.empty(1, device="cuda:0")
    t0 = time.perf_counter()
    import gpuio
    import gpuio.safetensors as st

    s = gpuio.Session()
    t1 = time.perf_counter()
    st.load_file(path, device="cuda:0", session=s)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(json.dumps({
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
        "devices": torch.cuda.device_count(),
        "session_ms": round((t1 - t0) * 1e3, 1),
        "load_ms": round((t2 - t1) * 1e3, 1),
        "gbps_from_session": round(os.path.getsize(path) / (t2 - t0) / 1e9, 2),
    }), flush=True)


def main(folder):
    import numpy as np

    path = os.path.join(folder, "contexts.safetensors")
    count, size = 64, 64 << 20
    header = {
        f"t{i}": {"dtype": "BF16", "shape": [size // 512, 256], "data_offsets": [i * size, (i + 1) * size]}
        for i in range(count)
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    block = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _ in range(count):
            f.write(block)
    with open(path, "rb", buffering=0) as f:  # warm: the page cache holds it
        while f.read(64 << 20):
            pass
    for visible in ["0", None, "0", None]:
        env = dict(os.environ)
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        else:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        subprocess.run([sys.executable, __file__, "--child", path], env=env, check=False)
    os.remove(path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
