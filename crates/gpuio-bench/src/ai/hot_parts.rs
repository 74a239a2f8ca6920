//! Where a B2 lookup through the hot tier spends its time: for one table and each batch's last
//! step, the HAL's hot gather timed by wall clock with the index list already on the device,
//! read from pinned memory by the kernel, and staged (one copy, then the kernel); the device's
//! own time for the first; and MemIO's zero-copy route around the same kernel (its index stage,
//! pieces and planner); the same list as two jobs of one launch (a step's two tables) through
//! the HAL and MemIO, and through a resident block where it fits; and the least a launch and
//! its wait cost. Notes only: the records are
//! the lookups themselves.

use super::percentile;
use crate::Result;
use gpuio_api::Session;
use gpuio_hal::{
    HostAllocOptions, HostBuffer, HotGather, HotRows, RESIDENT_MAX_BYTES, RESIDENT_MAX_ROWS,
    ResidentJob, RowIndices,
};
use gpuio_transport_memio::{GatherOptions, GatherStrategy, HotLookup};
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
        notes.push(two_jobs(session, table, &hot, ids)?);
    }
    // The least a launch and its wait cost here: the smallest kernel (a 16-byte fill).
    let tiny = gpu.alloc(16)?;
    let mut t = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let s = Instant::now();
        stream.fill_pattern(&tiny, 0, 16, 1)?;
        t.push(s.elapsed().as_secs_f64() * 1e6);
    }
    notes.push(format!(
        "B2: a launch of the smallest kernel (a 16-byte fill) and its wait: {:.1} µs wall p50",
        percentile(&mut t, 0.5)
    ));
    Ok(notes)
}

/// The same list as two jobs of one launch (a step's two tables): through the HAL (list in
/// pinned memory, and on the device, with the device's time) and through MemIO.
fn two_jobs(session: &Session, table: &HostBuffer, hot: &HotRows, ids: &[u64]) -> Result<String> {
    let gpu = session.gpu(0)?;
    let stream = gpu.stream()?;
    let (n, rb) = (ids.len(), hot.row_bytes());
    let bytes: Vec<u8> = ids
        .iter()
        .chain(ids)
        .flat_map(|i| i.to_le_bytes())
        .collect();
    let mut pinned = HostBuffer::alloc_pinned(bytes.len(), &HostAllocOptions::default(), gpu)?;
    pinned.as_mut_slice().copy_from_slice(&bytes);
    let on_device = gpu.alloc(bytes.len())?;
    stream.upload(&bytes, &on_device, 0)?;
    let dst = gpu.alloc(2 * n * rb)?;
    let job = |k: usize| HotGather {
        pool: table,
        hot,
        count: n,
        dst: &dst,
        dst_offset: k * n * rb,
    };
    let jobs = [job(0), job(1)];
    let (mut pinned_t, mut device_t, mut busy, mut memio_t) = (vec![], vec![], vec![], vec![]);
    // A resident block serves calls of up to 64 KiB (the engine's own, if it keeps one).
    let resident = (2 * n * rb <= RESIDENT_MAX_BYTES && 2 * n <= RESIDENT_MAX_ROWS)
        .then(|| gpu.resident_rows(std::time::Duration::from_millis(100)))
        .transpose()?;
    let mut resident_t = vec![];
    let opts = GatherOptions {
        strategy: GatherStrategy::ZeroCopy,
        ..GatherOptions::default()
    };
    let lookups = [0, 1].map(|k| HotLookup {
        pool: table,
        hot,
        indices: ids,
        dst: &dst,
        dst_offset: k * n * rb,
    });
    for _ in 0..REPS {
        let s = Instant::now();
        stream.gather_hot_jobs(&jobs, RowIndices::Pinned(&pinned))?;
        pinned_t.push(s.elapsed().as_secs_f64() * 1e6);
        let s = Instant::now();
        stream.gather_hot_jobs(&jobs, RowIndices::Device(&on_device))?;
        device_t.push(s.elapsed().as_secs_f64() * 1e6);
        let d = stream.gather_hot_jobs_timed(&jobs, RowIndices::Device(&on_device))?;
        busy.push(d.as_secs_f64() * 1e6);
        let s = Instant::now();
        let r = session.memio().gather_hot_jobs(&lookups, &opts);
        r.map_err(gpuio_api::Error::from)?;
        memio_t.push(s.elapsed().as_secs_f64() * 1e6);
        if let Some(server) = &resident {
            let jobs = [0, 1].map(|k| ResidentJob {
                pool: table,
                hot: Some(hot),
                indices: ids,
                dst: &dst,
                dst_offset: k * n * rb,
            });
            let s = Instant::now();
            server.gather(&jobs, rb)?;
            resident_t.push(s.elapsed().as_secs_f64() * 1e6);
        }
    }
    let resident = if resident_t.is_empty() {
        String::new()
    } else {
        format!(
            "; a HAL resident block {:.1}",
            percentile(&mut resident_t, 0.5)
        )
    };
    Ok(format!(
        "B2 hot gather, two tables' jobs of {n} ids in one launch (wall p50 of {REPS}): HAL with \
         the list in pinned memory {:.1} µs, on the device {:.1} (device time {:.1}); MemIO \
         zero-copy {:.1}{resident}",
        percentile(&mut pinned_t, 0.5),
        percentile(&mut device_t, 0.5),
        percentile(&mut busy, 0.5),
        percentile(&mut memio_t, 0.5)
    ))
}
