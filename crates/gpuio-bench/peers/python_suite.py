# gpuio's Python binding measured as users call it, for gpuio-bench's python suite. Prints one
# JSON line. Modes:
#   overhead PATH CALLS   4 KiB reads at scattered offsets of a page-cached file, one call at a
#                         time: into a gpuio host buffer (in place) and into a bytearray (copied
#                         over); per-call p50 and mean in ns.
#   ai CALLS SHAPE POSITIONS STEPS
#                         gpuio.ai's KvPool.load, SwapInBatch.load and EngramTable.lookup of
#                         the structures SHAPE (JSON) describes, reading POSITIONS (comma
#                         separated), one call at a time on gpuio device buffers: p50 ns each;
#                         and B1's decode step (KvBatch.load, STEPS steps): its p50 ns.
#   load PATH REPS        the whole file into a torch CUDA tensor: gpuio's read, torch's way (read
#                         the bytes, then .cuda()), kvikio's read where installed; median B/s,
#                         each result checked against torch's.
#   host PATH REPS        the whole file into host memory and back through the binding: into a
#                         NumPy array (warm and cold), a CPU torch tensor and a pinned gpuio
#                         buffer, and an array to a new file, durable; against readinto,
#                         numpy.fromfile, torch.load of the same bytes saved as a tensor, and
#                         write + fsync. Median B/s, every result checked against the file.
import json
import os
import sys
import time

try:
    import gpuio
except ImportError as e:
    sys.exit(f"the gpuio Python package is not importable ({e}): pip install crates/gpuio-py")

mode = sys.argv[1]
s = gpuio.Session()


def p50_ns(calls, fn):
    for _ in range(min(calls, 1000)):
        fn()
    lat = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t = clock()
        fn()
        lat.append(clock() - t)
    lat.sort()
    return lat[len(lat) // 2]


if mode == "ai":
    import array

    import gpuio.ai as ai

    calls, shape = int(sys.argv[2]), json.loads(sys.argv[3])
    positions = [int(p) for p in sys.argv[4].split(",")]
    entry, tokens, k = shape["entry_bytes"], shape["tokens"], shape["selection"]
    sel = array.array("q", positions)
    dst = s.alloc_device(k * entry)

    pool = ai.KvPool(s, layers=1, entry_bytes=entry, max_tokens=tokens, hot_slots=2 * k,
                     max_selection=k)
    pool.store(0, 0, s.alloc_device(tokens * entry))
    out = {"kv_load_p50_ns": p50_ns(calls, lambda: pool.load(0, sel, dst))}

    kv = ai.SwapInKv(s, layers=1, entry_bytes=entry, max_tokens=tokens, hot_slots=2 * k,
                     max_selection=k)
    kv.append(0, bytes(tokens * entry))
    on_device = s.alloc_device(4 * k)
    s.copy(array.array("I", positions), on_device)
    batch = ai.SwapInBatch(s, 0, [(kv, on_device, dst)])
    counts = [k]
    out["swap_in_load_p50_ns"] = p50_ns(calls, lambda: batch.load(counts))

    table = ai.EngramTable(s, shape["rows"], shape["row_bytes"])
    rows = s.alloc_device(k * shape["row_bytes"])
    out["engram_lookup_p50_ns"] = p50_ns(calls, lambda: table.lookup(sel, rows))
    del pool, kv, batch, table

    # B1's step, as the Rust side runs it (python/ai.rs: b1_selection).
    steps, n = int(sys.argv[5]), shape["b1_batch"]
    b1_tokens, topk = shape["b1_tokens"], shape["b1_topk"]
    src = s.alloc_device(b1_tokens * entry)
    pools, outs = [], []
    for _ in range(n):
        p = ai.KvPool(s, layers=1, entry_bytes=entry, max_tokens=b1_tokens, hot_slots=2 * topk,
                      max_selection=topk)
        p.store(0, 0, src)
        pools.append(p)
        outs.append(s.alloc_device(topk * entry))

    def selection(step, r):
        base = r * 104_729 + (step // 10) * 7919
        return array.array("q", ((i * 31 + base) % b1_tokens for i in range(topk)))

    sels = [[selection(step, r) for r in range(n)] for step in range(steps)]
    loader = ai.KvBatch(s)
    lat, dev = [], []
    clock = time.perf_counter_ns
    for step in range(steps):
        loads = [(p, 0, sel, o) for p, sel, o in zip(pools, sels[step], outs)]
        t = clock()
        _, device = loader.load(loads, timed=True)
        if step >= steps // 10:
            lat.append(clock() - t)
            dev.append(device * 1e9)
    lat.sort()
    dev.sort()
    out["b1_step_p50_ns"] = lat[len(lat) // 2]
    out["b1_step_device_p50_ns"] = dev[len(dev) // 2]
    del pools, outs, loader

    # B2's steps: both tables' lookups in one call, as the Rust side runs them (python/ai.rs:
    # b2_ids).
    rows, hot, per = shape["b2_rows"], shape["b2_hot"], shape["b2_ids_per_token"]
    tables = [ai.EngramTable(s, rows, shape["row_bytes"]) for _ in range(2)]
    for table in tables:
        table.keep_hot(array.array("q", range(hot)))

    def b2_ids(step, table, n):
        return array.array("q", ((i * 7919 + step * 104_729 + table * 15_485_863)
                                 % (rows if i % 6 == 0 else hot) for i in range(n * per)))

    out["b2_step_p50_ns"] = []
    for n in shape["b2_tokens"]:
        dsts = [s.alloc_device(n * per * shape["row_bytes"]) for _ in tables]
        ids = [[b2_ids(step, t, n) for t in range(2)] for step in range(steps)]
        lat = []
        for step in range(steps):
            lookups = [(tables[t], ids[step][t], dsts[t]) for t in range(2)]
            t = clock()
            ai.EngramTable.lookup_tables(lookups)
            if step >= steps // 10:
                lat.append(clock() - t)
        lat.sort()
        out["b2_step_p50_ns"].append(lat[len(lat) // 2])
    print(json.dumps(out))
    sys.exit(0)

path = sys.argv[2]
f = s.open(path)
size = f.size()

if mode == "overhead":
    calls = int(sys.argv[3])
    pages = max(size // 4096, 1)
    offsets = [(i * 7919 % pages) * 4096 for i in range(calls)]

    def per_call(dst):
        for o in offsets[: min(calls, 2000)]:
            s.read(f, dst, offset=o)
        lat = []
        clock = time.perf_counter_ns
        for o in offsets:
            t = clock()
            s.read(f, dst, offset=o)
            lat.append(clock() - t)
        lat.sort()
        return lat[len(lat) // 2], sum(lat) / len(lat)

    host_p50, host_mean = per_call(s.alloc_host(4096))
    copy_p50, copy_mean = per_call(bytearray(4096))
    print(json.dumps({"host_p50_ns": host_p50, "host_mean_ns": host_mean,
                      "bytearray_p50_ns": copy_p50, "bytearray_mean_ns": copy_mean}))
elif mode == "load":
    import torch

    reps = int(sys.argv[3])
    ours = torch.empty(size, dtype=torch.uint8, device="cuda")
    peer = torch.empty_like(ours)

    def timed(fn):
        fn()  # warm-up: allocations, the page cache
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        times.sort()
        return size / times[len(times) // 2]

    def torch_way():
        with open(path, "rb") as fh:
            data = bytearray(fh.read())
        peer.copy_(torch.frombuffer(data, dtype=torch.uint8).cuda())

    out = {"gpuio_bps": timed(lambda: s.read(f, ours)), "torch_bps": timed(torch_way)}
    out["gpuio_correct"] = bool(torch.equal(ours, peer))
    try:
        import kvikio

        other = torch.zeros_like(ours)

        def kvikio_read():
            with kvikio.CuFile(path, "r") as kf:
                kf.read(other)

        out["kvikio_bps"] = timed(kvikio_read)
        out["kvikio_correct"] = bool(torch.equal(other, peer))
    except ImportError as e:
        out["kvikio_absent"] = str(e)
    print(json.dumps(out))
elif mode == "host":
    import numpy as np

    reps = int(sys.argv[3])
    out = {}
    with open(path, "rb") as fh:
        truth = np.fromfile(fh, dtype=np.uint8)

    def median_bps(fn, before=lambda: None):
        fn()  # warm-up: allocations, the page cache
        times = []
        for _ in range(reps):
            before()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        times.sort()
        return size / times[len(times) // 2]

    def drop_cache():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def readinto(dst):
        with open(path, "rb", buffering=0) as fh:
            fh.readinto(memoryview(dst).cast("B"))

    def check(name, got):
        if not np.array_equal(np.asarray(got).view(np.uint8).reshape(-1), truth):
            out.setdefault("mismatch", []).append(name)

    arr = np.zeros(size, dtype=np.uint8)
    out["gpuio_numpy"] = median_bps(lambda: s.read(f, arr))
    check("gpuio_numpy", arr)
    out["readinto"] = median_bps(lambda: readinto(arr))
    fresh = {}

    def gpuio_fresh():
        fresh["a"] = np.empty(size, dtype=np.uint8)
        s.read(f, fresh["a"])

    out["gpuio_numpy_fresh"] = median_bps(gpuio_fresh)
    check("gpuio_numpy_fresh", fresh["a"])
    out["fromfile"] = median_bps(lambda: np.fromfile(path, dtype=np.uint8))
    out["gpuio_numpy_cold"] = median_bps(lambda: s.read(f, arr), drop_cache)
    check("gpuio_numpy_cold", arr)
    out["readinto_cold"] = median_bps(lambda: readinto(arr), drop_cache)
    pinned = s.alloc_host(size)
    out["gpuio_pinned"] = median_bps(lambda: s.read(f, pinned))
    check("gpuio_pinned", pinned)
    out["readinto_pinned"] = median_bps(lambda: readinto(np.asarray(pinned)))
    del pinned
    try:
        import torch

        tensor = torch.empty(size, dtype=torch.uint8)
        out["gpuio_torch"] = median_bps(lambda: s.read(f, tensor))
        check("gpuio_torch", tensor.numpy())
        saved = path + ".pt"
        torch.save(torch.from_numpy(truth), saved)
        try:
            out["torch_load"] = median_bps(lambda: torch.load(saved, weights_only=True))
        finally:
            os.remove(saved)
        del tensor
    except ImportError as e:
        out["torch_load_absent"] = str(e)
    written = path + ".written"

    def fsync(p):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def gpuio_write():
        s.write(s.open(written, write=True), truth, durable=True)

    def python_write():
        with open(written, "wb") as fh:
            fh.write(truth)
        fsync(written)

    try:
        out["gpuio_write"] = median_bps(gpuio_write)
        check("gpuio_write", np.fromfile(written, dtype=np.uint8))
        out["write"] = median_bps(python_write)
    finally:
        os.remove(written)
    out["correct"] = "mismatch" not in out
    print(json.dumps(out))
else:
    sys.exit(f"unknown mode {mode}")
