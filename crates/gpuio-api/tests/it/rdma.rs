//! `remoteio://...?transport=rdma` through a session (soft-RoCE in the QEMU guest: `cargo
//! xtask qemu-rdma`): copies from and to another node's memory export over RDMA verbs,
//! verified by checksum, into GPU memory (staged), a file export on the same agent falling
//! back to TCP, and remote atomics. Without a device the test says so and passes, unless
//! `GPUIO_REQUIRE_RDMA=1`.
#![cfg(feature = "rdma")]

use gpuio_api::{CopyOptions, Resource, Uri};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_testkit::Requirement;
use gpuio_transport_remoteio::rdma::RdmaOptions;
const LEN: usize = 6 << 20;

#[test]
fn sessions_copy_over_rdma() {
    if gpuio_rdma::device_names().unwrap_or_default().is_empty() {
        Requirement::Rdma.missing("no RDMA device");
        return;
    }
    let gid_index = if gpuio_rdma::RdmaDevice::open(None, 1).is_ok() {
        1
    } else {
        0
    };
    let crate::remote_agent::Remote {
        agent,
        mem,
        file_bytes: bytes,
        session: s,
        dir,
    } = crate::remote_agent::remote(
        LEN,
        31,
        |cfg| {
            cfg.rdma = Some(RdmaOptions {
                device: None,
                gid_index,
            })
        },
        |config| config.remote.rdma_gid_index = gid_index,
    );
    let at = |export: &str| {
        Uri::parse(&format!(
            "remoteio://{}/{export}?transport=rdma",
            agent.local_addr()
        ))
        .unwrap()
    };
    let verify = CopyOptions {
        verify: true,
        ..CopyOptions::default()
    };
    // Remote memory -> file and -> GPU memory, verified.
    let out = dir.path().join("out.bin");
    let to = Uri::parse(out.to_str().unwrap()).unwrap();
    s.copy(&at("mem"), &to, &verify, &mut |_| {}).unwrap();
    assert_eq!(
        pattern::first_deviation(&std::fs::read(&out).unwrap(), 0, 31),
        None
    );
    let r = s
        .copy(
            &at("mem"),
            &Uri::parse("gpu0").unwrap(),
            &verify,
            &mut |_| {},
        )
        .unwrap();
    assert!(r.checksum.is_some());
    // File -> remote memory over RDMA writes.
    let src_path = dir.path().join("src.bin");
    let mut fresh = vec![0u8; LEN];
    pattern::fill(&mut fresh, 0, 33);
    std::fs::write(&src_path, &fresh).unwrap();
    s.copy(
        &Uri::parse(src_path.to_str().unwrap()).unwrap(),
        &at("mem"),
        &verify,
        &mut |_| {},
    )
    .unwrap();
    assert!(mem.blocking_read()[..] == fresh[..]);
    // Remote memory -> host memory and back through the engines: the NIC moves the bytes in
    // place (the host buffer is registered through the cache, once).
    let host =
        gpuio_core::HostMemory::new(HostBuffer::alloc(LEN, &HostAllocOptions::default()).unwrap());
    let res = |r: Resource| match r {
        Resource::Remote(mut replicas) => replicas.remove(0),
        _ => panic!("not a remote resource"),
    };
    let remote = res(s.open(&at("mem"), 0, gpuio_api::Access::Read).unwrap());
    let src = gpuio_core::Endpoint::Remote {
        res: remote.clone(),
        offset: 4096,
    };
    let dst = gpuio_core::Endpoint::Host {
        mem: host.clone(),
        offset: 100,
    };
    let out = s.engines().execute(&src, &dst, LEN - 8192).unwrap();
    assert!(
        matches!(
            out.route,
            gpuio_core::Route::RemoteRead {
                via: gpuio_core::RemoteVia::Registered,
                ..
            } | gpuio_core::Route::RemoteWrite {
                via: gpuio_core::RemoteVia::Registered,
                ..
            }
        ),
        "{}",
        out.route
    );
    assert!(host.read()[100..100 + LEN - 8192] == fresh[4096..LEN - 4096]);
    pattern::fill(&mut host.write(), 0, 34);
    let out = s.engines().execute(&dst, &src, LEN - 8192).unwrap();
    assert!(
        matches!(
            out.route,
            gpuio_core::Route::RemoteRead {
                via: gpuio_core::RemoteVia::Registered,
                ..
            } | gpuio_core::Route::RemoteWrite {
                via: gpuio_core::RemoteVia::Registered,
                ..
            }
        ),
        "{}",
        out.route
    );
    assert!(mem.blocking_read()[4096..LEN - 4096] == host.read()[100..100 + LEN - 8192]);
    let regs = s.engines().remoteio().rdma_registrations();
    assert_eq!(regs.len(), 1, "one device, one cache: {regs:?}");
    assert!(regs[0].hits >= 1 && regs[0].entries >= 1, "{regs:?}");
    s.copy(
        &Uri::parse(src_path.to_str().unwrap()).unwrap(),
        &at("mem"),
        &verify,
        &mut |_| {},
    )
    .unwrap();
    // All of that went over RDMA: the agent served no bytes over TCP.
    let tcp = agent.stats();
    assert_eq!((tcp.bytes_read, tcp.bytes_written), (0, 0), "{tcp:?}");
    // A file export on the same agent: RDMA cannot reach it, TCP serves it.
    let out2 = dir.path().join("out2.bin");
    s.copy(
        &at("file"),
        &Uri::parse(out2.to_str().unwrap()).unwrap(),
        &verify,
        &mut |_| {},
    )
    .unwrap();
    assert!(std::fs::read(&out2).unwrap() == bytes);
    // Remote atomics through the session's peer.
    let Resource::Remote(replicas) = s.open(&at("mem"), 0, gpuio_api::Access::Read).unwrap() else {
        panic!("not a remote resource");
    };
    let (peer, export) = (replicas[0].peer(), replicas[0].export());
    let before = u64::from_ne_bytes(fresh[8..16].try_into().unwrap());
    assert_eq!(peer.fetch_add(export, 8, 3).unwrap(), before);
    assert_eq!(
        peer.compare_swap(export, 8, before + 3, 77).unwrap(),
        before + 3
    );
    assert_eq!(
        u64::from_ne_bytes(mem.blocking_read()[8..16].try_into().unwrap()),
        77
    );
    let file = gpuio_transport_remoteio::RemoteExport::new("file");
    assert!(peer.fetch_add(&file, 0, 1).is_err());
}
