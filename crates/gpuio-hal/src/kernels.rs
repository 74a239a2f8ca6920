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

/// Every source in `kernels/` that gpuio compiles at run time.
pub const ALL: &[KernelSource] = &[PATTERN];
