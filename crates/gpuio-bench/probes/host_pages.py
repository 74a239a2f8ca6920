# A probe, not a suite: does the device's rate of random reads from host memory depend on how
# that memory was made? One kernel reads random rows (256 B and 656 B, one 16-byte load per
# thread) from GB gigabytes (env GB, default 16) of host memory made one of five ways:
#   hostalloc  cudaHostAlloc
#   nohuge     mmap with MADV_NOHUGEPAGE, then cudaHostRegister
#   huge       mmap with MADV_HUGEPAGE (transparent huge pages), then cudaHostRegister
#   hugetlb    mmap with MAP_HUGETLB (2 MiB pages; needs root to reserve them)
#   vmm2/vmm3  cuMemCreate on the host (CU_MEM_LOCATION_TYPE_HOST / HOST_NUMA), mapped for
#              the device and the CPU
# Run one way per process (python3 host_pages.py huge): a failure in one leaves the others.
# Prints CUDA-event p50 per call and rows per second. docs/PERF.md (B2) has the figures.
import ctypes, sys, time, os, subprocess
import numpy as np, cupy as cp
GB = int(os.environ.get("GB", "16")); SIZE = GB << 30
print(open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip(),
      open('/sys/kernel/mm/transparent_hugepage/defrag').read().strip(), flush=True)
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
cuda = ctypes.CDLL("libcuda.so.1")
TWO = 2 << 20
src = r'''
extern "C" __global__ void gather(const uint4* __restrict__ t, const long long* __restrict__ idx,
                                  uint4* __restrict__ out, long long n, int w) {
  long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  long long row = g / w; int k = g % w;
  if (row < n) out[row * w + k] = t[idx[row] * w + k];
}'''
kern = cp.RawKernel(src, "gather")
def anon_huge():
    return int(subprocess.run("grep AnonHugePages /proc/meminfo", shell=True, capture_output=True, text=True).stdout.split()[1]) >> 10
def bench(name, ptr):
    rng = np.random.default_rng(1)
    for rowb in (256, 656):
        w = rowb // 16 if rowb % 16 == 0 else 41  # 656 B = 41 x 16 B
        rows = SIZE // (w * 16)
        for n in (768, 49152, 1 << 20):
            idx = cp.asarray(rng.integers(0, rows, n, dtype=np.int64))
            out = cp.empty(n * w * 16, dtype=cp.uint8)
            th = 256; bl = (n * w + th - 1) // th
            ts = []
            for r in range(25):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(); kern((bl,), (th,), (ptr, idx, out, np.int64(n), np.int32(w))); b.record(); b.synchronize()
                if r >= 5: ts.append(cp.cuda.get_elapsed_time(a, b) * 1000)
            ts.sort(); p50 = ts[len(ts)//2]
            print(f"{name:10s} row {rowb:4d} B n {n:8d}: p50 {p50:9.1f} us  {n/p50:8.1f} M rows/s  {n*rowb/p50/1e3:6.2f} GB/s", flush=True)
def mmap_case(name, advice, hugetlb=False):
    flags = 0x2 | 0x20 | (0x40000 if hugetlb else 0)
    p = libc.mmap(None, SIZE + TWO, 3, flags, -1, 0)
    if p is None or p == (1 << 64) - 1 or p == ctypes.c_void_p(-1).value:
        print(name, "mmap failed errno", ctypes.get_errno()); return
    a = (p + TWO - 1) & ~(TWO - 1)
    if advice: print(name, "madvise", libc.madvise(a, SIZE, advice))
    h0 = anon_huge(); t = time.time(); libc.memset(a, 1, SIZE); t1 = time.time()
    cp.cuda.runtime.hostRegister(a, SIZE, 3); t2 = time.time()
    print(f"{name}: touched {t1-t:.1f} s, registered {t2-t1:.1f} s, AnonHugePages +{anon_huge()-h0} MiB", flush=True)
    bench(name, a)
    cp.cuda.runtime.hostUnregister(a); libc.munmap(p, SIZE + TWO)
def hostalloc_case():
    t = time.time(); p = cp.cuda.runtime.hostAlloc(SIZE, 3); t1 = time.time()
    libc.memset(p, 1, SIZE)
    print(f"hostalloc: allocated {t1-t:.1f} s", flush=True)
    bench("hostalloc", p); cp.cuda.runtime.freeHost(p)
class Loc(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Flags(ctypes.Structure): _fields_ = [("ct", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("r", ctypes.c_ubyte * 4)]
class Prop(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("ht", ctypes.c_int), ("loc", Loc), ("win", ctypes.c_void_p), ("flags", Flags)]
class Access(ctypes.Structure): _fields_ = [("loc", Loc), ("flags", ctypes.c_int)]
def vmm_case(loctype):
    name = f"vmm{loctype}"
    prop = Prop(); prop.type = 1; prop.loc.type = loctype; prop.loc.id = 0
    g = ctypes.c_size_t(); rc = cuda.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 1)
    print(name, "granularity rc", rc, g.value, flush=True)
    if rc: return
    ptr = ctypes.c_uint64(); h = ctypes.c_uint64()
    t = time.time()
    print(name, "reserve", cuda.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(SIZE), ctypes.c_size_t(g.value), ctypes.c_uint64(0), ctypes.c_uint64(0)))
    rc = cuda.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(SIZE), ctypes.byref(prop), ctypes.c_uint64(0)); print(name, "create", rc)
    if rc: return
    print(name, "map", cuda.cuMemMap(ptr, ctypes.c_size_t(SIZE), ctypes.c_size_t(0), h, ctypes.c_uint64(0)))
    acc = (Access * 2)(); acc[0].loc.type = 1; acc[0].loc.id = 0; acc[0].flags = 3
    acc[1].loc.type = loctype; acc[1].loc.id = 0; acc[1].flags = 3
    rc2 = cuda.cuMemSetAccess(ptr, ctypes.c_size_t(SIZE), acc, ctypes.c_size_t(2)); print(name, "access dev+host rc", rc2)
    if rc2: print(name, "access dev only rc", cuda.cuMemSetAccess(ptr, ctypes.c_size_t(SIZE), acc, ctypes.c_size_t(1)))
    cp.cuda.runtime.memset(ptr.value, 1, SIZE); cp.cuda.Device().synchronize()
    print(f"{name}: made in {time.time()-t:.1f} s", flush=True)
    bench(name, ptr.value)
    if rc2 == 0:
        t = time.time(); libc.memset(ptr.value, 2, SIZE); print(f"{name}: CPU memset ok {SIZE/(time.time()-t)/1e9:.1f} GB/s", flush=True)
        bench(name + "cpu", ptr.value)
cp.cuda.Device(0).use(); cp.zeros(1)
which = sys.argv[1:] or ["hostalloc", "nohuge", "huge", "vmm2", "vmm3", "hugetlb"]
for c in which:
    if c == "hostalloc": hostalloc_case()
    elif c == "nohuge": mmap_case("nohuge", 15)
    elif c == "huge": mmap_case("huge", 14)
    elif c == "vmm2": vmm_case(2)
    elif c == "vmm3": vmm_case(3)
    elif c == "hugetlb":
        try:
            open("/proc/sys/vm/nr_hugepages", "w").write(str(GB * 512 + 16)); print("nr_hugepages", open("/proc/sys/vm/nr_hugepages").read().strip())
            mmap_case("hugetlb", 0, True)
        except Exception as e: print("hugetlb:", e)
