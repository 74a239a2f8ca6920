//! RDMA verbs (libibverbs through rdma-sys, cargo feature `rdma`): a device with its
//! protection domain and completion-polling thread, memory regions, and reliable-connected
//! queue pairs, behind safe types. Every verb blocks until its work requests complete; the
//! device's polling thread reaps the completions and hands each to the verb waiting for it.
//!
//! Two kinds of registered memory:
//! - [`RdmaBuffer`] owns its host memory: local ends of reads, writes, sends, receives and
//!   atomics.
//! - [`HostRegion`] registers a range of a [`HostBuffer`](crate::HostBuffer): exposed to remote
//!   peers (an agent's memory export), and the local end of verbs on borrowed slices inside it.
//!   Remote NICs read and write an exposed region whenever they are permitted to, like a GPU
//!   writing mapped pinned memory: its bytes can change under a reader, and gpuio only ever
//!   copies them, never interprets them. The region keeps the mapping alive until it is
//!   deregistered.
//!
//! Verbs that let the NIC write local memory take it by `&mut`, so no Rust reference can
//! observe the bytes while the NIC writes them, and they return only when the NIC is done.
//!
//! Its files: `device.rs` ([`RdmaDevice`] and its completion poller, which hands completions to
//! the verbs by work request id), `memory.rs` ([`RdmaBuffer`], [`HostRegion`], [`RemoteRegion`]:
//! registration and the range checks every verb makes before it posts), `queue_pair.rs`
//! ([`QueuePair`]: connecting, the verbs, posting and waiting), `work.rs` (one work request:
//! building it, cutting a large verb into several, what a failed completion means); here, the
//! error helpers they share.

mod device;
mod memory;
mod queue_pair;
mod work;

pub use device::{RdmaDevice, device_names};
pub use memory::{HostRegion, RdmaAccess, RdmaBuffer, RemoteRegion};
pub use queue_pair::{QueuePair, RdmaEndpoint};

use crate::error::{ErrorCode, HalError};

/// A verb that failed with `errno` set.
fn rdma_err(op: &'static str) -> HalError {
    let e = std::io::Error::last_os_error();
    HalError::Rdma {
        op,
        code: ErrorCode::from_io(&e),
        message: e.to_string(),
    }
}

/// A verb that failed with a return code (an errno value).
fn rc_err(op: &'static str, rc: i32) -> HalError {
    let e = std::io::Error::from_raw_os_error(rc.abs());
    HalError::Rdma {
        op,
        code: ErrorCode::from_io(&e),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_codes_map_like_errno_either_sign() {
        for rc in [libc::ETIMEDOUT, -libc::ETIMEDOUT] {
            let e = rc_err("posting a work request", rc);
            assert_eq!(e.code(), ErrorCode::Timeout, "{e}");
            assert!(
                e.to_string().starts_with("RDMA posting a work request: "),
                "{e}"
            );
        }
        assert_eq!(rc_err("x", libc::EINVAL).code(), ErrorCode::InvalidArg);
        assert_eq!(rc_err("x", libc::ENOMEM).code(), ErrorCode::NoMem);
        assert_eq!(rc_err("x", libc::EPERM).code(), ErrorCode::Permission);
        assert_eq!(rc_err("x", libc::EIO).code(), ErrorCode::Io);
    }
}
