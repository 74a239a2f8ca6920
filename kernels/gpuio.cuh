// gpuio device header: what user kernels include to start IO themselves.
//
// - Zero-copy row access: gpuio_gather_rows / gpuio_scatter_rows, in gpuio_rows.cuh.
// - The GPU->host request ring: gpuio_read_async / gpuio_write_async / gpuio_poll / gpuio_wait /
//   gpuio_read, in gpuio_ring.cuh.
// - On-demand arrays: gpuio_array<T> over a page cache in GPU memory, in gpuio_array.cuh.
//
// Built without include paths or standard headers (nvcc ahead of time to PTX, NVRTC at run time
// as the fallback): gpuio puts the headers' text before the sources that use them
// (gpuio_ring::DEVICE_HEADER), so every `#include` of a gpuio header sits inside its guard.
#ifndef GPUIO_CUH
#define GPUIO_CUH

#ifndef GPUIO_RING_CUH
#include "gpuio_ring.cuh"
#endif
#ifndef GPUIO_ARRAY_CUH
#include "gpuio_array.cuh"
#endif
#ifndef GPUIO_ROWS_CUH
#include "gpuio_rows.cuh"
#endif

#endif  // GPUIO_CUH
