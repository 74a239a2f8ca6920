// gpuio on-demand arrays, device side: gpuio_array<T> indexes an array bigger than GPU memory
// (a file, host or CXL memory, a remote export) through a page cache in GPU memory. A miss is
// read through the request ring (gpuio_ring.cuh) by one thread of the warps that want the page,
// however many there are; hits touch only the page table and the frame.
//
// The layout and constants mirror crates/gpuio-ring/src/ondemand/layout.rs and the protocol its
// mod.rs documents (HostAccessor in twin.rs follows it on host threads for CI). Change both
// together and bump GPUIO_ARRAY_VERSION.
//
// Why one long header: every path below (hit, miss, eviction, write-back, futures, resident
// reads) moves the same page-entry state machine, and a reviewer checks it against its Rust
// twin transition by transition; split, the transitions of one state would sit in different
// files, and the NVRTC fallback and `cargo xtask ptx` would have one more header to keep in
// order.
//
// Rules for callers:
// - Needs sm_70 or newer (acquire/release atomics, independent thread scheduling).
// - Every access is warp-cooperative over the lanes active at the call (as
//   gpuio_read_each_warp is): call get/store/gather from converged code, not from a lane
//   waiting for another lane of its warp.
// - A failed access (an index past the end, a store to a read-only array, a failed read or
//   write-back, no free frame) returns T() and records the first error in the array's slot;
//   the host reads it after the kernel (OnDemandArray::check), so failures never pass as data.
// - Stores to one element from two threads race as they would in a plain array.
// - get_async/wait (issue, compute, wait): every future is waited for; a thread holds one
//   future at a time (several only where the grid's outstanding futures fit the ring's
//   slots); between the two a thread touches no array or ring and waits at no barrier for
//   threads that do (a future holds a ring slot meanwhile).
// - gpuio_resident_array<T> (a read-only array held in the cache by the host,
//   OnDemandArray::resident): plain reads through an immutable frame table, no pins; valid
//   only while the host's ResidentArray lives.
#ifndef GPUIO_ARRAY_CUH
#define GPUIO_ARRAY_CUH

#ifndef GPUIO_RING_CUH
#include "gpuio_ring.cuh"
#endif

#define GPUIO_ARRAY_VERSION 4u

// Page-table entry (one u64 per page). The frame bits of an EMPTY page of an array that reads
// in place with admission on (gpuio_array_desc::admit_after) count its touches instead.
#define GPUIO_PAGE_FRAME_MASK 0xFFFFFFFFull
#define GPUIO_PAGE_PIN_ONE (1ull << 32)
#define GPUIO_PAGE_PIN_MASK (0xFFFFFFull << 32)
#define GPUIO_PAGE_DIRTY (1ull << 58)
#define GPUIO_PAGE_STATE_SHIFT 60
#define GPUIO_PAGE_STATE_MASK (3ull << 60)
#define GPUIO_PAGE_EMPTY 0ull
#define GPUIO_PAGE_FILLING 1ull
#define GPUIO_PAGE_VALID 2ull
#define GPUIO_PAGE_EVICTING 3ull

// Frame owner word (one u64 per frame).
#define GPUIO_FRAME_FREE 0ull
#define GPUIO_FRAME_LOCKED (1ull << 63)
#define GPUIO_FRAME_OWNED (1ull << 62)
#define GPUIO_FRAME_SLOT_SHIFT 48
#define GPUIO_FRAME_PAGE_MASK ((1ull << 48) - 1ull)

#define GPUIO_ARRAY_MAX_ARRAYS 64
#define GPUIO_ARRAY_LIVE 1u
#define GPUIO_ARRAY_WRITABLE 2u
// How long (ns) a miss looks for a frame before it gives up with GPUIO_ERROR_BUSY: frames
// locked by fills in progress come free as those finish, so only a cache whose every frame
// stays pinned runs into it.
#define GPUIO_ARRAY_NO_FRAME_NS 5000000000ull

// Statistics: per array, STAT_STRIPES stripes of 16 counters (two lines: the hit path's
// counters in the first), then the miss-latency histogram.
#define GPUIO_STAT_STRIPES 16
#define GPUIO_STAT_COUNTERS 16
#define GPUIO_STAT_HITS 0
#define GPUIO_STAT_MISSES 1
#define GPUIO_STAT_WAITS 2
#define GPUIO_STAT_EVICTIONS 3
#define GPUIO_STAT_WRITEBACKS 4
#define GPUIO_STAT_BYTES_IN 5
#define GPUIO_STAT_BYTES_OUT 6
#define GPUIO_STAT_FAILURES 7
#define GPUIO_STAT_DIRECT 8
#define GPUIO_STAT_BYTES_DIRECT 9
// What the bus moves at least per read in place: one 32-byte sector.
#define GPUIO_SECTOR_BYTES 32ull
#define GPUIO_STAT_BUCKETS 128
#define GPUIO_STAT_WORDS (GPUIO_STAT_STRIPES * GPUIO_STAT_COUNTERS + GPUIO_STAT_BUCKETS)

// One array's entry in the cache's slot table (gpuio_hal::ondemand::ArraySlot).
struct __align__(64) gpuio_array_slot {
    unsigned long long table;
    unsigned long long pages;
    unsigned long long bytes;
    unsigned int resource;
    unsigned int flags;
    long long error;
    // Write-backs of the array's pages begun (before each is posted) and ended (after each
    // completes, well or not): get_async trusts bytes it fetched without claiming their page
    // only if none was in flight when it posted the read and none began since.
    unsigned long long writebacks_begun;
    unsigned long long writebacks_ended;
    // Where kernels read the source in place (a read-only array over a file whose page cache
    // pages are pinned for the device): a miss is one copy by the warp, no ring round trip.
    // 0: misses go through the ring.
    unsigned long long direct;
};

// A page cache (gpuio_hal::ondemand::CacheDevice).
struct gpuio_cache {
    gpuio_ring ring;
    unsigned long long frames;
    unsigned long long owners;
    unsigned long long refs;
    unsigned long long slots;
    unsigned long long stats;
    unsigned long long clock;
    unsigned long long nframes;
    unsigned long long page_size;
    unsigned int page_shift;
    unsigned int version;
};

// One array (gpuio_hal::ondemand::ArrayDevice): what OnDemandArray::device() returns.
struct gpuio_array_desc {
    gpuio_cache cache;
    unsigned long long table;
    unsigned long long pages;
    unsigned long long bytes;
    unsigned int resource;
    unsigned int slot;
    unsigned int flags;
    // Reading in place (the slot's `direct`): touches of a page not cached, each served
    // from the source without the cache, before the next one brings the page in. 0: a miss
    // brings its page in at once.
    unsigned int admit_after;
};

static_assert(sizeof(gpuio_array_slot) == 64, "gpuio_array_slot size");
static_assert(sizeof(gpuio_cache) == 120, "gpuio_cache size");
static_assert(sizeof(gpuio_array_desc) == 160, "gpuio_array_desc size");
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(gpuio_array_slot, error) == 32, "slot.error");
static_assert(__builtin_offsetof(gpuio_array_slot, writebacks_begun) == 40, "slot.begun");
static_assert(__builtin_offsetof(gpuio_array_slot, writebacks_ended) == 48, "slot.ended");
static_assert(__builtin_offsetof(gpuio_array_slot, direct) == 56, "slot.direct");
static_assert(__builtin_offsetof(gpuio_cache, frames) == 48, "cache.frames");
static_assert(__builtin_offsetof(gpuio_cache, page_shift) == 112, "cache.page_shift");
static_assert(__builtin_offsetof(gpuio_array_desc, table) == 120, "array.table");
static_assert(__builtin_offsetof(gpuio_array_desc, resource) == 144, "array.resource");
static_assert(__builtin_offsetof(gpuio_array_desc, flags) == 152, "array.flags");
static_assert(__builtin_offsetof(gpuio_array_desc, admit_after) == 156, "array.admit_after");
#endif

// ---- Device-scope atomics with ordering (PTX, sm_70+) ----------------------------------------

__device__ __forceinline__ unsigned long long gpuio_atom_add(unsigned long long* p,
                                                            unsigned long long v) {
    unsigned long long old;
    asm volatile("atom.add.acq_rel.gpu.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

// A pin: what the pinning thread then reads of the frame is ordered after it (acquire); it
// publishes nothing itself, so it needs no release half (whose fence would wait for every
// earlier store of the thread on the hit path).
__device__ __forceinline__ unsigned long long gpuio_atom_add_acquire(unsigned long long* p,
                                                                    unsigned long long v) {
    unsigned long long old;
    asm volatile("atom.add.acquire.gpu.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ unsigned long long gpuio_atom_cas(unsigned long long* p,
                                                            unsigned long long cmp,
                                                            unsigned long long v) {
    unsigned long long old;
    asm volatile("atom.cas.acq_rel.gpu.b64 %0, [%1], %2, %3;"
                 : "=l"(old)
                 : "l"(p), "l"(cmp), "l"(v)
                 : "memory");
    return old;
}

__device__ __forceinline__ unsigned long long gpuio_atom_and(unsigned long long* p,
                                                            unsigned long long v) {
    unsigned long long old;
    asm volatile("atom.and.acq_rel.gpu.b64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ unsigned long long gpuio_atom_or(unsigned long long* p,
                                                           unsigned long long v) {
    unsigned long long old;
    asm volatile("atom.or.acq_rel.gpu.b64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ unsigned long long gpuio_ld_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void gpuio_st_release(unsigned long long* p, unsigned long long v) {
    asm volatile("st.release.gpu.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

// ---- The protocol -----------------------------------------------------------------------------

__device__ __forceinline__ unsigned long long gpuio_page_state(unsigned long long e) {
    return (e & GPUIO_PAGE_STATE_MASK) >> GPUIO_PAGE_STATE_SHIFT;
}

__device__ __forceinline__ unsigned long long* gpuio_array_entry(const gpuio_array_desc* a,
                                                                 unsigned long long page) {
    return (unsigned long long*)a->table + page;
}

__device__ __forceinline__ unsigned char* gpuio_frame(const gpuio_cache* c, unsigned int f) {
    return (unsigned char*)c->frames + ((unsigned long long)f << c->page_shift);
}

__device__ __forceinline__ unsigned long long* gpuio_array_stats(const gpuio_cache* c,
                                                                 unsigned int slot) {
    return (unsigned long long*)c->stats + (unsigned long long)slot * GPUIO_STAT_WORDS;
}

__device__ __forceinline__ void gpuio_array_count(const gpuio_cache* c, unsigned int slot,
                                                  int counter, unsigned long long n) {
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    atomicAdd(gpuio_array_stats(c, slot) + (sm % GPUIO_STAT_STRIPES) * GPUIO_STAT_COUNTERS +
                  counter,
              n);
}

// Adds the active lanes' `a` to counter `ca` and `b` to counter `cb`, one atomic per counter
// and warp (not one per lane: the hit path's counters would be its most contended lines).
__device__ __forceinline__ void gpuio_array_count_warp(const gpuio_cache* c, unsigned int slot,
                                                       unsigned int active, int ca,
                                                       unsigned int a, int cb, unsigned int b) {
#if __CUDA_ARCH__ >= 800
    a = __reduce_add_sync(active, a);
    b = __reduce_add_sync(active, b);
    if ((int)gpuio_ring_lane_id() != __ffs(active) - 1) return;
#endif
    if (a) gpuio_array_count(c, slot, ca, a);
    if (b) gpuio_array_count(c, slot, cb, b);
}

// The OR of the active lanes' `bits` (of which only the low `n` may be set).
__device__ __forceinline__ unsigned int gpuio_array_warp_or(unsigned int active,
                                                            unsigned int bits, int n) {
#if __CUDA_ARCH__ >= 800
    (void)n;
    return __reduce_or_sync(active, bits);
#else
    unsigned int all = 0u;
    for (int j = 0; j < n; j++) all |= (unsigned int)(__any_sync(active, bits >> j & 1u) != 0) << j;
    return all;
#endif
}

// Adds the active lanes' reads in place (`mine`: this lane's, of `len` bytes at address `at`)
// and the sectors they moved.
__device__ __forceinline__ void gpuio_array_count_in_place(const gpuio_cache* c,
                                                           unsigned int slot, unsigned int active,
                                                           int mine, unsigned long long at,
                                                           unsigned long long len) {
    const unsigned long long first = at / GPUIO_SECTOR_BYTES;
    const unsigned long long end = (at + len + GPUIO_SECTOR_BYTES - 1ull) / GPUIO_SECTOR_BYTES;
    const unsigned int bytes = mine ? (unsigned int)((end - first) * GPUIO_SECTOR_BYTES) : 0u;
    gpuio_array_count_warp(c, slot, active, GPUIO_STAT_DIRECT, mine ? 1u : 0u,
                           GPUIO_STAT_BYTES_DIRECT, bytes);
}

// Quarter-octave bucket of a latency in ns (gpuio_hal::ondemand::latency_bucket).
__device__ __forceinline__ unsigned int gpuio_latency_bucket(unsigned long long ns) {
    if (ns < 4ull) return (unsigned int)ns;
    const unsigned int msb = 63u - (unsigned int)__clzll((long long)ns);
    const unsigned int b = (msb - 1u) * 4u + (unsigned int)((ns >> (msb - 2u)) & 3ull);
    return b < GPUIO_STAT_BUCKETS ? b : GPUIO_STAT_BUCKETS - 1;
}

// Records the array's first error (the host reads and clears it).
__device__ __forceinline__ void gpuio_array_fail(const gpuio_cache* c, unsigned int slot,
                                                 long long code) {
    gpuio_array_slot* s = (gpuio_array_slot*)c->slots + slot;
    atomicCAS((unsigned long long*)&s->error, 0ull, (unsigned long long)code);
}

__device__ __forceinline__ void gpuio_frame_reference(const gpuio_cache* c, unsigned int f) {
    unsigned int* r = (unsigned int*)c->refs + f;
    if (*(volatile unsigned int*)r == 0u) *(volatile unsigned int*)r = 1u;
}

// Bytes of `page` in a source of `bytes` bytes.
__device__ __forceinline__ unsigned long long gpuio_page_len(const gpuio_cache* c,
                                                             unsigned long long bytes,
                                                             unsigned long long page) {
    const unsigned long long rest = bytes - (page << c->page_shift);
    return rest < c->page_size ? rest : c->page_size;
}

// Writes frame f, holding `page` of the array in slot `slot`, back to its source (one thread).
__device__ __forceinline__ long long gpuio_write_back(const gpuio_cache* c, unsigned int slot,
                                                      unsigned long long page, unsigned int f) {
    gpuio_array_slot* s = (gpuio_array_slot*)c->slots + slot;
    const unsigned long long len = gpuio_page_len(c, s->bytes, page);
    gpuio_atom_add(&s->writebacks_begun, 1ull);
    const long long res =
        gpuio_write(&c->ring, s->resource, page << c->page_shift, len, gpuio_frame(c, f));
    gpuio_atom_add(&s->writebacks_ended, 1ull);
    if (res < 0) {
        gpuio_array_count(c, slot, GPUIO_STAT_FAILURES, 1);
        gpuio_array_fail(c, slot, res);
    } else {
        gpuio_array_count(c, slot, GPUIO_STAT_WRITEBACKS, 1);
        gpuio_array_count(c, slot, GPUIO_STAT_BYTES_OUT, len);
    }
    return res;
}

// Evicts the page frame f (locked by this thread) holds: 1 done, 0 not now (or dirty, where
// `clean_only`), < 0 its write-back failed (the page stays cached and dirty).
__device__ __forceinline__ long long gpuio_evict(const gpuio_cache* c, unsigned int f,
                                                 unsigned long long owner, int clean_only) {
    const unsigned int slot = (unsigned int)((owner >> GPUIO_FRAME_SLOT_SHIFT) & 0xffull);
    const unsigned long long page = owner & GPUIO_FRAME_PAGE_MASK;
    const gpuio_array_slot* s = (const gpuio_array_slot*)c->slots + slot;
    if (!(s->flags & GPUIO_ARRAY_LIVE) || page >= s->pages) return 1;  // its array is gone
    unsigned long long* e = (unsigned long long*)s->table + page;
    const unsigned long long cur = gpuio_ld_acquire(e);
    if (gpuio_page_state(cur) != GPUIO_PAGE_VALID || (cur & GPUIO_PAGE_PIN_MASK) != 0ull ||
        (unsigned int)(cur & GPUIO_PAGE_FRAME_MASK) != f ||
        (clean_only && (cur & GPUIO_PAGE_DIRTY))) {
        return 0;
    }
    const unsigned long long evicting =
        (cur & ~GPUIO_PAGE_STATE_MASK) | (GPUIO_PAGE_EVICTING << GPUIO_PAGE_STATE_SHIFT);
    if (gpuio_atom_cas(e, cur, evicting) != cur) return 0;
    if (cur & GPUIO_PAGE_DIRTY) {
        const long long res = gpuio_write_back(c, slot, page, f);
        if (res < 0) {
            gpuio_atom_add(e, 0ull - ((GPUIO_PAGE_EVICTING - GPUIO_PAGE_VALID)
                                      << GPUIO_PAGE_STATE_SHIFT));
            return res;
        }
    }
    gpuio_atom_and(e, GPUIO_PAGE_PIN_MASK);
    gpuio_array_count(c, slot, GPUIO_STAT_EVICTIONS, 1);
    return 1;
}

// gpuio_try_take_frame found no frame this time: try again after the warp's round.
#define GPUIO_ARRAY_RETRY (-(1ll << 62))
// The round's lanes read their page in place, from the source, not through a frame.
#define GPUIO_ARRAY_IN_PLACE (-(1ll << 61))
// Frames the clock examines per try.
#define GPUIO_ARRAY_TRIES 128u

// A frame for `page` of the array in `slot`, locked and owned by it; GPUIO_ARRAY_RETRY when
// none came free in GPUIO_ARRAY_TRIES frames (the caller's warp goes on meanwhile: lanes that
// hold frames for their fills finish them, so nobody waits for a frame while its own warp
// holds one); or a negative code (a failed write-back, or none for GPUIO_ARRAY_NO_FRAME_NS
// since `since`). `clean_only`: no dirty victim (whose write-back needs a ring slot).
__device__ __forceinline__ long long gpuio_try_take_frame(const gpuio_cache* c, unsigned int slot,
                                                          unsigned long long page,
                                                          unsigned long long since,
                                                          int clean_only) {
    unsigned long long* clock = (unsigned long long*)c->clock;
    unsigned long long* owners = (unsigned long long*)c->owners;
    unsigned int* refs = (unsigned int*)c->refs;
    // The hand moves by the whole try at once: one atomic per try, not per frame (thousands
    // of lanes adding to one word one frame at a time made the clock the bottleneck).
    const unsigned long long hand = atomicAdd(clock, (unsigned long long)GPUIO_ARRAY_TRIES);
    for (unsigned int attempt = 0; attempt < GPUIO_ARRAY_TRIES; attempt++) {
        const unsigned int f = (unsigned int)((hand + attempt) % c->nframes);
        // CLOCK: a frame used since the hand last passed gets a second chance.
        if (*(volatile unsigned int*)(refs + f) != 0u) {
            *(volatile unsigned int*)(refs + f) = 0u;
            continue;
        }
        const unsigned long long cur = gpuio_ld_acquire(owners + f);
        if ((cur & GPUIO_FRAME_LOCKED) ||
            gpuio_atom_cas(owners + f, cur, cur | GPUIO_FRAME_LOCKED) != cur) {
            continue;
        }
        if (cur & GPUIO_FRAME_OWNED) {
            const long long ev = gpuio_evict(c, f, cur, clean_only);
            if (ev <= 0) {
                gpuio_st_release(owners + f, cur);
                if (ev < 0) return ev;
                continue;
            }
        }
        gpuio_st_release(owners + f, GPUIO_FRAME_LOCKED | GPUIO_FRAME_OWNED |
                                         ((unsigned long long)slot << GPUIO_FRAME_SLOT_SHIFT) |
                                         (page & GPUIO_FRAME_PAGE_MASK));
        return (long long)f;
    }
    if (gpuio_ring_now_ns() - since > GPUIO_ARRAY_NO_FRAME_NS) {
        gpuio_array_fail(c, slot, GPUIO_ERROR_BUSY);
        return GPUIO_ERROR_BUSY;
    }
    return GPUIO_ARRAY_RETRY;
}

// A lead lane's progress on a miss, kept across the rounds of its warp.
struct gpuio_miss {
    int frameless;             // it claimed the page (FILLING) and looks for a frame
    int waited;                // it found the page being filled or written back by another
    unsigned long long start;  // when it claimed the page (ns)
};

// Ends the fill of `page` into frame f (claimed FILLING, frame locked by this thread) once its
// bytes are in the frame (`res` >= 0, visible device-wide) or its read failed (`res` < 0):
// the page turns VALID with `n` pins already on (the lanes that paid for it own it this
// round), or EMPTY with the frame free again. Returns f or the failure.
__device__ __forceinline__ long long gpuio_array_filled(const gpuio_array_desc* a,
                                                       unsigned long long page, unsigned int f,
                                                       long long res, unsigned long long n,
                                                       unsigned long long start) {
    const gpuio_cache* c = &a->cache;
    unsigned long long* e = gpuio_array_entry(a, page);
    unsigned long long* owner = (unsigned long long*)c->owners + f;
    if (res < 0) {
        gpuio_st_release(owner, GPUIO_FRAME_FREE);
        gpuio_atom_and(e, GPUIO_PAGE_PIN_MASK);
        gpuio_array_count(c, a->slot, GPUIO_STAT_FAILURES, 1);
        gpuio_array_fail(c, a->slot, res);
        return res;
    }
    gpuio_st_release(owner, GPUIO_FRAME_OWNED |
                                ((unsigned long long)a->slot << GPUIO_FRAME_SLOT_SHIFT) | page);
    gpuio_frame_reference(c, f);
    gpuio_atom_add(e, ((GPUIO_PAGE_VALID - GPUIO_PAGE_FILLING) << GPUIO_PAGE_STATE_SHIFT) +
                          n * GPUIO_PAGE_PIN_ONE);
    gpuio_array_count(c, a->slot, GPUIO_STAT_MISSES, 1);
    gpuio_array_count(c, a->slot, GPUIO_STAT_BYTES_IN, gpuio_page_len(c, a->bytes, page));
    unsigned long long* hist =
        gpuio_array_stats(c, a->slot) + GPUIO_STAT_STRIPES * GPUIO_STAT_COUNTERS;
    atomicAdd(hist + gpuio_latency_bucket(gpuio_ring_now_ns() - start), 1ull);
    if (n > 1ull) gpuio_array_count(c, a->slot, GPUIO_STAT_WAITS, n - 1ull);
    return (long long)f;
}

// One round of a warp's accesses: every active lane calls it together, each with its own
// page; `lead` is non-zero for one lane per page wanted (the `n` lanes wanting it share the
// pin; `len`: the bytes of it the lead lane uses). A lead lane gets its page's frame pinned
// `n` times (>= 0), GPUIO_ARRAY_RETRY (not yet: the page is being filled or written back by
// another warp, or no frame came free), GPUIO_ARRAY_IN_PLACE (read the source itself: an
// array reading in place whose page has not proved hot, or is being filled or evicted by
// another warp), or a negative code. Misses claimed in this round are read through the ring
// together, their staged bytes copied by the whole warp. No pin outlives the round
// (gpuio_array_visit takes them off), and no lane waits in it for anything another warp's
// pins could hold up: a warp that kept pins while its lanes waited for frames could starve
// every other warp of them.
__device__ __forceinline__ long long gpuio_array_round(const gpuio_array_desc* a, int lead,
                                                      unsigned long long page,
                                                      unsigned long long n,
                                                      unsigned long long len, gpuio_miss* m) {
    const unsigned int active = __activemask();
    const gpuio_cache* c = &a->cache;
    unsigned long long* e = lead ? gpuio_array_entry(a, page) : (unsigned long long*)0;
    long long result = GPUIO_ARRAY_RETRY;
    int claimed = 0;
    unsigned int hits = 0u, waits = 0u;  // this lane's, counted once per warp below
    if (lead && !m->frameless) {
        const unsigned long long old = gpuio_atom_add_acquire(e, n * GPUIO_PAGE_PIN_ONE);
        if (gpuio_page_state(old) == GPUIO_PAGE_VALID) {
            result = (long long)(old & GPUIO_PAGE_FRAME_MASK);
            gpuio_frame_reference(c, (unsigned int)result);
            if (m->waited) {
                waits = (unsigned int)n;
            } else {
                hits = (unsigned int)n;
            }
        } else {
            gpuio_atom_add(e, 0ull - n * GPUIO_PAGE_PIN_ONE);
            const unsigned long long cur = gpuio_ld_acquire(e);
            const int empty = gpuio_page_state(cur) == GPUIO_PAGE_EMPTY;
            // Reading in place, a page earns its frame by admit_after touches (counted in its
            // empty entry's frame bits; an eviction starts the count again). Until then, and
            // while another warp fills or evicts it, the lanes read the source itself: a
            // few sectors over the bus instead of the whole page. An access of a quarter
            // page or more is cheaper cached at once (the fill moves the page once, copied by
            // the whole warp).
            const int in_place =
                a->admit_after != 0u && len < (c->page_size >> 2) &&
                ((const gpuio_array_slot*)c->slots + a->slot)->direct != 0ull;
            if (in_place && (!empty || (cur & GPUIO_PAGE_FRAME_MASK) + n <= a->admit_after)) {
                // A count lost to a racing lane only delays the admission.
                if (empty) gpuio_atom_cas(e, cur, cur + n);
                result = GPUIO_ARRAY_IN_PLACE;
            } else if (empty && gpuio_atom_cas(e, cur,
                                               (cur & ~GPUIO_PAGE_FRAME_MASK) |
                                                   (GPUIO_PAGE_FILLING << GPUIO_PAGE_STATE_SHIFT)) ==
                                    cur) {
                m->frameless = 1;
                m->start = gpuio_ring_now_ns();
            } else if (!empty) {
                m->waited = 1;
            }
        }
    }
    if (lead && m->frameless) {
        const long long f = gpuio_try_take_frame(c, a->slot, page, m->start, 0);
        if (f >= 0) {
            gpuio_atom_or(e, (unsigned long long)f);
            result = f;
            claimed = 1;
            m->frameless = 0;
        } else if (f != GPUIO_ARRAY_RETRY) {
            gpuio_atom_and(e, GPUIO_PAGE_PIN_MASK);
            result = f;
            m->frameless = 0;
        }
    }
    gpuio_array_count_warp(c, a->slot, active, GPUIO_STAT_HITS, hits, GPUIO_STAT_WAITS, waits);
    // The claimed pages' reads, their bytes copied by the whole warp together: staged by the
    // ring's proxy, or in place where the array's source is readable by the device.
    if (__any_sync(active, claimed)) {
        const unsigned long long len = claimed ? gpuio_page_len(c, a->bytes, page) : 0ull;
        const unsigned long long direct =
            claimed ? ((const gpuio_array_slot*)c->slots + a->slot)->direct : 0ull;
        unsigned char* frame = claimed ? gpuio_frame(c, (unsigned int)result) : (unsigned char*)0;
        const int through_ring = claimed && !direct;
        long long res = (long long)len;
        if (__any_sync(active, through_ring)) {
            const long long r = gpuio_read_each_warp_if(
                &c->ring, through_ring, a->resource, through_ring ? page << c->page_shift : 0ull,
                len, frame);
            if (through_ring) res = r;
        }
        gpuio_ring_copy_blocks_warp(
            active, claimed && direct,
            (const unsigned char*)(direct ? direct + (page << c->page_shift) : 0ull), frame, len);
        // Every lane's share of the copied bytes is visible before the page turns VALID.
        __threadfence();
        if (claimed) result = gpuio_array_filled(a, page, (unsigned int)result, res, n, m->start);
    }
    return result;
}

// Takes the pins of a round off again.
__device__ __forceinline__ void gpuio_array_unpin(const gpuio_array_desc* a,
                                                  unsigned long long page, unsigned long long n) {
    // A release reduction: what the lanes did with the frame is visible before the pins go,
    // and nothing waits for the old value.
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;"
                 :
                 : "l"(gpuio_array_entry(a, page)), "l"(0ull - n * GPUIO_PAGE_PIN_ONE)
                 : "memory");
}

// Where the lanes of a round use `page`: its frame, the source in place, or 0 (the access
// failed, its code recorded).
__device__ __forceinline__ unsigned char* gpuio_array_page_bytes(const gpuio_array_desc* a,
                                                                unsigned long long page,
                                                                long long frame) {
    const gpuio_cache* c = &a->cache;
    if (frame >= 0) return gpuio_frame(c, (unsigned int)frame);
    if (frame != GPUIO_ARRAY_IN_PLACE) return (unsigned char*)0;
    const gpuio_array_slot* s = (const gpuio_array_slot*)c->slots + a->slot;
    return (unsigned char*)(s->direct + (page << c->page_shift));
}

// Every active lane of a warp calls it together, each for its own page (`want` zero: none)
// and the `len` bytes at `at` in it it will use; `use(frame)` runs once per wanting lane, in
// the round its page is pinned, with the frame (>= 0), GPUIO_ARRAY_IN_PLACE, or the
// access's negative code (gpuio_array_page_bytes says where the bytes are); the pins come
// off right after. Lanes wanting one page share one pin, and
// the warp's misses are read together.
template <class Use>
__device__ __forceinline__ void gpuio_array_visit(const gpuio_array_desc* a, int want,
                                                  unsigned long long page, unsigned long long at,
                                                  unsigned long long len, Use use) {
    const unsigned int active = __activemask();
    gpuio_miss m = {0, 0, 0ull};
    int finished = !want;
    unsigned int ns = 32u;
    while (__any_sync(active, !finished)) {
        const unsigned int peers = __match_any_sync(active, finished ? ~0ull : page);
        const int leader = __ffs(peers) - 1;
        const int lead = !finished && (int)gpuio_ring_lane_id() == leader;
        const unsigned long long n = __popc(peers);
        const long long mine = gpuio_array_round(a, lead, page, n, len, &m);
        const long long frame = __shfl_sync(active, mine, leader);
        const int retry = !finished && frame == GPUIO_ARRAY_RETRY;
        const int in_place = !finished && frame == GPUIO_ARRAY_IN_PLACE;
        if (!finished && !retry) {
            use(frame);
            finished = 1;
        }
        if (__any_sync(active, in_place)) {
            // The sectors counted where the bytes lie (the source is only 16-byte aligned).
            const unsigned long long from =
                in_place ? (unsigned long long)gpuio_array_page_bytes(a, page, frame) + at : 0ull;
            gpuio_array_count_in_place(&a->cache, a->slot, active, in_place, from, len);
        }
        // Every lane is done with the frame before its leader takes the pins off.
        __syncwarp(active);
        if (lead && mine >= 0) gpuio_array_unpin(a, page, n);
        if (retry) gpuio_ring_backoff(&ns);
    }
}

// Accesses a lane of gpuio_array<T>::gather keeps in flight on its hit path (1 to 32: a bit
// each in the hit mask). Each may hold a pin: threads in flight times the depth stays far
// below a page entry's 2^24 pins (an H200's 270 K resident threads times 8: 2.2 M).
#ifndef GPUIO_ARRAY_GATHER_DEPTH
#define GPUIO_ARRAY_GATHER_DEPTH 8
#endif
static_assert(GPUIO_ARRAY_GATHER_DEPTH >= 1 && GPUIO_ARRAY_GATHER_DEPTH <= 32,
              "GPUIO_ARRAY_GATHER_DEPTH");

// The hit path of K reads per lane at once, for gather (every active lane calls it together):
// each wanted element's page is pinned with a relaxed atomic, the K pins ordered before the
// frame reads by one acquire fence and the reads before the pins go by one release fence, so
// the K round trips overlap instead of following one another. Lanes wanting one page share
// one pin where the warp has neighbours alike (sorted or sequential indices; random ones skip
// the match). Returns the bit mask of the elements read into v (their pages VALID); the rest
// (not cached, or their index out of range) go the warp-cooperative way. Their pins come off
// again at once: a page found filling, evicting or empty only sees a pin come and go, as a
// round's failed pin does. Reference bits are set after the pins go: a hint for the clock, harmless
// on a frame that changed meanwhile.
template <typename T, int K>
__device__ __forceinline__ unsigned int gpuio_array_hits(const gpuio_array_desc* a,
                                                        const int* want,
                                                        const unsigned long long* index,
                                                        T* v) {
    const gpuio_cache* c = &a->cache;
    const unsigned int active = __activemask();
    const unsigned int lane = gpuio_ring_lane_id();
    const unsigned long long size = a->bytes / sizeof(T);
    unsigned long long old[K], pins[K];
    int lead[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int go = want[j] && index[j] < size;
        // Lanes not reading get keys no page has (pages fit in 52 bits).
        const unsigned long long key = go ? (index[j] * sizeof(T)) >> c->page_shift : ~0ull - lane;
        const unsigned long long prev = __shfl_up_sync(active, key, 1);
        const int alike = lane > 0u && (active >> (lane - 1u) & 1u) && prev == key;
        const unsigned int peers =
            __any_sync(active, alike) ? __match_any_sync(active, key) : 1u << lane;
        lead[j] = go && (int)lane == __ffs(peers) - 1;
        pins[j] = go ? (unsigned long long)__popc(peers) : 0ull;
        old[j] = 0ull;
        if (lead[j]) {
            asm volatile("atom.add.relaxed.gpu.u64 %0, [%1], %2;"
                         : "=l"(old[j])
                         : "l"(gpuio_array_entry(a, key)), "l"(pins[j] * GPUIO_PAGE_PIN_ONE)
                         : "memory");
        }
        // Each lane learns its leader's entry (a lane not reading its own, 0).
        old[j] = __shfl_sync(active, old[j], __ffs(peers) - 1);
    }
    // The leaders' pins before every lane's frame reads (the barrier carries their acquire
    // to the lanes sharing their pins).
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    __syncwarp(active);
    unsigned int hit = 0u;
    unsigned int seen[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
        seen[j] = 1u;
        if (pins[j] && gpuio_page_state(old[j]) == GPUIO_PAGE_VALID) {
            const unsigned int f = (unsigned int)(old[j] & GPUIO_PAGE_FRAME_MASK);
            const unsigned long long at = (index[j] * sizeof(T)) & (c->page_size - 1ull);
            v[j] = *(const T*)(gpuio_frame(c, f) + at);
            if (lead[j]) seen[j] = *(volatile unsigned int*)((unsigned int*)c->refs + f);
            hit |= 1u << j;
        }
    }
    // Every lane's reads before its leader's pins go.
    __syncwarp(active);
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#pragma unroll
    for (int j = 0; j < K; j++) {
        if (!lead[j]) continue;
        asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;"
                     :
                     : "l"(gpuio_array_entry(a, (index[j] * sizeof(T)) >> c->page_shift)),
                       "l"(0ull - pins[j] * GPUIO_PAGE_PIN_ONE)
                     : "memory");
        if ((hit >> j & 1u) && seen[j] == 0u) {
            *(volatile unsigned int*)((unsigned int*)c->refs +
                                      (unsigned int)(old[j] & GPUIO_PAGE_FRAME_MASK)) = 1u;
        }
    }
    return hit;
}

// Writes `page` back if cached and dirty (one thread; waits for its pins to go).
__device__ __forceinline__ long long gpuio_array_flush_page(const gpuio_array_desc* a,
                                                            unsigned long long page) {
    unsigned long long* e = gpuio_array_entry(a, page);
    unsigned int ns = 32u;
    for (;;) {
        const unsigned long long cur = gpuio_ld_acquire(e);
        if (gpuio_page_state(cur) != GPUIO_PAGE_VALID || !(cur & GPUIO_PAGE_DIRTY)) return 0;
        if ((cur & GPUIO_PAGE_PIN_MASK) == 0ull) {
            const unsigned long long ev =
                (cur & ~(GPUIO_PAGE_STATE_MASK | GPUIO_PAGE_DIRTY)) |
                (GPUIO_PAGE_EVICTING << GPUIO_PAGE_STATE_SHIFT);
            if (gpuio_atom_cas(e, cur, ev) == cur) {
                const long long res = gpuio_write_back(
                    &a->cache, a->slot, page, (unsigned int)(cur & GPUIO_PAGE_FRAME_MASK));
                gpuio_atom_add(e, 0ull - ((GPUIO_PAGE_EVICTING - GPUIO_PAGE_VALID)
                                          << GPUIO_PAGE_STATE_SHIFT));
                if (res < 0) gpuio_atom_or(e, GPUIO_PAGE_DIRTY);
                return res < 0 ? res : 0;
            }
        }
        gpuio_ring_backoff(&ns);
    }
}

// Claims `page` for bytes fetched ahead (get_async) without waiting for anything: the page
// must be EMPTY, no write-back of the array may have begun since `writebacks` (the count when
// the read was posted, none in flight then: the bytes are what the source holds), and a clean
// frame must come free in one try (a dirty victim's write-back would need a ring slot while
// the caller holds one). Returns the frame, locked and owned, with the page FILLING, or -1.
__device__ __forceinline__ long long gpuio_array_claim_fetched(const gpuio_array_desc* a,
                                                              unsigned long long page,
                                                              unsigned long long writebacks) {
    const gpuio_cache* c = &a->cache;
    unsigned long long* e = gpuio_array_entry(a, page);
    const unsigned long long cur = gpuio_ld_acquire(e);
    // Clearing the frame bits, as every claim does: an empty page's may count its touches.
    if (gpuio_page_state(cur) != GPUIO_PAGE_EMPTY ||
        gpuio_atom_cas(e, cur,
                       (cur & ~GPUIO_PAGE_FRAME_MASK) |
                           (GPUIO_PAGE_FILLING << GPUIO_PAGE_STATE_SHIFT)) != cur) {
        return -1;
    }
    // Checked with the page claimed: a write-back of it that began after this check is
    // impossible (it is not VALID), and one that began before has been counted.
    gpuio_array_slot* s = (gpuio_array_slot*)c->slots + a->slot;
    long long f = -1;
    if (gpuio_ld_acquire(&s->writebacks_begun) == writebacks) {
        f = gpuio_try_take_frame(c, a->slot, page, gpuio_ring_now_ns(), 1);
    }
    if (f < 0) {
        gpuio_atom_and(e, GPUIO_PAGE_PIN_MASK);
        return -1;
    }
    gpuio_atom_or(e, (unsigned long long)f);
    return f;
}

// A read started by gpuio_array<T>::get_async, finished by wait (which every future needs:
// it may hold a ring slot).
#define GPUIO_FUTURE_READY 0     // value holds the element (T() after a failed access)
#define GPUIO_FUTURE_LATER 1     // wait reads it (its page was cached, or being brought in)
#define GPUIO_FUTURE_FETCHING 2  // this lane's staged read of the page is posted
template <typename T>
struct gpuio_array_future {
    unsigned long long index;
    unsigned long long writebacks;  // the array's write-backs begun when the read was posted
    unsigned long long start;       // when it was (ns)
    gpuio_token tok;
    T value;
    int state;
};

// ---- gpuio_array<T> ----------------------------------------------------------------------------

template <typename T>
struct gpuio_array {
    gpuio_array_desc d;

    __device__ gpuio_array(const gpuio_array_desc& desc) : d(desc) {}

    // Elements.
    __device__ __forceinline__ unsigned long long size() const { return d.bytes / sizeof(T); }

    // The element at `i` (T() and a recorded error if it cannot be had).
    __device__ __forceinline__ T get(unsigned long long i) const { return access(i, 0, T()); }

    __device__ __forceinline__ T operator[](unsigned long long i) const { return get(i); }

    // Stores `v` at `i` (the page becomes dirty; eviction or synchronize writes it back).
    __device__ __forceinline__ void store(unsigned long long i, T v) const { access(i, 1, v); }

    // out[k] = arr[idx[k]] for k < n, the grid's threads taking k = tid, tid + stride, ...
    // Each lane reads GPUIO_ARRAY_GATHER_DEPTH elements at once where their pages are cached
    // (gpuio_array_hits); the others go as get() does, together by warp (lanes wanting one
    // page pin it once, misses read together).
    __device__ __forceinline__ void gather(const unsigned long long* idx, T* out,
                                           unsigned long long n) const {
        constexpr int K = sizeof(T) <= 16 ? GPUIO_ARRAY_GATHER_DEPTH : 1;
        const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
        const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x;
        // A warp-uniform trip count: every lane reaches each collective call.
        for (unsigned long long base = first; base < n; base += stride * K) {
            int want[K];
            unsigned long long index[K];
            T v[K];
#pragma unroll
            for (int j = 0; j < K; j++) {
                const unsigned long long k = base + j * stride + threadIdx.x;
                want[j] = k < n;
                index[j] = want[j] ? idx[k] : 0ull;
            }
            const unsigned int active = __activemask();
            const unsigned int hit = gpuio_array_hits<T, K>(&d, want, index, v);
            gpuio_array_count_warp(&d.cache, d.slot, active, GPUIO_STAT_HITS,
                                   (unsigned int)__popc(hit), GPUIO_STAT_WAITS, 0u);
            unsigned int rest = 0u;  // this lane's elements not read on the hit path
#pragma unroll
            for (int j = 0; j < K; j++) {
                if (want[j] && (hit >> j & 1u)) out[base + j * stride + threadIdx.x] = v[j];
                if (want[j] && !(hit >> j & 1u)) rest |= 1u << j;
            }
            // The rest one depth at a time (only depths some lane needs: none where the warp
            // hit throughout), in a loop kept rolled: access_if is the whole miss path, and
            // unrolled it would be compiled K times over. The unrolled select
            // picks index j out of registers (an indexed register array would go to local
            // memory).
            unsigned int left = gpuio_array_warp_or(active, rest, K);
#pragma unroll 1
            while (left) {
                const int j = __ffs(left) - 1;
                left &= left - 1u;
                unsigned long long at = 0ull;
#pragma unroll
                for (int m = 0; m < K; m++) {
                    if (m == j) at = index[m];
                }
                const int mine = rest >> j & 1u;
                const T later = access_if(mine, at, 0, T());
                if (mine) out[base + j * stride + threadIdx.x] = later;
            }
        }
    }

    // Elements first .. first + count into out, each active lane its own span (the warp's
    // lanes together: their misses are read at once, many per warp in flight). Each lane
    // copies its own bytes out of the pinned frame.
    __device__ __forceinline__ void read_each(unsigned long long first, unsigned long long count,
                                              T* out) const {
        const unsigned int active = __activemask();
        const gpuio_cache* c = &d.cache;
        const int ok = first <= size() && count <= size() - first;
        if (!ok) {
            gpuio_array_fail(c, d.slot, GPUIO_ERROR_INVALID_ARG);
            for (unsigned long long j = 0; j < count; j++) out[j] = T();
        }
        unsigned long long done = ok ? 0ull : count;
        while (__any_sync(active, done < count)) {
            const int want = done < count;
            const unsigned long long byte = (first + done) * sizeof(T);
            const unsigned long long at = byte & (c->page_size - 1ull);
            const unsigned long long left = count - done;
            const unsigned long long in_page = (c->page_size - at) / sizeof(T);
            const unsigned long long n = want ? (in_page < left ? in_page : left) : 0ull;
            T* to = out + done;
            const unsigned long long page = byte >> c->page_shift;
            gpuio_array_visit(&d, want, page, at, n * sizeof(T), [&](long long frame) {
                const unsigned char* bytes = gpuio_array_page_bytes(&d, page, frame);
                if (!bytes) {
                    for (unsigned long long j = 0; j < n; j++) to[j] = T();
                    return;
                }
                const unsigned char* from = bytes + at;
                const unsigned long long span = n * sizeof(T);
                if ((((unsigned long long)from | (unsigned long long)to | span) & 15ull) == 0) {
                    // Several 16-byte loads in flight before any store.
                    const uint4* src = (const uint4*)from;
                    uint4* dst = (uint4*)to;
                    const unsigned long long pieces = span / 16;
                    for (unsigned long long i = 0; i < pieces; i += 8) {
                        uint4 v[8];
#pragma unroll
                        for (int k = 0; k < 8; k++) {
                            if (i + k < pieces) v[k] = src[i + k];
                        }
#pragma unroll
                        for (int k = 0; k < 8; k++) {
                            if (i + k < pieces) dst[i + k] = v[k];
                        }
                    }
                } else {
                    for (unsigned long long j = 0; j < n; j++) to[j] = ((const T*)from)[j];
                }
            });
            done += n;
        }
    }

    // Starts reading the element at `i` and returns at once (AGILE's issue, compute, wait):
    // the lowest lane of a warp wanting a page that is not cached posts a staged read of it
    // through the ring, without claiming the page, so that nothing waits for this warp
    // meanwhile; wait() puts those bytes into a frame, or, where the page came in otherwise
    // or may have changed at its source, reads the element as get() does. Every active lane
    // calls it together (warp-cooperative, like get), and every future must be waited for.
    //
    // A thread holds one future at a time; between get_async and wait it may compute, but must
    // not access an array or post ring requests, nor wait at a barrier for threads that do,
    // unless the grid's outstanding futures fit in the ring's slots: each future holds one
    // slot, and a ring full of held slots makes posts wait for them. get_async itself waits
    // while the ring is full (as gpuio_read does), so no ticket is left unposted across the
    // thread's compute, where the proxy thread serving it would wait for it.
    __device__ __forceinline__ gpuio_array_future<T> get_async(unsigned long long i) const {
        const unsigned int active = __activemask();
        const gpuio_cache* c = &d.cache;
        gpuio_array_future<T> f;
        f.index = i;
        f.writebacks = 0ull;
        f.start = 0ull;
        f.value = T();
        f.state = GPUIO_FUTURE_READY;
        f.tok.done = 1u;
        const int ok = i < size();
        if (!ok) gpuio_array_fail(c, d.slot, GPUIO_ERROR_INVALID_ARG);
        const unsigned long long page = ok ? (i * sizeof(T)) >> c->page_shift : ~0ull;
        const unsigned int peers = __match_any_sync(active, page);
        if (!ok) return f;
        f.state = GPUIO_FUTURE_LATER;
        const unsigned long long len = gpuio_page_len(c, d.bytes, page);
        const gpuio_ring* r = &c->ring;
        gpuio_array_slot* s = (gpuio_array_slot*)c->slots + d.slot;
        // In-place arrays read a miss with no ring round trip: wait does it, as get() does.
        if ((int)gpuio_ring_lane_id() != __ffs(peers) - 1 || !r->bounce ||
            len > r->bounce_bytes || s->direct ||
            gpuio_page_state(gpuio_ld_acquire(gpuio_array_entry(&d, page))) !=
                GPUIO_PAGE_EMPTY) {
            return f;
        }
        const unsigned long long ended = gpuio_ld_acquire(&s->writebacks_ended);
        const unsigned long long begun = gpuio_ld_acquire(&s->writebacks_begun);
        if (begun != ended) return f;  // a write-back in flight: its bytes may not be there yet
        f.writebacks = begun;
        f.start = gpuio_ring_now_ns();
        // The ticket's slot is the future's from now on (the ring shut down: get() reports it).
        const long long p = gpuio_post(r, GPUIO_RING_OP_READ, d.resource, GPUIO_RING_FLAG_STAGE,
                                       page << c->page_shift, len, 0ull, &f.tok);
        f.state = p < 0 ? GPUIO_FUTURE_LATER : GPUIO_FUTURE_FETCHING;
        return f;
    }

    // The element get_async started reading (T() and a recorded error if it cannot be had).
    // Every active lane calls it together. The lanes go round together, as those of
    // gpuio_read_each_warp_if do: collect what arrived, put fetched pages into frames (the
    // lanes wanting them read their elements under the pins the fill brings), hand the slots
    // back; no lane holds a completed slot while it waits for another. What no fetch brought
    // (a page cached or being brought in by others at get_async, or fetched bytes that could
    // not be trusted or placed) is read as get() reads it.
    __device__ __forceinline__ T wait(gpuio_array_future<T>& f) const {
        const unsigned int active = __activemask();
        const gpuio_cache* c = &d.cache;
        const gpuio_ring* r = &c->ring;
        const int want = f.state != GPUIO_FUTURE_READY;
        const unsigned long long page = want ? (f.index * sizeof(T)) >> c->page_shift : ~0ull;
        const unsigned long long len = want ? gpuio_page_len(c, d.bytes, page) : 0ull;
        const unsigned long long at = (f.index * sizeof(T)) & (c->page_size - 1ull);
        int fetching = f.state == GPUIO_FUTURE_FETCHING, done = !want;
        unsigned int ns = 32u;
        while (__any_sync(active, fetching)) {
            long long result = 0;
            int arrived = 0, staged = GPUIO_STAGED_NONE;
            unsigned long long word = 0ull;
            if (fetching) {
                arrived = gpuio_ring_arrived(r, &f.tok, &result, &staged, &word);
                // The ring's state costs a PCIe round trip of its own: every 16th poll only.
                if (!arrived && (++f.tok.polls & 15u) == 0u &&
                    gpuio_ring_ld_acquire32(&r->header->state) == GPUIO_RING_CLOSED) {
                    // The host's final sweep happened before CLOSED: look once more.
                    arrived = gpuio_ring_arrived(r, &f.tok, &result, &staged, &word);
                    if (!arrived) fetching = 0;  // never served
                }
            }
            // Lanes still wanting one page share what any of them fetched for it.
            const int usable =
                arrived && staged == GPUIO_STAGED_BOUNCE && result == (long long)len;
            const unsigned int peers = __match_any_sync(active, done ? ~0ull : page);
            const int leader = __ffs(peers) - 1;
            const int lead = !done && (int)gpuio_ring_lane_id() == leader;
            const unsigned int have = __ballot_sync(active, usable && !done) & peers;
            const int source = have ? __ffs(have) - 1 : leader;
            const unsigned long long from = __shfl_sync(
                active, usable ? (unsigned long long)gpuio_ring_bounce(r, &f.tok) : 0ull, source);
            const unsigned long long writebacks = __shfl_sync(active, f.writebacks, source);
            const unsigned long long start = __shfl_sync(active, f.start, source);
            const unsigned long long n = __popc(peers);
            long long frame = -1;
            if (lead && have) frame = gpuio_array_claim_fetched(&d, page, writebacks);
            const int claimed = frame >= 0;
            gpuio_ring_copy_blocks_warp(
                active, claimed, (const unsigned char*)from,
                claimed ? gpuio_frame(c, (unsigned int)frame) : (unsigned char*)0, len);
            // Every lane's share of the copied bytes is visible before the page turns VALID.
            __threadfence();
            if (claimed) frame = gpuio_array_filled(&d, page, (unsigned int)frame, 0, n, start);
            const long long filled = __shfl_sync(active, frame, leader);
            if (!done && filled >= 0) {
                f.value = *(const T*)(gpuio_frame(c, (unsigned int)filled) + at);
                done = 1;
            }
            __syncwarp(active);
            if (claimed) gpuio_array_unpin(&d, page, n);
            if (arrived) {
                gpuio_ring_release(r, &f.tok, result);
                fetching = 0;
            }
            if (fetching) gpuio_ring_backoff(&ns);
        }
        const T later = access_if(!done, f.index, 0, T());
        if (!done) f.value = later;
        f.state = GPUIO_FUTURE_READY;
        return f.value;
    }

    // One access by every active lane (each its own index): lanes wanting one page share
    // one pin; `write` stores `v` instead of reading.
    __device__ __forceinline__ T access(unsigned long long i, int write, T v) const {
        return access_if(1, i, write, v);
    }

    // access() by the lanes whose `go` is non-zero (the others take part in the warp's
    // collective steps and get T()).
    __device__ __forceinline__ T access_if(int go, unsigned long long i, int write, T v) const {
        const gpuio_cache* c = &d.cache;
        const int ok_index = !go || i < size();
        const int ok_mode = !go || !write || (d.flags & GPUIO_ARRAY_WRITABLE);
        if (!ok_index) gpuio_array_fail(c, d.slot, GPUIO_ERROR_INVALID_ARG);
        if (ok_index && !ok_mode) gpuio_array_fail(c, d.slot, GPUIO_ERROR_PERMISSION);
        const int want = go && ok_index && ok_mode;
        const unsigned long long byte = want ? i * sizeof(T) : 0ull;
        const unsigned long long page = byte >> c->page_shift;
        T out = T();
        const gpuio_array_desc* desc = &d;
        const unsigned long long in_page = byte & (c->page_size - 1ull);
        gpuio_array_visit(&d, want, page, in_page, sizeof(T), [&](long long frame) {
            unsigned char* bytes = gpuio_array_page_bytes(desc, page, frame);
            if (!bytes) return;
            T* at = (T*)(bytes + in_page);
            if (write) {
                unsigned long long* e = gpuio_array_entry(desc, page);
                if (!(*(volatile unsigned long long*)e & GPUIO_PAGE_DIRTY)) {
                    gpuio_atom_or(e, GPUIO_PAGE_DIRTY);
                }
                *at = v;
                __threadfence();  // the store is visible before the pins go
            } else {
                out = *at;
            }
        });
        return out;
    }
};

// ---- Resident arrays ---------------------------------------------------------------------------

// A read-only array whose every page the host holds in the cache (one pin each, taken by
// gpuio_array_hold and kept until gpuio_array_let_go): no page can be evicted or change while
// it is held, so a read needs no pin and no check, only the page's frame from a table that
// stays as it is (gpuio_hal::ondemand::ResidentDevice).
struct gpuio_resident_desc {
    const unsigned int* frames;   // the frame holding each page
    unsigned long long base;      // the cache's frame 0
    unsigned long long bytes;     // bytes of the array
    unsigned long long slots;     // the cache's slot table (errors are recorded there)
    unsigned int page_shift;
    unsigned int slot;            // the array's slot
};
static_assert(sizeof(gpuio_resident_desc) == 40, "gpuio_resident_desc size");

template <typename T>
struct gpuio_resident_array {
    gpuio_resident_desc d;

    __device__ __forceinline__ explicit gpuio_resident_array(const gpuio_resident_desc& desc)
        : d(desc) {}

    __device__ __forceinline__ unsigned long long size() const { return d.bytes / sizeof(T); }

    // Element i: two loads through the read-only cache, the frame and the element (both stay
    // as they are while the array is held). An index past the end reads T() and records
    // GPUIO_ERROR_INVALID_ARG for OnDemandArray::check.
    __device__ __forceinline__ T operator[](unsigned long long i) const {
        if (i >= size()) {
            gpuio_array_slot* s = (gpuio_array_slot*)d.slots + d.slot;
            atomicCAS((unsigned long long*)&s->error, 0ull,
                      (unsigned long long)GPUIO_ERROR_INVALID_ARG);
            return T();
        }
        const unsigned long long byte = i * sizeof(T);
        const unsigned int f = __ldg(d.frames + (byte >> d.page_shift));
        const unsigned long long mask = (1ull << d.page_shift) - 1ull;
        return __ldg((const T*)(d.base + ((unsigned long long)f << d.page_shift) + (byte & mask)));
    }

    // out[k] = (*this)[idx[k]] for k < n, grid-stride over the calling grid.
    __device__ __forceinline__ void gather(const unsigned long long* idx, T* out,
                                           unsigned long long n) const {
        const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
        for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
             k < n; k += stride) {
            out[k] = (*this)[idx[k]];
        }
    }
};

#endif  // GPUIO_ARRAY_CUH
