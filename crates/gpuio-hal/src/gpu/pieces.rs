//! Strided copies between two buffers of one device, many at once: a tensor-parallel load
//! sends each device its part of every tensor (the rows of a slice along one dim), and a
//! checkpoint of thousands of tensors makes thousands of such parts. One call checks them all
//! and queues one driver copy each, where a copy per part from Python cost ~100 µs.

use super::DeviceBuffer;
use super::stream::Stream;
use crate::error::{HalError, Result};

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

impl Stream {
    /// Copies every piece of `pieces` from `src` to `dst`, both on this stream's device and
    /// apart from each other, and waits. Every piece is checked before any is queued.
    pub fn copy_pieces(
        &self,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        pieces: &[Piece2d],
    ) -> Result<()> {
        self.gpu.check_owns("piece source", src)?;
        self.gpu.check_owns("piece destination", dst)?;
        let (s, d) = (src.device_addr(), dst.device_addr());
        if s < d.saturating_add(dst.len() as u64) && d < s.saturating_add(src.len() as u64) {
            return Err(HalError::InvalidArgument(
                "strided pieces between overlapping buffers".into(),
            ));
        }
        let mut ranges = Vec::with_capacity(pieces.len());
        for p in pieces.iter().filter(|p| p.width > 0 && p.rows > 0) {
            let from = p.span("piece source", p.src_pitch)?;
            let to = p.span("piece destination", p.dst_pitch)?;
            ranges.push((
                src.range("piece source", p.src_offset, from)?,
                dst.range("piece destination", p.dst_offset, to)?,
                p,
            ));
        }
        for (from, to, p) in ranges {
            // SAFETY: both ranges were checked against the live buffers, which the borrows
            // keep until the synchronize below (also where a piece fails), and the buffers
            // do not overlap.
            let queued = unsafe {
                self.inner
                    .copy_rows(from, p.src_pitch, to, p.dst_pitch, p.width, p.rows)
            };
            if let Err(e) = queued {
                // The pieces queued before it still write `dst`: done before the borrow ends.
                let _ = self.inner.synchronize();
                return Err(e);
            }
        }
        self.inner.synchronize()
    }
}
