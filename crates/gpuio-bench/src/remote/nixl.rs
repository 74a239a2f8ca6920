//! The remote suite's NIXL cases (cargo feature `nixl`, and NIXL found at run time):
//! `nixl_read/<size>` and `nixl_write/<size>`, a [`RemotePeer`] reaching a memory export with
//! `?transport=nixl` (an agent on loopback, `[agent] nixl`) and moving it in and out of shared
//! host memory (the engine's, as sessions and `gpuio cp` move it), against gpuio's own TCP
//! path (4 connections) into the same memory and against NIXL alone (two NIXL agents in this
//! process, one registered buffer read into another, one transfer per call: NIXL's best case),
//! same sizes, same run, the three alternated ([`super::interleaved`]). UCX picks the
//! transport (shared memory on one host). Each path's reads and writes are checked after, and
//! the agent must have served over TCP exactly what the TCP peer moved (none of NIXL's).

use super::remote;
use crate::{BenchError, Record, Result, Target, human};
use gpuio_hal::{HostAllocOptions, HostBuffer, SharedHostBuffer, pattern};
use gpuio_nixl::NixlAgent;
use gpuio_transport_remoteio::{PeerConfig, RemoteExport, RemotePeer};
use std::sync::Arc;

/// Runs the NIXL cases; records, and notes (why they did not run, where NIXL is missing).
pub(super) fn run(
    sizes: &[usize],
    seconds: f64,
    seed: u64,
    device: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<String>)> {
    if let Err(e) = gpuio_nixl::library() {
        return Ok((Vec::new(), vec![format!("remote: no NIXL cases: {e}")]));
    }
    let largest = sizes.iter().copied().max().unwrap_or(1 << 20);
    let export_bytes = largest * 2;
    let agent = super::start_agent(export_bytes, seed, |cfg| {
        cfg.nixl = true;
        // Loopback, in this process: UCX's TCP transport (which checks no keys) may stay on.
        cfg.nixl_tcp = true;
    })?;
    let peer = |nixl: bool| {
        let mut pc = PeerConfig::new(agent.local_addr(), super::credentials());
        pc.nixl = nixl;
        RemotePeer::connect(pc).map_err(remote)
    };
    let (over_nixl, over_tcp) = (peer(true)?, peer(false)?);
    let export = RemoteExport::new("mem");

    // NIXL alone: the same bytes between two agents of this process.
    let src_agent = NixlAgent::new("gpuio-bench-alone-src")?;
    let dst_agent = NixlAgent::new("gpuio-bench-alone-dst")?;
    let mut src = HostBuffer::alloc(export_bytes, &HostAllocOptions::default())?;
    pattern::fill(&mut src, 0, seed);
    let mut dst = HostBuffer::alloc(largest, &HostAllocOptions::default())?;
    let src_region = src_agent.register(&src, 0..export_bytes)?;
    let dst_region = dst_agent.register(&dst, 0..largest)?;
    let alone_peer = dst_agent.connect(&src_agent.metadata()?)?;
    let alone_remote = src_region.remote();

    let opts = HostAllocOptions::default();
    let mem = Arc::new(SharedHostBuffer::new(HostBuffer::alloc(largest, &opts)?));
    let mut records = Vec::new();
    let check = |case: &str, got: &[u8], at: u64| crate::check_pattern(case, got, at, seed);
    for &size in sizes {
        let spots = (export_bytes / size).max(1) as u64;
        let at = |i: u64| (i % spots) * size as u64;
        progress(&format!("nixl_read {}", human(size)));
        let ours = |i| over_nixl.read_memory(&export, at(i), &mem, 0, size);
        let tcp = |i| over_tcp.read_memory(&export, at(i), &mem, 0, size);
        let mut alone = |i| -> Result<()> {
            let d = &mut dst.as_mut_slice()[..size];
            Ok(dst_agent.read_into(&dst_region, d, &alone_peer, &alone_remote, at(i))?)
        };
        let [ours_r, tcp_r, alone_r] = super::interleaved(
            seconds,
            size,
            [
                &mut |i| ours(i).map_err(remote),
                &mut |i| tcp(i).map_err(remote),
                &mut alone,
            ],
        )?;
        // Each path's bytes, into a cleared buffer.
        let clear = || mem.write().as_mut_slice()[..size].fill(0);
        clear();
        ours(3).map_err(remote)?;
        check("nixl_read", &mem.read()[..size], at(3))?;
        clear();
        tcp(5).map_err(remote)?;
        check("tcp_read", &mem.read()[..size], at(5))?;
        let d = &mut dst.as_mut_slice()[..size];
        d.fill(0);
        dst_agent.read_into(&dst_region, d, &alone_peer, &alone_remote, at(7))?;
        check("nixl_alone_read", d, at(7))?;

        progress(&format!("nixl_write {}", human(size)));
        // Writing the export's own bytes back keeps it checkable.
        ours(0).map_err(remote)?;
        dst.as_mut_slice()[..size].copy_from_slice(&src.as_slice()[..size]);
        let write = |peer: &RemotePeer| peer.write_memory(&export, 0, &mem, 0, size);
        let [ours_w, tcp_w, alone_w] = super::interleaved(
            seconds,
            size,
            [
                &mut |_| write(&over_nixl).map_err(remote),
                &mut |_| write(&over_tcp).map_err(remote),
                &mut |_| {
                    let d = &dst.as_slice()[..size];
                    Ok(dst_agent.write_from(&dst_region, d, &alone_peer, &alone_remote, 0)?)
                },
            ],
        )?;
        // Each path's write lands: other bytes, read back over the other path, then the
        // export's own put back.
        let other = seed ^ 0x5a5a;
        for (case, writer, reader) in [
            ("nixl_write", &over_nixl, &over_tcp),
            ("tcp_write", &over_tcp, &over_nixl),
        ] {
            for (bytes, check_it) in [(other, true), (seed, false)] {
                pattern::fill(&mut mem.write().as_mut_slice()[..size], 0, bytes);
                writer
                    .write_memory(&export, 0, &mem, 0, size)
                    .map_err(remote)?;
                clear();
                reader
                    .read_memory(&export, 0, &mem, 0, size)
                    .map_err(remote)?;
                if check_it {
                    crate::check_pattern(case, &mem.read()[..size], 0, other)?;
                }
            }
        }
        pattern::fill(&mut dst.as_mut_slice()[..size], 0, other);
        let d = &dst.as_slice()[..size];
        dst_agent.write_from(&dst_region, d, &alone_peer, &alone_remote, 0)?;
        crate::check_pattern("nixl_alone_write", &src.as_slice()[..size], 0, other)?;
        pattern::fill(&mut src.as_mut_slice()[..size], 0, seed);
        for (case, value, peer, theirs) in [
            ("nixl_read", ours_r, "gpuio TCP (4 connections)", tcp_r),
            ("nixl_read", ours_r, "NIXL alone", alone_r),
            ("nixl_write", ours_w, "gpuio TCP (4 connections)", tcp_w),
            ("nixl_write", ours_w, "NIXL alone", alone_w),
        ] {
            records.push(Record {
                suite: super::SUITE.into(),
                case: format!("{case}/{}", human(size)),
                metric: "bandwidth".into(),
                value,
                unit: "GB/s".into(),
                peer: peer.into(),
                peer_value: theirs,
                ratio: value / theirs,
                bytes: size,
                route: "?transport=nixl (UCX; loopback)".into(),
                device: device.to_string(),
                reps: 1,
                rows: None,
            });
        }
    }
    let (tcp_moved, stats) = (over_tcp.stats(), agent.shutdown());
    if stats.refused > 0 || stats.protocol_errors > 0 {
        return Err(BenchError::Options(format!(
            "the agent refused {} requests and saw {} protocol errors",
            stats.refused, stats.protocol_errors
        )));
    }
    // The NIXL peer's bytes went over NIXL: the agent's TCP data path served the TCP peer's.
    let tcp_served = (stats.bytes_read, stats.bytes_written);
    if tcp_served != (tcp_moved.bytes_read, tcp_moved.bytes_written) {
        return Err(BenchError::Options(format!(
            "the agent served {tcp_served:?} bytes (read, written) over TCP, the TCP peer moved \
             {:?}: the NIXL peer fell back to TCP",
            (tcp_moved.bytes_read, tcp_moved.bytes_written)
        )));
    }
    Ok((records, Vec::new()))
}

/// The NIXL targets: at least gpuio's TCP path, and 0.9x NIXL alone.
pub(super) fn targets(records: &[Record]) -> Vec<Target> {
    vec![
        Target::judge(
            "NIXL transport >= 1.0x gpuio's TCP path (loopback, 1 MiB-1 GiB)",
            records,
            |r| r.case.starts_with("nixl_") && r.peer.starts_with("gpuio TCP"),
            |r| r.ratio,
            1.0,
            "x",
        ),
        Target::judge(
            "NIXL transport >= 0.9x NIXL alone (loopback, 1 MiB-1 GiB)",
            records,
            |r| r.case.starts_with("nixl_") && r.peer == "NIXL alone",
            |r| r.ratio,
            0.9,
            "x",
        ),
    ]
}
