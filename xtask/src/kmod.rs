//! `cargo xtask kmod [--kdir DIR]`: builds gpuio's kernel module (`kmod/`) against a kernel's
//! build tree: `--kdir`, else the newest under `/lib/modules` that has one (Debian's
//! `linux-headers-amd64`, installed when missing, matches `linux-image-amd64`, the QEMU
//! guest's kernel). The sources are copied to `target/kmod`, so no build output lands in the
//! tree; the module is `target/kmod/gpuio_nvme.ko`.

use crate::ci::ensure_packages;
use crate::{Result, copy, root, run};
use std::path::{Path, PathBuf};
use std::process::Command;

pub fn kmod(args: &[String]) -> Result {
    let kdir = match args {
        [] => None,
        [flag, dir] if flag == "--kdir" => Some(PathBuf::from(dir)),
        _ => return Err("usage: cargo xtask kmod [--kdir DIR]".into()),
    };
    let ko = build(kdir)?;
    println!("kmod: {}", ko.display());
    Ok(())
}

/// Builds the module; its path.
pub fn build(kdir: Option<PathBuf>) -> Result<PathBuf> {
    let kdir = match kdir {
        Some(k) => k,
        None => {
            ensure_packages(&["linux-headers-amd64", "make", "gcc"])?;
            newest_build_tree()?
        }
    };
    let out = root().join("target/kmod");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    for f in ["gpuio_nvme.c", "Kbuild"] {
        copy(&root().join("kmod").join(f), &out.join(f))?;
    }
    run(
        &format!("build kmod/ against {}", kdir.display()),
        Command::new("make")
            .arg("-C")
            .arg(&kdir)
            .arg(format!("M={}", out.display()))
            .arg("modules"),
    )?;
    let ko = out.join("gpuio_nvme.ko");
    if !ko.exists() {
        return Err(format!("make did not produce {}", ko.display()));
    }
    Ok(ko)
}

/// The newest `/lib/modules/<release>/build` that has a Makefile.
fn newest_build_tree() -> Result<PathBuf> {
    let entries = std::fs::read_dir("/lib/modules").map_err(|e| format!("/lib/modules: {e}"))?;
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("build"))
        .filter(|b| Path::new(b).join("Makefile").exists())
        .max()
        .ok_or_else(|| {
            "no kernel build tree under /lib/modules (install linux-headers-amd64)".into()
        })
}
