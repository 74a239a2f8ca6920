# A probe, not a suite: the gather through hot rows (kernels/gather.cu, gpuio_gather_hot_16)
# timed on the device against the floors of its work, on B2's shape: python3 hot_rows.py
# kernels (the folder; CuPy compiles gather.cu after the headers it needs). One table of
# 93.75 M rows of 256 B (24 GB, pinned), Zipf 1.0 ranks hashed to fixed rows, the most
# frequent rows of a 32 M-draw profile kept hot (7.6 M, as B2 keeps). Per lookup size, CUDA
# events around one launch (p50 of 30, idle GPU, ids already on the device):
#   hot      the hot gather of the lookup's ids;
#   all      the tuned gather of every id from the pool (no hot rows);
#   misses   the tuned gather of only the ids not kept, from the pool (the bus's part);
#   hits     the tuned gather of only the kept ids, from a device pool (HBM's part).
# docs/PERF.md (B2: a hot tier) has the figures.
import numpy as np, cupy as cp, sys, os
d = sys.argv[1]
src = "".join(open(os.path.join(d, f)).read()
              for f in ["gpuio_ring.cuh", "gpuio_array.cuh", "gpuio.cuh", "gather.cu"])
mod = cp.RawModule(code=src, options=("--std=c++17",))
hot_k, gather_k = mod.get_function("gpuio_gather_hot_16"), mod.get_function("gpuio_gather_16")
ROWS, RB, KEEP, PROFILE = 93_750_000, 256, 8_000_000, 32 << 20
SMS = cp.cuda.Device().attributes["MultiProcessorCount"]
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)

def mix64(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xbf58476d1ce4e5b9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94d049bb133111eb)
    return x ^ (x >> np.uint64(31))

def zipf(count, seed, key=np.uint64(77)):
    u = np.random.default_rng(seed).random(count)
    rank = np.clip((float(ROWS) + 1.0) ** u, 1, ROWS).astype(np.uint64)
    with np.errstate(over="ignore"):
        return mix64(rank ^ key) % np.uint64(ROWS)

def hot_hash(x):
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(33)); x = x * np.uint64(0xff51afd7ed558ccd)
        x = x ^ (x >> np.uint64(33)); x = x * np.uint64(0xc4ceb9fe1a85ec53)
        return x ^ (x >> np.uint64(33))

# The profile's most frequent rows, and their index (as hot_rows.rs builds it).
ids, counts = np.unique(zipf(PROFILE, 1), return_counts=True)
kept = ids[np.argsort(-counts, kind="stable")][:KEEP]
cap = 1 << int(np.ceil(np.log2(len(kept) * 4)))
words = np.full(cap, M64, dtype=np.uint64)
at = hot_hash(kept) & np.uint64(cap - 1)
slot = np.arange(len(kept), dtype=np.uint64)
run, probes = np.ones(len(kept), dtype=np.int64), 1
left = np.arange(len(kept))
while left.size:  # linear probing in rounds: each free word takes its first claimant
    free = words[at[left]] == M64
    cand = left[free]
    _, first = np.unique(at[cand], return_index=True)
    won = cand[first]
    words[at[won]] = slot[won] << np.uint64(40) | kept[won]
    probes = max(probes, int(run[won].max()) if won.size else probes)
    left = np.setdiff1d(left, won, assume_unique=True)
    at[left] = (at[left] + np.uint64(1)) & np.uint64(cap - 1)
    run[left] += 1
print(f"kept {len(kept)} rows, index {cap} words, longest probe {probes}", flush=True)
pool = cp.cuda.alloc_pinned_memory(ROWS * RB)
pool_ptr = np.uint64(pool.ptr)
sizes = [24, 384, 3072, 24576, 786432]
steps = {n: zipf(n, 100 + n) for n in sizes}
# Rows the probe reads get distinct bytes (the rest of the pool is never read).
view = np.frombuffer(pool, dtype=np.uint64, count=ROWS * RB // 8).reshape(ROWS, RB // 8)
for rows in [kept] + list(steps.values()):
    view[rows] = rows[:, None] * np.uint64(977) + np.arange(RB // 8, dtype=np.uint64)
hot = cp.zeros(len(kept) * RB, dtype=cp.uint8)
index = cp.asarray(words)
kept_d = cp.asarray(kept)
err = cp.full(1, M64, dtype=cp.uint64)
# The kernels' end signal (gather.cu's gpuio_end): all zeros, nothing told.
no_end = np.zeros(1, dtype=np.dtype([("blocks", "<u8"), ("word", "<u8"), ("seq", "<u8")], align=True))[0]

def cfg(n):
    return (int(min(max((n * (RB // 16) + 3) // 4 // 256, 1), SMS * 32)),), (256,)

def gather(pool_p, rows, idx, dst):
    n = idx.size
    gather_k(*cfg(n), (pool_p, np.uint64(rows), np.uint64(RB), idx, np.uint64(n), dst, err, no_end))

gather(pool_ptr, ROWS, kept_d, hot)  # the copies
cp.cuda.Device().synchronize()
kept_set = np.zeros(ROWS, dtype=bool); kept_set[kept] = True

def timed(f, reps=30):
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(); f(); b.record(); b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return sorted(ts)[len(ts) // 2]

for n in sizes:
    step = steps[n]
    hit = kept_set[step]
    idx, misses = cp.asarray(step), cp.asarray(step[~hit])
    slots = cp.asarray(np.searchsorted(np.sort(kept), step[hit]))  # any hot rows: HBM's rate
    dst = cp.zeros(n * RB, dtype=cp.uint8)
    hot_t = timed(lambda: hot_k(*cfg(n), (pool_ptr, np.uint64(ROWS), np.uint64(RB), idx,
                                          np.uint64(n), dst, err, no_end, hot, np.uint64(len(kept)),
                                          index, np.uint64(cap - 1), np.uint32(probes))))
    got = cp.asnumpy(dst).reshape(n, RB)
    ok = np.array_equal(got.view(np.uint64), view[step])
    all_t = timed(lambda: gather(pool_ptr, ROWS, idx, dst))
    miss_t = timed(lambda: gather(pool_ptr, ROWS, misses, dst)) if misses.size else 0.0
    hit_t = timed(lambda: gather(np.uint64(hot.data.ptr), len(kept), slots, dst)) if slots.size else 0.0
    print(f"{n:7d} ids, {hit.mean() * 100:5.1f}% kept: hot {hot_t:8.1f} µs | all from the pool "
          f"{all_t:8.1f} | misses alone {miss_t:8.1f} ({misses.size} rows) | hits alone from HBM "
          f"{hit_t:7.1f} | rows right: {ok}", flush=True)
