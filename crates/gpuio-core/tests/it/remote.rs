//! The RemoteIO engine over a real agent on loopback and the probed backend (CUDA on the GPU
//! machine): another node's memory into GPU memory and back through the staging buffers,
//! into and out of files, replica failover, and refusals that write nothing.

use crate::common;

use common::engines;
use gpuio_core::*;
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_localio::OpenOptions;
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Credentials, Export, ExportSource, Key, PeerConfig, RemotePeer,
    Role, SharedMemory, shared_memory,
};
use std::sync::Arc;
use std::time::Duration;

const KEY: &[u8] = b"118a6cd83870277cd9048915603426c7ecec9d77b5b4a3df1e33b94d4c9f79be";
/// More than two staging buffers' worth, at an odd size.
const LEN: usize = (20 << 20) + 12_345;

fn agent() -> (Agent, SharedMemory) {
    let mut buf = HostBuffer::alloc(LEN + (1 << 20), &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, 9);
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
    (Agent::start(cfg).unwrap(), mem)
}

fn peer(addr: std::net::SocketAddr) -> Arc<RemotePeer> {
    let creds = Credentials {
        key_id: "k".into(),
        secret: KEY.to_vec(),
    };
    let mut cfg = PeerConfig::new(addr, creds);
    cfg.timeout = Duration::from_secs(2);
    cfg.connect_attempts = 1;
    Arc::new(RemotePeer::new(cfg))
}

#[test]
fn remote_memory_reaches_gpu_memory_and_files_and_back() {
    let e = engines();
    let (agent, mem) = agent();
    let res = RemoteResource::new(peer(agent.local_addr()), "mem");
    let gpu = e.memio().gpu(0).unwrap().clone();
    let dev = gpu.alloc(LEN + 4096).unwrap();

    // Remote -> GPU, staged.
    let o = e
        .transfer(Source::Remote(&res, 7), Dest::Device(&dev, 100), LEN)
        .unwrap();
    assert_eq!(o.engine, EngineKind::RemoteIo);
    assert!(o.route.to_string().contains("staged"), "{}", o.route);
    let mut back = vec![0u8; LEN];
    e.transfer(Source::Device(&dev, 100), Dest::Host(&mut back), LEN)
        .unwrap();
    assert_eq!(pattern::first_deviation(&back, 7, 9), None);

    // GPU -> remote: new bytes land in the export.
    let mut fresh = vec![0u8; LEN];
    pattern::fill(&mut fresh, 0, 10);
    e.transfer(Source::Host(&fresh), Dest::Device(&dev, 0), LEN)
        .unwrap();
    e.transfer(Source::Device(&dev, 0), Dest::Remote(&res, 3), LEN)
        .unwrap();
    assert!(mem.blocking_read()[3..3 + LEN] == fresh[..]);

    // Remote -> file -> remote, and remote -> remote.
    let dir = tempfile::tempdir().unwrap();
    let f = e
        .localio()
        .open(dir.path().join("r.bin"), OpenOptions::CREATE)
        .unwrap();
    e.transfer(Source::Remote(&res, 3), Dest::File(&f, 0), LEN)
        .unwrap();
    assert!(std::fs::read(dir.path().join("r.bin")).unwrap() == fresh);
    e.transfer(Source::File(&f, 1000), Dest::Remote(&res, 0), 5000)
        .unwrap();
    assert!(mem.blocking_read()[..5000] == fresh[1000..6000]);
    e.transfer(
        Source::Remote(&res, 0),
        Dest::Remote(&res, LEN as u64),
        4096,
    )
    .unwrap();
    assert!(mem.blocking_read()[LEN..LEN + 4096] == fresh[1000..5096]);
}

#[test]
fn refusals_write_nothing_and_replicas_fail_over() {
    let e = engines();
    let (agent, _mem) = agent();
    let good = RemoteResource::new(peer(agent.local_addr()), "mem");
    let gpu = e.memio().gpu(0).unwrap().clone();
    let dev = gpu.alloc(1 << 20).unwrap();
    let zeros = vec![0u8; 1 << 20];
    e.transfer(Source::Host(&zeros), Dest::Device(&dev, 0), 1 << 20)
        .unwrap();
    // Past the export's end: a typed refusal, and the GPU buffer untouched.
    let err = e
        .transfer(
            Source::Remote(&good, LEN as u64 + 1),
            Dest::Device(&dev, 0),
            1 << 20,
        )
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    // An unknown export.
    let missing = RemoteResource::new(peer(agent.local_addr()), "nope");
    let mut small = vec![0u8; 64];
    let err = e
        .transfer(Source::Remote(&missing, 0), Dest::Host(&mut small), 64)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound, "{err}");
    let mut back = vec![1u8; 1 << 20];
    e.transfer(Source::Device(&dev, 0), Dest::Host(&mut back), 1 << 20)
        .unwrap();
    assert!(back.iter().all(|&b| b == 0));

    // A replica on a dead address, then a live one: the transfer fails over.
    let dead_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let dead = RemoteResource::new(peer(dead_addr), "mem");
    let dst = HostMemory::new(HostBuffer::alloc(1 << 20, &HostAllocOptions::default()).unwrap());
    let policy = RetryPolicy {
        max_retries: 1,
        ..RetryPolicy::default()
    };
    let (mut retries, mut failovers) = (0, 0);
    let o = e
        .execute_any(
            &[Endpoint::remote(&dead, 0), Endpoint::remote(&good, 0)],
            &Endpoint::host(&dst, 0),
            1 << 20,
            &policy,
            None,
            &mut || retries += 1,
            &mut || failovers += 1,
        )
        .unwrap();
    assert!(
        o.failover.is_some() && o.to_string().contains("failover"),
        "{o}"
    );
    assert_eq!((retries, failovers), (1, 1));
    assert_eq!(pattern::first_deviation(&dst.read(), 0, 9), None);
}
