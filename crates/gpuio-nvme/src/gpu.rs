//! GPU-driven queue pairs (Tier 1: queues and data in host memory pinned and mapped for the
//! GPU): the host creates the pair on the controller and registers its memory and the
//! controller's doorbells with a GPU; kernels then submit and complete commands themselves
//! (`kernels/gpuio_nvme.cuh`, whose protocol comment this follows). The layouts here mirror
//! that header; [`layout_words`] is what its layout kernel reports, compared on the GPU.

use super::controller::{Controller, IoQueuePair};
use super::dma::DmaBuffer;
use super::spec::{Cqe, Sqe};
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::gpu::{DeviceBuffer, Gpu, PinGuard};
use std::marker::PhantomData;
use std::mem::{offset_of, size_of};

/// The lock word of a pair a timed-out batch broke (`GPUIO_NVME_LOCK_BROKEN`).
const LOCK_BROKEN: u32 = 2;

/// The smallest queue a GPU pair may have: a warp's batch of 32 commands, plus the slot NVMe
/// keeps empty.
pub const MIN_GPU_DEPTH: u16 = 33;

/// A queue pair as kernels see it (`gpuio_nvme_queue`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct NvmeQueueDevice {
    /// Kernels' address of the SQ.
    pub sq: u64,
    /// Kernels' address of the CQ.
    pub cq: u64,
    /// Kernels' address of the SQ tail doorbell.
    pub sq_doorbell: u64,
    /// Kernels' address of the CQ head doorbell.
    pub cq_doorbell: u64,
    /// The pair's [`NvmeQueueState`] in GPU memory.
    pub state: u64,
    /// Entries per queue.
    pub depth: u32,
    /// The queue identifier.
    pub qid: u32,
    /// Kernels' address of the pair's PRP list pages (one 4 KiB page per command identifier).
    pub lists: u64,
    /// The controller's address of the first list page.
    pub lists_iova: u64,
}

/// The GPU's side of a queue pair between batches (`gpuio_nvme_state`), in GPU memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct NvmeQueueState {
    /// 0 free, 1 held by a warp's leader, 2 broken (a batch timed out).
    pub lock: u32,
    /// The next SQ slot.
    pub sq_tail: u32,
    /// The next CQ slot.
    pub cq_head: u32,
    /// The phase tag expected at `cq_head`.
    pub phase: u32,
}

const _: () = {
    assert!(size_of::<NvmeQueueDevice>() == 64);
    assert!(size_of::<NvmeQueueState>() == 16);
};

/// The shared layouts in the order `gpuio_nvme_layout` reports them: each struct's size,
/// then (offset, size) of its listed fields.
pub fn layout_words() -> Vec<u64> {
    macro_rules! field {
        ($out:ident, $t:ty, $f:ident) => {{
            $out.push(offset_of!($t, $f) as u64);
            let probe = <$t>::default();
            $out.push(std::mem::size_of_val(&probe.$f) as u64);
        }};
    }
    let mut w = vec![size_of::<Sqe>() as u64];
    field!(w, Sqe, nsid);
    field!(w, Sqe, prp1);
    field!(w, Sqe, prp2);
    field!(w, Sqe, cdw10);
    field!(w, Sqe, cdw12);
    w.push(size_of::<Cqe>() as u64);
    field!(w, Cqe, sq_head);
    field!(w, Cqe, cid);
    field!(w, Cqe, status);
    w.push(size_of::<NvmeQueueDevice>() as u64);
    field!(w, NvmeQueueDevice, sq);
    field!(w, NvmeQueueDevice, cq);
    field!(w, NvmeQueueDevice, sq_doorbell);
    field!(w, NvmeQueueDevice, cq_doorbell);
    field!(w, NvmeQueueDevice, state);
    field!(w, NvmeQueueDevice, depth);
    field!(w, NvmeQueueDevice, qid);
    field!(w, NvmeQueueDevice, lists);
    field!(w, NvmeQueueDevice, lists_iova);
    w.push(size_of::<NvmeQueueState>() as u64);
    field!(w, NvmeQueueState, lock);
    field!(w, NvmeQueueState, sq_tail);
    field!(w, NvmeQueueState, cq_head);
    field!(w, NvmeQueueState, phase);
    w
}

/// An I/O queue pair driven by a GPU's threads. Dropping it unregisters its memory and
/// deletes its queues; kernels using it must have finished (the launches here wait for them).
pub struct GpuQueuePair {
    // Field order is drop order: unregister before the queue memory is freed.
    _sq_pin: PinGuard,
    _cq_pin: PinGuard,
    _lists_pin: PinGuard,
    _state: DeviceBuffer,
    /// The most one command moves (the controller's limit, and one list page's).
    max_transfer: usize,
    device: NvmeQueueDevice,
    gpu: Gpu,
    // Keeps the queues on the controller (deleted when dropped, after the pins above).
    _io: IoQueuePair,
}

impl std::fmt::Debug for GpuQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuQueuePair")
            .field("qid", &self.device.qid)
            .field("depth", &self.device.depth)
            .field("gpu", &self.gpu.ordinal())
            .finish()
    }
}

impl GpuQueuePair {
    /// What kernels are given.
    pub fn device(&self) -> NvmeQueueDevice {
        self.device
    }

    /// The GPU whose kernels drive it.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The most one command on this pair moves, in bytes.
    pub fn max_transfer(&self) -> usize {
        self.max_transfer
    }

    /// Whether a GPU batch on this pair timed out (its lock word says broken): a completion
    /// may still arrive, so the pair can never be used again. The controller is disabled
    /// when this is found, so that nothing more lands in memory the caller takes back.
    pub(crate) fn check_broken(&self, stream: &gpuio_hal::gpu::Stream) -> Result<()> {
        let mut word = [0u8; 4];
        stream.download(&self._state, 0, &mut word)?;
        if u32::from_le_bytes(word) == LOCK_BROKEN {
            let _ = self._io.disable_controller();
            return Err(HalError::NvmeController {
                reason: format!(
                    "a GPU-issued command on queue {} got no completion in time; the queue \
                     pair is broken and the controller disabled",
                    self.device.qid
                ),
            });
        }
        Ok(())
    }

    /// The descriptor's bytes, as kernels read a `gpuio_nvme_queue`.
    pub(crate) fn descriptor_bytes(&self) -> Vec<u8> {
        descriptor_bytes(&self.device)
    }
}

impl Controller {
    /// Creates an I/O queue pair of `depth` entries (at least [`MIN_GPU_DEPTH`]) for `gpu`'s
    /// kernels: its queues and the controller's doorbells registered with the GPU, its
    /// lock and indices in GPU memory.
    pub fn gpu_queue_pair(&self, gpu: &Gpu, depth: u16) -> Result<GpuQueuePair> {
        if depth < MIN_GPU_DEPTH {
            return Err(HalError::InvalidArgument(format!(
                "a GPU-driven NVMe queue needs at least {MIN_GPU_DEPTH} entries, not {depth}"
            )));
        }
        let doorbells = self.doorbells_for(gpu)?;
        let io = self.io_queue_pair(depth)?;
        let (sq, cq, lists) = io.queue_memory();
        // SAFETY: the queue memory lives in `io`, which GpuQueuePair drops after the pins.
        let sq_pin = unsafe { gpu.pin_mapped(sq.memory().addr(0), sq.len(), false)? };
        let sq_addr = sq_pin.device_addr();
        // SAFETY: as above.
        let cq_pin = unsafe { gpu.pin_mapped(cq.memory().addr(0), cq.len(), false)? };
        let cq_addr = cq_pin.device_addr();
        // SAFETY: as above.
        let lists_pin = unsafe { gpu.pin_mapped(lists.memory().addr(0), lists.len(), false)? };
        let lists_addr = lists_pin.device_addr();
        let lists_iova = lists.iova();
        let state = gpu.alloc(size_of::<NvmeQueueState>())?;
        let initial = NvmeQueueState {
            phase: 1,
            ..NvmeQueueState::default()
        };
        gpu.stream()?.upload(&state_bytes(&initial), &state, 0)?;
        let (sq_doorbell, cq_doorbell) = io.doorbell_offsets();
        let device = NvmeQueueDevice {
            sq: sq_addr,
            cq: cq_addr,
            sq_doorbell: doorbells + sq_doorbell as u64,
            cq_doorbell: doorbells + cq_doorbell as u64,
            state: state.device_addr(),
            depth: depth as u32,
            qid: io.qid() as u32,
            lists: lists_addr,
            lists_iova,
        };
        let max_transfer = self
            .identity()
            .max_transfer()
            .unwrap_or(usize::MAX)
            .min(super::prp::MAX_TRANSFER);
        Ok(GpuQueuePair {
            _sq_pin: sq_pin,
            _cq_pin: cq_pin,
            _lists_pin: lists_pin,
            _state: state,
            max_transfer,
            device,
            gpu: gpu.clone(),
            _io: io,
        })
    }
}

fn state_bytes(s: &NvmeQueueState) -> [u8; 16] {
    let mut b = [0u8; 16];
    for (i, v) in [s.lock, s.sq_tail, s.cq_head, s.phase].iter().enumerate() {
        b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    b
}

/// A [`DmaBuffer`] registered with a GPU, mapped for its kernels while borrowed.
pub struct GpuMappedBuffer<'a> {
    _pin: PinGuard,
    pub(crate) addr: u64,
    pub(crate) iova: u64,
    pub(crate) len: usize,
    _buf: PhantomData<&'a DmaBuffer>,
}

impl DmaBuffer {
    /// Registers this buffer with `gpu`, so kernels can read and write it where commands
    /// move data.
    pub fn map_for_gpu(&self, gpu: &Gpu) -> Result<GpuMappedBuffer<'_>> {
        // SAFETY: the mapping borrows `self`, so the memory outlives the pin.
        let pin = unsafe { gpu.pin_mapped(self.memory().addr(0), self.len(), false)? };
        let addr = pin.device_addr();
        Ok(GpuMappedBuffer {
            _pin: pin,
            addr,
            iova: self.iova(),
            len: self.len(),
            _buf: PhantomData,
        })
    }
}

/// What a GPU-issued batch of commands does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuNvmeOp {
    /// FLUSH: no data.
    Flush,
    /// READ each command's blocks into its warp's data slot and check them against the data
    /// pattern of the given seed.
    ReadChecked(u64),
    /// WRITE each command's blocks from its data slot, filled with the data pattern of the
    /// given seed first.
    WritePattern(u64),
}

fn descriptor_bytes(d: &NvmeQueueDevice) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    for v in [d.sq, d.cq, d.sq_doorbell, d.cq_doorbell, d.state] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&d.depth.to_le_bytes());
    b.extend_from_slice(&d.qid.to_le_bytes());
    for v in [d.lists, d.lists_iova] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_words_list_the_shared_structs() {
        let w = layout_words();
        assert_eq!(w[0], 64, "SQE");
        assert_eq!(&w[1..3], &[4, 4], "nsid");
        assert_eq!(w.len(), 1 + 10 + 1 + 6 + 1 + 18 + 1 + 8);
        let d = NvmeQueueDevice {
            lists_iova: 0x1122,
            ..NvmeQueueDevice::default()
        };
        let bytes = descriptor_bytes(&d);
        assert_eq!(bytes.len(), 64);
        assert_eq!(
            bytes[56..64],
            0x1122u64.to_le_bytes(),
            "lists_iova at its offset"
        );
    }
}
