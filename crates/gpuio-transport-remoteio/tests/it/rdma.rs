//! RemoteIO over RDMA verbs (soft-RoCE in the QEMU guest: `cargo xtask qemu-rdma`): an agent
//! serving a memory export over RDMA, a client reaching it through the TCP control channel;
//! one-sided reads and writes checked byte for byte, remote atomics, and the NIC refusing
//! writes a read-only key may not make and ranges past the export. Without a device the tests
//! say so and pass, unless `GPUIO_REQUIRE_RDMA=1`.
#![cfg(feature = "rdma")]

use gpuio_hal::{ErrorCode, HostAllocOptions, HostBuffer, pattern};
use gpuio_testkit::Requirement;
use gpuio_transport_remoteio::rdma::{RdmaChannel, RdmaOptions};
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Connection, Credentials, Export, ExportSource, Key, Role,
    shared_memory,
};
use std::time::Duration;

const RW: &[u8] = b"f4e3b22b7ac5e013260a84bdb11b7888bfa98bdb4edb8685c6a403a5968e312d";
const RO: &[u8] = b"ce2c41324a17db89852cee246a92321a474ee5f99c4976eb7a4a291287d59e1e";
const LEN: usize = 8 << 20;

fn options() -> Option<RdmaOptions> {
    let names = gpuio_rdma::device_names().unwrap_or_default();
    if names.is_empty() {
        Requirement::Rdma.missing("no RDMA device");
        return None;
    }
    // RoCE: GID 1 is the first configured address where there is one.
    let gid_index = if gpuio_rdma::RdmaDevice::open(None, 1).is_ok() {
        1
    } else {
        0
    };
    Some(RdmaOptions {
        device: None,
        gid_index,
    })
}

#[test]
fn reads_writes_and_atomics_over_rdma() {
    let Some(opts) = options() else { return };
    let mut buf = HostBuffer::alloc(LEN, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, 21);
    buf.as_mut_slice()[..8].copy_from_slice(&100u64.to_ne_bytes());
    let mem = shared_memory(buf);
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = vec![
        Key {
            id: "rw".into(),
            secret: RW.to_vec(),
            role: Role::ReadWrite,
        },
        Key {
            id: "ro".into(),
            secret: RO.to_vec(),
            role: Role::ReadOnly,
        },
    ];
    cfg.exports = vec![Export {
        name: "mem".into(),
        source: ExportSource::Memory(mem.clone()),
        access: Access::ReadWrite,
    }];
    cfg.rdma = Some(opts.clone());
    let agent = Agent::start(cfg).unwrap();
    let dev = opts.open().unwrap();
    let t = Duration::from_secs(5);
    let connect = |id: &str, secret: &[u8]| {
        let creds = Credentials {
            key_id: id.into(),
            secret: secret.to_vec(),
        };
        let c = Connection::connect(agent.local_addr(), &creds, t).unwrap();
        RdmaChannel::open(c, &dev, "mem", 1 << 20, t).unwrap()
    };

    let mut ch = connect("rw", RW);
    assert_eq!(ch.len(), LEN as u64);
    let mut got = vec![0u8; (3 << 20) + 5];
    ch.read(4096, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 4096, 21), None);
    let data: Vec<u8> = (0..(2 << 20) + 7).map(|i| (i % 247) as u8).collect();
    ch.write(1 << 20, &data).unwrap();
    assert!(mem.blocking_read()[1 << 20..(1 << 20) + data.len()] == data[..]);
    assert_eq!(ch.fetch_add(0, 5).unwrap(), 100);
    assert_eq!(ch.compare_swap(0, 105, 1).unwrap(), 105);
    assert_eq!(
        u64::from_ne_bytes(mem.blocking_read()[..8].try_into().unwrap()),
        1
    );
    // Past the export: refused before anything is posted.
    let err = ch.read(LEN as u64 - 4, &mut got[..8]).unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");

    // A read-only key reads, and its writes and atomics are refused by the NIC.
    let mut ro = connect("ro", RO);
    let mut b = vec![0u8; 4096];
    ro.read(LEN as u64 - 4096, &mut b).unwrap();
    assert_eq!(pattern::first_deviation(&b, LEN as u64 - 4096, 21), None);
    let err = ro.write(LEN as u64 - 4096, &[9u8; 64]).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Permission, "{err}");
    assert_eq!(
        pattern::first_deviation(&mem.blocking_read()[LEN - 4096..], LEN as u64 - 4096, 21),
        None
    );
    drop(ro);
    drop(ch);
    assert_eq!(agent.shutdown().protocol_errors, 0);
}
