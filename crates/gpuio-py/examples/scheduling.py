"""AI work in the scheduler's classes from Python: a decode step's loads hold the realtime
class while an Engram prefetch (background) and a checkpoint (its own class) run beside
them; the scheduler holds the less urgent work back while a step loads.

    python scheduling.py

Runs on the host backend too. Prints the decode steps' p50 and p99 alone and beside the
background work.
"""

import threading
import time

import numpy as np

import gpuio
import gpuio.ai as ai

ENTRY, TOKENS, TOPK, STEPS = 656, 8192, 512, 200


def steps(pool, out, rng):
    lat = []
    for _ in range(STEPS):
        topk = rng.choice(TOKENS, TOPK, replace=False).astype(np.int64)
        t = time.perf_counter()
        pool.load(0, topk, out)
        lat.append(time.perf_counter() - t)
    lat.sort()
    return lat[len(lat) // 2] * 1e6, lat[int(len(lat) * 0.99)] * 1e6


def main():
    rng = np.random.default_rng(5)
    s = gpuio.Session()
    ctx = ai.AiContext(s)
    pool = ctx.open_sequence(1, layers=1, entry_bytes=ENTRY, max_tokens=TOKENS, hot_slots=1024,
                             max_selection=TOPK)
    kv = s.alloc_device(TOKENS * ENTRY)
    pool.store(0, 0, kv)
    pool.set_work("inference", deadline=0.050, compute=0.010)  # due in 50 ms, 10 of compute
    out = s.alloc_device(TOPK * ENTRY)
    alone = steps(pool, out, rng)

    table = ai.EngramTable(s, 1 << 18, 256)
    rows = s.alloc_device(1 << 20)
    weights = s.alloc_device(64 << 20)
    stop = threading.Event()

    def background():
        while not stop.is_set():
            ids = rng.integers(0, 1 << 18, 4096)
            table.prefetch(ids, rows).wait()  # background class, a lease per piece
            ctx.submit("checkpoint", weights, s.alloc_host(64 << 20)).wait()

    t = threading.Thread(target=background)
    t.start()
    try:
        beside = steps(pool, out, rng)
    finally:
        stop.set()
        t.join()
    print(f"decode step alone:  p50 {alone[0]:.0f} us, p99 {alone[1]:.0f} us")
    print(f"beside background:  p50 {beside[0]:.0f} us, p99 {beside[1]:.0f} us")
    print("scheduling: ok")


if __name__ == "__main__":
    main()
