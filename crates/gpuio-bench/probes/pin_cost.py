"""What pinning staging memory costs a fresh process, by the CUDA driver API (ctypes): 8
buffers of 16 MiB (128 MiB: 8 LocalIO lanes' staging at 4 slots of 4 MiB) made as gpuio makes them (anonymous
mmap, then cuMemHostRegister), with the pages touched first, with transparent huge pages
asked for, by cuMemHostAlloc, 8 at once on threads, and one buffer of 128 MiB. Prints one JSON line of milliseconds
for the 8 buffers of each way.

    python pin_cost.py
"""

import ctypes
import json
import mmap
import threading
import time

cuda = ctypes.CDLL("libcuda.so.1")
for name in ("cuInit", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuMemHostRegister_v2",
             "cuMemHostUnregister", "cuMemHostAlloc", "cuMemFreeHost"):
    assert hasattr(cuda, name), name
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
LEN, COUNT = 16 << 20, 8
MADV_HUGEPAGE, MADV_POPULATE_WRITE, MAP_POPULATE = 14, 23, 0x8000


def anon(touch=False, huge=False, populate=False, map_populate=False):
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_POPULATE if map_populate else 0)
    p = libc.mmap(None, LEN, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if huge:
        libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(LEN), MADV_HUGEPAGE)
    if populate:
        assert libc.madvise(ctypes.c_void_p(p), ctypes.c_size_t(LEN), MADV_POPULATE_WRITE) == 0
    if touch:
        ctypes.memset(p, 0, LEN)
    return p


def register(p):
    assert cuda.cuMemHostRegister_v2(ctypes.c_void_p(p), ctypes.c_size_t(LEN), 1) == 0


def timed(make):
    t = time.perf_counter()
    out = [make() for _ in range(COUNT)]
    return round((time.perf_counter() - t) * 1e3, 2), out


result = {}
result["mmap_register"], _ = timed(lambda: register(anon()) or 0)
result["touch_only"], touched = timed(lambda: anon(touch=True))
result["register_touched"], _ = timed(lambda: register(touched.pop()) or 0)
result["huge_register"], _ = timed(lambda: register(anon(huge=True)) or 0)


def host_alloc():
    p = ctypes.c_void_p()
    assert cuda.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(LEN), 1) == 0
    return p


result["cuMemHostAlloc"], _ = timed(host_alloc)
# gpuio's staging today: huge pages asked for, MADV_POPULATE_WRITE, then registered.
result["huge_populate_register"], _ = timed(lambda: register(anon(huge=True, populate=True)) or 0)
result["populate_only"], _ = timed(lambda: anon(populate=True))
result["map_populate_register"], _ = timed(lambda: register(anon(map_populate=True)) or 0)
result["huge_touch_register"], _ = timed(lambda: register(anon(huge=True, touch=True)) or 0)


def on_threads(make):
    t = time.perf_counter()

    def one():
        assert cuda.cuCtxSetCurrent(ctx) == 0
        make()

    threads = [threading.Thread(target=one) for _ in range(COUNT)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return round((time.perf_counter() - t) * 1e3, 2)


def one_big():
    global LEN
    LEN, saved = LEN * COUNT, LEN
    t = time.perf_counter()
    register(anon(huge=True))
    LEN = saved
    return round((time.perf_counter() - t) * 1e3, 2)


result["one_128MiB_register"] = one_big()
result["mmap_register_8_threads"] = on_threads(lambda: register(anon()))
result["touch_register_8_threads"] = on_threads(lambda: register(anon(touch=True)))
result["huge_populate_register_8_threads"] = on_threads(
    lambda: register(anon(huge=True, populate=True))
)
print(json.dumps(result))
