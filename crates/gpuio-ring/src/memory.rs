//! The memory of one request ring ([`RingMemory`]): a page-aligned host buffer holding the
//! header, the slots and their bounce buffers, pinned and mapped for a GPU; the producers' claim
//! memory (ticket counter and free turns) in that GPU's memory; the host-only counters. Here are its creation (the shared
//! layout initialised), the views of the shared memory the protocol's two sides work on, the
//! descriptor kernels receive, and its state. The two sides' parts of the protocol are in
//! `consumer.rs` and `producer.rs`.

use super::layout::{
    HEADER_BYTES, MAGIC, RING_OPEN, RING_STOPPING, RingDevice, RingHeader, RingSlot, SLOT_BYTES,
    SLOT_DONE, SLOT_FREE, VERSION, status_result, status_state, status_word,
};
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::gpu::{DeviceBuffer, Gpu, Stream};
use gpuio_hal::memory::{HostAllocOptions, HostBuffer};
use gpuio_hal::sync::THREAD_STRIPES;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering, fence};

/// Fewest slots a ring may have.
pub const MIN_SLOTS: usize = 2;
/// Most slots a ring may have (64 MiB of slots).
pub const MAX_SLOTS: usize = 1 << 20;

/// Where a ring is in its life (the header's `state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RingState {
    /// Requests are accepted and served.
    Open,
    /// Requests are refused; those being served finish.
    Stopping,
    /// Shut down; the host writes the ring no more.
    Closed,
}

impl RingState {
    fn from_raw(raw: u32) -> Self {
        match raw {
            RING_OPEN => Self::Open,
            RING_STOPPING => Self::Stopping,
            // Only the host writes the header; anything else is treated as the end.
            _ => Self::Closed,
        }
    }
}

/// Which producers a ring has: kernels (the device claim counter) or host threads (a host
/// counter). Both at once would hand out the same tickets twice.
const PRODUCERS_UNSET: u8 = 0;
pub(super) const PRODUCERS_HOST: u8 = 1;
const PRODUCERS_DEVICE: u8 = 2;

/// Keeps a hot host-only counter on a cache line of its own.
#[repr(align(64))]
pub(super) struct Padded<T>(pub(super) T);

/// The memory of one request ring: a page-aligned [`HostBuffer`] holding the header and the
/// slots, pinned (and mapped) for a GPU, plus the producers' claim memory in that GPU's
/// memory (see [`RingDevice::claim`]) and the host-only counters of the consumers. Share it in an `Arc` between the
/// proxy (consumers) and the producers.
///
/// Kernels reach it through [`device`](Self::device). The memory is unmapped when the last
/// handle drops: kernels that use the ring must have finished by then (shut the ring down
/// first; kernels waiting on it then return).
pub struct RingMemory {
    pub(super) buf: HostBuffer,
    pub(super) nslots: usize,
    /// Bytes of each slot's bounce buffer (0: none); the buffers follow the slots.
    pub(super) bounce_bytes: usize,
    pub(super) device_base: u64,
    /// Kernels' ticket counter and slots' free turns ([`RingDevice::claim`]).
    pub(super) device_claim: DeviceBuffer,
    pub(super) gpu: Gpu,
    /// Held for the ring's life. On CUDA (cudarc with event tracking) creating a context's
    /// first stream synchronizes the whole context, which would wait forever for the kernels
    /// that wait for this ring's completions; with this stream alive, the streams the engines
    /// create while serving requests are never a context's first.
    pub(super) _stream: Stream,
    pub(super) host_claim: Padded<AtomicU64>,
    /// Host producers' free turns: the ticket that may post in each slot next (the twin of
    /// the kernels' ones in `device_claim`).
    pub(super) host_free_turns: Box<[AtomicU64]>,
    pub(super) consumer_next: Padded<AtomicU64>,
    /// Consumer claims alive, striped by consumer thread (`sync::thread_stripe`); the sweep and
    /// close wait for none. One shared count took two contended read-modify-writes per
    /// request on a line that also held the fields every consumer reads.
    pub(super) live_claims: Box<[Padded<AtomicUsize>]>,
    pub(super) producers: AtomicU8,
    /// Tickets of host-producer tokens dropped before their completion was seen.
    pub(super) abandoned: Mutex<Vec<u64>>,
    pub(super) abandoned_count: AtomicUsize,
}

impl fmt::Debug for RingMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingMemory")
            .field("slots", &self.nslots)
            .field("device_addr", &format_args!("{:#x}", self.device_base))
            .field("gpu", &self.gpu.ordinal())
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl RingMemory {
    /// A ring of `slots` slots (a power of two, [`MIN_SLOTS`] to [`MAX_SLOTS`]) in host memory
    /// pinned and mapped for `gpu`, with its producers' claim memory in `gpu`'s memory.
    pub fn new(slots: usize, gpu: &Gpu) -> Result<Self> {
        Self::with_bounce(slots, 0, gpu)
    }

    /// Like [`new`](Self::new), with a bounce buffer of `bounce_bytes` (a multiple of 64, at
    /// most 1 MiB) per slot after the slots, for reads delivered in host memory
    /// ([`FLAG_STAGE`](super::FLAG_STAGE)).
    pub fn with_bounce(slots: usize, bounce_bytes: usize, gpu: &Gpu) -> Result<Self> {
        if !bounce_bytes.is_multiple_of(64) || bounce_bytes > 1 << 20 {
            return Err(HalError::InvalidArgument(format!(
                "a ring's bounce buffers hold a multiple of 64 bytes up to 1 MiB, not {bounce_bytes}"
            )));
        }
        if !slots.is_power_of_two() || !(MIN_SLOTS..=MAX_SLOTS).contains(&slots) {
            return Err(HalError::InvalidArgument(format!(
                "a request ring needs a power-of-two slot count from {MIN_SLOTS} to \
                 {MAX_SLOTS}, not {slots}"
            )));
        }
        let bytes = HEADER_BYTES + slots * (SLOT_BYTES + bounce_bytes);
        let mut buf = HostBuffer::alloc(bytes, &HostAllocOptions::default())?;
        buf.pin(gpu)?;
        let device_base = buf
            .pinned()
            .map(|p| p.device_addr())
            .ok_or_else(|| HalError::InvalidArgument("ring memory is not pinned".into()))?;
        if !(buf.base_ptr() as usize).is_multiple_of(64) || device_base % 64 != 0 {
            return Err(HalError::InvalidArgument(
                "ring memory is not 64-byte aligned".into(),
            ));
        }
        // The ticket counter (0), then each slot's first free turn (its index).
        let claim_words: Vec<u8> = std::iter::once(0u64)
            .chain(0..slots as u64)
            .flat_map(u64::to_le_bytes)
            .collect();
        let device_claim = gpu.alloc(claim_words.len())?;
        let stream = gpu.stream()?;
        stream.upload(&claim_words, &device_claim, 0)?;
        let ring = Self {
            buf,
            nslots: slots,
            bounce_bytes,
            device_base,
            device_claim,
            gpu: gpu.clone(),
            _stream: stream,
            host_claim: Padded(AtomicU64::new(0)),
            host_free_turns: (0..slots as u64).map(AtomicU64::new).collect(),
            consumer_next: Padded(AtomicU64::new(0)),
            live_claims: (0..THREAD_STRIPES)
                .map(|_| Padded(AtomicUsize::new(0)))
                .collect(),
            producers: AtomicU8::new(PRODUCERS_UNSET),
            abandoned: Mutex::new(Vec::new()),
            abandoned_count: AtomicUsize::new(0),
        };
        let h = ring.header();
        h.magic.store(MAGIC, Ordering::Relaxed);
        h.version.store(VERSION, Ordering::Relaxed);
        h.slots.store(slots as u32, Ordering::Relaxed);
        h.state.store(RING_OPEN, Ordering::Relaxed);
        for (i, s) in ring.slot_array().iter().enumerate() {
            s.turn.store(i as u64, Ordering::Relaxed);
            s.status.store(status_word(SLOT_FREE, 0), Ordering::Relaxed);
        }
        // Publishes the initial contents to host threads (they receive the ring through an
        // Arc, which synchronizes too) and orders them before any later kernel launch.
        fence(Ordering::SeqCst);
        Ok(ring)
    }

    pub(super) fn header(&self) -> &RingHeader {
        // SAFETY: the buffer is at least HEADER_BYTES long, 64-byte aligned (checked in new),
        // zero-initialised or written only through atomics (any bit pattern is a valid
        // atomic), and lives as long as `self`. RingHeader holds only atomics, so a shared
        // reference permits the GPU's and other threads' concurrent writes.
        unsafe { &*(self.buf.base_ptr() as *const RingHeader) }
    }

    pub(super) fn slot_array(&self) -> &[RingSlot] {
        // SAFETY: the buffer holds HEADER_BYTES + nslots * SLOT_BYTES bytes; slot 0 starts at
        // HEADER_BYTES, a multiple of 64 from a 64-byte-aligned base; the memory lives as long
        // as `self` and RingSlot holds only atomics (see `header`).
        unsafe {
            std::slice::from_raw_parts(
                self.buf.base_ptr().add(HEADER_BYTES) as *const RingSlot,
                self.nslots,
            )
        }
    }

    pub(super) fn slot(&self, ticket: u64) -> &RingSlot {
        &self.slot_array()[(ticket & self.mask()) as usize]
    }

    pub(super) fn mask(&self) -> u64 {
        self.nslots as u64 - 1
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.nslots
    }

    /// Bytes of each slot's bounce buffer (0: none).
    pub fn bounce_bytes(&self) -> usize {
        self.bounce_bytes
    }

    /// The bounce buffer of `ticket`'s slot.
    pub(super) fn bounce_ptr(&self, ticket: u64) -> *mut u8 {
        let at = HEADER_BYTES
            + self.nslots * SLOT_BYTES
            + (ticket & self.mask()) as usize * self.bounce_bytes;
        self.buf.base_ptr().wrapping_add(at)
    }

    /// The GPU the memory is pinned for.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The device address of the header (the ring's first byte) for kernels; on the host
    /// backend, the host address.
    pub fn device_addr(&self) -> u64 {
        self.device_base
    }

    /// The device address of slot 0.
    pub fn slots_device_addr(&self) -> u64 {
        self.device_base + HEADER_BYTES as u64
    }

    /// The descriptor kernels receive by value. From then on the ring's producers are
    /// kernels, so a [`HostProducer`](super::HostProducer) for it is refused (the two would claim the same tickets
    /// from different counters).
    pub fn device(&self) -> Result<RingDevice> {
        self.set_producers(PRODUCERS_DEVICE)?;
        Ok(RingDevice {
            header: self.device_base,
            slots: self.slots_device_addr(),
            claim: self.device_claim.device_addr(),
            mask: self.mask() as u32,
            nslots: self.nslots as u32,
            bounce: if self.bounce_bytes == 0 {
                0
            } else {
                self.slots_device_addr() + (self.nslots * SLOT_BYTES) as u64
            },
            bounce_bytes: self.bounce_bytes as u64,
        })
    }

    pub(super) fn set_producers(&self, kind: u8) -> Result<()> {
        match self.producers.compare_exchange(
            PRODUCERS_UNSET,
            kind,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => Ok(()),
            Err(current) if current == kind => Ok(()),
            Err(_) => Err(HalError::InvalidArgument(
                "a request ring is fed either by kernels or by host producers, not both".into(),
            )),
        }
    }

    /// The ring's state.
    pub fn state(&self) -> RingState {
        RingState::from_raw(self.header().state.load(Ordering::SeqCst))
    }

    pub(super) fn is_open(&self) -> bool {
        self.header().state.load(Ordering::SeqCst) == RING_OPEN
    }

    /// A slot's current contents, for diagnostics (`None` past the last slot).
    pub fn slot_view(&self, index: usize) -> Option<SlotView> {
        let s = self.slot_array().get(index)?;
        let status = s.status.load(Ordering::Acquire);
        let state = status_state(status);
        Some(SlotView {
            turn: s.turn.load(Ordering::Relaxed),
            state,
            // A POSTED word carries its ticket where a result goes.
            result: if state >= SLOT_DONE {
                status_result(status)
            } else {
                0
            },
        })
    }
}

/// A snapshot of one slot (diagnostics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotView {
    /// The ticket last posted in the slot (its index before the first post).
    pub turn: u64,
    /// `SLOT_FREE` (never posted), `SLOT_POSTED` or one of the `SLOT_DONE*` states (kept
    /// after the completion is collected, until the next post).
    pub state: u32,
    /// The last published result (0 before the first completion and while posted).
    pub result: i64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostProducer;
    use crate::testing::{host_gpu, ring};
    use gpuio_hal::error::ErrorCode;

    #[test]
    fn slot_counts_are_checked() {
        let gpu = host_gpu();
        for bad in [0, 1, 3, 6, MAX_SLOTS * 2] {
            let err = RingMemory::new(bad, &gpu).unwrap_err();
            assert_eq!(err.code(), ErrorCode::InvalidArg, "{bad}: {err}");
        }
        let r = RingMemory::new(8, &gpu).unwrap();
        assert_eq!(r.slots(), 8);
        assert_eq!(r.state(), RingState::Open);
        assert_eq!(r.device_addr() % 64, 0);
        for i in 0..8 {
            let v = r.slot_view(i).unwrap();
            assert_eq!((v.turn, v.state), (i as u64, SLOT_FREE));
        }
        assert!(r.slot_view(8).is_none());
        // Kernels' claim memory: the ticket counter, then each slot's first free turn.
        let mut words = vec![0u8; 8 * 9];
        r.gpu()
            .stream()
            .unwrap()
            .download(&r.device_claim, 0, &mut words)
            .unwrap();
        let words: Vec<u64> = words
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        assert_eq!(words, [0, 0, 1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn kernels_or_host_producers_not_both() {
        let r = ring(4);
        let d = r.device().unwrap();
        assert_eq!(d.nslots, 4);
        assert_eq!(d.mask, 3);
        assert_eq!(d.header, r.device_addr());
        assert_eq!(d.slots, r.device_addr() + 64);
        assert!(HostProducer::new(r.clone()).is_err());
        let r = ring(4);
        let _p = HostProducer::new(r.clone()).unwrap();
        assert!(r.device().is_err());
    }
}
