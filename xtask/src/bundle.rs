//! `cargo xtask gpu-bundle`: release test and bench binaries for the GPU machine (which has
//! no cargo), with `run.sh`, the one command that runs them there. The executables travel
//! gzipped, and `run.sh` unpacks them: what travels must fit 64 MiB with the working tree, and
//! every binary that links gpuio-hal carries the embedded PTX. The Python binding travels as a
//! release wheel, with the wheels pytest needs.

use crate::{Result, build_tests, cargo, copy, listed_tests, make_executable, root, run};
use std::path::Path;

/// The bundle carried to the GPU machine: `bin/` (gpuio, xtask), `lib/` (gpuio's
/// `libcufile.so.0`) and `tests/` (every test binary), gzipped; NVIDIA's cuFile header
/// (`cufile-sdk/`, which gpuio-cufile's C test compiles against), and `run.sh` (the kernel
/// sources travel with the working tree).
pub fn gpu_bundle() -> Result {
    // The CLI's default build and the workspace's test build (gpuio-rdma is a member).
    crate::ci::ensure_packages(&[crate::ci::BUILD_PACKAGES, crate::ci::RDMA_PACKAGES].concat())?;
    let root = root();
    let out = root.join("target/gpu-bundle");
    let _ = std::fs::remove_dir_all(&out);
    for d in ["bin", "lib", "tests"] {
        std::fs::create_dir_all(out.join(d)).map_err(|e| format!("creating {d}: {e}"))?;
    }
    run(
        "build binaries",
        cargo().args([
            "build",
            "--profile",
            "bundle",
            "-p",
            "gpuio-cli",
            "-p",
            "gpuio-cufile",
            "-p",
            "xtask",
        ]),
    )?;
    // Where cargo put them: CARGO_TARGET_DIR where set (worktrees share one), else target/.
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), Into::into);
    for bin in ["gpuio", "xtask"] {
        copy(&target.join("bundle").join(bin), &out.join("bin").join(bin))?;
    }
    copy(
        &target.join("bundle/libcufile.so"),
        &out.join("lib/libcufile.so.0"),
    )?;
    let headers = crate::cufile::sdk()?.join("nvidia/cu13/include");
    let sdk = out.join("cufile-sdk/nvidia/cu13/include");
    std::fs::create_dir_all(&sdk).map_err(|e| format!("creating {}: {e}", sdk.display()))?;
    for h in ["cufile.h", "cuda.h"] {
        copy(&headers.join(h), &sdk.join(h))?;
    }
    let tests = build_tests(
        "build test binaries",
        &["--workspace", "--profile", "bundle"],
    )?;
    let mut count = 0;
    for t in tests {
        // These read the source tree, which does not travel, or test the network on hosts
        // the GPU machine lacks (etcd, namespaces), or attack an agent process over loopback,
        // or test the test support, or compile C against the source tree's header (the C
        // API), or need an RDMA device and link libibverbs, which the GPU machine need not
        // have (gpuio-rdma: `qemu-rdma` runs them); nothing in them needs a GPU (and the
        // bundle must stay under 64 MiB).
        if matches!(
            t.package.as_str(),
            "gpuio-tests"
                | "xtask"
                | "gpuio-transport-remoteio"
                | "gpuio-testkit"
                | "gpuio-capi"
                | "gpuio-rdma"
        ) {
            continue;
        }
        let name = format!("{}--{}", t.package, t.target);
        copy(&t.path, &out.join("tests").join(&name))?;
        count += 1;
        let skipped = SKIPPED_MODULES
            .iter()
            .filter(|(package, target, _)| *package == t.package && *target == t.target)
            .flat_map(|(_, _, modules)| modules.iter());
        let mut args = Vec::new();
        for module in skipped {
            // A module that is gone (renamed) would no longer be skipped: say so here.
            let filter = format!("{module}::");
            if listed_tests(&t.path, &filter)?.is_empty() {
                return Err(format!("{name} has no tests in `{filter}` to skip"));
            }
            args.push(format!("--skip {filter}"));
        }
        if !args.is_empty() {
            let file = out.join("tests").join(format!("{name}.args"));
            std::fs::write(&file, args.join(" ") + "\n")
                .map_err(|e| format!("writing {}: {e}", file.display()))?;
        }
    }
    bundle_python(&out.join("python"))?;
    for d in ["bin", "lib", "tests"] {
        gzip_all(&out.join(d))?;
    }
    let script = out.join("run.sh");
    std::fs::write(&script, RUN_SH).map_err(|e| format!("writing run.sh: {e}"))?;
    make_executable(&script)?;
    carry_iperf3(&out.join("iperf3"))?;
    let size = dir_size(&out);
    eprintln!(
        "bundle: {} ({count} test binaries), {:.1} MiB",
        out.display(),
        size as f64 / (1 << 20) as f64
    );
    // What travels is the bundle and the tracked working tree, 64 MiB at most.
    let tree = tracked_size();
    if size + tree > 63 << 20 {
        return Err(format!(
            "the bundle ({} MiB) and the working tree ({} MiB) are over the 64 MiB the GPU \
             machine takes (with a margin)",
            size >> 20,
            tree >> 20
        ));
    }
    Ok(())
}

/// The load suite's peers that the GPU machine lacks, for its Python (3.12, CUDA 13): kvikio
/// with its library and logger, and fastsafetensors (built for one Python version only).
const LOAD_PEER_WHEELS: &[&str] = &[
    "kvikio-cu13==26.10.0",
    "libkvikio-cu13==26.10.0",
    "rapids-logger==0.3.0",
    "fastsafetensors==0.5.0",
];

/// LMCache (the release built for the GPU machine's torch) and what it imports that the
/// machine lacks, for its Python 3.12: the connector's tests and the python bench's LMCache
/// cases run against the real package. 24 MiB, more than the bundle's room: they go to a
/// directory of their own (`target/gpu-lmcache`), carried with the python part only, beside
/// the bundle's `bin`, `python` and `run.sh` (run.sh's header says so). Pinned to what the
/// package index had (its only cffi for Python 3.12 is 2.0.0b1).
const LMCACHE_WHEELS: &[&str] = &[
    "lmcache==0.5.3",
    "nvtx==0.2.17",
    "cachetools==8.0.2",
    "msgspec==0.23.0",
    "cryptography==50.0.2",
    "cffi==2.0.0b1",
    "pycparser==3.12",
    "aiofile==3.12.3",
    "caio==0.12.10",
    "pyzmq==27.3.0",
];

/// Downloads [`LMCACHE_WHEELS`] into `dir` (emptied first).
fn bundle_lmcache(python: &Path, dir: &Path) -> Result {
    let _ = std::fs::remove_dir_all(dir);
    run(
        "download LMCache and its imports",
        std::process::Command::new(python)
            .args(["-m", "pip", "download", "--quiet", "--no-deps"])
            .args(["--only-binary=:all:", "--python-version", "3.12"])
            .args(["--platform", "manylinux_2_28_x86_64", "--dest"])
            .arg(dir)
            .args(LMCACHE_WHEELS)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
    )
}

/// The Python binding's release wheel in `dir`, in `dir/deps` the pure-Python wheels pytest
/// needs (the GPU machine has no network; its torch brings NumPy), and in `dir/peers` the load
/// suite's peers.
fn bundle_python(dir: &Path) -> Result {
    let python = crate::python::venv()?;
    crate::python::wheel(&python, true, dir)?;
    // Beside the bundle: `dir` is target/gpu-bundle/python.
    if let Some(target) = dir.parent().and_then(Path::parent) {
        bundle_lmcache(&python, &target.join("gpu-lmcache"))?;
    }
    run(
        "download the load suite's peers",
        std::process::Command::new(&python)
            .args(["-m", "pip", "download", "--quiet", "--no-deps"])
            .args(["--only-binary=:all:", "--python-version", "3.12"])
            .args(["--platform", "manylinux_2_28_x86_64", "--dest"])
            .arg(dir.join("peers"))
            .args(LOAD_PEER_WHEELS)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
    )?;
    run(
        "download pytest's wheels",
        std::process::Command::new(&python)
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
            ])
            .args([
                "--python-version",
                "3.11",
                "--platform",
                "any",
                "--implementation",
                "py",
            ])
            .arg("--dest")
            .arg(dir.join("deps"))
            .args(crate::python::PYTEST_WHEELS)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
    )
}

/// Gzips every executable in `dir` in place (`x` becomes `x.gz`; the `.args` files stay as
/// they are); `run.sh` unpacks them.
fn gzip_all(dir: &Path) -> Result {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_none_or(|x| x != "args"))
        .collect();
    files.sort();
    run(
        &format!("gzip {}", dir.display()),
        std::process::Command::new("gzip").arg("-f").args(&files),
    )
}

/// The one command the GPU machine runs (`xtask/run.sh`, in parts that fit a device call).
const RUN_SH: &str = include_str!("../run.sh");

/// Modules of bundled test binaries that `run.sh` skips, by package and test target: they test
/// the network on hosts the GPU machine lacks (etcd, namespaces) or attack an agent process
/// over loopback; nothing in them needs a GPU. The bundle writes them to `tests/<binary>.args`
/// (`--skip <module>::`), which run.sh adds to that binary's arguments.
const SKIPPED_MODULES: &[(&str, &str, &[&str])] = &[("gpuio-cli", "it", &["agent", "multinode"])];

fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_size(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

/// iperf3 (the TCP peer of `gpuio bench remote`) and the libraries of its own that a GPU
/// machine lacks, where this machine has it (`cargo xtask ci` installs it); run.sh puts the
/// folder on PATH and the loader's path.
fn carry_iperf3(to: &Path) -> Result {
    let bin = Path::new("/usr/bin/iperf3");
    if !bin.exists() {
        eprintln!("not carrying iperf3: it is not installed here");
        return Ok(());
    }
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    copy(bin, &to.join("iperf3"))?;
    for lib in crate::qemu::shared_libraries(bin)? {
        let name = lib.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(name) = name.filter(|n| n.starts_with("libiperf") || n.starts_with("libsctp")) {
            // The links resolved: a copy of the file the name points at.
            copy(&lib, &to.join(name))?;
        }
    }
    Ok(())
}

/// Bytes of the files git tracks (what travels to the GPU machine besides the bundle).
fn tracked_size() -> u64 {
    let listed = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root())
        .output();
    let Ok(listed) = listed else {
        return 0;
    };
    listed
        .stdout
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .filter_map(|p| std::fs::metadata(root().join(String::from_utf8_lossy(p).as_ref())).ok())
        .map(|m| m.len())
        .sum()
}
