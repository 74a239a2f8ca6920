"""On-demand arrays from Python: a CuPy kernel reads random elements of a file four times
larger than its page cache in GPU memory, as if the file were a device array.

    python ondemand_cupy.py [--scratch DIR] [--mib N]

gpuio keeps the cache and serves its misses: in place from the file's pinned page cache pages
where the device can (a page not yet touched often enough reads just the element over the
bus), else through the request ring. The kernel is compiled by CuPy with gpuio's device header
in front and takes the array's descriptor. Each thread starts its read with get_async, does its own work, then waits (AGILE's
issue, compute, wait). The result is checked against NumPy, and the cache's counters printed.
Then a part of the file that fits the cache is held there (``resident()``) and read through
``gpuio_resident_array<float>``: no pin or check per access, the hit path of data known to fit.
Needs a CUDA GPU, CuPy and NumPy.
"""

import argparse
import os
import tempfile
import time

import cupy as cp
import numpy as np

import gpuio

KERNEL = r"""
extern "C" __global__ void scaled_gather(const gpuio_array_desc* desc,
                                         const unsigned long long* idx, float scale,
                                         float* out, unsigned long long n) {
    const gpuio_array<float> a(*desc);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    // A warp-uniform trip count: every lane takes part in each array call.
    for (unsigned long long base = (unsigned long long)blockIdx.x * blockDim.x; base < n;
         base += stride) {
        const unsigned long long k = base + threadIdx.x;
        auto f = a.get_async(k < n ? idx[k] : 0ull);  // issue (a miss is fetched meanwhile)
        const float w = scale * (k % 2 ? 1.0f : -1.0f);  // compute
        const float v = a.wait(f);                       // wait
        if (k < n) out[k] = w * v;
    }
}

extern "C" __global__ void resident_gather(const gpuio_resident_desc* desc,
                                           const unsigned long long* idx, float* out,
                                           unsigned long long n) {
    const gpuio_resident_array<float> a(*desc);
    a.gather(idx, out, n);
}
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scratch", default=tempfile.gettempdir())
    p.add_argument("--mib", type=int, default=256, help="cache capacity in MiB (file: 4x)")
    args = p.parse_args()
    capacity = args.mib << 20
    elements = 4 * capacity // 4
    path = os.path.join(args.scratch, "gpuio-ondemand-example.f32")
    # Element i holds float(i % 65536): exact in float32, so the check can be exact too.
    with open(path, "wb") as f:
        chunk = np.arange(1 << 20, dtype=np.uint32) % 65536
        for _ in range(elements // chunk.size):
            f.write(chunk.astype(np.float32).tobytes())

    session = gpuio.Session()
    cache = session.page_cache(gpu=0, page_size=4096, capacity=capacity)
    arr = cache.array(path, dtype=np.float32)
    module = cp.RawModule(code=gpuio.device_header() + KERNEL, options=("--std=c++17",))
    kernel = module.get_function("scaled_gather")
    desc = cp.asarray(np.frombuffer(arr.descriptor, dtype=np.uint8))

    n = 1 << 22
    cp.random.seed(1)
    idx = cp.random.randint(0, len(arr), size=n, dtype=cp.int64).astype(cp.uint64)
    out = cp.empty(n, dtype=cp.float32)
    t = time.perf_counter()
    # 8192 threads: about as many as the ring has slots (each miss polls host memory for its
    # completion).
    kernel((64,), (128,), (desc, idx, np.float32(2.0), out, np.uint64(n)))
    cp.cuda.Device().synchronize()
    seconds = time.perf_counter() - t
    arr.check()  # a failed access reads as zero: check after every kernel

    sign = cp.where(cp.arange(n) % 2 == 1, 1.0, -1.0).astype(cp.float32)
    want = 2.0 * sign * (idx % 65536).astype(cp.float32)
    bad = int(cp.count_nonzero(out != want))
    st = arr.stats()
    print(f"misses read {arr.miss_path}")
    print(
        f"{n} random reads of a {4 * args.mib} MiB file through a {args.mib} MiB cache in "
        f"{seconds * 1e3:.1f} ms ({n / seconds / 1e6:.2f} M reads/s): {bad} wrong; "
        f"hits {st['hits']}, misses {st['misses']}, waits {st['waits']}, read in place "
        f"{st['direct_reads']}, evictions {st['evictions']}, miss p50 {st['miss_p50_ns']} ns, "
        f"p99 {st['miss_p99_ns']} ns"
    )
    arr.close()

    # An eighth of the file fits half the cache: hold it there and read it with plain loads.
    part = cache.array(path, dtype=np.float32, length=elements // 8)
    gather = module.get_function("resident_gather")
    ridx = cp.random.randint(0, len(part), size=n, dtype=cp.int64).astype(cp.uint64)
    with part.resident() as view:
        rdesc = cp.asarray(np.frombuffer(view.descriptor, dtype=np.uint8))
        t = time.perf_counter()
        gather((256,), (256,), (rdesc, ridx, out, np.uint64(n)))
        cp.cuda.Device().synchronize()
        seconds = time.perf_counter() - t
    part.check()
    rbad = int(cp.count_nonzero(out != (ridx % 65536).astype(cp.float32)))
    print(
        f"{n} random reads of a resident {args.mib // 2} MiB array in {seconds * 1e3:.2f} ms "
        f"({n / seconds / 1e9:.2f} G reads/s): {rbad} wrong"
    )
    part.close()
    os.remove(path)
    if bad or rbad:
        raise SystemExit(f"{bad + rbad} elements read wrong")


if __name__ == "__main__":
    main()
