//! How much host memory the machine can back now: a mapping larger than that would only be
//! met by the OOM killer once its pages are touched (host memory is mapped without reserving
//! swap), so allocations past it are refused up front with a typed error instead.

use crate::error::{HalError, Result};
use std::path::Path;

/// Allocations from this size up are checked (smaller ones cannot be the problem, and the
/// check reads a few files).
const CHECKED_FROM: usize = 64 << 20;

/// Refuses `len` bytes of host memory where the machine cannot back them now.
pub(crate) fn check(len: usize) -> Result<()> {
    if len < CHECKED_FROM {
        return Ok(());
    }
    match backable_bytes() {
        Some(available) if len as u64 > available => {
            Err(HalError::HostMemoryExceeded { len, available })
        }
        _ => Ok(()),
    }
}

/// Bytes of host memory the machine can back now: available RAM plus free swap
/// (`/proc/meminfo`), within what this process's memory cgroup (v2 or v1) has left. `None`
/// where none of it can be read.
pub fn backable_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let machine = meminfo.as_deref().and_then(|m| {
        let available = meminfo_kib(m, "MemAvailable:")?;
        Some((available + meminfo_kib(m, "SwapFree:").unwrap_or(0)) * 1024)
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

/// What this process's memory cgroup has left below its limit (`None`: no limit, or none
/// readable).
fn cgroup_room() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        let room = if id == "0" && controllers.is_empty() {
            // v2: the unified hierarchy.
            let dirs = [
                Path::new("/sys/fs/cgroup").join(path),
                "/sys/fs/cgroup".into(),
            ];
            limit_minus_usage(&dirs, "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            let dirs = [
                Path::new("/sys/fs/cgroup/memory").join(path),
                "/sys/fs/cgroup/memory".into(),
            ];
            limit_minus_usage(&dirs, "memory.limit_in_bytes", "memory.usage_in_bytes")
        } else {
            continue;
        };
        if room.is_some() {
            return room;
        }
    }
    None
}

/// The room under the limit in the first of `dirs` that has both files (a cgroup namespace
/// mounts the process's own cgroup at the root, so its path may not appear).
fn limit_minus_usage(dirs: &[std::path::PathBuf], limit: &str, usage: &str) -> Option<u64> {
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    for dir in dirs {
        let (Some(l), Some(u)) = (read(dir.join(limit)), read(dir.join(usage))) else {
            continue;
        };
        // "max" (v2) or a page-rounded i64::MAX (v1): no limit.
        let Ok(l) = l.trim().parse::<u64>() else {
            return None;
        };
        if l >= 1 << 62 {
            return None;
        }
        return Some(l.saturating_sub(u.trim().parse().ok()?));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_can_back_something_and_not_everything() {
        let n = backable_bytes().expect("/proc/meminfo is readable on Linux");
        assert!(n > 0);
        assert!(check(1 << 20).is_ok());
        let err = check(usize::MAX / 4).unwrap_err();
        assert!(matches!(err, HalError::HostMemoryExceeded { .. }), "{err}");
        assert_eq!(err.code(), crate::ErrorCode::NoMem);
        assert_eq!(
            meminfo_kib("MemAvailable:   24124572 kB\n", "MemAvailable:"),
            Some(24124572)
        );
    }
}
