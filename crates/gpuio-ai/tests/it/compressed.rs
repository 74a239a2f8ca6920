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

/// A KV pool's cold tier on another node's memory export: evicted entries are written there
/// compressed, come back exact when selected, and a tier that is full says so.
#[test]
fn a_kv_cold_tier_on_a_remote_export() {
    use gpuio_ai::kv::{ColdTier, KvPool, KvPoolConfig, Tier};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let session = Arc::new(session_with_key(dir.path()));
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![Key {
        id: "ops".into(),
        secret: SECRET.as_bytes().to_vec(),
        role: Role::ReadWrite,
    }];
    let capacity = 64 << 10;
    let export = HostBuffer::alloc(capacity, &HostAllocOptions::default()).unwrap();
    cfg.exports = vec![Export {
        name: "kv-cold".into(),
        source: ExportSource::Memory(shared_memory(export)),
        access: ExportAccess::ReadWrite,
    }];
    let agent = Agent::start(cfg).unwrap();
    let uri = Uri::parse(&format!("remoteio://{}/kv-cold", agent.local_addr())).unwrap();
    let Resource::Remote(remote) = session.open(&uri, 0, Access::Update).unwrap() else {
        panic!("{uri} is not remote");
    };
    let at = Endpoint::remote(&remote[0], 0);
    let e = ColdTier::remote(
        &session,
        Endpoint::host(
            &session
                .alloc_host(HostPlacement::Dram { numa: None }, 8, false)
                .unwrap(),
            0,
        ),
        8,
        Codec::Lz4,
    )
    .unwrap_err();
    assert!(e.to_string().contains("export"), "{e}");
    let (entry, tokens) = (656usize, 200u64);
    let kv = KvPoolConfig {
        layers: 1,
        entry_bytes: entry,
        max_tokens: tokens,
        warm_entries: tokens,
        hot_slots: 64,
        max_selection: 32,
        gpu: 0,
        placement: HostPlacement::Dram { numa: None },
    };
    let mut pool = KvPool::new(&session, kv).unwrap();
    pool.attach_cold_tier(
        ColdTier::remote(&session, at, capacity as u64, Codec::Zstd { level: 3 }).unwrap(),
    )
    .unwrap();
    // KV-like entries: structured, so they compress.
    let bytes: Vec<u8> = (0..tokens as usize * entry)
        .map(|i| (pattern::mix64(i as u64 / 16) % 5) as u8)
        .collect();
    let src = session.alloc_device(0, bytes.len()).unwrap();
    src.gpu().stream().unwrap().upload(&bytes, &src, 0).unwrap();
    let scores: Vec<f32> = (0..tokens).map(|p| p as f32).collect();
    pool.store(&session, 0, 0, tokens as usize, &src, 0, Some(&scores))
        .unwrap();
    let moved = pool.compact(100.0).unwrap();
    assert_eq!(moved.to_cold, 100);
    assert_eq!(pool.tier_of(0, 3), Some(Tier::Cold));
    let cold = pool.cold_tier().unwrap();
    assert!(cold.file_bytes() < cold.raw_bytes() / 2, "{cold:?}");
    // Cold positions selected: read back from the export, checked, exact.
    let selection: Vec<u64> = (0..32).map(|i| i * 3).collect();
    let dst = session.alloc_device(0, selection.len() * entry).unwrap();
    let r = pool.load(0, &selection, &dst, 0).unwrap();
    assert_eq!(r.from_cold, selection.iter().filter(|&&p| p < 100).count());
    let mut got = vec![0u8; selection.len() * entry];
    dst.gpu()
        .stream()
        .unwrap()
        .download(&dst, 0, &mut got)
        .unwrap();
    for (i, &p) in selection.iter().enumerate() {
        let want = &bytes[p as usize * entry..][..entry];
        assert!(got[i * entry..(i + 1) * entry] == *want, "position {p}");
    }
    // Entries that do not compress fill the 64 KiB export: a typed refusal.
    let noise: Vec<u8> = (0..tokens as usize * entry)
        .map(|i| pattern::mix64(i as u64) as u8)
        .collect();
    src.gpu().stream().unwrap().upload(&noise, &src, 0).unwrap();
    pool.store(&session, 0, 0, tokens as usize, &src, 0, Some(&scores))
        .unwrap();
    let e = pool.compact(1000.0).unwrap_err();
    assert!(matches!(e, AiError::TierFull(_)), "{e}");
}
