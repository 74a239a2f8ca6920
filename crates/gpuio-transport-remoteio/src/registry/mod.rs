//! The multi-node registry on etcd (docs/REFERENCE.md#multi-node-registry): agents register the
//! segments they serve under leases they keep alive; clients resolve a segment name to the agents
//! serving it.
//!
//! Layout: `<prefix>/segments/<segment>/<agent-id>` → the agent's `host:port`, attached to
//! the agent's lease; `<prefix>/nixl/<agent-id>/<export>` → a published export's NIXL
//! description (one JSON line; opt-in, `[agent] nixl_publish`), under a lease of its own. An agent that dies stops renewing its lease, and etcd removes its keys
//! when the lease's TTL runs out; one that stops cleanly revokes the lease at once.
//!
//! The API is blocking: the registry runs its own small tokio runtime, on which the lease
//! keep-alive of every registration runs in the background.
//!
//! [`RegistryConfig`] and [`SegmentMember`] are always here; the etcd client (`Registry`,
//! `SegmentRegistration`) only with the cargo feature `registry`, because etcd-client's
//! build runs `protoc` and needs protobuf's well-known `.proto` files (Debian:
//! `protobuf-compiler` and `libprotobuf-dev`). A library user who does not name segments
//! needs neither.

#[cfg(feature = "registry")]
mod etcd;
#[cfg(feature = "registry")]
pub use etcd::{Registry, SegmentRegistration};

use std::net::SocketAddr;
use std::time::Duration;

/// Where the registry is and how patient to be with it.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// etcd client endpoints (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix, so that several deployments can share one etcd.
    pub prefix: String,
    /// Bound on connecting and on every request.
    pub timeout: Duration,
}

impl RegistryConfig {
    /// The given endpoints, prefix `/gpuio`, 5 s timeout.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            prefix: "/gpuio".into(),
            timeout: Duration::from_secs(5),
        }
    }
}

/// An agent serving a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentMember {
    /// The agent's name (unique within the segment).
    pub agent: String,
    /// Where clients connect.
    pub addr: SocketAddr,
}
