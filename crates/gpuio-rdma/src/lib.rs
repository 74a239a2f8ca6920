//! RDMA verbs for gpuio (libibverbs through rdma-sys): a device with its protection domain
//! and completion-polling thread, memory regions, and reliable-connected queue pairs, behind
//! safe types. Every verb blocks until its work requests complete; the device's polling thread
//! reaps the completions and hands each to the verb waiting for it. RemoteIO's `rdma` feature
//! is its user (gpuio-transport-remoteio's `rdma` module); the crate sits beside the
//! transports' layer, on gpuio-hal, whose [`HostBuffer`](gpuio_hal::HostBuffer) it registers
//! and whose [`HalError`] it returns (an [`HalError::Rdma`] for a failed verb).
//!
//! Two kinds of registered memory:
//! - [`RdmaBuffer`] owns its host memory: local ends of reads, writes, sends, receives and
//!   atomics.
//! - [`HostRegion`] registers a range of a [`HostBuffer`](gpuio_hal::HostBuffer): exposed to
//!   remote peers (an agent's memory export), and the local end of verbs on borrowed slices
//!   inside it. Remote NICs read and write an exposed region whenever they are permitted to,
//!   like a GPU writing mapped pinned memory: its bytes can change under a reader, and gpuio
//!   only ever copies them, never interprets them. The region keeps the mapping alive (a
//!   [`MappingHold`](gpuio_hal::MappingHold)) until it is deregistered.
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
//!
//! Building it needs libibverbs-dev, librdmacm-dev and libclang-dev (rdma-sys runs bindgen
//! over the verbs headers); running it, libibverbs and a provider for the device. Its unit
//! tests need no NIC; its integration tests (`tests/it`) need a device, and run on soft-RoCE
//! in a QEMU guest (`cargo xtask qemu-rdma`, with `GPUIO_REQUIRE_RDMA=1`).

#![deny(unsafe_op_in_unsafe_fn)]

mod device;
mod memory;
mod queue_pair;
mod work;

pub use device::{RdmaDevice, device_names};
pub use memory::{HostRegion, RdmaAccess, RdmaBuffer, RemoteRegion};
pub use queue_pair::{QueuePair, RdmaEndpoint};

use gpuio_hal::{ErrorCode, HalError};

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
