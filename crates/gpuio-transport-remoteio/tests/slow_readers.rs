//! Keys whose sessions ask for large file reads and never read the answers: another key's
//! reads must still be served at once, and the agent's memory must stay within its
//! `buffer_memory` while they wait and come back down after they leave.
//!
//! A test binary of its own, not a module of `tests/it`: it samples this process's resident
//! memory (`/proc/self/status`), which other tests running beside it in one process would
//! move.

use gpuio_hal::pattern;
use gpuio_transport_remoteio::wire::Message;
use gpuio_transport_remoteio::{
    Access, Agent, AgentConfig, Connection, Credentials, Export, ExportSource, Key, Role,
};
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"f3a9c1e7b5d20486a4c8e2f6b0d9a7c35e1f8b4d6a2c0e9f7b3d5a1c8e6f4b20";
const FILE_LEN: usize = 16 << 20;
const BUDGET: usize = 64 << 20;
const READERS: usize = 4;
const SESSIONS: usize = 8;

fn rss_mib() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap_or(0)
        >> 10
}

fn creds(id: &str) -> Credentials {
    Credentials {
        key_id: id.into(),
        secret: SECRET.to_vec(),
    }
}

#[test]
fn readers_that_never_read_hold_neither_the_budget_nor_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.bin");
    let mut bytes = vec![0u8; FILE_LEN];
    pattern::fill(&mut bytes, 0, 21);
    std::fs::write(&path, &bytes).unwrap();
    drop(bytes);
    let mut cfg = AgentConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.keys = (0..=READERS)
        .map(|k| Key {
            id: format!("r{k}"),
            secret: SECRET.to_vec(),
            role: Role::ReadOnly,
        })
        .collect();
    cfg.exports = vec![Export {
        name: "weights".into(),
        source: ExportSource::File {
            path: path.clone(),
            max_len: None,
        },
        access: Access::ReadOnly,
    }];
    cfg.buffer_memory = BUDGET;
    cfg.io_timeout = Duration::from_secs(30);
    let agent = Agent::start(cfg).unwrap();
    let addr = agent.local_addr();
    let t = Duration::from_secs(10);
    // The good client's buffer and a first read, before the baseline.
    let mut got = vec![0u8; FILE_LEN];
    let mut good = Connection::connect(addr, &creds(&format!("r{READERS}")), t).unwrap();
    good.read("weights", 0, &mut got, FILE_LEN).unwrap();
    let before = rss_mib();
    // Four read-only keys, eight sessions each, each with four 16 MiB reads in flight that
    // it never reads.
    let mut stalled = Vec::new();
    for k in 0..READERS {
        for _ in 0..SESSIONS {
            let mut c = Connection::connect(addr, &creds(&format!("r{k}")), t).unwrap();
            for id in 1..=4u64 {
                let req = Message::ReadReq {
                    export: "weights".into(),
                    offset: 0,
                    len: FILE_LEN as u64,
                };
                c.send_raw(&req.encode(id)).unwrap();
            }
            stalled.push(c);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    got.fill(0);
    good.read("weights", 0, &mut got, FILE_LEN).unwrap();
    let waited = started.elapsed();
    assert_eq!(pattern::first_deviation(&got, 0, 21), None);
    let during = rss_mib();
    drop(stalled);
    std::thread::sleep(Duration::from_secs(1));
    let after = rss_mib();
    eprintln!(
        "a 16 MiB read beside {} stalled sessions took {waited:?}; RSS {before} -> {during} -> \
         {after} MiB (budget {} MiB)",
        READERS * SESSIONS,
        BUDGET >> 20
    );
    assert!(
        waited < Duration::from_secs(3),
        "another key's read waited {waited:?} behind readers that never read"
    );
    // Within the budget, plus 16 MiB for the runtime's own.
    assert!(
        during <= before + (BUDGET >> 20) + 16,
        "{before} -> {during} MiB"
    );
    assert!(
        after <= before + 16,
        "{before} -> {after} MiB once they left"
    );
}
