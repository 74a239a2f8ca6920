//! RemoteIO over NIXL (UCX on loopback): an agent offering a memory export over NIXL, clients
//! reaching it through the authenticated TCP control channel. Bytes checked both ways, none of
//! them through the agent's TCP data path; a read-only key and a file export are not offered
//! NIXL and go over TCP, where the agent enforces what they may do; a restarted agent is
//! `Restarted`; a write past the export is refused before any byte moves; shared host memory
//! moves striped, both ways, over NIXL and over TCP; a program using
//! NIXL's own Python API reaches an export with the metadata a session was given; a GPU memory
//! export moves GPU to GPU where CUDA is. Without NIXL the tests say so and pass, unless
//! `GPUIO_REQUIRE_NIXL=1`.
#![cfg(feature = "nixl")]

use gpuio_hal::{ErrorCode, HostAllocOptions, HostBuffer, SharedHostBuffer, pattern};
use gpuio_testkit::Requirement;
use gpuio_transport_remoteio::nixl::NixlChannel;
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Connection, Credentials, Export, ExportSource, Key, PeerConfig,
    RemoteExport, RemoteIoError, RemotePeer, Role, shared_memory,
};
use std::sync::Arc;
use std::time::Duration;

const RW: &[u8] = b"0c1f5e6a9b8d7c3e2f4a6b8c0d1e3f5a7b9c1d3e5f7a9b1c3d5e7f9a1b3c5d7e";
const RO: &[u8] = b"9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d";
const LEN: usize = 16 << 20;
const T: Duration = Duration::from_secs(10);

fn nixl_here() -> bool {
    match gpuio_nixl::library() {
        Ok(_) => true,
        Err(e) => {
            Requirement::Nixl.missing(e);
            false
        }
    }
}

fn creds(id: &str, secret: &[u8]) -> Credentials {
    Credentials {
        key_id: id.into(),
        secret: secret.to_vec(),
    }
}

/// An agent on loopback offering `mem` (16 MiB of the pattern of seed 5) over NIXL, with a
/// read-write and a read-only key.
fn agent() -> (Agent, gpuio_transport_remoteio::SharedMemory) {
    let mut buf = HostBuffer::alloc(LEN, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, 5);
    let mem = shared_memory(buf);
    let mut cfg = config_of("mem", ExportSource::Memory(mem.clone()));
    cfg.keys.push(Key {
        id: "ro".into(),
        secret: RO.to_vec(),
        role: Role::ReadOnly,
    });
    (Agent::start(cfg).unwrap(), mem)
}

/// The agent's count of bytes its TCP data path served, once it reaches `want` (it counts a
/// read after its last byte is sent, so the client can be done first) or a second passed.
fn tcp_bytes_read(agent: &Agent, want: u64) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    loop {
        let n = agent.stats().bytes_read;
        if n >= want || std::time::Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An agent on loopback offering the read-write `name` export of `source` over NIXL, with
/// the read-write key.
fn config_of(name: &str, source: ExportSource) -> AgentConfig {
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![Key {
        id: "rw".into(),
        secret: RW.to_vec(),
        role: Role::ReadWrite,
    }];
    cfg.exports = vec![Export {
        name: name.into(),
        source,
        access: Access::ReadWrite,
    }];
    cfg.nixl = true;
    // Loopback: UCX's TCP transport, which checks no keys, is acceptable here.
    cfg.nixl_tcp = true;
    cfg
}

fn agent_of(name: &str, source: ExportSource) -> Agent {
    Agent::start(config_of(name, source)).unwrap()
}

fn peer(agent: &Agent, id: &str, secret: &[u8]) -> RemotePeer {
    let mut cfg = PeerConfig::new(agent.local_addr(), creds(id, secret));
    cfg.nixl = true;
    cfg.stripe_bytes = 1 << 20;
    RemotePeer::connect(cfg).unwrap()
}

#[test]
fn an_agent_will_not_serve_nixl_over_a_transport_that_checks_no_keys_unless_told() {
    if !nixl_here() {
        return;
    }
    if !gpuio_nixl::ucx_tcp_enabled() {
        eprintln!("skipped: UCX_TLS leaves TCP out here");
        return;
    }
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.nixl = true;
    match Agent::start(cfg) {
        Err(RemoteIoError::InvalidArgument(why)) => {
            assert!(why.contains("UCX_TLS") && why.contains("nixl_tcp"), "{why}")
        }
        other => panic!("{:?}", other.map(|a| a.local_addr())),
    }
}

#[test]
fn a_writer_moves_every_byte_over_nixl_and_none_over_tcp() {
    if !nixl_here() {
        return;
    }
    let (agent, mem) = agent();
    let p = peer(&agent, "rw", RW);
    let ex = RemoteExport::new("mem");
    let mut got = vec![0u8; (5 << 20) + 3];
    p.read(&ex, 777, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 777, 5), None);
    let data: Vec<u8> = (0..(3 << 20) + 1).map(|i| (i * 11 % 251) as u8).collect();
    p.write(&ex, 4 << 20, &data).unwrap();
    assert!(mem.blocking_read()[4 << 20..(4 << 20) + data.len()] == data[..]);
    p.read(&ex, 4 << 20, &mut got[..data.len()]).unwrap();
    assert!(got[..data.len()] == data[..]);
    // The agent's TCP data path moved nothing: NIXL did.
    let stats = agent.stats();
    assert_eq!((stats.bytes_read, stats.bytes_written), (0, 0), "{stats:?}");
    // A range past the export is refused before anything moves; the peer stays usable.
    let e = p.write(&ex, LEN as u64 - 10, &[1u8; 11]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
    assert!(mem.blocking_read()[LEN - 10..] != [1u8; 10][..]);
    let mut tail = [0u8; 10];
    p.read(&ex, LEN as u64 - 10, &mut tail).unwrap();
    assert_eq!(pattern::first_deviation(&tail, LEN as u64 - 10, 5), None);
}

#[test]
fn shared_memory_moves_in_place_over_nixl_and_tcp() {
    if !nixl_here() {
        return;
    }
    let (agent, mem) = agent();
    let ex = RemoteExport::new("mem");
    let over_tcp = {
        let mut cfg = PeerConfig::new(agent.local_addr(), creds("rw", RW));
        cfg.stripe_bytes = 1 << 20;
        RemotePeer::connect(cfg).unwrap()
    };
    let buf = HostBuffer::alloc(8 << 20, &HostAllocOptions::default()).unwrap();
    let mine = Arc::new(SharedHostBuffer::new(buf));
    let len = (5 << 20) + 3;
    for p in [&peer(&agent, "rw", RW), &over_tcp] {
        // Striped over four channels, twice (the second time registered already).
        for off in [777u64, 1 << 20] {
            p.read_memory(&ex, off, &mine, 4099, len).unwrap();
            let got = mine.read()[4099..4099 + len].to_vec();
            assert_eq!(pattern::first_deviation(&got, off, 5), None);
        }
        // And back, to another place of the export.
        p.write_memory(&ex, 9 << 20, &mine, 4099, len).unwrap();
        let theirs = mem.blocking_read()[9 << 20..(9 << 20) + len].to_vec();
        assert_eq!(pattern::first_deviation(&theirs, 1 << 20, 5), None);
        // Refused before anything moves: past the export, past the buffer.
        let e = p
            .write_memory(&ex, LEN as u64 - 10, &mine, 0, 11)
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
        let e = p
            .read_memory(&ex, 0, &mine, (8 << 20) - 10, 11)
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
        // Cleared, so that the next peer's write shows.
        mem.blocking_write()[9 << 20..(9 << 20) + len].fill(0);
    }
    // The agent's TCP data path moved only the TCP peer's bytes.
    let stats = agent.stats();
    assert_eq!(
        tcp_bytes_read(&agent, 2 * len as u64),
        2 * len as u64,
        "{stats:?}"
    );
    assert_eq!(stats.bytes_written, len as u64, "{stats:?}");
}

#[test]
fn a_read_only_key_is_not_offered_nixl_and_tcp_holds_it_to_reading() {
    if !nixl_here() {
        return;
    }
    let (agent, mem) = agent();
    // Asked directly, the agent refuses: NIXL could not stop this key from writing.
    let c = Connection::connect(agent.local_addr(), &creds("ro", RO), T).unwrap();
    match NixlChannel::open(c, "mem", 1 << 20) {
        Err(RemoteIoError::Remote { code, message }) => {
            assert_eq!(code, ErrorCode::Unsupported);
            assert!(message.contains("read over TCP"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Through a peer, reads go over TCP and writes are refused.
    let p = peer(&agent, "ro", RO);
    let ex = RemoteExport::new("mem");
    let mut got = vec![0u8; 1 << 20];
    p.read(&ex, 0, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 0, 5), None);
    assert_eq!(tcp_bytes_read(&agent, 1 << 20), 1 << 20);
    let e = p.write(&ex, 0, &[0u8; 16]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Permission, "{e}");
    assert_eq!(
        pattern::first_deviation(&mem.blocking_read()[..16], 0, 5),
        None
    );
}

#[test]
fn a_restarted_agent_is_restarted_not_a_stale_nixl_link() {
    if !nixl_here() {
        return;
    }
    let (agent, _) = agent();
    let addr = agent.local_addr();
    let p = peer(&agent, "rw", RW);
    let ex = RemoteExport::new("mem");
    let mut got = vec![0u8; 1 << 20];
    p.read(&ex, 0, &mut got).unwrap();
    agent.shutdown();
    // A new agent on the same port: a new instance, a new NIXL agent behind it.
    let mut cfg = AgentConfig::new(addr);
    cfg.keys = vec![Key {
        id: "rw".into(),
        secret: RW.to_vec(),
        role: Role::ReadWrite,
    }];
    let buf = HostBuffer::alloc(LEN, &HostAllocOptions::default()).unwrap();
    cfg.exports = vec![Export {
        name: "mem".into(),
        source: ExportSource::Memory(shared_memory(buf)),
        access: Access::ReadWrite,
    }];
    cfg.nixl = true;
    cfg.nixl_tcp = true;
    let _again = Agent::start(cfg).unwrap();
    match p.read(&ex, 0, &mut got) {
        Err(RemoteIoError::Restarted { .. }) => {}
        other => panic!("{other:?}"),
    }
}

/// A program using NIXL's own Python API (no gpuio code) reads and writes a gpuio export, with
/// the metadata an authenticated session was given (`nixl_peer.py`, gpuio-nixl's peer script):
/// what a client hands a NIXL program so that it reaches the export directly.
#[test]
fn a_nixl_program_reaches_an_export_with_metadata_from_a_session() {
    if !nixl_here() {
        return;
    }
    let Some(path) = std::env::var_os("GPUIO_NIXL_PYTHONPATH") else {
        Requirement::Nixl.missing("GPUIO_NIXL_PYTHONPATH (NIXL's Python package) is not set");
        return;
    };
    use std::io::{BufRead, BufReader, Write};
    let (agent, mem) = agent();
    // The script checks the bytes it reads against its own pattern.
    for (i, b) in mem.blocking_write().as_mut_slice().iter_mut().enumerate() {
        *b = ((i * 13 + 5) % 253) as u8;
    }
    let mut c = Connection::connect(agent.local_addr(), &creds("rw", RW), T).unwrap();
    let offer = c.nixl_exchange("mem").unwrap();
    assert_eq!(offer.gpu, None, "a host memory export");
    let (metadata, addr) = (offer.metadata, offer.addr);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../gpuio-nixl/tests/it/nixl_peer.py"
    );
    let mut child = std::process::Command::new("python3")
        .arg(script)
        .env("PYTHONPATH", path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut to = child.stdin.take().unwrap();
    let mut from = BufReader::new(child.stdout.take().unwrap());
    let said = |from: &mut BufReader<_>| {
        let mut line = String::new();
        loop {
            line.clear();
            if from.read_line(&mut line).unwrap() == 0 || !line.contains(" NIXL ") {
                return line;
            }
        }
    };
    assert!(said(&mut from).starts_with('{'));
    let hex: String = metadata.iter().map(|b| format!("{b:02x}")).collect();
    writeln!(
        to,
        "{{\"metadata\": \"{hex}\", \"addr\": {addr}, \"len\": {LEN}}}"
    )
    .unwrap();
    assert_eq!(said(&mut from).trim(), "ok", "the NIXL program failed");
    let got = mem.blocking_read();
    for (i, &b) in got.as_slice()[8192..8192 + 4096].iter().enumerate() {
        assert_eq!(
            b,
            ((i * 3 + 1) % 256) as u8,
            "byte {i} of the NIXL program's write"
        );
    }
    assert_eq!(got.as_slice()[8191], ((8191 * 13 + 5) % 253) as u8);
    drop(got);
    drop(to);
    assert!(child.wait().unwrap().success());
    // The agent's TCP data path moved none of it.
    assert_eq!(agent.stats().bytes_read, 0);
    drop(c);
}

/// A GPU memory export over NIXL. On CUDA the agent registers it as GPU memory, and a client
/// moves it GPU to GPU (from the first GPU into the last: `cuda_ipc` over NVLink where there
/// are two); on the host backend, whose stand-in devices are host memory, it is host memory to
/// NIXL and device transfers are left to staging (`None`). Host reads go over NIXL either way;
/// every byte is checked, and none moves through the agent's TCP data path.
#[test]
fn a_gpu_export_moves_over_nixl() {
    if !nixl_here() {
        return;
    }
    let probe = gpuio_hal::probe(gpuio_hal::BackendPreference::Auto).unwrap();
    let (from, to) = (&probe.gpus[0], probe.gpus.last().unwrap());
    let cuda = from.backend() == gpuio_hal::Backend::Cuda;
    let len = 8 << 20;
    let hbm = from.alloc(len).unwrap();
    let mut init = vec![0u8; len];
    pattern::fill(&mut init, 0, 9);
    from.stream().unwrap().upload(&init, &hbm, 0).unwrap();
    let agent = agent_of("hbm", ExportSource::Device(hbm.clone()));
    let p = peer(&agent, "rw", RW);
    let ex = RemoteExport::new("hbm");
    let mut got = vec![0u8; len - 5];
    p.read(&ex, 5, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 5, 9), None);

    let dst = to.alloc(len).unwrap();
    let stream = to.stream().unwrap();
    match p.read_device(&ex, 1000, &dst, 24..len - 976) {
        None => assert!(!cuda, "on CUDA a GPU export moves GPU to GPU"),
        Some(r) => {
            assert!(cuda, "host-backend memory is not moved as GPU memory");
            r.unwrap();
            let mut back = vec![0u8; len - 1000];
            stream.download(&dst, 24, &mut back).unwrap();
            assert_eq!(pattern::first_deviation(&back, 1000, 9), None);
            // And back the other way: 3 MiB of a new pattern into the export.
            let data: Vec<u8> = (0..3 << 20).map(|i| (i * 7 % 241) as u8).collect();
            stream.upload(&data, &dst, 0).unwrap();
            p.write_device(&ex, 4096, &dst, 0..data.len())
                .expect("NIXL serves it")
                .unwrap();
            let mut now = vec![0u8; data.len()];
            from.stream()
                .unwrap()
                .download(&hbm, 4096, &mut now)
                .unwrap();
            assert!(now == data);
            // Past the export's end: refused before anything moves.
            let e = p
                .write_device(&ex, len as u64 - 10, &dst, 0..11)
                .expect("NIXL serves it")
                .unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
            // A slice of a larger allocation is not offered: cuda_ipc would map all of it.
            let slice = from
                .borrow_device(hbm.device_addr() + 4096, 4096, hbm.clone())
                .unwrap();
            let sliced = agent_of("slice", ExportSource::Device(slice));
            let c = Connection::connect(sliced.local_addr(), &creds("rw", RW), T).unwrap();
            match NixlChannel::open(c, "slice", 1 << 20) {
                Err(RemoteIoError::Remote { code, message }) => {
                    assert_eq!(code, ErrorCode::Unsupported);
                    assert!(message.contains("borrowed"), "{message}");
                }
                other => panic!("{other:?}"),
            }
        }
    }
    let stats = agent.stats();
    assert_eq!((stats.bytes_read, stats.bytes_written), (0, 0), "{stats:?}");
}

/// `nixl_publish` takes read-write memory exports of an agent that serves NIXL, and nothing
/// else; a published export's description reaches it with NIXL alone.
#[test]
fn only_read_write_memory_exports_are_published() {
    if !nixl_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, [1u8; 4096]).unwrap();
    let start = |publish: &str, nixl: bool| {
        let buf = HostBuffer::alloc(1 << 20, &HostAllocOptions::default()).unwrap();
        let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
        let export = |name: &str, source, access| Export {
            name: name.into(),
            source,
            access,
        };
        cfg.exports = vec![
            export(
                "rw",
                ExportSource::Memory(shared_memory(buf)),
                Access::ReadWrite,
            ),
            export(
                "ro",
                ExportSource::Memory(shared_memory(
                    HostBuffer::alloc(4096, &Default::default()).unwrap(),
                )),
                Access::ReadOnly,
            ),
            export(
                "file",
                ExportSource::File {
                    path: file.clone(),
                    max_len: None,
                },
                Access::ReadWrite,
            ),
        ];
        (cfg.nixl, cfg.nixl_tcp) = (nixl, true);
        cfg.nixl_publish = vec![publish.to_string()];
        Agent::start(cfg)
    };
    for (name, nixl, why) in [
        ("ro", true, "read-only"),
        ("file", true, "is a file"),
        ("none", true, "does not exist"),
        ("rw", false, "needs nixl = true"),
    ] {
        match start(name, nixl) {
            Err(RemoteIoError::InvalidArgument(m)) => assert!(m.contains(why), "{name}: {m}"),
            other => panic!("{name}: {:?}", other.map(|a| a.local_addr())),
        }
    }
    let agent = start("rw", true).unwrap();
    let published = agent.nixl_published();
    assert_eq!(published.len(), 1);
    let (name, json) = &published[0];
    assert_eq!(name, "rw");
    let field = |k: &str| {
        let at = json.find(&format!("\"{k}\": ")).unwrap() + k.len() + 4;
        json[at..]
            .split([',', '}'])
            .next()
            .unwrap()
            .trim_matches('"')
            .to_string()
    };
    assert_eq!(
        (field("len"), field("gpu")),
        ("1048576".into(), "null".into())
    );
    let hex = field("metadata");
    let metadata: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let reader = gpuio_nixl::NixlAgent::new("it-published").unwrap();
    let peer = reader.connect(&metadata).unwrap();
    let remote = gpuio_nixl::NixlRemote {
        addr: field("addr").parse().unwrap(),
        len: 1 << 20,
        mem: gpuio_nixl::NixlMem::Host,
    };
    reader
        .write_direct(&[7u8; 1000], &peer, &remote, 5)
        .unwrap();
    let mut back = vec![0u8; 1010];
    reader.read_direct(&mut back, &peer, &remote, 0).unwrap();
    assert!(back[..5] == [0; 5] && back[5..1005] == [7; 1000] && back[1005..] == [0; 5]);
}
