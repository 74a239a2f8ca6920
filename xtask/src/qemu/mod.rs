//! The QEMU matrix: test binaries run in a QEMU guest (TCG) that has what this machine lacks.
//! [`Guest`] packs test binaries with busybox, the guest kernel's modules and the shared
//! libraries they load into an initramfs, boots Debian's kernel on it, and checks that each
//! binary passed exactly the tests its filter selects (listed here first, at least one).
//!
//! - `qemu-rdma` ([`rdma`]): the RDMA tests on soft-RoCE.
//! - `qemu-nvme` ([`nvme`]): the NVMe driver against QEMU's emulated NVMe, bound to vfio-pci
//!   behind an emulated IOMMU.

pub mod nvme;
pub mod rdma;

use crate::{
    Result, build_tests, copy, listed_tests_with, make_executable, root, run, tests_passed,
};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Debian packages the QEMU matrix needs: the guest kernel, busybox, QEMU, and what the
/// guests run (the rxe provider, the `rdma` tool).
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

/// One step of the guest's script: shell, or a test binary run with a filter, which must
/// pass as many tests as the filter selects.
enum Step {
    Shell(String),
    Tests {
        label: String,
        binary: String,
        args: String,
        env: String,
        selected: usize,
    },
}

/// A guest being put together under `target/<name>`.
pub struct Guest {
    work: PathBuf,
    root: PathBuf,
    kernel: PathBuf,
    modules_dir: PathBuf,
    modules: Vec<String>,
    libraries_for: Vec<PathBuf>,
    /// Test binaries in the guest (its name there, its path here).
    binaries: Vec<(String, PathBuf)>,
    steps: Vec<Step>,
}

impl Guest {
    /// An empty guest: busybox and the directories init needs.
    pub fn new(name: &str) -> Result<Self> {
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
        let work = root().join("target").join(name);
        let _ = std::fs::remove_dir_all(&work);
        let guest = work.join("root");
        for d in ["bin", "lib/modules", "dev", "proc", "sys", "tmp", "tests"] {
            std::fs::create_dir_all(guest.join(d)).map_err(|e| format!("{d}: {e}"))?;
        }
        copy(Path::new("/bin/busybox"), &guest.join("bin/busybox"))?;
        Ok(Self {
            work,
            root: guest,
            kernel,
            modules_dir: Path::new("/lib/modules").join(release),
            modules: Vec::new(),
            libraries_for: Vec::new(),
            binaries: Vec::new(),
            steps: Vec::new(),
        })
    }

    /// The guest's working directory on this machine (disk images go here).
    pub fn work(&self) -> &Path {
        &self.work
    }

    /// Kernel modules init loads, each after what it depends on (as `modinfo` says: the
    /// order changes between kernel updates).
    pub fn modules(&mut self, wanted: &[&str]) -> Result {
        for (m, found) in with_dependencies(&self.modules_dir, wanted)? {
            if !self.modules.contains(&m) {
                copy(&found, &self.root.join(format!("lib/modules/{m}.ko")))?;
                self.modules.push(m);
            }
        }
        Ok(())
    }

    /// `from` at the same path in the guest, with the shared libraries it loads.
    pub fn file(&mut self, from: &Path) -> Result {
        let to = self.root.join(from.strip_prefix("/").unwrap_or(from));
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        copy(from, &to)?;
        self.libraries_for.push(from.to_path_buf());
        Ok(())
    }

    /// Builds the test binaries of `crates` with `features` into the guest; their names there.
    pub fn build_tests(&mut self, crates: &[&str], features: &str) -> Result<Vec<String>> {
        let mut args: Vec<&str> = crates.iter().flat_map(|c| ["-p", *c]).collect();
        args.extend(["--features", features, "--test", "it"]);
        let built = build_tests("build the guest's tests", &args)?;
        if built.len() != crates.len() {
            return Err(format!(
                "built {} test binaries, expected one for each of {crates:?}",
                built.len()
            ));
        }
        let mut names = Vec::new();
        for t in built {
            let name = format!("{}--{}", t.package, t.target);
            copy(&t.path, &self.root.join("tests").join(&name))?;
            self.libraries_for.push(t.path.clone());
            self.binaries.push((name.clone(), t.path));
            names.push(name);
        }
        Ok(names)
    }

    /// A program built here, as `/tests/<name>` in the guest, with the shared libraries it
    /// loads.
    pub fn program(&mut self, from: &Path, name: &str) -> Result {
        copy(from, &self.root.join("tests").join(name))?;
        self.libraries_for.push(from.to_path_buf());
        Ok(())
    }

    /// A step running test binary `name` with libtest arguments `args` (a filter, `--skip`s,
    /// or none: every test; the ignored tests they select where `ignored`) and `env`; it must
    /// select a test, and pass every one it selects.
    pub fn run_tests(&mut self, name: &str, args: &[&str], env: &str, ignored: bool) -> Result {
        let path = self
            .binaries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p.clone())
            .ok_or_else(|| format!("no test binary {name} in the guest"))?;
        let ignored_ones = listed_tests_with(&path, &[args, &["--ignored"]].concat())?.len();
        let selected = if ignored {
            ignored_ones
        } else {
            listed_tests_with(&path, args)?.len() - ignored_ones
        };
        if selected == 0 {
            return Err(format!("{name} has no test matching `{}`", args.join(" ")));
        }
        let args = if ignored {
            format!("{} --ignored", args.join(" "))
        } else {
            args.join(" ")
        };
        self.steps.push(Step::Tests {
            label: format!("{name} {args}").trim_end().to_string(),
            binary: name.into(),
            args,
            env: env.into(),
            selected,
        });
        Ok(())
    }

    /// `from` (a kernel module built here) into the guest, loaded after the others.
    pub fn module_file(&mut self, from: &Path) -> Result {
        let name = from
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| format!("{}: not a module file", from.display()))?;
        copy(from, &self.root.join(format!("lib/modules/{name}.ko")))?;
        self.modules.push(name);
        Ok(())
    }

    /// A shell step.
    pub fn shell(&mut self, script: &str) {
        self.steps.push(Step::Shell(script.into()));
    }

    /// Boots the guest: init loads the modules, then runs the steps in order; `qemu` adds
    /// devices, `append` kernel arguments. Returns how many tests passed.
    pub fn boot(mut self, qemu: &[String], append: &str) -> Result<usize> {
        let mut script = String::new();
        for step in &self.steps {
            match step {
                Step::Shell(s) => {
                    script.push_str(s);
                    script.push('\n');
                }
                Step::Tests {
                    label,
                    binary,
                    args,
                    env,
                    ..
                } => script.push_str(&format!(
                    "echo \"== {label}\"; if {env} RUST_BACKTRACE=1 /tests/{binary} {args} --test-threads=1; then echo \"QEMU-PASS {label}\"; else echo \"QEMU-FAIL {label}\"; fi\n"
                )),
            }
        }
        let init = format!(
            "#!/bin/busybox sh\n\
             /bin/busybox --install -s /bin\n\
             mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev\n\
             for m in {modules}; do insmod /lib/modules/$m.ko || echo \"insmod $m failed\"; done\n\
             export TMPDIR=/tmp\n\
             {script}\
             echo QEMU-DONE\n\
             poweroff -f\n",
            modules = self.modules.join(" "),
        );
        let init_path = self.root.join("init");
        std::fs::write(&init_path, init).map_err(|e| format!("init: {e}"))?;
        make_executable(&init_path)?;
        for b in std::mem::take(&mut self.libraries_for) {
            for lib in shared_libraries(&b)? {
                let to = self.root.join(lib.strip_prefix("/").unwrap_or(&lib));
                if let Some(dir) = to.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                }
                if !to.exists() {
                    copy(&lib, &to)?;
                }
            }
        }
        let initrd = self.work.join("initrd.cpio");
        run(
            "pack the initramfs",
            Command::new("sh").arg("-c").arg(format!(
                "cd {} && find . | cpio -o -H newc --quiet > {}",
                self.root.display(),
                initrd.display()
            )),
        )?;
        eprintln!("==> boot {} in QEMU (TCG)", self.kernel.display());
        let started = Instant::now();
        let out = Command::new("timeout")
            .arg("900")
            .arg("qemu-system-x86_64")
            .args([
                "-m",
                "2048",
                "-smp",
                "2",
                "-nographic",
                "-no-reboot",
                "-kernel",
            ])
            .arg(&self.kernel)
            .arg("-initrd")
            .arg(&initrd)
            .arg("-append")
            .arg(format!("console=ttyS0 quiet panic=-1 {append}"))
            .args(qemu)
            .output()
            .map_err(|e| format!("qemu: {e}"))?;
        // The serial console ends lines with CR LF.
        let text = String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n");
        let log = self.work.join("guest.log");
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
        let mut total = 0;
        for step in &self.steps {
            let Step::Tests {
                label, selected, ..
            } = step
            else {
                continue;
            };
            let output = text
                .split_once(&format!("== {label}\n"))
                .and_then(|(_, after)| after.split_once(&format!("QEMU-PASS {label}\n")))
                .map(|(output, _)| output);
            let passed = output.map_or(0, tests_passed);
            if output.is_none() || passed != *selected as u64 {
                problems.push(format!("{label}: {passed} of {selected} passed"));
            }
            total += selected;
        }
        if text.contains("QEMU-FAIL") || !problems.is_empty() {
            return Err(format!(
                "guest tests failed or did not run: {}",
                problems.join("; ")
            ));
        }
        Ok(total)
    }
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
        let name = &name.replace('-', "_");
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

/// The first file called `name` under `dir`, `-` and `_` alike (module names use `_`, some
/// module files `-`).
fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    let name = name.replace('-', "_");
    let entries = std::fs::read_dir(dir).ok()?;
    for e in entries.filter_map(|e| e.ok()) {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = find_file(&p, &name) {
                return Some(f);
            }
        } else if p
            .file_name()
            .is_some_and(|n| n.to_string_lossy().replace('-', "_") == name)
        {
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
