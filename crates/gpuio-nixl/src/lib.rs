//! NIXL for gpuio: NVIDIA's inference transfer library (through nixl-sys), the engine that
//! serving stacks move KV caches and weights between nodes with. Its UCX backend picks a
//! transport at run time: shared memory and `cuda_ipc` on one host, TCP, RDMA and GPUDirect
//! RDMA between hosts.
//!
//! - [`library`] finds NIXL's C API at run time (nixl-sys is built with its `stub-api`, so a
//!   build needs no NIXL): a process without it gets `Unsupported` and the reason from every
//!   call here, and nixl-sys is never called (its stubs would abort the process).
//! - [`NixlAgent`]: an agent with the UCX backend. Its metadata (connection information and
//!   the keys of every registration) goes to peers over a channel of the caller's choosing;
//!   for gpuio, only inside an authenticated RemoteIO session, since whoever holds the
//!   metadata can read and write every registered region.
//! - [`NixlRegion`]: a registered range of a `HostBuffer` or a `DeviceBuffer` ([`NixlMem`]
//!   says which), exposed to peers, and the local end of transfers inside it.
//!   [`NixlRemote`]: a peer's region. Device memory moves GPU to GPU where UCX can
//!   (`cuda_ipc` on one host, GPUDirect RDMA between hosts).
//!
//! The crate sits beside the transports' layer, on gpuio-hal, whose buffers it registers
//! and whose [`HalError`] it returns (an [`HalError::Nixl`] for a failed call). Its files:
//! `library.rs` (finding and loading the library), `agent.rs` (the agent and transfers),
//! `memory.rs` (registrations and the range checks every transfer makes before it posts),
//! `registrations.rs` (the device allocations and shared host buffers an agent keeps
//! registered).
//!
//! Its users: `gpuio info`, and RemoteIO's `nixl` feature (`?transport=nixl`).
//!
//! Its integration tests (`tests/it`) need NIXL (PyPI's `nixl-cu13` wheel, which `cargo xtask
//! ci` installs): two agents in one process, over UCX on loopback.

#![deny(unsafe_op_in_unsafe_fn)]

mod agent;
mod library;
mod memory;
mod registrations;

pub use agent::{NixlAgent, NixlPeer, WAIT_REPORT};
pub use library::{NixlLibrary, library, ucx_tcp_enabled};
pub use memory::{NixlMem, NixlRegion, NixlRemote};

use gpuio_hal::{ErrorCode, HalError};

/// A failed NIXL call.
fn nixl_err(op: &'static str, e: nixl_sys::NixlError) -> HalError {
    use nixl_sys::NixlError as E;
    let code = match e {
        E::InvalidParam
        | E::StringConversionError(_)
        | E::IndexOutOfBounds
        | E::InvalidDataPointer => ErrorCode::InvalidArg,
        E::NotFound => ErrorCode::NotFound,
        _ => ErrorCode::General,
    };
    HalError::Nixl {
        op,
        message: e.to_string(),
        code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nixl_errors_map_to_codes() {
        let e = nixl_err(
            "loading a peer's metadata",
            nixl_sys::NixlError::InvalidParam,
        );
        assert_eq!(e.code(), ErrorCode::InvalidArg);
        assert!(
            e.to_string()
                .starts_with("NIXL loading a peer's metadata: "),
            "{e}"
        );
        assert_eq!(
            nixl_err("x", nixl_sys::NixlError::NotFound).code(),
            ErrorCode::NotFound
        );
        assert_eq!(
            nixl_err("x", nixl_sys::NixlError::BackendError).code(),
            ErrorCode::General
        );
    }
}
