// Strided pieces of one device's memory copied into another range of it, all in one launch
// (Stream::copy_pieces, crates/gpuio-hal/src/gpu/pieces.rs, which lays out gpuio_piece the
// same way). A tensor-parallel load sends each device its part of every tensor: thousands of
// pieces, many of them narrow rows (a split along the last dim of a [32768, 256] BF16 tensor
// is 32768 rows of 256 bytes), which the copy engine's 2D copies move far below the memory's
// rate. Here a warp copies one segment (at most `segment` bytes of one row) at a time, in the
// widest word the segment's addresses and length allow.

typedef unsigned long long u64;

struct gpuio_piece {
    u64 src;        // device address of the piece's first source row
    u64 dst;        // device address of its first destination row
    u64 src_pitch;  // bytes from one source row's start to the next's
    u64 dst_pitch;
    u64 width;      // bytes a row (> 0)
    u64 first;      // the piece's first segment among all pieces' (ascending; rows of
                    // ceil(width / segment) segments each)
};
static_assert(sizeof(gpuio_piece) == 48, "gpuio_piece");
#ifndef __CUDACC_RTC__  // NVRTC has no offsetof; nvcc checks the fields for both
static_assert(__builtin_offsetof(gpuio_piece, width) == 32, "gpuio_piece.width");
static_assert(__builtin_offsetof(gpuio_piece, first) == 40, "gpuio_piece.first");
#endif

template <typename W>
__device__ __forceinline__ void gpuio_copy_words(u64 src, u64 dst, u64 len, unsigned lane) {
    const W* s = (const W*)src;
    W* d = (W*)dst;
    const u64 n = len / sizeof(W);
    for (u64 i = lane; i < n; i += 32) d[i] = s[i];
}

// Copies segments 0..segments of pieces[0..count) (count > 0; the last piece's segments end
// at `segments`), a warp per segment, grid-stride.
extern "C" __global__ void gpuio_copy_pieces(const gpuio_piece* pieces, unsigned count,
                                             u64 segments, u64 segment) {
    const unsigned lane = threadIdx.x & 31u;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 g = (((u64)blockIdx.x * blockDim.x) + threadIdx.x) >> 5; g < segments;
         g += warps) {
        // The last piece whose first segment is at or before g.
        unsigned lo = 0, hi = count - 1;
        while (lo < hi) {
            const unsigned mid = lo + ((hi - lo + 1) >> 1);
            if (pieces[mid].first <= g) lo = mid; else hi = mid - 1;
        }
        const gpuio_piece p = pieces[lo];
        const u64 per_row = (p.width + segment - 1) / segment;
        const u64 k = g - p.first;
        const u64 row = k / per_row, at = (k % per_row) * segment;
        const u64 len = p.width - at < segment ? p.width - at : segment;
        const u64 src = p.src + row * p.src_pitch + at, dst = p.dst + row * p.dst_pitch + at;
        const u64 align = src | dst | len;
        if ((align & 15) == 0) gpuio_copy_words<uint4>(src, dst, len, lane);
        else if ((align & 7) == 0) gpuio_copy_words<u64>(src, dst, len, lane);
        else if ((align & 3) == 0) gpuio_copy_words<unsigned>(src, dst, len, lane);
        else if ((align & 1) == 0) gpuio_copy_words<unsigned short>(src, dst, len, lane);
        else gpuio_copy_words<unsigned char>(src, dst, len, lane);
    }
}
