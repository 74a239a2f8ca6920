//! The agent shared fairly and its file exports kept whole, over real TCP on loopback: a slow
//! TLS client (200 ms round trips, through a delaying relay) gets through a keyless flood from
//! 5,000 source addresses; a key holding every session place with keep-alives gives one up to
//! a key that asks; a copy a small tmpfs cannot hold is refused before it writes a byte; SYNC
//! makes a file export durable and is refused for memory.

use gpuio_hal::{ErrorCode, HostAllocOptions, HostBuffer, pattern};
use gpuio_testkit::Tmpfs;
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Connection, Credentials, Export, ExportSource, Key, PeerConfig,
    RemoteExport, RemoteIoError, RemotePeer, Role, TlsClient, TlsServer, shared_memory,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

const A: &[u8] = b"9d41b7c2e08f35a6d1c4e7f2a9b05c38e6d1f4a7c2b9e05d8a3f6c1e4b7d2a90";
const B: &[u8] = b"27e5c9a1f4d8b03e6a2c5f9d1b4e7a08c3f6d9b2e5a8c1f4d7b0e3a6c9f2d5b8";

fn key(id: &str, secret: &[u8]) -> Key {
    Key {
        id: id.into(),
        secret: secret.to_vec(),
        role: Role::ReadWrite,
    }
}

fn creds(id: &str, secret: &[u8]) -> Credentials {
    Credentials {
        key_id: id.into(),
        secret: secret.to_vec(),
    }
}

fn memory(len: usize, seed: u64) -> ExportSource {
    let mut buf = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, seed);
    ExportSource::Memory(shared_memory(buf))
}

fn export(name: &str, source: ExportSource) -> Export {
    Export {
        name: name.into(),
        source,
        access: Access::ReadWrite,
    }
}

/// Relays connections from its own port to `to`, each byte delivered `delay` after it
/// arrived, both ways: a client behind it sees a round trip of twice `delay`.
fn delaying_relay(to: SocketAddr, delay: Duration, stop: Arc<AtomicBool>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let Ok((client, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            };
            client.set_nonblocking(false).unwrap();
            let Ok(agent) = TcpStream::connect(to) else {
                continue;
            };
            for (from, into) in [
                (client.try_clone().unwrap(), agent.try_clone().unwrap()),
                (agent, client),
            ] {
                let _ = from.set_nodelay(true);
                let _ = into.set_nodelay(true);
                delayed_pipe(from, into, delay);
            }
        }
    });
    addr
}

/// Copies `from` into `into`, each piece `delay` after it was read.
fn delayed_pipe(mut from: TcpStream, mut into: TcpStream, delay: Duration) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0
                || tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        for (due, bytes) in rx {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            if into.write_all(&bytes).is_err() {
                break;
            }
        }
        let _ = into.shutdown(std::net::Shutdown::Write);
    });
}

/// Connects from 5,000 addresses of 127.1.0.0/16 (20 of its /24s; all of 127/8 is this host)
/// at `rate` a second, saying nothing, each kept open until its address comes round again,
/// until `stop`. (A fixed rate, so that what is measured is the agent's choice of whom to
/// evict, not which side of one loaded machine gets the processor.)
fn keyless_flood(to: SocketAddr, rate: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut open = std::collections::VecDeque::new();
            let mut opened = 0u64;
            let mut i = 0u32;
            let start = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let n = i % 5000;
                let source = [127, 1, (n / 250) as u8, (n % 250) as u8 + 1];
                i += 1;
                let Ok(s) = tokio::net::TcpSocket::new_v4() else {
                    continue;
                };
                if s.bind(SocketAddr::from((source, 0))).is_err() {
                    continue;
                }
                if let Ok(c) = s.connect(to).await {
                    opened += 1;
                    open.push_back(c);
                    if open.len() > 5000 {
                        open.pop_front();
                    }
                }
                let due = start + Duration::from_secs_f64(f64::from(i) / f64::from(rate));
                tokio::time::sleep_until(due.into()).await;
            }
            opened
        })
    })
}

#[test]
fn a_slow_tls_client_gets_through_a_flood_from_five_thousand_sources() {
    gpuio_hal::raise_fd_limit().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![key("a", A)];
    cfg.exports = vec![export("mem", memory(8 << 20, 11))];
    cfg.tls = Some(
        TlsServer::from_pem(
            cert.cert.pem().as_bytes(),
            cert.signing_key.serialize_pem().as_bytes(),
        )
        .unwrap(),
    );
    let agent = Agent::start(cfg).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let relay = delaying_relay(agent.local_addr(), Duration::from_millis(100), stop.clone());
    // Each pending handshake lives about 512 / 2,000 s under it: a client that needs three
    // round trips of 200 ms loses its place unless the agent keeps it.
    let flood = keyless_flood(agent.local_addr(), 2000, stop.clone());
    // Until the gate is full and evicting.
    let pressed = Instant::now() + Duration::from_secs(30);
    while agent.stats().evicted_handshakes < 1000 {
        assert!(Instant::now() < pressed, "the flood never filled the gate");
        std::thread::sleep(Duration::from_millis(20));
    }
    let copies = 20usize;
    let done = AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (done, failures, cert) = (&done, &failures, &cert);
            s.spawn(move || {
                for i in 0..(copies / 4) as u64 {
                    let mut pc = PeerConfig::new(relay, creds("a", A));
                    pc.tls = Some(TlsClient::from_ca_pem(cert.cert.pem().as_bytes()).unwrap());
                    pc.server_name = Some("127.0.0.1".into());
                    pc.timeout = Duration::from_secs(3);
                    pc.connect_attempts = 1;
                    let at = (t * 5 + i) << 18;
                    let mut got = vec![0u8; 1 << 18];
                    match RemotePeer::new(pc).read(&RemoteExport::new("mem"), at, &mut got) {
                        Ok(()) => {
                            assert_eq!(pattern::first_deviation(&got, at, 11), None);
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => failures.lock().unwrap().push(e.to_string()),
                    }
                }
            });
        }
    });
    stop.store(true, Ordering::Relaxed);
    let opened = flood.join().unwrap();
    let stats = agent.stats();
    let done = done.into_inner();
    eprintln!(
        "{done} of {copies} copies through 200 ms round trips; the flood opened {opened} \
         connections, {} evicted, {} refused",
        stats.evicted_handshakes, stats.refused_sessions
    );
    assert!(
        done * 100 >= copies * 95,
        "{done} of {copies} copies: {:?}",
        failures.into_inner().unwrap()
    );
}

#[test]
fn a_key_holding_every_place_with_keep_alives_gives_one_to_a_key_that_asks() {
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![key("a", A), key("b", B)];
    cfg.exports = vec![export("mem", memory(1 << 20, 12))];
    cfg.max_connections = 4;
    cfg.max_sessions_per_key = 4;
    let agent = Agent::start(cfg).unwrap();
    let addr = agent.local_addr();
    let t = Duration::from_secs(5);
    let stop = Arc::new(AtomicBool::new(false));
    // "a" takes every place, and keeps each alive with a STAT every 20 ms.
    let keepers: Vec<_> = (0..4)
        .map(|_| {
            let mut c = Connection::connect(addr, &creds("a", A), t).unwrap();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut stats = 0u32;
                while !stop.load(Ordering::Relaxed) && c.stat("mem").is_ok() {
                    stats += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                stats
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    let mut b = Connection::connect(addr, &creds("b", B), t).unwrap();
    let waited = started.elapsed();
    let mut got = vec![0u8; 4096];
    b.read("mem", 0, &mut got, 4096).unwrap();
    assert_eq!(pattern::first_deviation(&got, 0, 12), None);
    // A second place for "b" (its share is two of four), then no more.
    let _b2 = Connection::connect(addr, &creds("b", B), t).unwrap();
    match Connection::connect(addr, &creds("b", B), Duration::from_secs(3)) {
        Err(e) => assert_eq!(e.code(), ErrorCode::Busy, "{e}"),
        Ok(_) => panic!("a key past its share took a place"),
    }
    // "a", at its share now, is refused too.
    match Connection::connect(addr, &creds("a", A), Duration::from_secs(3)) {
        Err(e) => assert_eq!(e.code(), ErrorCode::Busy, "{e}"),
        Ok(_) => panic!("a key at its share took a place"),
    }
    stop.store(true, Ordering::Relaxed);
    let alive: Vec<u32> = keepers.into_iter().map(|k| k.join().unwrap()).collect();
    assert_eq!(agent.stats().preempted_sessions, 2, "{alive:?}");
    assert!(waited < Duration::from_secs(1), "{waited:?}");
}

/// An agent serving `path` as file export "disk" (writes up to `max_len`) and memory "mem".
fn file_agent(path: &std::path::Path, max_len: u64) -> Agent {
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![key("a", A)];
    cfg.exports = vec![
        export(
            "disk",
            ExportSource::File {
                path: path.into(),
                max_len: Some(max_len),
            },
        ),
        export("mem", memory(1 << 20, 13)),
    ];
    Agent::start(cfg).unwrap()
}

#[test]
fn a_copy_a_full_disk_cannot_hold_is_refused_before_it_writes() {
    let Some(fs) = Tmpfs::mount("4m") else {
        return;
    };
    let path = fs.path().join("export.bin");
    let mut old = vec![0u8; 1 << 20];
    pattern::fill(&mut old, 0, 14);
    std::fs::write(&path, &old).unwrap();
    // It may grow to 64 MiB, which the 4 MiB file system cannot hold.
    let agent = file_agent(&path, 64 << 20);
    let peer = RemotePeer::new(PeerConfig::new(agent.local_addr(), creds("a", A)));
    let disk = RemoteExport::new("disk");
    assert_eq!(peer.stat(&disk).unwrap().capacity, 64 << 20);
    let refused = peer.reserve(&disk, 16 << 20).unwrap_err();
    assert!(
        refused.to_string().contains("nothing was written"),
        "{refused}"
    );
    // A write message past what the disk holds is refused whole: none of it lands.
    let new = vec![0x5au8; 8 << 20];
    let mut c =
        Connection::connect(agent.local_addr(), &creds("a", A), Duration::from_secs(5)).unwrap();
    match c.write("disk", 0, &new, new.len()) {
        Err(RemoteIoError::Remote { message, .. }) => {
            assert!(message.contains("the disk cannot hold it"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(
        std::fs::read(&path).unwrap() == old,
        "the export was overwritten"
    );
    // What fits is reserved and written.
    peer.reserve(&disk, 2 << 20).unwrap();
    peer.write(&disk, 0, &new[..2 << 20]).unwrap();
    assert!(std::fs::read(&path).unwrap() == new[..2 << 20]);
}

#[test]
fn sync_makes_file_exports_durable_and_is_refused_for_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("export.bin");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    let agent = file_agent(&path, 1 << 20);
    let peer = RemotePeer::new(PeerConfig::new(agent.local_addr(), creds("a", A)));
    let (disk, mem) = (RemoteExport::new("disk"), RemoteExport::new("mem"));
    assert!(peer.stat(&disk).unwrap().durable);
    assert!(!peer.stat(&mem).unwrap().durable);
    peer.write(&disk, 4096, &[7u8; 4096]).unwrap();
    peer.sync(&disk).unwrap();
    match peer.sync(&mem) {
        Err(RemoteIoError::Remote { code, message }) => {
            assert_eq!(code, ErrorCode::Unsupported);
            assert!(message.contains("cannot be made durable"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Refusals leave the connection usable.
    assert_eq!(peer.stats().broken, 0);
}

#[test]
fn a_key_busy_with_the_whole_buffer_budget_makes_room_for_another() {
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![key("a", A), key("b", B)];
    cfg.exports = vec![export("mem", memory(32 << 20, 15))];
    cfg.buffer_memory = 16 << 20;
    cfg.io_timeout = Duration::from_secs(3);
    let agent = Agent::start(cfg).unwrap();
    let addr = agent.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    // "a" writes 16 MiB messages back to back: alone, it may hold the whole budget.
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut c = Connection::connect(addr, &creds("a", A), Duration::from_secs(5)).unwrap();
            let data = vec![1u8; 16 << 20];
            let mut writes = 0;
            while !stop.load(Ordering::Relaxed) {
                c.write("mem", 0, &data, data.len()).unwrap();
                writes += 1;
            }
            writes
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let mut b = Connection::connect(addr, &creds("b", B), Duration::from_secs(5)).unwrap();
    b.write("mem", 16 << 20, &[2u8; 4096], 4096).unwrap();
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let writes = busy.join().unwrap();
    assert!(writes > 1, "{writes}");
    assert!(
        took < Duration::from_secs(1),
        "another key's write waited {took:?}"
    );
}
