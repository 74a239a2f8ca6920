//! `cargo xtask python`: the Python binding built as users get it — a wheel by maturin,
//! installed (not linked in place) into a virtual environment under `target/pyenv` with the
//! test tools — and its pytests run there. Part of `ci`; `gpu-bundle` carries a release wheel
//! and the test tools' wheels to the GPU machine, which has no network.

use crate::{Result, root, run};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The tools, pinned: maturin builds the wheel, pytest and NumPy run the tests, safetensors is
/// what `gpuio.safetensors` is checked against.
pub const TOOLS: &[&str] = &[
    "maturin==1.16.0",
    "pytest==9.2.0",
    "numpy==2.4.6",
    "safetensors==0.7.0",
];

/// Pure-Python wheels pytest needs on the GPU machine (Python 3.11 or later); NumPy comes with
/// torch there.
pub const PYTEST_WHEELS: &[&str] = &[
    "pytest==9.2.0",
    "pluggy==1.7.0",
    "iniconfig==2.3.1",
    "packaging==26.3",
    "pygments==2.21.0",
];

fn pip_env(cmd: &mut Command) -> &mut Command {
    cmd.env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_ROOT_USER_ACTION", "ignore")
}

/// The virtual environment's Python, with [`TOOLS`] installed (once per pin set).
pub fn venv() -> Result<PathBuf> {
    let dir = root().join("target/pyenv");
    let python = dir.join("bin/python");
    let stamp = dir.join("gpuio-tools");
    let want = TOOLS.join("\n");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(want.as_str()) {
        let _ = std::fs::remove_dir_all(&dir);
        run(
            "create a Python virtual environment",
            Command::new("python3").args(["-m", "venv"]).arg(&dir),
        )?;
        run(
            "install maturin, pytest, NumPy and safetensors from PyPI",
            pip_env(
                Command::new(&python)
                    .args(["-m", "pip", "install", "--quiet"])
                    .args(TOOLS),
            ),
        )?;
        std::fs::write(&stamp, &want).map_err(|e| format!("{}: {e}", stamp.display()))?;
    }
    Ok(python)
}

/// Builds the binding's wheel into `out` (`release`: optimised, as published; otherwise the
/// dev profile, which shares the test build's artifacts); returns its path.
pub fn wheel(python: &Path, release: bool, out: &Path) -> Result<PathBuf> {
    let _ = std::fs::remove_dir_all(out);
    let maturin = python.with_file_name("maturin");
    let mut cmd = Command::new(&maturin);
    cmd.args(["build", "--quiet", "--compatibility", "linux", "--out"])
        .arg(out)
        .arg("--manifest-path")
        .arg(root().join("crates/gpuio-py/Cargo.toml"));
    if release {
        cmd.arg("--release");
    }
    run("build the Python wheel (maturin)", &mut cmd)?;
    std::fs::read_dir(out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("maturin left no wheel in {}", out.display()))
}

/// Builds the wheel, installs it into the virtual environment and runs the pytests.
pub fn python() -> Result {
    let python = venv()?;
    let wheel = wheel(&python, false, &root().join("target/wheels"))?;
    run(
        "install the wheel",
        pip_env(
            Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--no-deps",
                    "--force-reinstall",
                ])
                .arg(&wheel),
        ),
    )?;
    run(
        "Python binding tests (pytest)",
        Command::new(&python)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
            .arg(root().join("crates/gpuio-py/pytests"))
            // The installed wheel, not the source tree's `python/gpuio` without its module.
            .current_dir(root().join("target")),
    )
}

/// Installs `wheels` (pinned, without their dependencies) into `dir` with pip, unless the
/// stamp there says exactly these are installed already.
pub fn pip_target(dir: &Path, wheels: &[&str], what: &str) -> Result {
    let stamp = dir.join("installed");
    let want = wheels.join("\n");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        return Ok(());
    }
    let _ = std::fs::remove_dir_all(dir);
    let python = ["python3", "python"]
        .into_iter()
        .find(|p| crate::has(p, "--version"))
        .ok_or_else(|| format!("{what}: needs python3 with pip"))?;
    let mut pip = Command::new(python);
    pip.args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
        .arg(dir)
        .args(wheels)
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_ROOT_USER_ACTION", "ignore");
    crate::run(what, &mut pip)?;
    std::fs::write(&stamp, &want).map_err(|e| format!("{}: {e}", stamp.display()))
}
