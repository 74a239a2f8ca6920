//! What gpuio reads from the kernel's files about the machine: NUMA node lists (`0-3,8`),
//! each node's CPU list and meminfo, as `NumaTopology::read_from` finds them in a
//! sysfs-shaped directory.
//!
//! What must hold: a list parses to at most `MAX_CPU_LIST` ids or is refused, within the
//! allocation limit, whatever range it writes; a topology of at most `MAX_NUMA_NODES` nodes
//! is read or is a typed error; a node's memory is counted without overflow.

use crate::Target;
use gpuio_hal::memory::numa::{MAX_CPU_LIST, MAX_NUMA_NODES, NumaTopology, parse_cpu_list};
use std::path::PathBuf;
use std::sync::OnceLock;

pub const TARGET: Target = Target {
    name: "sysfs",
    parses: "NUMA online and CPU lists, node meminfo",
    sources: &["crates/gpuio-hal/src/memory/numa.rs"],
    run,
    seeds,
};

/// The input is the `online` list, node 0's `cpulist` and node 0's `meminfo`, split by NUL
/// bytes.
fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut parts = text.splitn(3, '\0');
    let (online, cpus, meminfo) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    for list in [online, cpus] {
        if let Some(ids) = parse_cpu_list(list) {
            assert!(ids.len() <= MAX_CPU_LIST, "{list:?}: {} ids", ids.len());
        }
    }
    let root = scratch();
    let node0 = root.join("node0");
    std::fs::write(root.join("online"), online).expect("scratch is writable");
    std::fs::write(node0.join("cpulist"), cpus).expect("scratch is writable");
    std::fs::write(node0.join("meminfo"), meminfo).expect("scratch is writable");
    if let Ok(t) = NumaTopology::read_from(&root) {
        assert!(t.nodes.len() <= MAX_NUMA_NODES, "{} nodes", t.nodes.len());
        let _ = (t.online_list(), t.memory_only_nodes());
    }
}

/// A sysfs-shaped directory of this process's own, made once (the fuzzer runs one input after
/// another in one process), in memory where the machine has a tmpfs at /dev/shm: three file
/// writes per input on a disk's file system cost more than the parsing.
fn scratch() -> PathBuf {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let d = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("a scratch directory");
        std::fs::create_dir(d.path().join("node0")).expect("scratch is writable");
        d
    });
    dir.path().to_path_buf()
}

fn seeds() -> Vec<Vec<u8>> {
    [
        "0\x000-15\x00Node 0 MemTotal:       16318412 kB\n",
        "0-1\x000-7,16-23\x00Node 0 MemTotal: 1 kB\n",
        "0,2\x00\x00",
        "0\x0018446744073709551615\x00Node 0 MemTotal: 18446744073709551615 kB\n",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}
