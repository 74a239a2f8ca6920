// Kernels that issue IO through the request ring, for gpuio's GPU tests and `gpuio bench ring`:
// many threads each reading blocks with gpuio_read, and one thread timing round trips.
#ifndef GPUIO_RING_CUH
#include "gpuio_ring.cuh"
#endif

#define GPUIO_RING_ARGS                                                                        \
    gpuio_ring_header *header, gpuio_ring_slot *slots, unsigned long long *claim,             \
        unsigned int mask, unsigned int nslots, unsigned char *bounce,                         \
        unsigned long long bounce_bytes
#define GPUIO_RING_MAKE gpuio_ring r = {header, slots, claim, mask, nslots, bounce, bounce_bytes};

// Block i of `n` (`block` bytes at offsets[i] of `resource`) into dst + i * block; its result
// (bytes or a negative GPUIO_ERROR_*) into results[i]. Every thread keeps one read in flight;
// each warp copies its lanes' staged blocks together (gpuio_read_each_warp).
extern "C" __global__ void gpuio_ring_read_blocks(GPUIO_RING_ARGS, unsigned int resource,
                                                  const unsigned long long* offsets,
                                                  unsigned long long n, unsigned long long block,
                                                  unsigned char* dst, long long* results) {
    GPUIO_RING_MAKE
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    // Warp-uniform trip count, so that every lane of a warp reaches each collective call.
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x;
    for (unsigned long long base = first; base < n; base += stride) {
        const unsigned long long i = base + threadIdx.x;
        if (i < n) {
            results[i] = gpuio_read_each_warp(&r, resource, offsets[i], block, dst + i * block);
        }
    }
}

// One thread: `iters` reads of `len` bytes at offset 0 of `resource` into dst, one at a time;
// ns[k] is the k-th round trip in nanoseconds (post to result), or ~0 if it failed.
extern "C" __global__ void gpuio_ring_ping(GPUIO_RING_ARGS, unsigned int resource,
                                           unsigned long long iters, unsigned long long len,
                                           unsigned char* dst, unsigned long long* ns) {
    GPUIO_RING_MAKE
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    for (unsigned long long k = 0; k < iters; k++) {
        const unsigned long long t0 = gpuio_ring_now_ns();
        const long long res = gpuio_read(&r, resource, 0, len, dst);
        ns[k] = res < 0 ? ~0ull : gpuio_ring_now_ns() - t0;
    }
}
