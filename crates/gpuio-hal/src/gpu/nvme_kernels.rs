//! Kernels that drive NVMe queue pairs from GPU threads (`kernels/nvme.cu`): checked reads,
//! pattern writes and flushes on [`GpuQueuePair`]s, and the layout report the GPU test
//! compares with [`crate::nvme::gpu::layout_words`]. The host backend refuses them.

use super::DeviceBuffer;
use super::Stream;
use super::backend::NvmeLaunch;
use crate::error::{HalError, Result, check_range};
use crate::nvme::Namespace;
use crate::nvme::gpu::{GpuMappedBuffer, GpuNvmeOp, GpuQueuePair, layout_words};

/// Threads per block of the NVMe kernels.
const THREADS: u32 = 128;

impl Stream {
    /// GPU threads submit `count` commands, command `i` at LBA `lbas[i]` (u64s on this
    /// device; not read for flushes) of `blocks` blocks of `ns` (up to the controller's
    /// transfer limit; the GPU writes a PRP list where a command spans more than two pages),
    /// on `queues` (block `b` of the grid using `queues[b % len]`), with `grid` blocks of 128
    /// threads.
    /// Each warp's data slots (32 of `blocks` blocks each) lie in `data` in warp order, so it
    /// must hold `grid * 4 * 32` slots. Command `i`'s status field goes to `statuses[i]` (u32,
    /// 0 success); the 8-byte words a checked read found wrong are returned. Waits for the
    /// kernel; a controller must be serving the queues. A batch that got no completion in
    /// time breaks its pair for good: this then disables the controller and fails.
    #[allow(clippy::too_many_arguments)]
    pub fn nvme_io(
        &self,
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
        let gpu = &self.gpu;
        if queues.is_empty() || queues.iter().any(|q| !q.gpu().same_device(gpu)) {
            return Err(HalError::InvalidArgument(
                "GPU NVMe IO needs queue pairs of the stream's GPU".into(),
            ));
        }
        for b in [lbas, statuses] {
            gpu.check_owns("NVMe kernel buffer", b)?;
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
        self.upload(&descriptors, &table, 0)?;
        let mismatches = gpu.alloc(8)?;
        self.upload(&[0u8; 8], &mismatches, 0)?;
        let (opcode, seed) = match op {
            GpuNvmeOp::Flush => (crate::nvme::spec::io::FLUSH, 0),
            GpuNvmeOp::ReadChecked(s) => (crate::nvme::spec::io::READ, s),
            GpuNvmeOp::WritePattern(s) => (crate::nvme::spec::io::WRITE, s),
        };
        let launch = NvmeLaunch::Io {
            queues: table.range("NVMe queue table", 0, descriptors.len())?,
            nqueues: queues.len() as u32,
            opcode: opcode as u32,
            nsid: ns.nsid,
            // A flush reads no LBA.
            lbas: lbas.range(
                "NVMe LBAs",
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
            statuses: statuses.range("NVMe statuses", 0, count.saturating_mul(4))?,
            mismatches: mismatches.range("NVMe mismatches", 0, 8)?,
            grid,
            threads: THREADS,
        };
        // SAFETY: the queue pairs (their memory pinned, their doorbells' register file pinned
        // by their controller) and `data` are borrowed until this synchronous call returns.
        unsafe { self.inner.nvme_kernel(launch)? };
        for q in queues {
            q.check_broken(self)?;
        }
        Ok(self.download_u64s(&mismatches, 1)?[0])
    }

    /// The NVMe layouts as this device's compiler sees them, in [`layout_words`] order.
    pub fn nvme_layout_words(&self) -> Result<Vec<u64>> {
        let n = layout_words().len();
        let out = self.gpu.alloc(n * 8)?;
        let launch = NvmeLaunch::Layout {
            out: out.range("NVMe layout", 0, n * 8)?,
        };
        // SAFETY: no queue memory is involved; `out` lives until after the download.
        unsafe { self.inner.nvme_kernel(launch)? };
        self.download_u64s(&out, n)
    }
}
