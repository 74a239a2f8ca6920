// Reports the request ring's shared layout as the device compiler sees it, for the GPU test
// that compares it with gpuio_hal::ring::layout(): for every struct and field (in the order of
// layout().fields) its offset and size, then every constant (in the order of
// layout().constants), one unsigned long long each, as RingLayout::words() lists them. The CI
// test of gpuio-hal reads the GPUIO_LAYOUT_* lines of this file and checks that they name the
// same fields and constants in the same order.
#ifndef GPUIO_RING_CUH
#include "gpuio_ring.cuh"
#endif

#define GPUIO_LAYOUT_STRUCT(T) \
    out[i++] = 0ull;           \
    out[i++] = (unsigned long long)sizeof(T);
// Offsets from the address of a real object: NVRTC has no offsetof.
#define GPUIO_LAYOUT_FIELD(T, F)                                                      \
    {                                                                                 \
        T obj;                                                                        \
        out[i++] = (unsigned long long)((const char*)&obj.F - (const char*)&obj);    \
        out[i++] = (unsigned long long)sizeof(obj.F);                                 \
    }
#define GPUIO_LAYOUT_CONST(C) out[i++] = (unsigned long long)(long long)(C);

// `out` needs room for RingLayout::words().len() values; one thread writes them all.
extern "C" __global__ void gpuio_ring_layout(unsigned long long* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned int i = 0;
    GPUIO_LAYOUT_STRUCT(gpuio_ring_header)
    GPUIO_LAYOUT_FIELD(gpuio_ring_header, magic)
    GPUIO_LAYOUT_FIELD(gpuio_ring_header, version)
    GPUIO_LAYOUT_FIELD(gpuio_ring_header, slots)
    GPUIO_LAYOUT_FIELD(gpuio_ring_header, state)
    GPUIO_LAYOUT_STRUCT(gpuio_ring_slot)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, status)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, inline_bytes)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, turn)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, op)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, resource)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, flags)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, offset)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, len)
    GPUIO_LAYOUT_FIELD(gpuio_ring_slot, dev_addr)
    GPUIO_LAYOUT_STRUCT(gpuio_ring)
    GPUIO_LAYOUT_FIELD(gpuio_ring, header)
    GPUIO_LAYOUT_FIELD(gpuio_ring, slots)
    GPUIO_LAYOUT_FIELD(gpuio_ring, claim)
    GPUIO_LAYOUT_FIELD(gpuio_ring, mask)
    GPUIO_LAYOUT_FIELD(gpuio_ring, nslots)
    GPUIO_LAYOUT_FIELD(gpuio_ring, bounce)
    GPUIO_LAYOUT_FIELD(gpuio_ring, bounce_bytes)
    GPUIO_LAYOUT_CONST(GPUIO_RING_MAGIC)
    GPUIO_LAYOUT_CONST(GPUIO_RING_VERSION)
    GPUIO_LAYOUT_CONST(GPUIO_RING_OPEN)
    GPUIO_LAYOUT_CONST(GPUIO_RING_STOPPING)
    GPUIO_LAYOUT_CONST(GPUIO_RING_CLOSED)
    GPUIO_LAYOUT_CONST(GPUIO_SLOT_FREE)
    GPUIO_LAYOUT_CONST(GPUIO_SLOT_POSTED)
    GPUIO_LAYOUT_CONST(GPUIO_SLOT_DONE)
    GPUIO_LAYOUT_CONST(GPUIO_SLOT_DONE_INLINE)
    GPUIO_LAYOUT_CONST(GPUIO_SLOT_DONE_BOUNCE)
    GPUIO_LAYOUT_CONST(GPUIO_SLOT_STATE_BITS)
    GPUIO_LAYOUT_CONST(GPUIO_RING_OP_READ)
    GPUIO_LAYOUT_CONST(GPUIO_RING_OP_WRITE)
    GPUIO_LAYOUT_CONST(GPUIO_RING_FLAG_DURABLE)
    GPUIO_LAYOUT_CONST(GPUIO_RING_FLAG_STAGE)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_GENERAL)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_NOMEM)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_INVALID_ARG)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_NOT_FOUND)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_TIMEOUT)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_IO)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_NETWORK)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_UNSUPPORTED)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_PERMISSION)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_BUSY)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_CANCELED)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_RING_UNREGISTERED)
    GPUIO_LAYOUT_CONST(GPUIO_ERROR_RING_SHUTDOWN)
}
