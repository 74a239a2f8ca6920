# A probe, not a suite: where gpuio_swap_in_plan's time goes (python3 swap_in_plan.py
# kernels/ai.cu, CuPy compiling the module). The same steady-state load (32K positions, 4096
# slots, top-2048, ~10% misses) is planned by variants of the kernel that stop after each
# phase (they find their place by the text of kernels/ai.cu: update `marks` when it changes).
# The state is restored from one snapshot before every launch; an unrelated copy kernel runs
# before it; an empty kernel in the same window measures the launch's own cost. docs/PERF.md
# (B1 planned on the device) has the figures.
import numpy as np, cupy as cp, sys
src0 = open(sys.argv[1]).read()
P, S, K = 32768, 4096, 2048
marks = [
    ("const gpuio_u32 count = (gpuio_u32)want;\n", 1),
    ("const gpuio_u32 misses = totals & 0xffff, hits = totals >> 16;\n", 2),
    ("        const gpuio_u32 n = tid < 256 ? sh.hist[255 - tid] : 0;\n", 3),
    ("        j = gpuio_swap_scan(victims, sh.sums, &t2);\n", 4),
]
def variant(stop):
    s = src0
    for text, k in marks:
        assert text in s, text
        s = s.replace(text, text + f"    if ({stop} == {k}) return;\n" if k != 3 else f"    if ({stop} == {k}) return;\n" + text)
    return s
copy = cp.RawKernel(r'''extern "C" __global__ void junk(const float4* a, float4* b, int n){
  int i = blockIdx.x*blockDim.x+threadIdx.x; if (i<n) { float4 v=a[i]; v.x+=1; b[i]=v; } }''', "junk")
ja = cp.zeros(1 << 20, dtype=cp.float32); jb = cp.zeros_like(ja)
rng = np.random.default_rng(5)
state = cp.zeros(2 + P + 2 * S, dtype=cp.uint32); state[2:2 + P + S] = 0xffffffff
sel = cp.zeros(K, dtype=cp.uint32); codes = cp.zeros(K, dtype=cp.uint64)
report = cp.full(3, 0xffffffffffffffff, dtype=cp.uint64); gjob = cp.zeros(8, dtype=cp.uint64)
ctrl_h = cp.cuda.alloc_pinned_memory(16)
ctrl = np.frombuffer(ctrl_h, dtype=np.uint64, count=2); ctrl[:] = [P, K]
job = np.zeros(8, dtype=np.uint64)
job[:] = [sel.data.ptr, ctrl_h.ptr, state.data.ptr, gjob.data.ptr, 0, 0, P | (S << 32), K]
jobs = cp.asarray(job)
def nxt(cur):
    keep = cur[rng.random(K) < 0.9]
    fresh = rng.choice(P, K * 2, replace=False)
    fresh = fresh[~np.isin(fresh, keep)][:K - len(keep)]
    return np.concatenate([keep, fresh]).astype(np.uint32)
base = cp.RawModule(code=variant(0), options=("--std=c++17",)).get_function("gpuio_swap_in_plan")
cur = rng.choice(P, K, replace=False).astype(np.uint32)
for _ in range(60):
    cur = nxt(cur); sel.set(cur); base((1,), (1024,), (jobs, codes, report))
cp.cuda.Device().synchronize()
snap = state.copy(); cur = nxt(cur); sel.set(cur)
for stop in [1, 2, 3, 4, 0, 0]:
    f = base if stop == 0 else cp.RawModule(code=variant(stop), options=("--std=c++17",)).get_function("gpuio_swap_in_plan")
    times = []
    for rep in range(120):
        cp.copyto(state, snap); report.fill(0xffffffffffffffff)
        copy(((1 << 18) // 256,), (256,), (ja, jb, np.int32(1 << 18)))
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(); f((1,), (1024,), (jobs, codes, report)); b.record(); b.synchronize()
        if rep >= 20: times.append(cp.cuda.get_elapsed_time(a, b) * 1000)
    times.sort(); r = report.get()
    print(f"stop after phase {stop or 'all'}: p50 {times[len(times)//2]:6.2f} us (p10 {times[len(times)//10]:6.2f}, p90 {times[9*len(times)//10]:6.2f}) counts {int(r[2]) & 0xffffffff}/{int(r[2]) >> 32}", flush=True)
# An empty kernel, for the launch's own cost.
empty = cp.RawKernel('extern "C" __global__ void e(){}', "e"); times = []
for rep in range(120):
    copy(((1 << 18) // 256,), (256,), (ja, jb, np.int32(1 << 18)))
    a, b = cp.cuda.Event(), cp.cuda.Event(); a.record(); empty((1,), (1024,), ()); b.record(); b.synchronize()
    if rep >= 20: times.append(cp.cuda.get_elapsed_time(a, b) * 1000)
times.sort(); print(f"empty kernel: p50 {times[len(times)//2]:6.2f} us")
