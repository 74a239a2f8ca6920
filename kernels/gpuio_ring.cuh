// gpuio request ring, device side: GPU threads post IO requests (resource handle, offset,
// length, device address) into a ring in mapped pinned host memory; gpuio's host proxy
// (gpuio_core::ring::RingProxy) carries them out through its engines and publishes completions
// that the threads poll.
//
// The layout and constants mirror crates/gpuio-ring/src/layout.rs (`#[repr(C)]` RingHeader,
// RingSlot, RingDevice); both sides check sizes and offsets (static_assert here, offsets only
// where the compiler has offsetof, which NVRTC lacks; const asserts there; and the
// gpuio_ring_layout kernel of ring_layout.cu compared with gpuio_hal::ring::layout() on the GPU
// machine). Change both together and bump GPUIO_RING_VERSION.
//
// Protocol (no GPU atomics on host memory: PCIe does not make them atomic):
// - post: claim ticket t with one warp-aggregated atomicAdd on a counter in device memory;
//   wait until the slot's free turn (device memory, beside the counter: only producers free
//   slots, so the check stays on the GPU) equals t (the ring is full meanwhile) or the ring is
//   no longer OPEN (then the request is refused with GPUIO_ERROR_RING_SHUTDOWN); write the
//   request fields, store status = POSTED | t << 8 (release: the fields before it).
// - the host consumer of ticket t sees exactly POSTED | t << 8 (a POSTED of an earlier lap
//   carries that lap's ticket), copies the request, carries it out, and stores status = DONE*
//   with the result in the same word (release; an inline completion's bytes before it).
// - poll: one 16-byte load of (status, inline bytes); when the state is DONE* (then an
//   acquire fence) the result and any inline bytes are in hand. No lap check: this thread
//   stored this lap's POSTED itself and no later lap posts before it frees the slot. Free
//   the slot for the next lap: free turn = t + nslots (release, device memory). If the ring
//   is CLOSED and the slot is not DONE*, the request was never served:
//   GPUIO_ERROR_RING_SHUTDOWN (the ring's state is read every 16th failed poll: a PCIe round
//   trip of its own).
//
// Rules for callers:
// - Needs sm_70 or newer (independent thread scheduling lets lanes of one warp wait for each
//   other's slots; acquire/release PTX). Older architectures compile a fallback but may hang.
// - Every posted token must be waited for (gpuio_wait, or gpuio_poll until it returns 1): its
//   slot is freed only then. A thread must not post while it holds tokens it has not waited
//   for, unless the whole grid's outstanding requests fit in the ring (nslots): a post that
//   waits for a full ring waits for other threads' tokens to be collected, and two threads
//   waiting for each other's slots never finish.
// - The ring's memory must outlive the kernels using it. Shutting the proxy down releases
//   every waiting thread (refused posts, shutdown results).
// - Destinations (READ) and sources (WRITE) must lie inside one device buffer registered with
//   the proxy; otherwise the request completes with GPUIO_ERROR_RING_UNREGISTERED and no byte
//   is read or written.
// - Results are bytes moved (>= 0, always the full length on success) or a negative code:
//   GPUIO_ERROR_* (-1 .. -11, docs/REFERENCE.md#error-codes) or one of the two ring codes below.
//
// Built without include paths or standard headers (nvcc ahead of time to PTX, NVRTC at run time
// as the fallback): gpuio puts this text before the sources that use it, so every
// `#include "gpuio_ring.cuh"` sits inside #ifndef GPUIO_RING_CUH.
#ifndef GPUIO_RING_CUH
#define GPUIO_RING_CUH

// ---- Constants (same values as crates/gpuio-ring/src/layout.rs) -------------------------

#define GPUIO_RING_MAGIC 0x4F495047u
#define GPUIO_RING_VERSION 2u

// gpuio_ring_header.state
#define GPUIO_RING_OPEN 0u
#define GPUIO_RING_STOPPING 1u
#define GPUIO_RING_CLOSED 2u

// gpuio_ring_slot.status: the state in the low GPUIO_SLOT_STATE_BITS bits, the result (bytes
// moved or a negative code) above them, so one store publishes a completion.
#define GPUIO_SLOT_STATE_BITS 8u
#define GPUIO_SLOT_FREE 0u
#define GPUIO_SLOT_POSTED 1u
// Done; the bytes (if any) are at their destination.
#define GPUIO_SLOT_DONE 2u
// A staged READ of at most 8 bytes is done and its bytes travel in the slot's inline_bytes
// word, read with the status (no second read of host memory).
#define GPUIO_SLOT_DONE_INLINE 3u
// A staged READ is done and its bytes are in the slot's bounce buffer.
#define GPUIO_SLOT_DONE_BOUNCE 4u
// A producer's inline_bytes marker is this times (ticket + 1): see gpuio_ring_inline_marker.
#define GPUIO_RING_INLINE_MARKER 0x9E3779B97F4A7C15ull

// gpuio_ring_slot.op
#define GPUIO_RING_OP_READ 1u
#define GPUIO_RING_OP_WRITE 2u

// gpuio_ring_slot.flags: a WRITE to a file reaches stable storage before it completes.
#define GPUIO_RING_FLAG_DURABLE 1u
// gpuio_ring_slot.flags: a READ may be delivered into the slot's bounce buffer (pinned host
// memory); the waiting thread then copies it to its destination (no DMA per request). A WRITE's
// bytes are in the bounce buffer already (the posting thread put them there).
#define GPUIO_RING_FLAG_STAGE 2u

// Error results: gpuio's error codes (docs/REFERENCE.md#error-codes) and two of the ring's own.
#ifndef GPUIO_ERROR_GENERAL
#define GPUIO_ERROR_GENERAL (-1ll)
#define GPUIO_ERROR_NOMEM (-2ll)
#define GPUIO_ERROR_INVALID_ARG (-3ll)
#define GPUIO_ERROR_NOT_FOUND (-4ll)
#define GPUIO_ERROR_TIMEOUT (-5ll)
#define GPUIO_ERROR_IO (-6ll)
#define GPUIO_ERROR_NETWORK (-7ll)
#define GPUIO_ERROR_UNSUPPORTED (-8ll)
#define GPUIO_ERROR_PERMISSION (-9ll)
#define GPUIO_ERROR_BUSY (-10ll)
#define GPUIO_ERROR_CANCELED (-11ll)
#endif
// The device range is not inside one registered device buffer (nothing was touched).
#define GPUIO_ERROR_RING_UNREGISTERED (-64ll)
// The ring shut down before the request was served (or it was refused when posted).
#define GPUIO_ERROR_RING_SHUTDOWN (-65ll)

// ---- Shared layout ---------------------------------------------------------------------------

// The ring's first cache line. Only the host writes it (state, at shutdown); the GPU polls it.
struct __align__(64) gpuio_ring_header {
    unsigned int magic;    // GPUIO_RING_MAGIC
    unsigned int version;  // GPUIO_RING_VERSION
    unsigned int slots;    // number of slots (a power of two)
    unsigned int state;    // GPUIO_RING_OPEN / STOPPING / CLOSED
    unsigned int reserved[12];
};

// One request slot, a cache line of its own. The status and the inline bytes come first, in
// one aligned 16 bytes, so that a completion is polled with one load.
struct __align__(64) gpuio_ring_slot {
    unsigned long long status;        // GPUIO_SLOT_* | result << GPUIO_SLOT_STATE_BITS
    unsigned long long inline_bytes;  // a DONE_INLINE completion's bytes
    unsigned long long turn;          // the ticket posted in the slot (diagnostics)
    unsigned int op;                  // GPUIO_RING_OP_READ / WRITE
    unsigned int resource;            // resource handle registered with the proxy
    unsigned int flags;               // GPUIO_RING_FLAG_*
    unsigned int reserved;
    unsigned long long offset;    // byte offset in the resource
    unsigned long long len;       // bytes
    unsigned long long dev_addr;  // destination (READ) or source (WRITE) in device memory
};

// What a kernel receives (by value) to reach a ring: gpuio_hal::ring::RingDevice.
struct gpuio_ring {
    gpuio_ring_header* header;  // mapped host memory
    gpuio_ring_slot* slots;     // mapped host memory, right after the header
    // Producers' memory, on the device: claim[0] the ticket counter (starts at 0), claim[1 + i]
    // slot i's free turn, the ticket that may post in it next (starts at i).
    unsigned long long* claim;
    unsigned int mask;          // nslots - 1
    unsigned int nslots;
    unsigned char* bounce;      // slot 0's bounce buffer (mapped host memory), or null
    unsigned long long bounce_bytes;  // bytes per slot's bounce buffer (0: none)
};

// One posted request, owned by the thread that posted it.
struct gpuio_token {
    unsigned long long ticket;
    long long result;   // valid once done
    unsigned int done;   // 1 once the outcome is known (completed, refused or shut down)
    unsigned int polls;  // polls that found it pending (the ring's state is read every 16th)
    unsigned long long dev_addr;  // the request's device address (a staged read lands there)
};

// Sizes are checked by every compiler. Offsets are checked where the compiler has offsetof
// (nvcc, host compilers); NVRTC has none, so there the gpuio_ring_layout kernel of
// ring_layout.cu reports them at run time for the GPU test to compare.
static_assert(sizeof(gpuio_ring_header) == 64, "gpuio_ring_header size");
static_assert(alignof(gpuio_ring_header) == 64, "gpuio_ring_header alignment");
static_assert(sizeof(gpuio_ring_slot) == 64, "gpuio_ring_slot size");
static_assert(alignof(gpuio_ring_slot) == 64, "gpuio_ring_slot alignment");
static_assert(sizeof(gpuio_ring) == 48, "gpuio_ring size");
static_assert(sizeof(gpuio_token) == 32, "gpuio_token size");

#ifndef __CUDACC_RTC__
#define GPUIO_RING_OFFSETOF(T, F) __builtin_offsetof(T, F)
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_header, magic) == 0, "header.magic");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_header, version) == 4, "header.version");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_header, slots) == 8, "header.slots");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_header, state) == 12, "header.state");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_header, reserved) == 16, "header.reserved");

static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, status) == 0, "slot.status");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, inline_bytes) == 8, "slot.inline_bytes");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, turn) == 16, "slot.turn");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, op) == 24, "slot.op");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, resource) == 28, "slot.resource");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, flags) == 32, "slot.flags");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, offset) == 40, "slot.offset");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, len) == 48, "slot.len");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring_slot, dev_addr) == 56, "slot.dev_addr");

static_assert(GPUIO_RING_OFFSETOF(gpuio_ring, header) == 0, "ring.header");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring, slots) == 8, "ring.slots");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring, claim) == 16, "ring.claim");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring, mask) == 24, "ring.mask");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring, nslots) == 28, "ring.nslots");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring, bounce) == 32, "ring.bounce");
static_assert(GPUIO_RING_OFFSETOF(gpuio_ring, bounce_bytes) == 40, "ring.bounce_bytes");
#endif  // __CUDACC_RTC__

// ---- System-scope loads and stores -----------------------------------------------------------

// Every read of host memory is a PCIe round trip (~1 us), so a completion is polled with one
// 16-byte load of a slot's (status, inline_bytes). Each word is read whole; the pair is not
// one atomic read, so the inline word may be older than the status beside it. The producer's
// marker makes that visible (see gpuio_ring_arrived): a word that is not the marker is the
// consumer's bytes, and one that is gets read again after the acquire fence.
__device__ __forceinline__ void gpuio_ring_ld_pair(const void* p, unsigned long long* a,
                                                   unsigned long long* b) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];"
                 : "=l"(*a), "=l"(*b)
                 : "l"(p)
                 : "memory");
}

// Orders the loads and stores after it after the loads before it (the acquire half of a
// message from the host: a load that saw the host's release, then this). An acquire-release
// fence, not __threadfence_system's sequentially consistent one: nothing here needs a total
// order across locations, and each .sys fence may wait for the GPU's writes to host memory.
__device__ __forceinline__ void gpuio_ring_fence_acquire() {
#if __CUDA_ARCH__ >= 700
    asm volatile("fence.acq_rel.sys;" ::: "memory");
#else
    __threadfence_system();
#endif
}

// The free turns live in device memory and only GPU threads use them: gpu-scope acquire and
// release, no PCIe.
__device__ __forceinline__ unsigned long long gpuio_ring_ld_acquire_gpu64(
    const unsigned long long* p) {
    unsigned long long v;
#if __CUDA_ARCH__ >= 700
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
#else
    v = *(const volatile unsigned long long*)p;
    __threadfence();
#endif
    return v;
}

__device__ __forceinline__ void gpuio_ring_st_release_gpu64(unsigned long long* p,
                                                             unsigned long long v) {
#if __CUDA_ARCH__ >= 700
    asm volatile("st.release.gpu.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
#else
    __threadfence();
    *(volatile unsigned long long*)p = v;
#endif
}

__device__ __forceinline__ unsigned int gpuio_ring_ld_acquire32(const unsigned int* p) {
    unsigned int v;
#if __CUDA_ARCH__ >= 700
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#else
    v = *(const volatile unsigned int*)p;
    __threadfence_system();
#endif
    return v;
}

// A status word's POSTED store: the release orders the request's fields before it.
__device__ __forceinline__ void gpuio_ring_st_release_sys64(unsigned long long* p,
                                                             unsigned long long v) {
#if __CUDA_ARCH__ >= 700
    asm volatile("st.release.sys.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
#else
    __threadfence_system();
    *(volatile unsigned long long*)p = v;
#endif
}

// Waits a little longer each time (up to ~8 us), so that thousands of waiting threads do not
// saturate PCIe with polls of host memory.
__device__ __forceinline__ void gpuio_ring_backoff(unsigned int* ns) {
#if __CUDA_ARCH__ >= 700
    __nanosleep(*ns);
#endif
    // Capped at 256 ns: a poll of host memory is a PCIe round trip (~1 us) already, and every
    // extra nanosecond of sleep adds to the request's round trip.
    if (*ns < 256u) *ns *= 2u;
}

__device__ __forceinline__ unsigned int gpuio_ring_lane_id() {
    unsigned int lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
}

__device__ __forceinline__ unsigned int gpuio_ring_lanemask_lt() {
    unsigned int mask;
    asm volatile("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
    return mask;
}

__device__ __forceinline__ unsigned long long gpuio_ring_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---- Producer API ----------------------------------------------------------------------------

// Claims one ticket per calling thread with a single atomicAdd per warp: the active lanes elect
// a leader that adds their count, and each lane takes base + its rank among them.
__device__ __forceinline__ unsigned long long gpuio_ring_claim(const gpuio_ring* r) {
    const unsigned int active = __activemask();
    const int leader = __ffs(active) - 1;
    const unsigned int rank = __popc(active & gpuio_ring_lanemask_lt());
    unsigned long long base = 0;
    if ((int)gpuio_ring_lane_id() == leader) {
        base = atomicAdd(r->claim, (unsigned long long)__popc(active));
    }
    base = __shfl_sync(active, base, leader);
    return base + rank;
}

// What a producer stores in its slot's inline_bytes when it posts: an inline completion's
// bytes that differ from it cannot be an earlier lap's (see gpuio_ring_arrived).
__device__ __forceinline__ unsigned long long gpuio_ring_inline_marker(unsigned long long t) {
    return GPUIO_RING_INLINE_MARKER * (t + 1ull);
}

// Writes a request into the slot of ticket `tok->ticket` if that slot is free for it: 1 when
// posted, 0 when the slot is still busy with an earlier lap (try again), or
// GPUIO_ERROR_RING_SHUTDOWN when the ring is no longer open (nothing posted; `tok` then holds
// that result). Never waits.
__device__ __forceinline__ long long gpuio_ring_try_post(const gpuio_ring* r, gpuio_token* tok,
                                                         unsigned int op, unsigned int resource,
                                                         unsigned int flags,
                                                         unsigned long long offset,
                                                         unsigned long long len,
                                                         const unsigned char* stage_from = 0) {
    const unsigned long long t = tok->ticket;
    gpuio_ring_slot* s = r->slots + (t & r->mask);
    // The slot's free turn first, in device memory (L2, no PCIe): free when it is this
    // ticket's. A ring that stopped meanwhile is found by the waiter: the host writes nothing
    // after CLOSED, and a request still POSTED then is reported shut down.
    if (gpuio_ring_ld_acquire_gpu64(r->claim + 1 + (t & r->mask)) != t) {
        // A full ring: the ring's state costs a PCIe round trip, so every 16th try only.
        if ((++tok->polls & 15u) == 0u &&
            gpuio_ring_ld_acquire32(&r->header->state) != GPUIO_RING_OPEN) {
            tok->result = GPUIO_ERROR_RING_SHUTDOWN;
            tok->done = 1u;
            return GPUIO_ERROR_RING_SHUTDOWN;
        }
        return 0;
    }
    if (stage_from) {
        // A staged WRITE: its bytes go into the slot's bounce buffer before the post (stores
        // to mapped host memory are posted writes: no round trip each).
        unsigned char* to = r->bounce + (t & r->mask) * r->bounce_bytes;
        if ((((unsigned long long)stage_from | (unsigned long long)to | len) & 15ull) == 0) {
            for (unsigned long long i = 0; i < len / 16; i++) {
                ((uint4*)to)[i] = ((const uint4*)stage_from)[i];
            }
        } else {
            for (unsigned long long i = 0; i < len; i++) to[i] = stage_from[i];
        }
    }
    volatile gpuio_ring_slot* v = s;
    v->op = op;
    v->resource = resource;
    v->flags = flags;
    v->offset = offset;
    v->len = len;
    v->dev_addr = tok->dev_addr;
    v->turn = t;
    v->inline_bytes = gpuio_ring_inline_marker(t);
    // The release store orders the fields (and a staged WRITE's bytes) before POSTED, which
    // carries the ticket: the consumer of this ticket waits for exactly this word.
    gpuio_ring_st_release_sys64(&s->status, GPUIO_SLOT_POSTED | (t << GPUIO_SLOT_STATE_BITS));
    return 1;
}

// Claims a ticket for the calling thread into a fresh token for a request at `dev_addr`.
__device__ __forceinline__ void gpuio_ring_ticket(const gpuio_ring* r, gpuio_token* tok,
                                                  unsigned long long dev_addr) {
    tok->ticket = gpuio_ring_claim(r);
    tok->result = 0;
    tok->done = 0u;
    tok->polls = 0u;
    tok->dev_addr = dev_addr;
}

// Posts a request (op GPUIO_RING_OP_*, flags GPUIO_RING_FLAG_*). Waits while the ring is full.
// Returns 0 when posted, or GPUIO_ERROR_RING_SHUTDOWN when refused because the ring is not open
// (nothing posted; `tok` then holds that result, so gpuio_poll/gpuio_wait return it at once).
__device__ __forceinline__ long long gpuio_post(const gpuio_ring* r, unsigned int op,
                                                unsigned int resource, unsigned int flags,
                                                unsigned long long offset, unsigned long long len,
                                                unsigned long long dev_addr, gpuio_token* tok,
                                                const unsigned char* stage_from = 0) {
    gpuio_ring_ticket(r, tok, dev_addr);
    unsigned int ns = 32u;
    for (;;) {
        const long long posted =
            gpuio_ring_try_post(r, tok, op, resource, flags, offset, len, stage_from);
        if (posted != 0) return posted < 0 ? posted : 0;
        gpuio_ring_backoff(&ns);
    }
}

// Posts a READ: `len` bytes of `resource` from `offset` into device memory at `dst`.
__device__ __forceinline__ long long gpuio_read_async(const gpuio_ring* r, unsigned int resource,
                                                      unsigned long long offset,
                                                      unsigned long long len, void* dst,
                                                      gpuio_token* tok) {
    // Small enough for the slot's bounce buffer: the host delivers there and the waiting
    // thread copies, which spares the host a DMA and a driver call per request.
    const unsigned int flags = (r->bounce && len <= r->bounce_bytes) ? GPUIO_RING_FLAG_STAGE : 0u;
    return gpuio_post(r, GPUIO_RING_OP_READ, resource, flags, offset, len,
                      (unsigned long long)dst, tok);
}

// Posts a WRITE: `len` bytes of device memory at `src` to `resource` at `offset`. The bytes
// must be written (by every thread that wrote them) before the post. Small enough for the
// slot's bounce buffer, they are copied there by this thread and the host writes them from
// it: no DMA and no driver call on the host side, so nothing there waits for the device
// (whose kernels are running).
__device__ __forceinline__ long long gpuio_write_async(const gpuio_ring* r, unsigned int resource,
                                                       unsigned long long offset,
                                                       unsigned long long len, const void* src,
                                                       gpuio_token* tok) {
    const int stage = r->bounce && len <= r->bounce_bytes;
    return gpuio_post(r, GPUIO_RING_OP_WRITE, resource, stage ? GPUIO_RING_FLAG_STAGE : 0u,
                      offset, len, (unsigned long long)src, tok,
                      stage ? (const unsigned char*)src : (const unsigned char*)0);
}

// Copies a staged read from its bounce buffer (mapped host memory) to its destination. Plain
// loads are right here: they come after the system-scope acquire of DONE. Each is a PCIe round
// trip, so GPUIO_RING_COPY_INFLIGHT of them are issued before any is stored; 16-byte pieces
// where both ends allow, 8-byte ones next, bytes otherwise.
#define GPUIO_RING_COPY_INFLIGHT 8
template <typename T>
__device__ __forceinline__ void gpuio_ring_copy_pieces(const T* from, T* to,
                                                       unsigned long long n) {
    unsigned long long i = 0;
    for (; i + GPUIO_RING_COPY_INFLIGHT <= n; i += GPUIO_RING_COPY_INFLIGHT) {
        T v[GPUIO_RING_COPY_INFLIGHT];
#pragma unroll
        for (int k = 0; k < GPUIO_RING_COPY_INFLIGHT; k++) v[k] = from[i + k];
#pragma unroll
        for (int k = 0; k < GPUIO_RING_COPY_INFLIGHT; k++) to[i + k] = v[k];
    }
    for (; i < n; i++) to[i] = from[i];
}

__device__ __forceinline__ void gpuio_ring_copy_staged(const unsigned char* from,
                                                       unsigned char* to,
                                                       unsigned long long n) {
    const unsigned long long bits = (unsigned long long)from | (unsigned long long)to | n;
    if ((bits & 15ull) == 0) {
        gpuio_ring_copy_pieces((const uint4*)from, (uint4*)to, n / 16);
    } else if ((bits & 7ull) == 0) {
        gpuio_ring_copy_pieces((const unsigned long long*)from, (unsigned long long*)to, n / 8);
    } else {
        gpuio_ring_copy_pieces(from, to, n);
    }
}

// Where a completion's bytes are, besides the destination.
#define GPUIO_STAGED_NONE 0    // already at the destination (or none: an error)
#define GPUIO_STAGED_BOUNCE 1  // in the slot's bounce buffer
#define GPUIO_STAGED_INLINE 2  // in the slot's inline_bytes word (*inline_bytes)

// Whether the completion has arrived; then its result and where its bytes are (a
// GPUIO_STAGED_* value; inline ones are copied into *inline_bytes). The slot is not handed on
// (gpuio_ring_release does that).
__device__ __forceinline__ int gpuio_ring_arrived(const gpuio_ring* r, const gpuio_token* tok,
                                                  long long* result, int* staged,
                                                  unsigned long long* inline_bytes) {
    const gpuio_ring_slot* s = r->slots + (tok->ticket & r->mask);
    unsigned long long status, word;
    gpuio_ring_ld_pair(&s->status, &status, &word);
    const unsigned int state = (unsigned int)(status & ((1ull << GPUIO_SLOT_STATE_BITS) - 1ull));
    if (state < GPUIO_SLOT_DONE || state > GPUIO_SLOT_DONE_BOUNCE) return 0;  // POSTED: not yet
    gpuio_ring_fence_acquire();
    const long long res = (long long)status >> GPUIO_SLOT_STATE_BITS;
    *result = res;
    *staged = GPUIO_STAGED_NONE;
    if (res > 0 && state == GPUIO_SLOT_DONE_INLINE) {
        // The word was loaded with the status, not after it: it is the producer's marker
        // (stored when this ticket posted, by this thread or one ordered before it) or the
        // consumer's bytes, the only later store before the
        // next lap. Bytes that happen to equal the marker are read again, after the fence.
        if (word == gpuio_ring_inline_marker(tok->ticket)) {
            word = *(const volatile unsigned long long*)&s->inline_bytes;
        }
        *staged = GPUIO_STAGED_INLINE;
        *inline_bytes = word;
    } else if (res > 0 && state == GPUIO_SLOT_DONE_BOUNCE) {
        *staged = GPUIO_STAGED_BOUNCE;
    }
    return 1;
}

// Stores the n (at most 8) bytes of an inline completion at `to`.
__device__ __forceinline__ void gpuio_ring_store_inline(unsigned char* to, unsigned long long word,
                                                        unsigned long long n) {
    if (n == 8 && ((unsigned long long)to & 7ull) == 0) {
        *(unsigned long long*)to = word;
        return;
    }
    for (unsigned long long i = 0; i < n && i < 8; i++) to[i] = (unsigned char)(word >> (8 * i));
}

// The slot's bounce buffer.
__device__ __forceinline__ const unsigned char* gpuio_ring_bounce(const gpuio_ring* r,
                                                                  const gpuio_token* tok) {
    return r->bounce + (tok->ticket & r->mask) * r->bounce_bytes;
}

// Hands the slot of a collected completion to the next lap: its free turn, in device memory.
// The release orders this thread's reads of the slot and its bounce buffer before the next
// lap's producer (a GPU thread, which acquires the free turn) writes them.
__device__ __forceinline__ void gpuio_ring_release(const gpuio_ring* r, gpuio_token* tok,
                                                   long long result) {
    gpuio_ring_st_release_gpu64(r->claim + 1 + (tok->ticket & r->mask), tok->ticket + r->nslots);
    tok->result = result;
    tok->done = 1u;
}

// Collects the completion if it has arrived: reads the result (copying staged bytes to their
// destination), frees the slot.
__device__ __forceinline__ int gpuio_ring_try_finish(const gpuio_ring* r, gpuio_token* tok) {
    long long result;
    int staged;
    unsigned long long word = 0;
    if (!gpuio_ring_arrived(r, tok, &result, &staged, &word)) return 0;
    if (staged == GPUIO_STAGED_INLINE) {
        gpuio_ring_store_inline((unsigned char*)tok->dev_addr, word, (unsigned long long)result);
    } else if (staged == GPUIO_STAGED_BOUNCE) {
        gpuio_ring_copy_staged(gpuio_ring_bounce(r, tok), (unsigned char*)tok->dev_addr,
                               (unsigned long long)result);
    }
    gpuio_ring_release(r, tok, result);
    return 1;
}

// Non-blocking: 1 when the request has finished (its result, bytes or a negative code, goes to
// *result when result is not null), 0 while it is pending. Polling a finished token again
// returns 1 and the same result.
__device__ __forceinline__ int gpuio_poll(const gpuio_ring* r, gpuio_token* tok,
                                          long long* result) {
    if (!tok->done && !gpuio_ring_try_finish(r, tok)) {
        // The ring's state costs a PCIe round trip of its own: read every 16th poll only.
        if ((++tok->polls & 15u) != 0u ||
            gpuio_ring_ld_acquire32(&r->header->state) != GPUIO_RING_CLOSED) {
            return 0;
        }
        // The host's final sweep happened before CLOSED: look once more, then it never comes.
        if (!gpuio_ring_try_finish(r, tok)) {
            tok->result = GPUIO_ERROR_RING_SHUTDOWN;
            tok->done = 1u;
        }
    }
    if (result) *result = tok->result;
    return 1;
}

// Waits for the request's result (bytes or a negative code). Ends when the host completes the
// request or the ring closes.
__device__ __forceinline__ long long gpuio_wait(const gpuio_ring* r, gpuio_token* tok) {
    long long result = 0;
    unsigned int ns = 32u;
    while (!gpuio_poll(r, tok, &result)) gpuio_ring_backoff(&ns);
    return result;
}

// Waits at most `timeout_ns` nanoseconds: 1 with *result set when finished, 0 when still
// pending (the token stays valid: wait again or poll later; it must still be collected).
__device__ __forceinline__ int gpuio_wait_for(const gpuio_ring* r, gpuio_token* tok,
                                              unsigned long long timeout_ns, long long* result) {
    const unsigned long long start = gpuio_ring_now_ns();
    unsigned int ns = 32u;
    while (!gpuio_poll(r, tok, result)) {
        if (gpuio_ring_now_ns() - start >= timeout_ns) return 0;
        gpuio_ring_backoff(&ns);
    }
    return 1;
}

// Blocking READ by one thread: bytes read (always len) or a negative code.
__device__ __forceinline__ long long gpuio_read(const gpuio_ring* r, unsigned int resource,
                                                unsigned long long offset,
                                                unsigned long long len, void* dst) {
    gpuio_token tok;
    gpuio_read_async(r, resource, offset, len, dst, &tok);
    return gpuio_wait(r, &tok);
}

// Blocking WRITE by one thread: bytes written (always len) or a negative code.
__device__ __forceinline__ long long gpuio_write(const gpuio_ring* r, unsigned int resource,
                                                 unsigned long long offset,
                                                 unsigned long long len, const void* src) {
    gpuio_token tok;
    gpuio_write_async(r, resource, offset, len, src, &tok);
    return gpuio_wait(r, &tok);
}

// Every active lane of a warp calls it; each lane with `mine` non-zero has `n` bytes at
// `from` (a bounce buffer whose completion it acquired) for `to`. The warp copies those
// blocks one after another, all lanes together: 16-byte pieces side by side, so that the PCIe
// reads of one block coalesce instead of one thread reading it piece after piece. Returns
// once every lane's stores are made (the caller fences where others must see them).
__device__ __forceinline__ void gpuio_ring_copy_blocks_warp(unsigned int active, int mine,
                                                            const unsigned char* from,
                                                            unsigned char* to,
                                                            unsigned long long n) {
    const unsigned int lanes = __popc(active);
    const unsigned int rank = __popc(active & gpuio_ring_lanemask_lt());
    // Each lane acquired its own completion; this orders every lane's loads after them.
    __syncwarp(active);
    for (unsigned int owners = __ballot_sync(active, mine); owners; owners &= owners - 1) {
        const int owner = __ffs(owners) - 1;
        const unsigned char* src8 =
            (const unsigned char*)__shfl_sync(active, (unsigned long long)from, owner);
        unsigned char* dst8 = (unsigned char*)__shfl_sync(active, (unsigned long long)to, owner);
        const unsigned long long len = __shfl_sync(active, n, owner);
        if ((((unsigned long long)src8 | (unsigned long long)dst8 | len) & 15ull) == 0) {
            // Every load is a PCIe round trip: each lane issues GPUIO_RING_COPY_INFLIGHT of
            // them before it stores any (a 4 KiB block is one round of the warp's loads, not
            // eight in a row), side by side across the lanes so that each round coalesces.
            const uint4* src = (const uint4*)src8;
            uint4* out = (uint4*)dst8;
            const unsigned long long pieces = len / 16;
            for (unsigned long long base = rank; base < pieces;
                 base += (unsigned long long)lanes * GPUIO_RING_COPY_INFLIGHT) {
                uint4 v[GPUIO_RING_COPY_INFLIGHT];
#pragma unroll
                for (int k = 0; k < GPUIO_RING_COPY_INFLIGHT; k++) {
                    const unsigned long long i = base + (unsigned long long)k * lanes;
                    if (i < pieces) v[k] = src[i];
                }
#pragma unroll
                for (int k = 0; k < GPUIO_RING_COPY_INFLIGHT; k++) {
                    const unsigned long long i = base + (unsigned long long)k * lanes;
                    if (i < pieces) out[i] = v[k];
                }
            }
        } else {
            for (unsigned long long i = rank; i < len; i += lanes) dst8[i] = src8[i];
        }
    }
    __syncwarp(active);
}

// Blocking READs by the active lanes of a warp whose `post` is non-zero (each its own range
// and destination), whose staged bytes all active lanes copy together: 16-byte pieces side by
// side, so that the PCIe reads of one block coalesce instead of one thread reading it piece
// after piece. Call it from every active lane; each posting lane gets its own result (bytes or
// a negative code), the others 0.
//
// The lanes go round together: post where the slot is free, look for completions, copy the
// blocks that arrived, free their slots. No lane holds a slot while it waits for another lane,
// so any number of threads may call it on a ring of any size (a lane that kept its completed
// slot until its neighbours had posted could wait for slots that lanes of other warps keep
// the same way).
__device__ __forceinline__ long long gpuio_read_each_warp_if(const gpuio_ring* r, int post,
                                                             unsigned int resource,
                                                             unsigned long long offset,
                                                             unsigned long long len, void* dst) {
    const unsigned int active = __activemask();
    gpuio_token tok;
    tok.dev_addr = (unsigned long long)dst;
    if (post) gpuio_ring_ticket(r, &tok, (unsigned long long)dst);
    // Small enough for the slot's bounce buffer: delivered there and copied by the warp.
    const unsigned int flags = (r->bounce && len <= r->bounce_bytes) ? GPUIO_RING_FLAG_STAGE : 0u;
    long long result = 0;
    int pending = post, posted = 0;
    unsigned int ns = 32u;
    while (__any_sync(active, pending)) {
        int arrived = 0, staged = GPUIO_STAGED_NONE;
        unsigned long long word = 0;
        if (pending && !posted) {
            const long long p =
                gpuio_ring_try_post(r, &tok, GPUIO_RING_OP_READ, resource, flags, offset, len);
            if (p < 0) {
                result = p;
                pending = 0;
            }
            posted = p > 0;
        }
        if (pending && posted) {
            arrived = gpuio_ring_arrived(r, &tok, &result, &staged, &word);
            // The ring's state costs a PCIe round trip of its own: read every 16th poll only.
            if (!arrived && (++tok.polls & 15u) == 0u &&
                gpuio_ring_ld_acquire32(&r->header->state) == GPUIO_RING_CLOSED) {
                // The host's final sweep happened before CLOSED: look once more.
                arrived = gpuio_ring_arrived(r, &tok, &result, &staged, &word);
                if (!arrived) {
                    result = GPUIO_ERROR_RING_SHUTDOWN;
                    pending = 0;
                }
            }
        }
        if (staged == GPUIO_STAGED_INLINE) {
            gpuio_ring_store_inline((unsigned char*)tok.dev_addr, word,
                                    (unsigned long long)result);
        }
        const int bounced = staged == GPUIO_STAGED_BOUNCE;
        gpuio_ring_copy_blocks_warp(active, bounced,
                                    bounced ? gpuio_ring_bounce(r, &tok) : (const unsigned char*)0,
                                    (unsigned char*)tok.dev_addr, (unsigned long long)result);
        if (arrived) {
            gpuio_ring_release(r, &tok, result);
            pending = 0;
        }
        if (pending) gpuio_ring_backoff(&ns);
    }
    return result;
}

// Blocking READs, one per active lane of a warp (each lane its own range and destination),
// copied together as gpuio_read_each_warp_if does. Call it from every active lane; each lane
// gets its own result (bytes or a negative code).
__device__ __forceinline__ long long gpuio_read_each_warp(const gpuio_ring* r,
                                                          unsigned int resource,
                                                          unsigned long long offset,
                                                          unsigned long long len, void* dst) {
    return gpuio_read_each_warp_if(r, 1, resource, offset, len, dst);
}

// Pieces of a cooperative read are cut at multiples of this many bytes.
#define GPUIO_RING_WARP_PIECE 4096ull

// Blocking READ by the active lanes of a warp together: [offset, offset + len) of `resource`
// into `dst`, cut into one piece per lane (multiples of GPUIO_RING_WARP_PIECE) posted and
// waited for in parallel. Call it from every active lane; the lowest lane's arguments are used.
// Every lane returns the same value: len, or the first lane's negative code if any piece
// failed (other pieces may then have been read). len == 0 reads nothing and returns 0.
__device__ __forceinline__ long long gpuio_read_warp(const gpuio_ring* r, unsigned int resource,
                                                     unsigned long long offset,
                                                     unsigned long long len, void* dst) {
    const unsigned int active = __activemask();
    const int leader = __ffs(active) - 1;
    resource = __shfl_sync(active, resource, leader);
    offset = __shfl_sync(active, offset, leader);
    len = __shfl_sync(active, len, leader);
    const unsigned long long base = __shfl_sync(active, (unsigned long long)dst, leader);
    const unsigned int lanes = __popc(active);
    const unsigned int rank = __popc(active & gpuio_ring_lanemask_lt());
    unsigned long long piece = (len + lanes - 1) / lanes;
    piece = (piece + GPUIO_RING_WARP_PIECE - 1) / GPUIO_RING_WARP_PIECE * GPUIO_RING_WARP_PIECE;
    const unsigned long long begin = (unsigned long long)rank * piece;
    long long mine = 0;
    if (begin < len) {
        const unsigned long long n = len - begin < piece ? len - begin : piece;
        gpuio_token tok;
        gpuio_read_async(r, resource, offset + begin, n, (void*)(base + begin), &tok);
        mine = gpuio_wait(r, &tok);
    }
    __syncwarp(active);
    const unsigned int failed = __ballot_sync(active, mine < 0);
    if (failed) return __shfl_sync(active, mine, __ffs(failed) - 1);
    long long total = 0;
    for (unsigned int m = active; m != 0u; m &= m - 1u) {
        total += __shfl_sync(active, mine, __ffs(m) - 1);
    }
    return total;
}

#endif  // GPUIO_RING_CUH
