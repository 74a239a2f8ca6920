//! The resource tracker: transfers and bytes in flight per resource, which failover reads to
//! try the least loaded replica first.
//!
//! It counts what it balances: reads from a replicated source (a request with alternate
//! sources), each from the replica it runs on. A single-source transfer has no choice to make
//! and is not counted, which keeps a shared counter off every request's path (the scheduler's
//! per-engine in-flight bytes, [`crate::SchedStats`], cover all requests).

use crate::endpoint::ResourceKey;
use gpuio_hal::sync::MutexExt;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Work in flight on one resource.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Load {
    /// Transfers running.
    pub requests: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Shared, cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct ResourceTracker {
    load: Arc<Mutex<HashMap<ResourceKey, Load>>>,
}

/// Ends a transfer's load when dropped.
#[derive(Debug)]
pub struct LoadGuard {
    tracker: ResourceTracker,
    key: ResourceKey,
    bytes: u64,
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        let mut g = self.tracker.load.lock_unpoisoned();
        if let Some(l) = g.get_mut(&self.key) {
            l.requests -= 1;
            l.bytes -= self.bytes;
            if l.requests == 0 {
                g.remove(&self.key);
            }
        }
    }
}

impl ResourceTracker {
    /// A transfer of `bytes` starts on the resource `key`; it ends when the guard drops.
    pub fn begin(&self, key: ResourceKey, bytes: u64) -> LoadGuard {
        let mut g = self.load.lock_unpoisoned();
        let l = g.entry(key).or_default();
        l.requests += 1;
        l.bytes += bytes;
        LoadGuard {
            tracker: self.clone(),
            key,
            bytes,
        }
    }

    /// The load on `key` now.
    pub fn load(&self, key: ResourceKey) -> Load {
        self.load
            .lock_unpoisoned()
            .get(&key)
            .copied()
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Endpoint, HostMemory};
    use gpuio_hal::{HostAllocOptions, HostBuffer};

    #[test]
    fn load_counts_running_transfers_and_ends_with_them() {
        let mem = HostMemory::new(HostBuffer::alloc(64, &HostAllocOptions::default()).unwrap());
        let (a, b) = (Endpoint::host(&mem, 0).resource(), {
            let other =
                HostMemory::new(HostBuffer::alloc(8, &HostAllocOptions::default()).unwrap());
            Endpoint::host(&other, 0).resource()
        });
        let t = ResourceTracker::default();
        let g1 = t.begin(a, 100);
        let g2 = t.begin(a, 20);
        assert_eq!(
            t.load(a),
            Load {
                requests: 2,
                bytes: 120
            }
        );
        assert_eq!(t.load(b), Load::default());
        drop(g1);
        assert_eq!(
            t.load(a),
            Load {
                requests: 1,
                bytes: 20
            }
        );
        drop(g2);
        assert_eq!(t.load(a), Load::default());
        assert!(
            t.load.lock_unpoisoned().is_empty(),
            "idle resources are forgotten"
        );
    }
}
