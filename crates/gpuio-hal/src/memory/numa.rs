//! Host NUMA topology, read from sysfs. A CXL memory expander shows up as a NUMA node with
//! memory but no CPUs; that is how gpuio finds CXL pools (`memio://cxl/<pool>?device=N`).

use crate::error::{HalError, Result};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// One NUMA node of the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    /// The kernel's node id.
    pub id: u32,
    /// CPUs of this node (empty for a CPU-less memory node such as a CXL expander).
    pub cpus: Vec<u32>,
    /// Memory on this node in bytes (`MemTotal` of its meminfo).
    pub memory_bytes: u64,
}

impl NumaNode {
    /// A node with memory and no CPUs: a CXL memory expander (or another memory-only tier).
    pub fn is_memory_only(&self) -> bool {
        self.cpus.is_empty() && self.memory_bytes > 0
    }
}

/// The host's NUMA nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaTopology {
    /// Online nodes, in id order. A kernel without NUMA support yields one node 0.
    pub nodes: Vec<NumaNode>,
}

impl NumaTopology {
    /// Reads the topology of this machine.
    pub fn detect() -> Self {
        Self::read_from(Path::new("/sys/devices/system/node")).unwrap_or_else(|_| Self {
            nodes: vec![NumaNode {
                id: 0,
                cpus: (0..std::thread::available_parallelism().map_or(1, |n| n.get() as u32))
                    .collect(),
                memory_bytes: total_memory_bytes(),
            }],
        })
    }

    /// Reads a topology from a sysfs-shaped directory (`online`, `nodeN/cpulist`,
    /// `nodeN/meminfo`).
    pub fn read_from(root: &Path) -> Result<Self> {
        let online = read_trimmed(&root.join("online"))?;
        let ids = parse_cpu_list(&online).ok_or_else(|| {
            HalError::InvalidArgument(format!("unparsable NUMA online list {online:?}"))
        })?;
        // Each node costs two file reads: a list naming more nodes than any kernel has is
        // refused before they are made.
        if ids.len() > MAX_NUMA_NODES {
            return Err(HalError::InvalidArgument(format!(
                "a NUMA online list of {} nodes: no kernel has more than {MAX_NUMA_NODES}",
                ids.len()
            )));
        }
        let nodes = ids
            .into_iter()
            .map(|id| {
                let dir = root.join(format!("node{id}"));
                let cpus = read_trimmed(&dir.join("cpulist"))
                    .ok()
                    .and_then(|s| parse_cpu_list(&s))
                    .unwrap_or_default();
                let memory_bytes = std::fs::read_to_string(dir.join("meminfo"))
                    .ok()
                    .and_then(|s| meminfo_total(&s))
                    .unwrap_or(0);
                NumaNode {
                    id,
                    cpus,
                    memory_bytes,
                }
            })
            .collect();
        Ok(Self { nodes })
    }

    /// The node with this id.
    pub fn node(&self, id: u32) -> Result<&NumaNode> {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .ok_or_else(|| HalError::NoSuchNumaNode {
                node: id,
                online: self.online_list(),
            })
    }

    /// Memory-only nodes (CXL expanders), in id order: `memio://cxl/<pool>?device=N` is the
    /// N-th of these.
    pub fn memory_only_nodes(&self) -> Vec<&NumaNode> {
        self.nodes.iter().filter(|n| n.is_memory_only()).collect()
    }

    /// The online node ids as a short list, e.g. `0,1`.
    pub fn online_list(&self) -> String {
        let ids: Vec<String> = self.nodes.iter().map(|n| n.id.to_string()).collect();
        ids.join(",")
    }
}

fn read_trimmed(path: &PathBuf) -> Result<String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| HalError::Os {
            op: "read NUMA topology",
            source,
        })
}

/// The most ids a CPU or node list may hold: the kernel's own limit on CPUs (`NR_CPUS` is at
/// most 8192) with room to spare. A list naming more is not the kernel's.
pub const MAX_CPU_LIST: usize = 1 << 16;

/// The most NUMA nodes a kernel has (`CONFIG_NODES_SHIFT` is at most 10).
pub const MAX_NUMA_NODES: usize = 1 << 10;

/// Parses the kernel's list format: `0-3,8,10-11`. An empty string is an empty list; a list
/// of more than [`MAX_CPU_LIST`] ids is refused.
pub fn parse_cpu_list(s: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
                if a > b || (b - a) as usize >= MAX_CPU_LIST - out.len() {
                    return None;
                }
                out.extend(a..=b);
            }
            None if out.len() < MAX_CPU_LIST => out.push(part.parse().ok()?),
            None => return None,
        }
    }
    Some(out)
}

fn meminfo_total(s: &str) -> Option<u64> {
    // "Node 0 MemTotal:       16318412 kB"
    let line = s.lines().find(|l| l.contains("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().rev().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

fn total_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| meminfo_total(&s))
        .unwrap_or(0)
}

/// The transparent-huge-page mode of the kernel (`always`, `madvise` or `never`), if known.
pub fn transparent_huge_pages() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let start = s.find('[')?;
    let end = s[start..].find(']')?;
    Some(s[start + 1..start + end].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8"), Some(vec![0, 1, 2, 3, 8]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    /// Found by fuzzing: `0-4294967295` asked for 16 GiB, and a MemTotal near `u64::MAX` kB
    /// overflowed.
    #[test]
    fn lists_and_sizes_the_kernel_cannot_mean_are_refused() {
        assert_eq!(parse_cpu_list("0-4294967295"), None);
        assert_eq!(parse_cpu_list("0-65534,1-3"), None);
        assert_eq!(
            parse_cpu_list("0-65535").map(|l| l.len()),
            Some(MAX_CPU_LIST)
        );
        assert_eq!(
            meminfo_total("Node 0 MemTotal: 18446744073709551615 kB"),
            None
        );
        assert_eq!(meminfo_total("Node 0 MemTotal: 4 kB"), Some(4096));
    }

    #[test]
    fn reads_a_sysfs_tree_with_a_cpu_less_node() {
        let dir = std::env::temp_dir().join(format!("gpuio-numa-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("node0")).unwrap();
        std::fs::create_dir_all(dir.join("node1")).unwrap();
        std::fs::write(dir.join("online"), "0-1\n").unwrap();
        std::fs::write(dir.join("node0/cpulist"), "0-7\n").unwrap();
        std::fs::write(dir.join("node0/meminfo"), "Node 0 MemTotal:  1024 kB\n").unwrap();
        std::fs::write(dir.join("node1/cpulist"), "\n").unwrap();
        std::fs::write(dir.join("node1/meminfo"), "Node 1 MemTotal:  2048 kB\n").unwrap();
        let t = NumaTopology::read_from(&dir).unwrap();
        assert_eq!(t.nodes.len(), 2);
        assert!(!t.nodes[0].is_memory_only());
        assert!(t.nodes[1].is_memory_only());
        assert_eq!(t.nodes[1].memory_bytes, 2048 * 1024);
        assert_eq!(t.memory_only_nodes()[0].id, 1);
        assert!(matches!(
            t.node(5),
            Err(HalError::NoSuchNumaNode { node: 5, .. })
        ));
        // Found by fuzzing: an online list of thousands of nodes cost two file reads each
        // (slow enough, on a loaded machine, to pass the fuzzer's hang limit).
        std::fs::write(
            dir.join("online"),
            "0-1024
",
        )
        .unwrap();
        assert!(matches!(
            NumaTopology::read_from(&dir),
            Err(HalError::InvalidArgument(_))
        ));
        std::fs::write(
            dir.join("online"),
            "0-1023
",
        )
        .unwrap();
        assert_eq!(
            NumaTopology::read_from(&dir).unwrap().nodes.len(),
            MAX_NUMA_NODES
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn this_machine_has_a_node() {
        let t = NumaTopology::detect();
        assert!(!t.nodes.is_empty());
    }
}
