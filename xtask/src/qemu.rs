//! `cargo xtask qemu-rdma`: the RDMA tests (cargo feature `rdma`) in a QEMU guest with
//! soft-RoCE (rxe): builds the test binaries of the crates that have them, packs them with
//! busybox, the guest kernel's modules and libibverbs' rxe provider into an initramfs, boots
//! it under TCG, runs each binary filtered to its `rdma` module with `GPUIO_REQUIRE_RDMA=1`,
//! and reports what they printed. Each must pass exactly the tests its filter selects (listed
//! here first, and at least one): a filter that matches nothing fails.

use crate::ci::{RDMA_PACKAGES, ensure_packages};
use crate::{Result, build_tests, copy, listed_tests, make_executable, root, run, tests_passed};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Debian packages the QEMU matrix needs: the guest kernel, busybox, QEMU, and what the guest
/// runs (the rxe provider, the `rdma` tool).
pub const QEMU_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "linux-image-amd64",
    "rdma-core",
    "ibverbs-providers",
    "iproute2",
    "cpio",
    "kmod",
];

/// The crates whose test binary (`tests/it`) has an `rdma` module, built with their `rdma`
/// features.
const RDMA_CRATES: &[&str] = &["gpuio-hal", "gpuio-transport-remoteio", "gpuio-api"];

/// The libtest filter that selects the RDMA tests in those binaries.
const RDMA_FILTER: &str = "rdma::";

/// Kernel modules the guest needs: virtio networking, then soft-RoCE. They are loaded with
/// what each depends on first, as the guest kernel's `modinfo` says (the order changes between
/// kernel updates: 6.1.0-56's virtio needs virtio_ring loaded before it).
const GUEST_MODULES: &[&str] = &["virtio_pci", "virtio_net", "crc32_generic", "rdma_rxe"];

pub fn qemu_rdma() -> Result {
    ensure_packages(&[RDMA_PACKAGES, QEMU_PACKAGES].concat())?;
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
    // The crates' test binaries, built with the feature; each with the RDMA tests its filter
    // selects (listed here, where listing needs no device).
    let features = RDMA_CRATES
        .iter()
        .map(|c| format!("{c}/rdma"))
        .collect::<Vec<_>>()
        .join(",");
    let mut args: Vec<&str> = RDMA_CRATES.iter().flat_map(|c| ["-p", *c]).collect();
    args.extend(["--features", &features, "--test", "it"]);
    let mut tests = Vec::new();
    for t in build_tests("build the RDMA tests", &args)? {
        let selected = listed_tests(&t.path, RDMA_FILTER)?;
        if selected.is_empty() {
            return Err(format!(
                "{}'s test binary has no test matching `{RDMA_FILTER}`",
                t.package
            ));
        }
        tests.push((
            format!("{}--{}", t.package, t.target),
            t.path,
            selected.len(),
        ));
    }
    if tests.len() != RDMA_CRATES.len() {
        return Err(format!(
            "built {} RDMA test binaries, expected one for each of {RDMA_CRATES:?}",
            tests.len()
        ));
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
    let load_order = with_dependencies(&modules, GUEST_MODULES)?;
    for (m, found) in &load_order {
        copy(found, &guest.join(format!("lib/modules/{m}.ko")))?;
    }
    let provider = Path::new("/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so");
    let mut binaries = vec![PathBuf::from("/usr/bin/rdma"), provider.to_path_buf()];
    copy(
        Path::new("/etc/libibverbs.d/rxe.driver"),
        &guest.join("etc/libibverbs.d/rxe.driver"),
    )?;
    copy(&PathBuf::from("/usr/bin/rdma"), &guest.join("bin/rdma"))?;
    let mut script = String::new();
    for (name, path, _) in &tests {
        copy(path, &guest.join("tests").join(name))?;
        binaries.push(path.clone());
        script.push_str(&format!(
            "echo \"== {name}\"; if GPUIO_REQUIRE_RDMA=1 RUST_BACKTRACE=1 /tests/{name} {RDMA_FILTER} --test-threads=1; then echo \"QEMU-PASS {name}\"; else echo \"QEMU-FAIL {name}\"; fi\n"
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
        modules = load_order
            .iter()
            .map(|(m, _)| m.as_str())
            .collect::<Vec<_>>()
            .join(" "),
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
            || l.contains("== ")
    }) {
        println!("{line}");
    }
    eprintln!(
        "    guest ran {:.1} s; its console is in {}",
        started.elapsed().as_secs_f64(),
        log.display()
    );
    if !text.contains("QEMU-DONE") {
        return Err("the guest did not finish (see the console log)".into());
    }
    // Per binary: it passed, and libtest counted as many passes as its filter selects.
    let mut problems = Vec::new();
    let mut counts = Vec::new();
    for (name, _, selected) in &tests {
        let output = text
            .split_once(&format!("== {name}"))
            .and_then(|(_, after)| after.split_once(&format!("QEMU-PASS {name}")))
            .map(|(output, _)| output);
        let passed = output.map_or(0, tests_passed);
        counts.push(format!("{name}: {passed}"));
        if output.is_none() || passed != *selected as u64 {
            problems.push(format!("{name}: {passed} of {selected} passed"));
        }
    }
    if text.contains("QEMU-FAIL") || !problems.is_empty() {
        return Err(format!(
            "RDMA tests failed or did not run: {}",
            problems.join("; ")
        ));
    }
    let total: usize = tests.iter().map(|(_, _, n)| n).sum();
    println!(
        "qemu-rdma: {total} RDMA tests passed on soft-RoCE ({})",
        counts.join(", ")
    );
    Ok(())
}

/// `wanted` and every module they depend on (found under `modules`, uncompressed), each after
/// what it depends on: the guest's insmod order.
fn with_dependencies(modules: &Path, wanted: &[&str]) -> Result<Vec<(String, PathBuf)>> {
    fn visit(
        modules: &Path,
        name: &str,
        done: &mut Vec<(String, PathBuf)>,
        seen: &mut Vec<String>,
    ) -> Result {
        if seen.iter().any(|s| s == name) {
            return Ok(());
        }
        seen.push(name.to_string());
        let file = find_file(modules, &format!("{name}.ko"))
            .ok_or_else(|| format!("module {name} not found under {}", modules.display()))?;
        let out = Command::new("modinfo")
            .args(["-F", "depends"])
            .arg(&file)
            .output()
            .map_err(|e| format!("modinfo: {e}"))?;
        let depends = String::from_utf8_lossy(&out.stdout).trim().to_string();
        for dep in depends.split(',').filter(|d| !d.is_empty()) {
            visit(modules, dep, done, seen)?;
        }
        done.push((name.to_string(), file));
        Ok(())
    }
    let (mut done, mut seen) = (Vec::new(), Vec::new());
    for w in wanted {
        visit(modules, w, &mut done, &mut seen)?;
    }
    Ok(done)
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
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
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
