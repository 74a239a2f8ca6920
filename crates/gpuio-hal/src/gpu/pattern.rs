//! The data pattern on the device (`kernels/pattern.cu`), as ops: [`Stream::fill_pattern`]
//! writes it, [`Stream::find_mismatch`] compares two ranges. The host backend does the same
//! with [`crate::pattern`] over the locked ranges.

use super::op::{Access, CudaRun, DevArg, DeviceOp, HostRun, KernelArgs};
use super::{DeviceBuffer, Stream};
use crate::error::Result;
use crate::kernels::PatternKernel;

impl Stream {
    /// Runs the pattern-fill kernel over `dst[offset..offset+len]` and waits for it: byte `i`
    /// of the range becomes [`crate::pattern::byte_at`]`(seed, offset + i)`, the same bytes
    /// [`crate::pattern::fill`] writes on the CPU.
    pub fn fill_pattern(
        &self,
        dst: &DeviceBuffer,
        offset: usize,
        len: usize,
        seed: u64,
    ) -> Result<()> {
        let dst = self.arg("pattern destination", dst, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.run(&Fill {
            dst,
            first: offset as u64,
            seed,
        })
    }

    /// Compares `len` bytes of two buffers of this device on the device; returns the first
    /// offset where they differ. Waits for the stream's earlier work first.
    pub fn find_mismatch(
        &self,
        a: &DeviceBuffer,
        a_offset: usize,
        b: &DeviceBuffer,
        b_offset: usize,
        len: usize,
    ) -> Result<Option<u64>> {
        let a = self.arg("compared range", a, a_offset, len)?;
        let b = self.arg("compared range", b, b_offset, len)?;
        if len == 0 {
            return Ok(None);
        }
        let out = self.gpu.alloc(8)?;
        let first = self.run(&Compare {
            a,
            b,
            out: self.arg("compare result", &out, 0, 8)?,
        })?;
        Ok(first.filter(|&i| i != u64::MAX))
    }
}

/// Pattern bytes `first..first + dst.len()` of `seed` into `dst`.
struct Fill<'a> {
    dst: DevArg<'a>,
    first: u64,
    seed: u64,
}

impl DeviceOp for Fill<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        let _lock = host.lock(&[(self.dst, Access::Write)])?;
        // SAFETY: a checked range of a live host-backend allocation, held exclusively for
        // this slice's life.
        let out = unsafe { std::slice::from_raw_parts_mut(self.dst.host_ptr(), self.dst.len()) };
        crate::pattern::fill(out, self.first, self.seed);
        Ok(())
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let len = self.dst.len() as u64;
        let words = (self.first + len).div_ceil(8) - self.first / 8;
        let args = KernelArgs::new().ptr(&self.dst).u64(len);
        let args = args.u64(self.first).u64(self.seed);
        // SAFETY: the arguments match gpuio_fill_pattern(u8*, u64, u64, u64); dst is a
        // checked range of a live allocation, borrowed until the synchronize below; the
        // kernel writes only inside it.
        unsafe { cuda.launch(PatternKernel::FillPattern, cuda.grid_stride(words), &args)? };
        cuda.synchronize()
    }
}

/// The first offset where `a` and `b` (of equal length) differ; `out` is 8 bytes of scratch.
struct Compare<'a> {
    a: DevArg<'a>,
    b: DevArg<'a>,
    out: DevArg<'a>,
}

impl DeviceOp for Compare<'_> {
    type Output = Option<u64>;

    fn host(&self, host: &HostRun<'_>) -> Result<Option<u64>> {
        let _lock = host.lock(&[(self.a, Access::Read), (self.b, Access::Read)])?;
        // SAFETY: checked ranges of live host-backend allocations, locked for reading while
        // the slices live.
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts(self.a.host_ptr(), self.a.len()),
                std::slice::from_raw_parts(self.b.host_ptr(), self.b.len()),
            )
        };
        Ok(crate::pattern::first_mismatch(x, y).map(|i| i as u64))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<Option<u64>> {
        let first = self.compare(cuda);
        if first.is_err() {
            // The kernel may still be queued: drain before the caller frees `out`.
            let _ = cuda.synchronize();
        }
        first
    }
}

impl Compare<'_> {
    fn compare(&self, cuda: &CudaRun<'_>) -> Result<Option<u64>> {
        let none = u64::MAX.to_le_bytes();
        // SAFETY: `none` outlives the synchronize below, which waits for the copy.
        unsafe { cuda.upload(none.as_ptr(), self.out)? };
        let len = self.a.len() as u64;
        let args = KernelArgs::new().ptr(&self.a).ptr(&self.b);
        let args = args.u64(len).ptr(&self.out);
        let shape = cuda.grid_stride(len.div_ceil(16));
        // SAFETY: the arguments match gpuio_find_mismatch(const u8*, const u8*, u64, u64*);
        // the ranges are checked and borrowed until the synchronize below; the kernel writes
        // only the 8 bytes of `out`.
        unsafe { cuda.launch(PatternKernel::FindMismatch, shape, &args)? };
        let mut first = [0u8; 8];
        // SAFETY: `first` is 8 writable bytes, read only after the synchronize below.
        unsafe { cuda.download(self.out, first.as_mut_ptr())? };
        cuda.synchronize()?;
        Ok(Some(u64::from_le_bytes(first)))
    }
}
