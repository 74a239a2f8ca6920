# A probe, not a suite: of a small call's wall time past its kernel, how much is the driver's
# wait, and would watching a word in mapped host memory see the end sooner? One tiny kernel
# (one block; `mark` has its last thread store the call's number to pinned host memory after a
# system-wide fence, `idle` does nothing), N calls (argv[1], default 4000) of each way,
# alternating:
#   sync    launch, then cuStreamSynchronize
#   query   launch, then cuStreamQuery until it reports the stream idle
#   spin    launch `mark`, then spin on the host word until it holds the call's number
#   write   launch `idle`, then cuStreamWriteValue32 of the number to the word, then spin
#   event   events around the launch: the device's time, the launch's own latency included
#   sysN/devN  launch a kernel of N blocks that counts its blocks as gather.cu's
#           gpuio_signal_end does (a system-wide fence / a device-wide one before each count),
#           the last storing the number, then spin on the word
#   launch  the launch call alone (of the spin calls)
# The driver is called through ctypes.PyDLL (the interpreter lock held, as a compiled caller
# would call it); the stream is synchronized outside the clock after each timed call. Prints
# p50 and p90 of each, in microseconds. docs/PERF.md (row gathers, small calls) has the
# figures.
import ctypes, sys, time
import numpy as np, cupy as cp

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
cu = ctypes.PyDLL("libcuda.so.1")
for f in ("cuStreamSynchronize", "cuStreamQuery"):
    getattr(cu, f).argtypes = [ctypes.c_void_p]
cu.cuStreamWriteValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
mod = cp.RawModule(code=r'''
extern "C" __global__ void mark(volatile unsigned int* word, unsigned int seq) {
  if (threadIdx.x == blockDim.x - 1) { __threadfence_system(); *word = seq; }
}
extern "C" __global__ void idle(volatile unsigned int* word, unsigned int seq) {}
// As gather.cu's gpuio_signal_end: the last block to finish stores the number (FENCE 1: a
// device-wide fence before each block's count, 2: a system-wide one).
template <int FENCE> __device__ void counted(volatile unsigned int* word, unsigned int seq,
                                             unsigned int* blocks) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (FENCE == 2) __threadfence_system(); else __threadfence();
  if (atomicAdd(blocks, 1u) != gridDim.x - 1) return;
  *blocks = 0;
  __threadfence_system();
  *word = seq;
}
extern "C" __global__ void counted_sys(volatile unsigned int* word, unsigned int seq,
                                       unsigned int* blocks) { counted<2>(word, seq, blocks); }
extern "C" __global__ void counted_dev(volatile unsigned int* word, unsigned int seq,
                                       unsigned int* blocks) { counted<1>(word, seq, blocks); }''')
kern = {n: mod.get_function(n) for n in ("mark", "idle", "counted_sys", "counted_dev")}
blocks = cp.zeros(1, dtype=cp.uint32)
pinned = cp.cuda.alloc_pinned_memory(4096)
word = np.frombuffer(pinned, dtype=np.uint32, count=1)
word[0] = 0
stream = cp.cuda.Stream(non_blocking=True)
raw = ctypes.c_void_p(stream.ptr)
ptr = np.uintp(pinned.ptr)
ways = ("sync", "query", "spin", "write", "event", "sys1", "dev1", "sys8", "dev8")
times = {w: [] for w in ways + ("launch",)}
seq = 0
for i in range(N + 200):
    for way in ways if i % 2 == 0 else ways[::-1]:
        seq += 1
        s = np.uint32(seq)
        k = kern["idle" if way == "write" else "mark"]
        grid, args = 1, (ptr, s)
        if way[:3] in ("sys", "dev"):
            k = kern["counted_sys" if way[:3] == "sys" else "counted_dev"]
            grid, args = int(way[3:]), (ptr, s, blocks)
        if way == "event":
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            k((grid,), (32,), args, stream=stream)
            b.record(stream)
            b.synchronize()
            us = cp.cuda.get_elapsed_time(a, b) * 1000
        else:
            t = time.perf_counter_ns()
            k((grid,), (32,), args, stream=stream)
            launched = (time.perf_counter_ns() - t) / 1000
            if way == "sync":
                assert cu.cuStreamSynchronize(raw) == 0
            elif way == "query":
                while cu.cuStreamQuery(raw) != 0:
                    pass
            else:
                if way == "write":
                    assert cu.cuStreamWriteValue32_v2(raw, pinned.ptr, seq, 0) == 0
                while word[0] != seq:
                    pass
            us = (time.perf_counter_ns() - t) / 1000
            assert cu.cuStreamSynchronize(raw) == 0
        if word[0] != seq:
            raise SystemExit(f"{way}: the word holds {word[0]}, not {seq}")
        if i >= 200:
            times[way].append(us)
            if way == "spin":
                times["launch"].append(launched)
for way, ts in times.items():
    ts.sort()
    print(f"{way:6s} p50 {ts[len(ts) // 2]:6.2f} us  p90 {ts[len(ts) * 9 // 10]:6.2f} us  (n {len(ts)})")
