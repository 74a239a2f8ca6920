//! gpuio's NVMe from user space: the protocol's vocabulary, a polling controller driver, and the two
//! controllers it drives.
//!
//! - [`spec`]: registers, queue entries, opcodes, status codes and Identify data, with their
//!   layouts asserted.
//! - [`prp`]: PRP entries and lists for a transfer.
//! - [`dma`]: DMA memory, register files ([`Mmio`]) and IO address mapping ([`DmaMapper`]).
//! - [`Controller`] (`controller`, with `queue` below it): reset, enable, admin queue,
//!   Identify, I/O queue pairs and block IO, by polling; errors typed, a hung or failed
//!   controller disabled before any error returns.
//! - [`extents`]: a file's extents (FIEMAP), checked to be plainly on the device, read
//!   through a queue pair from the raw namespace.
//! - [`gpu`]: queue pairs GPU threads drive (`kernels/gpuio_nvme.cuh`), their memory and the
//!   controller's doorbells registered with the GPU; [`ops`] launches the test and bench
//!   kernels ([`kernels`]: generated from `kernels.toml`).
//! - [`soft`]: a software controller served by a host thread, with injected faults, for where
//!   no NVMe is reachable (CI, and the GPU machine).
//! - [`kmod`]: a controller bound to gpuio's kernel module (`kmod/`) instead of VFIO: BAR0
//!   and DMA-coherent buffers from its character device.
//! - [`open`] (`pci`): a controller by PCI address, through the driver it is bound to.
//! - [`peer`]: another device's memory (a GPU's, as a dma-buf) mapped for a controller through
//!   the kernel module (Tier 2).
//! - [`tiers`]: which tiers of device-initiated IO this machine supports, and why not.
//! - `vfio` (cargo feature `vfio`): a real controller bound to `vfio-pci`, its BAR0
//!   mapped and its DMA through the IOMMU; tested in the QEMU guest (`cargo xtask qemu-nvme`).

#![deny(unsafe_op_in_unsafe_fn)]

mod controller;
pub mod dma;
pub mod extents;
pub mod gpu;
#[rustfmt::skip]
pub mod kernels;
pub mod kmod;
pub mod ops;
mod pci;
pub mod peer;
pub mod prp;
mod queue;
pub mod soft;
pub mod spec;
pub mod tiers;
#[cfg(feature = "vfio")]
pub mod vfio;

pub use controller::{BlockIo, Controller, ControllerOptions, IoQueuePair, Namespace};
pub use dma::{DmaBuffer, DmaMapper, DmaMemory, DmaTarget, IovaSpace, Mmio};
pub use extents::FileExtents;
pub use gpu::{GpuMappedBuffer, GpuNvmeOp, GpuQueuePair, NvmeQueueDevice};
pub use pci::{full_address, open};
pub use peer::PeerBuffer;
pub use soft::{CqeTamper, SoftConfig, SoftController, SoftFaults};
pub use spec::{Cap, ControllerIdentity, NamespaceIdentity, Status};
