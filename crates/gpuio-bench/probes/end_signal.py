# A probe, not a suite: what the row kernels' end signal (gather.cu's gpuio_signal_end: a
# barrier, a fence and a count per block, the last block's store to mapped host memory) costs
# a large gather. gpuio_gather_16 over a pinned 256 MiB pool, 1 Mi random rows of 64 B (4096
# blocks of 256 threads, as gpuio launches it) and 64 Ki rows of 4 KiB, timed by CUDA events
# with the signal armed and not, alternating, p50 of N (argv[1], default 30) each; the last
# call of each way is checked against the pool. Run from the repository's root:
# python3 crates/gpuio-bench/probes/end_signal.py. docs/PERF.md (row gathers) has the figures.
import sys
import numpy as np, cupy as cp

N = int(sys.argv[1]) if len(sys.argv) > 1 else 30
src = open("kernels/gpuio_rows.cuh").read() + open("crates/gpuio-hal/kernels/gather.cu").read()
kern = cp.RawModule(code=src, options=("--std=c++17",)).get_function("gpuio_gather_16")
POOL = 256 << 20
pinned = cp.cuda.alloc_pinned_memory(POOL)
pool = np.frombuffer(pinned, dtype=np.uint8, count=POOL)
pool[:] = np.random.default_rng(1).integers(0, 256, POOL, dtype=np.uint8)
word = cp.cuda.alloc_pinned_memory(8)
word_host = np.frombuffer(word, dtype=np.uint64, count=1)
word_host[0] = 0
blocks = cp.zeros(1, dtype=cp.uint64)
err = cp.full(1, np.uint64(2**64 - 1), dtype=cp.uint64)
end_t = np.dtype([("blocks", "<u8"), ("word", "<u8"), ("seq", "<u8")], align=True)
SMS = cp.cuda.Device().attributes["MultiProcessorCount"]

def end(seq):
    e = np.zeros(1, dtype=end_t)[0]
    if seq:
        e["blocks"], e["word"], e["seq"] = blocks.data.ptr, word.ptr, seq
    return e

seq = 0
for row, count in ((64, 1 << 20), (4096, 1 << 16)):
    rows = POOL // row
    idx_h = np.random.default_rng(row).integers(0, rows, count, dtype=np.uint64)
    idx = cp.asarray(idx_h)
    dst = cp.zeros(count * row, dtype=cp.uint8)
    threads = count * (row // 16) // 4
    grid = int(min(max((threads + 255) // 256, 1), SMS * 32))
    times = {"armed": [], "not armed": []}
    for i in range(N + 3):
        for way in ("armed", "not armed") if i % 2 == 0 else ("not armed", "armed"):
            seq += 1
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            kern((grid,), (256,), (np.uint64(pinned.ptr), np.uint64(rows), np.uint64(row), idx,
                                   np.uint64(count), dst, err, end(seq if way == "armed" else 0)))
            b.record()
            b.synchronize()
            if i >= 3:
                times[way].append(cp.cuda.get_elapsed_time(a, b) * 1000)
            if way == "armed" and int(word_host[0]) != seq:
                raise SystemExit(f"the end word holds {word_host[0]}, not {seq}")
            if i == N + 2:
                got = cp.asnumpy(dst).reshape(count, row)
                want = pool.reshape(rows, row)[idx_h.astype(np.int64)]
                if not np.array_equal(got, want) or int(err[0]) != 2**64 - 1:
                    raise SystemExit(f"{way}: wrong rows")
    p50 = {w: sorted(t)[len(t) // 2] for w, t in times.items()}
    print(f"{count} rows of {row} B, {grid} blocks: armed {p50['armed']:.1f} us, not armed "
          f"{p50['not armed']:.1f} us ({p50['armed'] / p50['not armed']:.3f}x); counter left "
          f"{int(blocks[0])}")
