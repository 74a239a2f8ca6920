//! Strided copies between two buffers of one device, many at once (`kernels/pieces.cu`): a
//! tensor-parallel load sends each device its part of every tensor (the rows of a slice along
//! one dim), and a checkpoint of thousands of tensors makes thousands of such parts, many of
//! them narrow rows. One call checks them all and runs them in one launch: a 2D copy engine
//! copy per part cost a driver call each and moved rows of a few hundred bytes far below the
//! memory's rate. The host backend copies row by row.

use super::op::{Access, CudaRun, DevArg, DeviceOp, HostRun, KernelArgs, LaunchShape};
use super::{DeviceBuffer, Stream};
use crate::error::{HalError, Result};
use crate::kernels::PiecesKernel;

/// One strided piece: `rows` rows of `width` bytes, row `i` read at
/// `src_offset + i * src_pitch` and written at `dst_offset + i * dst_pitch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Piece2d {
    /// Where the first row is read.
    pub src_offset: usize,
    /// Bytes from one source row's start to the next's.
    pub src_pitch: usize,
    /// Where the first row is written.
    pub dst_offset: usize,
    /// Bytes from one destination row's start to the next's.
    pub dst_pitch: usize,
    /// Bytes per row.
    pub width: usize,
    /// Rows.
    pub rows: usize,
}

impl Piece2d {
    /// Bytes from a side's first row's start to its last row's end; where rows would overlap
    /// each other (a pitch below the width), an error.
    fn span(&self, what: &'static str, pitch: usize) -> Result<usize> {
        if self.rows > 1 && pitch < self.width {
            return Err(HalError::InvalidArgument(format!(
                "{what}: a pitch of {pitch} bytes under rows of {}",
                self.width
            )));
        }
        self.rows
            .saturating_sub(1)
            .checked_mul(pitch)
            .and_then(|n| n.checked_add(self.width))
            .ok_or_else(|| HalError::InvalidArgument(format!("{what}: the piece's span overflows")))
    }
}

/// Bytes of a row a warp copies at a time: rows wider than this are cut into segments, so
/// that one wide piece spreads over the whole device.
const SEGMENT: u64 = 8192;

/// The kernel's `gpuio_piece`, six u64s: source and destination addresses, their pitches,
/// the width, and the piece's first segment.
const ROW_BYTES: usize = 48;

impl Stream {
    /// Copies every piece of `pieces` from `src`, a buffer of this stream's device, to `dst`,
    /// one of this device or of another GPU of the same backend, and waits. Every piece is
    /// checked before any of `dst` is written. Where this device's kernels reach `dst`
    /// ([`Gpu::kernels_reach`](super::Gpu::kernels_reach): peer access over NVLink or PCIe)
    /// its kernel writes there; else the span of `dst` the pieces write (from the first
    /// piece's start to the last one's end) is staged in a buffer of that size here, written,
    /// and copied back: bytes between the pieces keep the values they had when the call
    /// began, so another writer of those bytes during the call loses its write. Where
    /// destination rows of two pieces overlap, which piece's bytes land there is unspecified.
    pub fn copy_pieces(
        &self,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        pieces: &[Piece2d],
    ) -> Result<()> {
        let kept: Vec<Piece2d> = pieces
            .iter()
            .filter(|p| p.width > 0 && p.rows > 0)
            .copied()
            .collect();
        // One question to the driver decides the way (and gives the direct way its argument).
        match self.reachable_arg("piece destination", dst, 0, dst.len())? {
            Some(to) => self.copy_pieces_to(src, to, &kept),
            None => self.copy_pieces_staged(src, dst, &kept),
        }
    }

    /// [`copy_pieces`](Self::copy_pieces) into a device this one does not reach: the span
    /// the pieces write, read from `dst` into a buffer here, written, and put back.
    fn copy_pieces_staged(
        &self,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        kept: &[Piece2d],
    ) -> Result<()> {
        let mut span = (usize::MAX, 0usize);
        for p in kept {
            let end = p
                .span("piece destination", p.dst_pitch)?
                .checked_add(p.dst_offset)
                .ok_or_else(|| HalError::InvalidArgument("a piece's end overflows".into()))?;
            span = (span.0.min(p.dst_offset), span.1.max(end));
        }
        let Some(len) = span.1.checked_sub(span.0) else {
            return Ok(());
        };
        dst.range("piece destination", span.0, len)?;
        let from = self.arg("piece source", src, 0, src.len())?;
        for p in kept {
            from.part(p.src_offset, p.span("piece source", p.src_pitch)?)?;
        }
        let stage = self.gpu.alloc(len)?;
        self.copy_device(dst, span.0, &stage, 0, len)?;
        let rebased: Vec<Piece2d> = kept
            .iter()
            .map(|p| Piece2d {
                dst_offset: p.dst_offset - span.0,
                ..*p
            })
            .collect();
        self.copy_pieces_to(src, self.arg("piece staging", &stage, 0, len)?, &rebased)?;
        self.copy_device(&stage, 0, dst, span.0, len)
    }

    /// [`copy_pieces`](Self::copy_pieces) of non-empty pieces into `to`, memory this
    /// device's kernels reach.
    fn copy_pieces_to(&self, src: &DeviceBuffer, to: DevArg<'_>, kept: &[Piece2d]) -> Result<()> {
        let from = self.arg("piece source", src, 0, src.len())?;
        let (s, d) = (from.addr(), to.addr());
        if s < d.saturating_add(to.len() as u64) && d < s.saturating_add(from.len() as u64) {
            return Err(HalError::InvalidArgument(
                "strided pieces between overlapping buffers".into(),
            ));
        }
        let mut table = Vec::with_capacity(kept.len() * ROW_BYTES);
        let mut segments = 0u64;
        for p in kept {
            // Each side's span, checked against its buffer.
            from.part(p.src_offset, p.span("piece source", p.src_pitch)?)?;
            to.part(p.dst_offset, p.span("piece destination", p.dst_pitch)?)?;
            let words = [
                s + p.src_offset as u64,
                d + p.dst_offset as u64,
                p.src_pitch as u64,
                p.dst_pitch as u64,
                p.width as u64,
                segments,
            ];
            words.iter().for_each(|w| table.extend(w.to_le_bytes()));
            segments = (p.width as u64)
                .div_ceil(SEGMENT)
                .checked_mul(p.rows as u64)
                .and_then(|n| n.checked_add(segments))
                .ok_or_else(|| HalError::InvalidArgument("too many strided rows".into()))?;
        }
        if kept.is_empty() {
            return Ok(());
        }
        let count = u32::try_from(kept.len())
            .map_err(|_| HalError::InvalidArgument("over 2^32 strided pieces".into()))?;
        let table_buf = self.gpu.alloc(table.len())?;
        self.run(&Pieces {
            src: from,
            dst: to,
            pieces: kept,
            table: &table,
            table_arg: self.arg("piece table", &table_buf, 0, table.len())?,
            count,
            segments,
        })
    }
}

/// The checked pieces of one call, and their table as the kernel reads it.
struct Pieces<'a> {
    src: DevArg<'a>,
    dst: DevArg<'a>,
    pieces: &'a [Piece2d],
    table: &'a [u8],
    table_arg: DevArg<'a>,
    count: u32,
    segments: u64,
}

impl DeviceOp for Pieces<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        let _lock = host.lock(&[(self.src, Access::Read), (self.dst, Access::Write)])?;
        // SAFETY: checked ranges of live host-backend allocations that do not overlap, locked
        // (the destination exclusively) while the slices live.
        let (src, dst) = unsafe {
            (
                std::slice::from_raw_parts(self.src.host_ptr(), self.src.len()),
                std::slice::from_raw_parts_mut(self.dst.host_ptr(), self.dst.len()),
            )
        };
        let outside = || HalError::InvalidArgument("a strided piece left its buffer".into());
        for p in self.pieces {
            for i in 0..p.rows {
                let (a, b) = (
                    p.src_offset + i * p.src_pitch,
                    p.dst_offset + i * p.dst_pitch,
                );
                let row = src.get(a..a + p.width).ok_or_else(outside)?;
                dst.get_mut(b..b + p.width)
                    .ok_or_else(outside)?
                    .copy_from_slice(row);
            }
        }
        Ok(())
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let wait = super::op::WaitOnDrop::new(cuda);
        // SAFETY: `table` outlives the synchronize below, which waits for the copy.
        unsafe { cuda.upload(self.table.as_ptr(), self.table_arg)? };
        // A warp a segment, 8 warps a block, at most 4096 blocks striding over the rest.
        let blocks = self.segments.div_ceil(8).min(4096) as u32;
        let args = KernelArgs::new().ptr(&self.table_arg).u32(self.count);
        let args = args.u64(self.segments).u64(SEGMENT);
        // SAFETY: the arguments match gpuio_copy_pieces(const gpuio_piece*, u32, u64, u64);
        // the table holds `count` rows of ROW_BYTES in the kernel's layout, whose segments
        // number `segments`; every row of every piece was checked to lie inside `src` or
        // `dst`, live ranges that do not overlap, of this device or one whose memory it
        // reaches (peer access, enabled when the devices were opened), borrowed until the
        // wait.
        unsafe {
            cuda.launch(
                PiecesKernel::CopyPieces,
                LaunchShape::threads(blocks * 256, 256),
                &args,
            )?
        };
        wait.wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::{BackendPreference, probe};

    /// The staged way (a device that cannot reach the destination's) writes what the direct
    /// way writes and keeps the bytes between pieces; the host backend's devices all reach
    /// each other, so only this test takes it there.
    #[test]
    fn staged_pieces_write_what_direct_ones_write() {
        let gpu = probe(BackendPreference::Host).unwrap().gpus.remove(0);
        let stream = gpu.stream().unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 13 % 251) as u8).collect();
        let src = gpu.alloc(8192).unwrap();
        stream.upload(&data, &src, 0).unwrap();
        let pieces = [
            Piece2d {
                src_offset: 16,
                src_pitch: 64,
                dst_offset: 1000,
                dst_pitch: 40,
                width: 24,
                rows: 16,
            },
            Piece2d {
                src_offset: 3001,
                src_pitch: 0,
                dst_offset: 2000,
                dst_pitch: 0,
                width: 777,
                rows: 1,
            },
            Piece2d {
                src_offset: 0,
                src_pitch: 0,
                dst_offset: 0,
                dst_pitch: 0,
                width: 0,
                rows: 3,
            },
        ];
        let mut got = Vec::new();
        for staged in [false, true] {
            let dst = gpu.alloc(8192).unwrap();
            stream.upload(&[0xEE; 8192], &dst, 0).unwrap();
            let kept = &pieces[..2];
            if staged {
                stream.copy_pieces_staged(&src, &dst, kept).unwrap();
            } else {
                stream.copy_pieces(&src, &dst, &pieces).unwrap();
            }
            let mut out = vec![0; 8192];
            stream.download(&dst, 0, &mut out).unwrap();
            got.push(out);
        }
        let mut want = vec![0xEE; 8192];
        for p in &pieces {
            for i in 0..p.rows {
                let row = &data[p.src_offset + i * p.src_pitch..][..p.width];
                want[p.dst_offset + i * p.dst_pitch..][..p.width].copy_from_slice(row);
            }
        }
        assert!(got[0] == want, "direct pieces");
        assert!(got[1] == want, "staged pieces, the bytes between them kept");
        let past = Piece2d {
            dst_offset: 8000,
            ..pieces[1]
        };
        let dst = gpu.alloc(8192).unwrap();
        assert!(stream.copy_pieces_staged(&src, &dst, &[past]).is_err());
    }
}
