//! TLS between peers and an agent on loopback: data arrives intact through the encrypted
//! channel (the key is still checked inside it); plain clients, clients trusting another CA
//! and clients expecting another name are refused, and the agent goes on serving.

use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Connection, Credentials, Export, ExportSource, Key, PeerConfig,
    RemoteExport, RemotePeer, Role, TlsClient, TlsServer, shared_memory,
};
use std::time::Duration;

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
