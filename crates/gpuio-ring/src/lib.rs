//! gpuio's GPU-initiated IO. The GPU→host request ring: GPU kernel threads post IO requests into
//! slots in mapped pinned host memory, host proxy threads carry them out and publish
//! completions that the GPU polls.
//!
//! This crate owns the shared layout ([`RingHeader`], [`RingSlot`], [`RingDevice`] and the
//! constants, mirrored by `kernels/gpuio_ring.cuh` and checked on both sides through
//! [`layout()`]), the ring memory ([`RingMemory`]), the consumer side of the protocol
//! ([`RingMemory::claim`] → [`RingClaim::take`] → [`RingTaken::complete`]) and a producer that
//! runs on host threads ([`HostProducer`]) and follows the protocol a GPU thread follows, so
//! that CI tests the protocol without a GPU. What a request *does* (engines, resources) is
//! gpuio-core's `RingProxy`.
//!
//! Its files: `layout.rs` (the `#[repr(C)]` structs, the constants and their const asserts),
//! `memory.rs` ([`RingMemory`]), `consumer.rs` (claim, take, complete; stop, sweep, close),
//! `producer.rs` ([`HostProducer`]), `ops.rs` (the ring's test and bench kernels, as ops),
//! `kernels.rs` (generated from `kernels.toml`); [`ondemand`], the arrays built on the ring;
//! here, what all of them share: the result codes a completion publishes (defined in
//! gpuio-hal's errors, so that [`HalError::RingRequest`](gpuio_hal::HalError::RingRequest)
//! reads them) and how each side waits ([`WaitPolicy`]).
//!
//! # Protocol
//!
//! The ring has `N` slots (a power of two). Ticket `t` uses slot `t & (N-1)`. A slot's
//! `status` word holds its state and, once done, the result (`state | result << 8`), so one
//! store publishes a completion and one 16-byte load reads it with its inline bytes.
//!
//! - **Producer** (a GPU thread): claims a ticket `t` from a counter outside the ring (device
//!   memory; GPUs cannot do atomics on host memory over PCIe). Whose turn a slot is lives
//!   beside that counter, not in the slot: slot `i`'s *free turn* starts at `i`, and the
//!   producer waits until it equals `t` (back-pressure) or the ring is no longer open (then
//!   the request is refused). The check reads the GPU's own memory, not host memory across
//!   PCIe: only producers free slots, so only they need to know. It then writes the request
//!   fields, and stores `status = POSTED` with the ticket in the word (release).
//! - **Consumer** (a host proxy thread): claims the next consumer ticket `h` (host counter),
//!   waits for `status == POSTED | h << 8` (acquire: a `POSTED` of an earlier lap, still
//!   waiting for its own consumer, carries that lap's ticket), copies the request out, carries
//!   it out, and stores `status = DONE*` with the result (release): `DONE`, `DONE_INLINE`
//!   (at most 8 bytes, in the slot's `inline_bytes`) or `DONE_BOUNCE` (in the slot's bounce
//!   buffer).
//! - **Completion**: the producer of `t` sees a `DONE*` state (acquire) with its result, takes
//!   the bytes, and frees the slot for the next lap: free turn `t + N` (release). The slot
//!   keeps its `DONE*` status until that lap posts. No lap check is needed: the producer
//!   itself stored this lap's `POSTED`, and no later lap posts before it frees the slot.
//! - **Shutdown**: the host stores `STOPPING`; consumers stop taking requests and finish the
//!   ones they hold; a sweep completes every slot still `POSTED` with [`RESULT_SHUT_DOWN`];
//!   then the host stores `CLOSED` and writes the ring no more. A producer waiting for a free
//!   slot is refused once the ring is not open; one waiting for a completion that sees
//!   `CLOSED` while its slot is not `DONE*` (it posted after the sweep) gets the shutdown
//!   error.
//!
//! Every load and store of shared ring memory here is a Rust atomic on a view made from the
//! mapped pointer: the GPU writes the same lines, so no `&mut` to them ever exists. The slot's
//! `turn` (the ticket last posted) is for diagnostics only.
//!
//! ```
//! use gpuio_ring::{HostProducer, RingMemory, Take, WaitPolicy};
//! use gpuio_hal::{BackendPreference, probe};
//! use std::sync::Arc;
//!
//! let gpus = probe(BackendPreference::Host).unwrap();
//! let ring = Arc::new(RingMemory::new(4, &gpus.gpus[0]).unwrap());
//! let producer = HostProducer::new(ring.clone()).unwrap();
//! let mut token = producer.post_read(7, 0, 4096, 0x1000).unwrap();
//!
//! // A consumer (normally gpuio-core's RingProxy) takes the request and completes it.
//! match ring.claim().try_take() {
//!     Take::Taken(taken) => {
//!         assert_eq!(taken.request().resource, 7);
//!         let len = taken.request().len as i64;
//!         taken.complete(len);
//!     }
//!     _ => unreachable!("the request was posted"),
//! }
//! assert_eq!(producer.wait(&mut token, None).unwrap(), 4096);
//! ring.close(std::time::Duration::from_secs(1)).unwrap();
//! ```

#![deny(unsafe_op_in_unsafe_fn)]

mod consumer;
#[rustfmt::skip]
pub mod kernels;
mod layout;
mod memory;
pub mod ondemand;
#[cfg(feature = "test-kernels")]
pub mod ops;
mod producer;

pub use consumer::{RingClaim, RingOp, RingRequest, RingTaken, Take};
pub use layout::{
    FLAG_DURABLE, FLAG_STAGE, FLAGS_KNOWN, FieldLayout, HEADER_BYTES, INLINE_BYTES, INLINE_MARKER,
    MAGIC, OP_READ, OP_WRITE, RESULT_SHUT_DOWN, RESULT_UNREGISTERED, RING_CLOSED, RING_OPEN,
    RING_STOPPING, RingDevice, RingHeader, RingLayout, RingSlot, SLOT_BYTES, SLOT_DONE,
    SLOT_DONE_BOUNCE, SLOT_DONE_INLINE, SLOT_FREE, SLOT_POSTED, STATE_BITS, VERSION, inline_marker,
    layout, posted_word, status_result, status_state, status_word,
};
pub use memory::{MAX_SLOTS, MIN_SLOTS, RingMemory, RingState, SlotView};
pub use producer::{HostProducer, RingPost, RingToken};

use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Results: what a completion publishes, and how the error side of the HAL reads it.

pub use gpuio_hal::error::{error_code_of, result_name, result_of};

/// The device API's headers (`gpuio_ring.cuh`, `gpuio_array.cuh`, `gpuio_rows.cuh` and the
/// umbrella `gpuio.cuh`, from the workspace's `kernels/`) as one text, for user kernels
/// compiled at run time (NVRTC, CuPy's `RawModule`): put it in front of a source that uses
/// `gpuio_array<T>`, the request ring or the row gathers (each header is in it once; their
/// `#include`s sit inside `#ifndef` guards). nvcc users add `-I kernels` and include
/// `gpuio.cuh`.
pub static DEVICE_HEADER: &str = concat!(
    include_str!("../../../kernels/gpuio_ring.cuh"),
    include_str!("../../../kernels/gpuio_array.cuh"),
    include_str!("../../../kernels/gpuio_rows.cuh"),
    include_str!("../../../kernels/gpuio.cuh"),
);

// ---------------------------------------------------------------------------------------------
// Waiting.

/// How a side of the ring waits: spin, then yield, then sleep with growing pauses up to
/// `max_sleep`. Spinning answers fastest; sleeping leaves the cores to others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Busy-wait iterations (`spin_loop`) before yielding.
    pub spins: u32,
    /// `yield_now` calls before sleeping.
    pub yields: u32,
    /// The longest pause between checks once sleeping.
    pub max_sleep: Duration,
}

impl Default for WaitPolicy {
    fn default() -> Self {
        Self {
            spins: 256,
            yields: 32,
            max_sleep: Duration::from_micros(200),
        }
    }
}

struct Backoff {
    policy: WaitPolicy,
    step: u64,
    sleep: Duration,
}

impl Backoff {
    fn new(policy: &WaitPolicy) -> Self {
        Self {
            policy: *policy,
            step: 0,
            sleep: Duration::from_micros(10).min(policy.max_sleep),
        }
    }

    fn snooze(&mut self) {
        let spins = u64::from(self.policy.spins);
        if self.step < spins {
            std::hint::spin_loop();
        } else if self.step < spins + u64::from(self.policy.yields) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.sleep);
            self.sleep = (self.sleep * 2).min(self.policy.max_sleep);
        }
        self.step += 1;
    }

    /// Whether sleeping has begun (expensive checks are made only from then on).
    fn sleeping(&self) -> bool {
        self.step >= u64::from(self.policy.spins) + u64::from(self.policy.yields)
    }
}

fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
}

/// What the tests of the ring's modules share: a host-backend GPU and rings on it.
#[cfg(test)]
mod testing {
    use super::RingMemory;
    use gpuio_hal::{BackendPreference, Gpu, probe};
    use std::sync::Arc;
    use std::time::Duration;

    pub(super) fn host_gpu() -> Gpu {
        probe(BackendPreference::Host).unwrap().gpus[0].clone()
    }

    pub(super) fn ring(slots: usize) -> Arc<RingMemory> {
        Arc::new(RingMemory::new(slots, &host_gpu()).unwrap())
    }

    pub(super) const SECOND: Duration = Duration::from_secs(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuio_hal::{ErrorCode, HalError};

    #[test]
    fn result_codes_round_trip() {
        assert_eq!(result_of(ErrorCode::NotFound), -4);
        assert_eq!(error_code_of(-4), Some(ErrorCode::NotFound));
        assert_eq!(error_code_of(RESULT_SHUT_DOWN), Some(ErrorCode::Canceled));
        assert_eq!(
            error_code_of(RESULT_UNREGISTERED),
            Some(ErrorCode::InvalidArg)
        );
        assert_eq!(error_code_of(-1000), Some(ErrorCode::General));
        assert_eq!(error_code_of(5), None);
        assert_eq!(result_name(-3), "GPUIO_ERROR_INVALID_ARG");
        assert_eq!(result_name(RESULT_SHUT_DOWN), "GPUIO_ERROR_RING_SHUTDOWN");
        assert_eq!(result_name(-1000), "unknown error");
    }

    #[test]
    fn ring_request_errors_read_through_the_ring_codes() {
        let e = HalError::RingRequest {
            code: RESULT_UNREGISTERED,
        };
        assert_eq!(e.code(), ErrorCode::InvalidArg);
        assert_eq!(
            e.to_string(),
            "ring request failed: GPUIO_ERROR_RING_UNREGISTERED (-64)"
        );
        let e = HalError::RingRequest {
            code: result_of(ErrorCode::NotFound),
        };
        assert_eq!(e.code(), ErrorCode::NotFound);
        assert_eq!(
            e.to_string(),
            "ring request failed: GPUIO_ERROR_NOT_FOUND (-4)"
        );
        let e = HalError::RingRequest { code: -1000 };
        assert_eq!(e.code(), ErrorCode::General);
        assert_eq!(e.to_string(), "ring request failed: unknown error (-1000)");
    }
}
