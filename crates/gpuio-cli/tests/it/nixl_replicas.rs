//! A segment of two `gpuio agent`s serving a memory export over NIXL, through a real etcd: a
//! session's write reaches both replicas and its reads come back verified, with no byte on
//! either agent's TCP data path; one agent killed (no clean exit), reads fail over to the other
//! (a read is verified or fails with a typed error, never wrong bytes) and still go over NIXL.
//! Needs NIXL and etcd: without either the test says so and passes, unless
//! `GPUIO_REQUIRE_NIXL=1` / `GPUIO_REQUIRE_ETCD=1`.

use crate::common::write_private;
use crate::multinode::{Proc, start_etcd};
use gpuio_api::{Config, CopyOptions, ErrorCode, Session, Uri};
use gpuio_testkit::Requirement;
use std::io::BufRead;
use std::path::Path;
use std::time::{Duration, Instant};

/// Made by `gpuio agent keygen` (agents refuse weak secrets).
const SECRET: &str = "7f3a91c0d2e4b6a8c1e3f5a7b9d0c2e4f6a8b0c1d3e5f7a9b2c4d6e8f0a1b3c5";
const LEN: usize = 32 << 20;

/// Agent `name` of segment "nx", exporting `LEN` bytes of host memory as "kv" over NIXL; the
/// second value collects what it prints after starting (its closing line at SIGTERM).
fn agent(dir: &Path, name: &str, etcd: u16) -> (Proc, std::sync::mpsc::Receiver<String>) {
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(
        &cfg,
        format!(
            r#"
[agent]
listen = "127.0.0.1:0"
segment = "nx"
name = "{name}"
lease_ttl_s = 2
nixl = true
# UCX's TCP transport (which checks no keys) may stay on: a test machine's own processes
# (CI holds UCX to loopback, UCX_NET_DEVICES=lo).
nixl_tcp = true
[[agent.keys]]
id = "ops"
role = "read-write"
secret_env = "GPUIO_TEST_KEY"
[[agent.exports]]
name = "kv"
access = "read-write"
memory = "{LEN}"
[remote]
registry = ["http://127.0.0.1:{etcd}"]
"#
        ),
    )
    .unwrap();
    let (child, _, out) = crate::common::spawn_agent(&cfg, &[("GPUIO_TEST_KEY", SECRET)]);
    let mut lines = out.lines();
    // After its address: its exports, its registration.
    for _ in 0..2 {
        assert!(
            lines.next().is_some(),
            "agent {name} ended before registering"
        );
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    (Proc(child), rx)
}

fn copy(s: &Session, from: &str, to: &str) -> gpuio_api::Result<u32> {
    let opts = CopyOptions {
        verify: true,
        ..CopyOptions::default()
    };
    let (from, to) = (Uri::parse(from).unwrap(), Uri::parse(to).unwrap());
    s.copy(&from, &to, &opts, &mut |_| {})
        .map(|r| r.checksum.unwrap_or_default())
}

#[test]
fn replicas_over_nixl_take_writes_and_fail_over_reads() {
    if let Err(e) = gpuio_nixl::library() {
        Requirement::Nixl.missing(e);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some((_etcd, port)) = start_etcd(dir.path(), &[]) else {
        return;
    };
    let (a1, _) = agent(dir.path(), "a1", port);
    let (mut a2, a2_said) = agent(dir.path(), "a2", port);
    let key = dir.path().join("key");
    write_private(&key, SECRET);
    let mut cfg = Config::default();
    cfg.remote.key_id = "ops".into();
    cfg.remote.secret_file = key.display().to_string();
    cfg.remote.registry = vec![format!("http://127.0.0.1:{port}")];
    cfg.remote.timeout_ms = 1500;
    cfg.retry.max_retries = 1;
    let s = Session::new(cfg).unwrap();

    // A write reaches both replicas; a read comes back verified.
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
    let src = dir.path().join("src.bin");
    std::fs::write(&src, &data).unwrap();
    let kv = "remoteio://nx/kv?transport=nixl";
    copy(&s, src.to_str().unwrap(), kv).unwrap();
    let want = crc32c::crc32c(&data);
    let out = dir.path().join("out.bin");
    assert_eq!(copy(&s, kv, out.to_str().unwrap()).unwrap(), want);

    // One replica dies with no clean exit: every read is verified or a typed error, and reads
    // go on from the other replica.
    drop(a1);
    let mut served = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while served < 3 {
        assert!(Instant::now() < deadline, "reads never failed over");
        let _ = std::fs::remove_file(&out);
        match copy(&s, kv, out.to_str().unwrap()) {
            Ok(crc) => {
                assert_eq!(crc, want);
                assert!(std::fs::read(&out).unwrap() == data);
                served += 1;
            }
            Err(e) => assert!(
                matches!(
                    e.code(),
                    ErrorCode::Network | ErrorCode::Timeout | ErrorCode::NotFound
                ),
                "{e}"
            ),
        }
    }
    // The survivor served all of it over NIXL: its TCP data path moved no byte.
    assert!(crate::hosts::sh(&["kill", "-TERM", &a2.0.id().to_string()]));
    assert!(a2.0.wait().unwrap().success());
    // Its output up to the end: the reading thread forwards the last lines after the exit.
    let mut closing = Vec::new();
    while let Ok(line) = a2_said.recv_timeout(Duration::from_secs(10)) {
        closing.push(line);
    }
    let last = closing
        .iter()
        .find(|l| l.starts_with("served "))
        .expect("a closing line");
    assert!(last.ends_with("0 bytes read, 0 written"), "{last}");
}
