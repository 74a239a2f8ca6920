// The AI tier's kernels: KV quantization (FP16, FP8 E4M3 and INT8 with a scale per block,
// 4-bit integers with a scale per group) and its inverse, bit for bit what gpuio-ai's CPU
// reference (compress/quant.rs) computes; and brute-force similarity scores (a dot product of a
// query with every row of a table, in device memory or in pinned host memory read over the
// bus, rows of f32 or of FP8 E4M3 values).
//
// Built without standard headers: FP16 conversions are PTX `cvt`, FP8 ones are written out
// here (round to nearest, ties to even, as the reference's conversion does).

typedef unsigned long long gpuio_u64;
typedef unsigned int gpuio_u32;

#define GPUIO_Q_F16 0
#define GPUIO_Q_FP8 1
#define GPUIO_Q_INT8 2
#define GPUIO_Q_INT4 3

// The largest level each scaled format maps a block's largest magnitude to.
__device__ __forceinline__ float gpuio_q_top(int format) {
    return format == GPUIO_Q_FP8 ? 448.0f : format == GPUIO_Q_INT8 ? 127.0f : 7.0f;
}

__device__ __forceinline__ void gpuio_q_bad(gpuio_u64* err, gpuio_u64 i) { atomicMin(err, i); }

__device__ __forceinline__ bool gpuio_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// f32 -> E4M3 (bias 7, 3 mantissa bits, no infinities), |v| <= 448, ties to even.
__device__ __forceinline__ unsigned char gpuio_to_e4m3(float v) {
    const gpuio_u32 bits = __float_as_uint(v);
    const unsigned char sign = (unsigned char)((bits >> 31) << 7);
    const float a = fabsf(v);
    if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 steps make the first normal)
        return sign | (unsigned char)rintf(a * 512.0f);
    }
    int e = (int)((bits >> 23) & 0xff) - 127;
    gpuio_u32 keep = (bits & 0x7fffff) >> 20, rest = bits & 0xfffff;
    if (rest > 0x80000u || (rest == 0x80000u && (keep & 1))) keep++;
    if (keep == 8) {
        keep = 0;
        e++;
    }
    return sign | (unsigned char)(((e + 7) << 3) | keep);
}

__device__ __forceinline__ float gpuio_from_e4m3(unsigned char b) {
    const int e = (b >> 3) & 0xf, m = b & 7;
    float a;
    if ((b & 0x7f) == 0x7f) {
        a = __uint_as_float(0x7fc00000u);
    } else if (e == 0) {
        a = (float)m * 0.001953125f;  // m * 2^-9
    } else {
        a = __uint_as_float((gpuio_u32)(e - 7 + 127) << 23 | (gpuio_u32)m << 20);
    }
    return (b & 0x80) ? -a : a;
}

__device__ __forceinline__ unsigned short gpuio_to_f16(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

__device__ __forceinline__ float gpuio_from_f16(unsigned short h) {
    float v;
    asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(h));
    return v;
}

// Pass 1 of a scaled quantization: one warp per block of `block` values (at most n: the host
// clamps it), its scale (the block's largest magnitude over the format's top level; 1 where
// that is 0). A value that is not finite is reported by its index.
extern "C" __global__ void gpuio_quant_scales(const float* x, gpuio_u64 n, gpuio_u64 block,
                                              int format, float* scales, gpuio_u64* err) {
    const gpuio_u64 warp = ((gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const gpuio_u64 warps = (gpuio_u64)gridDim.x * blockDim.x / 32;
    const unsigned lane = threadIdx.x % 32;
    const gpuio_u64 blocks = (n + block - 1) / block;
    for (gpuio_u64 b = warp; b < blocks; b += warps) {
        const gpuio_u64 start = b * block, end = start + block < n ? start + block : n;
        float m = 0.0f;
        for (gpuio_u64 i = start + lane; i < end; i += 32) {
            const float v = x[i];
            if (!gpuio_finite(v)) gpuio_q_bad(err, i);
            m = fmaxf(m, fabsf(v));
        }
        for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
        // 1 where the scale is 0: an all-zero block, or one whose scale underflows.
        const float scale = m / gpuio_q_top(format);
        if (lane == 0) scales[b] = scale == 0.0f ? 1.0f : scale;
    }
}

// A scaled value's integer level: v / scale rounded half away from zero, clamped to +-top.
__device__ __forceinline__ int gpuio_q_level(float v, float scale, float top) {
    return (int)fminf(fmaxf(roundf(v / scale), -top), top);
}

// Pass 2: the packed data, one thread per output byte (two values per byte for INT4, so that
// no two threads share a byte), FP16 one little-endian half per value (the data 2-aligned). FP16 reports values beyond its range
// and values that are not finite.
extern "C" __global__ void gpuio_quant_data(const float* x, gpuio_u64 n, gpuio_u64 block,
                                            int format, const float* scales,
                                            unsigned char* data, gpuio_u64* err) {
    const gpuio_u64 stride = (gpuio_u64)gridDim.x * blockDim.x;
    const gpuio_u64 items = format == GPUIO_Q_INT4 ? (n + 1) / 2 : n;
    for (gpuio_u64 k = (gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x; k < items; k += stride) {
        if (format == GPUIO_Q_F16) {
            const float v = x[k];
            if (!gpuio_finite(v) || fabsf(v) > 65504.0f) gpuio_q_bad(err, k);
            reinterpret_cast<unsigned short*>(data)[k] = gpuio_to_f16(v);
        } else if (format == GPUIO_Q_FP8) {
            const float y = fminf(fmaxf(x[k] / scales[k / block], -448.0f), 448.0f);
            data[k] = gpuio_to_e4m3(y);
        } else if (format == GPUIO_Q_INT8) {
            data[k] = (unsigned char)(signed char)gpuio_q_level(x[k], scales[k / block], 127.0f);
        } else {
            unsigned char byte = 0;
            for (int h = 0; h < 2; h++) {
                const gpuio_u64 i = 2 * k + h;
                if (i >= n) break;
                const int l = gpuio_q_level(x[i], scales[i / block], 7.0f);
                byte |= (unsigned char)((l & 0xf) << (4 * h));
            }
            data[k] = byte;
        }
    }
}

// The values back: one thread per value, the decoded level times its block's scale.
extern "C" __global__ void gpuio_dequant(const unsigned char* data, const float* scales,
                                         gpuio_u64 n, gpuio_u64 block, int format, float* out) {
    const gpuio_u64 stride = (gpuio_u64)gridDim.x * blockDim.x;
    for (gpuio_u64 i = (gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v;
        if (format == GPUIO_Q_F16) {
            v = gpuio_from_f16(reinterpret_cast<const unsigned short*>(data)[i]);
        } else {
            const float scale = scales[i / block];
            if (format == GPUIO_Q_FP8) {
                v = gpuio_from_e4m3(data[i]) * scale;
            } else if (format == GPUIO_Q_INT8) {
                v = (float)(signed char)data[i] * scale;
            } else {
                const int nibble = (data[i / 2] >> (4 * (i % 2))) & 0xf;
                v = (float)((nibble ^ 8) - 8) * scale;
            }
        }
        out[i] = v;
    }
}

// Similarity scores: scores[r] = dot(query, row r) for the `rows` rows of `dim` values at
// `table` (device memory, or pinned host memory through its mapped address), each value an
// f32 (fp8 == 0) or an E4M3 byte (fp8 == 1). One warp per row, the lanes striding over it.
extern "C" __global__ void gpuio_dot_scores(const void* table, gpuio_u64 rows, gpuio_u64 dim,
                                            int fp8, const float* query, float* scores) {
    const gpuio_u64 warp = ((gpuio_u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const gpuio_u64 warps = (gpuio_u64)gridDim.x * blockDim.x / 32;
    const unsigned lane = threadIdx.x % 32;
    for (gpuio_u64 r = warp; r < rows; r += warps) {
        float s = 0.0f;
        if (fp8) {
            const unsigned char* row = (const unsigned char*)table + r * dim;
            for (gpuio_u64 d = lane; d < dim; d += 32) s += gpuio_from_e4m3(row[d]) * query[d];
        } else {
            const float* row = (const float*)table + r * dim;
            for (gpuio_u64 d = lane; d < dim; d += 32) s += row[d] * query[d];
        }
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) scores[r] = s;
    }
}

// ---- Swap-in: HiSparse's hot buffer, refilled by the device (swap_in.rs in the HAL) ----------
//
// A job is one request's layer: a top-k selection of positions (u32s in device memory), a
// hot buffer of `slots` device rows, a state in device memory (a step counter, a bad-state
// flag, each position's slot, each slot's position, each slot's last step) and the layer's
// entries in pinned host memory (position p at warm row warm_first + p). A load is two
// kernels, because only the first is on the critical path:
//
// - The fetch (many blocks per job) looks up each selected position's slot and copies its
//   row into the output: from the slot on a hit, from pinned host memory on a miss (and then
//   also into the job's staging rows). A hit is marked in the position's slot word (SEL), a
//   miss with PENDING; a hit whose slot holds another position is a corrupt state. The
//   caller reads the counts and failures as soon as it ends.
// - The install (a block per job) finishes the step off the critical path: the misses,
//   numbered in selection order, take the slots not selected this step, oldest first (ages
//   capped at 255 steps; among equal ages, lower slots first; victims taken in slot order);
//   each miss's row goes from staging into its slot; the marks are cleared, the step
//   counted, and the report words reset for the next call. It reads only what the table and
//   the state own (the fetch keeps a copy of the selection): once the fetch is done, the
//   caller may write its selection and destination again.
// - A load may also prefetch: the `ahead` entries after its count (the indexer's next
//   candidates) are copied aside by its fetch, and after its install the same two kernels run
//   again over them (phase 1): the fetch marks their hits and reads their misses into
//   staging only (no destination), the install gives the misses slots. That second step is
//   off the critical path too, and the caller's selection is free once the first fetch ends.
//
// The host backend runs the same steps in Rust (swap_in.rs); the two leave the same state
// from every state their loads leave.
// A state is trusted for nothing: a slot or position out of its table's bounds is reported
// (kind 4), never followed. A refused job installs nothing (its hits are marked used, the
// step is spent); its output may hold some of its rows. A victim whose position is out of
// bounds is found by the install, after the rows went out: the job's rows are right, nothing
// is installed, and the state is flagged bad, so that its next load is refused (kind 4).

#define GPUIO_SWAP_NONE 0xffffffffu
#define GPUIO_SWAP_PENDING 0xfffffffeu
// A slot word's mark for a hit this step (slots are below 8192; NONE and PENDING have it).
#define GPUIO_SWAP_SEL (1u << 30)
#define GPUIO_SWAP_MAX_SELECTION 4096
#define GPUIO_SWAP_MAX_SLOTS 8192
#define GPUIO_SWAP_THREADS 1024
#define GPUIO_SWAP_FETCH_THREADS 256
#define GPUIO_SWAP_FETCH_ENTRIES (GPUIO_SWAP_FETCH_THREADS / 32)
// Failure kinds, in the order the first is reported (swap_in.rs names them).
#define GPUIO_SWAP_PAST_LEN 0ull
#define GPUIO_SWAP_TWICE 1ull
#define GPUIO_SWAP_TOO_MANY 2ull
#define GPUIO_SWAP_EXHAUSTED 3ull
#define GPUIO_SWAP_CORRUPT 4ull

// One job (88 bytes, as the host writes it: `SwapJob` in
// crates/gpuio-hal/src/ai/swap_in/op.rs, whose layout is asserted there too).
struct gpuio_swap_job {
    gpuio_u64 selection;   // u32 positions
    gpuio_u64 control;     // per call: the layer's length, then count | ahead << 32
    gpuio_u64 state;       // u32 step, u32 bad, slot_of[positions], holder[slots], last_used[slots]
    gpuio_u64 warm;        // warm row 0, pinned host memory through its device address
    gpuio_u64 warm_first;  // the warm row of position 0
    gpuio_u64 hot;         // `slots` rows
    gpuio_u64 dst;         // `max_count` rows
    gpuio_u64 staging;     // `max_count` rows: the misses' rows from the fetch to the install
    gpuio_u64 seen;        // `max_count` u32s: the selection as the fetch read it, for the install
    gpuio_u32 positions, slots, max_count, unused;
};
static_assert(sizeof(gpuio_swap_job) == 88, "gpuio_swap_job size");
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(gpuio_swap_job, selection) == 0, "swap_job.selection");
static_assert(__builtin_offsetof(gpuio_swap_job, control) == 8, "swap_job.control");
static_assert(__builtin_offsetof(gpuio_swap_job, state) == 16, "swap_job.state");
static_assert(__builtin_offsetof(gpuio_swap_job, warm) == 24, "swap_job.warm");
static_assert(__builtin_offsetof(gpuio_swap_job, warm_first) == 32, "swap_job.warm_first");
static_assert(__builtin_offsetof(gpuio_swap_job, hot) == 40, "swap_job.hot");
static_assert(__builtin_offsetof(gpuio_swap_job, dst) == 48, "swap_job.dst");
static_assert(__builtin_offsetof(gpuio_swap_job, staging) == 56, "swap_job.staging");
static_assert(__builtin_offsetof(gpuio_swap_job, seen) == 64, "swap_job.seen");
static_assert(__builtin_offsetof(gpuio_swap_job, positions) == 72, "swap_job.positions");
static_assert(__builtin_offsetof(gpuio_swap_job, slots) == 76, "swap_job.slots");
static_assert(__builtin_offsetof(gpuio_swap_job, max_count) == 80, "swap_job.max_count");
static_assert(__builtin_offsetof(gpuio_swap_job, unused) == 84, "swap_job.unused");
#endif

// A call's control words in the fetch's parameters, where it has at most
// GPUIO_SWAP_INLINE_JOBS jobs (`jobs`; 0: read them from the table): a fetch queued on the
// caller's stream then waits for no upload. The install reads the table's, uploaded before it.
#define GPUIO_SWAP_INLINE_JOBS 16
struct gpuio_swap_inline {
    gpuio_u64 jobs;
    gpuio_u64 words[2 * GPUIO_SWAP_INLINE_JOBS];
};
static_assert(sizeof(gpuio_swap_inline) == 264, "gpuio_swap_inline size");

// The report words: the call's first failure, each job's first failure (all ones where none:
// atomic minima), each job's hits | misses << 32.
__device__ __forceinline__ void gpuio_swap_bad(gpuio_u64* report, gpuio_u64 kind, gpuio_u64 job,
                                               gpuio_u64 value) {
    const gpuio_u64 word = kind << 60 | job << 32 | (value & 0xffffffffull);
    atomicMin(report, word);
    atomicMin(report + 1 + job, word);
}

// A slot word no load leaves: a slot past the table (with or without the hit mark) that is
// neither NONE nor PENDING.
__device__ __forceinline__ bool gpuio_swap_corrupt(gpuio_u32 word, gpuio_u32 slots) {
    return word != GPUIO_SWAP_NONE && word != GPUIO_SWAP_PENDING && (word & ~GPUIO_SWAP_SEL) >= slots;
}

// A refusal of the whole job before anything is marked (the same test in both kernels and
// phases; `want` is the count and the entries ahead): its kind, or -1 when the job may run.
__device__ __forceinline__ int gpuio_swap_refused(gpuio_u32 step, gpuio_u32 bad, gpuio_u64 want,
                                                  gpuio_u32 max_count) {
    if (step == GPUIO_SWAP_NONE) return (int)GPUIO_SWAP_EXHAUSTED;
    if (want > max_count) return (int)GPUIO_SWAP_TOO_MANY;
    if (bad) return (int)GPUIO_SWAP_CORRUPT;
    return -1;
}

// A phase's entries from a job's control words (`len`, `ctl`): the load (phase 0) takes
// [0, count), its prefetch (phase 1) [count, count + ahead); `want` is both together, for the
// refusal.
struct gpuio_swap_window {
    gpuio_u64 len, want;
    gpuio_u32 first, count, ahead;
};
__device__ __forceinline__ gpuio_swap_window gpuio_swap_window_of(gpuio_u64 len, gpuio_u64 ctl,
                                                                  gpuio_u64 phase) {
    const gpuio_u32 count = (gpuio_u32)ctl, ahead = (gpuio_u32)(ctl >> 32);
    gpuio_swap_window w;
    w.len = len;
    w.want = (gpuio_u64)count + ahead;
    w.first = phase ? count : 0;
    w.count = phase ? ahead : count;
    w.ahead = ahead;
    return w;
}

// Lane 0's second step for an entry at `i` whose slot word was `old` (not corrupt): 1 for a
// hit (its slot holds `p`), 2 for a miss it claimed, 0 for a failure (reported).
__device__ __forceinline__ int gpuio_swap_verdict(const gpuio_swap_job& job, gpuio_u32 p,
                                                  gpuio_u32 old, gpuio_u64* report, gpuio_u32 j) {
    gpuio_u32* slot_of = (gpuio_u32*)job.state + 2;
    if (old == GPUIO_SWAP_NONE) {
        if (atomicCAS(&slot_of[p], GPUIO_SWAP_NONE, GPUIO_SWAP_PENDING) == GPUIO_SWAP_NONE) return 2;
        gpuio_swap_bad(report, GPUIO_SWAP_TWICE, j, p);
        return 0;
    }
    if (old == GPUIO_SWAP_PENDING || (old & GPUIO_SWAP_SEL)) {
        gpuio_swap_bad(report, GPUIO_SWAP_TWICE, j, p);
        return 0;
    }
    // Loads keep slot_of[p] = s exactly when holder[s] = p: a slot holding another position
    // (or two positions naming one slot) is the state's fault.
    if (slot_of[job.positions + old] == p) return 1;
    gpuio_swap_bad(report, GPUIO_SWAP_CORRUPT, j, p);
    return 0;
}

// Row pieces a warp copies: one round of 4 a lane. A longer row is split in chunks of as many,
// a warp each, so that its copy is as deep as one round however long the row is.
#define GPUIO_SWAP_CHUNK_PIECES (4 * 32)

// A warp's chunk `chunk` of the entry at `i` (position `p`, slot word `old`): its pieces are
// loaded from where `old` says (its slot, or pinned host memory) while lane 0 decides, and
// stored only once that holds: to the destination (where `deliver`: not in a prefetch), and a
// miss's also to staging. Chunk 0's warp marked the slot word (`old` is what it held before)
// and gives the verdict, counted and reported; another chunk's warp read the word as it was
// and only copies: from the slot where it holds `p`, else (NONE or PENDING) from host memory,
// as chunk 0's does unless the job fails, which refuses it.
template <typename W>
__device__ __forceinline__ void gpuio_swap_fetch_entry(const gpuio_swap_job& job, gpuio_u64 rb,
                                                       gpuio_u32 i, gpuio_u32 p, gpuio_u32 old,
                                                       gpuio_u32 chunk, bool deliver,
                                                       gpuio_u64* report, gpuio_u32 j,
                                                       gpuio_u64* counted) {
    const gpuio_u32 lane = threadIdx.x & 31, per_row = (gpuio_u32)(rb / sizeof(W));
    const gpuio_u32 slot = old & ~GPUIO_SWAP_SEL;
    const bool miss = old == GPUIO_SWAP_NONE || (chunk > 0 && old == GPUIO_SWAP_PENDING);
    const W* from = 0;
    if (miss) from = (const W*)(job.warm + (job.warm_first + p) * rb);
    else if (deliver && (chunk > 0 || !(old & GPUIO_SWAP_SEL))) from = (const W*)(job.hot + (gpuio_u64)slot * rb);
    const gpuio_u32 base = chunk * GPUIO_SWAP_CHUNK_PIECES;
    W v[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const gpuio_u32 c = base + lane + 32 * k;
        if (from && c < per_row) v[k] = from[c];
    }
    int mine = 0;
    if (lane == 0 && chunk == 0) mine = gpuio_swap_verdict(job, p, old, report, j);
    else if (lane == 0) mine = miss ? 2 : (((gpuio_u32*)job.state)[2 + job.positions + slot] == p);
    const int verdict = __shfl_sync(0xffffffffu, mine, 0);
    if (lane == 0 && chunk == 0 && verdict) atomicAdd(counted, verdict == 1 ? 1ull : 1ull << 32);
    if (!verdict || (!deliver && verdict == 1)) return;
    W* to = (W*)(job.dst + (gpuio_u64)i * rb);
    W* also = (W*)(job.staging + (gpuio_u64)i * rb);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const gpuio_u32 c = base + lane + 32 * k;
        if (c < per_row) {
            if (deliver) to[c] = v[k];
            if (verdict == 2) also[c] = v[k];
        }
    }
}

// The fetch: grid (the largest phase's entries times a row's chunks / 8, jobs),
// GPUIO_SWAP_FETCH_THREADS threads, a warp per chunk of an entry's row (one chunk for rows of
// up to 128 pieces). Phase 0 (the load) reads the caller's selection and copies the entries
// ahead of its count into the table's copy (lane 1 of chunk 0's warp, beside lane 0's work);
// phase 1 (the prefetch) reads them there.
// Each step issues every load it needs before its first branch, so an entry waits on five
// trips to memory: the job; its state words and position (and the control words, where they
// are not in the parameters); its slot word; the slot word's atomic; its row (beside the
// hit's check or the miss's claim). `width` divides the row size and every row address (the
// host picks it).
//
// The fetch's body for one phase, fixed at compile time: the load's entries are addressed
// without its control words, so its first loads (the position's among them) wait on nothing.
template <bool PREFETCH>
__device__ __forceinline__ void gpuio_swap_fetch_phase(const gpuio_swap_job* jobs, gpuio_u64 rb,
                                                       gpuio_u64 width, gpuio_u64* report,
                                                       const gpuio_swap_inline& ctl,
                                                       gpuio_u64* counted) {
    const gpuio_u32 j = blockIdx.y, n = gridDim.y, lane = threadIdx.x & 31;
    // Rows are at most 256 KiB (the host checks): 32-bit arithmetic.
    const gpuio_u32 per_row = (gpuio_u32)rb / (gpuio_u32)width;
    const gpuio_u32 chunks = (per_row + GPUIO_SWAP_CHUNK_PIECES - 1) / GPUIO_SWAP_CHUNK_PIECES;
    const gpuio_u32 g = blockIdx.x * GPUIO_SWAP_FETCH_ENTRIES + threadIdx.x / 32;
    const gpuio_u32 w = chunks == 1 ? g : g / chunks, chunk = g - w * chunks;
    const gpuio_swap_job& job = jobs[j];
    gpuio_u32* st = (gpuio_u32*)job.state;
    gpuio_u32* slot_of = st + 2;
    gpuio_u32* seen = (gpuio_u32*)job.seen;
    if (threadIdx.x == 0) *counted = 0;
    const gpuio_u64* control = (const gpuio_u64*)job.control;
    const gpuio_u64 phase = PREFETCH;
    const gpuio_swap_window win = ctl.jobs ? gpuio_swap_window_of(ctl.words[2 * j], ctl.words[2 * j + 1], phase)
                                           : gpuio_swap_window_of(control[0], control[1], phase);
    const gpuio_u32 step = st[0], flagged = st[1];
    // The selection holds max_count positions: one is read before the count is known. The
    // prefetch's entries follow the count, in the table's copy.
    gpuio_u32 i = w, p = 0;
    if (PREFETCH) {
        i = win.first + w;
        if (i < job.max_count) p = seen[i];
    } else if (i < job.max_count) {
        p = ((const gpuio_u32*)job.selection)[i];
    }
    // A job with nothing ahead has no prefetch: not refused, not a step.
    const bool idle = PREFETCH && !win.count;
    const int refused = idle ? -1 : gpuio_swap_refused(step, flagged, win.want, job.max_count);
    if (refused >= 0 && blockIdx.x == 0 && threadIdx.x == 0)
        gpuio_swap_bad(report, refused, j, refused == (int)GPUIO_SWAP_CORRUPT ? GPUIO_SWAP_NONE : win.want);
    __syncthreads();  // `counted` is zeroed
    if (!PREFETCH && refused < 0 && chunk == 0 && lane == 1 && w < win.ahead)
        seen[win.count + w] = ((const gpuio_u32*)job.selection)[win.count + w];
    if (refused < 0 && w < win.count) {
        gpuio_u32 old = GPUIO_SWAP_PENDING;
        int go = 0;
        if (lane == 0) {
            if (!PREFETCH && chunk == 0) seen[i] = p;
            const gpuio_u32 word = p < win.len ? slot_of[p] : GPUIO_SWAP_NONE;
            if (p >= win.len) {
                if (chunk == 0) gpuio_swap_bad(report, GPUIO_SWAP_PAST_LEN, j, i);
            } else if (gpuio_swap_corrupt(word, job.slots)) {
                // Not followed, and left as it is (no load of this call changes such a word:
                // marked, some would read as NONE or PENDING to a second entry of `p`).
                if (chunk == 0) gpuio_swap_bad(report, GPUIO_SWAP_CORRUPT, j, p);
            } else if (chunk == 0) {
                // One atomic marks a hit (NONE and PENDING already carry the mark); a miss is
                // claimed by a second, in gpuio_swap_verdict.
                old = atomicOr(&slot_of[p], GPUIO_SWAP_SEL);
                go = 1;
            } else {
                old = word;
                go = 1;
            }
        }
        old = __shfl_sync(0xffffffffu, old, 0);
        if (__shfl_sync(0xffffffffu, go, 0)) {
            const bool d = !PREFETCH;
            if (width == 16) gpuio_swap_fetch_entry<uint4>(job, rb, i, p, old, chunk, d, report, j, counted);
            else if (width == 8) gpuio_swap_fetch_entry<gpuio_u64>(job, rb, i, p, old, chunk, d, report, j, counted);
            else if (width == 4) gpuio_swap_fetch_entry<gpuio_u32>(job, rb, i, p, old, chunk, d, report, j, counted);
            else gpuio_swap_fetch_entry<unsigned char>(job, rb, i, p, old, chunk, d, report, j, counted);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && *counted) atomicAdd(report + 1 + n + j, *counted);
}

extern "C" __global__ void __launch_bounds__(GPUIO_SWAP_FETCH_THREADS)
    gpuio_swap_in_fetch(const gpuio_swap_job* jobs, gpuio_u64 rb, gpuio_u64 width,
                        gpuio_u64* report, gpuio_u64 phase, const gpuio_swap_inline ctl) {
    __shared__ gpuio_u64 counted;  // this block's hits | misses << 32
    if (phase) gpuio_swap_fetch_phase<true>(jobs, rb, width, report, ctl, &counted);
    else gpuio_swap_fetch_phase<false>(jobs, rb, width, report, ctl, &counted);
}

// Exclusive prefix sum of `v` over the block (GPUIO_SWAP_THREADS threads), the total in
// `*total`. Every thread of the block must call it.
__device__ gpuio_u32 gpuio_swap_scan(gpuio_u32 v, gpuio_u32* sums, gpuio_u32* total) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    gpuio_u32 x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const gpuio_u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= (unsigned)o) x += y;
    }
    if (lane == 31) sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        const gpuio_u32 w = sums[lane];
        gpuio_u32 s = w;
        for (int o = 1; o < 32; o <<= 1) {
            const gpuio_u32 y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= (unsigned)o) s += y;
        }
        sums[lane] = s - w;
        if (lane == 31) sums[32] = s;
    }
    __syncthreads();
    const gpuio_u32 before = sums[warp] + x - v;
    *total = sums[32];
    __syncthreads();  // `sums` is reused by the next scan
    return before;
}

// The install's shared memory. Each thread owns PER consecutive selection entries and SLOTS
// consecutive slots (the smallest powers of two that cover the job: the kernel picks the
// instance), so one scan over the block numbers misses in selection order and victims in
// slot order.
struct gpuio_swap_shared {
    // Per miss in selection order: its position, then (once chosen) its slot; its entry.
    gpuio_u32 miss_pos[GPUIO_SWAP_MAX_SELECTION], miss_at[GPUIO_SWAP_MAX_SELECTION];
    gpuio_u32 hit[GPUIO_SWAP_MAX_SLOTS / 32], hist[256], sums[33];
    gpuio_u32 oldest, older;
};

// Each miss's row from staging (its entry's row) into its slot, with the block's threads,
// four pieces of W per thread in flight at a time.
template <typename W>
__device__ __forceinline__ void gpuio_swap_install_rows(const gpuio_swap_job& job,
                                                        const gpuio_swap_shared& sh,
                                                        gpuio_u32 misses, gpuio_u64 rb) {
    const gpuio_u32 per_row = (gpuio_u32)(rb / sizeof(W)), total = misses * per_row;
    for (gpuio_u32 base = 0; base < total; base += 4 * blockDim.x) {
        W v[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const gpuio_u32 c = base + threadIdx.x + k * blockDim.x;
            if (c < total) v[k] = ((const W*)(job.staging + sh.miss_at[c / per_row] * rb))[c % per_row];
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const gpuio_u32 c = base + threadIdx.x + k * blockDim.x;
            if (c < total) ((W*)(job.hot + sh.miss_pos[c / per_row] * rb))[c % per_row] = v[k];
        }
    }
}

template <int PER, int SLOTS>
__device__ __forceinline__ void gpuio_swap_install_job(const gpuio_swap_job& job, gpuio_u64 rb,
                                                       gpuio_u64 width, gpuio_u64* report,
                                                       gpuio_u64 phase, gpuio_swap_shared& sh) {
    const unsigned tid = threadIdx.x, lane = tid & 31;
    const gpuio_u32 j = blockIdx.x, n = gridDim.x;
    gpuio_u32* st = (gpuio_u32*)job.state;
    gpuio_u32* slot_of = st + 2;
    gpuio_u32* holder = slot_of + job.positions;
    gpuio_u32* last_used = holder + job.slots;
    const gpuio_u64* control = (const gpuio_u64*)job.control;
    const gpuio_swap_window win = gpuio_swap_window_of(control[0], control[1], phase);
    const gpuio_u64 len = win.len;
    const gpuio_u32 state = st[0], flagged = st[1];
    const bool refused = report[1 + j] != ~0ull;
    __syncthreads();  // every thread has read the words reset below
    if ((phase && !win.count) || gpuio_swap_refused(state, flagged, win.want, job.max_count) >= 0) {
        // The fetch touched nothing (nothing ahead to prefetch, or a job refused whole).
    } else {
        const gpuio_u32 first = win.first, end = win.first + win.count, step = state + 1;
        // Every input in one round of loads.
        gpuio_u32 pos[PER], lu[SLOTS], held[SLOTS];
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const gpuio_u32 i = tid * PER + k;
            // The caller may write its selection again once the fetch is done.
            pos[k] = i >= first && i < end ? ((const gpuio_u32*)job.seen)[i] : GPUIO_SWAP_NONE;
        }
#pragma unroll
        for (int k = 0; k < SLOTS; k++) {
            const gpuio_u32 s = tid * SLOTS + k;
            lu[k] = s < job.slots ? last_used[s] : 0;
            held[k] = s < job.slots ? holder[s] : GPUIO_SWAP_NONE;
        }
        if (tid < 256) sh.hist[tid] = 0;
        for (gpuio_u32 w = tid; w < GPUIO_SWAP_MAX_SLOTS / 32; w += GPUIO_SWAP_THREADS) sh.hit[w] = 0;
        gpuio_u32 mark[PER];
#pragma unroll
        for (int k = 0; k < PER; k++) mark[k] = pos[k] < len ? slot_of[pos[k]] : GPUIO_SWAP_NONE;
        __syncthreads();
        // The fetch's marks: a hit's is cleared and its slot used this step; a miss is counted
        // (or, in a refused job, unmarked). Other words are as the fetch found them.
        gpuio_u32 misses_here = 0;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const gpuio_u32 m = mark[k];
            if (m == GPUIO_SWAP_PENDING) {
                if (refused) slot_of[pos[k]] = GPUIO_SWAP_NONE;
                else misses_here++;
            } else if ((m & GPUIO_SWAP_SEL) && (m & ~GPUIO_SWAP_SEL) < job.slots) {
                const gpuio_u32 s = m & ~GPUIO_SWAP_SEL;
                slot_of[pos[k]] = s;
                last_used[s] = step;
                atomicOr(&sh.hit[s / 32], 1u << (s % 32));
            }
        }
        gpuio_u32 misses;
        gpuio_u32 at = gpuio_swap_scan(misses_here, sh.sums, &misses);
#pragma unroll
        for (int k = 0; k < PER; k++) {
            if (!refused && mark[k] == GPUIO_SWAP_PENDING) {
                sh.miss_pos[at] = pos[k];
                sh.miss_at[at] = tid * PER + k;
                at++;
            }
        }
        int victim[SLOTS];
        gpuio_u32 v = 0;
        int bad = 0;
        if (misses > 0) {
            // How many unselected slots are each age (warp-aggregated: many share one).
            gpuio_u32 age[SLOTS];
#pragma unroll
            for (int k = 0; k < SLOTS; k++) {
                const gpuio_u32 s = tid * SLOTS + k;
                const bool free = s < job.slots && !(sh.hit[s / 32] >> (s % 32) & 1);
                age[k] = free ? min(step - lu[k], 255u) : 256;
                const unsigned same = __match_any_sync(0xffffffffu, age[k]);
                if (age[k] < 256 && lane == (unsigned)__ffs(same) - 1) atomicAdd(&sh.hist[age[k]], __popc(same));
            }
            __syncthreads();
            // The youngest age the victims reach, and how many unselected slots are older.
            const gpuio_u32 nth = tid < 256 ? sh.hist[255 - tid] : 0;
            gpuio_u32 all;
            const gpuio_u32 older = gpuio_swap_scan(nth, sh.sums, &all);
            if (tid < 256 && older < misses && older + nth >= misses) {
                sh.oldest = 255 - tid;
                sh.older = older;
            }
            __syncthreads();
            const gpuio_u32 edge = sh.oldest, from_edge = misses - sh.older;
            gpuio_u32 at_edge = 0;
#pragma unroll
            for (int k = 0; k < SLOTS; k++) at_edge += age[k] == edge;
            gpuio_u32 t1, t2;
            gpuio_u32 rank = gpuio_swap_scan(at_edge, sh.sums, &t1);
            gpuio_u32 victims = 0;
#pragma unroll
            for (int k = 0; k < SLOTS; k++) {
                victim[k] = age[k] < 256 && (age[k] > edge || (age[k] == edge && rank++ < from_edge));
                victims += victim[k];
                // A victim's position is followed below: one outside the table flags the state.
                if (victim[k] && held[k] >= job.positions && held[k] != GPUIO_SWAP_NONE) bad = 1;
            }
            v = gpuio_swap_scan(victims, sh.sums, &t2);
            bad = __syncthreads_or(bad);
        }
        if (bad) {
            // The rows went out; nothing is installed, and the next load is refused.
            for (gpuio_u32 m = tid; m < misses; m += GPUIO_SWAP_THREADS) slot_of[sh.miss_pos[m]] = GPUIO_SWAP_NONE;
            if (tid == 0) st[1] = 1;
        } else if (misses > 0) {
#pragma unroll
            for (int k = 0; k < SLOTS; k++) {
                if (!victim[k]) continue;
                const gpuio_u32 s = tid * SLOTS + k, p = sh.miss_pos[v], old = held[k];
                if (old != GPUIO_SWAP_NONE) slot_of[old] = GPUIO_SWAP_NONE;
                holder[s] = p;
                slot_of[p] = s;
                last_used[s] = step;
                sh.miss_pos[v] = s;
                v++;
            }
            __syncthreads();
            if (width == 16) gpuio_swap_install_rows<uint4>(job, sh, misses, rb);
            else if (width == 8) gpuio_swap_install_rows<gpuio_u64>(job, sh, misses, rb);
            else if (width == 4) gpuio_swap_install_rows<gpuio_u32>(job, sh, misses, rb);
            else gpuio_swap_install_rows<unsigned char>(job, sh, misses, rb);
        }
        if (tid == 0) st[0] = step;
    }
    // The report words back to their start for the next call (the caller has read them).
    if (tid == 0) {
        report[1 + j] = ~0ull;
        report[1 + n + j] = 0;
        if (j == 0) report[0] = ~0ull;
    }
}

extern "C" __global__ void __launch_bounds__(GPUIO_SWAP_THREADS)
    gpuio_swap_in_install(const gpuio_swap_job* jobs, gpuio_u64 rb, gpuio_u64 width,
                          gpuio_u64* report, gpuio_u64 phase) {
    __shared__ gpuio_swap_shared sh;
    const gpuio_swap_job& job = jobs[blockIdx.x];
    const gpuio_u32 per = (job.max_count + GPUIO_SWAP_THREADS - 1) / GPUIO_SWAP_THREADS;
    const gpuio_u32 slots = (job.slots + GPUIO_SWAP_THREADS - 1) / GPUIO_SWAP_THREADS;
    // The host bounds max_count by 4096 and slots by 8192: per <= 4, slots <= 8.
#define GPUIO_SWAP_SLOTS_CASES(P)                                                           \
    if (slots <= 1) return gpuio_swap_install_job<P, 1>(job, rb, width, report, phase, sh); \
    if (slots <= 2) return gpuio_swap_install_job<P, 2>(job, rb, width, report, phase, sh); \
    if (slots <= 4) return gpuio_swap_install_job<P, 4>(job, rb, width, report, phase, sh); \
    return gpuio_swap_install_job<P, 8>(job, rb, width, report, phase, sh);
    if (per <= 1) { GPUIO_SWAP_SLOTS_CASES(1) }
    if (per <= 2) { GPUIO_SWAP_SLOTS_CASES(2) }
    GPUIO_SWAP_SLOTS_CASES(4)
#undef GPUIO_SWAP_SLOTS_CASES
}
