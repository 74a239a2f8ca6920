// On-demand array kernels: the ones gpuio's host API launches (OnDemandArray::prefetch and
// ::synchronize) and the GPU tests' (reads and stores checked against the data pattern, and the
// layout as the device compiler sees it). gpuio puts gpuio_ring.cuh, gpuio_array.cuh and
// gpuio_pattern.cuh in front of it.
#ifndef GPUIO_ARRAY_CUH
#include "gpuio_array.cuh"
#endif
#ifndef GPUIO_PATTERN_CUH
#include "gpuio_pattern.cuh"
#endif

// Pages first .. first + count of the array, one per thread: brought in (touch) or written
// back if dirty (flush). A touch brings a page in however few touches it had (admit_after
// does not apply: the caller asked for the page).
extern "C" __global__ void gpuio_array_touch(gpuio_array_desc a, unsigned long long first,
                                             unsigned long long count) {
    a.admit_after = 0u;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long start = (unsigned long long)blockIdx.x * blockDim.x;
    for (unsigned long long base = start; base < count; base += stride) {
        const unsigned long long k = base + threadIdx.x;
        gpuio_array_visit(&a, k < count, first + k, 0ull, 0ull, [](long long) {});
    }
}

extern "C" __global__ void gpuio_array_flush(gpuio_array_desc a, unsigned long long first,
                                             unsigned long long count) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         k < count; k += stride) {
        gpuio_array_flush_page(&a, first + k);
    }
}

// Holds pages first .. first + count, one per thread: each is brought in if needed and keeps
// one pin until gpuio_array_let_go takes it off; frames[page] gets its frame (0xFFFFFFFF for a
// page that could not be held: its error is recorded for OnDemandArray::check).
extern "C" __global__ void gpuio_array_hold(gpuio_array_desc a, unsigned long long first,
                                            unsigned long long count, unsigned int* frames) {
    a.admit_after = 0u;  // held pages are in frames
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long start = (unsigned long long)blockIdx.x * blockDim.x;
    for (unsigned long long base = start; base < count; base += stride) {
        const unsigned long long k = base + threadIdx.x;
        const unsigned long long page = first + k;
        gpuio_array_visit(&a, k < count, page, 0ull, 0ull, [&](long long frame) {
            if (frame >= 0) {
                // Taken while the visit's own pin holds the page: it stays after that goes.
                gpuio_atom_add(gpuio_array_entry(&a, page), GPUIO_PAGE_PIN_ONE);
            }
            frames[page] = frame >= 0 ? (unsigned int)frame : 0xFFFFFFFFu;
        });
    }
}

// Takes off the pins gpuio_array_hold left on pages first .. first + count (those whose
// frames entry is not 0xFFFFFFFF).
extern "C" __global__ void gpuio_array_let_go(gpuio_array_desc a, unsigned long long first,
                                              unsigned long long count,
                                              const unsigned int* frames) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         k < count; k += stride) {
        if (frames[first + k] != 0xFFFFFFFFu) gpuio_array_unpin(&a, first + k, 1ull);
    }
}

// The value element i should hold: word i of pattern `seed`, or of `written` where i is a
// multiple of `every` (what gpuio_array_test_store wrote; every == 0: nothing written).
__device__ __forceinline__ unsigned long long gpuio_array_expected(unsigned long long i,
                                                                  unsigned long long seed,
                                                                  unsigned long long every,
                                                                  unsigned long long written) {
    return every != 0ull && i % every == 0ull ? gpuio_word_at(written, i) : gpuio_word_at(seed, i);
}

// `reads` reads of u64 elements at random indices (from `salt`), each checked: out[0] counts
// mismatches, out[1] (starting at ~0) is the smallest index read wrong, out[2] counts reads.
// Even warps read through gpuio_array::get; odd warps through get_async and wait, each
// thread checking one element while the next is on its way.
extern "C" __global__ void gpuio_array_test_read(gpuio_array_desc d, unsigned long long reads,
                                                 unsigned long long salt, unsigned long long seed,
                                                 unsigned long long every,
                                                 unsigned long long written,
                                                 unsigned long long* out) {
    const gpuio_array<unsigned long long> a(d);
    const unsigned long long n = a.size();
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long start = (unsigned long long)blockIdx.x * blockDim.x;
    const auto check = [&](unsigned long long i, unsigned long long v) {
        atomicAdd(out + 2, 1ull);
        if (v != gpuio_array_expected(i, seed, every, written)) {
            atomicAdd(out, 1ull);
            atomicMin(out + 1, i);
        }
    };
    const auto index = [&](unsigned long long k) { return gpuio_mix64(salt ^ k) % n; };
    if (((start + threadIdx.x) / 32u) % 2u == 0u) {
        for (unsigned long long base = start; base < reads; base += stride) {
            const unsigned long long k = base + threadIdx.x;
            const int mine = k < reads;
            const unsigned long long i = mine ? index(k) : 0ull;
            const unsigned long long v = a.get(i);
            if (mine) check(i, v);
        }
        return;
    }
    // A warp-uniform trip count; a lane past the end asks for element 0 and checks nothing.
    unsigned long long k = start + threadIdx.x;
    gpuio_array_future<unsigned long long> ahead = a.get_async(k < reads ? index(k) : 0ull);
    for (unsigned long long base = start; base < reads; base += stride) {
        const unsigned long long next = base + stride < reads ? k + stride : reads;
        const unsigned long long v = a.wait(ahead);
        const unsigned long long i = ahead.index;
        ahead = a.get_async(next < reads ? index(next) : 0ull);
        if (k < reads) check(i, v);
        k = next;
    }
    a.wait(ahead);
}

// Stores word i of pattern `written` at every element i that is a multiple of `every`.
extern "C" __global__ void gpuio_array_test_store(gpuio_array_desc d, unsigned long long every,
                                                  unsigned long long written) {
    const gpuio_array<unsigned long long> a(d);
    const unsigned long long count = (a.size() + every - 1ull) / every;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long start = (unsigned long long)blockIdx.x * blockDim.x;
    for (unsigned long long base = start; base < count; base += stride) {
        const unsigned long long k = base + threadIdx.x;
        if (k < count) a.store(k * every, gpuio_word_at(written, k * every));
    }
}

// The constants of gpuio_hal::ondemand::constants(), in its order, as this compiler sees them.
extern "C" __global__ void gpuio_array_layout(unsigned long long* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned int i = 0;
    out[i++] = GPUIO_ARRAY_VERSION;
    out[i++] = GPUIO_PAGE_PIN_ONE;
    out[i++] = GPUIO_PAGE_PIN_MASK;
    out[i++] = GPUIO_PAGE_DIRTY;
    out[i++] = GPUIO_PAGE_STATE_SHIFT;
    out[i++] = GPUIO_FRAME_LOCKED;
    out[i++] = GPUIO_FRAME_OWNED;
    out[i++] = GPUIO_FRAME_SLOT_SHIFT;
    out[i++] = GPUIO_ARRAY_MAX_ARRAYS;
    out[i++] = GPUIO_STAT_STRIPES;
    out[i++] = GPUIO_STAT_WORDS;
    out[i++] = sizeof(gpuio_array_slot);
    out[i++] = sizeof(gpuio_cache);
    out[i++] = sizeof(gpuio_array_desc);
    out[i++] = sizeof(gpuio_resident_desc);
    out[i++] = gpuio_latency_bucket(1000ull);
    out[i++] = gpuio_latency_bucket(123456789ull);
}

// ---- Benchmark kernels (`gpuio bench ondemand`) ------------------------------------------------

// Rows of `row_words` u64s: row rows[k] of the array into out + k * row_words, a thread per row
// (a warp has 32 rows' misses in flight).
extern "C" __global__ void gpuio_array_bench_rows(gpuio_array_desc d,
                                                  const unsigned long long* rows,
                                                  unsigned long long n,
                                                  unsigned long long row_words,
                                                  unsigned long long* out) {
    const gpuio_array<unsigned long long> a(d);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long start = (unsigned long long)blockIdx.x * blockDim.x;
    // A warp-uniform trip count: every lane reaches each collective call.
    for (unsigned long long base = start; base < n; base += stride) {
        const unsigned long long k = base + threadIdx.x;
        const int mine = k < n;
        a.read_each(mine ? rows[k] * row_words : 0ull, mine ? row_words : 0ull,
                    out + (mine ? k : 0ull) * row_words);
    }
}

// Random u64 elements: out[k] = a[idx[k]] (one thread per element).
extern "C" __global__ void gpuio_array_bench_elements(gpuio_array_desc d,
                                                      const unsigned long long* idx,
                                                      unsigned long long n,
                                                      unsigned long long* out) {
    const gpuio_array<unsigned long long> a(d);
    a.gather(idx, out, n);
}

// Random 4-byte elements (a float feature, an embedding id): out[k] = a[idx[k]].
extern "C" __global__ void gpuio_array_bench_words(gpuio_array_desc d,
                                                   const unsigned long long* idx,
                                                   unsigned long long n, unsigned int* out) {
    const gpuio_array<unsigned int> a(d);
    a.gather(idx, out, n);
}

// The same reads from memory the kernel reads directly (a device array, or managed memory
// whose first touch migrates it); an index past `len` reads 0.
extern "C" __global__ void gpuio_plain_bench_words(const unsigned int* src, unsigned long long len,
                                                   const unsigned long long* idx,
                                                   unsigned long long n, unsigned int* out) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += stride) {
        const unsigned long long i = idx[k];
        out[k] = i < len ? src[i] : 0u;
    }
}

// The same reads from a plain device array of `len` elements (the hit path's peer); an index
// past it reads 0.
extern "C" __global__ void gpuio_plain_bench_elements(const unsigned long long* src,
                                                      unsigned long long len,
                                                      const unsigned long long* idx,
                                                      unsigned long long n,
                                                      unsigned long long* out) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += stride) {
        const unsigned long long i = idx[k];
        out[k] = i < len ? src[i] : 0ull;
    }
}

// The same reads from a resident array (the hit path without pins).
extern "C" __global__ void gpuio_resident_bench_elements(gpuio_resident_desc d,
                                                         const unsigned long long* idx,
                                                         unsigned long long n,
                                                         unsigned long long* out) {
    const gpuio_resident_array<unsigned long long> a(d);
    a.gather(idx, out, n);
}
