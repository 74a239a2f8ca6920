//! Where a B2 lookup through the hot tier spends its time: for one table and each batch's last
//! step, the HAL's hot gather timed by wall clock with the index list already on the device,
//! read from pinned memory by the kernel, and staged (one copy, then the kernel); the device's
//! own time for the first; and MemIO's zero-copy route around the same kernel (its index stage,
//! pieces and planner). Notes only: the records are the lookups themselves.

use super::percentile;
use crate::Result;
use gpuio_api::Session;
use gpuio_hal::{HostAllocOptions, HostBuffer, RowIndices};
use gpuio_transport_memio::{GatherOptions, GatherStrategy};
use std::time::Instant;

const REPS: usize = 30;

/// Notes on each of `lists` (index lists of one table) gathered through hot rows `keep` of
/// `table`.
pub(super) fn breakdown(
    session: &Session,
    table: &HostBuffer,
    row_bytes: usize,
    keep: &[u64],
    lists: &[&[u64]],
) -> Result<Vec<String>> {
    let gpu = session.gpu(0)?;
    let stream = gpu.stream()?;
    let hot = stream.keep_hot(table, row_bytes, keep)?;
    let mut notes = Vec::new();
    for ids in lists {
        let n = ids.len();
        let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        let mut pinned = HostBuffer::alloc_pinned(n * 8, &HostAllocOptions::default(), gpu)?;
        pinned.as_mut_slice().copy_from_slice(&bytes);
        let on_device = gpu.alloc(n * 8)?;
        stream.upload(&bytes, &on_device, 0)?;
        let dst = gpu.alloc(n * row_bytes)?;
        let wall = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            let mut t = Vec::with_capacity(REPS);
            for _ in 0..REPS {
                let s = Instant::now();
                f()?;
                t.push(s.elapsed().as_secs_f64() * 1e6);
            }
            Ok(percentile(&mut t, 0.5))
        };
        let device_list = wall(&mut || {
            let idx = RowIndices::Device(&on_device);
            Ok(stream.gather_hot(table, &hot, idx, n, &dst, 0)?)
        })?;
        let pinned_list = wall(&mut || {
            let idx = RowIndices::Pinned(&pinned);
            Ok(stream.gather_hot(table, &hot, idx, n, &dst, 0)?)
        })?;
        let staged = wall(&mut || {
            let idx = RowIndices::Staged {
                host: &pinned,
                device: &on_device,
            };
            Ok(stream.gather_hot(table, &hot, idx, n, &dst, 0)?)
        })?;
        let mut device = Vec::with_capacity(REPS);
        for _ in 0..REPS {
            let idx = RowIndices::Device(&on_device);
            let d = stream.gather_hot_timed(table, &hot, idx, n, &dst, 0)?;
            device.push(d.as_secs_f64() * 1e6);
        }
        let device = percentile(&mut device, 0.5);
        let opts = GatherOptions {
            strategy: GatherStrategy::ZeroCopy,
            ..GatherOptions::default()
        };
        let memio = wall(&mut || {
            let memio = session.memio();
            let r = memio.gather_hot(table, &hot, *ids, &dst, 0, &opts);
            r.map_err(gpuio_api::Error::from)?;
            Ok(())
        })?;
        notes.push(format!(
            "B2 hot gather, one table, {n} ids (wall p50 of {REPS}): HAL with the list on the \
             device {device_list:.1} µs (device time {device:.1}), read from pinned memory \
             {pinned_list:.1}, staged {staged:.1}; MemIO zero-copy {memio:.1}"
        ));
    }
    Ok(notes)
}
