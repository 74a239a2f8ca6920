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
