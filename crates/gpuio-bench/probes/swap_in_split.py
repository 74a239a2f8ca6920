# A probe, not a suite: the device-planned swap-in's two kernels (kernels/ai.cu) timed apart,
# against the floor of their work: python3 swap_in_split.py kernels/ai.cu (CuPy compiling the
# module). Steady-state loads (32K positions, 4096 slots, top-2048, ~10% misses; one request,
# then 64) are set up by running fetch + install; then, from one snapshot of the states, the
# fetch (the critical path), the install, and a kernel that only reads the step's missed rows
# from pinned memory (no lookups: the bus's part) are each timed with CUDA events — after a
# 256 MiB copy kernel ("queued": the GPU busy while the launch is queued, L2 flushed) or on an
# idle GPU (the launch's host gap inside the events, as `gpuio bench ai` measures). The
# selection is written by a kernel just before, as a model's indexer leaves it. Last, for one
# request, the fetch of selections that miss 0 to 64 positions (the floor a prefetch of the
# step's new positions would leave).
# docs/PERF.md (B1: the load split in two) has the figures.
import numpy as np, cupy as cp, sys
src = open(sys.argv[1]).read()
P, S, K, RB = 32768, 4096, 2048, 656
mod = cp.RawModule(code=src, options=("--std=c++17",))
fetch, install = mod.get_function("gpuio_swap_in_fetch"), mod.get_function("gpuio_swap_in_install")
# The fetch's inline control words (gpuio_swap_inline) with no job: it reads the table's.
TABLE = np.zeros((), dtype=[("jobs", "<u8"), ("words", "<u8", (32,))])[()]
aux = cp.RawModule(code=r'''
typedef unsigned long long u64; typedef unsigned int u32;
// n random host rows (positions in idx) into dst, 32 rows a block of 256 threads, every load
// of a thread in flight before its stores (as the fetch copies).
extern "C" __global__ void rows(const u32* idx, u32 n, const char* warm, char* dst) {
  __shared__ const char* from[32];
  const u32 base = blockIdx.x * 32;
  if (threadIdx.x < 32) from[threadIdx.x] = base + threadIdx.x < n ? warm + (u64)idx[base + threadIdx.x] * 656 : 0;
  __syncthreads();
  uint4 v[6];
#pragma unroll
  for (int k = 0; k < 6; k++) {
    const u32 c = threadIdx.x + k * 256, e = c / 41, w = c % 41;
    if (c < 32 * 41 && from[e]) v[k] = ((const uint4*)from[e])[w];
  }
#pragma unroll
  for (int k = 0; k < 6; k++) {
    const u32 c = threadIdx.x + k * 256, e = c / 41, w = c % 41;
    if (c < 32 * 41 && from[e]) ((uint4*)(dst + (u64)(base + e) * 656))[w] = v[k];
  }
}
extern "C" __global__ void big_copy(const float4* a, float4* b, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) b[i] = a[i];
}
extern "C" __global__ void put(const u32* a, u32* b, u32 n) {
  for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) b[i] = a[i];
}
extern "C" __global__ void empty() {}
''', options=("--std=c++17",))
rows, big, put, empty = (aux.get_function(f) for f in ["rows", "big_copy", "put", "empty"])
ja = cp.zeros(64 << 20, dtype=cp.float32); jb = cp.zeros_like(ja)
def busy(): big((264,), (512,), (ja, jb, np.uint64(ja.size // 4)))
rng = np.random.default_rng(5)
def nxt(cur):
    keep = cur[rng.random(K) < 0.9]
    fresh = rng.choice(P, K * 2, replace=False)
    fresh = fresh[~np.isin(fresh, keep)][:K - len(keep)]
    return np.concatenate([keep, fresh]).astype(np.uint32)
def p50(ts): ts = sorted(ts); return ts[len(ts) // 2], ts[len(ts) // 10], ts[9 * len(ts) // 10]
for J in [1, 64]:
    state = cp.zeros((J, 2 + P + 2 * S), dtype=cp.uint32); state[:, 2:2 + P + S] = 0xffffffff
    sel = cp.zeros((J, K), dtype=cp.uint32); sel_src = cp.zeros_like(sel)
    control = cp.asarray(np.tile(np.array([P, K], dtype=np.uint64), J))
    report = cp.zeros(1 + 2 * J, dtype=cp.uint64); report[:1 + J] = np.uint64(0xffffffffffffffff)
    warm_h = cp.cuda.alloc_pinned_memory(J * P * RB)
    np.frombuffer(warm_h, dtype=np.uint8, count=J * P * RB)[:] = 7
    hot = cp.zeros(J * S * RB, dtype=cp.uint8); dst = cp.zeros(J * K * RB, dtype=cp.uint8)
    staging = cp.zeros(J * K * RB, dtype=cp.uint8); seen = cp.zeros(J * K, dtype=cp.uint32)
    # ai.cu's gpuio_swap_job, 88 bytes.
    job = np.zeros((J, 11), dtype=np.uint64)
    for j in range(J):
        job[j] = [sel[j].data.ptr, control.data.ptr + 16 * j, state[j].data.ptr, warm_h.ptr + j * P * RB, 0,
                  hot.data.ptr + j * S * RB, dst.data.ptr + j * K * RB, staging.data.ptr + j * K * RB,
                  seen.data.ptr + 4 * j * K, P | (S << 32), K]
    jobs = cp.asarray(job)
    E = 8  # selection entries per block, a warp each (GPUIO_SWAP_FETCH_ENTRIES)
    grid = (K // E, J)
    go_fetch = lambda: fetch(grid, (256,), (jobs, np.uint64(RB), np.uint64(16), report, np.uint64(0), TABLE))
    go_install = lambda: install((J,), (1024,), (jobs, np.uint64(RB), np.uint64(16), report, np.uint64(0)))
    cur = [rng.choice(P, K, replace=False).astype(np.uint32) for _ in range(J)]
    for _ in range(40):
        cur = [nxt(c) for c in cur]; sel.set(np.stack(cur)); go_fetch(); go_install()
    cp.cuda.Device().synchronize()
    assert int(report[0].get()) == 0xffffffffffffffff, hex(int(report[0].get()))
    snap = state.copy()
    sels = [np.stack([nxt(c) for c in cur]) for _ in range(60)]
    def timed(name, before, launch, queued):
        ts = []
        for rep, s in enumerate(sels):
            # The state and the report words as the last install left them.
            cp.copyto(state, snap); report[:1 + J] = np.uint64(0xffffffffffffffff); report[1 + J:] = 0
            sel_src.set(s); before()
            cp.cuda.Device().synchronize()
            if queued: busy()
            put((J * 8,), (256,), (sel_src, sel, np.uint32(J * K)))
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(); launch(); b.record(); b.synchronize()
            if rep >= 10: ts.append(cp.cuda.get_elapsed_time(a, b) * 1000)
        m, lo, hi = p50(ts)
        print(f"batch {J:3} {name:26} {'queued' if queued else 'idle  '}: p50 {m:7.2f} us (p10 {lo:7.2f}, p90 {hi:7.2f})", flush=True)
        return m
    nothing = lambda: None
    misses = int(sum((snap[j, 2:2 + P].get()[sels[0][j]] == 0xffffffff).sum() for j in range(J)))
    idx = cp.asarray(rng.choice(J * P, misses, replace=False).astype(np.uint32))
    for queued in [True, False]:
        timed("empty kernel", nothing, lambda: empty((1,), (32,), ()), queued)
        t = timed("fetch", nothing, go_fetch, queued)
        print(f"  {misses} misses ({misses / J:.0f} a request): {misses * RB / t / 1e3:.1f} GB/s of misses", flush=True)
        # The install after its fetch (run untimed first; the report reset by the install).
        timed("install", go_fetch, go_install, queued)
        t = timed(f"{misses} host rows alone", nothing, lambda: rows(((misses + 31) // 32,), (256,), (idx, np.uint32(misses), np.uint64(warm_h.ptr), dst)), queued)
        print(f"  {misses / t:.1f} M rows/s, {misses * RB / t / 1e3:.1f} GB/s", flush=True)
    hb = cp.empty(misses * RB, dtype=cp.uint8); ts = []
    for rep in range(30):
        busy(); a, b = cp.cuda.Event(), cp.cuda.Event(); a.record()
        cp.cuda.runtime.memcpyAsync(hb.data.ptr, warm_h.ptr, misses * RB, 1, 0); b.record(); b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1000)
    m, _, _ = p50(ts)
    print(f"  cudaMemcpy of the misses' {misses * RB} B, pinned -> device, queued: p50 {m:.2f} us = {misses * RB / m / 1e3:.1f} GB/s", flush=True)
    # Every row written, from its slot or from host memory (every entry is 7s; the slots were
    # filled from host memory by the installs).
    cp.copyto(state, snap); sel.set(sels[0]); dst.fill(1); go_fetch(); cp.cuda.Device().synchronize()
    r = report.get()
    print(f"  fetch rows right: {bool((dst == 7).all())}, no failure: {int(r[0]) == 0xffffffffffffffff}", flush=True)
    go_install(); cp.cuda.Device().synchronize()
    if J != 1:
        continue
    # The fetch against its misses: selections of the resident positions with `k` positions
    # not resident in them (as a prefetch that found all but k of a step's new positions
    # would leave it).
    s0 = snap[0, 2:2 + P].get()
    resident = np.flatnonzero(s0 != 0xffffffff).astype(np.uint32)
    absent = np.flatnonzero(s0 == 0xffffffff).astype(np.uint32)
    for k in [0, 1, 4, 16, 64]:
        sels = [np.stack([np.concatenate([rng.choice(resident, K - k, replace=False),
                                          rng.choice(absent, k, replace=False)])]) for _ in range(60)]
        for queued in [True, False]:
            timed(f"fetch, {k} misses", nothing, go_fetch, queued)
