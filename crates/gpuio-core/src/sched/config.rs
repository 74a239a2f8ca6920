//! The scheduler's settings (`SchedulerConfig`, the `[scheduler]` section of the
//! configuration) and a session's (`SessionOptions`).

use super::queue::{Policy, QueueConfig};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The scheduler's settings (the `[scheduler]` section of the configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// Worker threads.
    pub workers: usize,
    /// Ordering policy.
    pub policy: Policy,
    /// Starvation bound: a class waiting this long while others run goes next.
    #[serde(with = "micros")]
    pub max_wait: Duration,
    /// Less urgent leases wait this long after a more urgent class's last lease ends, for
    /// its next one (a decode step's next layer) to find the bus free.
    #[serde(with = "micros")]
    pub lease_linger: Duration,
    /// ADAPTIVE: deadlines closer than this are served first.
    #[serde(with = "micros")]
    pub urgent_window: Duration,
    /// Requests larger than this are queued as chunks of this size (preemption points).
    pub chunk_size: usize,
    /// Bytes admitted and not yet completed, per engine.
    pub engine_in_flight: u64,
    /// Bytes admitted and not yet completed, per session.
    pub session_in_flight: u64,
    /// A worker takes units from the shared queue until they add up to this many bytes.
    pub grab_bytes: u64,
    /// Adjacent small requests are merged into transfers of at most this size.
    pub coalesce_max: usize,
    /// How long an idle worker spins before it sleeps.
    #[serde(with = "micros")]
    pub spin: Duration,
}

mod micros {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_micros() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_micros)
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        let q = QueueConfig::default();
        Self {
            workers: 4,
            policy: q.policy,
            max_wait: q.max_wait,
            lease_linger: Duration::from_micros(50),
            urgent_window: q.urgent_window,
            chunk_size: 1 << 20,
            engine_in_flight: 8 << 30,
            session_in_flight: 2 << 30,
            grab_bytes: 256 << 10,
            coalesce_max: 1 << 20,
            spin: Duration::from_micros(50),
        }
    }
}

/// How a session shares the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionOptions {
    /// Fair-share weight against other sessions of the same class (≥ 1).
    pub weight: u32,
    /// Bytes this session may have in flight (default: the scheduler's `session_in_flight`).
    pub max_in_flight: Option<u64>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            weight: 1,
            max_in_flight: None,
        }
    }
}
