// GPU-driven NVMe queues (Tier 1: queues and data in host memory pinned and mapped for the
// GPU). GPU threads build submission queue entries, ring the controller's doorbells and poll
// its completion queue's phase tags; no CPU is on the path unless the controller itself is a
// host thread (gpuio_hal::nvme::SoftController, the stand-in where no NVMe is reachable).
//
// Layouts mirror crates/gpuio-nvme/src/{spec,gpu}.rs (Sqe, Cqe, NvmeQueueDevice,
// NvmeQueueState); the sizes are asserted here and there, and the GPU test compares the
// layout kernel's report with the Rust side.
//
// One warp at a time owns a queue pair for one batch: its leader takes the pair's lock (in GPU
// memory), each active lane writes one SQE (its command identifier is its rank in the batch),
// the leader rings the SQ tail doorbell once, each lane polls one CQ entry, the statuses are
// handed to the lanes whose identifiers they carry, and the leader rings the CQ head doorbell
// and releases the lock. The queues are empty between batches, so a batch of at most 32
// commands always fits a queue of 33 entries or more. Warps of different blocks use different
// queue pairs (one pair per group of blocks), so submission scales with the pairs.
#ifndef GPUIO_NVME_CUH
#define GPUIO_NVME_CUH

// A submission queue entry (NVMe base specification, 64 bytes).
struct gpuio_nvme_sqe {
    unsigned int cdw0;  // opcode 0..8, command identifier 16..32
    unsigned int nsid;
    unsigned int cdw2;
    unsigned int cdw3;
    unsigned long long mptr;
    unsigned long long prp1;
    unsigned long long prp2;
    unsigned int cdw10;
    unsigned int cdw11;
    unsigned int cdw12;
    unsigned int cdw13;
    unsigned int cdw14;
    unsigned int cdw15;
};

// A completion queue entry (16 bytes): the status's bit 0 is the phase tag.
struct gpuio_nvme_cqe {
    unsigned int result;
    unsigned int rsvd;
    unsigned short sq_head;
    unsigned short sq_id;
    unsigned short cid;
    unsigned short status;
};

// A queue pair as kernels see it: addresses kernels reach (mapped host memory, doorbells in
// the controller's register file) and the pair's state in GPU memory.
struct gpuio_nvme_queue {
    unsigned long long sq;           // depth SQEs
    unsigned long long cq;           // depth CQEs
    unsigned long long sq_doorbell;  // 32-bit SQ tail doorbell
    unsigned long long cq_doorbell;  // 32-bit CQ head doorbell
    unsigned long long state;        // a gpuio_nvme_state in GPU memory
    unsigned int depth;
    unsigned int qid;
    unsigned long long lists;       // one 4 KiB PRP list page per command identifier
    unsigned long long lists_iova;  // the controller's address of the first
};

// Where the GPU's side of a queue pair stands between batches.
struct gpuio_nvme_state {
    unsigned int lock;     // 0 free, 1 held by a warp's leader
    unsigned int sq_tail;  // the next SQ slot
    unsigned int cq_head;  // the next CQ slot
    unsigned int phase;    // the phase tag expected at cq_head
};

static_assert(sizeof(gpuio_nvme_sqe) == 64, "SQE is 64 bytes");
static_assert(sizeof(gpuio_nvme_cqe) == 16, "CQE is 16 bytes");
static_assert(sizeof(gpuio_nvme_queue) == 64, "queue descriptor is 64 bytes");
static_assert(sizeof(gpuio_nvme_state) == 16, "queue state is 16 bytes");

#define GPUIO_NVME_FLUSH 0x00u
#define GPUIO_NVME_WRITE 0x01u
#define GPUIO_NVME_READ 0x02u
#define GPUIO_NVME_PAGE 4096ull
// Statuses no controller returns (the field is 15 bits): the completion did not come in
// time; the queue pair is broken (an earlier batch timed out), so nothing was submitted.
#define GPUIO_NVME_TIMED_OUT 0xffffu
#define GPUIO_NVME_BROKEN 0xfffeu
// Lock word values: free, held by a warp's leader, broken for good (the host sees it and
// disables the controller: a late completion must not land in a later batch's slots).
#define GPUIO_NVME_LOCK_FREE 0u
#define GPUIO_NVME_LOCK_HELD 1u
#define GPUIO_NVME_LOCK_BROKEN 2u
// How long a lane polls its completion before giving up.
#define GPUIO_NVME_TIMEOUT_NS 10000000000ull

__device__ __forceinline__ unsigned long long gpuio_nvme_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Whether `bytes` at IO address `iova` touch more than two memory pages (PRP2 must then
// name a PRP list).
__device__ __forceinline__ bool gpuio_nvme_needs_list(unsigned long long iova,
                                                      unsigned long long bytes) {
    return iova % GPUIO_NVME_PAGE + bytes > 2ull * GPUIO_NVME_PAGE;
}

// A READ or WRITE of `blocks` blocks at `lba` moving `bytes` bytes at IO address `iova`
// (dword-aligned). PRP1 and, where the transfer touches exactly two pages, PRP2 are set; a
// transfer over more pages needs a PRP list, which gpuio_nvme_warp_rw writes (PRP2 stays 0
// here).
__device__ __forceinline__ gpuio_nvme_sqe gpuio_nvme_rw(unsigned int opcode, unsigned int nsid,
                                                        unsigned long long lba,
                                                        unsigned int blocks,
                                                        unsigned long long iova,
                                                        unsigned long long bytes) {
    gpuio_nvme_sqe e = {};
    e.cdw0 = opcode;
    e.nsid = nsid;
    e.prp1 = iova;
    const unsigned long long second = (iova / GPUIO_NVME_PAGE + 1) * GPUIO_NVME_PAGE;
    e.prp2 = (iova + bytes > second && !gpuio_nvme_needs_list(iova, bytes)) ? second : 0ull;
    e.cdw10 = (unsigned int)lba;
    e.cdw11 = (unsigned int)(lba >> 32);
    e.cdw12 = (blocks - 1u) & 0xffffu;
    return e;
}

// A FLUSH of namespace `nsid` (no data).
__device__ __forceinline__ gpuio_nvme_sqe gpuio_nvme_flush(unsigned int nsid) {
    gpuio_nvme_sqe e = {};
    e.cdw0 = GPUIO_NVME_FLUSH;
    e.nsid = nsid;
    return e;
}

// Submits each active lane's `sqe` on queue pair `q` as one batch and waits for all of them,
// calling `prepare(sqe, command identifier)` on each lane's entry under the pair's lock;
// returns the lane's status field (0: success; GPUIO_NVME_TIMED_OUT where no completion came
// in time, after which the pair is broken; GPUIO_NVME_BROKEN where it already was).
// Every lane of the warp that is running must call it together (inactive lanes pass
// `active = false`). The data a command reads is in its buffer once this returns: the
// completion is posted after the data (NVMe orders them), and the lane fences before reading.
template <class Prepare>
__device__ unsigned int gpuio_nvme_warp_batch(const gpuio_nvme_queue* q, bool active,
                                              gpuio_nvme_sqe sqe, Prepare prepare) {
    const unsigned int warp = __activemask();
    const unsigned int act = __ballot_sync(warp, active);
    if (act == 0) return 0;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int leader = __ffs(act) - 1;
    const unsigned int rank = __popc(act & ((1u << lane) - 1u));
    const unsigned int n = __popc(act);
    const unsigned int depth = q->depth;
    gpuio_nvme_state* st = (gpuio_nvme_state*)q->state;
    unsigned int tail = 0, head = 0, phase = 0, broken = 0;
    if (lane == leader) {
        unsigned int was;
        while ((was = atomicCAS(&st->lock, GPUIO_NVME_LOCK_FREE, GPUIO_NVME_LOCK_HELD)) !=
               GPUIO_NVME_LOCK_FREE) {
            if (was == GPUIO_NVME_LOCK_BROKEN) {
                broken = 1;
                break;
            }
            __nanosleep(64);
        }
        __threadfence();
        tail = ((volatile gpuio_nvme_state*)st)->sq_tail;
        head = ((volatile gpuio_nvme_state*)st)->cq_head;
        phase = ((volatile gpuio_nvme_state*)st)->phase;
    }
    if (__shfl_sync(warp, broken, leader)) return GPUIO_NVME_BROKEN;
    tail = __shfl_sync(warp, tail, leader);
    head = __shfl_sync(warp, head, leader);
    phase = __shfl_sync(warp, phase, leader);
    if (active) {
        // The command identifier is the lane's rank; its PRP list page is the pair's
        // page of that identifier, the warp's while it holds the lock.
        prepare(sqe, rank);
        sqe.cdw0 = (sqe.cdw0 & 0xffffu) | (rank << 16);
        volatile unsigned long long* to =
            (volatile unsigned long long*)(q->sq + (unsigned long long)((tail + rank) % depth) * 64ull);
        const unsigned long long* from = (const unsigned long long*)&sqe;
#pragma unroll
        for (int w = 0; w < 8; ++w) to[w] = from[w];
        // The entry must reach host memory before the doorbell announces it.
        __threadfence_system();
    }
    __syncwarp(warp);
    if (lane == leader) {
        __threadfence_system();
        const unsigned int new_tail = (tail + n) % depth;
        *(volatile unsigned int*)q->sq_doorbell = new_tail;
        st->sq_tail = new_tail;
    }
    // Lane of rank r waits for CQ entry head + r; completions arrive in any command order.
    unsigned int cid = 0xffffffffu, status = GPUIO_NVME_TIMED_OUT;
    if (active) {
        const unsigned int at = head + rank;
        const unsigned int expect = phase ^ (at >= depth ? 1u : 0u);
        const unsigned long long entry = q->cq + (unsigned long long)(at % depth) * 16ull;
        volatile unsigned short* tag = (volatile unsigned short*)(entry + 14);
        const unsigned long long start = gpuio_nvme_now();
        unsigned short s = *tag;
        while ((s & 1u) != expect) {
            if (gpuio_nvme_now() - start > GPUIO_NVME_TIMEOUT_NS) break;
            s = *tag;
        }
        if ((s & 1u) == expect) {
            __threadfence_system();
            cid = *(volatile unsigned short*)(entry + 12);
            status = (unsigned int)(s >> 1);
        }
    }
    // Hand each status to the lane whose rank its command identifier names.
    unsigned int mine = GPUIO_NVME_TIMED_OUT;
    for (unsigned int from = act; from != 0; from &= from - 1) {
        const int src = __ffs(from) - 1;
        const unsigned int c = __shfl_sync(warp, cid, src);
        const unsigned int v = __shfl_sync(warp, status, src);
        if (active && c == rank) mine = v;
    }
    const unsigned int late = __ballot_sync(warp, active && status == GPUIO_NVME_TIMED_OUT);
    __syncwarp(warp);
    if (late != 0) {
        // A completion may still come, into slots a later batch would poll: the pair is
        // broken for good, its doorbells left as they are.
        if (lane == leader) {
            __threadfence();
            atomicExch(&st->lock, GPUIO_NVME_LOCK_BROKEN);
        }
        return mine;
    }
    if (lane == leader) {
        const unsigned int end = head + n;
        const unsigned int new_head = end % depth;
        *(volatile unsigned int*)q->cq_doorbell = new_head;
        st->cq_head = new_head;
        st->phase = phase ^ (end >= depth ? 1u : 0u);
        __threadfence();
        atomicExch(&st->lock, GPUIO_NVME_LOCK_FREE);
    }
    return mine;
}

// Submits each active lane's `sqe` (its PRPs complete: at most two pages) as one batch.
__device__ unsigned int gpuio_nvme_warp_submit(const gpuio_nvme_queue* q, bool active,
                                               gpuio_nvme_sqe sqe) {
    return gpuio_nvme_warp_batch(q, active, sqe, [](gpuio_nvme_sqe&, unsigned int) {});
}

// Each active lane's READ or WRITE (gpuio_nvme_rw's arguments; `bytes` up to 2 MiB and the
// controller's transfer limit) as one batch: a transfer over more than two pages gets its
// PRP list written into the pair's list page of its command identifier.
__device__ unsigned int gpuio_nvme_warp_rw(const gpuio_nvme_queue* q, bool active,
                                           unsigned int opcode, unsigned int nsid,
                                           unsigned long long lba, unsigned int blocks,
                                           unsigned long long iova, unsigned long long bytes) {
    const gpuio_nvme_sqe sqe = gpuio_nvme_rw(opcode, nsid, lba, blocks, iova, bytes);
    const bool list = gpuio_nvme_needs_list(iova, bytes);
    return gpuio_nvme_warp_batch(q, active, sqe, [&](gpuio_nvme_sqe& e, unsigned int cid) {
        if (!list) return;
        volatile unsigned long long* page =
            (volatile unsigned long long*)(q->lists + (unsigned long long)cid * GPUIO_NVME_PAGE);
        unsigned int i = 0;
        for (unsigned long long at = (iova / GPUIO_NVME_PAGE + 1) * GPUIO_NVME_PAGE;
             at < iova + bytes; at += GPUIO_NVME_PAGE) {
            page[i++] = at;
        }
        e.prp2 = q->lists_iova + (unsigned long long)cid * GPUIO_NVME_PAGE;
    });
}

#endif  // GPUIO_NVME_CUH
