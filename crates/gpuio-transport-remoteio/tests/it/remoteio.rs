//! The agent, connections and peers over real TCP on loopback: reads and writes of memory and
//! file exports checked byte for byte (pipelined, and striped over several connections), the
//! handshake refusing wrong and unknown keys and keys over their session limit, permissions
//! and bounds refused per request with the connection going on, broken and fuzzed messages
//! ending only their own connection, and shutdown with requests in flight.

use gpuio_hal::{ErrorCode, HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_remoteio::wire::{HEADER_LEN, Message};
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Connection, Credentials, Export, ExportInfo, ExportSource, Key,
    PeerConfig, RemoteExport, RemoteIoError, RemotePeer, Role, SharedMemory, shared_memory,
};
use proptest::prelude::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);
const RW_KEY: &[u8] = b"483f44b439143a50bd4b12c50314e5b77fc3d4234496b7a10b1f2423e63e64a2";
const RO_KEY: &[u8] = b"0549fee7c1cc3f3934466ba5e112a1bbe011213175ef1e98701f842843fbaaf6";

struct Setup {
    agent: Agent,
    _dir: tempfile::TempDir,
    mem: SharedMemory,
    file_path: std::path::PathBuf,
}

const MEM_LEN: usize = 40 << 20; // more than two messages' worth
const FILE_LEN: usize = 3 << 20;

fn setup() -> Setup {
    let mut buf = HostBuffer::alloc(MEM_LEN, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, 1);
    let mem = shared_memory(buf);
    let mut ro = HostBuffer::alloc(1 << 20, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut ro, 0, 2);
    let dir = tempfile::tempdir().unwrap();
    let file_path = dir.path().join("export.bin");
    let mut bytes = vec![0u8; FILE_LEN];
    pattern::fill(&mut bytes, 0, 3);
    std::fs::write(&file_path, &bytes).unwrap();
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![
        Key {
            id: "writer".into(),
            secret: RW_KEY.to_vec(),
            role: Role::ReadWrite,
        },
        Key {
            id: "reader".into(),
            secret: RO_KEY.to_vec(),
            role: Role::ReadOnly,
        },
    ];
    cfg.exports = vec![
        Export {
            name: "kv".into(),
            source: ExportSource::Memory(mem.clone()),
            access: Access::ReadWrite,
        },
        Export {
            name: "weights".into(),
            source: ExportSource::Memory(shared_memory(ro)),
            access: Access::ReadOnly,
        },
        Export {
            name: "ckpt".into(),
            source: ExportSource::File {
                path: file_path.clone(),
                max_len: Some(FILE_LEN as u64 + 4096),
            },
            access: Access::ReadWrite,
        },
    ];
    cfg.handshake_timeout = Duration::from_secs(2);
    Setup {
        agent: Agent::start(cfg).unwrap(),
        _dir: dir,
        mem,
        file_path,
    }
}

/// Messages of 1 MiB: a 33 MiB read is 33 pipelined requests.
const CHUNK: usize = 1 << 20;

fn creds(key: &str, secret: &[u8]) -> Credentials {
    Credentials {
        key_id: key.into(),
        secret: secret.to_vec(),
    }
}

fn connect(
    addr: std::net::SocketAddr,
    key: &str,
    secret: &[u8],
    t: Duration,
) -> Result<Connection, RemoteIoError> {
    Connection::connect(addr, &creds(key, secret), t)
}

/// A connection with the same calls as a peer (the chunk size fixed).
struct Client(Connection);

impl Client {
    fn read(&mut self, export: &str, offset: u64, buf: &mut [u8]) -> Result<(), RemoteIoError> {
        self.0.read(export, offset, buf, CHUNK)
    }

    fn write(&mut self, export: &str, offset: u64, data: &[u8]) -> Result<(), RemoteIoError> {
        self.0.write(export, offset, data, CHUNK)
    }
}

fn client(s: &Setup, key: &str, secret: &[u8]) -> Client {
    Client(connect(s.agent.local_addr(), key, secret, T).unwrap())
}

fn remote_code(r: Result<impl std::fmt::Debug, RemoteIoError>) -> ErrorCode {
    match r {
        Err(RemoteIoError::Remote { code, .. }) => code,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn reads_and_writes_arrive_intact() {
    let s = setup();
    let mut c = client(&s, "writer", RW_KEY);
    // A read spanning several messages, at an odd offset.
    let mut got = vec![0u8; 33 << 20];
    c.read("kv", 12_345, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 12_345, 1), None);
    // A write, then the exporting program sees it and a read returns it.
    let data: Vec<u8> = (0..(17 << 20) + 3).map(|i| (i * 31 % 251) as u8).collect();
    c.write("kv", 777, &data).unwrap();
    assert!(s.mem.blocking_read()[777..777 + data.len()] == data[..]);
    let mut back = vec![0u8; data.len()];
    c.read("kv", 777, &mut back).unwrap();
    assert!(back == data);
    // A file export: read, write, extend up to its limit, read back from disk.
    let mut f = vec![0u8; 100_000];
    c.read("ckpt", 1000, &mut f).unwrap();
    assert_eq!(pattern::first_deviation(&f, 1000, 3), None);
    c.write("ckpt", FILE_LEN as u64 - 10, &[7u8; 100]).unwrap();
    let disk = std::fs::read(&s.file_path).unwrap();
    assert_eq!(disk.len(), FILE_LEN + 90);
    assert!(disk[FILE_LEN - 10..].iter().all(|&b| b == 7));
    let stats = s.agent.stats();
    assert_eq!(stats.sessions, 1);
    assert_eq!(stats.refused, 0);
}

#[test]
fn the_handshake_refuses_wrong_and_unknown_keys() {
    let s = setup();
    let addr = s.agent.local_addr();
    for (key, secret) in [
        ("writer", &b"not the writer's secret at all!!"[..]),
        ("nobody", RW_KEY),
    ] {
        match connect(addr, key, secret, T) {
            Err(e @ RemoteIoError::Auth(_)) => assert_eq!(e.code(), ErrorCode::Permission),
            other => panic!("{key}: {other:?}"),
        }
    }
    // The agent still serves a client with the right key.
    let mut c = client(&s, "reader", RO_KEY);
    let mut b = [0u8; 16];
    c.read("weights", 0, &mut b).unwrap();
    assert_eq!(s.agent.stats().refused_sessions, 2);
}

#[test]
fn permissions_and_bounds_are_refused_and_the_connection_goes_on() {
    let s = setup();
    let mut r = client(&s, "reader", RO_KEY);
    let mut w = client(&s, "writer", RW_KEY);
    // A read-only key may not write, even a read-write export.
    assert_eq!(
        remote_code(r.write("kv", 0, &[1, 2, 3])),
        ErrorCode::Permission
    );
    // Nobody may write a read-only export.
    assert_eq!(
        remote_code(w.write("weights", 0, &[1])),
        ErrorCode::Permission
    );
    // Unknown exports, ranges past the end, offsets that overflow.
    let mut b = vec![0u8; 64];
    assert_eq!(remote_code(w.read("nope", 0, &mut b)), ErrorCode::NotFound);
    assert_eq!(
        remote_code(w.read("kv", MEM_LEN as u64 - 63, &mut b)),
        ErrorCode::InvalidArg
    );
    assert_eq!(
        remote_code(w.read("kv", u64::MAX - 10, &mut b)),
        ErrorCode::InvalidArg
    );
    assert_eq!(
        remote_code(w.write("ckpt", FILE_LEN as u64 + 4096, &[1])),
        ErrorCode::InvalidArg
    );
    // Nothing was written, and both connections still work.
    let mut pristine = vec![0u8; 16];
    w.read("kv", 0, &mut pristine).unwrap();
    assert_eq!(pattern::first_deviation(&pristine, 0, 1), None);
    r.read("weights", 100, &mut pristine).unwrap();
    assert_eq!(pattern::first_deviation(&pristine, 100, 2), None);
    assert_eq!(
        std::fs::metadata(&s.file_path).unwrap().len(),
        FILE_LEN as u64
    );
    assert_eq!(s.agent.stats().refused, 6);
}

#[test]
fn a_broken_message_ends_its_connection_only() {
    let s = setup();
    let mut good = client(&s, "writer", RW_KEY);
    let mut bad = client(&s, "writer", RW_KEY);
    // A header with a bad magic.
    let mut m = Message::WriteResp { written: 1 }.encode(9);
    m[0] ^= 0xff;
    bad.0.send_raw(&m).unwrap();
    let mut b = [0u8; 8];
    assert!(bad.read("kv", 0, &mut b).is_err());
    // A response type sent as a request, and a truncated message, on fresh connections.
    let mut odd = client(&s, "writer", RW_KEY);
    odd.0
        .send_raw(&Message::WriteResp { written: 1 }.encode(3))
        .unwrap();
    assert!(odd.read("kv", 0, &mut b).is_err());
    let mut cut = client(&s, "writer", RW_KEY);
    let req = Message::ReadReq {
        export: "kv".into(),
        offset: 0,
        len: 8,
    }
    .encode(4);
    cut.0.send_raw(&req[..HEADER_LEN + 3]).unwrap();
    drop(cut);
    // The first connection is untouched.
    good.read("kv", 8, &mut b).unwrap();
    assert_eq!(pattern::first_deviation(&b, 8, 1), None);
    assert!(s.agent.stats().protocol_errors >= 2);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// Arbitrary bytes, before or after the handshake, and valid messages with bytes flipped:
    /// the agent answers or closes, never crashes, and keeps serving a well-behaved client.
    #[test]
    fn fuzzed_messages_never_stop_the_agent(
        junk in proptest::collection::vec(any::<u8>(), 0..200),
        flip_at in 0usize..60,
        flip in 1u8..=255,
        after_handshake in any::<bool>(),
    ) {
        let s = fuzz_agent();
        let addr = s.local_addr();
        if after_handshake {
            // A short timeout: a flipped length can leave the agent waiting for more bytes.
            let mut c = Client(connect(addr, "writer", RW_KEY, Duration::from_millis(500)).unwrap());
            let mut msg = Message::ReadReq { export: "kv".into(), offset: 0, len: 16 }.encode(1);
            let i = flip_at % msg.len();
            msg[i] ^= flip;
            msg.extend_from_slice(&junk);
            c.0.send_raw(&msg).unwrap();
            let mut b = [0u8; 4];
            // Either the flip was harmless and this works, or the connection was refused.
            let _ = c.read("kv", 0, &mut b);
        } else {
            use std::io::Write;
            let mut raw = std::net::TcpStream::connect(addr).unwrap();
            let _ = raw.write_all(&junk);
        }
        let mut c = Client(connect(addr, "writer", RW_KEY, T).unwrap());
        let mut b = [0u8; 32];
        c.read("kv", 64, &mut b).unwrap();
        prop_assert_eq!(pattern::first_deviation(&b, 64, 1), None);
    }
}

/// A small agent of its own per fuzz case (so one case's connections cannot affect the next).
fn fuzz_agent() -> Agent {
    let mut cfg = small_agent("kv", small_export(), Access::ReadOnly);
    cfg.handshake_timeout = Duration::from_millis(300);
    Agent::start(cfg).unwrap()
}

/// 4 KiB of host memory holding the pattern of seed 1.
fn small_export() -> ExportSource {
    let mut buf = HostBuffer::alloc(4096, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, 1);
    ExportSource::Memory(shared_memory(buf))
}

/// An agent configuration with the read-write key only and one export.
fn small_agent(name: &str, source: ExportSource, access: Access) -> AgentConfig {
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![Key {
        id: "writer".into(),
        secret: RW_KEY.to_vec(),
        role: Role::ReadWrite,
    }];
    cfg.exports = vec![Export {
        name: name.into(),
        source,
        access,
    }];
    cfg
}

#[test]
fn shutdown_finishes_requests_in_flight() {
    let s = setup();
    let addr = s.agent.local_addr();
    let reader = std::thread::spawn(move || {
        let mut c = Client(connect(addr, "writer", RW_KEY, T).unwrap());
        let mut ok = 0u32;
        let mut buf = vec![0u8; 8 << 20];
        loop {
            match c.read("kv", 0, &mut buf) {
                Ok(()) => {
                    // Every completed read is whole and correct.
                    assert_eq!(pattern::first_deviation(&buf, 0, 1), None);
                    ok += 1;
                }
                Err(e) => return (ok, e.code()),
            }
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let stats = s.agent.shutdown();
    let (ok, code) = reader.join().unwrap();
    assert!(ok > 0, "no read completed before shutdown");
    assert!(
        matches!(code, ErrorCode::Network | ErrorCode::Timeout),
        "{code:?}"
    );
    assert!(stats.served >= u64::from(ok));
    // Nothing listens any more.
    assert!(connect(addr, "writer", RW_KEY, Duration::from_millis(500)).is_err());
}

#[test]
fn a_peer_stripes_large_transfers_over_several_connections() {
    let s = setup();
    let mut cfg = PeerConfig::new(s.agent.local_addr(), creds("writer", RW_KEY));
    cfg.connections = 4;
    cfg.stripe_bytes = 256 << 10;
    let peer = RemotePeer::connect(cfg).unwrap();
    let kv = RemoteExport::new("kv");
    assert_eq!(
        peer.stat(&kv).unwrap(),
        ExportInfo {
            size: MEM_LEN as u64,
            capacity: MEM_LEN as u64,
            writable: true,
            durable: false,
            instance: s.agent.instance(),
        }
    );
    let mut got = vec![0u8; (9 << 20) + 17];
    peer.read(&kv, 3, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 3, 1), None);
    let data: Vec<u8> = (0..(5 << 20) + 1).map(|i| (i * 7 % 253) as u8).collect();
    peer.write(&kv, 1 << 20, &data).unwrap();
    assert!(s.mem.blocking_read()[1 << 20..(1 << 20) + data.len()] == data[..]);
    // Four connections did it, and went back to the pool.
    assert_eq!(peer.stats().connects, 4);
    assert_eq!(s.agent.stats().sessions, 4);
    // A striped read that runs past the end is refused as a whole; the pool is still usable.
    let mut tail = vec![0u8; 2 << 20];
    match peer.read(&kv, MEM_LEN as u64 - (1 << 20), &mut tail) {
        Err(RemoteIoError::Remote { code, .. }) => assert_eq!(code, ErrorCode::InvalidArg),
        other => panic!("{other:?}"),
    }
    // A write that would run past the end is refused before a byte is sent.
    let written = s.agent.stats().bytes_written;
    match peer.write(&kv, MEM_LEN as u64 - (1 << 20), &tail) {
        Err(e @ RemoteIoError::InvalidArgument(_)) => assert_eq!(e.code(), ErrorCode::InvalidArg),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.agent.stats().bytes_written, written);
    peer.read(&kv, 7 << 20, &mut tail).unwrap();
    assert_eq!(pattern::first_deviation(&tail, 7 << 20, 1), None);
    assert_eq!(peer.stats().broken, 0);
    // A peer of a read-only key sees the export as not writable.
    let ro = RemotePeer::connect(PeerConfig::new(
        s.agent.local_addr(),
        creds("reader", RO_KEY),
    ))
    .unwrap();
    assert!(!ro.stat(&RemoteExport::new("kv")).unwrap().writable);
    let ckpt = ro.stat(&RemoteExport::new("ckpt")).unwrap();
    assert_eq!(
        (ckpt.size, ckpt.capacity),
        (FILE_LEN as u64, FILE_LEN as u64 + 4096)
    );
}

#[test]
fn a_pipelined_refusal_leaves_the_connection_in_step() {
    let s = setup();
    let mut c = client(&s, "writer", RW_KEY);
    // Eight pieces in flight, the last ones past the end of the export.
    let mut big = vec![0u8; 8 << 20];
    assert!(matches!(
        c.read("kv", MEM_LEN as u64 - (6 << 20), &mut big),
        Err(RemoteIoError::Remote { .. })
    ));
    // Writes to a read-only export: every piece's data is skipped by the agent.
    assert!(matches!(
        c.write("weights", 0, &big[..3 << 20]),
        Err(RemoteIoError::Remote {
            code: ErrorCode::Permission,
            ..
        })
    ));
    let mut b = vec![0u8; 100];
    c.read("kv", 5, &mut b).unwrap();
    assert_eq!(pattern::first_deviation(&b, 5, 1), None);
    assert!(!c.0.is_broken());
}

#[test]
fn a_key_over_its_session_limit_is_refused_busy() {
    let mut cfg = small_agent("kv", small_export(), Access::ReadOnly);
    cfg.max_sessions_per_key = 2;
    let agent = Agent::start(cfg).unwrap();
    let addr = agent.local_addr();
    let a = connect(addr, "writer", RW_KEY, T).unwrap();
    let _b = connect(addr, "writer", RW_KEY, T).unwrap();
    match connect(addr, "writer", RW_KEY, T) {
        Err(e) => assert_eq!(e.code(), ErrorCode::Busy, "{e}"),
        Ok(_) => panic!("a third session was accepted"),
    }
    // A session that ends frees its slot.
    drop(a);
    let deadline = std::time::Instant::now() + T;
    while connect(addr, "writer", RW_KEY, T).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the slot was never freed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn gpu_memory_exports_are_served_through_the_copy_engines() {
    let probe = gpuio_hal::probe(gpuio_hal::BackendPreference::Auto).unwrap();
    let gpu = &probe.gpus[0];
    let dev = gpu.alloc(3 << 20).unwrap();
    let mut init = vec![0u8; 3 << 20];
    pattern::fill(&mut init, 0, 8);
    gpu.stream().unwrap().upload(&init, &dev, 0).unwrap();
    let cfg = small_agent("hbm", ExportSource::Device(dev.clone()), Access::ReadWrite);
    let agent = Agent::start(cfg).unwrap();
    let mut c = Client(connect(agent.local_addr(), "writer", RW_KEY, T).unwrap());
    assert_eq!(c.0.stat("hbm").unwrap().size, 3 << 20);
    let mut got = vec![0u8; (2 << 20) + 1];
    c.read("hbm", 99, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 99, 8), None);
    let data = vec![0x5au8; 100_000];
    c.write("hbm", 1 << 20, &data).unwrap();
    let mut back = vec![0u8; 100_000];
    gpu.stream()
        .unwrap()
        .download(&dev, 1 << 20, &mut back)
        .unwrap();
    assert!(back == data);
    // Past the end: refused, the connection goes on.
    assert_eq!(
        remote_code(c.read("hbm", (3 << 20) - 10, &mut back[..20])),
        ErrorCode::InvalidArg
    );
    c.read("hbm", 0, &mut back[..16]).unwrap();
}

#[test]
fn a_fake_agent_trickling_its_handshake_cannot_hold_a_client_past_its_timeout() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else {
            return;
        };
        // A challenge, one byte every 100 ms: each read is quick, the whole never ends.
        let challenge = Message::Challenge { nonce: [1; 32] }.encode(0);
        for b in challenge.iter().cycle().take(600) {
            std::thread::sleep(Duration::from_millis(100));
            if std::io::Write::write_all(&mut s, &[*b]).is_err() {
                return;
            }
        }
    });
    let started = std::time::Instant::now();
    let r = connect(addr, "writer", RW_KEY, Duration::from_secs(1));
    let took = started.elapsed();
    match r {
        Err(e) => assert_eq!(e.code(), ErrorCode::Timeout, "{e}"),
        Ok(_) => panic!("a fake agent completed the handshake"),
    }
    assert!(took < Duration::from_secs(3), "the handshake took {took:?}");
}
