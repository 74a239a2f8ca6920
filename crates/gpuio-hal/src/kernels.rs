//! The device-side sources in `kernels/`, embedded so that a binary carries them and NVRTC can
//! compile them at run time for the device it finds.

/// A CUDA C source file of `kernels/`.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name within `kernels/`.
    pub name: &'static str,
    /// The source text.
    pub source: &'static str,
    /// The `extern "C"` kernels it defines.
    pub functions: &'static [&'static str],
}

/// `kernels/pattern.cu`: the data pattern fill and the on-device compare.
pub const PATTERN: KernelSource = KernelSource {
    name: "pattern.cu",
    source: include_str!("../../../kernels/pattern.cu"),
    functions: &["gpuio_fill_pattern", "gpuio_find_mismatch"],
};

/// `kernels/gather.cu` with the device header `gpuio.cuh` (and the ring header it includes)
/// in front: the row gather and scatter kernels, the naive baseline, and the sorted gather's
/// ordering kernels.
pub const GATHER: KernelSource = KernelSource {
    name: "gather.cu",
    source: concat!(
        include_str!("../../../kernels/gpuio_ring.cuh"),
        include_str!("../../../kernels/gpuio.cuh"),
        include_str!("../../../kernels/gather.cu")
    ),
    functions: &[
        "gpuio_gather_16",
        "gpuio_gather_8",
        "gpuio_gather_4",
        "gpuio_gather_1",
        "gpuio_scatter_16",
        "gpuio_scatter_8",
        "gpuio_scatter_4",
        "gpuio_scatter_1",
        "gpuio_gather_naive",
        "gpuio_gather_ordered_16",
        "gpuio_gather_ordered_8",
        "gpuio_gather_ordered_4",
        "gpuio_gather_ordered_1",
        "gpuio_order_count",
        "gpuio_order_scan_blocks",
        "gpuio_order_scan_sums",
        "gpuio_order_place",
    ],
};

/// `kernels/ring_bench.cu` and `ring_layout.cu` with the ring header in front: kernels
/// issuing reads through the request ring (many threads, and one thread timing round trips),
/// and the layout report the GPU test compares with [`crate::ring::layout()`].
pub const RING_BENCH: KernelSource = KernelSource {
    name: "ring_bench.cu",
    source: concat!(
        include_str!("../../../kernels/gpuio_ring.cuh"),
        include_str!("../../../kernels/ring_bench.cu"),
        include_str!("../../../kernels/ring_layout.cu")
    ),
    functions: &[
        "gpuio_ring_read_blocks",
        "gpuio_ring_ping",
        "gpuio_ring_layout",
    ],
};

/// Every source in `kernels/` that gpuio compiles at run time.
pub const ALL: &[KernelSource] = &[PATTERN, GATHER, RING_BENCH];
