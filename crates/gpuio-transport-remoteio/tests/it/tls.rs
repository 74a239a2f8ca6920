//! TLS between peers and an agent on loopback: data arrives intact through the encrypted
//! channel (the key is still checked inside it); plain clients, clients trusting another CA
//! and clients expecting another name are refused, and the agent goes on serving. Certificate,
//! key and CA files: special files (`/dev/zero`, a FIFO) are refused at once rather than read
//! without end or waited on forever, oversized files are refused, and a private key must be
//! private to its owner (mode 0600), as secret files are.

use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Connection, Credentials, Export, ExportSource, Key, PeerConfig,
    RemoteExport, RemotePeer, Role, TlsClient, TlsServer, shared_memory,
};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const KEY: &[u8] = b"3b298dfa760c30c461cef70377a6b4446a18accaf6110de835119470785a4a9e";

fn creds() -> Credentials {
    Credentials {
        key_id: "k".into(),
        secret: KEY.to_vec(),
    }
}

/// A self-signed certificate for these names: (certificate PEM, private key PEM).
fn certificate(names: &[&str]) -> (String, String) {
    let c =
        rcgen::generate_simple_self_signed(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    (c.cert.pem(), c.signing_key.serialize_pem())
}

fn agent(cert: &str, key: &str) -> (Agent, gpuio_transport_remoteio::SharedMemory) {
    let mut buf = HostBuffer::alloc(8 << 20, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, 5);
    let mem = shared_memory(buf);
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![Key {
        id: "k".into(),
        secret: KEY.to_vec(),
        role: Role::ReadWrite,
    }];
    cfg.exports = vec![Export {
        name: "mem".into(),
        source: ExportSource::Memory(mem.clone()),
        access: Access::ReadWrite,
    }];
    cfg.tls = Some(TlsServer::from_pem(cert.as_bytes(), key.as_bytes()).unwrap());
    cfg.handshake_timeout = Duration::from_secs(2);
    (Agent::start(cfg).unwrap(), mem)
}

fn tls_peer(addr: std::net::SocketAddr, ca: &str, name: Option<&str>) -> PeerConfig {
    let mut cfg = PeerConfig::new(addr, creds());
    cfg.tls = Some(TlsClient::from_ca_pem(ca.as_bytes()).unwrap());
    cfg.server_name = name.map(String::from);
    cfg.timeout = Duration::from_secs(3);
    cfg.connect_attempts = 1;
    cfg
}

#[test]
fn data_crosses_tls_intact() {
    let (cert, key) = certificate(&["127.0.0.1"]);
    let (agent, mem) = agent(&cert, &key);
    let peer = RemotePeer::connect(tls_peer(agent.local_addr(), &cert, None)).unwrap();
    let mem_export = RemoteExport::new("mem");
    let mut got = vec![0u8; (5 << 20) + 3];
    peer.read(&mem_export, 11, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 11, 5), None);
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 249) as u8).collect();
    peer.write(&mem_export, 100, &data).unwrap();
    assert!(mem.blocking_read()[100..100 + data.len()] == data[..]);
    assert_eq!(agent.stats().refused_sessions, 0);
}

#[test]
fn untrusting_or_plain_clients_are_refused() {
    let (cert, key) = certificate(&["127.0.0.1", "agent.example"]);
    let (agent, _mem) = agent(&cert, &key);
    let addr = agent.local_addr();
    // Plain TCP to a TLS agent.
    assert!(Connection::connect(addr, &creds(), Duration::from_secs(3)).is_err());
    // A client trusting another CA.
    let (other, _) = certificate(&["127.0.0.1"]);
    assert!(RemotePeer::connect(tls_peer(addr, &other, None)).is_err());
    // A client expecting another name.
    assert!(RemotePeer::connect(tls_peer(addr, &cert, Some("elsewhere.example"))).is_err());
    // The name the certificate does carry works, and the agent still serves.
    let peer = RemotePeer::connect(tls_peer(addr, &cert, Some("agent.example"))).unwrap();
    let mut b = [0u8; 64];
    peer.read(&RemoteExport::new("mem"), 0, &mut b).unwrap();
    assert_eq!(pattern::first_deviation(&b, 0, 5), None);
    assert!(agent.stats().refused_sessions >= 2);
}

/// A self-signed certificate's and key's PEM files in `dir`, the key of mode 0600.
fn pem_files(dir: &Path) -> (PathBuf, PathBuf) {
    let c = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, c.cert.pem()).unwrap();
    std::fs::write(&key, c.signing_key.serialize_pem()).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    (cert, key)
}

fn fifo(dir: &Path) -> PathBuf {
    let path = dir.join("fifo");
    let status = std::process::Command::new("mkfifo")
        .arg(&path)
        .status()
        .unwrap();
    assert!(status.success());
    path
}

/// Runs `load` on another thread and returns its error, failing (not hanging) if it takes
/// more than a few seconds or succeeds.
fn refused<T: Send + 'static>(
    what: &str,
    load: impl FnOnce() -> gpuio_transport_remoteio::Result<T> + Send + 'static,
) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(load().err().map(|e| e.to_string()));
    });
    let e = rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("{what}: still loading after 5 s"))
        .unwrap_or_else(|| panic!("{what}: accepted"));
    assert!(start.elapsed() < Duration::from_secs(2), "{what}: slow");
    e
}

#[test]
fn special_files_as_certificate_key_or_ca_are_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = pem_files(dir.path());
    let fifo = fifo(dir.path());
    for (special, kind) in [
        (PathBuf::from("/dev/zero"), "a character device"),
        (fifo, "a FIFO"),
    ] {
        let (c, k, s) = (cert.clone(), key.clone(), special.clone());
        let e = refused("certificate", move || TlsServer::from_pem_files(&s, &k));
        assert!(
            e.contains(kind) && e.contains("must be regular files"),
            "{e}"
        );
        assert!(e.contains(&special.display().to_string()), "{e}");
        let s = special.clone();
        let e = refused("key", move || TlsServer::from_pem_files(&c, &s));
        assert!(e.contains(kind) && e.contains("TLS private keys"), "{e}");
        let s = special.clone();
        let e = refused("CA", move || TlsClient::from_ca_pem_file(&s));
        assert!(e.contains(kind) && e.contains("TLS CA files"), "{e}");
    }
}

#[test]
fn oversized_certificate_files_are_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let (_, key) = pem_files(dir.path());
    // Sparse: its size is what is refused, without reading or writing gigabytes.
    let big = dir.path().join("big.pem");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(3 << 30)
        .unwrap();
    let b = big.clone();
    let e = refused("certificate", move || TlsServer::from_pem_files(&b, &key));
    assert!(e.contains("at most"), "{e}");
    let e = refused("CA", move || TlsClient::from_ca_pem_file(&big));
    assert!(e.contains("at most"), "{e}");
}

#[test]
fn private_keys_readable_by_others_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = pem_files(dir.path());
    TlsServer::from_pem_files(&cert, &key).unwrap();
    TlsClient::from_ca_pem_file(&cert).unwrap();
    for mode in [0o644, 0o640, 0o602] {
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = TlsServer::from_pem_files(&cert, &key)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("chmod 600") && e.contains("private key"),
            "{mode:o}: {e}"
        );
    }
    // A certificate is public: 0644 is fine.
    std::fs::set_permissions(&cert, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    TlsServer::from_pem_files(&cert, &key).unwrap();
}
