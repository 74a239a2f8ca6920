#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

use std::fmt::Display;

/// Something a test needs that a machine may lack. Each has its variable
/// ([`Requirement::var`]); the crate docs give the contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Requirement {
    /// A CUDA device and driver (`GPUIO_REQUIRE_CUDA`; the GPU bundle's `run.sh` sets it).
    Cuda,
    /// libnvrtc, which compiles the embedded kernels; no GPU needed (`GPUIO_REQUIRE_NVRTC`,
    /// implied by `GPUIO_REQUIRE_CUDA`).
    Nvrtc,
    /// cuFile, GPUDirect Storage (`GPUIO_REQUIRE_GDS`).
    Gds,
    /// An RDMA device, soft-RoCE in `cargo xtask qemu-rdma`'s guest (`GPUIO_REQUIRE_RDMA`).
    Rdma,
    /// The right to mount a FUSE file system, `/dev/fuse` (`GPUIO_REQUIRE_FUSE`).
    Fuse,
    /// An `etcd` binary for the multi-node tests (`GPUIO_REQUIRE_ETCD`).
    Etcd,
    /// A scratch file system that takes O_DIRECT (`GPUIO_REQUIRE_ODIRECT`).
    ODirect,
    /// An NVMe controller bound to vfio-pci, in `cargo xtask qemu-nvme`'s guest
    /// (`GPUIO_REQUIRE_NVME`).
    Nvme,
    /// The right to mount a small tmpfs, for full-disk tests (`GPUIO_REQUIRE_TMPFS`).
    Tmpfs,
    /// NVIDIA's `cufile.h`, `cuda.h` and `libcufile.so.0` from PyPI's wheels, which
    /// `cargo xtask ci` installs and names in `GPUIO_CUFILE_SDK` (`GPUIO_REQUIRE_CUFILESDK`).
    CufileSdk,
    /// NIXL's `libnixl_capi.so` and its UCX plugin, from PyPI's `nixl-cu13` wheel, which
    /// `cargo xtask ci` installs and names in `GPUIO_NIXL_LIB` (`GPUIO_REQUIRE_NIXL`).
    Nixl,
}

impl Requirement {
    /// Every requirement.
    pub const ALL: [Requirement; 11] = [
        Requirement::Cuda,
        Requirement::Nvrtc,
        Requirement::Gds,
        Requirement::Rdma,
        Requirement::Fuse,
        Requirement::Etcd,
        Requirement::ODirect,
        Requirement::Nvme,
        Requirement::Tmpfs,
        Requirement::CufileSdk,
        Requirement::Nixl,
    ];

    /// The variable that makes this requirement's absence a failure: `GPUIO_REQUIRE_<NAME>`.
    pub fn var(self) -> &'static str {
        match self {
            Requirement::Cuda => "GPUIO_REQUIRE_CUDA",
            Requirement::Nvrtc => "GPUIO_REQUIRE_NVRTC",
            Requirement::Gds => "GPUIO_REQUIRE_GDS",
            Requirement::Rdma => "GPUIO_REQUIRE_RDMA",
            Requirement::Fuse => "GPUIO_REQUIRE_FUSE",
            Requirement::Etcd => "GPUIO_REQUIRE_ETCD",
            Requirement::ODirect => "GPUIO_REQUIRE_ODIRECT",
            Requirement::Nvme => "GPUIO_REQUIRE_NVME",
            Requirement::Tmpfs => "GPUIO_REQUIRE_TMPFS",
            Requirement::CufileSdk => "GPUIO_REQUIRE_CUFILESDK",
            Requirement::Nixl => "GPUIO_REQUIRE_NIXL",
        }
    }

    /// The requirements whose variable also requires this one (CUDA implies NVRTC).
    fn implied_by(self) -> &'static [Requirement] {
        match self {
            Requirement::Nvrtc => &[Requirement::Cuda],
            _ => &[],
        }
    }

    /// Whether this process must not skip for want of this requirement: its variable, or that
    /// of a requirement implying it, is `1`.
    pub fn required(self) -> bool {
        self.required_by(|v| std::env::var(v).ok()).is_some()
    }

    /// Says that this requirement is missing here, and why (`reason`): a failure (a panic at
    /// the caller) where it is [required](Requirement::required), otherwise a note on stderr
    /// (`skipped: <reason>`). The caller then skips what needs it, typically by returning.
    #[track_caller]
    pub fn missing(self, reason: impl Display) {
        if let Err(message) = self.judge(|v| std::env::var(v).ok(), &reason) {
            panic!("{message}");
        }
        eprintln!(
            "skipped: {reason} (set {}=1 to make this a failure)",
            self.var()
        );
    }

    /// The variable that requires this, as `lookup` reads the environment.
    fn required_by(self, lookup: impl Fn(&str) -> Option<String>) -> Option<&'static str> {
        std::iter::once(self)
            .chain(self.implied_by().iter().copied())
            .map(Requirement::var)
            .find(|v| lookup(v).as_deref() == Some("1"))
    }

    /// What [`Requirement::missing`] decides: `Err` with the failure's message where the
    /// requirement is required.
    fn judge(
        self,
        lookup: impl Fn(&str) -> Option<String>,
        reason: &dyn Display,
    ) -> Result<(), String> {
        match self.required_by(lookup) {
            None => Ok(()),
            Some(var) if var == self.var() => Err(format!("{var}=1, but {reason}")),
            Some(var) => Err(format!("{var}=1 (which requires {self:?}), but {reason}")),
        }
    }
}

/// A tmpfs of a given size mounted on a fresh directory, unmounted when dropped: a file
/// system that fills up, for tests of full disks.
#[derive(Debug)]
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (as mount's `size=` option takes it: `1m`, `4m`) on a new
    /// directory; `None` where mounting is refused ([`Requirement::Tmpfs`] says so, or
    /// fails).
    #[track_caller]
    pub fn mount(size: &str) -> Option<Self> {
        let dir = tempfile::tempdir().ok()?;
        let out = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Self { dir }),
            Ok(o) => {
                let why = String::from_utf8_lossy(&o.stderr).trim().to_string();
                Requirement::Tmpfs.missing(format!("cannot mount a tmpfs: {why}"));
                None
            }
            Err(e) => {
                Requirement::Tmpfs.missing(format!("cannot run mount: {e}"));
                None
            }
        }
    }

    /// Where it is mounted.
    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |v| {
            pairs
                .iter()
                .find(|(k, _)| *k == v)
                .map(|(_, x)| x.to_string())
        }
    }

    #[test]
    fn only_one_requires() {
        for r in Requirement::ALL {
            assert_eq!(r.required_by(env(&[])), None);
            for value in ["0", "", "true", "yes", " 1", "1 "] {
                let lookup = move |v: &str| (v == r.var()).then(|| value.to_string());
                assert_eq!(r.required_by(lookup), None, "{r:?} with {value:?}");
            }
            let lookup = move |v: &str| (v == r.var()).then(|| "1".to_string());
            assert_eq!(r.required_by(lookup), Some(r.var()));
        }
    }

    #[test]
    fn variables_are_named_after_the_requirement() {
        for r in Requirement::ALL {
            let name = format!("{r:?}").to_uppercase();
            assert_eq!(r.var(), format!("GPUIO_REQUIRE_{name}"));
        }
    }

    #[test]
    fn cuda_implies_nvrtc_and_nothing_else_implies_anything() {
        let cuda = env(&[("GPUIO_REQUIRE_CUDA", "1")]);
        assert_eq!(
            Requirement::Nvrtc.required_by(&cuda),
            Some("GPUIO_REQUIRE_CUDA")
        );
        for r in Requirement::ALL {
            let only_this = move |v: &str| (v == r.var()).then(|| "1".to_string());
            for other in Requirement::ALL.into_iter().filter(|o| *o != r) {
                let implied = r == Requirement::Cuda && other == Requirement::Nvrtc;
                assert_eq!(
                    other.required_by(only_this).is_some(),
                    implied,
                    "{r:?} -> {other:?}"
                );
            }
        }
    }

    #[test]
    fn a_missing_requirement_fails_only_where_required() {
        let reason = "no RDMA device";
        assert_eq!(Requirement::Rdma.judge(env(&[]), &reason), Ok(()));
        let err = Requirement::Rdma
            .judge(env(&[("GPUIO_REQUIRE_RDMA", "1")]), &reason)
            .unwrap_err();
        assert_eq!(err, "GPUIO_REQUIRE_RDMA=1, but no RDMA device");
        let err = Requirement::Nvrtc
            .judge(env(&[("GPUIO_REQUIRE_CUDA", "1")]), &"libnvrtc not found")
            .unwrap_err();
        assert!(
            err.starts_with("GPUIO_REQUIRE_CUDA=1 (which requires Nvrtc)"),
            "{err}"
        );
    }
}
