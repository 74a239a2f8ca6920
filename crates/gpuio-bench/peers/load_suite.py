"""The load suite's child process: makes checkpoints, and loads one with one loader in a fresh
process, printing one JSON line.

    load_suite.py make DIR SHAPE FRAMEWORK
    load_suite.py load LOADER PREFIX DEVICES TEMP REPS

``make`` writes DIR/SHAPE.safetensors (and DIR/SHAPE.pt for torch.load where torch is
installed) and DIR/SHAPE.json: each tensor's two checksums, which every load is checked
against. ``load`` makes the devices' CUDA contexts, then times from the loader's import to the
last tensor on the devices: the first load of the process (``first_s``), then REPS more
(``hot_s``). TEMP ``cold`` drops the files' pages first (and loads once), ``warm`` reads them
first. DEVICES: ``cpu``, or CUDA devices joined by commas. Loaders: gpuio, gpuio-direct (its
O_DIRECT reads), gpuio-replicated, gpuio-split, safetensors, safetensors-open,
fastsafetensors, kvikio-THREADS, torch-load.
"""

import json
import os
import struct
import sys
import time

import numpy as np

# The checkpoints: (count, bytes of each, dtypes in turn) on a GPU, and a small twin for CI.
SHAPES = {
    "large": ([8192 * 4096 * 2] * 64, ["BF16"]),
    "small": ([s << 10 for s in (256, 512, 1024, 2048)] * 1024, ["F32", "BF16", "F16"]),
}
HOST_SHAPES = {
    "large": ([1 << 20] * 16, ["F32"]),
    "small": ([s << 10 for s in (4, 8, 16, 32)] * 64, ["F32", "F16", "I32"]),
}
ITEM = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4}
NP = {"F32": "float32", "F16": "float16", "I32": "int32"}


def sums(words):
    """Two checksums of int32 words: their sum, and the sum of every 7th (shifts show); each
    tensor's bytes are its own, so a tensor under another's name shows too."""
    return [int(words.sum(dtype=np.int64)), int(words[::7].sum(dtype=np.int64))]


def make(folder, shape, framework):
    sizes, dtypes = (SHAPES if framework == "pt" else HOST_SHAPES)[shape]
    rng = np.random.default_rng(42)
    base = rng.integers(0, 256, max(sizes) + (len(sizes) << 6), dtype=np.uint8)
    header, tensors, at = {}, [], 0
    for i, size in enumerate(sizes):
        dt = dtypes[i % len(dtypes)]
        cols = 256 if size // ITEM[dt] % 256 == 0 else 1
        name = f"layers.{i // 8}.w{i % 8}"
        header[name] = {"dtype": dt, "shape": [size // ITEM[dt] // cols, cols],
                        "data_offsets": [at, at + size]}
        tensors.append((name, base[i << 6 :][:size]))  # bytes of its own
        at += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = os.path.join(folder, shape + ".safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, data in tensors:
            f.write(data.data)
    checks = {
        name: sums(data.view(np.int32)) + [header[name]["shape"], ITEM[header[name]["dtype"]]]
        for name, data in tensors
    }
    with open(os.path.join(folder, shape + ".json"), "w") as f:
        json.dump(checks, f)
    if framework == "pt":
        try:
            import torch
        except ImportError:
            pass
        else:
            dts = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
            state = {
                name: torch.frombuffer(bytearray(data), dtype=torch.uint8)
                .view(dts[header[name]["dtype"]])
                .reshape(header[name]["shape"])
                for name, data in tensors
            }
            torch.save(state, os.path.join(folder, shape + ".pt"))
    print(json.dumps({"path": path, "bytes": at, "tensors": len(sizes)}))


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path):
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    rows = sorted((v["data_offsets"][0], v["data_offsets"][1], k, v) for k, v in h.items())
    return 8 + n, rows


def torch_views(torch, blob, rows):
    """The tensors of ``rows`` viewed in ``blob`` (the way gpuio's loader makes them)."""
    dts = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I32": torch.int32}
    raws = blob.split_with_sizes([e - b for b, e, _, _ in rows])
    return {k: r.view(dts[v["dtype"]]).view(v["shape"]) for r, (_, _, k, v) in zip(raws, rows)}


def split_dim(name, shape):
    """The tensor-parallel cut: even layers' weights by rows, odd ones by columns."""
    return int(name.split(".")[-1][1:]) % 2


def load(loader, path, devices):
    """One load; returns a list of dicts of tensors, one per device, and what to keep alive."""
    if devices[0] == "cpu":  # host memory, NumPy: the suite's run without a GPU
        if loader in ("gpuio", "gpuio-direct"):
            from gpuio.safetensors import load_numpy

            return [load_numpy(path, direct=loader == "gpuio-direct")], None
        from safetensors.numpy import load_file

        return [load_file(path)], None
    if loader.startswith("gpuio"):
        from gpuio import safetensors as gst

        if loader in ("gpuio", "gpuio-direct"):
            direct = loader == "gpuio-direct"
            return [gst.load_file(path, device=devices[0], direct=direct)], None
        if loader == "gpuio-replicated":
            return gst.load_replicated(path, devices), None
        if loader == "gpuio-halves":
            return halves(gst, path, devices), None
        return gst.load_split(path, devices, split_dim), None
    if loader == "safetensors":
        from safetensors.torch import load_file

        return [load_file(path, device=devices[0])], None
    if loader == "safetensors-open":
        from safetensors import safe_open

        with safe_open(path, framework="pt", device=devices[0]) as f:
            return [{k: f.get_tensor(k) for k in f.keys()}], None
    if loader == "fastsafetensors":
        import torch
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        fl = SafeTensorsFileLoader(SingleGroup(), torch.device(devices[0]), nogds=True)
        fl.add_filenames({0: [path]})
        fb = fl.copy_files_to_device()
        return [{k: fb.get_tensor(k) for k in fb.key_to_rank_lidx}], (fb, fl)
    if loader.startswith("kvikio-"):
        import kvikio
        import torch

        start, rows = header(path)
        blob = torch.empty(rows[-1][1], dtype=torch.uint8, device=devices[0])
        with kvikio.CuFile(path, "r") as f:
            f.pread(blob, blob.numel(), start).get()
        return [torch_views(torch, blob, rows)], None
    if loader == "torch-load":
        import torch

        pt = path[: -len(".safetensors")] + ".pt"
        return [torch.load(pt, map_location=devices[0], weights_only=True)], None
    raise SystemExit(f"unknown loader {loader}")


def halves(gst, path, devices):
    """The host's side of a load onto several GPUs, the limit under one: each device reads
    its 1/N of the data (cut at tensor boundaries, as ``load_split`` cuts), side by side,
    through gpuio's session; no views, no copies between the GPUs. Returns each device's
    bytes and the rows in them, viewed only by ``check``, outside the timing."""
    import torch

    start, rows = header(path)
    cuts = gst._cuts(rows[-1][1], len(devices), [e for _, e, _, _ in rows])
    blobs = [torch.empty(hi - lo, dtype=torch.uint8, device=d)
             for d, lo, hi in zip(devices, cuts, cuts[1:])]
    moved = gst._Progress(None, rows[-1][1])
    gst._read_side_by_side(gst._default_session(), path,
                           [(b, start + lo) for b, lo in zip(blobs, cuts)], moved)
    return [(b, [r for r in rows if lo <= r[0] < hi]) for b, lo, hi in zip(blobs, cuts, cuts[1:])]


def check(loader, got, expected, devices):
    """Every device's tensors against the checksums (split parts put back together)."""
    if devices[0] != "cpu":
        import torch

        if loader == "gpuio-halves":
            got = [{k: t for b, rows in got for k, t in torch_views(torch, b, rows).items()}]
        if loader == "gpuio-split":
            cat = lambda k: torch.cat([g[k].to(devices[0]) for g in got], split_dim(k, None))  # noqa: E731
            got = [{k: cat(k) for k in got[0]}]
        words = lambda t: t.contiguous().reshape(-1).view(torch.int32)  # noqa: E731
        total = lambda w: int(w.sum(dtype=torch.int64))  # noqa: E731
        item = lambda t: t.element_size()  # noqa: E731
    else:
        words = lambda t: np.ascontiguousarray(t).reshape(-1).view(np.int32)  # noqa: E731
        total = lambda w: int(w.sum(dtype=np.int64))  # noqa: E731
        item = lambda t: t.itemsize  # noqa: E731
    for tensors in got:
        if sorted(tensors) != sorted(expected):
            return False
        for k, t in tensors.items():
            w = words(t)
            if [total(w), total(w[::7]), list(t.shape), item(t)] != expected[k]:
                return False
    return True


def main():
    if sys.argv[1] == "make":
        return make(*sys.argv[2:5])
    loader, prefix, devices, temp, reps = sys.argv[2:7]
    devices = devices.split(",")
    path = prefix + ".safetensors"
    files = [path, prefix + ".pt"] if loader == "torch-load" else [path]
    with open(prefix + ".json") as f:
        expected = json.load(f)
    sync = lambda: None  # noqa: E731
    if devices[0] != "cpu":
        import torch

        for d in devices:
            torch.empty(1, device=d)
        sync = lambda: [torch.cuda.synchronize(d) for d in devices]  # noqa: E731
    for p in files[-1:]:
        drop_cache(p) if temp == "cold" else warm(p)
    times = []
    for _ in range(1 + (0 if temp == "cold" else int(reps))):
        t = time.perf_counter()
        got, keep = load(loader, path, devices)
        sync()
        times.append(time.perf_counter() - t)
        ok = check(loader, got, expected, devices)
        if not ok:
            break
        del got, keep
    print(json.dumps({"loader": loader, "temp": temp, "correct": ok, "first_s": times[0],
                      "hot_s": times[1:]}))


if __name__ == "__main__":
    main()
