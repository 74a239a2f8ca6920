//! How much host memory the machine can back now: a mapping larger than that would only be
//! met by the OOM killer once its pages are touched (host memory is mapped without reserving
//! swap), so allocations past it are refused up front with a typed error instead.

use crate::error::{HalError, Result};
use std::path::Path;

/// Allocations from this size up are checked (smaller ones cannot be the problem, and the
/// check reads a few files).
const CHECKED_FROM: usize = 64 << 20;

/// Refuses `len` bytes of host memory where the machine cannot back them now; `swappable`
/// says whether swap may back them (not for memory that will be pinned).
pub(crate) fn check(len: usize, swappable: bool) -> Result<()> {
    if len < CHECKED_FROM {
        return Ok(());
    }
    match backable_bytes(swappable) {
        Some(available) if len as u64 > available => {
            Err(HalError::HostMemoryExceeded { len, available })
        }
        _ => Ok(()),
    }
}

/// Bytes of host memory the machine can back now: available RAM (plus free swap where
/// `swappable`), from `/proc/meminfo`, within what this process's memory cgroup and each of
/// its ancestors (v2 or v1) have left. `None` where none of it can be read.
pub fn backable_bytes(swappable: bool) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let machine = meminfo.as_deref().and_then(|m| {
        let available = meminfo_kib(m, "MemAvailable:")?;
        let swap = if swappable {
            meminfo_kib(m, "SwapFree:").unwrap_or(0)
        } else {
            0
        };
        Some((available + swap) * 1024)
    });
    match (machine, cgroup_room()) {
        (Some(m), Some(c)) => Some(m.min(c)),
        (m, c) => m.or(c),
    }
}

fn meminfo_kib(meminfo: &str, field: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(field))?;
    line[field.len()..].split_whitespace().next()?.parse().ok()
}

/// The least any memory cgroup from this process's up to the root has left below its limit
/// (`None`: no limit anywhere, or none readable). A limit on a parent (a job, a pod, a slice)
/// binds as much as one on the process's own.
fn cgroup_room() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut least: Option<u64> = None;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (base, limit, usage) = if id == "0" && controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        // The process's group and each ancestor. In a cgroup namespace the process's own
        // group is mounted at the base, and its path is not found below it.
        let mut dir = Path::new(base).join(path.trim_start_matches('/'));
        loop {
            if let Some(room) = limit_minus_usage(&dir, limit, usage) {
                least = Some(least.map_or(room, |l| l.min(room)));
            }
            if dir == Path::new(base) || !dir.pop() {
                break;
            }
        }
    }
    least
}

/// The room under the limit of the group at `dir` (`None`: no limit, or not readable).
fn limit_minus_usage(dir: &Path, limit: &str, usage: &str) -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    // "max" (v2) or a page-rounded i64::MAX (v1): no limit.
    let l = read(limit)?.trim().parse::<u64>().ok()?;
    if l >= 1 << 62 {
        return None;
    }
    Some(l.saturating_sub(read(usage)?.trim().parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_can_back_something_and_not_everything() {
        let n = backable_bytes(true).expect("/proc/meminfo is readable on Linux");
        assert!(n > 0);
        // Without swap no more than with it; the two reads are moments apart on a machine
        // whose free memory moves (a build beside the tests), so within a GiB of churn.
        assert!(backable_bytes(false).unwrap() <= n + (1 << 30));
        assert!(check(1 << 20, true).is_ok());
        let err = check(usize::MAX / 4, false).unwrap_err();
        assert!(matches!(err, HalError::HostMemoryExceeded { .. }), "{err}");
        assert_eq!(err.code(), crate::ErrorCode::NoMem);
        assert_eq!(
            meminfo_kib("MemAvailable:   24124572 kB\n", "MemAvailable:"),
            Some(24124572)
        );
    }
}
