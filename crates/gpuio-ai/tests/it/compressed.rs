//! Compressed transfers from host and GPU memory to a file and to another node's memory export
//! (an agent in this process, over TCP), read back byte-exact; damaged frames refused.

use gpuio_ai::AiError;
use gpuio_ai::compress::{CHUNK, Codec, read_compressed, transfer_compressed};
use gpuio_api::{Access, Config, Endpoint, HostPlacement, OpenOptions, Resource, Session, Uri};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_remoteio::{
    Access as ExportAccess, Agent, AgentConfig, Export, ExportSource, Key, Role, shared_memory,
};

/// Made by `gpuio agent keygen` (agents refuse weak secrets).
const SECRET: &str = "5d0c1e8a9b7f6e2d4c3b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d";
const LEN: usize = 2 * CHUNK + 12_345;

/// KV-like bytes: small values with structure, which compress.
fn data() -> Vec<u8> {
    (0..LEN as u64)
        .map(|i| (pattern::mix64(i / 64) % 7) as u8 ^ (i % 3) as u8)
        .collect()
}

fn session_with_key(dir: &std::path::Path) -> Session {
    let key = dir.join("key");
    std::fs::write(&key, SECRET).unwrap();
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut config = Config::default();
    config.remote.key_id = "ops".into();
    config.remote.secret_file = key.display().to_string();
    Session::new(config).unwrap()
}

#[test]
fn frames_to_files_and_exports_come_back_exact() {
    let dir = tempfile::tempdir().unwrap();
    let session = session_with_key(dir.path());
    let bytes = data();
    let host = session
        .alloc_host(HostPlacement::Dram { numa: None }, LEN, false)
        .unwrap();
    host.write().copy_from_slice(&bytes);
    let gpu = session.alloc_device(0, LEN).unwrap();
    gpu.gpu().stream().unwrap().upload(&bytes, &gpu, 0).unwrap();
    // The destinations: a file, and an agent's memory export.
    let file = session
        .open_file(dir.path().join("frames"), OpenOptions::CREATE)
        .unwrap();
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![Key {
        id: "ops".into(),
        secret: SECRET.as_bytes().to_vec(),
        role: Role::ReadWrite,
    }];
    let export = HostBuffer::alloc(LEN + (1 << 20), &HostAllocOptions::default()).unwrap();
    cfg.exports = vec![Export {
        name: "cold".into(),
        source: ExportSource::Memory(shared_memory(export)),
        access: ExportAccess::ReadWrite,
    }];
    let agent = Agent::start(cfg).unwrap();
    let uri = Uri::parse(&format!("remoteio://{}/cold", agent.local_addr())).unwrap();
    let Resource::Remote(remote) = session.open(&uri, 0, Access::Update).unwrap() else {
        panic!("{uri} is not remote");
    };
    let remote = Endpoint::remote(&remote[0], 0);
    let targets = [Endpoint::file(&file, 0), remote];
    let sources = [Endpoint::host(&host, 0), Endpoint::device(&gpu, 0)];
    for (dst, codec) in targets.iter().zip([Codec::Lz4, Codec::Zstd { level: 3 }]) {
        for src in &sources {
            let w = transfer_compressed(&session, src, dst, LEN, codec).unwrap();
            assert_eq!((w.raw_bytes, w.frames), (LEN as u64, 3));
            assert!(w.ratio() > 2.0, "{codec:?} to {dst}: ratio {}", w.ratio());
            let back = session.alloc_device(0, LEN).unwrap();
            let r = read_compressed(&session, dst, &Endpoint::device(&back, 0), LEN).unwrap();
            assert_eq!(r, w);
            let mut got = vec![0u8; LEN];
            back.gpu()
                .stream()
                .unwrap()
                .download(&back, 0, &mut got)
                .unwrap();
            assert!(got == bytes, "{codec:?} {src} -> {dst} came back different");
        }
    }
    // Damage in the file: an error, never other bytes.
    let path = dir.path().join("frames");
    let mut on_disk = std::fs::read(&path).unwrap();
    on_disk[100] ^= 0xff;
    std::fs::write(&path, &on_disk).unwrap();
    let file = session.open_file(&path, OpenOptions::READ).unwrap();
    let sink = session
        .alloc_host(HostPlacement::Dram { numa: None }, LEN, false)
        .unwrap();
    let e = read_compressed(
        &session,
        &Endpoint::file(&file, 0),
        &Endpoint::host(&sink, 0),
        LEN,
    )
    .unwrap_err();
    assert!(matches!(e, AiError::Corrupt(_)), "{e}");
    // Asking for more than was written: the frames do not fit the request.
    let e = read_compressed(
        &session,
        &Endpoint::file(&file, 0),
        &Endpoint::host(&sink, 0),
        10,
    )
    .unwrap_err();
    assert!(matches!(e, AiError::Corrupt(_)), "{e}");
}
