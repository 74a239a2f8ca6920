//! RemoteIO over NIXL between hosts: a `gpuio agent` with `[agent] nixl = true` in a network
//! namespace of its own (a loopback port where namespaces are refused), and `gpuio cp` clients
//! with `?transport=nixl` in this one. UCX is held to TCP (`UCX_TLS=tcp`) on both sides, so the
//! bytes cross the veth link rather than shared memory between the processes, each side's UCX
//! held to its end of that link (`UCX_NET_DEVICES`; CI holds the other tests' UCX to
//! loopback, since this one's interfaces come and go under them, as theirs do under this).
//!
//! Checked: a copy into the agent's memory export and one out of it, byte for byte, with none
//! of the bytes on the agent's TCP data path (its closing line says so); a read-only key's copy
//! served over TCP instead; `gpuio nixl-export` handing a program that uses NIXL's own Python
//! API (no gpuio code) the export, which it reads and writes, and refusing a read-only key. Needs NIXL (`cargo xtask nixl`): without it the test says so and
//! passes, unless `GPUIO_REQUIRE_NIXL=1`.

#![cfg(feature = "nixl")]

use crate::common::{bin, write_private};
use crate::hosts::Hosts;
use gpuio_testkit::Requirement;
use std::io::BufRead;
use std::process::{Command, Stdio};

/// Made by `gpuio agent keygen` (agents refuse weak secrets).
const RW: &str = "5b1f0e9c2a7d4e8f6b3c1a9e7d5f2b4c8e0a6d3f1b9c7e5a2d4f8b0c6e3a1d9f";
const RO: &str = "a3c5e7f9b1d2e4f6a8c0b2d4e6f8a1c3e5b7d9f0a2c4e6b8d1f3a5c7e9b2d4f6";
const LEN: usize = 24 << 20;

#[test]
fn gpuio_cp_moves_a_memory_export_over_nixl_between_hosts() {
    if let Err(e) = gpuio_nixl::library() {
        Requirement::Nixl.missing(e);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let hosts = Hosts::new(1, "nx", 212);
    let agent_cfg = dir.path().join("agent.toml");
    std::fs::write(
        &agent_cfg,
        format!(
            r#"
[agent]
listen = "{ip}:0"
nixl = true
# UCX is held to TCP below, which checks no keys: acceptable between the test's hosts.
nixl_tcp = true
[[agent.keys]]
id = "rw"
role = "read-write"
secret_env = "GPUIO_TEST_RW"
[[agent.keys]]
id = "ro"
role = "read-only"
secret_env = "GPUIO_TEST_RO"
[[agent.exports]]
name = "mem"
access = "read-write"
memory = "{LEN}"
"#,
            ip = hosts.agent_ip(1)
        ),
    )
    .unwrap();
    // Where NIXL is, for the processes (the test's environment names it in CI).
    let nixl_env: Vec<(String, String)> = ["GPUIO_NIXL_LIB", "UCX_MODULES"]
        .iter()
        .filter_map(|k| Some((k.to_string(), std::env::var(k).ok()?)))
        .collect();
    // Each side's UCX uses the one interface between them: with all of them, a client could
    // pick one that another test's hosts are taking down (UCX: "Destination is unreachable").
    let client_link = hosts.host_link(1);
    let mut agent = hosts
        .command(1, &bin())
        .args(["--config", agent_cfg.to_str().unwrap(), "agent"])
        .env("GPUIO_TEST_RW", RW)
        .env("GPUIO_TEST_RO", RO)
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", hosts.agent_link(1))
        .envs(nixl_env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("gpuio agent starts");
    let mut out = std::io::BufReader::new(agent.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    let addr = first.trim().rsplit(' ').next().unwrap().to_string();
    assert!(addr.contains(':'), "the agent said {first:?}");

    let client = |key: &str, secret: &str, from: &str, to: &str| {
        let cfg = dir.path().join(format!("{key}.toml"));
        let secret_file = dir.path().join(format!("{key}.secret"));
        write_private(&secret_file, secret);
        std::fs::write(
            &cfg,
            format!(
                "[remote]\nkey_id = \"{key}\"\nsecret_file = \"{}\"\n",
                secret_file.display()
            ),
        )
        .unwrap();
        Command::new(bin())
            .args(["--config", cfg.to_str().unwrap(), "cp", from, to])
            .env("UCX_TLS", "tcp")
            .env("UCX_NET_DEVICES", &client_link)
            .env("GPUIO_LOG", "gpuio_transport_remoteio=debug")
            .envs(nixl_env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap()
    };
    let remote = format!("remoteio://{addr}/mem?transport=nixl");
    // The pattern `nixl_peer.py` checks, below.
    let mut data: Vec<u8> = (0..LEN).map(|i| ((i * 13 + 5) % 253) as u8).collect();
    let src = dir.path().join("src.bin");
    std::fs::write(&src, &data).unwrap();
    let sent = client("rw", RW, src.to_str().unwrap(), &remote);
    assert!(
        sent.status.success(),
        "{}",
        String::from_utf8_lossy(&sent.stderr)
    );
    let back = dir.path().join("back.bin");
    let got = client("rw", RW, &remote, back.to_str().unwrap());
    assert!(
        got.status.success(),
        "{}",
        String::from_utf8_lossy(&got.stderr)
    );
    assert!(
        std::fs::read(&back).unwrap() == data,
        "the bytes read back differ"
    );
    // A read-only key is not offered NIXL: its copy goes over TCP.
    let ro_back = dir.path().join("ro.bin");
    let ro = client("ro", RO, &remote, ro_back.to_str().unwrap());
    assert!(
        ro.status.success(),
        "{}",
        String::from_utf8_lossy(&ro.stderr)
    );
    assert!(std::fs::read(&ro_back).unwrap() == data);
    assert!(
        String::from_utf8_lossy(&ro.stderr).contains("not offered over NIXL"),
        "{}",
        String::from_utf8_lossy(&ro.stderr)
    );

    // `gpuio nixl-export` hands a program using NIXL's own Python API the export: it reads it
    // whole and writes 4096 bytes at 8192, with no gpuio code.
    if let Some(py) = std::env::var_os("GPUIO_NIXL_PYTHONPATH") {
        let md = dir.path().join("md.json");
        let cfg = dir.path().join("rw.toml");
        let mut holder = Command::new(bin())
            .args(["--config", cfg.to_str().unwrap(), "nixl-export"])
            .arg(format!("remoteio://{addr}/mem"))
            .args(["--out", md.to_str().unwrap()])
            .env("UCX_TLS", "tcp")
            .env("UCX_NET_DEVICES", &client_link)
            .envs(nixl_env.iter().map(|(k, v)| (k, v)))
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::fs::metadata(&md).map_or(true, |m| m.len() == 0) {
            assert!(std::time::Instant::now() < deadline, "no metadata written");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let mode =
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&md).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o600, "the metadata is a credential");
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../gpuio-nixl/tests/it/nixl_peer.py"
        );
        let mut program = Command::new("python3")
            .arg(script)
            .env("PYTHONPATH", py)
            .env("UCX_TLS", "tcp")
            .env("UCX_NET_DEVICES", &client_link)
            .envs(nixl_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut to = program.stdin.take().unwrap();
        let mut said = std::io::BufReader::new(program.stdout.take().unwrap())
            .lines()
            .map(|l| l.unwrap())
            .filter(|l| !l.contains(" NIXL "));
        assert!(said.next().unwrap().starts_with('{'));
        std::io::Write::write_all(&mut to, &std::fs::read(&md).unwrap()).unwrap();
        assert_eq!(
            said.next().as_deref(),
            Some("ok"),
            "the NIXL program failed"
        );
        drop(to);
        assert!(program.wait().unwrap().success());
        for (i, b) in data[8192..8192 + 4096].iter_mut().enumerate() {
            *b = ((i * 3 + 1) % 256) as u8;
        }
        let after = dir.path().join("after.bin");
        let got = client("rw", RW, &remote, after.to_str().unwrap());
        assert!(
            got.status.success(),
            "{}",
            String::from_utf8_lossy(&got.stderr)
        );
        assert!(
            std::fs::read(&after).unwrap() == data,
            "the program's write is not there"
        );
        let _ = holder.kill();
        let _ = holder.wait();
        // A read-only key is refused the metadata: NIXL could not hold it to reading.
        let ro_cfg = dir.path().join("ro.toml");
        let refused = Command::new(bin())
            .args(["--config", ro_cfg.to_str().unwrap(), "nixl-export"])
            .arg(format!("remoteio://{addr}/mem"))
            .envs(nixl_env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        assert!(!refused.status.success());
        let why = String::from_utf8_lossy(&refused.stderr);
        assert!(why.contains("read over TCP"), "{why}");
    } else {
        Requirement::Nixl.missing("GPUIO_NIXL_PYTHONPATH (NIXL's Python package) is not set");
    }

    // Stopped, the agent says what its TCP data path moved: the read-only copy alone.
    assert!(
        Command::new("kill")
            .args(["-TERM", &agent.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let mut rest = String::new();
    for line in out.lines() {
        rest = line.unwrap();
    }
    agent.wait().unwrap();
    assert!(
        rest.contains(&format!("{LEN} bytes read, 0 written")),
        "the agent's last line: {rest:?} (isolated hosts: {})",
        hosts.isolated()
    );
}

/// `[agent] nixl_publish`: the agent puts the export's NIXL description in a real etcd (under a
/// lease), a NIXL agent with no gpuio session reads and writes the export with it alone, the
/// write shows through a gpuio session, an export not listed is not published, and the key is
/// gone once the agent has died and its lease run out. Needs etcd (`GPUIO_REQUIRE_ETCD`).
#[cfg(feature = "registry")]
#[test]
fn an_agent_publishes_only_the_exports_it_is_told_to() {
    use crate::multinode::{Proc, start_etcd};
    use gpuio_transport_remoteio::{
        Credentials, PeerConfig, Registry, RegistryConfig, RemoteExport, RemotePeer,
    };
    if let Err(e) = gpuio_nixl::library() {
        Requirement::Nixl.missing(e);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some((_etcd, port)) = start_etcd(dir.path(), &[]) else {
        return;
    };
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[agent]
listen = "127.0.0.1:0"
name = "pub"
lease_ttl_s = 2
nixl = true
# UCX's TCP transport (which checks no keys) may stay on: a test machine's own processes
# (CI holds UCX to loopback, UCX_NET_DEVICES=lo).
nixl_tcp = true
nixl_publish = ["mem"]
[[agent.keys]]
id = "rw"
role = "read-write"
secret_env = "GPUIO_TEST_RW"
[[agent.exports]]
name = "mem"
access = "read-write"
memory = "1MiB"
[[agent.exports]]
name = "other"
access = "read-write"
memory = "1MiB"
[remote]
registry = ["http://127.0.0.1:{port}"]
"#
        ),
    )
    .unwrap();
    let (child, addr, out) = crate::common::spawn_agent(&cfg, &[("GPUIO_TEST_RW", RW)]);
    let mut out = out.lines();
    let agent = Proc(child);
    let said: Vec<String> = out.by_ref().take(2).map(|l| l.unwrap()).collect();
    assert!(
        said[1].starts_with("published the NIXL metadata of mem at /gpuio/nixl/pub/mem"),
        "{said:?}"
    );

    let registry = Registry::connect(RegistryConfig::new(vec![format!(
        "http://127.0.0.1:{port}"
    )]))
    .unwrap();
    assert_eq!(registry.published_nixl("pub", "other").unwrap(), None);
    let json: serde_json::Value =
        serde_json::from_str(&registry.published_nixl("pub", "mem").unwrap().unwrap()).unwrap();
    assert_eq!(
        (json["len"].as_u64(), json["gpu"].is_null()),
        (Some(1 << 20), true)
    );
    let hex = json["metadata"].as_str().unwrap();
    let metadata: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let remote = gpuio_nixl::NixlRemote {
        addr: json["addr"].as_u64().unwrap(),
        len: 1 << 20,
        mem: gpuio_nixl::NixlMem::Host,
    };
    // NIXL alone, with what the registry holds: a write, then the whole export read back.
    let reader = gpuio_nixl::NixlAgent::new("published-reader").unwrap();
    let peer = reader.connect(&metadata).unwrap();
    let data: Vec<u8> = (0..300_000).map(|i| (i % 241) as u8 + 1).collect();
    reader.write_direct(&data, &peer, &remote, 4096).unwrap();
    let mut whole = vec![0xffu8; 1 << 20];
    reader.read_direct(&mut whole, &peer, &remote, 0).unwrap();
    assert!(whole[..4096].iter().all(|&b| b == 0) && whole[4096..4096 + data.len()] == data[..]);
    // The same bytes through a gpuio session.
    let creds = Credentials {
        key_id: "rw".into(),
        secret: RW.as_bytes().to_vec(),
    };
    let session = RemotePeer::connect(PeerConfig::new(addr, creds)).unwrap();
    let mut got = vec![0u8; data.len()];
    session
        .read(&RemoteExport::new("mem"), 4096, &mut got)
        .unwrap();
    assert!(got == data);

    // The agent dies without revoking: its lease runs out, and the credential is gone.
    drop(agent);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while registry.published_nixl("pub", "mem").unwrap().is_some() {
        assert!(std::time::Instant::now() < deadline, "still published");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}
