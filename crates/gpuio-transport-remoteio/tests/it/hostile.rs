//! The agent against clients that misbehave on purpose, over real TCP on loopback: strangers
//! who want something to test key guesses against or to tell key ids apart, weak secrets,
//! clients that stop reading or writing half-way through a message (the export must stay
//! available to everyone else), and connections that send part of a header and wait.

use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_remoteio::wire::{HEADER_LEN, Header, Message, NONCE_LEN};
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Connection, Credentials, Export, ExportSource, Key, Role,
    SharedMemory, auth, shared_memory,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const KEY: &[u8] = b"5d1c7e0a93b24f68c1e97a3d05b8f2c4e6a9d1370b5c8e2f4a6d9c1b3e7f0a25";
const MEM: usize = 64 << 20;

fn agent(tune: impl FnOnce(&mut AgentConfig)) -> (Agent, SharedMemory) {
    let mut buf = HostBuffer::alloc(MEM, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, 4);
    let mem = shared_memory(buf);
    let cfg = config(mem.clone(), tune);
    (Agent::start(cfg).unwrap(), mem)
}

/// One key, "ops", and `mem` as export "kv"; then `tune`.
fn config(mem: SharedMemory, tune: impl FnOnce(&mut AgentConfig)) -> AgentConfig {
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![Key {
        id: "ops".into(),
        secret: KEY.to_vec(),
        role: Role::ReadWrite,
    }];
    cfg.exports = vec![Export {
        name: "kv".into(),
        source: ExportSource::Memory(mem),
        access: Access::ReadWrite,
    }];
    tune(&mut cfg);
    cfg
}

fn connect(addr: SocketAddr) -> Connection {
    let creds = Credentials {
        key_id: "ops".into(),
        secret: KEY.to_vec(),
    };
    Connection::connect(addr, &creds, Duration::from_secs(5)).unwrap()
}

/// Reads one whole message from a raw socket.
fn recv(s: &mut TcpStream) -> std::io::Result<(Header, Message)> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h)?;
    let header = Header::decode(&h).map_err(std::io::Error::other)?;
    let mut p = vec![0u8; header.payload_len as usize];
    s.read_exact(&mut p)?;
    let msg = Message::decode(&header, &p).map_err(std::io::Error::other)?;
    Ok((header, msg))
}

/// Says HELLO as `key_id`, then answers the challenge with a proof made from `secret`; the
/// challenge and the final answer.
fn try_key(addr: SocketAddr, key_id: &str, secret: &[u8]) -> (Message, Message) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let cn = [7u8; NONCE_LEN];
    let hello = Message::Hello {
        key_id: key_id.into(),
        nonce: cn,
    };
    s.write_all(&hello.encode(0)).unwrap();
    let (_, challenge) = recv(&mut s).unwrap();
    let Message::Challenge { nonce: sn } = challenge.clone() else {
        panic!("{key_id}: {challenge:?}");
    };
    let proof = auth::client_proof(secret, &cn, &sn).unwrap();
    s.write_all(&Message::Proof { proof }.encode(0)).unwrap();
    let (_, answer) = recv(&mut s).unwrap();
    (challenge, answer)
}

#[test]
fn strangers_get_nothing_to_guess_against_and_cannot_tell_key_ids_apart() {
    let (agent, _mem) = agent(|_| {});
    let addr = agent.local_addr();
    // A known id and an unknown one get the same bare challenge (a nonce, no proof) and, for
    // a wrong proof, the same refusal.
    let (known, known_answer) = try_key(addr, "ops", b"a guess that is wrong");
    let (unknown, unknown_answer) = try_key(addr, "nobody", b"a guess that is wrong");
    assert_eq!(known.encode(0).len(), unknown.encode(0).len());
    let refusal = |m: &Message| match m {
        Message::Error { code, message } => (*code, message.clone()),
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert_eq!(refusal(&known_answer), refusal(&unknown_answer));
    assert!(!refusal(&known_answer).1.contains("authentication failed"));
    // The right key: the agent proves itself only now, and says which instance it is.
    let (_, welcome) = try_key(addr, "ops", KEY);
    match welcome {
        Message::Welcome { instance, .. } => assert_eq!(instance, agent.instance()),
        other => panic!("{other:?}"),
    }
    // The client sees one prefix, not two.
    let wrong = Credentials {
        key_id: "ops".into(),
        secret: b"not the secret".to_vec(),
    };
    let e = Connection::connect(addr, &wrong, Duration::from_secs(5)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "authentication failed: wrong key or unknown key id"
    );
    assert_eq!(agent.stats().refused_sessions, 3);
}

#[test]
fn weak_secrets_and_settings_that_would_hang_are_refused() {
    for weak in [&b"sixteen byte key"[..], &[b'x'; 64][..]] {
        let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.keys = vec![Key {
            id: "ops".into(),
            secret: weak.to_vec(),
            role: Role::ReadOnly,
        }];
        let e = Agent::start(cfg).unwrap_err();
        assert!(e.to_string().contains("gpuio agent keygen"), "{e}");
    }
    let zero: [fn(&mut AgentConfig); 4] = [
        |c| c.handshake_timeout = Duration::ZERO,
        |c| c.max_connections = 0,
        |c| c.idle_timeout = Duration::ZERO,
        |c| c.buffer_memory = 1 << 20,
    ];
    for tune in zero {
        let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
        tune(&mut cfg);
        assert!(Agent::start(cfg).is_err());
    }
}

#[test]
fn a_client_that_stops_reading_or_writing_freezes_nobody() {
    let (agent, mem) = agent(|c| c.io_timeout = Duration::from_secs(20));
    let addr = agent.local_addr();
    // A reader that asks for 16 MiB and never reads the answer.
    let mut c = connect(addr);
    let req = Message::ReadReq {
        export: "kv".into(),
        offset: 0,
        len: 16 << 20,
    };
    c.send_raw(&req.encode(1)).unwrap();
    // A writer that declares 16 MiB and sends half.
    let mut w = connect(addr);
    let mut head = gpuio_transport_remoteio::wire::write_req_head(1, "kv", 0, 16 << 20);
    head.extend_from_slice(&vec![0xab; 8 << 20]);
    w.send_raw(&head).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // Everyone else: reads and writes of the same export finish at once...
    let t = Instant::now();
    let mut other = connect(addr);
    let mut b = vec![0u8; 1 << 20];
    other.read("kv", 32 << 20, &mut b, 1 << 20).unwrap();
    assert_eq!(pattern::first_deviation(&b, 32 << 20, 4), None);
    other.write("kv", 40 << 20, &[9u8; 4096], 1 << 20).unwrap();
    // ... and so does the exporting program.
    mem.blocking_write()[48 << 20] = 1;
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // The half-sent write changed nothing.
    assert_eq!(
        pattern::first_deviation(&mem.blocking_read()[..8 << 20], 0, 4),
        None
    );
    drop((c, w));
}

#[test]
fn part_of_a_header_or_silence_does_not_hold_a_connection() {
    let (agent, _mem) = agent(|c| {
        c.io_timeout = Duration::from_millis(400);
        c.idle_timeout = Duration::from_millis(600);
    });
    let addr = agent.local_addr();
    // 27 of a header's 28 bytes, then nothing.
    let mut c = connect(addr);
    let req = Message::StatReq {
        export: "kv".into(),
    }
    .encode(1);
    c.send_raw(&req[..HEADER_LEN - 1]).unwrap();
    std::thread::sleep(Duration::from_millis(700));
    assert!(!c.is_alive(), "a partial header held its connection");
    // Silence after the handshake: closed after the idle timeout, and a pooled client sees
    // that before reusing it.
    let idle = connect(addr);
    assert!(idle.is_alive());
    std::thread::sleep(Duration::from_millis(900));
    assert!(!idle.is_alive(), "an idle connection was kept");
    // The agent still serves.
    let mut fresh = connect(addr);
    let mut b = [0u8; 16];
    fresh.read("kv", 0, &mut b, 16).unwrap();
    assert_eq!(pattern::first_deviation(&b, 0, 4), None);
}

#[test]
fn a_read_only_file_export_that_is_a_fifo_is_refused_at_start_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let started = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let path = fifo.clone();
    let mem = shared_memory(HostBuffer::alloc(4096, &HostAllocOptions::default()).unwrap());
    let cfg = config(mem, |c| {
        c.exports.push(Export {
            name: "f".into(),
            source: ExportSource::File {
                path,
                max_len: None,
            },
            access: Access::ReadOnly,
        })
    });
    std::thread::spawn(move || {
        let _ = tx.send(Agent::start(cfg).map(|_| ()).map_err(|e| e.to_string()));
    });
    let r = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the agent blocked opening a FIFO");
    let e = r.unwrap_err();
    assert!(e.contains("not a regular file"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
}
