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

// ---- Swap-in planning: HiSparse's hot buffer, refilled by the device (swap_in.rs in the HAL) --
//
// A job is one request's layer: a top-k selection of positions (u32s in device memory), a
// hot buffer of `slots` device rows, and a state in device memory — a step counter, each
// position's slot, each slot's position, each slot's last step. One block per job plans a
// load: a selected position with a slot is a hit (its code names the slot, the slot is marked
// used this step); the others are misses, numbered in selection order, each given a victim
// slot — the slots not selected this step, oldest first (ages capped at 255 steps; among
// equal ages, lower slots first), the victims taken in slot order — and a code that reads the
// entry from pinned host memory (warm row `warm_first + position`) and installs it in its
// slot. The tiered gather (gather.cu) then moves the rows, reading this job's gather entry,
// whose count the plan writes (0 when the plan fails). The host backend runs the same plan in
// Rust (swap_in.rs): the two agree code for code. A state is trusted for nothing: a slot or
// position out of its table's bounds is reported (kind 4), never followed.

#define GPUIO_SWAP_NONE 0xffffffffu
#define GPUIO_SWAP_PENDING 0xfffffffeu
#define GPUIO_SWAP_MAX_SELECTION 4096
#define GPUIO_SWAP_MAX_SLOTS 8192
#define GPUIO_SWAP_THREADS 1024
// As gather.cu's tiered codes: the warm bit, then the slot above the 40-bit warm row.
#define GPUIO_SWAP_WARM (1ull << 63)
#define GPUIO_SWAP_ROW_BITS 40

// One job's plan (64 bytes, as the host writes it).
struct gpuio_swap_job {
    gpuio_u64 selection;   // u32 positions
    gpuio_u64 control;     // pinned host memory, mapped: the layer's length, the selection's count
    gpuio_u64 state;       // u32 step, u32 unused, slot_of[positions], holder[slots], last_used[slots]
    gpuio_u64 gather_job;  // this job's entry of the gather table (its count is word 6)
    gpuio_u64 warm_first;  // the warm row of position 0
    gpuio_u64 first;       // this job's first code
    gpuio_u32 positions, slots, max_count, unused;
};

// The first failure wins (an atomic minimum): kind, job, value (an entry or a position), in
// the call's word and, with bit 63 set, in the job's own word (which otherwise receives its
// counts; both start as all ones).
__device__ __forceinline__ void gpuio_swap_bad(gpuio_u64* report, gpuio_u64 kind, gpuio_u64 job,
                                               gpuio_u64 value) {
    const gpuio_u64 word = kind << 60 | job << 32 | (value & 0xffffffffull);
    atomicMin(report, word);
    atomicMin(report + 2 + job, word | 1ull << 63);
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

// Each thread owns PER consecutive selection entries and SLOTS consecutive slots (the
// smallest powers of two that cover the job: the kernel picks the instance), so one scan over
// the block numbers misses in selection order and victims in slot order. Everything the plan
// reads from memory — the control words, the step, the selection, every slot's last step and
// position — is loaded at the start, together: the plan is one round of loads, one of
// atomics, then shared memory and registers.
struct gpuio_swap_shared {
    gpuio_u32 miss_pos[GPUIO_SWAP_MAX_SELECTION], miss_at[GPUIO_SWAP_MAX_SELECTION];
    gpuio_u32 hit[GPUIO_SWAP_MAX_SLOTS / 32], hist[256], sums[33];
    gpuio_u64 len, count;
    gpuio_u32 state, oldest, older;
};

template <int PER, int SLOTS>
__device__ __forceinline__ void gpuio_swap_plan(const gpuio_swap_job& job, gpuio_u64* codes,
                                                gpuio_u64* report, gpuio_swap_shared& sh) {
    const unsigned tid = threadIdx.x, lane = tid & 31;
    gpuio_u32* st = (gpuio_u32*)job.state;
    gpuio_u32* slot_of = st + 2;
    gpuio_u32* holder = slot_of + job.positions;
    gpuio_u32* last_used = holder + job.slots;
    gpuio_u64* gather_count = (gpuio_u64*)job.gather_job + 6;

    // One round of loads.
    if (tid == 0) {
        const volatile gpuio_u64* control = (const volatile gpuio_u64*)job.control;
        sh.len = control[0];
        sh.count = control[1];
        sh.state = st[0];
    }
    gpuio_u32 pos[PER], lu[SLOTS], held[SLOTS];
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const gpuio_u32 i = tid * PER + k;
        pos[k] = i < job.max_count ? ((const gpuio_u32*)job.selection)[i] : 0;
    }
#pragma unroll
    for (int k = 0; k < SLOTS; k++) {
        const gpuio_u32 s = tid * SLOTS + k;
        lu[k] = s < job.slots ? last_used[s] : 0;
        held[k] = s < job.slots ? holder[s] : GPUIO_SWAP_NONE;
    }
    if (tid < 256) sh.hist[tid] = 0;
    for (gpuio_u32 w = tid; w < GPUIO_SWAP_MAX_SLOTS / 32; w += GPUIO_SWAP_THREADS) sh.hit[w] = 0;
    __syncthreads();
    const gpuio_u64 len = sh.len, want = sh.count;
    const gpuio_u32 step = sh.state + 1;
    if (want > job.max_count || sh.state == 0xffffffffu) {
        if (tid == 0) {
            gpuio_swap_bad(report, sh.state == 0xffffffffu ? 3 : 2, blockIdx.x, want);
            *gather_count = 0;
        }
        return;
    }
    const gpuio_u32 count = (gpuio_u32)want;

    // One round of atomics: a selected position with a slot is a hit, one without is marked
    // pending (a miss); a position marked twice, or a slot hit twice, is selected twice.
    gpuio_u32 slot[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const gpuio_u32 i = tid * PER + k;
        slot[k] = GPUIO_SWAP_NONE;
        if (i < count && pos[k] < len)
            slot[k] = atomicCAS(&slot_of[pos[k]], GPUIO_SWAP_NONE, GPUIO_SWAP_PENDING);
    }
    gpuio_u32 misses_here = 0, hits_here = 0;
    int bad = 0;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const gpuio_u32 i = tid * PER + k;
        if (i >= count) continue;
        if (pos[k] >= len) {
            bad = 1;
            gpuio_swap_bad(report, 0, blockIdx.x, i);
        } else if (slot[k] == GPUIO_SWAP_NONE) {
            misses_here++;
        } else if (slot[k] == GPUIO_SWAP_PENDING || slot[k] >= job.slots) {
            bad = 1;
            gpuio_swap_bad(report, slot[k] == GPUIO_SWAP_PENDING ? 1 : 4, blockIdx.x, pos[k]);
        } else if (atomicOr(&sh.hit[slot[k] / 32], 1u << (slot[k] % 32)) & (1u << (slot[k] % 32))) {
            bad = 1;
            gpuio_swap_bad(report, 1, blockIdx.x, pos[k]);
        } else {
            hits_here++;
            last_used[slot[k]] = step;
            codes[job.first + i] = slot[k];
        }
    }
    // Misses numbered in selection order; hits and misses counted (16 bits each: at most
    // 4096 of either).
    gpuio_u32 totals;
    gpuio_u32 at = gpuio_swap_scan(misses_here | hits_here << 16, sh.sums, &totals) & 0xffff;
#pragma unroll
    for (int k = 0; k < PER; k++) {
        const gpuio_u32 i = tid * PER + k;
        if (i < count && pos[k] < len && slot[k] == GPUIO_SWAP_NONE) {
            sh.miss_pos[at] = pos[k];
            sh.miss_at[at] = i;
            at++;
        }
    }
    const gpuio_u32 misses = totals & 0xffff, hits = totals >> 16;
    int victim[SLOTS];
    gpuio_u32 j = 0;
    if (!__syncthreads_or(bad) && misses > 0) {
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
        const gpuio_u32 n = tid < 256 ? sh.hist[255 - tid] : 0;
        gpuio_u32 all;
        const gpuio_u32 older = gpuio_swap_scan(n, sh.sums, &all);
        if (tid < 256 && older < misses && older + n >= misses) {
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
            // A victim's position is followed below: one outside the table fails the plan.
            if (victim[k] && held[k] >= job.positions && held[k] != GPUIO_SWAP_NONE) {
                bad = 1;
                gpuio_swap_bad(report, 4, blockIdx.x, tid * SLOTS + k);
            }
        }
        j = gpuio_swap_scan(victims, sh.sums, &t2);
        bad = __syncthreads_or(bad);
    } else {
        bad = __syncthreads_or(bad);
    }
    if (bad) {
        // Nothing installed: the misses' marks are taken back; the step is spent (the hits
        // were marked with it).
        for (gpuio_u32 m = tid; m < misses; m += GPUIO_SWAP_THREADS) slot_of[sh.miss_pos[m]] = GPUIO_SWAP_NONE;
        if (tid == 0) {
            *gather_count = 0;
            st[0] = step;
        }
        return;
    }
    if (misses > 0) {
#pragma unroll
        for (int k = 0; k < SLOTS; k++) {
            if (!victim[k]) continue;
            const gpuio_u32 s = tid * SLOTS + k, p = sh.miss_pos[j], old = held[k];
            if (old != GPUIO_SWAP_NONE) slot_of[old] = GPUIO_SWAP_NONE;
            holder[s] = p;
            slot_of[p] = s;
            last_used[s] = step;
            codes[job.first + sh.miss_at[j]] =
                GPUIO_SWAP_WARM | (gpuio_u64)s << GPUIO_SWAP_ROW_BITS | (job.warm_first + p);
            j++;
        }
    }
    if (tid == 0) {
        *gather_count = count;
        st[0] = step;
        report[2 + blockIdx.x] = hits | (gpuio_u64)misses << 32;
    }
}

extern "C" __global__ void __launch_bounds__(GPUIO_SWAP_THREADS)
    gpuio_swap_in_plan(const gpuio_swap_job* jobs, gpuio_u64* codes, gpuio_u64* report) {
    __shared__ gpuio_swap_shared sh;
    const gpuio_swap_job job = jobs[blockIdx.x];
    const gpuio_u32 per = (job.max_count + GPUIO_SWAP_THREADS - 1) / GPUIO_SWAP_THREADS;
    const gpuio_u32 slots = (job.slots + GPUIO_SWAP_THREADS - 1) / GPUIO_SWAP_THREADS;
    // The host bounds max_count by 4096 and slots by 8192: per <= 4, slots <= 8.
#define GPUIO_SWAP_SLOTS_CASES(P)                                            \
    if (slots <= 1) return gpuio_swap_plan<P, 1>(job, codes, report, sh);   \
    if (slots <= 2) return gpuio_swap_plan<P, 2>(job, codes, report, sh);   \
    if (slots <= 4) return gpuio_swap_plan<P, 4>(job, codes, report, sh);   \
    return gpuio_swap_plan<P, 8>(job, codes, report, sh);
    if (per <= 1) { GPUIO_SWAP_SLOTS_CASES(1) }
    if (per <= 2) { GPUIO_SWAP_SLOTS_CASES(2) }
    GPUIO_SWAP_SLOTS_CASES(4)
#undef GPUIO_SWAP_SLOTS_CASES
}
