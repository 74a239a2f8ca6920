//! The `remote` suite: RemoteIO over TCP on loopback.
//!
//! - `tcp_read` / `tcp_write`: an agent exporting host memory, a [`RemotePeer`] reading (or
//!   writing) 64 MiB transfers striped over 1 and over 4 connections, for about as long as
//!   iperf3 runs, against `iperf3` on loopback in the same run (the better of one stream and
//!   four). Every read is checked against the export's pattern.
//! - `small_read`: sequential 64 B and 4 KiB reads on one connection; p50 and p99, against a
//!   bare TCP request–response of the same sizes (std sockets, no protocol, no checks): the
//!   floor of the loopback round trip.
//! - `nixl_read` / `nixl_write` (cargo feature `nixl`, NIXL found at run time): `nixl.rs`.
//! - `gpu_nixl_read` / `gpu_nixl_write` (the same, and CUDA): GPU memory between two
//!   processes, `nixl_gpu.rs`.

#[cfg(feature = "nixl")]
mod nixl;
#[cfg(feature = "nixl")]
mod nixl_gpu;

use crate::{BenchError, Record, Result, Target, fresh_seed, human, median_f64};
use gpuio_api::Session;
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Credentials, Export, ExportSource, Key, PeerConfig, RemoteExport,
    RemoteIoError, RemotePeer, Role, shared_memory,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The suite's name.
pub const SUITE: &str = "remote";

/// Sizes of the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// Bytes of the exported memory.
    pub export_bytes: usize,
    /// Bytes per transfer.
    pub transfer: usize,
    /// Seconds each side of a bandwidth race runs.
    pub seconds: f64,
    /// Timed repetitions (median).
    pub reps: usize,
    /// Connection counts measured.
    pub connections: Vec<usize>,
    /// Small reads timed per size.
    pub small_reads: usize,
    /// Transfer sizes of the NIXL cases.
    pub nixl_sizes: Vec<usize>,
    /// Transfer sizes of the GPU-to-GPU NIXL cases.
    pub gpu_nixl_sizes: Vec<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            export_bytes: 256 << 20,
            transfer: 64 << 20,
            seconds: 2.0,
            reps: 3,
            connections: vec![1, 4],
            small_reads: 20_000,
            nixl_sizes: vec![1 << 20, 16 << 20, 256 << 20, 1 << 30],
            gpu_nixl_sizes: vec![64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30],
        }
    }
}

impl Options {
    /// A short run.
    pub fn quick() -> Self {
        Self {
            export_bytes: 64 << 20,
            transfer: 16 << 20,
            seconds: 1.0,
            reps: 1,
            small_reads: 2000,
            nixl_sizes: vec![1 << 20, 16 << 20],
            gpu_nixl_sizes: vec![64 << 10, 16 << 20],
            ..Self::default()
        }
    }
}

const KEY: &[u8] = b"66fd8c7ecfaa22ea152306a380bc87f8dd0c898feb7c2ac9f1ead0ea40a91bb8";

fn remote(e: RemoteIoError) -> BenchError {
    BenchError::Gpuio(e.into())
}

/// Runs `op` over and over for `seconds`; returns GB/s of `bytes` per call.
fn sustained(seconds: f64, bytes: usize, mut op: impl FnMut() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    let mut n = 0u64;
    while n == 0 || t.elapsed().as_secs_f64() < seconds {
        op()?;
        n += 1;
    }
    Ok(n as f64 * bytes as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// [`sustained`] for several operations side by side: each runs `seconds` in all, in ten
/// turns alternated with the others', so that the machine's drift over the run (clocks,
/// caches, other load) falls on all alike. Each call gets its number; GB/s of each.
#[cfg(feature = "nixl")]
fn interleaved<const N: usize>(
    seconds: f64,
    bytes: usize,
    mut ops: [&mut dyn FnMut(u64) -> Result<()>; N],
) -> Result<[f64; N]> {
    const TURNS: u32 = 10;
    let turn = seconds / f64::from(TURNS);
    let (mut calls, mut spent) = ([0u64; N], [0f64; N]);
    for _ in 0..TURNS {
        for (k, op) in ops.iter_mut().enumerate() {
            let t = Instant::now();
            while calls[k] == 0 || t.elapsed().as_secs_f64() < turn {
                op(calls[k])?;
                calls[k] += 1;
            }
            spent[k] += t.elapsed().as_secs_f64();
        }
    }
    Ok(std::array::from_fn(|k| {
        calls[k] as f64 * bytes as f64 / spent[k] / 1e9
    }))
}

/// iperf3 on loopback for `seconds` with `streams` parallel streams: GB/s received.
fn iperf3(seconds: f64, streams: usize) -> std::result::Result<f64, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port()
        .to_string();
    let mut server = Command::new("iperf3")
        .args(["-s", "-B", "127.0.0.1", "-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("iperf3 is not installed ({e}); `apt-get install iperf3`"))?;
    // The server needs a moment to listen; the client is retried until it does.
    let mut out = None;
    for _ in 0..50 {
        let o = Command::new("iperf3")
            .args(["-c", "127.0.0.1", "-p", &port, "-J", "-P"])
            .arg(streams.to_string())
            // Whole seconds: iperf3 reads "-t 0.5" as 0, which means forever.
            .arg("-t")
            .arg(format!("{}", seconds.ceil().max(1.0) as u64))
            .output()
            .map_err(|e| e.to_string())?;
        let refused = String::from_utf8_lossy(&o.stdout).contains("Connection refused");
        out = Some(o);
        if !refused {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = server.kill();
    let _ = server.wait();
    let out = out.ok_or("iperf3 never ran")?;
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("iperf3 printed no JSON: {e}"))?;
    json["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|bps| bps / 8e9)
        .ok_or_else(|| format!("iperf3: {}", json["error"]))
}

/// A bare request–response server: reads 36-byte requests, answers `size` bytes each.
fn echo_server(size: usize) -> Result<(SocketAddr, std::thread::JoinHandle<()>)> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| BenchError::Options(e.to_string()))?;
    let addr = l
        .local_addr()
        .map_err(|e| BenchError::Options(e.to_string()))?;
    let h = std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let _ = s.set_nodelay(true);
        let mut req = [0u8; 36];
        let answer = vec![7u8; size];
        while s.read_exact(&mut req).is_ok() {
            if s.write_all(&answer).is_err() {
                return;
            }
        }
    });
    Ok((addr, h))
}

/// An agent on loopback exporting `bytes` of host memory holding the pattern of `seed` as
/// "mem", with the suite's read-write key; `configure` adds to its configuration.
fn start_agent(bytes: usize, seed: u64, configure: impl FnOnce(&mut AgentConfig)) -> Result<Agent> {
    let mut mem = HostBuffer::alloc(bytes, &HostAllocOptions::default())?;
    pattern::fill(&mut mem, 0, seed);
    let mut cfg = AgentConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)));
    cfg.keys = vec![Key {
        id: "bench".into(),
        secret: KEY.to_vec(),
        role: Role::ReadWrite,
    }];
    cfg.exports = vec![Export {
        name: "mem".into(),
        source: ExportSource::Memory(shared_memory(mem)),
        access: Access::ReadWrite,
    }];
    cfg.threads = std::thread::available_parallelism().map_or(2, |c| c.get().min(8));
    configure(&mut cfg);
    Agent::start(cfg).map_err(remote)
}

/// The suite's key, as a client presents it.
fn credentials() -> Credentials {
    Credentials {
        key_id: "bench".into(),
        secret: KEY.to_vec(),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(i).copied().unwrap_or_default()
}

/// Runs the suite.
pub fn run(
    #[cfg_attr(not(feature = "nixl"), allow(unused_variables))] session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let device = format!(
        "loopback, {} cores",
        std::thread::available_parallelism().map_or(1, |c| c.get())
    );
    let seed = fresh_seed();
    let agent = start_agent(opts.export_bytes, seed, |_| {})?;
    let creds = credentials();
    let export = RemoteExport::new("mem");
    let transfer = opts.transfer.min(opts.export_bytes);
    let spots = (opts.export_bytes / transfer).max(1);
    let mut buf = vec![0u8; transfer];
    let mut records = Vec::new();
    let mut notes = Vec::new();

    // Bandwidth, interleaved with iperf3.
    let max_conns = opts.connections.iter().copied().max().unwrap_or(4);
    let peers: Vec<(usize, RemotePeer)> = opts
        .connections
        .iter()
        .map(|&c| {
            let mut pc = PeerConfig::new(agent.local_addr(), creds.clone());
            pc.connections = c;
            RemotePeer::connect(pc).map(|p| (c, p)).map_err(remote)
        })
        .collect::<Result<_>>()?;
    let mut reads: Vec<Vec<f64>> = vec![Vec::new(); peers.len()];
    let mut writes: Vec<Vec<f64>> = vec![Vec::new(); peers.len()];
    let mut iperf: Vec<f64> = Vec::new();
    let mut iperf_failed = None;
    for rep in 0..opts.reps.max(1) {
        for (k, (conns, peer)) in peers.iter().enumerate() {
            progress(&format!("tcp_read, {conns} connections"));
            let mut i = rep;
            reads[k].push(sustained(opts.seconds, transfer, || {
                let at = (i % spots * transfer) as u64;
                i += 1;
                peer.read(&export, at, &mut buf).map_err(remote)
            })?);
            // The last read's bytes, checked.
            let at = ((i - 1) % spots * transfer) as u64;
            crate::check_pattern("tcp_read", &buf, at, seed)?;
            progress(&format!("tcp_write, {conns} connections"));
            // Writing the export's own bytes back keeps it checkable.
            writes[k].push(sustained(opts.seconds, transfer, || {
                peer.write(&export, at, &buf).map_err(remote)
            })?);
        }
        progress("iperf3");
        let best = [1, max_conns]
            .iter()
            .map(|&p| iperf3(opts.seconds, p))
            .collect::<Vec<_>>();
        match best
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .copied()
            .reduce(f64::max)
        {
            Some(v) => iperf.push(v),
            None => {
                iperf_failed = best.into_iter().find_map(|r| r.err());
            }
        }
    }
    let peer_gbs = (!iperf.is_empty()).then(|| median_f64(iperf.clone()));
    if let Some(e) = &iperf_failed
        && peer_gbs.is_none()
    {
        notes.push(format!("remote: no iperf3 figure: {e}"));
    }
    for (k, (conns, _)) in peers.iter().enumerate() {
        for (case, v) in [("tcp_read", &reads[k]), ("tcp_write", &writes[k])] {
            let value = median_f64(v.clone());
            let p = peer_gbs.unwrap_or(f64::NAN);
            records.push(Record {
                suite: SUITE.into(),
                case: format!("{case}/{conns} conn"),
                metric: "bandwidth".into(),
                value,
                unit: "GB/s".into(),
                peer: format!("iperf3 loopback (best of -P 1 and -P {max_conns})"),
                peer_value: p,
                ratio: value / p,
                bytes: transfer,
                route: format!("{conns} TCP connections, {} stripes", human(1 << 20)),
                device: device.clone(),
                reps: v.len(),
                rows: None,
            });
        }
    }

    // Small-read latency against a bare request-response.
    let peer = &peers[0].1;
    for size in [64usize, 4096] {
        progress(&format!("small_read {}", human(size)));
        let mut small = vec![0u8; size];
        let mut ours = Vec::with_capacity(opts.small_reads);
        for i in 0..opts.small_reads {
            let at = (pattern::mix64(seed ^ i as u64) % (opts.export_bytes - size) as u64) & !63;
            let t = Instant::now();
            peer.read(&export, at, &mut small).map_err(remote)?;
            ours.push(t.elapsed());
        }
        let (addr, server) = echo_server(size)?;
        let mut s = TcpStream::connect(addr).map_err(|e| BenchError::Options(e.to_string()))?;
        let _ = s.set_nodelay(true);
        let mut bare = Vec::with_capacity(opts.small_reads);
        let req = [1u8; 36];
        for _ in 0..opts.small_reads {
            let t = Instant::now();
            s.write_all(&req)
                .and_then(|()| s.read_exact(&mut small))
                .map_err(|e| BenchError::Options(e.to_string()))?;
            bare.push(t.elapsed());
        }
        drop(s);
        let _ = server.join();
        ours.sort();
        bare.sort();
        for (metric, p) in [("p50", 0.5), ("p99", 0.99)] {
            let (v, b) = (percentile(&ours, p), percentile(&bare, p));
            records.push(Record {
                suite: SUITE.into(),
                case: format!("small_read_{metric}/{}", human(size)),
                metric: format!("latency {metric}"),
                value: v.as_secs_f64() * 1e6,
                unit: "us".into(),
                peer: "bare TCP request-response".into(),
                peer_value: b.as_secs_f64() * 1e6,
                ratio: b.as_secs_f64() / v.as_secs_f64().max(1e-12),
                bytes: size,
                route: "one connection".into(),
                device: device.clone(),
                reps: opts.small_reads,
                rows: None,
            });
        }
    }
    let stats = agent.shutdown();
    if stats.refused > 0 || stats.protocol_errors > 0 {
        return Err(BenchError::Options(format!(
            "the agent refused {} requests and saw {} protocol errors",
            stats.refused, stats.protocol_errors
        )));
    }
    #[allow(unused_mut)] // extended by the NIXL cases where built
    let mut targets = vec![Target::judge(
        "TCP loopback read bandwidth >= 0.9x iperf3 (best connection count)",
        &records,
        |r| r.case.starts_with("tcp_read") && r.case.ends_with(&format!("/{max_conns} conn")),
        |r| r.ratio,
        0.9,
        "x",
    )];
    #[cfg(feature = "nixl")]
    {
        let (more, why) = nixl::run(
            &opts.nixl_sizes,
            opts.seconds / 2.0,
            seed,
            &device,
            progress,
        )?;
        targets.extend(nixl::targets(&more));
        records.extend(more);
        notes.extend(why);
        let (more, why) = nixl_gpu::run(
            session,
            &opts.gpu_nixl_sizes,
            opts.seconds / 2.0,
            seed,
            progress,
        )?;
        targets.extend(nixl_gpu::targets(&more));
        records.extend(more);
        notes.extend(why);
    }
    #[cfg(not(feature = "nixl"))]
    notes.push("remote: no NIXL cases: not in this build (cargo feature `nixl`)".into());
    Ok((records, targets, notes))
}
