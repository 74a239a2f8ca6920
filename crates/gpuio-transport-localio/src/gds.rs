//! The GPUDirect Storage engine: cuFile reads and writes straight between files and GPU
//! memory, a chunk per call, spread over the transfer's threads (cuFile's own calls are
//! synchronous, so parallel calls are what keep the device busy — as kvikio does).

use crate::file::FileHandle;
use crate::plan::{Chunk, Plan};
use crate::{LocalIoError, Result};
use gpuio_hal::{DeviceBuffer, GdsFile, HalError};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Registrations of a transfer's files, in plan order.
pub(crate) fn register(files: &[&FileHandle], gpu: &gpuio_hal::Gpu) -> Result<Vec<Arc<GdsFile>>> {
    files.iter().map(|f| f.gds_file(gpu)).collect()
}

/// A cuFile error on `file` at `offset`, as LocalIO reports IO errors.
fn io_error(file: &FileHandle, op: &'static str, offset: u64, e: HalError) -> LocalIoError {
    match e {
        HalError::Os { source, .. } => file.io(op, offset, source),
        other => LocalIoError::Hal(other),
    }
}

/// Reads chunks of `plan` until they run out (or `abort` is set by a failing thread).
pub(crate) fn read(
    files: &[&FileHandle],
    gds: &[Arc<GdsFile>],
    plan: &Plan,
    dst: &DeviceBuffer,
    dst_offset: usize,
    abort: &AtomicBool,
) -> Result<()> {
    each_chunk(files, gds, plan, abort, |file, reg, c| {
        let got = reg
            .read(c.start(), dst, dst_offset + c.dev_off, c.len)
            .map_err(|e| io_error(file, "read", c.start(), e))?;
        if got < c.len {
            return Err(file.eof(c.start(), c.len, got));
        }
        Ok(())
    })
}

/// Writes chunks of `plan` until they run out (or `abort` is set), counting confirmed bytes
/// in `written`.
pub(crate) fn write(
    files: &[&FileHandle],
    gds: &[Arc<GdsFile>],
    plan: &Plan,
    src: &DeviceBuffer,
    src_offset: usize,
    written: &AtomicUsize,
    abort: &AtomicBool,
) -> Result<()> {
    each_chunk(files, gds, plan, abort, |file, reg, c| {
        let result = reg.write(src, src_offset + c.dev_off, c.len, c.start());
        let before = written.load(Ordering::Relaxed);
        match result {
            Ok(n) if n == c.len => {
                written.fetch_add(n, Ordering::Relaxed);
                Ok(())
            }
            Ok(n) => Err(file.no_space(c.start(), c.len, before + n)),
            Err(HalError::Os { source, .. })
                if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) =>
            {
                Err(file.no_space(c.start(), c.len, before))
            }
            Err(e) => Err(io_error(file, "write", c.start(), e)),
        }
    })
}

/// Claims chunks of `plan` and runs `io` on each, with its file and registration, until
/// they run out, `abort` is set, or `io` fails.
fn each_chunk(
    files: &[&FileHandle],
    gds: &[Arc<GdsFile>],
    plan: &Plan,
    abort: &AtomicBool,
    mut io: impl FnMut(&FileHandle, &GdsFile, Chunk) -> Result<()>,
) -> Result<()> {
    let mut claims = plan.worker();
    while !abort.load(Ordering::Relaxed) {
        let Some((_, c)) = claims.next() else {
            break;
        };
        let (file, reg) = pick(files, gds, &c)?;
        io(file, reg, c)?;
    }
    Ok(())
}

fn pick<'a>(
    files: &[&'a FileHandle],
    gds: &'a [Arc<GdsFile>],
    c: &Chunk,
) -> Result<(&'a FileHandle, &'a GdsFile)> {
    match (files.get(c.file), gds.get(c.file)) {
        (Some(f), Some(g)) => Ok((f, g)),
        _ => Err(LocalIoError::Internal(
            "a chunk names no file of the transfer".into(),
        )),
    }
}
