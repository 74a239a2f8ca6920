//! The library against NVIDIA's own cuFile SDK (PyPI's `nvidia-cufile` and the CUDA runtime's
//! headers, which `cargo xtask ci` installs and names in `GPUIO_CUFILE_SDK`): every function
//! `cufile.h` declares is exported, the C test (`test_cufile.c`) compiles against that header
//! and passes (also built with AddressSanitizer and UndefinedBehaviorSanitizer), and the
//! struct layouts it prints are the ones `abi::LAYOUT` pins.

use gpuio_testkit::Requirement;
use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The SDK's include directory, or None (skipped, or failed where it is required).
fn sdk_include() -> Option<PathBuf> {
    let root = std::env::var_os("GPUIO_CUFILE_SDK")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate_dir().join("../../target/cufile-sdk"));
    let include = root.join("nvidia/cu13/include");
    if include.join("cufile.h").exists() && include.join("cuda.h").exists() {
        return Some(include);
    }
    Requirement::CufileSdk.missing(format!(
        "no cufile.h and cuda.h under {} (`cargo xtask cufile-sdk` installs them)",
        include.display()
    ));
    None
}

/// A directory holding `libcufile.so.0`: `GPUIO_CUFILE_LIB_DIR` where it names one (the GPU
/// bundle's `lib/`), else a link to what cargo built for this test (the profile directory's
/// `libcufile.so`, or the one beside this test binary in `deps/`).
fn library_dir(scratch: &Path) -> PathBuf {
    if let Some(dir) = std::env::var_os("GPUIO_CUFILE_LIB_DIR").map(PathBuf::from)
        && dir.join("libcufile.so.0").exists()
    {
        return dir;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("target/<profile>/deps/<test>");
    let built = [Some(deps), deps.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join("libcufile.so"))
        .find(|p| p.exists())
        .expect("cargo builds libcufile.so with this test");
    let dir = scratch.join("lib");
    std::fs::create_dir_all(&dir).expect("lib dir");
    std::os::unix::fs::symlink(&built, dir.join("libcufile.so.0")).expect("link");
    dir
}

/// The functions `cufile.h` declares (a declaration: a return type, then `cuFile...(`).
fn declared(header: &str) -> Vec<String> {
    let mut names: Vec<String> = header
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let rest = ["CUfileError_t ", "ssize_t ", "void ", "long "]
                .iter()
                .find_map(|t| l.strip_prefix(t))?;
            let name = rest.trim_start_matches('*').split('(').next()?.trim();
            (name.starts_with("cuFile") && rest.contains('(')).then(|| name.to_string())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

fn exported(lib: &Path) -> Vec<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib)
        .output()
        .expect("nm (binutils) runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect()
}

#[test]
fn every_declared_function_is_exported() {
    let Some(include) = sdk_include() else { return };
    let header = std::fs::read_to_string(include.join("cufile.h")).expect("cufile.h");
    let names = declared(&header);
    assert!(
        names.len() >= 49,
        "only {} declarations found in cufile.h: the scan is broken",
        names.len()
    );
    let scratch = tempfile::tempdir().expect("scratch");
    let ours = exported(&library_dir(scratch.path()).join("libcufile.so.0"));
    let missing: Vec<&String> = names.iter().filter(|n| !ours.contains(n)).collect();
    assert!(missing.is_empty(), "not exported: {missing:?}");
    // The macro's name for the close every program built with this header calls.
    assert!(ours.iter().any(|n| n == "cuFileDriverClose_v2"));
    // NVIDIA's library exports each of them too: the header, not a guess, is the contract.
    let nvidia = include.join("../lib/libcufile.so.0");
    if nvidia.exists() {
        let theirs = exported(&nvidia);
        let odd: Vec<&String> = names.iter().filter(|n| !theirs.contains(n)).collect();
        assert!(odd.is_empty(), "declared, not in NVIDIA's library: {odd:?}");
    }
}

fn compile(include: &Path, lib: &Path, exe: &Path, sanitize: bool) -> bool {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut cmd = Command::new(&cc);
    cmd.args(["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-g", "-I"])
        .arg(include)
        .arg(crate_dir().join("tests/it/test_cufile.c"))
        .arg("-L")
        .arg(lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-l:libcufile.so.0", "-ldl", "-o"])
        .arg(exe);
    if sanitize {
        cmd.args([
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
        ]);
    }
    cmd.status()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"))
        .success()
}

fn run(exe: &Path, scratch: &Path) -> String {
    let data = scratch.join(format!(
        "data-{}",
        exe.file_name().unwrap().to_string_lossy()
    ));
    std::fs::create_dir_all(&data).expect("data dir");
    let mut cmd = Command::new(exe);
    cmd.arg(&data)
        // The session lives as long as the process, by design: not a leak to report. The
        // CUDA driver maps the address range ASan's shadow gap would protect.
        .env("ASAN_OPTIONS", "detect_leaks=0:protect_shadow_gap=0")
        .env("GPUIO_CUFILE_DEBUG", "1");
    if Requirement::Cuda.required() {
        cmd.arg("cuda");
    }
    let out = cmd.output().expect("run the C test");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("all cuFile checks passed"),
        "{} failed:\n{stdout}",
        exe.display()
    );
    stdout
}

#[test]
fn c_program_passes_against_nvidias_header() {
    let Some(include) = sdk_include() else { return };
    let scratch = tempfile::tempdir().expect("scratch");
    let lib = library_dir(scratch.path());
    let exe = scratch.path().join("test_cufile");
    assert!(
        compile(&include, &lib, &exe, false),
        "test_cufile.c does not compile against cufile.h"
    );
    let stdout = run(&exe, scratch.path());
    let layout: Vec<(String, usize)> = stdout
        .lines()
        .filter_map(|l| {
            let (name, n) = l.strip_prefix("layout ")?.rsplit_once(' ')?;
            Some((name.to_string(), n.parse().ok()?))
        })
        .collect();
    let pinned: Vec<(String, usize)> = cufile::abi::LAYOUT
        .iter()
        .map(|(n, v)| (n.to_string(), *v))
        .collect();
    assert_eq!(
        layout, pinned,
        "C (NVIDIA's header) and Rust disagree on a layout"
    );
    if Requirement::Cuda.required() {
        assert!(stdout.contains("device memory checks ran"));
    }
    // Cold reads of O_DIRECT descriptors need a scratch file system that takes O_DIRECT and
    // drops clean pages (tmpfs does not), and a kernel that says what is cached.
    if let Some(why) = stdout
        .lines()
        .find_map(|l| l.strip_prefix("cold O_DIRECT checks skipped: "))
    {
        Requirement::ODirect.missing(format!("cold O_DIRECT cuFile reads unchecked: {why}"));
    } else {
        assert!(stdout.contains("cold O_DIRECT checks ran"), "{stdout}");
    }
}

#[test]
fn c_program_passes_under_sanitizers() {
    let Some(include) = sdk_include() else { return };
    let scratch = tempfile::tempdir().expect("scratch");
    let lib = library_dir(scratch.path());
    let exe = scratch.path().join("test_cufile_asan");
    assert!(
        compile(&include, &lib, &exe, true),
        "test_cufile.c does not build with -fsanitize=address,undefined"
    );
    run(&exe, scratch.path());
}
