//! Host bytes checked in pieces: the crc32c of each piece of a buffer, and a copy between a
//! gpuio host buffer and lent memory that checks its pieces as it goes, on a team of threads;
//! the GIL released for both. What the LMCache connector stores and loads chunks by (32 MiB
//! chunks, a batch of them from several Python threads at once). A copy checks each 64 KiB
//! block right before copying it, while the block is in cache: one pass over memory.

use crate::buffers::HostBuffer;
use crate::error::{invalid, to_py};
use crate::lent::Lent;
use pyo3::prelude::*;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Copies of at least this many bytes write with streaming stores: their destination goes to
/// a GPU by DMA or is read much later, and on the H200's host a copy of a 32 MiB chunk ran
/// 1.3-1.5x faster so (a smaller one may still be read from the cache).
const STREAM_FROM: usize = 1 << 20;

/// The threads that copy pieces: one per CPU, shared by every call, so that a batch's
/// chunks copied from several Python threads at once share the cores instead of each
/// starting threads of its own. None in a forked child (its parent's threads are not there;
/// no lock is taken after the team is made, so a fork cannot leave one held) and where they
/// could not be started: the caller's thread copies then.
fn team() -> Option<&'static rayon::ThreadPool> {
    static TEAM: OnceLock<Option<(u32, rayon::ThreadPool)>> = OnceLock::new();
    let made = TEAM.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(gpuio_hal::sys::cpu_count())
            .thread_name(|i| format!("gpuio-copy-{i}"))
            .build()
            .ok()
            .map(|pool| (std::process::id(), pool))
    });
    match made {
        Some((pid, pool)) if *pid == std::process::id() => Some(pool),
        _ => None,
    }
}

/// Each job's `src` copied into its `dst` (the same length) and checked in pieces of
/// `piece` bytes: every job's piece crc32cs, in order. The pieces of all the jobs go to the
/// team together.
fn copy_pieces(jobs: Vec<(&[u8], &mut [u8])>, piece: usize) -> Vec<Vec<u32>> {
    let counts: Vec<usize> = jobs.iter().map(|(s, _)| s.len().div_ceil(piece)).collect();
    let tasks: Vec<(&[u8], &mut [u8], bool)> = jobs
        .into_iter()
        .flat_map(|(s, d)| {
            let streaming = s.len() >= STREAM_FROM;
            s.chunks(piece)
                .zip(d.chunks_mut(piece))
                .map(move |(s, d)| (s, d, streaming))
        })
        .collect();
    let copy = |(s, d, streaming): (&[u8], &mut [u8], bool)| copy_and_check(s, d, streaming);
    let crcs: Vec<u32> = match team() {
        Some(team) if tasks.len() > 1 => team.install(|| tasks.into_par_iter().map(copy).collect()),
        _ => tasks.into_iter().map(copy).collect(),
    };
    let mut crcs = crcs.into_iter();
    counts
        .into_iter()
        .map(|n| crcs.by_ref().take(n).collect())
        .collect()
}

/// Bytes checked, then copied while they are still in the core's cache.
const BLOCK: usize = 64 << 10;

/// Copies `src` into `dst` (the same length), with streaming stores where asked, and
/// returns `src`'s crc32c.
fn copy_and_check(src: &[u8], dst: &mut [u8], streaming: bool) -> u32 {
    debug_assert_eq!(src.len(), dst.len());
    src.chunks(BLOCK)
        .zip(dst.chunks_mut(BLOCK))
        .fold(0, |crc, (s, d)| {
            let crc = ::crc32c::crc32c_append(crc, s);
            if streaming {
                gpuio_hal::copy_streaming(d, s);
            } else {
                d.copy_from_slice(s);
            }
            crc
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
    // On the caller's thread: its callers check many chunks at once already, and more
    // threads each made the H200's file stores 3x slower.
    Ok(py.detach(|| lent.bytes().chunks(piece).map(::crc32c::crc32c).collect()))
}

/// For each `(offset, buffer)` of `jobs` (a byte buffer Python lends): all of the buffer
/// copied into `host` at `offset` (`to_host`), or that many bytes of `host` at `offset` copied
/// into the buffer. Returns each job's crc32cs of every `piece` bytes copied, in order. A
/// batch's chunks in one call: the range of `host` they span is locked once (shared to read
/// from it, exclusive to write), and their pieces share the team. Jobs writing the same bytes
/// are refused.
#[pyfunction]
pub(crate) fn copy_checked(
    py: Python<'_>,
    host: &HostBuffer,
    jobs: Vec<(usize, Bound<'_, PyAny>)>,
    to_host: bool,
    piece: usize,
) -> PyResult<Vec<Vec<u32>>> {
    let piece = piece_size(piece)?;
    let mut lent = jobs
        .iter()
        .map(|(offset, buf)| Ok((*offset, Lent::of(buf)?)))
        .collect::<PyResult<Vec<_>>>()?;
    let ranges: Vec<(usize, usize)> = lent.iter().map(|(o, l)| (*o, l.span().1)).collect();
    let Some((start, end)) = span(&ranges)? else {
        return Ok(Vec::new());
    };
    let mem = &host.mem;
    if to_host {
        let srcs: Vec<&[u8]> = lent.iter().map(|(_, l)| l.bytes()).collect();
        py.detach(|| {
            let mut range = mem
                .write_range(start, end - start)
                .map_err(|e| to_py(e.into()))?;
            let dsts = carve(&mut range, start, &ranges)?;
            Ok(copy_pieces(srcs.into_iter().zip(dsts).collect(), piece))
        })
    } else {
        // Checked before any two `&mut` slices of one buffer could exist.
        disjoint(lent.iter().map(|(_, l)| l.span()), "a copy's destinations")?;
        let dsts = lent
            .iter_mut()
            .map(|(_, l)| l.bytes_mut())
            .collect::<PyResult<Vec<_>>>()?;
        py.detach(|| {
            let range = mem
                .read_range(start, end - start)
                .map_err(|e| to_py(e.into()))?;
            let srcs = ranges
                .iter()
                .map(|&(o, n)| &range[o - start..o - start + n]);
            Ok(copy_pieces(srcs.zip(dsts).collect(), piece))
        })
    }
}

/// The bytes `(offset, len)` ranges span, from the first to the end of the last; None where
/// there are none.
fn span(ranges: &[(usize, usize)]) -> PyResult<Option<(usize, usize)>> {
    let mut out: Option<(usize, usize)> = None;
    for &(o, n) in ranges {
        let end = o
            .checked_add(n)
            .ok_or_else(|| invalid(format!("{n} bytes at offset {o} run past any buffer")))?;
        out = Some(out.map_or((o, end), |(s, e)| (s.min(o), e.max(end))));
    }
    Ok(out)
}

/// Refuses `(start, len)` ranges of which two share a byte.
fn disjoint(ranges: impl Iterator<Item = (usize, usize)>, what: &str) -> PyResult<()> {
    let spans = ranges.map(|(at, len)| (at as u64, len)).collect();
    gpuio_hal::gpu::check_disjoint(spans, what).map_err(|e| to_py(e.into()))
}

/// `range` (the bytes from `start`) cut into one slice per `(offset, len)` of `ranges`, in
/// their order; refused where two share a byte.
fn carve<'a>(
    range: &'a mut [u8],
    start: usize,
    ranges: &[(usize, usize)],
) -> PyResult<Vec<&'a mut [u8]>> {
    disjoint(ranges.iter().copied(), "a copy's chunks in host memory")?;
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_unstable_by_key(|&i| ranges[i].0);
    let mut out: Vec<Option<&'a mut [u8]>> = ranges.iter().map(|_| None).collect();
    let (mut rest, mut at) = (range, start);
    for i in order {
        let (o, n) = ranges[i];
        if n == 0 {
            out[i] = Some(Default::default());
            continue;
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(o - at);
        let (mine, tail) = tail.split_at_mut(n);
        out[i] = Some(mine);
        (rest, at) = (tail, o + n);
    }
    Ok(out.into_iter().flatten().collect())
}
