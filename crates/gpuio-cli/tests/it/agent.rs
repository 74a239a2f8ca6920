//! `gpuio agent` as a stranger, a careless client and a crashing supervisor would meet it: a
//! real agent process on loopback, attacked without a key (floods of silent sockets, oversized
//! HELLOs) while a good client must keep being served within a second and the agent's memory
//! stays bounded; restarted mid-copy (a copy must fail, never finish with the new instance's
//! zeros); too small for what is written to it; sized past what the machine can back.

use crate::common;

use common::bin;
use gpuio_api::{Access, Config, ErrorCode, Resource, Session, Uri};
use gpuio_hal::pattern;
use gpuio_transport_remoteio::{Credentials, PeerConfig, RemoteExport, RemotePeer};
use std::io::{BufRead, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "9f3c2a7e51b04d8e6a1f0c3b7d2e94a8c5f61b0e3d7a2c9f4e8b1d6a0c3f5e72";
const EXPORT: usize = 32 << 20;
const SEED: u64 = 77;

/// A `gpuio agent` process, killed when dropped.
struct AgentProc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl AgentProc {
    /// Resident memory of the agent, in KiB.
    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }
}

/// A loopback port free now, for an agent that must come back on the same one: another process may
/// take it before the agent binds it, so agents that need no fixed port listen on port 0.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes the agent's configuration: a read-write key, a read-write memory export `mem` of
/// [`EXPORT`] bytes, and `extra` TOML lines under `[agent]`.
fn agent_config(dir: &Path, port: u16, extra: &str) -> PathBuf {
    let cfg = dir.join(format!("agent-{port}.toml"));
    std::fs::write(
        &cfg,
        format!(
            r#"
[agent]
listen = "127.0.0.1:{port}"
{extra}
[[agent.keys]]
id = "ops"
role = "read-write"
secret_env = "GPUIO_TEST_SECRET"
[[agent.exports]]
name = "mem"
access = "read-write"
memory = "{EXPORT}"
"#
        ),
    )
    .unwrap();
    cfg
}

/// Starts `gpuio agent` with `cfg` and waits for it to listen.
fn start_agent(cfg: &Path) -> AgentProc {
    let (child, addr, out) = common::spawn_agent(cfg, &[("GPUIO_TEST_SECRET", SECRET)]);
    // Keep draining its output so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in out.lines() {});
    AgentProc { child, addr }
}

fn creds() -> Credentials {
    Credentials {
        key_id: "ops".into(),
        secret: SECRET.as_bytes().to_vec(),
    }
}

fn peer(addr: SocketAddr) -> RemotePeer {
    let mut cfg = PeerConfig::new(addr, creds());
    cfg.timeout = Duration::from_secs(5);
    RemotePeer::new(cfg)
}

/// Fills the export with the test pattern.
fn fill(addr: SocketAddr) {
    let mut data = vec![0u8; EXPORT];
    pattern::fill(&mut data, 0, SEED);
    peer(addr)
        .write(&RemoteExport::new("mem"), 0, &data)
        .unwrap();
}

/// A good client's round: a fresh connection, a 1 MiB read checked byte for byte. Its time.
fn good_round(addr: SocketAddr, i: u64) -> Duration {
    let t = Instant::now();
    let p = peer(addr);
    let mut buf = vec![0u8; 1 << 20];
    let at = (i * 3 % 31) << 20;
    p.read(&RemoteExport::new("mem"), at, &mut buf)
        .unwrap_or_else(|e| panic!("round {i}: {e}"));
    assert_eq!(pattern::first_deviation(&buf, at, SEED), None);
    t.elapsed()
}

/// Connects from `source` (any 127/8 address is this host) to `to`, without a handshake.
async fn stranger(source: [u8; 4], to: SocketAddr) -> Option<tokio::net::TcpStream> {
    let s = tokio::net::TcpSocket::new_v4().ok()?;
    s.bind(SocketAddr::from((source, 0))).ok()?;
    s.connect(to).await.ok()
}

/// Floods `to`: first `big` sockets that declare a 16 MiB HELLO and send 1 MiB of it (from
/// 127.0.0.3: an agent that buffered what a stranger declares would hold 250 MiB of it), then
/// `silent` sockets that say nothing (from 127.0.0.2, and every fourth from 127.0.0.1, the
/// good client's own address). Once all are open it says so on `ready`, then reconnects the
/// silent ones round-robin for `churn`. Returns the connections it opened.
fn flood(
    to: SocketAddr,
    silent: usize,
    big: usize,
    churn: Duration,
    ready: std::sync::mpsc::Sender<()>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut hello = gpuio_transport_remoteio::wire::Header {
                msg_type: gpuio_transport_remoteio::wire::MsgType::Hello,
                flags: 0,
                request_id: 0,
                payload_len: 16 << 20,
            }
            .encode()
            .to_vec();
            hello.extend_from_slice(&vec![0x41; 1 << 20]);
            let mut held = Vec::new();
            for _ in 0..big {
                if let Some(mut s) = stranger([127, 0, 0, 3], to).await {
                    use tokio::io::AsyncWriteExt;
                    // The agent may stop reading (it should): then the write just gives up.
                    let _ = tokio::time::timeout(Duration::from_secs(1), s.write_all(&hello)).await;
                    held.push(s);
                }
            }
            let mut silent_socks = Vec::with_capacity(silent);
            let mut opened = 0u64;
            let mut i = 0usize;
            let mut until = None;
            while until.is_none_or(|t| Instant::now() < t) {
                let source = if i.is_multiple_of(4) {
                    [127, 0, 0, 1]
                } else {
                    [127, 0, 0, 2]
                };
                if let Some(s) = stranger(source, to).await {
                    opened += 1;
                    if silent_socks.len() < silent {
                        silent_socks.push(s);
                    } else {
                        silent_socks[i % silent] = s;
                    }
                }
                i += 1;
                if until.is_none() && silent_socks.len() == silent {
                    let _ = ready.send(());
                    until = Some(Instant::now() + churn);
                }
                if i.is_multiple_of(200) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            drop(held);
            opened
        })
    })
}

#[test]
fn keyless_floods_never_deny_a_good_client_and_memory_stays_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let agent = start_agent(&agent_config(dir.path(), 0, ""));
    fill(agent.addr);
    good_round(agent.addr, 0);
    let before = agent.rss_kib();
    // Long enough for ten good rounds even on a loaded two-core machine (~300 ms each).
    let churn = Duration::from_secs(5);
    let (ready, flooding) = std::sync::mpsc::channel();
    let attack = flood(agent.addr, 1500, 250, churn, ready);
    flooding
        .recv_timeout(Duration::from_secs(60))
        .expect("the flood never reached 1500 sockets");
    let until = Instant::now() + churn - Duration::from_millis(300);
    let mut worst = Duration::ZERO;
    let mut rounds = 0;
    while Instant::now() < until {
        worst = worst.max(good_round(agent.addr, rounds));
        rounds += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let during = agent.rss_kib();
    let opened = attack.join().unwrap();
    eprintln!(
        "flood: {opened} connections; {rounds} good rounds, worst {worst:?}; agent RSS \
         {before} -> {during} KiB"
    );
    assert!(rounds >= 10, "only {rounds} good rounds ran");
    assert!(
        worst < Duration::from_secs(1),
        "a good client waited {worst:?} under the flood"
    );
    // 250 declared 16 MiB HELLOs would be 4 GiB if buffered; pre-auth messages are capped.
    assert!(
        during < before + (64 << 10),
        "the agent grew from {before} KiB to {during} KiB under the flood"
    );
    good_round(agent.addr, 99);
}

#[test]
fn a_copy_that_spans_an_agent_restart_fails_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = agent_config(dir.path(), port, "");
    let agent = start_agent(&cfg);
    fill(agent.addr);
    // Reading: the first window from the first instance, the rest would be the new one's zeros.
    let session = client_session(dir.path());
    let src = Uri::parse(&format!("remoteio://127.0.0.1:{port}/mem")).unwrap();
    let Resource::Remote(replicas) = session.open(&src, 0, Access::Read).unwrap() else {
        panic!("not remote");
    };
    let (p, export) = (replicas[0].peer(), replicas[0].export());
    let mut first = vec![0u8; 4 << 20];
    p.read(export, 0, &mut first).unwrap();
    assert_eq!(pattern::first_deviation(&first, 0, SEED), None);
    drop(agent);
    let again = start_agent(&cfg);
    let mut rest = vec![0u8; 4 << 20];
    let err = p.read(export, 4 << 20, &mut rest).unwrap_err();
    assert!(err.to_string().contains("restarted"), "{err}");
    assert_eq!(err.code(), ErrorCode::Io);
    // Writing: nothing reaches the new instance.
    let data = vec![0x5au8; 1 << 20];
    assert!(p.write(export, 0, &data).is_err());
    let mut probe = vec![1u8; 1 << 20];
    peer(again.addr)
        .read(&RemoteExport::new("mem"), 0, &mut probe)
        .unwrap();
    assert!(
        probe.iter().all(|&b| b == 0),
        "the new instance was written"
    );
    // A resource opened again meets the new instance.
    let Resource::Remote(fresh) = session.open(&src, 0, Access::Read).unwrap() else {
        panic!("not remote");
    };
    fresh[0]
        .peer()
        .read(fresh[0].export(), 0, &mut probe)
        .unwrap();

    // `gpuio cp` while the agent is killed and restarted as a supervisor would: it fails
    // non-zero and leaves no destination, or (if it finished first) the bytes are whole.
    fill(again.addr);
    drop(again);
    let mut agent = start_agent(&cfg);
    fill(agent.addr);
    let out = dir.path().join("out.bin");
    let mut interrupted = 0;
    for round in 0..5u64 {
        let cp = Command::new(bin())
            .args([
                "--config",
                client_config(dir.path(), port).to_str().unwrap(),
            ])
            .args(["cp", "-q", "--window", "256KiB"])
            .arg(format!("remoteio://127.0.0.1:{port}/mem"))
            .arg(&out)
            .env("GPUIO_TEST_SECRET", SECRET)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Once the copy is under way (its partial file exists: it has met the first
        // instance), at a moment that differs by round.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !has_partial(dir.path()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(3 * round));
        drop(agent);
        agent = start_agent(&cfg);
        let done = cp.wait_with_output().unwrap();
        if done.status.success() {
            // Whole from one instance: the first one's pattern, or (if the copy began after
            // the restart) the new one's zeros; never a mix.
            let got = std::fs::read(&out).unwrap();
            assert_eq!(got.len(), EXPORT);
            let first = pattern::first_deviation(&got, 0, SEED).is_none();
            let second = got.iter().all(|&b| b == 0);
            assert!(first || second, "exit 0 with bytes of two instances");
            std::fs::remove_file(&out).unwrap();
        } else {
            interrupted += 1;
            assert!(!out.exists(), "a failed copy left its destination");
            let text = String::from_utf8_lossy(&done.stderr);
            assert!(
                text.contains("restarted") || text.contains("network"),
                "{text}"
            );
        }
        fill(agent.addr);
    }
    eprintln!("{interrupted} of 5 copies were caught by a restart");
    assert!(interrupted > 0, "no copy was caught by a restart");
    assert_no_partials(dir.path());

    // An agent that does not come back: "connection refused", not a timeout.
    drop(agent);
    let o = Command::new(bin())
        .args([
            "--config",
            client_config(dir.path(), port).to_str().unwrap(),
        ])
        .args(["cp", "-q"])
        .arg(format!("remoteio://127.0.0.1:{port}/mem"))
        .arg(&out)
        .env("GPUIO_TEST_SECRET", SECRET)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(7), "{text}");
    assert!(text.contains("refused"), "{text}");
}

fn has_partial(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().ends_with(".gpuio-partial"))
}

fn assert_no_partials(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".gpuio-partial"))
        .collect();
    assert!(left.is_empty(), "partial files left: {left:?}");
}

/// A client configuration naming the key (its secret from the environment).
fn client_config(dir: &Path, port: u16) -> PathBuf {
    let p = dir.join(format!("client-{port}.toml"));
    std::fs::write(
        &p,
        "[remote]\nkey_id = \"ops\"\nsecret_env = \"GPUIO_TEST_SECRET\"\ntimeout_ms = 2000\n",
    )
    .unwrap();
    p
}

/// A library session holding the key (its secret in a file only its owner may read).
fn client_session(dir: &Path) -> Session {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("secret");
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(SECRET.as_bytes()))
        .unwrap();
    let mut config = Config::default();
    config.remote.key_id = "ops".into();
    config.remote.secret_file = path.display().to_string();
    Session::new(config).unwrap()
}

#[test]
fn a_copy_too_large_for_a_remote_export_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let agent = start_agent(&agent_config(dir.path(), 0, ""));
    let port = agent.addr.port();
    fill(agent.addr);
    let big = dir.path().join("big.bin");
    std::fs::File::create(&big)
        .unwrap()
        .write_all(&vec![0xeeu8; EXPORT + 4096])
        .unwrap();
    let o = Command::new(bin())
        .args([
            "--config",
            client_config(dir.path(), port).to_str().unwrap(),
        ])
        .args(["cp", "-q", "--window", "1MiB"])
        .arg(&big)
        .arg(format!("remoteio://127.0.0.1:{port}/mem"))
        .env("GPUIO_TEST_SECRET", SECRET)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{text}");
    assert!(text.contains("does not fit"), "{text}");
    assert_untouched(agent.addr);
}

/// Asserts the agent's memory export still holds what [`fill`] wrote.
fn assert_untouched(addr: SocketAddr) {
    let mut back = vec![0u8; EXPORT];
    peer(addr)
        .read(&RemoteExport::new("mem"), 0, &mut back)
        .unwrap();
    assert_eq!(
        pattern::first_deviation(&back, 0, SEED),
        None,
        "the export was written"
    );
}

#[test]
fn remote_copies_are_durable_where_they_can_be_and_refused_where_not() {
    let Some(fs) = gpuio_testkit::Tmpfs::mount("4m") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let disk = fs.path().join("disk.bin");
    let mut old = vec![0u8; 1 << 20];
    pattern::fill(&mut old, 0, SEED);
    std::fs::write(&disk, &old).unwrap();
    let cfg = agent_config(dir.path(), 0, "");
    // A file export that may grow to 64 MiB, on a file system of 4.
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str(&format!(
        "[[agent.exports]]\nname = \"disk\"\naccess = \"read-write\"\nfile = \"{}\"\n\
         max_size = \"64MiB\"\n",
        disk.display()
    ));
    std::fs::write(&cfg, text).unwrap();
    let agent = start_agent(&cfg);
    let port = agent.addr.port();
    fill(agent.addr);
    let cp = |args: &[&str], src: &Path, export: &str| {
        let o = Command::new(bin())
            .args([
                "--config",
                client_config(dir.path(), port).to_str().unwrap(),
            ])
            .args(["cp", "-q"])
            .args(args)
            .arg(src)
            .arg(format!("remoteio://127.0.0.1:{port}/{export}"))
            .env("GPUIO_TEST_SECRET", SECRET)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let write = |name: &str, len: usize| {
        let p = dir.path().join(name);
        std::fs::write(&p, vec![0x3cu8; len]).unwrap();
        p
    };
    // Memory starts afresh when its agent restarts: --durable is refused before a byte.
    let (code, text) = cp(&["--durable"], &write("small.bin", 1 << 20), "mem");
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("starts afresh"), "{text}");
    assert_untouched(agent.addr);
    // 16 MiB fit the export's bound but not its disk: refused whole, the file untouched.
    let (code, text) = cp(&[], &write("big.bin", 16 << 20), "disk");
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("the disk cannot hold it"), "{text}");
    assert!(
        std::fs::read(&disk).unwrap() == old,
        "the export was overwritten"
    );
    // What fits is copied, and made durable.
    let (code, text) = cp(&["--durable"], &write("fits.bin", 2 << 20), "disk");
    assert_eq!(code, Some(0), "{text}");
    assert!(std::fs::read(&disk).unwrap() == vec![0x3cu8; 2 << 20]);
}

#[test]
fn an_agent_out_of_descriptors_answers_busy() {
    let dir = tempfile::tempdir().unwrap();
    let agent = start_agent(&agent_config(dir.path(), 0, ""));
    let t = Duration::from_secs(5);
    let mut held =
        vec![gpuio_transport_remoteio::Connection::connect(agent.addr, &creds(), t).unwrap()];
    // Descriptors run out a few connections from now: new ones take the lowest free
    // numbers, and four are left below the limit. The set is read once it has stopped
    // changing: on a loaded machine the agent's threads may still be opening theirs.
    let pid = agent.child.id();
    let fds = || -> std::collections::BTreeSet<u32> {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect()
    };
    let mut open = fds();
    let settle = Instant::now() + Duration::from_secs(5);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = fds();
        if now == open || Instant::now() > settle {
            break;
        }
        open = now;
    }
    let first_free = (0..).find(|n| !open.contains(n)).unwrap();
    let limit = format!("--nofile={0}:{0}", first_free + 4);
    let ok = Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &limit])
        .status()
        .unwrap();
    assert!(ok.success(), "prlimit failed");
    let mut busy = None;
    for _ in 0..64 {
        let started = Instant::now();
        match gpuio_transport_remoteio::Connection::connect(agent.addr, &creds(), t) {
            Ok(c) => held.push(c),
            Err(e) => {
                busy = Some((e, started.elapsed()));
                break;
            }
        }
    }
    let (e, took) = busy.expect("descriptors never ran out");
    eprintln!("refused after {} sessions: {e}", held.len());
    assert_eq!(e.code(), ErrorCode::Busy, "{e}");
    assert!(took < Duration::from_secs(2), "refused after {took:?}");
    // Sessions that end give their descriptors back.
    held.truncate(1);
    let deadline = Instant::now() + Duration::from_secs(5);
    while gpuio_transport_remoteio::Connection::connect(agent.addr, &creds(), t).is_err() {
        assert!(Instant::now() < deadline, "the agent never recovered");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_does_not_wait_for_a_stalled_client() {
    let dir = tempfile::tempdir().unwrap();
    let mut agent = start_agent(&agent_config(dir.path(), 0, ""));
    let t = Duration::from_secs(5);
    let mut c = gpuio_transport_remoteio::Connection::connect(agent.addr, &creds(), t).unwrap();
    // A write of 8 MiB whose data stops after 1 KiB: the agent waits for the rest, up to
    // its io_timeout (30 s).
    let head = gpuio_transport_remoteio::wire::write_req_head(1, "mem", 0, 8 << 20);
    c.send_raw(&head).unwrap();
    c.send_raw(&[7u8; 1024]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let pid = agent.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let started = Instant::now();
    while agent.child.try_wait().unwrap().is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the agent still runs after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c);
}
