# A probe, not a suite: the swap-in fetch (kernels/ai.cu) with rows of 656 B to 256 KiB, a
# few to many at a time, every row a miss from pinned host memory, against cudaMemcpy of as
# many bytes: python3 swap_in_rows.py kernels/ai.cu (CuPy compiling the module). Each fetch is
# queued behind a busy kernel so that its launch is hidden; CUDA events around it. The fetch
# gives each 128 pieces of a row a warp (2 KiB at 16-byte pieces).
import numpy as np, cupy as cp, sys
src = open(sys.argv[1]).read()
mod = cp.RawModule(code=src, options=("--std=c++17",))
fetch = mod.get_function("gpuio_swap_in_fetch")
# The fetch's inline control words (gpuio_swap_inline) with no job: it reads the table's.
TABLE = np.zeros((), dtype=[("jobs", "<u8"), ("words", "<u8", (32,))])[()]
aux = cp.RawModule(code=r'''
extern "C" __global__ void big_copy(const float4* a, float4* b, unsigned long long n) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) b[i] = a[i];
}''')
big = aux.get_function("big_copy")
ja = cp.zeros(64 << 20, dtype=cp.float32); jb = cp.zeros_like(ja)
def busy(): big((264,), (512,), (ja, jb, np.uint64(ja.size // 4)))
P, S, K = 512, 512, 256
def p50(ts): ts = sorted(ts); return ts[len(ts) // 2]
for RB in [656, 4096, 16384, 65536, 262144]:
    warm_h = cp.cuda.alloc_pinned_memory(P * RB)
    np.frombuffer(warm_h, dtype=np.uint8, count=P * RB)[:] = 7
    dst = cp.zeros(K * RB, dtype=cp.uint8); staging = cp.zeros(K * RB, dtype=cp.uint8)
    hot = cp.zeros(S * RB, dtype=cp.uint8); seen = cp.zeros(K, dtype=cp.uint32)
    state = cp.zeros(2 + P + 2 * S, dtype=cp.uint32); state[2:2 + P + S] = 0xffffffff
    snap = state.copy()
    sel = cp.asarray(np.random.default_rng(1).permutation(P)[:K].astype(np.uint32))
    report = cp.zeros(3, dtype=cp.uint64)
    chunks = -(-RB // 16 // 128)  # a warp per 128 pieces of a row (GPUIO_SWAP_CHUNK_PIECES)
    line = []
    for n in [1, 4, 8, 64]:
        if n * RB > 32 << 20:
            continue
        control = cp.asarray(np.array([P, n], dtype=np.uint64))
        job = np.array([sel.data.ptr, control.data.ptr, state.data.ptr, warm_h.ptr, 0, hot.data.ptr,
                        dst.data.ptr, staging.data.ptr, seen.data.ptr, P | (S << 32), K], dtype=np.uint64)
        jobs = cp.asarray(job)
        ts, cs = [], []
        for rep in range(25):
            cp.copyto(state, snap); report[:2] = np.uint64(0xffffffffffffffff); report[2] = 0
            dst.fill(1); cp.cuda.Device().synchronize()
            busy(); a, b = cp.cuda.Event(), cp.cuda.Event(); a.record()
            fetch(((n * chunks + 7) // 8, 1), (256,), (jobs, np.uint64(RB), np.uint64(16), report, np.uint64(0), TABLE))
            b.record(); b.synchronize()
            if rep >= 5: ts.append(cp.cuda.get_elapsed_time(a, b) * 1000)
            busy(); a, b = cp.cuda.Event(), cp.cuda.Event(); a.record()
            cp.cuda.runtime.memcpyAsync(staging.data.ptr, warm_h.ptr, n * RB, 1, 0)
            b.record(); b.synchronize()
            if rep >= 5: cs.append(cp.cuda.get_elapsed_time(a, b) * 1000)
        ok = bool((dst[:n * RB] == 7).all()) and int(report[2].get()) >> 32 == n
        f, c = p50(ts), p50(cs)
        line.append(f"{n:3} rows {f:8.1f} us ({n * RB / f / 1e3:5.1f} GB/s) vs memcpy {c:7.1f} = {c / f:4.2f}x{'' if ok else ' WRONG'}")
    print(f"{RB:7} B: " + " | ".join(line), flush=True)
