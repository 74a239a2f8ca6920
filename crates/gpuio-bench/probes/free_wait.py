# A probe, not a suite: does freeing device memory wait for a kernel that is still running on
# another (non-blocking) stream of the same context? That is what a resident block looks like
# to the rest of a process (crates/gpuio-hal/src/gpu/resident.rs). One block spins for SPIN
# seconds (argv[1], default 1.0) on the GPU's global timer; meanwhile the host times, each
# against a fresh allocation of 1 MiB:
#   cudaFree       the runtime's free (CuPy's cupy.cuda.runtime.free)
#   cuMemFree      the driver's free (ctypes)
#   cudaFreeAsync  the stream-ordered free, on the legacy default stream
#   cuMemFreeHost  a free of page-locked host memory (cuMemHostAlloc)
#   unregister     cuMemHostUnregister of registered host memory
#   cudaMalloc     an allocation of 1 MiB; cuMemAlloc1G one of 1 GiB (new mappings)
#   cuMemHostAlloc page-locked host memory; register: cuMemHostRegister of 2 MiB
#   managed       cuMemAllocManaged of 1 MiB
#   ctxsync        cuCtxSynchronize (for scale: it waits for the kernel)
# A time near SPIN means the call waited for the kernel. Prints each in milliseconds.
import ctypes, sys, time
import cupy as cp

SPIN = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
cu = ctypes.CDLL("libcuda.so.1")
cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
cu.cuMemFreeHost.argtypes = [ctypes.c_void_p]
cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
cu.cuMemAllocManaged.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_uint]
spin = cp.RawKernel(r'''
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}''', "spin")
stream = cp.cuda.Stream(non_blocking=True)
rt = cp.cuda.runtime


def timed(name, f):
    cp.cuda.Device().synchronize()
    with stream:
        spin((1,), (32,), (cp.uint64(int(SPIN * 1e9)),))
    time.sleep(0.05)  # the kernel is running
    t = time.perf_counter()
    f()
    ms = (time.perf_counter() - t) * 1e3
    print(f"{name:14s} {ms:9.2f} ms   (spin {SPIN * 1e3:.0f} ms)")


def cuda_free():
    p = rt.malloc(1 << 20)
    return lambda: rt.free(p)


def driver_free():
    p = ctypes.c_uint64()
    assert cu.cuMemAlloc_v2(ctypes.byref(p), 1 << 20) == 0
    return lambda: cu.cuMemFree_v2(p.value)


def free_async():
    p = rt.malloc(1 << 20)
    return lambda: rt.freeAsync(p, 0)


def host_free():
    p = ctypes.c_void_p()
    assert cu.cuMemHostAlloc(ctypes.byref(p), 1 << 20, 0) == 0
    return lambda: cu.cuMemFreeHost(p)


def unregister():
    buf = ctypes.create_string_buffer(1 << 21)
    at = (ctypes.addressof(buf) + 4095) & ~4095
    assert cu.cuMemHostRegister_v2(at, 1 << 20, 0) == 0
    return lambda keep=buf: cu.cuMemHostUnregister(at)  # keep: the buffer outlives the call


for name, make in (("cudaFree", cuda_free), ("cuMemFree", driver_free),
                   ("cudaFreeAsync", free_async), ("cuMemFreeHost", host_free),
                   ("unregister", unregister)):
    timed(name, make())
timed("cudaMalloc", lambda: rt.malloc(1 << 20))
timed("cuMemAlloc1G", lambda: cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), 1 << 30))
timed("cuMemHostAlloc", lambda: cu.cuMemHostAlloc(ctypes.byref(ctypes.c_void_p()), 1 << 21, 0))
keep = ctypes.create_string_buffer(1 << 22)
at = (ctypes.addressof(keep) + 4095) & ~4095
timed("register", lambda: cu.cuMemHostRegister_v2(at, 1 << 21, 0))
timed("managed", lambda: cu.cuMemAllocManaged(ctypes.byref(ctypes.c_uint64()), 1 << 20, 1))
timed("ctxsync", lambda: cp.cuda.Device().synchronize())
