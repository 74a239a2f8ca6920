//! The C API from C: `gpuio.h` is what cbindgen makes of the crate now, and a C program
//! compiled against it (`tests/it/test_gpuio.c`, with `cc`) passes every check of every
//! function and its error paths, linked against the `libgpuio.so` cargo built with this
//! test.

use std::path::PathBuf;
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The header cbindgen generates from the crate now.
fn generated_header() -> String {
    let dir = crate_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .expect("cbindgen runs")
        .write(&mut out);
    String::from_utf8(out).expect("UTF-8 header")
}

#[test]
fn header_is_current() {
    let path = crate_dir().join("include/gpuio.h");
    let now = generated_header();
    if std::env::var_os("GPUIO_WRITE_HEADER").is_some() {
        std::fs::write(&path, &now).expect("write include/gpuio.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == now,
        "include/gpuio.h is stale: run `GPUIO_WRITE_HEADER=1 cargo test -p gpuio-capi` and \
         commit it"
    );
}

/// Where cargo put `libgpuio.so` for this build: beside this test binary in `deps/` (built
/// with the tests, since the library is also an rlib), or uplifted to the profile directory
/// by `cargo build`.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("target/<profile>/deps/<test>");
    [Some(deps), deps.parent()]
        .into_iter()
        .flatten()
        .find(|d| d.join("libgpuio.so").exists())
        .unwrap_or(deps)
        .to_path_buf()
}

#[test]
fn c_program_passes_every_check() {
    let lib = library_dir();
    assert!(
        lib.join("libgpuio.so").exists(),
        "no libgpuio.so in {} or its parent: cargo builds it with this test",
        lib.display()
    );
    let scratch = tempfile::tempdir().expect("scratch dir");
    let exe = scratch.path().join("test_gpuio");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(crate_dir().join("include"))
        .arg(crate_dir().join("tests/it/test_gpuio.c"))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lgpuio", "-o"])
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(
        status.success(),
        "the C test does not compile against gpuio.h"
    );
    let out = Command::new(&exe)
        .arg(scratch.path())
        .output()
        .expect("run the C test");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success() && stdout.contains("all C API checks passed"),
        "the C test failed"
    );
}
