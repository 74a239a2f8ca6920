# A probe, not a suite: what a load queued in a model's stream order pays besides its kernel.
# A model's stream A runs a long kernel (standing in for the indexer), then the pieces below,
# each timed by events on A from the long kernel's end to the point where A may go on (the
# launches are queued while the long kernel runs, so the host's launch time is hidden):
#   kernel        an empty kernel on A
#   upload+kernel a 16-byte copy from pinned memory, then the kernel (a load's control words)
#   kernel+dl     the kernel, then a 64-byte copy to pinned memory (a load's report words)
#   handoff       A's event waited for by stream B, the kernel on B, B's event waited for by A
#                 (a load on its own stream, ordered to the model's both ways)
# p50 and p90 of 300 (argv[1]) of each, alternating, in microseconds. docs/PERF.md (B1) has
# the figures.
import sys
import numpy as np, cupy as cp

N = int(sys.argv[1]) if len(sys.argv) > 1 else 300
mod = cp.RawModule(code=r'''
extern "C" __global__ void busy(float4* a, unsigned long long n) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) a[i].x += 1.0f;
}
extern "C" __global__ void empty() {}
''')
busy, empty = mod.get_function("busy"), mod.get_function("empty")
a = cp.zeros(32 << 20, dtype=cp.float32)
A, B = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
up = cp.cuda.alloc_pinned_memory(16)
down = cp.cuda.alloc_pinned_memory(64)
dev = cp.zeros(64, dtype=cp.uint8)


def kernel(s):
    empty((1,), (32,), (), stream=s)


def upload_kernel(s):
    cp.cuda.runtime.memcpyAsync(dev.data.ptr, up.ptr, 16, 1, s.ptr)
    kernel(s)


def kernel_download(s):
    kernel(s)
    cp.cuda.runtime.memcpyAsync(down.ptr, dev.data.ptr, 64, 2, s.ptr)


def handoff(s):
    e = cp.cuda.Event(disable_timing=True)
    e.record(s)
    B.wait_event(e)
    kernel(B)
    f = cp.cuda.Event(disable_timing=True)
    f.record(B)
    s.wait_event(f)


cases = {"kernel": kernel, "upload+kernel": upload_kernel, "kernel+dl": kernel_download,
         "handoff": handoff}
times = {k: [] for k in cases}
for rep in range(N + 20):
    for name, run in cases.items():
        start, end = cp.cuda.Event(), cp.cuda.Event()
        busy((264,), (512,), (a, np.uint64(a.size // 4)), stream=A)
        start.record(A)
        run(A)
        end.record(A)
        end.synchronize()
        if rep >= 20:
            times[name].append(cp.cuda.get_elapsed_time(start, end) * 1000)
for name, ts in times.items():
    ts.sort()
    print(f"{name:14} p50 {ts[len(ts) // 2]:6.2f} us  p90 {ts[9 * len(ts) // 10]:6.2f} us", flush=True)
