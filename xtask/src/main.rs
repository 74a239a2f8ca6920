//! gpuio's project tasks (`cargo xtask <task>`):
//!
//! - `ci`: what `.ci/run` runs: the Debian packages the build and tests need (installed when
//!   missing), formatting, clippy, the test suite, rustdoc.
//! - `bench [ARGS]`: the benchmark suites this machine supports (`gpuio bench` in release).
//! - `gpu-bundle`: release test and bench binaries for the GPU machine (no cargo there), with
//!   `run.sh`, the one command that runs them there.
//! - `ptx [--kernels DIR] [--arch SM]`: compiles `kernels/` with nvcc where present and checks
//!   that NVRTC compiles the sources gpuio embeds. Runs from the bundle on the GPU machine.
//! - `qemu-rdma`: the RDMA tests (cargo feature `rdma`) in a QEMU guest with soft-RoCE (rxe):
//!   builds them, packs them with busybox, the guest kernel's modules and libibverbs' rxe
//!   provider into an initramfs, boots it, and reports what they printed.

#![forbid(unsafe_code)]

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
        "ci" => ci(),
        "bench" => bench(rest),
        "gpu-bundle" => gpu_bundle(),
        "ptx" => ptx(rest),
        "qemu-rdma" => qemu_rdma(),
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | bench [ARGS] | gpu-bundle | ptx [--kernels DIR] [--arch SM] | qemu-rdma>"
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

/// Debian packages the build and the tests need: (a command it provides, the package).
/// protoc builds etcd-client; etcd serves the multi-node tests; iperf3 is the TCP peer of
/// `gpuio bench remote`.
const PACKAGES: &[(&str, &str)] = &[
    ("protoc", "protobuf-compiler"),
    ("etcd", "etcd-server"),
    ("iperf3", "iperf3"),
];

/// Installs the missing [`PACKAGES`] with apt-get (as root), or says what to install.
fn ensure_packages() -> Result {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(cmd, _)| !has(cmd, "--version"))
        .map(|(_, pkg)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    if !root || !has("apt-get", "--version") {
        return Err(format!(
            "missing Debian packages: {} (apt-get install {})",
            missing.join(", "),
            missing.join(" ")
        ));
    }
    let apt = |args: &[&str]| {
        let mut c = Command::new("apt-get");
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
    let mut install = apt(&["install", "-y", "-q", "--no-install-recommends"]);
    install.args(&missing);
    if run("install packages", &mut install).is_err() {
        // A fresh machine may have no package lists yet.
        run("apt-get update", &mut apt(&["update", "-q"]))?;
        let mut install = apt(&["install", "-y", "-q", "--no-install-recommends"]);
        install.args(&missing);
        run("install packages", &mut install)?;
    }
    Ok(())
}

fn ci() -> Result {
    ensure_packages()?;
    run("rustfmt", cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(
        "clippy",
        cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    // Where the machine has FUSE, the fault-injection tests must mount it, not skip.
    let fuse = if std::path::Path::new("/dev/fuse").exists() {
        "1"
    } else {
        "0"
    };
    if has("cargo-nextest", "--version") {
        run(
            "tests (nextest)",
            cargo()
                .args(["nextest", "run", "--workspace", "--no-fail-fast"])
                .env("GPUIO_REQUIRE_FUSE", fuse)
                .env("GPUIO_REQUIRE_ETCD", "1"),
        )?;
        // nextest does not run doctests.
        run("doctests", cargo().args(["test", "--workspace", "--doc"]))?;
    } else {
        run(
            "tests",
            cargo()
                .args(["test", "--workspace", "--no-fail-fast"])
                .env("GPUIO_REQUIRE_FUSE", fuse)
                .env("GPUIO_REQUIRE_ETCD", "1"),
        )?;
    }
    run(
        "rustdoc",
        cargo()
            .args(["doc", "--workspace", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )
}

fn bench(args: &[String]) -> Result {
    ensure_packages()?;
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

/// The bundle carried to the GPU machine: `bin/` (gpuio, xtask), `tests/` (every test
/// binary), `kernels/`, and `run.sh`.
fn gpu_bundle() -> Result {
    let root = root();
    let out = root.join("target/gpu-bundle");
    let _ = std::fs::remove_dir_all(&out);
    for d in ["bin", "tests", "kernels"] {
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
            "xtask",
        ]),
    )?;
    for bin in ["gpuio", "xtask"] {
        copy(
            &root.join("target/bundle").join(bin),
            &out.join("bin").join(bin),
        )?;
    }
    eprintln!("==> build test binaries");
    let output = cargo()
        .args([
            "test",
            "--workspace",
            "--profile",
            "bundle",
            "--no-run",
            "--message-format=json",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !output.status.success() {
        return Err("building test binaries failed".into());
    }
    let mut count = 0;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let is_test = msg["profile"]["test"].as_bool() == Some(true);
        if let (true, Some(exe)) = (is_test, msg["executable"].as_str()) {
            let exe = Path::new(exe);
            let target = msg["target"]["name"].as_str().unwrap_or("test");
            let pkg = package_name(msg["package_id"].as_str().unwrap_or(""));
            // These read the source tree, which does not travel, or test the network on hosts
            // the GPU machine lacks (etcd, namespaces); nothing in them needs a GPU.
            if matches!(pkg, "gpuio-tests" | "xtask" | "gpuio-transport-remoteio")
                || target == "multinode"
            {
                continue;
            }
            copy(exe, &out.join("tests").join(format!("{pkg}--{target}")))?;
            count += 1;
        }
    }
    for entry in std::fs::read_dir(root.join("kernels")).map_err(|e| format!("kernels/: {e}"))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if let Some(name) = path.file_name() {
            copy(&path, &out.join("kernels").join(name))?;
        }
    }
    let script = out.join("run.sh");
    std::fs::write(&script, RUN_SH).map_err(|e| format!("writing run.sh: {e}"))?;
    make_executable(&script)?;
    let size = dir_size(&out);
    eprintln!(
        "bundle: {} ({count} test binaries), {:.1} MiB",
        out.display(),
        size as f64 / (1 << 20) as f64
    );
    if size > 60 << 20 {
        return Err(format!(
            "the bundle is {} MiB; the GPU machine takes at most 64",
            size >> 20
        ));
    }
    Ok(())
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# gpuio's GPU matrix, in one command: every test binary with CUDA required, the kernel compile
# checks (nvcc and NVRTC), gpuio info, a 1 GiB file round trip through GPU memory, and the
# MemIO, LocalIO, core, gather, ring and remote benchmarks against their peers (fio: GPUIO_FIO;
# kvikio and torch: on PYTHONPATH; iperf3 where installed).
# Results (bench JSON, plots) go to $OUT or ./out.
set -u
cd "$(dirname "$0")"
export GPUIO_REQUIRE_CUDA=1
export GPUIO_BIN="$PWD/bin/gpuio"
export GPUIO_E2E_BYTES="${GPUIO_E2E_BYTES:-1073741824}"
out="${OUT:-$PWD/out}"
mkdir -p "$out"
status=0
step() {
    echo "== $*"
    "$@" || { echo "FAILED: $*"; status=1; }
}
# cuFile asks udev for the file system of each disk; containers have no udev database. As
# root, record each block device's real type (blkid) where udev has not.
if [ "$(id -u)" = 0 ] && command -v blkid >/dev/null; then
    mkdir -p /run/udev/data
    for d in /sys/class/block/*; do
        [ -r "$d/dev" ] || continue
        db="/run/udev/data/b$(cat "$d/dev")"; [ -e "$db" ] && continue
        t=$(blkid -o value -s TYPE "/dev/$(basename "$d")" 2>/dev/null) || continue
        [ -n "$t" ] && printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$t" >"$db"
    done
fi
for t in tests/*; do step "$t" --test-threads=4; done
step bin/xtask ptx --kernels kernels
step bin/gpuio info
step bin/gpuio bench memio --out "$out" ${GPUIO_BENCH_ARGS:-}
step bin/gpuio bench localio --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out"
step bin/gpuio bench core --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out"
step bin/gpuio bench gather --out "$out"
step bin/gpuio bench ring --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out"
step bin/gpuio bench remote --out "$out"
echo "== gpu matrix: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
"#;

/// The package name in a cargo package id (`path+file:///x/benches#gpuio-bench@0.1.0`, or
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

/// nvcc over every `.cu` in the kernels directory (where nvcc exists), and NVRTC over the
/// sources embedded in gpuio-hal (where libnvrtc exists). Fails if a compiler that is present
/// rejects a source; says what was skipped and why.
fn ptx(args: &[String]) -> Result {
    let mut kernels = root().join("kernels");
    let mut arch = String::from("sm_90");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--kernels" => kernels = it.next().ok_or("--kernels needs a directory")?.into(),
            "--arch" => arch = it.next().ok_or("--arch needs e.g. sm_90")?.clone(),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let mut failed = Vec::new();
    if has("nvcc", "--version") {
        let tmp = std::env::temp_dir().join(format!("gpuio-ptx-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).map_err(|e| e.to_string())?;
        let mut sources: Vec<PathBuf> = std::fs::read_dir(&kernels)
            .map_err(|e| format!("{}: {e}", kernels.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "cu"))
            .collect();
        sources.sort();
        for src in sources {
            let name = src
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let ptx_out = tmp.join(format!("{name}.ptx"));
            let ok = run(
                &format!("nvcc -arch={arch} {}", src.display()),
                Command::new("nvcc")
                    .args(["-arch", &arch, "-ptx", "-Xptxas", "-v", "-o"])
                    .arg(&ptx_out)
                    .arg(&src),
            );
            if ok.is_err() {
                failed.push(format!("nvcc {}", src.display()));
            }
        }
        let _ = std::fs::remove_dir_all(&tmp);
    } else {
        eprintln!("skipped nvcc: nvcc is not on PATH");
    }
    for src in gpuio_hal::kernels::ALL {
        match gpuio_hal::gpu::cuda::compile_ptx(src, None) {
            Ok(ptx) => {
                let text = ptx.to_src();
                let missing: Vec<_> = src
                    .functions
                    .iter()
                    .filter(|f| !text.contains(*f))
                    .collect();
                if missing.is_empty() {
                    eprintln!("NVRTC {}: ok ({} bytes of PTX)", src.name, text.len());
                } else {
                    failed.push(format!("NVRTC {}: PTX lacks {missing:?}", src.name));
                }
            }
            Err(gpuio_hal::HalError::Compile { log, .. }) if log.contains("libnvrtc not found") => {
                eprintln!("skipped NVRTC {}: {log}", src.name);
            }
            Err(e) => failed.push(format!("NVRTC {}: {e}", src.name)),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// Debian packages the QEMU matrix needs: the guest kernel, busybox, QEMU, and what the RDMA
/// build and guest need.
const QEMU_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "linux-image-amd64",
    "libibverbs-dev",
    "librdmacm-dev",
    "libclang-dev",
    "rdma-core",
    "ibverbs-providers",
    "iproute2",
    "cpio",
];

/// Kernel modules the guest loads, in order: virtio networking, then soft-RoCE.
const GUEST_MODULES: &[&str] = &[
    "virtio",
    "virtio_ring",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "failover",
    "net_failover",
    "virtio_net",
    "crc32_generic",
    "udp_tunnel",
    "ip6_udp_tunnel",
    "ib_core",
    "ib_uverbs",
    "rdma_rxe",
];

fn qemu_rdma() -> Result {
    let kernel = std::fs::read_dir("/boot").ok().and_then(|d| {
        d.filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
            })
            .max()
    });
    let missing = !has("qemu-system-x86_64", "--version")
        || kernel.is_none()
        || !Path::new("/bin/busybox").exists();
    if missing {
        let mut c = Command::new("apt-get");
        c.args(["install", "-y", "-q", "--no-install-recommends"])
            .args(QEMU_PACKAGES)
            .env("DEBIAN_FRONTEND", "noninteractive");
        run("install the QEMU matrix's packages", &mut c)?;
    }
    let kernel = std::fs::read_dir("/boot")
        .map_err(|e| format!("/boot: {e}"))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .max()
        .ok_or("no guest kernel under /boot (apt-get install linux-image-amd64)")?;
    let release = kernel
        .file_name()
        .map(|n| {
            n.to_string_lossy()
                .trim_start_matches("vmlinuz-")
                .to_string()
        })
        .unwrap_or_default();
    // The RDMA tests, built with the feature.
    eprintln!("==> build the RDMA tests");
    let output = cargo()
        .args([
            "test",
            "--no-run",
            "--message-format=json",
            "-p",
            "gpuio-hal",
            "-p",
            "gpuio-transport-remoteio",
            "-p",
            "gpuio-api",
            "--features",
            "gpuio-hal/rdma,gpuio-transport-remoteio/rdma,gpuio-api/rdma",
            "--test",
            "rdma",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cargo test --no-run: {e}"))?;
    if !output.status.success() {
        return Err("building the RDMA tests failed".into());
    }
    let mut tests = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let (Some(true), Some(exe)) =
            (msg["profile"]["test"].as_bool(), msg["executable"].as_str())
        {
            tests.push(PathBuf::from(exe));
        }
    }
    if tests.is_empty() {
        return Err("no RDMA test binaries were built".into());
    }
    // The initramfs.
    let work = root().join("target/qemu-rdma");
    let _ = std::fs::remove_dir_all(&work);
    let guest = work.join("root");
    for d in [
        "bin",
        "lib/modules",
        "dev",
        "proc",
        "sys",
        "tmp",
        "etc/libibverbs.d",
        "tests",
    ] {
        std::fs::create_dir_all(guest.join(d)).map_err(|e| format!("{d}: {e}"))?;
    }
    copy(Path::new("/bin/busybox"), &guest.join("bin/busybox"))?;
    let modules = Path::new("/lib/modules").join(&release);
    for m in GUEST_MODULES {
        let found = find_file(&modules, &format!("{m}.ko"))
            .ok_or_else(|| format!("module {m} not found under {}", modules.display()))?;
        copy(&found, &guest.join(format!("lib/modules/{m}.ko")))?;
    }
    let provider = Path::new("/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so");
    let mut binaries = vec![PathBuf::from("/usr/bin/rdma"), provider.to_path_buf()];
    copy(
        Path::new("/etc/libibverbs.d/rxe.driver"),
        &guest.join("etc/libibverbs.d/rxe.driver"),
    )?;
    copy(&PathBuf::from("/usr/bin/rdma"), &guest.join("bin/rdma"))?;
    let mut script = String::new();
    for (i, t) in tests.iter().enumerate() {
        let name = format!(
            "t{i}-{}",
            t.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        );
        copy(t, &guest.join("tests").join(&name))?;
        binaries.push(t.clone());
        script.push_str(&format!(
            "echo \"== {name}\"; if GPUIO_REQUIRE_RDMA=1 RUST_BACKTRACE=1 /tests/{name} --test-threads=1; then echo \"QEMU-PASS {name}\"; else echo \"QEMU-FAIL {name}\"; fi\n"
        ));
    }
    let provider_to = guest.join(provider.strip_prefix("/").unwrap_or(provider));
    if let Some(dir) = provider_to.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    copy(provider, &provider_to)?;
    for b in &binaries {
        for lib in shared_libraries(b)? {
            let to = guest.join(lib.strip_prefix("/").unwrap_or(&lib));
            if let Some(dir) = to.parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            }
            if !to.exists() {
                copy(&lib, &to)?;
            }
        }
    }
    let init = format!(
        "#!/bin/busybox sh\n\
         /bin/busybox --install -s /bin\n\
         mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev\n\
         for m in {modules}; do insmod /lib/modules/$m.ko || echo \"insmod $m failed\"; done\n\
         ip link set lo up; ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0\n\
         rdma link add rxe0 type rxe netdev eth0 || echo 'QEMU-FAIL rxe'\n\
         export TMPDIR=/tmp\n\
         {script}\
         echo QEMU-DONE\n\
         poweroff -f\n",
        modules = GUEST_MODULES.join(" "),
    );
    let init_path = guest.join("init");
    std::fs::write(&init_path, init).map_err(|e| format!("init: {e}"))?;
    make_executable(&init_path)?;
    let initrd = work.join("initrd.cpio");
    run(
        "pack the initramfs",
        Command::new("sh").arg("-c").arg(format!(
            "cd {} && find . | cpio -o -H newc --quiet > {}",
            guest.display(),
            initrd.display()
        )),
    )?;
    eprintln!("==> boot {} in QEMU (TCG)", kernel.display());
    let started = Instant::now();
    let out = Command::new("timeout")
        .arg("900")
        .arg("qemu-system-x86_64")
        .args([
            "-M",
            "q35",
            "-m",
            "2048",
            "-smp",
            "2",
            "-nographic",
            "-no-reboot",
            "-kernel",
        ])
        .arg(&kernel)
        .arg("-initrd")
        .arg(&initrd)
        .args([
            "-append",
            "console=ttyS0 quiet panic=-1",
            "-netdev",
            "user,id=n0",
            "-device",
            "virtio-net-pci,netdev=n0",
        ])
        .output()
        .map_err(|e| format!("qemu: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let log = work.join("guest.log");
    let _ = std::fs::write(&log, text.as_bytes());
    for line in text.lines().filter(|l| {
        l.contains("QEMU-")
            || l.contains("test result")
            || l.contains("panicked")
            || l.starts_with("test ")
            || l.starts_with("== ")
    }) {
        println!("{line}");
    }
    eprintln!(
        "    guest ran {:.1} s; its console is in {}",
        started.elapsed().as_secs_f64(),
        log.display()
    );
    let passed = text.matches("QEMU-PASS").count();
    if !text.contains("QEMU-DONE") {
        return Err("the guest did not finish (see the console log)".into());
    }
    if text.contains("QEMU-FAIL") || passed != tests.len() {
        return Err(format!(
            "{passed} of {} RDMA test binaries passed",
            tests.len()
        ));
    }
    println!("qemu-rdma: {passed} RDMA test binaries passed on soft-RoCE");
    Ok(())
}

/// The first file called `name` under `dir`.
fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    for e in entries.filter_map(|e| e.ok()) {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = find_file(&p, name) {
                return Some(f);
            }
        } else if p.file_name().is_some_and(|n| n == name) {
            return Some(p);
        }
    }
    None
}

/// The shared libraries `binary` loads (as `ldd` resolves them), the loader included.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| format!("ldd: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(PathBuf::from)
        .collect())
}
