//! gpuio's project tasks (`cargo xtask <task>`):
//!
//! - `ci` ([`ci`]): what `.ci/run` runs: the Debian packages every step needs (installed
//!   when missing), formatting, clippy over every feature set, the test suite, rustdoc, the
//!   Python binding's tests, the kernels, the RDMA tests in QEMU.
//! - `bench [ARGS]`: the benchmark suites this machine supports (`gpuio bench` in release).
//! - `gpu-bundle` ([`bundle`]): release test and bench binaries for the GPU machine (no cargo
//!   there), with `run.sh`, the one command that runs them there.
//! - `ptx [--arch SM].. [--wheels] [--write | --check | --rust]` ([`ptx`]): every
//!   kernel compiled for sm_80, sm_90 and sm_100 by nvcc and NVRTC (with `--wheels`: CUDA
//!   13.0's compilers from PyPI, no GPU needed); `--write` writes the PTX gpuio-hal embeds,
//!   `--check` fails where it is stale, `--rust` writes only the Rust that embeds it (from
//!   each crate's `kernels.toml`). Runs from the bundle on the GPU machine too.
//! - `python` ([`python`]): the Python binding's wheel built by maturin, installed into a
//!   virtual environment under `target/pyenv`, and its pytests.
//! - `kmod [--kdir DIR]` ([`kmod`]): gpuio's kernel module built against a kernel's build
//!   tree (the QEMU guest's by default).
//! - `fuzz [TARGET].. [--time S] [--jobs N] [--keep]` ([`fuzz`]): the fuzz targets of `fuzz/` under
//!   AFL++ (cargo-afl, installed when missing); `--keep` minimizes what a run found into the
//!   committed corpora.
//! - `cufile-sdk` ([`cufile`]): NVIDIA's cuFile header and library from PyPI under
//!   `target/cufile-sdk`, which gpuio-cufile's tests build against (`ci` installs it too).
//! - `nixl` ([`nixl`]): NIXL from PyPI under `target/nixl`, which gpuio-nixl's tests load
//!   (`ci` installs it too).
//! - `qemu-rdma` and `qemu-nvme` ([`qemu`]): the RDMA tests on soft-RoCE, and the NVMe driver
//!   against QEMU's emulated NVMe through VFIO, each in a QEMU guest.

#![forbid(unsafe_code)]

mod bundle;
mod ci;
mod cufile;
mod fuzz;
mod kmod;
mod manifest;
mod nixl;
mod ptx;
mod python;
mod qemu;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

type Result<T = ()> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (task, rest) = args
        .split_first()
        .map_or(("help", &[][..]), |(t, r)| (t.as_str(), r));
    let result = match task {
        "ci" => ci::ci(),
        "bench" => bench(rest),
        "gpu-bundle" => bundle::gpu_bundle(),
        "ptx" => ptx::ptx(rest),
        "python" => python::python(),
        "qemu-rdma" => qemu::rdma::qemu_rdma(),
        "qemu-nvme" => qemu::nvme::qemu_nvme(),
        "kmod" => kmod::kmod(rest),
        "fuzz" => fuzz::fuzz(rest),
        "cufile-sdk" => cufile::cufile_sdk(),
        "nixl" => nixl::nixl(),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | bench [ARGS] | gpu-bundle | ptx [--arch SM].. [--wheels] [--write | --check | --rust] | python | qemu-rdma | qemu-nvme | kmod [--kdir DIR] | cufile-sdk | nixl>"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {task}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root (xtask's parent directory), or the current directory when run from a
/// bundle.
fn root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    match here.parent() {
        Some(p) if p.join("Cargo.toml").exists() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(what: &str, cmd: &mut Command) -> Result {
    let start = Instant::now();
    eprintln!("==> {what}");
    let status = cmd
        .status()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    eprintln!(
        "    {what}: {} in {:.1} s",
        if status.success() { "ok" } else { "FAILED" },
        start.elapsed().as_secs_f64()
    );
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

fn has(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

fn bench(args: &[String]) -> Result {
    ci::ensure_packages(ci::BUILD_PACKAGES)?;
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "-p",
        "gpuio-cli",
        "--",
        "bench",
    ])
    .args(args);
    run("gpuio bench", &mut cmd)
}

/// A test executable cargo built: its path, package and target names.
struct TestBinary {
    path: PathBuf,
    package: String,
    target: String,
}

/// The executable of binary target `bin` of `package`, built with `features` (`cargo build
/// --message-format=json`).
fn build_binary(package: &str, bin: &str, features: &str) -> Result<PathBuf> {
    let what = format!("build {package}'s {bin}");
    eprintln!("==> {what}");
    let output = cargo()
        .args([
            "build",
            "--message-format=json",
            "-p",
            package,
            "--bin",
            bin,
        ])
        .args(["--features", features])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo build: {e}"))?;
    if !output.status.success() {
        return Err(format!("{what} failed"));
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|m| m["target"]["name"] == bin && m["executable"].is_string())
        .and_then(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| format!("{what}: cargo named no executable"))
}

/// Runs `cargo test --no-run --message-format=json` with `args` and lists the test executables
/// it built.
fn build_tests(what: &str, args: &[&str]) -> Result<Vec<TestBinary>> {
    eprintln!("==> {what}");
    let output = cargo()
        .args(["test", "--no-run", "--message-format=json"])
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !output.status.success() {
        return Err(format!("{what} failed"));
    }
    let mut tests = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let (Some(true), Some(exe)) =
            (msg["profile"]["test"].as_bool(), msg["executable"].as_str())
        {
            tests.push(TestBinary {
                path: PathBuf::from(exe),
                package: package_name(msg["package_id"].as_str().unwrap_or("")).to_string(),
                target: msg["target"]["name"].as_str().unwrap_or("test").to_string(),
            });
        }
    }
    Ok(tests)
}

/// The tests libtest reports passed in `output`: the sum over its `test result:` lines (none:
/// 0).
fn tests_passed(output: &str) -> u64 {
    output
        .lines()
        .filter_map(|l| {
            let (counts, _) = l.split_once("test result: ")?.1.split_once(" passed")?;
            counts.rsplit(' ').next()?.parse::<u64>().ok()
        })
        .sum()
}

/// The names of the tests `binary` runs with the libtest filter `filter` (its `--list`, run
/// here: listing runs no test, so it needs no device).
fn listed_tests(binary: &Path, filter: &str) -> Result<Vec<String>> {
    listed_tests_with(binary, &[filter])
}

/// The names of the tests `binary` lists with libtest arguments `args` (`--list` added).
fn listed_tests_with(binary: &Path, args: &[&str]) -> Result<Vec<String>> {
    let out = Command::new(binary)
        .args(args)
        .arg("--list")
        .output()
        .map_err(|e| format!("{} --list: {e}", binary.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} --list failed: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_owned)
        .collect())
}

/// Runs `cmd`, a `cargo test` whose libtest filter must select tests: its output is shown,
/// and it fails where the tests fail or where none ran (a filter that matches nothing passes
/// in libtest's eyes).
fn run_tests(what: &str, cmd: &mut Command) -> Result {
    let start = Instant::now();
    eprintln!("==> {what}");
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    let passed = tests_passed(&text);
    eprintln!(
        "    {what}: {} ({passed} passed) in {:.1} s",
        if out.status.success() { "ok" } else { "FAILED" },
        start.elapsed().as_secs_f64()
    );
    if !out.status.success() {
        return Err(format!("{what} failed ({})", out.status));
    }
    if passed == 0 {
        return Err(format!("{what}: no test ran (does the filter match?)"));
    }
    Ok(())
}

/// The package name in a cargo package id (`path+file:///x/crates/gpuio-bench#gpuio-bench@0.1.0`, or
/// `path+file:///x/crates/gpuio-hal#0.1.0` where the directory is the name).
fn package_name(id: &str) -> &str {
    let tail = id.rsplit('/').next().unwrap_or(id);
    match tail.split_once('#') {
        Some((dir, rest)) => match rest.split_once('@') {
            Some((name, _)) => name,
            None => dir,
        },
        None => tail,
    }
}

fn copy(from: &Path, to: &Path) -> Result {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))
}

fn make_executable(path: &Path) -> Result {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}
