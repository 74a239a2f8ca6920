//! The `gpuio` command end to end. `GPUIO_BIN` points at another build of the binary (the GPU
//! bundle sets it); `GPUIO_E2E_BYTES` sets the size of the round trip through GPU memory
//! (64 MiB by default, 1 GiB in the GPU bundle).

use crate::common;

use gpuio_hal::pattern;
use gpuio_testkit::Requirement;
use std::path::PathBuf;
use std::process::{Command, Output};

fn gpuio(args: &[&str]) -> Output {
    let out = Command::new(common::bin())
        .args(args)
        .output()
        .expect("gpuio runs");
    assert_ne!(
        out.status.code(),
        Some(101),
        "gpuio panicked: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs gpuio with `env` added, failing the test (and killing it) if it runs past 60 s: the
/// cases that use it once hung forever.
fn gpuio_within(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(common::bin())
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("gpuio runs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            panic!("gpuio {args:?} hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert_ne!(
        out.status.code(),
        Some(101),
        "gpuio panicked: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn mkfifo(path: &std::path::Path) {
    let made = Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    assert!(made, "mkfifo {}", path.display());
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn info_lists_devices_and_paths() {
    let o = gpuio(&["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("gpu0") && text.contains("IO paths:"),
        "{text}"
    );
    let o = gpuio(&["info", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(!v["devices"].as_array().unwrap().is_empty());
    assert!(
        v["paths"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["engine"] == "memio")
    );
    if Requirement::Cuda.required() {
        assert_eq!(v["backend"], "cuda", "{v}");
    }
    let o = gpuio(&["info", "--show-config"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("api_version = 1"));
}

#[test]
fn a_file_round_trips_through_gpu_memory() {
    let bytes: usize = std::env::var("GPUIO_E2E_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64 << 20);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let dst = dir.path().join("dst.bin");
    let mut data = vec![0u8; bytes];
    let seed = pattern::mix64(std::process::id() as u64 ^ bytes as u64);
    pattern::fill(&mut data, 0, seed);
    std::fs::write(&src, &data).unwrap();
    drop(data);
    let o = gpuio(&[
        "cp",
        src.to_str().unwrap(),
        dst.to_str().unwrap(),
        "--via",
        "gpu0",
        "--verify",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary = String::from_utf8_lossy(&o.stdout);
    assert!(summary.contains("verified"), "{summary}");
    eprintln!("{summary}");
    let back = std::fs::read(&dst).unwrap();
    assert_eq!(back.len(), bytes);
    assert_eq!(pattern::first_deviation(&back, 0, seed), None);
}

#[test]
fn bad_input_gets_typed_errors_and_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("s");
    std::fs::write(&src, b"hello").unwrap();
    let s = src.to_str().unwrap();
    let cases: &[(&[&str], i32, &str)] = &[
        (&["cp", "memio://cpu/dram?numa=x", "gpu0"], 3, "numa"),
        (&["cp", "nvmf://x", "gpu0"], 3, "unknown scheme"),
        (&["cp", "nvme://x", "gpu0"], 3, "a PCI address"),
        (&["cp", "/nonexistent/file", "gpu0"], 4, "No such file"),
        (&["cp", s, "gpu99"], 4, "GPU 99"),
        (&["cp", s, "memio://cpu/dram?numa=999"], 4, "NUMA node 999"),
        (&["cp", "gpu0", s], 3, "no content"),
        (&["cp", s, s], 3, "same file"),
        (
            &["cp", s, "remoteio://10.1.1.1:9/x"],
            3,
            "RemoteIO needs a key",
        ),
        (
            &["cp", s, "remoteio://10.1.1.1:9/x?transport=rdma"],
            8,
            "RDMA",
        ),
        (&["bench", "nosuchsuite"], 3, "unknown suite"),
        (&["bench", "--sizes", "4Q"], 3, "bad size"),
    ];
    for (args, code, needle) in cases {
        let o = gpuio(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(*code), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(err.contains("GPUIO_ERROR_"), "{args:?}: {err}");
    }
    let o = gpuio(&["--backend", "opencl", "info"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn bench_writes_records_a_plot_and_a_table() {
    let dir = tempfile::tempdir().unwrap();
    let o = gpuio(&[
        "bench",
        "memio",
        "--quick",
        "--sizes",
        "64K,2M",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("h2d_pageable") && table.contains("ratio"),
        "{table}"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("memio.json")).unwrap()).unwrap();
    let records = json["records"].as_array().unwrap();
    assert_eq!(records.len(), 2 * 5);
    for r in records {
        for field in [
            "suite",
            "case",
            "metric",
            "value",
            "unit",
            "peer",
            "peer_value",
            "ratio",
        ] {
            assert!(!r[field].is_null(), "{field} missing in {r}");
        }
        assert!(r["value"].as_f64().unwrap() > 0.0);
    }
    let svg = std::fs::read_to_string(dir.path().join("memio.svg")).unwrap();
    assert!(svg.starts_with("<svg"));
}

#[test]
fn a_running_command_serves_metrics_that_stat_reads() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let out = tempfile::tempdir().unwrap();
    let bin = std::env::var_os("GPUIO_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_gpuio")));
    // The core suite runs its requests through the scheduler, which records metrics.
    let mut child = Command::new(bin)
        .args([
            "--metrics-addr",
            &addr,
            "--metrics-linger",
            "20",
            "bench",
            "core",
            "--quick",
        ])
        .arg("--out")
        .arg(out.path())
        // The child is killed mid-run: its scratch files must die with `out`, not in /tmp.
        .arg("--scratch")
        .arg(out.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let text = loop {
        let o = gpuio(&["stat", "--addr", &addr]);
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        if o.status.success() && text.contains("deadlines:") {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no metrics from {addr}: {text} {}",
            stderr(&o)
        );
        std::thread::sleep(std::time::Duration::from_millis(300));
    };
    child.kill().ok();
    child.wait().ok();
    assert!(
        text.contains("memio") && text.contains("latency p50"),
        "{text}"
    );
    // The session's staging pool reports from the start: its limit (memory_pool_size) and use.
    assert!(
        text.contains("staging pool: limit") && text.contains("failures"),
        "{text}"
    );
    // Nothing listens: a typed error, not a hang.
    let o = gpuio(&["stat", "--addr", "127.0.0.1:1"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("reading metrics"), "{}", stderr(&o));
}

#[test]
fn the_agent_serves_its_exports_until_sigterm() {
    use gpuio_transport_remoteio::{Credentials, PeerConfig, RemoteExport, RemotePeer};
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let file = dir.path().join("export.bin");
    std::fs::write(&file, &data).unwrap();
    // The key as an operator makes it: `gpuio agent keygen --out FILE`.
    let key = dir.path().join("ops.key");
    let o = gpuio(&["agent", "keygen", "--out", key.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let secret = std::fs::read_to_string(&key)
        .unwrap()
        .trim_end()
        .to_string();
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[agent]
listen = "127.0.0.1:0"
[[agent.keys]]
id = "ops"
role = "read-only"
secret_file = "{}"
[[agent.exports]]
name = "data"
access = "read-only"
file = "{}"
"#,
            key.display(),
            file.display()
        ),
    )
    .unwrap();
    let (mut child, addr, out) = common::spawn_agent(&cfg, &[]);
    let creds = Credentials {
        key_id: "ops".into(),
        secret: secret.as_bytes().to_vec(),
    };
    let c = RemotePeer::connect(PeerConfig::new(addr, creds)).unwrap();
    let mut got = vec![0u8; 50_000];
    let export = RemoteExport::new("data");
    c.read(&export, 25_000, &mut got).unwrap();
    assert!(got[..] == data[25_000..75_000]);
    // A read-only key cannot write: refused before anything is sent.
    assert!(c.write(&export, 0, &[1]).is_err());
    drop(c);
    let term = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let rest: Vec<String> = out.lines().map(|l| l.unwrap()).collect();
    assert!(
        rest.iter()
            .any(|l| l.starts_with("served 2 requests (0 refused)")),
        "{rest:?}"
    );
}

#[test]
fn wait_options_are_refused_when_they_make_no_sense() {
    for bad in ["inf", "1e300", "-1", "NaN"] {
        let o = gpuio(&[
            "--metrics-addr",
            "127.0.0.1:0",
            "--metrics-linger",
            bad,
            "info",
        ]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--metrics-linger"), "{bad}: {err}");
        let o = gpuio(&["stat", "--watch", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", stderr(&o));
    }
}

#[test]
fn errors_show_control_characters_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let hostile = dir
        .path()
        .join("missing\u{1b}[2J\u{1b}]0;owned\u{7}\nfake: line\u{9b}31m");
    let o = gpuio(&["cp", hostile.to_str().unwrap(), "gpu0"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(4), "{err}");
    assert!(
        !err.trim_end_matches('\n').chars().any(|c| c.is_control()),
        "raw control characters reach the terminal: {err:?}"
    );
    assert!(
        err.contains("missing\\x1b[2J\\x1b]0;owned\\x07\\nfake: line\\u{9b}31m"),
        "{err}"
    );
    let o = gpuio(&["--config", hostile.to_str().unwrap(), "info"]);
    let err = stderr(&o);
    assert!(!o.status.success());
    assert!(
        !err.trim_end_matches('\n').chars().any(|c| c.is_control()),
        "{err:?}"
    );
    // Usage errors quote the bad value: clap strips escape sequences, not lone controls.
    let o = gpuio(&["stat", "--addr", "x\u{7}y\u{9b}2Jz\rw"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!err.chars().any(|c| c.is_control() && c != '\n'), "{err:?}");
    assert!(err.contains("\\u{9b}2Jz\\rw"), "{err}");
}

#[test]
fn a_configuration_that_is_not_a_small_regular_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("gpuio.toml");
    mkfifo(&fifo);
    let fifo = fifo.to_str().unwrap();
    for (args, env, needle) in [
        (&["--config", fifo, "info"][..], &[][..], "a FIFO"),
        (&["info"][..], &[("GPUIO_CONFIG", fifo)][..], "a FIFO"),
        (
            &["--config", "/dev/zero", "info"][..],
            &[][..],
            "a character device",
        ),
        (
            &["info"][..],
            &[("GPUIO_CONFIG", "/dev/zero")][..],
            "a character device",
        ),
    ] {
        let o = gpuio_within(args, env);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(3), "{args:?} {env:?}: {err}");
        assert!(err.contains(needle) && err.contains("regular"), "{err}");
    }
}

#[test]
fn an_empty_gpuio_config_means_none() {
    let o = gpuio_within(&["info", "--show-config"], &[("GPUIO_CONFIG", "")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let shown = String::from_utf8_lossy(&o.stdout);
    assert!(shown.contains("memory_pool_size"), "{shown}");
}

#[test]
fn sources_that_cannot_be_sized_are_refused_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let out = dir.path().join("out");
    let mut cases = vec![(fifo.to_str().unwrap().to_string(), "a FIFO")];
    for (path, kind) in [
        ("/dev/zero", "a character device"),
        ("/dev/urandom", "a character device"),
        ("/proc/cpuinfo", "has content"),
        ("/proc/self/mem", "cannot be read"),
    ] {
        if std::path::Path::new(path).exists() {
            cases.push((path.into(), kind));
        }
    }
    for (src, kind) in &cases {
        for extra in [&[][..], &["--via", "gpu0"][..]] {
            let mut args = vec!["cp", src.as_str(), out.to_str().unwrap()];
            args.extend_from_slice(extra);
            let o = gpuio_within(&args, &[]);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(3), "{args:?}: {err}");
            assert!(
                err.contains(src.as_str()) && err.contains(kind) && err.contains("cannot be sized"),
                "{args:?}: {err}"
            );
            assert!(!out.exists(), "{args:?} left {}", out.display());
            let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
            assert_eq!(leftovers, 1, "{args:?}: only the FIFO should be there");
        }
    }
}

#[test]
fn info_reports_what_this_build_and_machine_have() {
    let o = gpuio(&["info"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(!text.contains("is not in this build\n"), "{text}");
    assert!(
        !text.contains("RemoteIO is not in this build")
            && !text.contains("GPU-initiated IO is not in this build"),
        "{text}"
    );
    let o = gpuio(&["info", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let paths = v["paths"].as_array().unwrap();
    let path = |engine: &str, name: &str| -> (bool, String) {
        let p = paths
            .iter()
            .find(|p| p["engine"] == engine && p["path"].as_str().unwrap().contains(name))
            .unwrap_or_else(|| panic!("no {engine} {name} in {paths:?}"));
        (
            p["available"].as_bool().unwrap(),
            p["detail"].as_str().unwrap().to_string(),
        )
    };
    assert!(path("remoteio", "TCP").0);
    assert!(path("remoteio", "TLS").0);
    let (rdma, detail) = path("remoteio", "RDMA verbs");
    if cfg!(feature = "rdma") {
        assert!(detail.starts_with("built in"), "{detail}");
    } else {
        assert!(!rdma && detail.contains("not in this build"), "{detail}");
    }
    assert!(!path("remoteio", "GPUDirect RDMA").0);
    let (registry, detail) = path("remoteio", "etcd registry");
    assert_eq!(registry, cfg!(feature = "registry"), "{detail}");
    let (gathers, g_detail) = path("gpu-initiated", "row gathers");
    let (ring, r_detail) = path("gpu-initiated", "request ring");
    if v["backend"] == "host" {
        assert!(gathers && g_detail.contains("CPU"), "{g_detail}");
        assert!(!ring && r_detail.contains("runs no kernels"), "{r_detail}");
    } else if Requirement::Cuda.required() {
        assert!(gathers, "{g_detail}");
        assert!(ring, "{r_detail}");
    }
}

#[test]
fn agent_keygen_makes_strong_private_secrets() {
    use gpuio_transport_remoteio::auth::check_secret;
    use std::os::unix::fs::PermissionsExt;
    let printed = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let a = gpuio(&["agent", "keygen"]);
    let b = gpuio(&["agent", "keygen"]);
    assert!(a.status.success() && b.status.success(), "{}", stderr(&a));
    let (a, b) = (printed(&a), printed(&b));
    for s in [&a, &b] {
        let secret = s.strip_suffix('\n').expect("one line");
        assert_eq!(secret.len(), 64, "{s:?}");
        assert!(secret.bytes().all(|c| c.is_ascii_hexdigit()), "{s:?}");
        check_secret("k", secret.as_bytes()).unwrap();
    }
    assert_ne!(a, b);
    // No configuration is needed, and a broken one does not stop it.
    let o = gpuio_within(
        &["agent", "keygen"],
        &[("GPUIO_CONFIG", "/nonexistent.toml")],
    );
    assert!(o.status.success(), "{}", stderr(&o));

    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("k");
    let k = key.to_str().unwrap();
    let o = gpuio(&["agent", "keygen", "--out", k]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(printed(&o).is_empty(), "the secret goes to the file only");
    let meta = std::fs::metadata(&key).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let first = std::fs::read_to_string(&key).unwrap();
    assert_eq!(first.len(), 65);
    check_secret("k", first.trim_end().as_bytes()).unwrap();
    // Never overwritten, not even through a symlink.
    let o = gpuio(&["agent", "keygen", "--out", k]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("exists"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&key).unwrap(), first);
    let target = dir.path().join("target");
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let o = gpuio(&["agent", "keygen", "--out", link.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(!target.exists());
}
