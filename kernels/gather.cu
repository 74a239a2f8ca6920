// Row gather and scatter between pinned host memory (or device memory) and device memory:
// the kernels behind gpuio's `gather` / `scatter` calls, and the naive baseline they are
// measured against. The tuned kernels are the gpuio.cuh functions, one entry point per piece
// width (the host picks the widest that divides the row size and both base addresses).
#ifndef GPUIO_CUH
#include "gpuio.cuh"
#endif

#define GPUIO_ROW_KERNELS(W)                                                                    \
    extern "C" __global__ void gpuio_gather_##W(const void* pool, gpuio_u64 rows,               \
                                                gpuio_u64 row_bytes, const gpuio_u64* idx,      \
                                                gpuio_u64 n, void* dst, gpuio_u64* err) {       \
        gpuio_gather_rows<W>(pool, rows, row_bytes, idx, n, dst, err);                          \
    }                                                                                           \
    extern "C" __global__ void gpuio_scatter_##W(const void* src, gpuio_u64 rows,               \
                                                 gpuio_u64 row_bytes, const gpuio_u64* idx,     \
                                                 gpuio_u64 n, void* pool, gpuio_u64* err) {     \
        gpuio_scatter_rows<W>(src, rows, row_bytes, idx, n, pool, err);                         \
    }

GPUIO_ROW_KERNELS(16)
GPUIO_ROW_KERNELS(8)
GPUIO_ROW_KERNELS(4)
GPUIO_ROW_KERNELS(1)

// The baseline: one warp per row, each lane copying 16-byte pieces (bytes where unaligned)
// of it, one row after another, one load in flight per lane.
extern "C" __global__ void gpuio_gather_naive(const unsigned char* pool, gpuio_u64 rows,
                                              gpuio_u64 row_bytes, const gpuio_u64* idx,
                                              gpuio_u64 n, unsigned char* dst, gpuio_u64* err) {
    const gpuio_u64 warp = ((gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const gpuio_u64 warps = (gpuio_u64)gridDim.x * blockDim.x / 32;
    const unsigned lane = threadIdx.x % 32;
    const bool wide = row_bytes % 16 == 0 && (gpuio_u64)pool % 16 == 0 && (gpuio_u64)dst % 16 == 0;
    for (gpuio_u64 r = warp; r < n; r += warps) {
        gpuio_u64 row = idx[r];
        if (row >= rows) {
            if (lane == 0) gpuio_bad_index(err, r);
            continue;
        }
        const unsigned char* s = pool + row * row_bytes;
        unsigned char* d = dst + r * row_bytes;
        if (wide) {
            for (gpuio_u64 b = lane * 16; b < row_bytes; b += 32 * 16)
                *(uint4*)(d + b) = *(const uint4*)(s + b);
        } else {
            for (gpuio_u64 b = lane; b < row_bytes; b += 32) d[b] = s[b];
        }
    }
}
