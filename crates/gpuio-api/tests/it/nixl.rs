//! `remoteio://...?transport=nixl` through a session (UCX on loopback): copies from and to an
//! agent's memory export over NIXL, verified by checksum, with none of the bytes on the
//! agent's TCP data path; a file export on the same agent falling back to TCP. Without NIXL
//! the test says so and passes, unless `GPUIO_REQUIRE_NIXL=1`.
#![cfg(feature = "nixl")]

use gpuio_api::{Config, CopyOptions, Session, Uri};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_testkit::Requirement;
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Export, ExportSource, Key, Role, shared_memory,
};

/// Made by `gpuio agent keygen` (agents refuse weak secrets).
const SECRET: &str = "8f0e3a5c7b9d1e2f4a6c8e0b2d4f6a8c0e2b4d6f8a0c2e4b6d8f0a2c4e6b8d0f";
const LEN: usize = 6 << 20;

#[test]
fn sessions_copy_over_nixl() {
    if let Err(e) = gpuio_nixl::library() {
        Requirement::Nixl.missing(e);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut buf = HostBuffer::alloc(LEN, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, 41);
    let mem = shared_memory(buf);
    let file = dir.path().join("export.bin");
    let mut bytes = vec![0u8; 1 << 20];
    pattern::fill(&mut bytes, 0, 42);
    std::fs::write(&file, &bytes).unwrap();
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![Key {
        id: "ops".into(),
        secret: SECRET.as_bytes().to_vec(),
        role: Role::ReadWrite,
    }];
    cfg.exports = vec![
        Export {
            name: "mem".into(),
            source: ExportSource::Memory(mem.clone()),
            access: Access::ReadWrite,
        },
        Export {
            name: "file".into(),
            source: ExportSource::File {
                path: file.clone(),
                max_len: None,
            },
            access: Access::ReadOnly,
        },
    ];
    cfg.nixl = true;
    // Loopback: UCX's TCP transport, which checks no keys, is acceptable here.
    cfg.nixl_tcp = true;
    let agent = Agent::start(cfg).unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, SECRET).unwrap();
    // Secret files must be private to their owner.
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut config = Config::default();
    config.remote.key_id = "ops".into();
    config.remote.secret_file = key.display().to_string();
    let s = Session::new(config).unwrap();
    let at = |export: &str| {
        Uri::parse(&format!(
            "remoteio://{}/{export}?transport=nixl",
            agent.local_addr()
        ))
        .unwrap()
    };
    let verify = CopyOptions {
        verify: true,
        ..CopyOptions::default()
    };
    // Remote memory -> file, verified; then a file -> remote memory.
    let out = dir.path().join("out.bin");
    let to = Uri::parse(out.to_str().unwrap()).unwrap();
    s.copy(&at("mem"), &to, &verify, &mut |_| {}).unwrap();
    assert_eq!(
        pattern::first_deviation(&std::fs::read(&out).unwrap(), 0, 41),
        None
    );
    let src_path = dir.path().join("src.bin");
    let mut fresh = vec![0u8; LEN];
    pattern::fill(&mut fresh, 0, 43);
    std::fs::write(&src_path, &fresh).unwrap();
    s.copy(
        &Uri::parse(src_path.to_str().unwrap()).unwrap(),
        &at("mem"),
        &verify,
        &mut |_| {},
    )
    .unwrap();
    assert!(mem.blocking_read()[..] == fresh[..]);
    // NIXL moved it all: the agent's TCP data path served no byte.
    let stats = agent.stats();
    assert_eq!((stats.bytes_read, stats.bytes_written), (0, 0), "{stats:?}");
    // The file export is not offered over NIXL: TCP serves it.
    let copied = dir.path().join("copied.bin");
    s.copy(
        &at("file"),
        &Uri::parse(copied.to_str().unwrap()).unwrap(),
        &verify,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(std::fs::read(&copied).unwrap(), bytes);
    // (read once to copy and once more to verify; counted after the last byte is sent)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    while agent.stats().bytes_read < 2 << 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(agent.stats().bytes_read, 2 << 20);
}
