//! RemoteIO across several nodes: `gpuio agent` processes as separate hosts in network
//! namespaces (on loopback ports where namespaces are refused), registered in a real etcd
//! that the test starts, and a client session resolving `remoteio://<segment>/...` through it.
//!
//! Checked: reads and writes verified by checksum; an agent killed mid-transfer (the copy
//! fails over to the other replica, or fails with a typed error, never with wrong bytes) and
//! gone from the registry when its lease expires; a network cut (link down) that recovers;
//! wrong keys, forbidden exports and out-of-bounds ranges refused with the agents serving on.
//!
//! Needs `etcd` (Debian etcd-server) and, for namespaces, root and iproute2. Without etcd
//! the test says so and passes, unless `GPUIO_REQUIRE_ETCD=1` (CI sets it) makes it fail.
//! Built only with the CLI's (default) `registry` feature.

#![cfg(feature = "registry")]

use crate::hosts::{Hosts, sh};
use gpuio_api::{Access, Config, CopyOptions, ErrorCode, Resource, Session, Uri};
use gpuio_testkit::Requirement;
use gpuio_transport_remoteio::{Registry, RegistryConfig};
use std::io::BufRead;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Made by `gpuio agent keygen` (agents refuse weak secrets).
const SECRET: &str = "da403df6ec318e1a90d34b08dea84289e43e5772774ff36f5e37bc611f478092";
const AGENTS: usize = 2;
const DATA: usize = 48 << 20;

fn bin() -> PathBuf {
    std::env::var_os("GPUIO_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_gpuio")))
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A child process killed when dropped.
pub(crate) struct Proc(pub(crate) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A real etcd, listening on loopback and on each address of `also_on` (the agent networks'
/// host addresses); `None` after saying why where there is no etcd.
pub(crate) fn start_etcd(dir: &Path, also_on: &[String]) -> Option<(Proc, u16)> {
    if !sh(&["etcd", "--version"]) {
        Requirement::Etcd.missing("no etcd on this machine (apt-get install etcd-server)");
        return None;
    }
    let (port, peer) = (free_port(), free_port());
    let mut listen = vec![format!("http://127.0.0.1:{port}")];
    listen.extend(also_on.iter().map(|ip| format!("http://{ip}:{port}")));
    let child = Command::new("etcd")
        .args(["--name", "gpuio-test", "--data-dir"])
        .arg(dir.join("etcd"))
        .args(["--listen-client-urls", &listen.join(",")])
        .args(["--advertise-client-urls", &listen[0]])
        .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
        .args([
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
        ])
        .args([
            "--initial-cluster",
            &format!("gpuio-test=http://127.0.0.1:{peer}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd starts");
    let etcd = Proc(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "etcd never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some((etcd, port))
}

/// Starts agent `i` serving `data` (read-only) and `scratch` (read-write) in segment `seg`.
fn start_agent(hosts: &Hosts, i: usize, dir: &Path, etcd_port: u16) -> Proc {
    let cfg = dir.join(format!("agent{i}.toml"));
    std::fs::write(
        &cfg,
        format!(
            r#"
[agent]
listen = "{ip}:0"
segment = "seg"
name = "a{i}"
lease_ttl_s = 2
[[agent.keys]]
id = "ops"
role = "read-write"
secret_env = "GPUIO_TEST_KEY"
[[agent.exports]]
name = "data"
access = "read-only"
file = "{data}"
[[agent.exports]]
name = "scratch"
access = "read-write"
file = "{scratch}"
[remote]
registry = ["http://{host}:{etcd_port}"]
"#,
            ip = hosts.agent_ip(i),
            host = hosts.host_ip(i),
            data = dir.join(format!("data{i}.bin")).display(),
            scratch = dir.join(format!("scratch{i}.bin")).display(),
        ),
    )
    .unwrap();
    let mut child = hosts
        .command(i, &bin())
        .args(["--config", cfg.to_str().unwrap(), "agent"])
        .env("GPUIO_TEST_KEY", SECRET)
        .stdout(Stdio::piped())
        .spawn()
        .expect("gpuio agent starts");
    // It prints its address, its exports, then its registration.
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    for _ in 0..3 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "agent {i} ended before registering");
    }
    // Keep reading, so that what it prints at shutdown has somewhere to go.
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    Proc(child)
}

fn session(etcd_port: u16, secret_file: &str) -> Session {
    let mut cfg = Config::default();
    cfg.remote.key_id = "ops".into();
    cfg.remote.secret_file = secret_file.into();
    cfg.remote.registry = vec![format!("http://127.0.0.1:{etcd_port}")];
    cfg.remote.timeout_ms = 1500;
    cfg.retry.max_retries = 1;
    Session::new(cfg).unwrap()
}

fn uri(s: &str) -> Uri {
    Uri::parse(s).unwrap()
}

fn copy(s: &Session, from: &str, to: &Path) -> gpuio_api::Result<u32> {
    let opts = CopyOptions {
        verify: true,
        ..CopyOptions::default()
    };
    let to = uri(to.to_str().unwrap());
    s.copy(&uri(from), &to, &opts, &mut |_| {})
        .map(|r| r.checksum.unwrap_or_default())
}

fn wait_until(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn agents_on_several_hosts_serve_a_segment_through_the_registry() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = Hosts::new(AGENTS, "mn", 211);
    let also_on: Vec<String> = match hosts.isolated() {
        true => (1..=AGENTS).map(|i| hosts.host_ip(i).to_string()).collect(),
        false => Vec::new(),
    };
    let Some((_etcd, port)) = start_etcd(dir.path(), &also_on) else {
        return;
    };
    // Both replicas hold the same bytes.
    let data: Vec<u8> = (0..DATA).map(|i| (i * 131 % 251) as u8).collect();
    for i in 1..=AGENTS {
        std::fs::write(dir.path().join(format!("data{i}.bin")), &data).unwrap();
        std::fs::write(
            dir.path().join(format!("scratch{i}.bin")),
            vec![0u8; 1 << 20],
        )
        .unwrap();
    }
    let mut agents: Vec<Option<Proc>> = (1..=AGENTS)
        .map(|i| Some(start_agent(&hosts, i, dir.path(), port)))
        .collect();
    let s = session(port, &secret_file(dir.path(), "key", SECRET));
    let want = crc32c::crc32c(&data);

    // A read through the registry, verified.
    let out = dir.path().join("copy.bin");
    assert_eq!(copy(&s, "remoteio://seg/data", &out).unwrap(), want);
    assert!(std::fs::read(&out).unwrap() == data);

    // A write reaches every replica.
    let small: Vec<u8> = (0..300_000u32).map(|i| (i % 241) as u8).collect();
    let src = dir.path().join("small.bin");
    std::fs::write(&src, &small).unwrap();
    let to = uri("remoteio://seg/scratch");
    s.copy(
        &uri(src.to_str().unwrap()),
        &to,
        &CopyOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    for i in 1..=AGENTS {
        let back = std::fs::read(dir.path().join(format!("scratch{i}.bin"))).unwrap();
        assert!(back[..small.len()] == small[..], "replica {i}");
    }

    // Refusals: a forbidden export, a range past the end, a wrong key.
    let ro = uri("remoteio://seg/data");
    let err = s
        .copy(
            &uri(src.to_str().unwrap()),
            &ro,
            &CopyOptions::default(),
            &mut |_| {},
        )
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Permission, "{err}");
    let Resource::Remote(replicas) = s.open(&ro, 0, Access::Read).unwrap() else {
        panic!("a remote URI opened as something else");
    };
    let mut buf = vec![0u8; 4096];
    for r in &replicas {
        let err = r
            .peer()
            .read(r.export(), DATA as u64 - 100, &mut buf)
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    }
    let wrong = session(
        port,
        &secret_file(
            dir.path(),
            "wrong",
            "135d227938f0b050778e65298d6a9a977fc79661c205cfee766304ae469225d6",
        ),
    );
    let err = copy(&wrong, "remoteio://seg/data", &dir.path().join("no.bin")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Permission, "{err}");

    // A network cut: reads of that agent fail with a typed error, then recover.
    if hosts.isolated() {
        let one = format!("remoteio://{}/data", agent_addr(port, "a1"));
        hosts.link(1, false);
        let err = copy(&s, &one, &dir.path().join("cut.bin")).unwrap_err();
        assert!(
            matches!(err.code(), ErrorCode::Network | ErrorCode::Timeout),
            "{err}"
        );
        hosts.link(1, true);
        assert_eq!(
            copy(&s, &one, &dir.path().join("healed.bin")).unwrap(),
            want
        );
    } else {
        eprintln!("skipped the network cut: no namespaces");
    }

    // An agent killed mid-transfer: the copy fails over to the other replica or fails with a
    // typed error; what it delivers is never wrong.
    let killer = {
        let victim = agents[0].take().unwrap();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(victim);
        })
    };
    let during = dir.path().join("during.bin");
    let t = Instant::now();
    let outcome = copy(&s, "remoteio://seg/data", &during);
    eprintln!(
        "copy with an agent killed at 30 ms: {:?} after {:?}",
        outcome.as_ref().map(|_| ()),
        t.elapsed()
    );
    match outcome {
        Ok(crc) => {
            assert_eq!(crc, want);
            assert!(std::fs::read(&during).unwrap() == data);
        }
        Err(e) => {
            assert!(
                matches!(e.code(), ErrorCode::Network | ErrorCode::Timeout),
                "{e}"
            );
            assert!(!during.exists(), "a failed copy left a partial file");
        }
    }
    killer.join().unwrap();
    // Its lease runs out and it leaves the registry; the segment still resolves and serves.
    wait_until(
        "the dead agent leaves the registry",
        Duration::from_secs(15),
        || registry_members(port) == vec!["a2".to_string()],
    );
    assert_eq!(
        copy(&s, "remoteio://seg/data", &dir.path().join("after.bin")).unwrap(),
        want
    );
    // An agent that stops cleanly leaves at once.
    if let Some(mut a) = agents[1].take() {
        assert!(sh(&["kill", "-TERM", &a.0.id().to_string()]));
        assert!(a.0.wait().unwrap().success());
    }
    wait_until(
        "the stopped agent leaves the registry",
        Duration::from_secs(3),
        || registry_members(port).is_empty(),
    );
    let err = copy(&s, "remoteio://seg/data", &dir.path().join("none.bin")).unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound, "{err}");
}

fn secret_file(dir: &Path, name: &str, secret: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, secret).unwrap();
    // Secret files must be private to their owner.
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    p.display().to_string()
}

fn registry(port: u16) -> Registry {
    Registry::connect(RegistryConfig::new(vec![format!(
        "http://127.0.0.1:{port}"
    )]))
    .unwrap()
}

fn registry_members(port: u16) -> Vec<String> {
    let mut m: Vec<String> = registry(port)
        .resolve("seg")
        .unwrap()
        .into_iter()
        .map(|m| m.agent)
        .collect();
    m.sort();
    m
}

fn agent_addr(port: u16, agent: &str) -> std::net::SocketAddr {
    registry(port)
        .resolve("seg")
        .unwrap()
        .into_iter()
        .find(|m| m.agent == agent)
        .map(|m| m.addr)
        .expect("the agent is registered")
}
