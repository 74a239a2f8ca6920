// The position-addressable data pattern's words, shared by pattern.cu and the on-demand
// array tests (ondemand.cu). Word k of pattern stream `seed` is gpuio_word_at(seed, k); the CPU
// reference is crates/gpuio-hal/src/pattern.rs, bit-identical.
#ifndef GPUIO_PATTERN_CUH
#define GPUIO_PATTERN_CUH

__device__ __forceinline__ unsigned long long gpuio_mix64(unsigned long long x) {
    unsigned long long z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ unsigned long long gpuio_word_at(unsigned long long seed,
                                                           unsigned long long k) {
    return gpuio_mix64(seed ^ (k * 0xD6E8FEB86659FD93ull));
}

#endif  // GPUIO_PATTERN_CUH
