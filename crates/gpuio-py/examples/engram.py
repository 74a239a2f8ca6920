"""Engram tables from Python: rows of conditional memory in pinned host memory, loaded from
a file, read by id into GPU memory (the most-read rows kept on the GPU), prefetched for the
next layer while this one computes, written back, and searched by similarity.

    python engram.py [--scratch DIR]

Runs on the host backend too. Checks every row read against the table.
"""

import argparse
import os
import tempfile

import numpy as np

import gpuio
import gpuio.ai as ai

ROWS, ROW, IDS = 1 << 16, 256, 4096


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scratch", default=tempfile.gettempdir())
    args = p.parse_args()
    rng = np.random.default_rng(2)
    s = gpuio.Session()
    rows = rng.integers(0, 256, (ROWS, ROW), dtype=np.uint8)
    path = os.path.join(args.scratch, f"engram-{os.getpid()}.bin")
    rows.tofile(path)
    try:
        table = ai.EngramTable(s, ROWS, ROW)
        s.read(path, table.memory())  # the table, straight into its pinned memory
    finally:
        os.remove(path)

    out = s.alloc_device(IDS * ROW)
    check = np.empty(IDS * ROW, dtype=np.uint8)
    ids = rng.zipf(1.3, IDS) % ROWS  # n-gram ids repeat: a few rows are read most
    r = table.lookup(ids, out)
    s.copy(out, check)
    assert np.array_equal(check.reshape(IDS, ROW), rows[ids])
    print(f"lookup: {r['rows']} rows, {r['rows_fetched']} fetched, path {r['path']}")

    hot = np.unique(ids)[:1024]
    print(f"hot tier: {table.keep_hot(hot)}")
    nxt = rng.zipf(1.3, IDS) % ROWS
    pending = table.prefetch(nxt, out)  # the next layer's rows, on a side thread
    # ... this layer computes here ...
    r = pending.wait()
    s.copy(out, check)
    assert np.array_equal(check.reshape(IDS, ROW), rows[nxt])
    print(f"prefetch: {r['rows']} rows, hot {r['hot']}")

    updated = rng.integers(0, 256, (8, ROW), dtype=np.uint8)
    src = s.alloc_device(updated.nbytes)
    s.copy(updated, src)
    table.store_async(list(range(8)), src).wait()  # written back, kept rows refreshed
    one = s.alloc_device(8 * ROW)
    table.lookup(list(range(8)), one)
    back = np.empty(8 * ROW, dtype=np.uint8)
    s.copy(one, back)
    assert np.array_equal(back.reshape(8, ROW), updated)

    query = rng.standard_normal(ROW // 4).astype(np.float32)
    best = table.similar(query, k=3)
    print(f"most similar rows: {[i for i, _ in best]}")
    print("engram: ok")


if __name__ == "__main__":
    main()
