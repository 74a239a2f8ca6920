// Kernels that drive NVMe queue pairs from GPU threads (gpuio_nvme.cuh), for gpuio's GPU tests
// and `gpuio bench nvme`, and the layout report the GPU test compares with the Rust side.
#ifndef GPUIO_NVME_CUH
#include "gpuio_nvme.cuh"
#endif
#ifndef GPUIO_PATTERN_CUH
#include "gpuio_pattern.cuh"
#endif

// Command i (i < n) is `opcode` on namespace `nsid` at lbas[i], `blocks` blocks of
// `block_bytes` (FLUSH: no data, and `lbas` is not read). Each warp owns 32 data slots of blocks * block_bytes bytes
// in host memory (mapped at `data`, IO address `data_iova`): slot (global warp * 32 + lane).
// A WRITE's slot is filled with pattern stream `seed` at the command's byte offset in the
// namespace (lba * block_bytes) first; a READ's slot is checked against the same pattern
// after the completion, and mismatched 8-byte words are counted in `mismatches`. The whole
// warp fills or checks one slot at a time, 16 bytes a lane, so each access is one coalesced
// transfer over the bus. Block b's warps use queue pair queues[b % nqueues]. statuses[i] gets
// command i's status field (0: success).
extern "C" __global__ void gpuio_nvme_io(const gpuio_nvme_queue* queues, unsigned int nqueues,
                                         unsigned int opcode, unsigned int nsid,
                                         const unsigned long long* lbas, unsigned long long n,
                                         unsigned int blocks, unsigned int block_bytes,
                                         unsigned long long data_iova, unsigned char* data,
                                         unsigned long long seed, unsigned int* statuses,
                                         unsigned long long* mismatches) {
    const gpuio_nvme_queue* q = &queues[blockIdx.x % nqueues];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned long long warps = (unsigned long long)gridDim.x * (blockDim.x / 32u);
    const unsigned long long warp =
        (unsigned long long)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    const unsigned long long bytes = (unsigned long long)blocks * block_bytes;
    unsigned char* slots = data + warp * 32ull * bytes;
    unsigned long long bad = 0;
    // Warp-uniform trip count: every lane reaches each batch.
    for (unsigned long long base = warp * 32ull; base < n; base += warps * 32ull) {
        const unsigned long long i = base + lane;
        const bool active = i < n;
        const unsigned long long lba = (active && opcode != GPUIO_NVME_FLUSH) ? lbas[i] : 0ull;
        if (opcode == GPUIO_NVME_WRITE) {
            const unsigned int fill = __ballot_sync(0xffffffffu, active);
            for (unsigned int k = 0; k < 32u; ++k) {
                if (((fill >> k) & 1u) == 0u) continue;
                const unsigned long long first = __shfl_sync(0xffffffffu, lba, k) * block_bytes / 8ull;
                ulonglong2* slot = (ulonglong2*)(slots + k * bytes);
                for (unsigned long long p = lane; p < bytes / 16ull; p += 32ull) {
                    __stwt(slot + p, make_ulonglong2(gpuio_word_at(seed, first + 2ull * p),
                                                     gpuio_word_at(seed, first + 2ull * p + 1ull)));
                }
            }
            __threadfence_system();
        }
        const unsigned int status =
            opcode == GPUIO_NVME_FLUSH
                ? gpuio_nvme_warp_submit(q, active, gpuio_nvme_flush(nsid))
                : gpuio_nvme_warp_rw(q, active, opcode, nsid, lba, blocks,
                                     data_iova + (slots - data) + lane * bytes, bytes);
        if (active) statuses[i] = status;
        if (opcode == GPUIO_NVME_READ) {
            const unsigned int check = __ballot_sync(0xffffffffu, active && status == 0u);
            for (unsigned int k = 0; k < 32u; ++k) {
                if (((check >> k) & 1u) == 0u) continue;
                const unsigned long long first = __shfl_sync(0xffffffffu, lba, k) * block_bytes / 8ull;
                const ulonglong2* slot = (const ulonglong2*)(slots + k * bytes);
                for (unsigned long long p = lane; p < bytes / 16ull; p += 32ull) {
                    const ulonglong2 v = __ldcv(slot + p);
                    bad += (v.x != gpuio_word_at(seed, first + 2ull * p)) +
                           (v.y != gpuio_word_at(seed, first + 2ull * p + 1ull));
                }
            }
        }
    }
    if (bad != 0ull) atomicAdd(mismatches, bad);
}

// Sizes and offsets of the shared layouts as the device compiler sees them, one u64 each:
// struct size, then (offset, size) of chosen fields, in the order
// gpuio_hal::nvme::gpu::layout_words lists them.
#define GPUIO_NVME_FIELD(T, F)                                                     \
    {                                                                              \
        T obj;                                                                     \
        out[i++] = (unsigned long long)((const char*)&obj.F - (const char*)&obj); \
        out[i++] = (unsigned long long)sizeof(obj.F);                              \
    }
extern "C" __global__ void gpuio_nvme_layout(unsigned long long* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned int i = 0;
    out[i++] = sizeof(gpuio_nvme_sqe);
    GPUIO_NVME_FIELD(gpuio_nvme_sqe, nsid)
    GPUIO_NVME_FIELD(gpuio_nvme_sqe, prp1)
    GPUIO_NVME_FIELD(gpuio_nvme_sqe, prp2)
    GPUIO_NVME_FIELD(gpuio_nvme_sqe, cdw10)
    GPUIO_NVME_FIELD(gpuio_nvme_sqe, cdw12)
    out[i++] = sizeof(gpuio_nvme_cqe);
    GPUIO_NVME_FIELD(gpuio_nvme_cqe, sq_head)
    GPUIO_NVME_FIELD(gpuio_nvme_cqe, cid)
    GPUIO_NVME_FIELD(gpuio_nvme_cqe, status)
    out[i++] = sizeof(gpuio_nvme_queue);
    GPUIO_NVME_FIELD(gpuio_nvme_queue, sq)
    GPUIO_NVME_FIELD(gpuio_nvme_queue, cq)
    GPUIO_NVME_FIELD(gpuio_nvme_queue, sq_doorbell)
    GPUIO_NVME_FIELD(gpuio_nvme_queue, cq_doorbell)
    GPUIO_NVME_FIELD(gpuio_nvme_queue, state)
    GPUIO_NVME_FIELD(gpuio_nvme_queue, depth)
    GPUIO_NVME_FIELD(gpuio_nvme_queue, qid)
    GPUIO_NVME_FIELD(gpuio_nvme_queue, lists)
    GPUIO_NVME_FIELD(gpuio_nvme_queue, lists_iova)
    out[i++] = sizeof(gpuio_nvme_state);
    GPUIO_NVME_FIELD(gpuio_nvme_state, lock)
    GPUIO_NVME_FIELD(gpuio_nvme_state, sq_tail)
    GPUIO_NVME_FIELD(gpuio_nvme_state, cq_head)
    GPUIO_NVME_FIELD(gpuio_nvme_state, phase)
}
