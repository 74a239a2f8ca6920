// Deterministic data pattern and on-device comparison.
//
// Byte i of pattern stream `seed` is byte (i % 8) of word_at(seed, i / 8), little-endian; the
// CPU reference is crates/gpuio-hal/src/pattern.rs and both must stay bit-identical (the CUDA
// tests compare them). gpuio puts gpuio_pattern.cuh in front of it (NVRTC gets no include
// paths).

#ifndef GPUIO_PATTERN_CUH
#include "gpuio_pattern.cuh"
#endif

typedef unsigned long long u64;
typedef unsigned char u8;

// Writes pattern bytes first..first+len of `seed` to dst[0..len). One thread per pattern word;
// whole words go out as one 8-byte store when dst is aligned with the pattern.
extern "C" __global__ void gpuio_fill_pattern(u8* dst, u64 len, u64 first, u64 seed) {
    const u64 w_begin = first / 8;
    const u64 w_end = (first + len + 7) / 8;
    const bool aligned = (((unsigned long long)dst - first) % 8) == 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 w = w_begin + (u64)blockIdx.x * blockDim.x + threadIdx.x; w < w_end; w += stride) {
        const u64 word = gpuio_word_at(seed, w);
        const u64 lo = w * 8;  // pattern index of the word's first byte
        if (aligned && lo >= first && lo + 8 <= first + len) {
            *(u64*)(dst + (lo - first)) = word;
        } else {
            for (int b = 0; b < 8; ++b) {
                const u64 i = lo + b;
                if (i >= first && i < first + len) dst[i - first] = (u8)(word >> (8 * b));
            }
        }
    }
}

// Finds the first offset where a[0..len) and b[0..len) differ; *first_diff must start at
// ~0ull and ends as the smallest differing offset (or stays ~0ull). 16 bytes per thread step.
extern "C" __global__ void gpuio_find_mismatch(const u8* a, const u8* b, u64 len, u64* first_diff) {
    const u64 chunks = (len + 15) / 16;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += stride) {
        const u64 lo = c * 16;
        const u64 hi = lo + 16 < len ? lo + 16 : len;
        for (u64 i = lo; i < hi; ++i) {
            if (a[i] != b[i]) {
                atomicMin(first_diff, i);
                break;
            }
        }
    }
}
