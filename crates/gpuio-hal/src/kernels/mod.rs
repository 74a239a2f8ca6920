//! The device-side code in `kernels/`, embedded three times, each the fallback of the one
//! before (all built ahead of time by nvcc into `crates/gpuio-hal/ptx/` by `cargo xtask ptx
//! --write`, but the source):
//! - machine code (cubins) for Hopper and Blackwell, which the driver loads as it is: no
//!   compile at all, so a process's first kernel costs no JIT even where the driver's JIT cache
//!   is empty (a machine's first run, a fresh container, `CUDA_CACHE_DISABLE=1`);
//! - PTX, which the driver JIT-compiles for the device it finds (other architectures);
//! - CUDA C source, which NVRTC compiles at run time where no embedded PTX fits the device or
//!   the driver refuses it (a driver older than the PTX ISA, say).
//!
//! A binary therefore needs only the driver to run every kernel, and NVRTC only as the last
//! fallback.
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
    /// The machine code nvcc built from `source` ahead of time, one per architecture of
    /// [`CUBIN_ARCHS`], oldest first.
    pub cubins: &'static [EmbeddedCubin],
}

/// Machine code built ahead of time for one real architecture.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddedCubin {
    /// The architecture as major × 10 + minor: 90 is `sm_90`.
    pub arch: u32,
    /// The cubin (an ELF image) as nvcc wrote it.
    pub image: &'static [u8],
    /// What it was built from: `gpuio-cubin: <module> sm_<arch> source-fnv1a64 <hash>
    /// image-fnv1a64 <hash>`, written beside it, so that a test can tell a stale cubin without
    /// a compiler.
    pub stamp: &'static str,
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

/// The real architectures every module's machine code is built for (major × 10 + minor): the
/// datacenter GPUs gpuio is measured on. A cubin runs on devices of its major version and a
/// minor version at least its own; the others JIT-compile the PTX.
pub const CUBIN_ARCHS: &[u32] = &[90, 100];

/// The 64-bit FNV-1a hash of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

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

    /// The embedded machine code that runs on a device of compute capability `cc`: of its
    /// major version, and the newest whose minor version is not above the device's.
    pub fn cubin_for(&self, cc: (u32, u32)) -> Option<&'static EmbeddedCubin> {
        self.cubins
            .iter()
            .filter(|c| c.arch / 10 == cc.0 && c.arch % 10 <= cc.1)
            .max_by_key(|c| c.arch)
    }

    /// The 64-bit FNV-1a hash of [`source`](Self::source): what the first line of each of its
    /// PTX files (and each cubin's stamp) records as `source-fnv1a64`, so that a test can tell
    /// stale device code without a compiler.
    pub fn source_hash(&self) -> u64 {
        fnv1a64(self.source.as_bytes())
    }
}

/// Where a loaded kernel module's device code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelOrigin {
    /// The embedded machine code for `sm_<arch>`, loaded as it is.
    EmbeddedCubin {
        /// Its architecture (major × 10 + minor).
        arch: u32,
    },
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
            Self::EmbeddedCubin { arch } => write!(f, "embedded sm_{arch} machine code"),
            Self::EmbeddedPtx { arch } => write!(f, "embedded compute_{arch} PTX"),
            Self::Nvrtc => f.write_str("NVRTC"),
        }
    }
}

/// One way of loading a module, for measuring it alone ([`crate::Gpu::time_kernel_load`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPath {
    /// The embedded machine code for the device, loaded by the driver.
    EmbeddedCubin,
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
    /// NVRTC's compile (zero for embedded code).
    pub compile: Duration,
    /// The driver loading the code (`cuModuleLoadData`, which JIT-compiles PTX unless the
    /// driver's JIT cache has it) and looking up every function.
    pub load: Duration,
}

impl KernelLoad {
    /// Compile and load together: what first use of the module costs.
    pub fn total(&self) -> Duration {
        self.compile + self.load
    }
}

/// What is wrong with the embedded device code of `modules` (a crate's `MODULES`, whose files
/// live in `ptx_dir` as the messages name it): a module without PTX for every architecture of
/// [`PTX_ARCHS`] or a cubin for every one of [`CUBIN_ARCHS`], a file built from another source
/// than the module embeds now (the hash a PTX file's first line or a cubin's stamp records),
/// a PTX file that does not target its architecture, lacks a function or holds a NUL byte, a
/// cubin that is not an ELF image, names none of the functions, or is not the image its stamp
/// hashed. Empty when all is well: each crate that carries kernels runs this in its tests,
/// which need no compiler (`cargo xtask ptx --check` compares whole files).
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
        problems.extend(cubin_problems(src, stem, ptx_dir));
    }
    problems
}

/// [`embedded_ptx_problems`] for one module's cubins.
fn cubin_problems(src: &KernelSource, stem: &str, ptx_dir: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let archs: Vec<u32> = src.cubins.iter().map(|c| c.arch).collect();
    if archs != CUBIN_ARCHS {
        problems.push(format!(
            "{}: cubins for {archs:?}, not {CUBIN_ARCHS:?}",
            src.name
        ));
    }
    for cubin in src.cubins {
        let path = format!("{ptx_dir}/{stem}.sm_{}.cubin", cubin.arch);
        let want = format!(
            "gpuio-cubin: {} sm_{} source-fnv1a64 {:016x} image-fnv1a64 {:016x}",
            src.name,
            cubin.arch,
            src.source_hash(),
            fnv1a64(cubin.image)
        );
        if cubin.stamp.trim_end() != want {
            problems.push(format!(
                "{path} was built from another source than the module holds now, or is not \
                 the image its stamp names (the stamp: {:?}; now: {want:?})",
                cubin.stamp.trim_end()
            ));
        }
        if !cubin.image.starts_with(b"\x7fELF") {
            problems.push(format!("{path} is not an ELF image"));
        }
        // The string table names every kernel it defines, each name ending in a NUL (so
        // `gpuio_gather_1` is not found inside `gpuio_gather_16`).
        for f in src.functions {
            let name = [f.as_bytes(), b"\0"].concat();
            if !cubin.image.windows(name.len()).any(|w| w == name) {
                problems.push(format!("{path} does not define {f}"));
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
    fn machine_code_of_the_device_major_version_and_no_newer_minor_is_chosen() {
        let arch = |cc| PATTERN.cubin_for(cc).map(|c| c.arch);
        assert_eq!(arch((8, 0)), None, "Ampere runs the PTX");
        assert_eq!(arch((9, 0)), Some(90));
        assert_eq!(arch((9, 1)), Some(90));
        assert_eq!(arch((10, 0)), Some(100));
        assert_eq!(arch((10, 3)), Some(100));
        assert_eq!(arch((12, 0)), None, "a newer major version runs the PTX");
        for m in MODULES {
            assert!(
                m.cubins.iter().all(|c| CUBIN_ARCHS.contains(&c.arch)),
                "{}",
                m.name
            );
        }
    }

    #[test]
    fn a_cubin_that_is_not_its_stamps_image_is_a_problem() {
        let good = PIECES.cubins[0];
        let src = |cubins: &'static [EmbeddedCubin]| KernelSource { cubins, ..PIECES };
        let stem = "pieces";
        assert!(cubin_problems(&src(PIECES.cubins), stem, "ptx").is_empty());
        let other: &'static [EmbeddedCubin] = Box::leak(Box::new([
            EmbeddedCubin {
                image: PATTERN.cubins[0].image,
                ..good
            },
            PIECES.cubins[1],
        ]));
        let problems = cubin_problems(&src(other), stem, "ptx");
        assert!(problems.iter().any(|p| p.contains("stamp")), "{problems:?}");
        assert!(
            problems.iter().any(|p| p.contains("does not define")),
            "{problems:?}"
        );
        let one: &'static [EmbeddedCubin] = Box::leak(Box::new([good]));
        assert!(cubin_problems(&src(one), stem, "ptx")[0].contains("cubins for [90]"));
    }

    #[test]
    fn the_source_hash_is_fnv1a() {
        let empty = KernelSource {
            name: "x.cu",
            source: "",
            functions: &[],
            ptx: &[],
            cubins: &[],
        };
        assert_eq!(empty.source_hash(), 0xcbf2_9ce4_8422_2325);
        let a = KernelSource {
            source: "a",
            ..empty
        };
        assert_eq!(a.source_hash(), 0xaf63_dc4c_8601_ec8c);
    }
}
