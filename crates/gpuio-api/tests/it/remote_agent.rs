//! What the RDMA and NIXL session tests share: an agent on loopback with a memory export and a
//! file export, and a session holding its key.

#![cfg(any(feature = "rdma", feature = "nixl"))]

use gpuio_api::{Config, Session};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Export, ExportSource, Key, Role, SharedMemory, shared_memory,
};

/// Made by `gpuio agent keygen` (agents refuse weak secrets).
const SECRET: &str = "2364734aef7a34601fbc7e950cc43a7a0da7942685a7875f0c6700334ee62a91";

/// The agent, what it exports, and a session that may reach it.
pub struct Remote {
    pub agent: Agent,
    /// The "mem" export: host memory holding the pattern of the seed.
    pub mem: SharedMemory,
    /// The bytes of the "file" export (read-only, 1 MiB, the pattern of the seed + 1).
    pub file_bytes: Vec<u8>,
    pub session: Session,
    /// Where the key and the file live; the test's scratch too.
    pub dir: tempfile::TempDir,
}

/// An agent with key "ops" (read-write) exporting "mem" (`len` bytes, read-write) and
/// "file"; `agent` and `client` add the transport's settings to either side.
pub fn remote(
    len: usize,
    seed: u64,
    agent: impl FnOnce(&mut AgentConfig),
    client: impl FnOnce(&mut Config),
) -> Remote {
    let dir = tempfile::tempdir().unwrap();
    let mut buf = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, seed);
    let mem = shared_memory(buf);
    let file = dir.path().join("export.bin");
    let mut file_bytes = vec![0u8; 1 << 20];
    pattern::fill(&mut file_bytes, 0, seed + 1);
    std::fs::write(&file, &file_bytes).unwrap();
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
                path: file,
                max_len: None,
            },
            access: Access::ReadOnly,
        },
    ];
    agent(&mut cfg);
    let started = Agent::start(cfg).unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, SECRET).unwrap();
    // Secret files must be private to their owner.
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut config = Config::default();
    config.remote.key_id = "ops".into();
    config.remote.secret_file = key.display().to_string();
    client(&mut config);
    Remote {
        agent: started,
        mem,
        file_bytes,
        session: Session::new(config).unwrap(),
        dir,
    }
}
