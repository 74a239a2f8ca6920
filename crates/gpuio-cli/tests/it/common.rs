//! What the CLI's test files share: the binary under test, and `gpuio agent` processes.

#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

/// The `gpuio` binary: `GPUIO_BIN` (the GPU bundle's), else this build's.
pub fn bin() -> PathBuf {
    std::env::var_os("GPUIO_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_gpuio")))
}

/// Starts `gpuio --config cfg agent` with `env` added, and waits for its first line, which
/// says where it listens. Returns the process, that address, and the rest of its output.
pub fn spawn_agent(
    cfg: &Path,
    env: &[(&str, &str)],
) -> (Child, SocketAddr, BufReader<ChildStdout>) {
    let mut child = Command::new(bin())
        .args(["--config", cfg.to_str().unwrap(), "agent"])
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    let addr = first
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {first:?}"));
    (child, addr, out)
}

/// Writes `text` to `path`, readable by its owner alone (as secret files must be).
pub fn write_private(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
}

/// Runs `gpuio --config cfg agent` with `env` added, expecting it to fail at start.
pub fn agent_refusing(cfg: &Path, env: &[(&str, &str)]) -> std::process::Output {
    Command::new(bin())
        .args(["--config", cfg.to_str().unwrap(), "agent"])
        .envs(env.iter().copied())
        .output()
        .unwrap()
}
