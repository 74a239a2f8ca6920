//! The remote suite's GPU cases (CUDA and NIXL): `gpu_nixl_read/<size>` and
//! `gpu_nixl_write/<size>`, between two processes. A `gpuio agent` child exports memory of the
//! first GPU over NIXL; this process moves it into and out of memory of the last GPU with a
//! [`RemotePeer`] (`read_device`/`write_device`: `cuda_ipc` between the processes, over NVLink
//! between two GPUs). Against NIXL alone (a NIXL agent of this process with its buffer
//! registered once, reaching the same export through the agent's NIXL side: NIXL's best case)
//! and, for reads, a torch peer copy in one process (`dst.copy_(src)`, first GPU to last). Each
//! case's last bytes are checked.

use super::{KEY, remote, sustained};
use crate::{BenchError, Record, Result, Target, human};
use gpuio_api::Session;
use gpuio_hal::{Backend, DeviceBuffer, Stream, pattern};
use gpuio_nixl::{NixlAgent, NixlMem, NixlRemote};
use gpuio_transport_remoteio::{Connection, PeerConfig, RemoteExport, RemotePeer};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const TORCH_PEER_COPY: &str = include_str!("../../peers/torch_peer_copy.py");

/// A private scratch directory, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `gpuio agent` child process, killed when dropped (its key and configuration removed).
struct AgentProcess {
    child: Child,
    addr: SocketAddr,
    // After the child (fields drop in order): removed once it is gone.
    _dir: Scratch,
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How long the agent process may take to say where it listens.
const AGENT_START: Duration = Duration::from_secs(60);

/// Starts `gpuio agent` (this executable) exporting `bytes` of GPU 0's memory as "hbm" over
/// NIXL, with the suite's key; returns once it listens. UCX's TCP transport (which checks no
/// keys) stays on loopback (`UCX_NET_DEVICES=lo`); GPU memory moves over `cuda_ipc`.
fn start_agent_process(bytes: usize) -> Result<AgentProcess> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let io = |e: std::io::Error| BenchError::Options(format!("the agent process: {e}"));
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = Scratch(std::env::temp_dir().join(format!(
        "gpuio-bench-agent-{}-{nonce:08x}",
        std::process::id()
    )));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir.0)
        .map_err(io)?;
    let key = dir.0.join("key");
    std::fs::write(&key, KEY).map_err(io)?;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    let config = dir.0.join("agent.toml");
    let toml = format!(
        "[agent]\nlisten = \"127.0.0.1:0\"\nnixl = true\nnixl_tcp = true\n\
         [[agent.keys]]\nid = \"bench\"\nrole = \"read-write\"\nsecret_file = \"{}\"\n\
         [[agent.exports]]\nname = \"hbm\"\naccess = \"read-write\"\nmemory = {bytes}\ngpu = 0\n",
        key.display()
    );
    std::fs::write(&config, toml).map_err(io)?;
    let stderr = std::fs::File::create(dir.0.join("stderr")).map_err(io)?;
    let exe = std::env::current_exe().map_err(io)?;
    let mut child = Command::new(exe)
        .arg("--config")
        .arg(&config)
        .arg("agent")
        .env("UCX_NET_DEVICES", "lo")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .map_err(io)?;
    // Its first line, read on a thread of its own so that a child that never says it is
    // waited for a bounded time; the thread then drains the rest, keeping the pipe open.
    let (tx, rx) = std::sync::mpsc::channel();
    if let Some(out) = child.stdout.take() {
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            let _ = tx.send(lines.next().and_then(|l| l.ok()).unwrap_or_default());
            lines.for_each(drop);
        });
    }
    let line = rx.recv_timeout(AGENT_START).unwrap_or_default();
    let addr = line
        .trim()
        .strip_prefix("gpuio agent listening on ")
        .and_then(|a| a.parse().ok());
    let said = std::fs::read_to_string(dir.0.join("stderr")).unwrap_or_default();
    let started = AgentProcess {
        child,
        addr: addr.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0))),
        _dir: dir,
    };
    match addr {
        Some(_) => Ok(started),
        None => Err(BenchError::Options(format!(
            "the agent process did not start: {}",
            said.lines().last().unwrap_or(line.trim())
        ))),
    }
}

/// Runs the torch peer copy for `sizes`: bytes per second for each, or why it could not run.
fn torch_peer_copy(seconds: f64, sizes: &[usize]) -> std::result::Result<Vec<f64>, String> {
    let out = crate::peers::python_peer("torch peer copy", TORCH_PEER_COPY, |cmd| {
        cmd.arg(seconds.to_string())
            .args(sizes.iter().map(|s| s.to_string()));
    })?;
    sizes
        .iter()
        .map(|&s| {
            out.iter()
                .find(|j| j["size"].as_u64() == Some(s as u64))
                .and_then(|j| j["bytes_per_s"].as_f64())
                .ok_or_else(|| format!("torch peer copy: no figure for {s} bytes"))
        })
        .collect()
}

/// Whether `len` bytes of `buf` at 0 hold the pattern of `seed` from `at`.
fn check(
    stream: &Stream,
    case: &str,
    buf: &DeviceBuffer,
    len: usize,
    at: u64,
    seed: u64,
) -> Result<()> {
    let mut host = vec![0u8; len];
    stream.download(buf, 0, &mut host)?;
    crate::check_pattern(case, &host, at, seed)
}

/// Runs the GPU cases; records, and notes (why they did not run). Only wrong bytes fail the
/// suite: a machine where they cannot run (no CUDA, no NIXL, an agent process that does not
/// start, a path NIXL does not serve) gets a note, and the suite's other records stand.
pub(super) fn run(
    session: &Session,
    sizes: &[usize],
    seconds: f64,
    seed: u64,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<String>)> {
    let gpus = session.gpus();
    let why = match (gpus.first(), gpuio_nixl::library()) {
        (None, _) => "no GPU".to_string(),
        (Some(g), _) if g.backend() != Backend::Cuda => "no CUDA GPU".into(),
        (_, Err(e)) => e.to_string(),
        (Some(_), Ok(_)) => match measure(gpus, sizes, seconds, seed, progress) {
            Err(e @ BenchError::Corrupt { .. }) => return Err(e),
            Err(e) => e.to_string(),
            Ok(done) => return Ok(done),
        },
    };
    Ok((
        Vec::new(),
        vec![format!("remote: no GPU NIXL cases: {why}")],
    ))
}

/// The GPU cases, between the first GPU and the last.
fn measure(
    gpus: &[gpuio_hal::Gpu],
    sizes: &[usize],
    seconds: f64,
    seed: u64,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<String>)> {
    let (Some(first), Some(to)) = (gpus.first(), gpus.last()) else {
        return Err(BenchError::Options("no GPU".into()));
    };
    let largest = sizes.iter().copied().max().unwrap_or(1 << 20);
    let export_bytes = largest * 2;
    progress("gpu_nixl: starting the agent process");
    let agent = start_agent_process(export_bytes)?;
    let device = format!(
        "{} -> {} (two processes, GPU {} -> GPU {})",
        first.info().name,
        to.info().name,
        first.ordinal(),
        to.ordinal()
    );
    let mut pc = PeerConfig::new(agent.addr, super::credentials());
    pc.nixl = true;
    let peer = RemotePeer::connect(pc).map_err(remote)?;
    let export = RemoteExport::new("hbm");
    let stream = to.stream()?;
    let buf = to.alloc(largest)?;
    let alone_buf = to.alloc(largest)?;

    // The export gets the pattern, written GPU to GPU (the write path's first check).
    let mut init = vec![0u8; export_bytes];
    pattern::fill(&mut init, 0, seed);
    for half in 0..2 {
        let at = half * largest;
        stream.upload(&init[at..at + largest], &buf, 0)?;
        peer.write_device(&export, at as u64, &buf, 0..largest)
            .ok_or_else(|| BenchError::Options("the GPU export is not served over NIXL".into()))?
            .map_err(remote)?;
    }
    drop(init);

    // NIXL alone: its own session to the agent, the metadata, one registration.
    let mut control =
        Connection::connect(agent.addr, &super::credentials(), Duration::from_secs(10))
            .map_err(remote)?;
    let offer = control.nixl_exchange("hbm").map_err(remote)?;
    let raw = NixlAgent::new("gpuio-bench-gpu-alone")?;
    let alone_peer = raw.connect(&offer.metadata)?;
    let alone_remote = NixlRemote {
        addr: offer.addr,
        len: export_bytes as u64,
        mem: offer.gpu.map_or(NixlMem::Host, NixlMem::Gpu),
    };
    let region = raw.register_device(&alone_buf, 0..largest)?;

    let torch = torch_peer_copy(seconds, sizes);
    let mut notes = Vec::new();
    if let Err(why) = &torch {
        notes.push(format!("remote: {why}"));
    }
    let mut records = Vec::new();
    for (n, &size) in sizes.iter().enumerate() {
        let spots = (export_bytes / size).max(1) as u64;
        let at = |i: u64| (i % spots) * size as u64;
        let (mut i, mut k) = (0u64, 0u64);
        progress(&format!("gpu_nixl_read {}", human(size)));
        let ours = sustained(seconds, size, || {
            i += 1;
            let r = peer.read_device(&export, at(i), &buf, 0..size);
            r.ok_or_else(|| BenchError::Options("no longer served over NIXL".into()))?
                .map_err(remote)
        })?;
        check(&stream, "gpu_nixl_read", &buf, size, at(i), seed)?;
        let alone = sustained(seconds, size, || {
            k += 1;
            Ok(raw.read_region(&region, 0..size, &alone_peer, &alone_remote, at(k))?)
        })?;
        check(
            &stream,
            "gpu_nixl_alone_read",
            &alone_buf,
            size,
            at(k),
            seed,
        )?;
        progress(&format!("gpu_nixl_write {}", human(size)));
        // Writing the export's own bytes back (those at 0) keeps it checkable.
        peer.read_device(&export, 0, &buf, 0..size)
            .ok_or_else(|| BenchError::Options("no longer served over NIXL".into()))?
            .map_err(remote)?;
        let ours_w = sustained(seconds, size, || {
            let r = peer.write_device(&export, 0, &buf, 0..size);
            r.ok_or_else(|| BenchError::Options("no longer served over NIXL".into()))?
                .map_err(remote)
        })?;
        raw.read_region(&region, 0..size, &alone_peer, &alone_remote, 0)?;
        let alone_w = sustained(seconds, size, || {
            Ok(raw.write_region(&region, 0..size, &alone_peer, &alone_remote, 0)?)
        })?;
        raw.read_region(&region, 0..size, &alone_peer, &alone_remote, 0)?;
        check(&stream, "gpu_nixl_write", &alone_buf, size, 0, seed)?;
        let mut versus = vec![
            ("gpu_nixl_read", ours, "NIXL alone", alone),
            ("gpu_nixl_write", ours_w, "NIXL alone", alone_w),
        ];
        if let Ok(t) = &torch {
            versus.push((
                "gpu_nixl_read",
                ours,
                "torch peer copy, one process",
                t[n] / 1e9,
            ));
        }
        for (case, value, peer, theirs) in versus {
            records.push(Record {
                bytes: size,
                route: "?transport=nixl, GPU memory both ends (UCX cuda_ipc)".into(),
                device: device.clone(),
                ..Record::versus(
                    super::SUITE,
                    (&format!("{case}/{}", human(size)), "bandwidth", "GB/s"),
                    value,
                    peer,
                    theirs,
                    true,
                )
            });
        }
    }
    Ok((records, notes))
}

/// The GPU targets: 1 GiB and more at 0.8x a torch peer copy, 64 KiB at 0.8x NIXL alone.
pub(super) fn targets(records: &[Record]) -> Vec<Target> {
    vec![
        Target::judge(
            "GPU->GPU over NIXL, >= 1 GiB: >= 0.8x a torch peer copy in one process",
            records,
            |r| {
                r.case.starts_with("gpu_nixl_read")
                    && r.bytes >= 1 << 30
                    && r.peer.starts_with("torch")
            },
            |r| r.ratio,
            0.8,
            "x",
        ),
        Target::judge(
            "GPU->GPU over NIXL, 64 KiB: >= 0.8x NIXL alone",
            records,
            |r| r.case.starts_with("gpu_nixl_") && r.bytes == 64 << 10 && r.peer == "NIXL alone",
            |r| r.ratio,
            0.8,
            "x",
        ),
    ]
}
