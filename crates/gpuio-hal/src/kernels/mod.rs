//! The device-side code in `kernels/`, embedded twice: as PTX that nvcc built ahead of time
//! (`crates/gpuio-hal/ptx/`, written by `cargo xtask ptx --write`), which the driver loads and
//! JIT-compiles for the device it finds, and as CUDA C source, which NVRTC compiles at run time
//! where no embedded PTX fits the device or the driver refuses it (a driver older than the PTX
//! ISA, say). A binary therefore needs only the driver to run every kernel, and NVRTC only as
//! the fallback.
//!
//! A crate that carries kernels lists its modules in its `kernels.toml`; `cargo xtask ptx
//! --write` builds their PTX and writes the Rust that embeds them (`modules.rs` here): a
//! [`KernelSource`] static per module and an enum naming its functions, which implements
//! [`Kernel`], so that code launches a kernel by name. `cargo xtask ptx --check` (CI) checks
//! that the embedded PTX and Rust are what the manifest and nvcc give now; the first line of
//! each PTX file records a hash of the source it was built from, which this crate's tests
//! compare with [`KernelSource::source_hash`] without a compiler.

use std::fmt;
use std::time::Duration;

#[rustfmt::skip]
mod modules;
pub use modules::*;

/// One function of a kernel module, named by the module's generated enum.
pub trait Kernel: Copy + fmt::Debug + Send + Sync + 'static {
    /// The module that defines it.
    fn module() -> &'static KernelSource;

    /// Its position in the module's [`functions`](KernelSource::functions).
    fn index(self) -> usize;

    /// Its name in the source.
    fn name(self) -> &'static str {
        Self::module().functions[self.index()]
    }
}

/// A CUDA C source file of `kernels/` (with the headers it uses in front): one module.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name within `kernels/`.
    pub name: &'static str,
    /// The source text, as NVRTC compiles it.
    pub source: &'static str,
    /// The `extern "C"` kernels it defines.
    pub functions: &'static [&'static str],
    /// The PTX nvcc built from `source` ahead of time, one per architecture of [`PTX_ARCHS`],
    /// oldest first.
    pub ptx: &'static [EmbeddedPtx],
}

/// PTX built ahead of time for one virtual architecture.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedPtx {
    /// The virtual architecture as major × 10 + minor: 80 is `compute_80`.
    pub arch: u32,
    /// The PTX text: a line naming the source and its hash, then nvcc's output.
    pub text: &'static str,
}

/// The virtual architectures every module's PTX is built for (major × 10 + minor).
///
/// `compute_80` covers Ampere and Hopper: the kernels use nothing newer than sm_70 (acquire and
/// release loads, `__nanosleep`), and nvcc's `compute_90` PTX of them differs from
/// `compute_80`'s only in its `.target` line, so the driver's JIT makes the same code for
/// sm_90 from either. `compute_100` is there because CUDA 13 compiles Blackwell targets with a
/// newer front end, so its PTX is not the same code: Blackwell devices get what NVRTC would
/// give them.
pub const PTX_ARCHS: &[u32] = &[80, 100];

impl KernelSource {
    /// The newest embedded PTX that a device of compute capability `cc` can load (whose
    /// architecture is not above the device's), or `None` where the device predates them all.
    pub fn ptx_for(&self, cc: (u32, u32)) -> Option<&'static EmbeddedPtx> {
        let device = cc.0 * 10 + cc.1;
        self.ptx
            .iter()
            .filter(|p| p.arch <= device)
            .max_by_key(|p| p.arch)
    }

    /// The 64-bit FNV-1a hash of [`source`](Self::source): what the first line of each of its
    /// PTX files records as `source-fnv1a64`, so that a test can tell stale PTX without a
    /// compiler.
    pub fn source_hash(&self) -> u64 {
        self.source.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

/// Where a loaded kernel module's device code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelOrigin {
    /// The embedded PTX for `compute_<arch>`, JIT-compiled by the driver.
    EmbeddedPtx {
        /// Its virtual architecture (major × 10 + minor).
        arch: u32,
    },
    /// The source, compiled by NVRTC at run time (then JIT-compiled by the driver).
    Nvrtc,
}

impl fmt::Display for KernelOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EmbeddedPtx { arch } => write!(f, "embedded compute_{arch} PTX"),
            Self::Nvrtc => f.write_str("NVRTC"),
        }
    }
}

/// One way of loading a module, for measuring it alone ([`crate::Gpu::time_kernel_load`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPath {
    /// The newest embedded PTX that fits the device, loaded by the driver.
    EmbeddedPtx,
    /// NVRTC compiling the source for the device, then the driver loading its PTX.
    Nvrtc,
}

/// What loading a fresh copy of a module took ([`crate::Gpu::time_kernel_load`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelLoad {
    /// Where the code came from.
    pub origin: KernelOrigin,
    /// NVRTC's compile (zero for embedded PTX).
    pub compile: Duration,
    /// The driver loading the PTX (`cuModuleLoadData`, which JIT-compiles it unless the
    /// driver's JIT cache has it) and looking up every function.
    pub load: Duration,
}

impl KernelLoad {
    /// Compile and load together: what first use of the module costs.
    pub fn total(&self) -> Duration {
        self.compile + self.load
    }
}

/// What is wrong with the embedded PTX of `modules` (a crate's `MODULES`, whose PTX lives in
/// `ptx_dir` as the messages name it): a module without PTX for every architecture of
/// [`PTX_ARCHS`], a file built from another source than the module embeds now (the hash its
/// first line records), one that does not target its architecture or lacks a function, or
/// one with a NUL byte. Empty when all is well: each crate that carries kernels runs this in
/// its tests, which need no compiler (`cargo xtask ptx --check` compares whole files).
pub fn embedded_ptx_problems(modules: &[&KernelSource], ptx_dir: &str) -> Vec<String> {
    let mut problems = Vec::new();
    if modules.is_empty() {
        problems.push("no kernel modules".into());
    }
    for src in modules {
        let archs: Vec<u32> = src.ptx.iter().map(|p| p.arch).collect();
        if archs != PTX_ARCHS {
            problems.push(format!(
                "{}: PTX for {archs:?}, not {PTX_ARCHS:?}",
                src.name
            ));
        }
        let stem = src.name.strip_suffix(".cu").unwrap_or(src.name);
        for ptx in src.ptx {
            let path = format!("{ptx_dir}/{stem}.compute_{}.ptx", ptx.arch);
            let want = format!(
                "// gpuio-ptx: {} compute_{} source-fnv1a64 {:016x}",
                src.name,
                ptx.arch,
                src.source_hash()
            );
            let first = ptx.text.lines().next().unwrap_or("");
            if first != want {
                problems.push(format!(
                    "{path} was built from another source than the module holds now (its \
                     first line: {first:?})"
                ));
            }
            if ptx.text.contains('\0') {
                problems.push(format!("{path} contains a NUL byte"));
            }
            let target = format!(".target sm_{}", ptx.arch);
            if !ptx.text.lines().any(|l| l.trim() == target) {
                problems.push(format!("{path} lacks {target:?}"));
            }
            for f in src.functions {
                if !ptx.text.contains(&format!(".entry {f}(")) {
                    problems.push(format!("{path} does not define {f}"));
                }
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_are_found_by_name() {
        assert_eq!(GatherKernel::OrderPlace.name(), "gpuio_order_place");
        assert_eq!(PatternKernel::FindMismatch.name(), "gpuio_find_mismatch");
        assert!(std::ptr::eq(PatternKernel::module(), &PATTERN));
        for m in MODULES {
            assert!(
                m.ptx.iter().all(|p| PTX_ARCHS.contains(&p.arch)),
                "{}",
                m.name
            );
        }
    }

    #[test]
    fn the_newest_ptx_not_above_the_device_is_chosen() {
        let arch = |cc| PATTERN.ptx_for(cc).map(|p| p.arch);
        assert_eq!(arch((7, 5)), None, "Turing predates every embedded PTX");
        assert_eq!(arch((8, 0)), Some(80));
        assert_eq!(arch((8, 9)), Some(80));
        assert_eq!(arch((9, 0)), Some(80));
        assert_eq!(arch((10, 0)), Some(100));
        assert_eq!(arch((12, 0)), Some(100));
    }

    #[test]
    fn the_source_hash_is_fnv1a() {
        let empty = KernelSource {
            name: "x.cu",
            source: "",
            functions: &[],
            ptx: &[],
        };
        assert_eq!(empty.source_hash(), 0xcbf2_9ce4_8422_2325);
        let a = KernelSource {
            source: "a",
            ..empty
        };
        assert_eq!(a.source_hash(), 0xaf63_dc4c_8601_ec8c);
    }
}
