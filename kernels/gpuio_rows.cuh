// gpuio device header, zero-copy row access: gpuio_gather_rows / gpuio_scatter_rows move rows
// (opaque bytes) between pinned or registered host memory (reached through its mapped device
// address, see HostBuffer::pinned().device_addr()) and device memory, one thread per `W`-byte
// piece with several loads in flight per thread, which is what hides PCIe latency for small
// rows. gpuio's own row kernels (gather.cu) are built on gpuio_move_pieces.
//
// Built without include paths or standard headers: every `#include "gpuio_rows.cuh"` sits
// inside #ifndef GPUIO_ROWS_CUH (see gpuio.cuh).
#ifndef GPUIO_ROWS_CUH
#define GPUIO_ROWS_CUH

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

// The loop every row kernel shares. Every thread of the grid takes items tid, tid+stride, ...;
// U of them are loaded before any is stored, so that many PCIe reads are outstanding per
// thread, and the next round's row references are loaded while this round's pieces are in
// flight: with the index list in host memory, an index and the piece it names are two
// dependent PCIe round trips, and this overlaps them instead of paying both in turn.
// `ref(k)` loads item k's row reference (pool row, dense position); `place(k, ref, from, to)`
// sets the byte offsets its W-byte piece moves between (src + from -> dst + to), or returns
// false where it has none (a lane past its row, an out-of-range index it has reported).
template <int W, int U, class Ref, class Place>
__device__ __forceinline__ void gpuio_move_pieces(const unsigned char* __restrict__ src,
                                                  unsigned char* __restrict__ dst,
                                                  gpuio_u64 items, Ref ref, Place place) {
    typedef typename gpuio_piece<W>::t P;
    const gpuio_u64 stride = (gpuio_u64)gridDim.x * blockDim.x;
    gpuio_u64 i = (gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x;
    ulonglong2 next[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        gpuio_u64 k = i + u * stride;
        next[u] = k < items ? ref(k) : make_ulonglong2(0, 0);
    }
    for (; i < items; i += stride * U) {
        P v[U];
        gpuio_u64 to[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            gpuio_u64 k = i + u * stride, from = 0, at = 0;
            const bool moves = k < items && place(k, next[u], from, at);
            to[u] = moves ? at : ~0ull;
            if (moves) v[u] = *reinterpret_cast<const P*>(src + from);
        }
        const gpuio_u64 ahead = i + stride * U;
#pragma unroll
        for (int u = 0; u < U; u++) {
            gpuio_u64 k = ahead + u * stride;
            if (k < items) next[u] = ref(k);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (to[u] != ~0ull) *reinterpret_cast<P*>(dst + to[u]) = v[u];
        }
    }
}

// Copies rows: dst row i <- src row idx[i] (gather), or dst row idx[i] <- src row i (scatter),
// in W-byte pieces dealt out in dense order, GPUIO_UNROLL loads in flight per thread.
// Rows whose index is >= rows are skipped and reported through `err` (by dense position).
template <int W, bool SCATTER, bool ORDERED = false>
__device__ __forceinline__ void gpuio_rows(const unsigned char* __restrict__ src,
                                           unsigned char* __restrict__ dst,
                                           const gpuio_u64* __restrict__ idx, gpuio_u64 n,
                                           gpuio_u64 rows, gpuio_u64 row_bytes, gpuio_u64* err) {
    const gpuio_u64 per_row = row_bytes / W;
    gpuio_move_pieces<W, GPUIO_UNROLL>(
        src, dst, n * per_row,
        [&](gpuio_u64 k) { return gpuio_row_ref<ORDERED>(idx, k / per_row); },
        [&](gpuio_u64 k, ulonglong2 ref, gpuio_u64& from, gpuio_u64& to) {
            if (ref.x >= rows) {
                gpuio_bad_index(err, ref.y);
                return false;
            }
            const gpuio_u64 piece = (k % per_row) * W;
            from = (SCATTER ? ref.y : ref.x) * row_bytes + piece;
            to = (SCATTER ? ref.x : ref.y) * row_bytes + piece;
            return true;
        });
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

#endif  // GPUIO_ROWS_CUH
