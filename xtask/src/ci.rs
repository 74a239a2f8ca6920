//! `cargo xtask ci`, what `.ci/run` runs on a fresh machine: the Debian packages every step
//! needs (installed when missing), formatting, clippy over every feature set that ships, the
//! test suite, rustdoc, every kernel compiled for every architecture (compilers from PyPI) and
//! the embedded PTX checked against `kernels/`, every fuzz target for a few seconds, and the
//! RDMA and NVMe tests in QEMU guests.

use crate::{Result, cargo, has, run};
use std::process::Command;

/// What the default build and the tests need: protoc and protobuf's well-known `.proto`
/// files build etcd-client (the CLI's `registry` feature); libclang runs nixl-sys's bindgen
/// (the CLI's `nixl` feature); etcd serves the multi-node tests; iperf3 is the TCP peer of
/// `gpuio bench remote`.
pub const BUILD_PACKAGES: &[&str] = &[
    "protobuf-compiler",
    "libprotobuf-dev",
    "libclang-dev",
    "etcd-server",
    "iperf3",
];

/// What gpuio-rdma's build needs (rdma-sys runs bindgen over the verbs headers): a workspace
/// build compiles it as a member, and the `rdma` features of the crates above reach it.
pub const RDMA_PACKAGES: &[&str] = &["libibverbs-dev", "librdmacm-dev", "libclang-dev"];

/// Installs the packages of `packages` that are not installed (apt-get, as root), or says
/// what to install. Where there is no dpkg (not Debian), says what the steps need and goes on.
pub fn ensure_packages(packages: &[&str]) -> Result {
    if !has("dpkg-query", "--version") {
        eprintln!(
            "not a Debian system: make sure these (or your distribution's equivalents) are \
             installed: {}",
            packages.join(" ")
        );
        return Ok(());
    }
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        return Err(format!(
            "missing Debian packages: {0} (as root: apt-get install {0})",
            missing.join(" ")
        ));
    }
    let apt = |args: &[&str]| {
        let mut c = Command::new("apt-get");
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
    let install = || {
        let mut c = apt(&["install", "-y", "-q", "--no-install-recommends"]);
        c.args(&missing);
        c
    };
    if run("install packages", &mut install()).is_err() {
        // A fresh machine may have no package lists yet.
        run("apt-get update", &mut apt(&["update", "-q"]))?;
        run("install packages", &mut install())?;
    }
    Ok(())
}

/// Whether this process runs as root.
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f", "${Status}", package])
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.ends_with(b" installed"))
}

fn clippy(what: &str, args: &[&str]) -> Result {
    run(
        what,
        cargo()
            .arg("clippy")
            .args(args)
            .args(["--all-targets", "--", "-D", "warnings"]),
    )
}

pub fn ci() -> Result {
    let all: Vec<&str> = [BUILD_PACKAGES, RDMA_PACKAGES, crate::qemu::QEMU_PACKAGES].concat();
    ensure_packages(&all)?;
    run("rustfmt", cargo().args(["fmt", "--all", "--", "--check"]))?;
    clippy("clippy", &["--workspace"])?;
    // The feature sets the workspace build does not compile: every feature on (RemoteIO over
    // gpuio-rdma's verbs, the crates' `rdma` features), and a library user's gpuio-api without
    // the etcd registry (the CLI turns it on).
    clippy("clippy, all features", &["--workspace", "--all-features"])?;
    clippy(
        "clippy, no registry",
        &[
            "-p",
            "gpuio-api",
            "-p",
            "gpuio-cli",
            "--no-default-features",
        ],
    )?;
    // Where the machine has FUSE, the fault-injection tests must mount it, not skip.
    let fuse = if std::path::Path::new("/dev/fuse").exists() {
        "1"
    } else {
        "0"
    };
    // As root, the full-disk tests must mount their small tmpfs, not skip.
    let tmpfs = if is_root() { "1" } else { "0" };
    let cufile_sdk = crate::cufile::sdk()?;
    let nixl = crate::nixl::install()?;
    let test_env = |cmd: &mut Command| {
        cmd.env("GPUIO_REQUIRE_FUSE", fuse)
            .env("GPUIO_REQUIRE_TMPFS", tmpfs)
            .env("GPUIO_REQUIRE_ETCD", "1")
            .env("GPUIO_REQUIRE_ODIRECT", "1")
            .env("GPUIO_CUFILE_SDK", &cufile_sdk)
            .env("GPUIO_REQUIRE_CUFILESDK", "1")
            .env("GPUIO_NIXL_LIB", crate::nixl::lib_dir(&nixl))
            .env("GPUIO_NIXL_PYTHONPATH", &nixl)
            .env("GPUIO_REQUIRE_NIXL", "1")
            // UCX's TCP transport on loopback only: the network-namespace tests create and
            // remove interfaces while other tests' NIXL agents enumerate theirs (an agent
            // that picked one that vanished fails to set up). Those tests set their own.
            .env("UCX_NET_DEVICES", "lo");
    };
    if has("cargo-nextest", "--version") {
        let mut tests = cargo();
        tests.args(["nextest", "run", "--workspace", "--no-fail-fast"]);
        test_env(&mut tests);
        run("tests (nextest)", &mut tests)?;
        // nextest does not run doctests.
        run("doctests", cargo().args(["test", "--workspace", "--doc"]))?;
    } else {
        let mut tests = cargo();
        tests.args(["test", "--workspace", "--no-fail-fast"]);
        test_env(&mut tests);
        run("tests", &mut tests)?;
    }
    run(
        "rustdoc",
        cargo()
            .args(["doc", "--workspace", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    // A library user's build: without the CLI, nothing turns the registry on.
    run(
        "rustdoc, no registry",
        cargo()
            .args([
                "doc",
                "-p",
                "gpuio-transport-remoteio",
                "-p",
                "gpuio-api",
                "--no-deps",
            ])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    crate::python::python()?;
    crate::ptx::ptx(&["--wheels".to_string(), "--check".to_string()])?;
    // Every fuzz target for a short time: the harness builds and runs, and a new crash fails
    // CI (the committed corpora are replayed by the tests above).
    crate::fuzz::fuzz(&["--time".to_string(), "10".to_string()])?;
    crate::qemu::rdma::qemu_rdma()?;
    crate::qemu::nvme::qemu_nvme()
}
