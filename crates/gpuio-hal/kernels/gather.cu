// Row gather and scatter between pinned host memory (or device memory) and device memory:
// the kernels behind gpuio's `gather` / `scatter` calls, and the naive baseline they are
// measured against. The tuned kernels are gpuio_rows.cuh's functions, one entry point per piece
// width (the host picks the widest that divides the row size and both base addresses).
// Sorted gathers first order their index list by pool address on the device (gpuio_order_*,
// a counting sort) so that loads issued together share address translations and read
// requests; the ordered kernels then take (pool row, position) pairs.
#ifndef GPUIO_ROWS_CUH
#include "gpuio_rows.cuh"
#endif

typedef unsigned int gpuio_u32;

// Loads in flight per thread in the ordered kernel's line mapping (measured on an H200: 8
// beats 4 by up to 24% for small rows from a 16 GiB pool and costs nothing elsewhere).
#define GPUIO_LINE_UNROLL 8

// A call's end, told to the host without the driver: the last block of the grid to finish
// stores the call's number in a word of mapped host memory, which the host watches. A stream
// synchronize sees the kernel's end 1-2 us later on an H200 (a small gather's wall is 0.6-1.6
// us shorter). `blocks` (device memory) counts the blocks done and is zero between calls: the
// last block sets it back. `word` 0: the launch tells nothing (one of several launches of a
// call, a call timed by events, or a grid of more than a block per multiprocessor, whose
// blocks would pay 0.2-0.9% of the call: probes/end_signal.py). As the host writes it:
// `EndSignal` in crates/gpuio-hal/src/gpu/cuda/report.rs, whose layout is asserted there too.
struct gpuio_end {
    gpuio_u64 blocks, word, seq;
};
static_assert(sizeof(gpuio_end) == 24, "gpuio_end size");
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(gpuio_end, word) == 8, "gpuio_end.word");
static_assert(__builtin_offsetof(gpuio_end, seq) == 16, "gpuio_end.seq");
#endif

// Every thread of the block calls it once its last store is issued. Thread 0 orders the
// block's stores (the barrier, then a fence: fences are cumulative) before its count, device-
// wide, and the last block orders every block's before the host word, system-wide. A grid of
// one block (a call of a few rows) skips the count.
__device__ __forceinline__ void gpuio_signal_end(const gpuio_end& end) {
    if (!end.word) return;
    __syncthreads();
    if (threadIdx.x != 0) return;
    const unsigned int grid = gridDim.x * gridDim.y * gridDim.z;
    if (grid > 1) {
        __threadfence();
        unsigned int* blocks = (unsigned int*)end.blocks;
        if (atomicAdd(blocks, 1u) != grid - 1) return;
        *blocks = 0;
    }
    __threadfence_system();
    *(volatile gpuio_u64*)end.word = end.seq;
}

// An ordered gather dealt out by pool line: 128/W lanes per 128-byte line and `lines` line
// slots per row (every line a row can touch), a lane whose piece lies outside its row idle.
// Each line a row touches is then read by one warp instruction, one read request. Dealt out
// in dense order instead, a warp's 32 pieces start mid-line and split lines between two
// instructions: about one request more per row (656-byte rows: 7 instead of 6), at the
// link's request limit. Pairs as gpuio_rows<W, false, true> takes them.
template <int W>
__device__ __forceinline__ void gpuio_rows_by_line(const unsigned char* __restrict__ pool,
                                                   unsigned char* __restrict__ dst,
                                                   const ulonglong2* __restrict__ pairs,
                                                   gpuio_u64 n, gpuio_u64 rows,
                                                   gpuio_u64 row_bytes, gpuio_u32 lines,
                                                   gpuio_u64* err) {
    const gpuio_u64 per_row = (gpuio_u64)lines * (128 / W);
    gpuio_move_pieces<W, GPUIO_LINE_UNROLL>(
        pool, dst, n * per_row, [&](gpuio_u64 k) { return pairs[k / per_row]; },
        [&](gpuio_u64 k, ulonglong2 ref, gpuio_u64& from, gpuio_u64& to) {
            const gpuio_u64 slot = k % per_row;
            if (ref.x >= rows) {
                if (slot == 0) gpuio_bad_index(err, ref.y);
                return false;
            }
            const gpuio_u64 start = (gpuio_u64)pool + ref.x * row_bytes;
            const gpuio_u64 at = (start & ~127ull) + slot * W;
            if (at < start || at >= start + row_bytes) return false;
            from = at - (gpuio_u64)pool;
            to = ref.y * row_bytes + (at - start);
            return true;
        });
}

#define GPUIO_ROW_KERNELS(W)                                                                    \
    extern "C" __global__ void gpuio_gather_##W(const void* pool, gpuio_u64 rows,               \
                                                gpuio_u64 row_bytes, const gpuio_u64* idx,      \
                                                gpuio_u64 n, void* dst, gpuio_u64* err,         \
                                                gpuio_end end) {                                \
        gpuio_gather_rows<W>(pool, rows, row_bytes, idx, n, dst, err);                          \
        gpuio_signal_end(end);                                                                  \
    }                                                                                           \
    extern "C" __global__ void gpuio_scatter_##W(const void* src, gpuio_u64 rows,               \
                                                 gpuio_u64 row_bytes, const gpuio_u64* idx,     \
                                                 gpuio_u64 n, void* pool, gpuio_u64* err,       \
                                                 gpuio_end end) {                               \
        gpuio_scatter_rows<W>(src, rows, row_bytes, idx, n, pool, err);                         \
        gpuio_signal_end(end);                                                                  \
    }                                                                                           \
    extern "C" __global__ void gpuio_gather_ordered_##W(                                        \
        const void* pool, gpuio_u64 rows, gpuio_u64 row_bytes, const gpuio_u64* pairs,          \
        gpuio_u64 n, void* dst, gpuio_u64* err, gpuio_end end, gpuio_u32 lines) {               \
        if (lines)                                                                              \
            gpuio_rows_by_line<W>((const unsigned char*)pool, (unsigned char*)dst,              \
                                  (const ulonglong2*)pairs, n, rows, row_bytes, lines, err);    \
        else                                                                                    \
            gpuio_rows<W, false, true>((const unsigned char*)pool, (unsigned char*)dst, pairs,  \
                                       n, rows, row_bytes, err);                                \
        gpuio_signal_end(end);                                                                  \
    }

GPUIO_ROW_KERNELS(16)
GPUIO_ROW_KERNELS(8)
GPUIO_ROW_KERNELS(4)
GPUIO_ROW_KERNELS(1)

// ---- Tiered gathers: rows from a hot tier in device memory and a warm tier in mapped host
// memory, for several jobs (one per grid row `blockIdx.y`) in one launch. Each output row has a
// code: bit 63 clear, a hot row; set, a warm row in bits 0..39 that is also written to the hot
// row in bits 40..62 (all ones: none), so a miss is read once and installed on the way.
#define GPUIO_TIER_WARM (1ull << 63)
#define GPUIO_TIER_ROW_BITS 40
#define GPUIO_TIER_NO_SLOT 0x7fffffull

// One job of a tiered gather (64 bytes, as the host writes it: `TierJob` in
// crates/gpuio-hal/src/ai/tiered.rs, whose layout is asserted there too).
struct gpuio_tier_job {
    gpuio_u64 hot, hot_rows, warm, warm_rows, dst, first, count, unused;
};
static_assert(sizeof(gpuio_tier_job) == 64, "gpuio_tier_job size");
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(gpuio_tier_job, hot) == 0, "tier_job.hot");
static_assert(__builtin_offsetof(gpuio_tier_job, hot_rows) == 8, "tier_job.hot_rows");
static_assert(__builtin_offsetof(gpuio_tier_job, warm) == 16, "tier_job.warm");
static_assert(__builtin_offsetof(gpuio_tier_job, warm_rows) == 24, "tier_job.warm_rows");
static_assert(__builtin_offsetof(gpuio_tier_job, dst) == 32, "tier_job.dst");
static_assert(__builtin_offsetof(gpuio_tier_job, first) == 40, "tier_job.first");
static_assert(__builtin_offsetof(gpuio_tier_job, count) == 48, "tier_job.count");
static_assert(__builtin_offsetof(gpuio_tier_job, unused) == 56, "tier_job.unused");
#endif

template <int W>
__device__ __forceinline__ void gpuio_tiered_rows(const gpuio_tier_job* __restrict__ jobs,
                                                  const gpuio_u64* __restrict__ codes,
                                                  gpuio_u64 row_bytes, gpuio_u64* err) {
    typedef typename gpuio_piece<W>::t P;
    const gpuio_tier_job job = jobs[blockIdx.y];
    const gpuio_u64 per_row = row_bytes / W, items = job.count * per_row;
    const gpuio_u64 stride = (gpuio_u64)gridDim.x * blockDim.x;
    for (gpuio_u64 i = (gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x; i < items;
         i += stride * GPUIO_UNROLL) {
        P v[GPUIO_UNROLL];
        gpuio_u64 to[GPUIO_UNROLL], also[GPUIO_UNROLL];
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            const gpuio_u64 k = i + u * stride;
            to[u] = 0;
            also[u] = 0;
            if (k >= items) continue;
            const gpuio_u64 r = k / per_row, piece = (k % per_row) * W;
            const gpuio_u64 code = codes[job.first + r];
            gpuio_u64 from;
            if (code & GPUIO_TIER_WARM) {
                const gpuio_u64 row = code & ((1ull << GPUIO_TIER_ROW_BITS) - 1);
                const gpuio_u64 slot = (code >> GPUIO_TIER_ROW_BITS) & GPUIO_TIER_NO_SLOT;
                if (row >= job.warm_rows ||
                    (slot != GPUIO_TIER_NO_SLOT && slot >= job.hot_rows)) {
                    gpuio_bad_index(err, job.first + r);
                    continue;
                }
                from = job.warm + row * row_bytes + piece;
                if (slot != GPUIO_TIER_NO_SLOT) also[u] = job.hot + slot * row_bytes + piece;
            } else {
                if (code >= job.hot_rows) {
                    gpuio_bad_index(err, job.first + r);
                    continue;
                }
                from = job.hot + code * row_bytes + piece;
            }
            to[u] = job.dst + r * row_bytes + piece;
            v[u] = *reinterpret_cast<const P*>(from);
        }
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            if (to[u]) *reinterpret_cast<P*>(to[u]) = v[u];
            if (also[u]) *reinterpret_cast<P*>(also[u]) = v[u];
        }
    }
}

#define GPUIO_TIERED_KERNEL(W)                                                                  \
    extern "C" __global__ void gpuio_gather_tiered_##W(const void* jobs, const gpuio_u64* codes, \
                                                       gpuio_u64 row_bytes, gpuio_u64* err) {   \
        gpuio_tiered_rows<W>((const gpuio_tier_job*)jobs, codes, row_bytes, err);               \
    }

GPUIO_TIERED_KERNEL(16)
GPUIO_TIERED_KERNEL(8)
GPUIO_TIERED_KERNEL(4)
GPUIO_TIERED_KERNEL(1)

// ---- Gathers through hot rows: copies of chosen pool rows kept in device memory, found by
// pool row in an open-addressed index of 8-byte words (pool row in bits 0..39, hot row in bits
// 40..63; all ones: empty), probed from the row's hash at most `probes` words on (the longest
// run the index's builder made). A row found there is read from device memory, any other from
// the pool over the bus (every row, where there is no index: 0). A word naming a hot row past
// `hot_rows` is not followed: the pool row is read instead (the copy is only ever a copy).
#define GPUIO_HOT_EMPTY (~0ull)
#define GPUIO_HOT_ROW_BITS 40

// The hash both the builder (hot_rows.rs `hot_hash`) and the probe use: a 64-bit finalizer.
__device__ __forceinline__ gpuio_u64 gpuio_hot_hash(gpuio_u64 row) {
    row ^= row >> 33;
    row *= 0xff51afd7ed558ccdull;
    row ^= row >> 33;
    row *= 0xc4ceb9fe1a85ec53ull;
    return row ^ (row >> 33);
}

template <int W>
__device__ __forceinline__ void gpuio_hot_rows(const unsigned char* __restrict__ pool,
                                               gpuio_u64 rows, gpuio_u64 row_bytes,
                                               const gpuio_u64* __restrict__ idx, gpuio_u64 n,
                                               unsigned char* __restrict__ dst, gpuio_u64* err,
                                               const unsigned char* __restrict__ hot,
                                               gpuio_u64 hot_rows,
                                               const gpuio_u64* __restrict__ index,
                                               gpuio_u64 mask, gpuio_u32 probes) {
    typedef typename gpuio_piece<W>::t P;
    const gpuio_u64 per_row = row_bytes / W, items = n * per_row;
    const gpuio_u64 stride = (gpuio_u64)gridDim.x * blockDim.x;
    const gpuio_u64 row_mask = (1ull << GPUIO_HOT_ROW_BITS) - 1;
    for (gpuio_u64 i = (gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x; i < items;
         i += stride * GPUIO_UNROLL) {
        // In rounds, each over every unrolled piece, so that their loads are in flight
        // together: the rows asked for, then each one's first index word (most lookups end
        // there), then the rare longer runs, then the rows themselves.
        gpuio_u64 row[GPUIO_UNROLL], word[GPUIO_UNROLL], at[GPUIO_UNROLL];
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            const gpuio_u64 k = i + u * stride;
            row[u] = k < items ? idx[k / per_row] : rows;
        }
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            at[u] = gpuio_hot_hash(row[u]) & mask;
            word[u] = row[u] < rows && index ? index[at[u]] : GPUIO_HOT_EMPTY;
        }
        P v[GPUIO_UNROLL];
        gpuio_u64 to[GPUIO_UNROLL];
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            const gpuio_u64 k = i + u * stride;
            to[u] = 0;
            if (k >= items) continue;
            const gpuio_u64 r = k / per_row, piece = (k % per_row) * W;
            if (row[u] >= rows) {
                if (piece == 0) gpuio_bad_index(err, r);
                continue;
            }
            for (gpuio_u32 p = 1; p < probes && word[u] != GPUIO_HOT_EMPTY &&
                                  (word[u] & row_mask) != row[u];
                 p++) {
                at[u] = (at[u] + 1) & mask;
                word[u] = index[at[u]];
            }
            const gpuio_u64 slot = word[u] >> GPUIO_HOT_ROW_BITS;
            const bool kept = word[u] != GPUIO_HOT_EMPTY && (word[u] & row_mask) == row[u] &&
                              slot < hot_rows;
            const unsigned char* from =
                kept ? hot + slot * row_bytes + piece : pool + row[u] * row_bytes + piece;
            to[u] = (gpuio_u64)(dst + r * row_bytes + piece);
            v[u] = *reinterpret_cast<const P*>(from);
        }
#pragma unroll
        for (int u = 0; u < GPUIO_UNROLL; u++) {
            if (to[u]) *reinterpret_cast<P*>(to[u]) = v[u];
        }
    }
}

#define GPUIO_HOT_KERNEL(W)                                                                     \
    extern "C" __global__ void gpuio_gather_hot_##W(                                            \
        const void* pool, gpuio_u64 rows, gpuio_u64 row_bytes, const gpuio_u64* idx,            \
        gpuio_u64 n, void* dst, gpuio_u64* err, gpuio_end end, const void* hot,                 \
        gpuio_u64 hot_rows, const gpuio_u64* index, gpuio_u64 mask, gpuio_u32 probes) {         \
        gpuio_hot_rows<W>((const unsigned char*)pool, rows, row_bytes, idx, n,                  \
                          (unsigned char*)dst, err, (const unsigned char*)hot, hot_rows, index, \
                          mask, probes);                                                        \
        gpuio_signal_end(end);                                                                  \
    }

GPUIO_HOT_KERNEL(16)
GPUIO_HOT_KERNEL(8)
GPUIO_HOT_KERNEL(4)
GPUIO_HOT_KERNEL(1)

// ---- Gathers through hot rows of several pools in one launch (one job per grid row
// `blockIdx.y`): a model that reads two Engram tables per step pays one launch and one wait,
// not two. The jobs travel as the kernel's argument (no copy before the launch). Job k reports
// its first bad index (a position in its own list) in its own report word.
#define GPUIO_HOT_JOBS 8  // HOT_MAX_JOBS in crates/gpuio-hal/src/gpu/hot_jobs.rs

// One job (96 bytes, as the host writes it: `HotJobWords` in
// crates/gpuio-hal/src/gpu/cuda/hot_jobs.rs, whose layout is asserted there too).
struct gpuio_hot_job {
    gpuio_u64 pool, rows, idx, n, dst, err, hot, hot_rows, index, mask, probes, unused;
};
struct gpuio_hot_jobs {
    gpuio_hot_job job[GPUIO_HOT_JOBS];
};
static_assert(sizeof(gpuio_hot_job) == 96, "gpuio_hot_job size");
static_assert(sizeof(gpuio_hot_jobs) == 96 * GPUIO_HOT_JOBS, "gpuio_hot_jobs size");
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(gpuio_hot_job, pool) == 0, "hot_job.pool");
static_assert(__builtin_offsetof(gpuio_hot_job, idx) == 16, "hot_job.idx");
static_assert(__builtin_offsetof(gpuio_hot_job, dst) == 32, "hot_job.dst");
static_assert(__builtin_offsetof(gpuio_hot_job, hot) == 48, "hot_job.hot");
static_assert(__builtin_offsetof(gpuio_hot_job, index) == 64, "hot_job.index");
static_assert(__builtin_offsetof(gpuio_hot_job, probes) == 80, "hot_job.probes");
#endif

#define GPUIO_HOT_JOBS_KERNEL(W)                                                                \
    extern "C" __global__ void gpuio_gather_hot_jobs_##W(gpuio_hot_jobs jobs,                   \
                                                         gpuio_u64 row_bytes, gpuio_end end) {  \
        const gpuio_hot_job j = jobs.job[blockIdx.y];                                           \
        gpuio_hot_rows<W>((const unsigned char*)j.pool, j.rows, row_bytes,                      \
                          (const gpuio_u64*)j.idx, j.n, (unsigned char*)j.dst,                  \
                          (gpuio_u64*)j.err, (const unsigned char*)j.hot, j.hot_rows,           \
                          (const gpuio_u64*)j.index, j.mask, (gpuio_u32)j.probes);              \
        gpuio_signal_end(end);                                                                  \
    }

GPUIO_HOT_JOBS_KERNEL(16)
GPUIO_HOT_JOBS_KERNEL(8)
GPUIO_HOT_JOBS_KERNEL(4)
GPUIO_HOT_JOBS_KERNEL(1)

// The baseline: one warp per row, each lane copying 16-byte pieces (bytes where unaligned)
// of it, one row after another, one load in flight per lane.
extern "C" __global__ void gpuio_gather_naive(const unsigned char* pool, gpuio_u64 rows,
                                              gpuio_u64 row_bytes, const gpuio_u64* idx,
                                              gpuio_u64 n, unsigned char* dst, gpuio_u64* err,
                                              gpuio_end end) {
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
    gpuio_signal_end(end);
}

// ---- Ordering an index list by pool address: a counting sort over buckets of 2^shift pool
// bytes. count: each index's bucket gets one more (its rank in the bucket is the old count);
// scan_blocks + scan_sums: exclusive prefix sums of the counts (4096 per block, then the
// blocks' totals); place: each index's pair (row, position) goes to its bucket's start plus
// its rank. Out-of-range indices sort into the last bucket; the gather reports them.

#define GPUIO_SCAN_PER_BLOCK 4096

__device__ __forceinline__ gpuio_u32 gpuio_bucket(gpuio_u64 row, gpuio_u64 rows,
                                                  gpuio_u64 row_bytes, gpuio_u32 shift,
                                                  gpuio_u32 buckets) {
    gpuio_u64 b = row < rows ? (row * row_bytes) >> shift : buckets - 1;
    return b < buckets ? (gpuio_u32)b : buckets - 1;
}

extern "C" __global__ void gpuio_order_count(const gpuio_u64* idx, gpuio_u64 n, gpuio_u64 rows,
                                             gpuio_u64 row_bytes, gpuio_u32 shift,
                                             gpuio_u32 buckets, gpuio_u32* counts,
                                             gpuio_u32* rank) {
    const gpuio_u64 stride = (gpuio_u64)gridDim.x * blockDim.x;
    for (gpuio_u64 i = (gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        rank[i] = atomicAdd(&counts[gpuio_bucket(idx[i], rows, row_bytes, shift, buckets)], 1u);
}

// Exclusive scan of one value per thread across the block (blockDim.x a multiple of 32, at
// most 1024); *total gets the block's sum.
__device__ __forceinline__ gpuio_u32 gpuio_block_scan(gpuio_u32 v, gpuio_u32* total) {
    __shared__ gpuio_u32 warp_sums[32];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    gpuio_u32 x = v;
    for (int d = 1; d < 32; d <<= 1) {
        gpuio_u32 y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        gpuio_u32 s = lane < blockDim.x / 32 ? warp_sums[lane] : 0, z = s;
        for (int d = 1; d < 32; d <<= 1) {
            gpuio_u32 y = __shfl_up_sync(0xffffffffu, z, d);
            if (lane >= d) z += y;
        }
        warp_sums[lane] = z - s;
        if (lane == 31) *total = z;
    }
    __syncthreads();
    gpuio_u32 before = warp_sums[warp] + x - v;
    __syncthreads();
    return before;
}

// 1024 threads per block, 4 counts each.
extern "C" __global__ void gpuio_order_scan_blocks(gpuio_u32* counts, gpuio_u32 buckets,
                                                   gpuio_u32* sums) {
    __shared__ gpuio_u32 total;
    const gpuio_u64 base = (gpuio_u64)blockIdx.x * GPUIO_SCAN_PER_BLOCK + threadIdx.x * 4;
    gpuio_u32 v[4], t = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[k] = base + k < buckets ? counts[base + k] : 0;
        t += v[k];
    }
    gpuio_u32 at = gpuio_block_scan(t, &total);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (base + k < buckets) counts[base + k] = at;
        at += v[k];
    }
    if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

// One block: the exclusive scan of the `m` block totals, in place.
extern "C" __global__ void gpuio_order_scan_sums(gpuio_u32* sums, gpuio_u32 m) {
    __shared__ gpuio_u32 total;
    gpuio_u32 carry = 0;
    for (gpuio_u32 at = 0; at < m; at += blockDim.x) {
        const gpuio_u32 k = at + threadIdx.x;
        const gpuio_u32 v = k < m ? sums[k] : 0;
        const gpuio_u32 before = gpuio_block_scan(v, &total);
        if (k < m) sums[k] = carry + before;
        carry += total;
        __syncthreads();
    }
}

extern "C" __global__ void gpuio_order_place(const gpuio_u64* idx, gpuio_u64 n, gpuio_u64 rows,
                                             gpuio_u64 row_bytes, gpuio_u32 shift,
                                             gpuio_u32 buckets, const gpuio_u32* starts,
                                             const gpuio_u32* sums, const gpuio_u32* rank,
                                             ulonglong2* pairs) {
    const gpuio_u64 stride = (gpuio_u64)gridDim.x * blockDim.x;
    for (gpuio_u64 i = (gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const gpuio_u64 row = idx[i];
        const gpuio_u32 b = gpuio_bucket(row, rows, row_bytes, shift, buckets);
        pairs[starts[b] + sums[b / GPUIO_SCAN_PER_BLOCK] + rank[i]] = make_ulonglong2(row, i);
    }
}
