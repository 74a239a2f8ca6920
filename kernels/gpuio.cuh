// gpuio device header: what user kernels include to start IO themselves.
//
// - Zero-copy row access: gpuio_gather_rows / gpuio_scatter_rows move rows (opaque bytes) between
//   pinned or registered host memory (reached through its mapped device address, see
//   HostBuffer::pinned().device_addr()) and device memory, one thread per `W`-byte piece with
//   several loads in flight per thread, which is what hides PCIe latency for small rows.
// - The GPU->host request ring: gpuio_read_async / gpuio_write_async / gpuio_poll / gpuio_wait /
//   gpuio_read, in gpuio_ring.cuh (included below).
//
// Compiled by NVRTC at run time (no include paths, no standard headers): gpuio embeds this text
// before the sources that use it, so every `#include "gpuio.cuh"` sits inside #ifndef GPUIO_CUH.
#ifndef GPUIO_CUH
#define GPUIO_CUH

#ifndef GPUIO_RING_CUH
#include "gpuio_ring.cuh"
#endif

typedef unsigned long long gpuio_u64;

// Loads in flight per thread in the row kernels.
#define GPUIO_UNROLL 4

// Piece types by width.
template <int W> struct gpuio_piece;
template <> struct gpuio_piece<16> { typedef uint4 t; };
template <> struct gpuio_piece<8> { typedef unsigned long long t; };
template <> struct gpuio_piece<4> { typedef unsigned int t; };
template <> struct gpuio_piece<1> { typedef unsigned char t; };

// Records the first out-of-range index position (atomicMin) so the host can fail the call.
__device__ __forceinline__ void gpuio_bad_index(gpuio_u64* err, gpuio_u64 pos) {
    if (err) atomicMin(err, pos);
}

// Row k of a job: the pool row it names and its position in the dense buffer. A plain index
// list gives (idx[k], k); an ordered list (see gather.cu's gpuio_order_* kernels) holds the
// pairs themselves, sorted by pool address.
template <bool ORDERED>
__device__ __forceinline__ ulonglong2 gpuio_row_ref(const gpuio_u64* __restrict__ idx,
                                                    gpuio_u64 k) {
    if (ORDERED) return reinterpret_cast<const ulonglong2*>(idx)[k];
    return make_ulonglong2(idx[k], k);
}

// Copies rows: dst row i <- src row idx[i] (gather), or dst row idx[i] <- src row i (scatter),
// in W-byte pieces. Every thread of the grid takes pieces tid, tid+stride, ...; GPUIO_UNROLL of
// them are loaded before any is stored so that many PCIe reads are outstanding per thread.
// The indices of the next round are loaded while this round's pieces are in flight: with the
// index list in host memory, an index and the piece it names are two dependent PCIe round
// trips, and this overlaps them instead of paying both in turn.
// Rows whose index is >= rows are skipped and reported through `err` (by dense position).
template <int W, bool SCATTER, bool ORDERED = false>
__device__ __forceinline__ void gpuio_rows(const unsigned char* __restrict__ src,
                                           unsigned char* __restrict__ dst,
                                           const gpuio_u64* __restrict__ idx, gpuio_u64 n,
                                           gpuio_u64 rows, gpuio_u64 row_bytes, gpuio_u64* err) {
    typedef typename gpuio_piece<W>::t P;
    const gpuio_u64 per_row = row_bytes / W;
    const gpuio_u64 items = n * per_row;
    const gpuio_u64 stride = (gpuio_u64)gridDim.x * blockDim.x;
    gpuio_u64 i = (gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x;
    ulonglong2 next[GPUIO_UNROLL];
#pragma unroll
    for (int u = 0; u < GPUIO_UNROLL; u++) {
        gpuio_u64 k = i + u * stride;
        next[u] = k < items ? gpuio_row_ref<ORDERED>(idx, k / per_row) : make_ulonglong2(0, 0);
    }
    for (; i < items; i += stride * GPUIO_UNROLL) {
        P v[GPUIO_UNROLL];
        gpuio_u64 to[GPUIO_UNROLL];
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            gpuio_u64 k = i + u * stride;
            to[u] = ~0ull;
            if (k < items) {
                gpuio_u64 piece = k % per_row;
                gpuio_u64 row = next[u].x, r = next[u].y;
                if (row >= rows) {
                    gpuio_bad_index(err, r);
                    continue;
                }
                gpuio_u64 from = (SCATTER ? r : row) * per_row + piece;
                to[u] = (SCATTER ? row : r) * per_row + piece;
                v[u] = reinterpret_cast<const P*>(src)[from];
            }
        }
        const gpuio_u64 ahead = i + stride * GPUIO_UNROLL;
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            gpuio_u64 k = ahead + u * stride;
            if (k < items) next[u] = gpuio_row_ref<ORDERED>(idx, k / per_row);
        }
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            if (to[u] != ~0ull) reinterpret_cast<P*>(dst)[to[u]] = v[u];
        }
    }
}

// Gathers n rows of `row_bytes` from `pool` (rows rows) into `dst` by index. `pool` may be
// mapped host memory or device memory; W must divide row_bytes and both base addresses.
template <int W>
__device__ __forceinline__ void gpuio_gather_rows(const void* pool, gpuio_u64 rows,
                                                  gpuio_u64 row_bytes, const gpuio_u64* idx,
                                                  gpuio_u64 n, void* dst, gpuio_u64* err) {
    gpuio_rows<W, false>((const unsigned char*)pool, (unsigned char*)dst, idx, n, rows, row_bytes,
                         err);
}

// Scatters n rows of `src` into `pool` rows by index (the inverse of the gather). Duplicate
// indices leave one of their rows, unspecified which.
template <int W>
__device__ __forceinline__ void gpuio_scatter_rows(const void* src, gpuio_u64 rows,
                                                   gpuio_u64 row_bytes, const gpuio_u64* idx,
                                                   gpuio_u64 n, void* pool, gpuio_u64* err) {
    gpuio_rows<W, true>((const unsigned char*)src, (unsigned char*)pool, idx, n, rows, row_bytes,
                        err);
}

#endif  // GPUIO_CUH
