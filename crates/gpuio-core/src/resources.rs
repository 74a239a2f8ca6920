//! The resource tracker: what gpuio holds and has in flight, per resource — requests and bytes
//! in flight per device or file (which the transport manager balances on), and memory held
//! per pool (pinned staging, GPU cache arenas). The scheduler adds in-flight bytes per engine
//! and queue depth ([`crate::SchedStats`]).

use gpuio_hal::sync::MutexExt;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Work in flight on one resource.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Load {
    /// Transfers running.
    pub requests: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// A snapshot of everything tracked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ResourceReport {
    /// Load per resource (e.g. `file:/data/a.bin`, `gpu0`).
    pub load: BTreeMap<String, Load>,
    /// Bytes held per memory pool (e.g. `pinned staging`, `gpu0 cache`).
    pub memory: BTreeMap<String, u64>,
}

#[derive(Debug, Default)]
struct Inner {
    load: BTreeMap<String, Load>,
    memory: BTreeMap<String, u64>,
}

/// Shared, cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct ResourceTracker {
    inner: Arc<Mutex<Inner>>,
}

/// Ends a transfer's load when dropped.
#[derive(Debug)]
pub struct LoadGuard {
    tracker: ResourceTracker,
    name: String,
    bytes: u64,
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        let mut g = self.tracker.inner.lock_unpoisoned();
        if let Some(l) = g.load.get_mut(&self.name) {
            l.requests -= 1;
            l.bytes -= self.bytes;
            if l.requests == 0 {
                g.load.remove(&self.name);
            }
        }
    }
}

impl ResourceTracker {
    /// A transfer of `bytes` starts on `name`.
    pub fn begin(&self, name: String, bytes: u64) -> LoadGuard {
        let mut g = self.inner.lock_unpoisoned();
        let l = g.load.entry(name.clone()).or_default();
        l.requests += 1;
        l.bytes += bytes;
        LoadGuard {
            tracker: self.clone(),
            name,
            bytes,
        }
    }

    /// The load on `name` now.
    pub fn load(&self, name: &str) -> Load {
        self.inner
            .lock_unpoisoned()
            .load
            .get(name)
            .copied()
            .unwrap_or_default()
    }

    /// Sets the bytes a memory pool holds.
    pub fn set_memory(&self, pool: &str, bytes: u64) {
        let mut g = self.inner.lock_unpoisoned();
        if bytes == 0 {
            g.memory.remove(pool);
        } else {
            g.memory.insert(pool.to_string(), bytes);
        }
    }

    /// Adds to (or, negative, takes from) the bytes a memory pool holds.
    pub fn add_memory(&self, pool: &str, delta: i64) {
        let mut g = self.inner.lock_unpoisoned();
        let v = g.memory.entry(pool.to_string()).or_default();
        *v = v.saturating_add_signed(delta);
        if *v == 0 {
            g.memory.remove(pool);
        }
    }

    /// Everything tracked.
    pub fn report(&self) -> ResourceReport {
        let g = self.inner.lock_unpoisoned();
        ResourceReport {
            load: g.load.clone(),
            memory: g.memory.clone(),
        }
    }
}
