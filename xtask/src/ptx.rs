//! `cargo xtask ptx`: every kernel compiled for every target architecture by nvcc (`.cu` files
//! of `kernels/` to cubin: the front end and ptxas). With `--wheels` (CI) it also runs
//! gpuio-hal's `kernels` test, which compiles the sources gpuio embeds with NVRTC as gpuio does
//! at run time; on the GPU machine that test runs with the others. No GPU is needed to
//! compile, so CI runs it with CUDA 13.0's compilers from PyPI.

use crate::{Result, cargo, has, root, run, run_tests};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The architectures every kernel must build for: Ampere, Hopper, Blackwell.
const ARCHS: &[&str] = &["sm_80", "sm_90", "sm_100"];

/// CUDA 13.0's compilers as PyPI wheels (the GPU machine's toolkit version), pinned so that
/// CI checks what the GPU machine compiles. nvcc needs nvvm (cicc), crt and the runtime's
/// headers beside it.
const WHEELS: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-nvrtc==13.0.88",
];

/// Set in the child that runs with the wheels' libraries on its loader path.
const WHEELS_ENV: &str = "GPUIO_XTASK_CUDA_WHEELS";

struct Options {
    kernels: PathBuf,
    archs: Vec<String>,
    /// Install the compilers from PyPI where missing, and fail if either is still missing.
    wheels: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut opts = Options {
        kernels: root().join("kernels"),
        archs: Vec::new(),
        wheels: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--kernels" => opts.kernels = it.next().ok_or("--kernels needs a directory")?.into(),
            "--arch" => opts
                .archs
                .push(it.next().ok_or("--arch needs e.g. sm_90")?.clone()),
            "--wheels" => opts.wheels = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if opts.archs.is_empty() {
        opts.archs = ARCHS.iter().map(|a| a.to_string()).collect();
    }
    if let Some(bad) = opts.archs.iter().find(|a| arch_number(a).is_none()) {
        return Err(format!("--arch {bad}: expected sm_<number>, e.g. sm_90"));
    }
    Ok(opts)
}

fn arch_number(arch: &str) -> Option<&str> {
    arch.strip_prefix("sm_")
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Compiles every kernel for every architecture with every compiler present; fails if one
/// rejects a source, and (with `--wheels`) if a compiler could not be had.
pub fn ptx(args: &[String]) -> Result {
    let opts = parse(args)?;
    if opts.wheels && std::env::var_os(WHEELS_ENV).is_none() {
        return rerun_with_wheels(args);
    }
    let mut failed = Vec::new();
    if has("nvcc", "--version") {
        failed.extend(nvcc(&opts)?);
    } else if opts.wheels {
        failed.push("nvcc did not run, although --wheels installed it".into());
    } else {
        eprintln!("skipped nvcc: nvcc is not on PATH");
    }
    if opts.wheels {
        // NVRTC, as gpuio compiles the embedded sources, for every architecture.
        let nvrtc = run_tests(
            "NVRTC over the embedded kernels (gpuio-hal's kernels tests)",
            cargo()
                .args(["test", "-p", "gpuio-hal", "--test", "it", "--", "kernels::"])
                .env("GPUIO_REQUIRE_NVRTC", "1"),
        );
        if let Err(e) = nvrtc {
            failed.push(e);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// nvcc over every `.cu` in the kernels directory, to cubin (so ptxas runs too).
fn nvcc(opts: &Options) -> Result<Vec<String>> {
    let tmp = std::env::temp_dir().join(format!("gpuio-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&opts.kernels)
        .map_err(|e| format!("{}: {e}", opts.kernels.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    if sources.is_empty() {
        return Err(format!("no .cu files in {}", opts.kernels.display()));
    }
    let mut failed = Vec::new();
    for arch in &opts.archs {
        for src in &sources {
            let name = src.file_stem().unwrap_or_default().to_string_lossy();
            let out = tmp.join(format!("{name}.{arch}.cubin"));
            let what = format!("nvcc -arch={arch} {}", src.display());
            let mut cmd = Command::new("nvcc");
            cmd.args(["-arch", arch, "-cubin", "-o"]).arg(&out).arg(src);
            if run(&what, &mut cmd).is_err() {
                failed.push(what);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(failed)
}

/// Installs the pinned wheels under `target/cuda-wheels` (once) and runs this task again with
/// their nvcc on `PATH` and their libnvrtc on the loader's path (read only at process start).
fn rerun_with_wheels(args: &[String]) -> Result {
    let dir = root().join("target/cuda-wheels");
    let stamp = dir.join("installed");
    let want = WHEELS.join("\n");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(want.as_str()) {
        let _ = std::fs::remove_dir_all(&dir);
        let python = ["python3", "python"]
            .into_iter()
            .find(|p| has(p, "--version"))
            .ok_or("--wheels needs python3 with pip")?;
        let mut pip = Command::new(python);
        pip.args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(&dir)
            .args(WHEELS)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
            .env("PIP_ROOT_USER_ACTION", "ignore");
        run("install CUDA 13.0's nvcc and NVRTC from PyPI", &mut pip)?;
        std::fs::write(&stamp, &want).map_err(|e| format!("{}: {e}", stamp.display()))?;
    }
    let cuda = dir.join("nvidia/cu13");
    let path = prepend(&cuda.join("bin"), "PATH");
    let libs = prepend(&cuda.join("lib"), "LD_LIBRARY_PATH");
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    run(
        "kernels with the wheels' nvcc and NVRTC",
        Command::new(exe)
            .arg("ptx")
            .args(args)
            .env("PATH", path)
            .env("LD_LIBRARY_PATH", libs)
            .env(WHEELS_ENV, "1"),
    )
}

fn prepend(dir: &Path, var: &str) -> std::ffi::OsString {
    let mut paths = vec![dir.to_path_buf()];
    if let Some(old) = std::env::var_os(var) {
        paths.extend(std::env::split_paths(&old));
    }
    std::env::join_paths(paths).unwrap_or_else(|_| dir.as_os_str().to_owned())
}
