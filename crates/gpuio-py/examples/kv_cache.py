"""A DSA-style KV cache from Python: each decode step stores the new token's entry and loads
the top-k entries of the context into one GPU buffer; unimportant entries are evicted to a
compressed cold tier on disk and come back when selected. Then the same loads planned on the
device (SwapInKv, SwapInBatch): the selection is already in GPU memory.

    python kv_cache.py [--scratch DIR]

Runs on the host backend too (gpuio's device buffers are then host memory). Checks every
loaded entry against the bytes stored.
"""

import argparse
import os
import tempfile

import numpy as np

import gpuio
import gpuio.ai as ai

ENTRY, TOKENS, TOPK = 656, 4096, 256


def to_device(s, array):
    buf = s.alloc_device(array.nbytes)
    s.copy(array, buf)
    return buf


def to_host(s, buf, n):
    out = np.empty(n, dtype=np.uint8)
    s.copy(buf, out, size=n)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scratch", default=tempfile.gettempdir())
    args = p.parse_args()
    rng = np.random.default_rng(1)
    s = gpuio.Session()
    kv = rng.integers(0, 256, (TOKENS, ENTRY), dtype=np.uint8)
    scores = rng.random(TOKENS, dtype=np.float32)

    pool = ai.KvPool(s, layers=1, entry_bytes=ENTRY, max_tokens=TOKENS, hot_slots=512,
                     max_selection=TOPK)
    pool.store(0, 0, to_device(s, kv), scores=scores)  # the prefill
    out = s.alloc_device(TOPK * ENTRY)
    for step in range(4):
        topk = np.sort(rng.choice(TOKENS, TOPK, replace=False)).astype(np.int64)
        r = pool.load(0, topk, out)
        got = to_host(s, out, TOPK * ENTRY).reshape(TOPK, ENTRY)
        assert np.array_equal(got, kv[topk]), f"step {step}: wrong entries"
        print(f"step {step}: {r['hits']} hits, {r['misses']} misses")

    cold = os.path.join(args.scratch, f"kv-cold-{os.getpid()}.bin")
    try:
        pool.attach_cold_tier(cold, codec="zstd")
        evicted = pool.compact(0.5)  # the less important half leaves host memory
        stored, raw = pool.cold_tier_bytes()
        print(f"evicted {evicted['evicted']} entries: {raw} bytes in {stored} on disk")
        topk = np.argsort(scores)[:TOPK].astype(np.int64)  # the least important: all cold
        r = pool.load(0, topk, out)
        got = to_host(s, out, TOPK * ENTRY).reshape(TOPK, ENTRY)
        assert r["from_cold"] > 0 and np.array_equal(got, kv[topk])
        print(f"loaded {r['from_cold']} entries back from the cold tier")
    finally:
        os.remove(cold)

    seq = ai.SwapInKv(s, layers=1, entry_bytes=ENTRY, max_tokens=TOKENS, hot_slots=512,
                      max_selection=TOPK)
    seq.append(0, kv)
    picks = rng.choice(TOKENS, TOPK, replace=False).astype(np.uint32)
    selection = to_device(s, picks)  # where a model's top-k kernel leaves it
    batch = ai.SwapInBatch(s, 0, [(seq, selection, out)])
    for _ in range(2):
        (report,) = batch.load([TOPK])
        got = to_host(s, out, TOPK * ENTRY).reshape(TOPK, ENTRY)
        assert np.array_equal(got, kv[picks.astype(np.int64)])
    print(f"device-planned: {report['hits']} hits on the second load")
    print("kv_cache: ok")


if __name__ == "__main__":
    main()
