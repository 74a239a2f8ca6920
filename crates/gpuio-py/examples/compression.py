"""KV quantization and compressed frames from Python: values quantized on the host and on the
device (the same bytes), their error against each format's bound, and KV bytes written to a
file as LZ4 frames (crc32c-checked) and read back.

    python compression.py [--scratch DIR]

Runs on the host backend too.
"""

import argparse
import os
import tempfile

import numpy as np

import gpuio
import gpuio.ai as ai


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scratch", default=tempfile.gettempdir())
    args = p.parse_args()
    rng = np.random.default_rng(4)
    s = gpuio.Session()
    values = rng.standard_normal(1 << 16).astype(np.float32)
    on_device = s.alloc_device(values.nbytes)
    s.copy(values, on_device)
    for fmt in ("f16", "fp8", "int8", "int4"):
        q = ai.quantize(values, fmt, block=64)
        dq = ai.quantize_device(on_device, fmt, block=64)
        assert dq.to_host().data == q.data, f"{fmt}: device and host differ"
        err = np.max(np.abs(np.asarray(ai.dequantize(q)) - values))
        print(f"{fmt:5s} {q.stored_bytes / values.nbytes:5.3f} of the bytes, max error {err:.4f}")

    kv = np.repeat(rng.integers(0, 16, 1 << 18, dtype=np.uint8), 4)  # compressible
    src = s.alloc_device(kv.nbytes)
    s.copy(kv, src)
    path = os.path.join(args.scratch, f"frames-{os.getpid()}.bin")
    try:
        r = ai.transfer_compressed(s, src, path, codec="lz4")
        back = s.alloc_device(kv.nbytes)
        ai.read_compressed(s, path, back, kv.nbytes)
    finally:
        os.remove(path)
    check = np.empty_like(kv)
    s.copy(back, check)
    assert np.array_equal(check, kv)
    print(f"{r['raw_bytes']} bytes as {r['stored_bytes']} in {r['frames']} frames")
    print("compression: ok")


if __name__ == "__main__":
    main()
