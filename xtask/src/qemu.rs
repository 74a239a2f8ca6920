//! `cargo xtask qemu-rdma`: the RDMA tests (cargo feature `rdma`) in a QEMU guest with
//! soft-RoCE (rxe): builds them, packs them with busybox, the guest kernel's modules and
//! libibverbs' rxe provider into an initramfs, boots it under TCG, and reports what they
//! printed. Every test binary must pass with `GPUIO_REQUIRE_RDMA=1`.

use crate::ci::{RDMA_PACKAGES, ensure_packages};
use crate::{Result, build_tests, copy, make_executable, root, run};
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
    // The RDMA tests, built with the feature.
    let tests: Vec<PathBuf> = build_tests(
        "build the RDMA tests",
        &[
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
        ],
    )?
    .into_iter()
    .map(|t| t.path)
    .collect();
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
