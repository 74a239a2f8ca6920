//! `remoteio://...?transport=nixl` through a session (UCX on loopback): copies from and to an
//! agent's memory export over NIXL, verified by checksum, with none of the bytes on the
//! agent's TCP data path; a file export on the same agent falling back to TCP; a GPU memory
//! export copied into GPU memory, GPU to GPU where CUDA is. Without NIXL the tests say so and
//! pass, unless `GPUIO_REQUIRE_NIXL=1`.
#![cfg(feature = "nixl")]

use gpuio_api::{CopyOptions, Uri};
use gpuio_core::{RemoteVia, Route};
use gpuio_hal::pattern;
use gpuio_testkit::Requirement;
use gpuio_transport_remoteio::{Access, Export, ExportSource};
const LEN: usize = 6 << 20;

#[test]
fn sessions_copy_over_nixl() {
    if let Err(e) = gpuio_nixl::library() {
        Requirement::Nixl.missing(e);
        return;
    }
    let crate::remote_agent::Remote {
        agent,
        mem,
        file_bytes: bytes,
        session: s,
        dir,
    } = crate::remote_agent::remote(
        LEN,
        41,
        |cfg| {
            cfg.nixl = true;
            // Loopback: UCX's TCP transport, which checks no keys, is acceptable here.
            cfg.nixl_tcp = true;
        },
        |_| {},
    );
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

/// A GPU memory export (on the first GPU) copied into the last GPU through a session, verified
/// by checksum: GPU to GPU over NIXL on CUDA, staged through host memory on the host backend
/// (whose stand-in devices NIXL sees as host memory); no byte on the agent's TCP data path.
#[test]
fn a_gpu_export_copies_into_gpu_memory() {
    if let Err(e) = gpuio_nixl::library() {
        Requirement::Nixl.missing(e);
        return;
    }
    let probe = gpuio_hal::probe(gpuio_hal::BackendPreference::Auto).unwrap();
    let from = &probe.gpus[0];
    let hbm = from.alloc(LEN).unwrap();
    let mut init = vec![0u8; LEN];
    pattern::fill(&mut init, 0, 47);
    from.stream().unwrap().upload(&init, &hbm, 0).unwrap();
    let crate::remote_agent::Remote {
        agent,
        session: s,
        dir: _dir,
        ..
    } = crate::remote_agent::remote(
        1 << 20,
        45,
        |cfg| {
            cfg.exports.push(Export {
                name: "hbm".into(),
                source: ExportSource::Device(hbm.clone()),
                access: Access::ReadWrite,
            });
            cfg.nixl = true;
            cfg.nixl_tcp = true;
        },
        |_| {},
    );
    let src = Uri::parse(&format!(
        "remoteio://{}/hbm?transport=nixl",
        agent.local_addr()
    ))
    .unwrap();
    let dst = Uri::parse(&format!("gpu{}", probe.gpus.len() - 1)).unwrap();
    let verify = CopyOptions {
        verify: true,
        ..CopyOptions::default()
    };
    let report = s.copy(&src, &dst, &verify, &mut |_| {}).unwrap();
    assert_eq!(report.bytes, LEN as u64);
    assert_eq!(report.checksum, Some(crc32c::crc32c(&init)));
    let via = match from.backend() {
        gpuio_hal::Backend::Cuda => RemoteVia::GpuToGpu,
        gpuio_hal::Backend::Host => RemoteVia::Staged,
    };
    assert!(
        report
            .stages
            .iter()
            .all(|o| matches!(o.route, Route::RemoteRead { via: v, .. } if v == via)),
        "{:?}",
        report.stages
    );
    let stats = agent.stats();
    assert_eq!((stats.bytes_read, stats.bytes_written), (0, 0), "{stats:?}");
}
