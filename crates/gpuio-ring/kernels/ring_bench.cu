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

// One thread: `iters` reads of `len` bytes at offset 0 of `resource` into dst, one at a time,
// each timed by phase on the GPU's clock: ns[4k .. 4k + 4] are the nanoseconds from the k-th
// read's start to its ticket claimed, its request posted, its completion seen and its slot
// handed back (the round trip); all four ~0 if it failed. The steps are gpuio_read's.
extern "C" __global__ void gpuio_ring_ping(GPUIO_RING_ARGS, unsigned int resource,
                                           unsigned long long iters, unsigned long long len,
                                           unsigned char* dst, unsigned long long* ns) {
    GPUIO_RING_MAKE
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const unsigned int flags = (r.bounce && len <= r.bounce_bytes) ? GPUIO_RING_FLAG_STAGE : 0u;
    for (unsigned long long k = 0; k < iters; k++) {
        unsigned long long* t = ns + 4 * k;
        const unsigned long long t0 = gpuio_ring_now_ns();
        gpuio_token tok;
        gpuio_ring_ticket(&r, &tok, (unsigned long long)dst);
        t[0] = gpuio_ring_now_ns() - t0;
        long long posted;
        unsigned int wait_ns = 32u;
        while ((posted = gpuio_ring_try_post(&r, &tok, GPUIO_RING_OP_READ, resource, flags, 0ull,
                                             len)) == 0) {
            gpuio_ring_backoff(&wait_ns);
        }
        t[1] = gpuio_ring_now_ns() - t0;
        long long res = posted < 0 ? posted : 0;
        int staged = GPUIO_STAGED_NONE, arrived = 0;
        unsigned long long word = 0ull;
        wait_ns = 32u;
        while (posted > 0 && !(arrived = gpuio_ring_arrived(&r, &tok, &res, &staged, &word))) {
            if ((++tok.polls & 15u) == 0u &&
                gpuio_ring_ld_acquire32(&r.header->state) == GPUIO_RING_CLOSED) {
                // The host's final sweep happened before CLOSED: look once more.
                arrived = gpuio_ring_arrived(&r, &tok, &res, &staged, &word);
                if (!arrived) res = GPUIO_ERROR_RING_SHUTDOWN;
                break;
            }
            gpuio_ring_backoff(&wait_ns);
        }
        t[2] = gpuio_ring_now_ns() - t0;
        if (arrived) {
            if (staged == GPUIO_STAGED_INLINE) {
                gpuio_ring_store_inline(dst, word, (unsigned long long)res);
            } else if (staged == GPUIO_STAGED_BOUNCE) {
                gpuio_ring_copy_staged(gpuio_ring_bounce(&r, &tok), dst, (unsigned long long)res);
            }
            gpuio_ring_release(&r, &tok, res);
        }
        t[3] = gpuio_ring_now_ns() - t0;
        if (res < 0) t[0] = t[1] = t[2] = t[3] = ~0ull;
    }
}
