//! Many clients at once: 64 clients, each with a region of one memory export to itself, write
//! fresh bytes, read them back and compare, in mixed sizes, over loopback for
//! `GPUIO_LOAD_SECONDS` (5 by default; 60 for the long run), over plain TCP and then TLS. No request may fail, no byte may
//! differ, and the process's memory must stay flat once the agent's buffers are warm.
//!
//! A test binary of its own, not a module of `tests/it`: it samples this process's resident
//! memory (`/proc/self/status`), which other tests running beside it in one process (their
//! buffers, agents and threads) would move, and so make the check flaky or hide a leak.

use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Credentials, Export, ExportSource, Key, PeerConfig, RemoteExport,
    RemotePeer, Role, TlsClient, TlsServer, shared_memory,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const KEY: &[u8] = b"c0ffee5e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4";
const CLIENTS: usize = 64;
const REGION: usize = 4 << 20;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn sixty_four_clients_read_and_write_without_an_error_or_a_wrong_byte() {
    // One after the other in one test: both sample this process's memory.
    load(None);
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    load(Some((cert.cert.pem(), cert.signing_key.serialize_pem())));
}

/// Runs the load, over TLS with this certificate and key where given.
fn load(tls: Option<(String, String)>) {
    let seconds: u64 = std::env::var("GPUIO_LOAD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    // Every page touched before the clients start (the export, their buffers), so that what
    // the process's memory does afterwards is the agent's doing.
    let mut buf = HostBuffer::alloc(CLIENTS * REGION, &HostAllocOptions::default()).unwrap();
    buf.fill(1);
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![Key {
        id: "load".into(),
        secret: KEY.to_vec(),
        role: Role::ReadWrite,
    }];
    cfg.exports = vec![Export {
        name: "kv".into(),
        source: ExportSource::Memory(shared_memory(buf)),
        access: Access::ReadWrite,
    }];
    cfg.max_sessions_per_key = CLIENTS * 2;
    if let Some((cert, key)) = &tls {
        cfg.tls = Some(TlsServer::from_pem(cert.as_bytes(), key.as_bytes()).unwrap());
    }
    let agent = Agent::start(cfg).unwrap();
    let trust = tls
        .as_ref()
        .map(|(cert, _)| TlsClient::from_ca_pem(cert.as_bytes()).unwrap());
    let addr = agent.local_addr();
    let ops = AtomicU64::new(0);
    let samples = std::sync::Mutex::new(Vec::new());
    let end = Instant::now() + Duration::from_secs(seconds);
    std::thread::scope(|scope| {
        for c in 0..CLIENTS {
            let (ops, trust) = (&ops, &trust);
            scope.spawn(move || {
                let mut pc = PeerConfig::new(
                    addr,
                    Credentials {
                        key_id: "load".into(),
                        secret: KEY.to_vec(),
                    },
                );
                pc.connections = 1;
                pc.tls = trust.clone();
                let peer = RemotePeer::new(pc);
                let kv = RemoteExport::new("kv");
                let base = (c * REGION) as u64;
                let mut data = vec![1u8; REGION];
                let mut back = vec![1u8; REGION];
                let mut round = 0u64;
                while Instant::now() < end {
                    // Sizes from 64 B to the whole region, at offsets inside it.
                    let len = 64usize << (round % 17).min(16);
                    let len = len.min(REGION);
                    let at = base + ((round * 4096) % (REGION - len + 1) as u64 / 64 * 64);
                    let seed = (c as u64) << 32 | round;
                    pattern::fill(&mut data[..len], at, seed);
                    peer.write(&kv, at, &data[..len])
                        .unwrap_or_else(|e| panic!("client {c} round {round}: write: {e}"));
                    peer.read(&kv, at, &mut back[..len])
                        .unwrap_or_else(|e| panic!("client {c} round {round}: read: {e}"));
                    assert_eq!(
                        pattern::first_deviation(&back[..len], at, seed),
                        None,
                        "client {c} round {round}: {len} bytes at {at}"
                    );
                    ops.fetch_add(2, Ordering::Relaxed);
                    round += 1;
                }
            });
        }
        // The process's memory, sampled while the clients run (after a warm-up second).
        scope.spawn(|| {
            std::thread::sleep(Duration::from_secs(1).min(Duration::from_secs(seconds) / 2));
            while Instant::now() < end {
                samples.lock().unwrap().push(rss_kib());
                std::thread::sleep(Duration::from_millis(250));
            }
        });
    });
    let stats = agent.shutdown();
    let samples = samples.into_inner().unwrap();
    let (lo, hi) = (
        samples.iter().copied().min().unwrap_or(0),
        samples.iter().copied().max().unwrap_or(0),
    );
    eprintln!(
        "{}: {} requests in {seconds} s by {CLIENTS} clients; RSS {lo}..{hi} KiB over {} samples; {stats:?}",
        if tls.is_some() { "TLS" } else { "plain TCP" },
        ops.load(Ordering::Relaxed),
        samples.len()
    );
    assert_eq!(stats.refused, 0);
    assert_eq!(stats.protocol_errors, 0);
    assert_eq!(stats.sessions, CLIENTS as u64, "a client reconnected");
    // Flat: the agent's buffers are bounded (a message per busy session, given back when
    // idle), not growing with time.
    assert!(hi <= lo + (128 << 10), "RSS grew from {lo} to {hi} KiB");
}
