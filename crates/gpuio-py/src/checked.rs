//! Host bytes checked in pieces: the crc32c of each piece of a buffer, and a copy between a
//! gpuio host buffer and lent memory that checks its pieces as it goes, on several threads;
//! the GIL released for both. What the LMCache connector stores and loads chunks by: a 32 MiB
//! chunk copied and checked on one thread takes ~5 ms, a memcpy on many ~1 ms. A copy checks
//! each 64 KiB block right after copying it, while the block is still in cache.

use crate::buffers::HostBuffer;
use crate::error::{invalid, to_py};
use crate::lent::Lent;
use pyo3::prelude::*;

/// Threads one call uses at most.
const MAX_THREADS: usize = 8;

/// Each `piece` bytes of `src` copied into `dst` (where given) and checked: their crc32cs,
/// in order. A copy's pieces go to up to `MAX_THREADS` scoped threads, a run of pieces each;
/// a check alone runs on the caller's thread (its callers check many chunks at once already,
/// and more threads each made the H200's file stores 3x slower).
fn pieces(src: &[u8], dst: Option<&mut [u8]>, piece: usize) -> Vec<u32> {
    let n = src.len().div_ceil(piece);
    let mut crcs = vec![0u32; n];
    let threads = match dst {
        Some(_) => std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, MAX_THREADS)
            .min(n.max(1)),
        None => 1,
    };
    let per = n.div_ceil(threads).max(1);
    let srcs: Vec<&[u8]> = src.chunks(piece).collect();
    let mut dsts: Vec<Option<&mut [u8]>> = match dst {
        Some(d) => d.chunks_mut(piece).map(Some).collect(),
        None => (0..n).map(|_| None).collect(),
    };
    let run = |srcs: &[&[u8]], dsts: &mut [Option<&mut [u8]>], crcs: &mut [u32]| {
        for ((s, d), c) in srcs.iter().zip(dsts.iter_mut()).zip(crcs.iter_mut()) {
            *c = match d {
                Some(d) => copy_and_check(s, d),
                None => ::crc32c::crc32c(s),
            };
        }
    };
    if threads <= 1 {
        run(&srcs, &mut dsts, &mut crcs);
        return crcs;
    }
    std::thread::scope(|scope| {
        for ((s, d), c) in srcs
            .chunks(per)
            .zip(dsts.chunks_mut(per))
            .zip(crcs.chunks_mut(per))
        {
            scope.spawn(move || run(s, d, c));
        }
    });
    crcs
}

/// Bytes copied, then checked while they are still in the core's cache: one pass over
/// memory, where a whole piece copied and then checked is read from memory twice.
const BLOCK: usize = 64 << 10;

/// Copies `src` into `dst` (the same length) and returns `src`'s crc32c.
fn copy_and_check(src: &[u8], dst: &mut [u8]) -> u32 {
    debug_assert_eq!(src.len(), dst.len());
    src.chunks(BLOCK)
        .zip(dst.chunks_mut(BLOCK))
        .fold(0, |crc, (s, d)| {
            d.copy_from_slice(s);
            ::crc32c::crc32c_append(crc, s)
        })
}

fn piece_size(piece: usize) -> PyResult<usize> {
    if piece == 0 {
        return Err(invalid("a piece is at least one byte"));
    }
    Ok(piece)
}

/// The crc32c of each `piece` bytes of `data` (a byte buffer), in order.
#[pyfunction]
pub(crate) fn crc32c_pieces(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    piece: usize,
) -> PyResult<Vec<u32>> {
    let piece = piece_size(piece)?;
    let lent = Lent::of(data)?;
    Ok(py.detach(|| pieces(lent.bytes(), None, piece)))
}

/// Copies all of `other` (a byte buffer Python lends) into `host` at `offset` (`to_host`), or
/// that many bytes of `host` at `offset` into `other`, and returns the crc32c of each `piece`
/// bytes copied, in order.
#[pyfunction]
pub(crate) fn copy_checked(
    py: Python<'_>,
    host: &HostBuffer,
    offset: usize,
    other: &Bound<'_, PyAny>,
    to_host: bool,
    piece: usize,
) -> PyResult<Vec<u32>> {
    let piece = piece_size(piece)?;
    let mut lent = Lent::of(other)?;
    let mem = &host.mem;
    if to_host {
        let src = lent.bytes();
        py.detach(|| {
            let mut dst = mem
                .write_range(offset, src.len())
                .map_err(|e| to_py(e.into()))?;
            Ok(pieces(src, Some(&mut dst), piece))
        })
    } else {
        let dst = lent.bytes_mut()?;
        py.detach(|| {
            let src = mem
                .read_range(offset, dst.len())
                .map_err(|e| to_py(e.into()))?;
            Ok(pieces(&src, Some(dst), piece))
        })
    }
}
