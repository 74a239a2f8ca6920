//! Kernels that drive NVMe queue pairs from GPU threads (`kernels/nvme.cu`), as ops: checked
//! reads, pattern writes and flushes on [`GpuQueuePair`]s, and the layout report the GPU test
//! compares with [`layout_words`]. The host backend runs no kernels; its driver is
//! [`super::IoQueuePair`] on host threads.

use super::Namespace;
use super::gpu::{GpuMappedBuffer, GpuNvmeOp, GpuQueuePair, layout_words};
use crate::kernels::NvmeKernel;
use gpuio_hal::error::{HalError, Result, check_range};
use gpuio_hal::gpu::{
    CudaRun, DevArg, DeviceBuffer, DeviceOp, HostRun, KernelArgs, LaunchShape, Stream,
};

/// Threads per block of the NVMe kernels.
const THREADS: u32 = 128;

const NO_KERNELS: &str = "IoQueuePair drives the queues from host threads";

/// GPU threads submit `count` commands, command `i` at LBA `lbas[i]` (u64s on this device;
/// not read for flushes) of `blocks` blocks of `ns` (up to the controller's transfer limit;
/// the GPU writes a PRP list where a command spans more than two pages), on `queues` (block
/// `b` of the grid using `queues[b % len]`), with `grid` blocks of 128 threads.
/// Each warp's data slots (32 of `blocks` blocks each) lie in `data` in warp order, so it must
/// hold `grid * 4 * 32` slots. Command `i`'s status field goes to `statuses[i]` (u32, 0
/// success); the 8-byte words a checked read found wrong are returned. Waits for the kernel;
/// a controller must be serving the queues. A batch that got no completion in time breaks its
/// pair for good: this then disables the controller and fails.
#[allow(clippy::too_many_arguments)]
pub fn io(
    stream: &Stream,
    queues: &[&GpuQueuePair],
    op: GpuNvmeOp,
    ns: &Namespace,
    lbas: &DeviceBuffer,
    count: usize,
    blocks: u32,
    data: &GpuMappedBuffer<'_>,
    statuses: &DeviceBuffer,
    grid: u32,
) -> Result<u64> {
    let gpu = stream.gpu();
    if queues.is_empty() || queues.iter().any(|q| !q.gpu().same_device(gpu)) {
        return Err(HalError::InvalidArgument(
            "GPU NVMe IO needs queue pairs of the stream's GPU".into(),
        ));
    }
    let block_bytes = ns.identity.block_size;
    let bytes = if op == GpuNvmeOp::Flush {
        0
    } else {
        blocks as usize * block_bytes as usize
    };
    // One command moves at most what every pair's controller takes and one PRP list
    // page names.
    let max = queues.iter().map(|q| q.max_transfer()).min().unwrap_or(0);
    if op != GpuNvmeOp::Flush && (bytes == 0 || bytes > max) {
        return Err(HalError::InvalidArgument(format!(
            "a GPU-issued NVMe command moves 1 block to {max} bytes, not {blocks} blocks of \
             {block_bytes} bytes"
        )));
    }
    let grid = grid.max(1);
    let slots = grid as usize * (THREADS as usize / 32) * 32;
    let slot_bytes = slots
        .checked_mul(bytes)
        .ok_or_else(|| HalError::InvalidArgument("GPU NVMe data slots overflow".into()))?;
    check_range("GPU NVMe data slots", 0, slot_bytes, data.len)?;
    let descriptors: Vec<u8> = queues.iter().flat_map(|q| q.descriptor_bytes()).collect();
    let table = gpu.alloc(descriptors.len())?;
    stream.upload(&descriptors, &table, 0)?;
    let mismatches = gpu.alloc(8)?;
    stream.upload(&[0u8; 8], &mismatches, 0)?;
    let (opcode, seed) = match op {
        GpuNvmeOp::Flush => (crate::spec::io::FLUSH, 0),
        GpuNvmeOp::ReadChecked(s) => (crate::spec::io::READ, s),
        GpuNvmeOp::WritePattern(s) => (crate::spec::io::WRITE, s),
    };
    stream.run(&Io {
        queues: stream.arg("NVMe queue table", &table, 0, descriptors.len())?,
        nqueues: queues.len() as u32,
        opcode: opcode as u32,
        nsid: ns.nsid,
        // A flush reads no LBA.
        lbas: stream.arg(
            "NVMe LBAs",
            lbas,
            0,
            if op == GpuNvmeOp::Flush {
                0
            } else {
                count.saturating_mul(8)
            },
        )?,
        count: count as u64,
        blocks,
        block_bytes,
        data_iova: data.iova,
        data: data.addr,
        seed,
        statuses: stream.arg("NVMe statuses", statuses, 0, count.saturating_mul(4))?,
        mismatches: stream.arg("NVMe mismatches", &mismatches, 0, 8)?,
        grid,
        _borrowed: (queues, data),
    })?;
    for q in queues {
        q.check_broken(stream)?;
    }
    Ok(stream.download_u64s(&mismatches, 1)?[0])
}

/// The NVMe layouts as this device's compiler sees them, in [`layout_words`] order.
pub fn device_layout_words(stream: &Stream) -> Result<Vec<u64>> {
    let n = layout_words().len();
    // SAFETY: gpuio_nvme_layout takes one u64* and writes layout_words().len() u64s.
    unsafe {
        gpuio_hal::gpu::report_words(
            stream,
            NvmeKernel::NvmeLayout,
            n,
            "the NVMe layout report",
            NO_KERNELS,
        )
    }
}

/// `gpuio_nvme_io`'s launch: `count` commands on the queue pairs whose descriptors `queues`
/// holds, data in host memory at device address `data` (IO address `data_iova`).
struct Io<'a> {
    queues: DevArg<'a>,
    nqueues: u32,
    opcode: u32,
    nsid: u32,
    lbas: DevArg<'a>,
    count: u64,
    blocks: u32,
    block_bytes: u32,
    data_iova: u64,
    data: u64,
    seed: u64,
    statuses: DevArg<'a>,
    mismatches: DevArg<'a>,
    grid: u32,
    /// Borrowed so that the pairs' memory, their doorbells and the data stay registered
    /// while the kernel runs.
    _borrowed: (&'a [&'a GpuQueuePair], &'a GpuMappedBuffer<'a>),
}

impl DeviceOp for Io<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(host.no_kernels("GPU-driven NVMe queues", NO_KERNELS))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let args = KernelArgs::new()
            .ptr(&self.queues)
            .u32(self.nqueues)
            .u32(self.opcode)
            .u32(self.nsid)
            .ptr(&self.lbas)
            .u64(self.count)
            .u32(self.blocks)
            .u32(self.block_bytes)
            .u64(self.data_iova)
            .u64(self.data)
            .u64(self.seed)
            .ptr(&self.statuses)
            .ptr(&self.mismatches);
        let shape = LaunchShape {
            grid: self.grid,
            ..LaunchShape::threads(THREADS, THREADS)
        };
        // SAFETY: the arguments match gpuio_nvme_io; the kernel reads the checked descriptor
        // and LBA ranges, writes the checked status and mismatch ranges and, through the
        // descriptors, queue memory, doorbells and data memory that `_borrowed` keeps
        // registered until the synchronize below; each warp touches only its own data slots,
        // which `io` checked fit `data`.
        unsafe { cuda.launch(NvmeKernel::NvmeIo, shape, &args)? };
        cuda.synchronize()
    }
}
