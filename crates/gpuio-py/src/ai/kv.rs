//! KV caches: `KvPool` (host-planned loads across hot, warm and cold tiers) and `SwapInKv`
//! with `SwapInBatch` (device-planned loads of selections already on the GPU).

use super::{Ids, batch_row, indices, own_class, refuse, row_indices, settle, shared_gpus, to_py};
use crate::buffers::{DeviceBuffer, Resource};
use crate::error::DetachIn;
use crate::error::invalid;
use crate::lent::Lent;
use crate::session::Session;
use gpuio_ai::compress::Codec;
use gpuio_ai::kv::{self, ColdTier, EvictReport, KvPoolConfig, LoadReport, SwapInConfig, Tier};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::sync::{Arc, Mutex, PoisonError};

/// What a load did (keys interned: a report is made on every call).
fn load_report<'py>(py: Python<'py>, r: &LoadReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(intern!(py, "selected"), r.selected)?;
    d.set_item(intern!(py, "hits"), r.hits)?;
    d.set_item(intern!(py, "misses"), r.misses)?;
    d.set_item(intern!(py, "from_cold"), r.from_cold)?;
    d.set_item(intern!(py, "bytes_from_host"), r.bytes_from_host)?;
    Ok(d)
}

/// Each sequence's report (a dict) or its error (a `gpuio.Error`, not raised), in order.
fn batch_reports<'py>(
    py: Python<'py>,
    reports: Vec<gpuio_ai::Result<LoadReport>>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    reports
        .into_iter()
        .map(|r| match r {
            Ok(r) => load_report(py, &r).map(Bound::into_any),
            Err(e) => Ok(to_py(e).into_value(py).into_bound(py).into_any()),
        })
        .collect()
}

fn evict_report<'py>(py: Python<'py>, r: &EvictReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("evicted", r.evicted)?;
    d.set_item("to_cold", r.to_cold)?;
    d.set_item("bytes_freed", r.bytes_freed)?;
    Ok(d)
}

/// A codec by name: `lz4`, or `zstd` at `level`.
pub(crate) fn codec(name: &str, level: i32) -> PyResult<Codec> {
    match name {
        "lz4" => Ok(Codec::Lz4),
        "zstd" => Ok(Codec::Zstd { level }),
        _ => Err(invalid(format!("codec {name:?}: lz4 or zstd"))),
    }
}

/// One sequence's KV entries across device memory (hot), pinned host memory (warm) and a
/// compressed cold tier; one decode loop drives it (calls from several threads take turns).
#[pyclass(module = "gpuio.ai", frozen)]
pub struct KvPool {
    pool: Mutex<kv::KvPool>,
    session: Arc<gpuio_api::Session>,
    cfg: KvPoolConfig,
}

impl KvPool {
    fn with<T>(&self, f: impl FnOnce(&mut kv::KvPool) -> T) -> T {
        f(&mut self.pool.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// [`with`](Self::with) without the GIL: a load or store holds the pool for as long as
    /// it waits for its lease and moves data.
    fn get<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut kv::KvPool) -> T + Send) -> T {
        py.detach_kept(|| self.with(f))
    }
}

#[pymethods]
impl KvPool {
    #[new]
    #[pyo3(signature = (session, layers, entry_bytes, max_tokens, warm_entries=None, hot_slots=4096,
                        max_selection=2048, gpu=0, placement="memio://cpu/dram"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        session: &Session,
        layers: usize,
        entry_bytes: usize,
        max_tokens: u64,
        warm_entries: Option<u64>,
        hot_slots: usize,
        max_selection: usize,
        gpu: u32,
        placement: &str,
    ) -> PyResult<Self> {
        let cfg = KvPoolConfig {
            layers,
            entry_bytes,
            max_tokens,
            warm_entries: warm_entries.unwrap_or((layers as u64).saturating_mul(max_tokens)),
            hot_slots,
            max_selection,
            gpu,
            placement: super::placement(placement)?,
        };
        let session = Arc::clone(session.session());
        let pool = py
            .detach_kept(|| kv::KvPool::new(&session, cfg))
            .map_err(to_py)?;
        Ok(Self {
            pool: Mutex::new(pool),
            session,
            cfg,
        })
    }

    /// Stores `count` entries of `layer` from `src` (device memory) at `src_offset` at
    /// positions `first..first + count`, with their importance scores (`scores`: `count`
    /// little-endian f32s) where given.
    #[pyo3(signature = (layer, first, count, src, src_offset=0, scores=None))]
    #[allow(clippy::too_many_arguments)]
    fn store(
        &self,
        py: Python<'_>,
        layer: usize,
        first: u64,
        count: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        scores: Option<&[u8]>,
    ) -> PyResult<()> {
        let scores = scores.map(|s| super::f32s(s, "scores")).transpose()?;
        let wait = shared_gpus(&[src]);
        py.detach_in(&self.session, || {
            settle(&wait)?;
            self.with(|p| {
                p.store(
                    &self.session,
                    layer,
                    first,
                    count,
                    &src.buf,
                    src_offset,
                    scores.as_deref(),
                )
            })
        })?
        .map_err(to_py)
    }

    /// Loads `layer`'s entries at `selection` (little-endian u64 positions) into `dst` from
    /// `dst_offset`, entry `i` being position `selection[i]`; what it did.
    #[pyo3(signature = (layer, selection, dst, dst_offset=0))]
    fn load<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        selection: &Bound<'_, PyAny>,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        let selection = indices(selection, "a selection")?;
        let wait = shared_gpus(&[dst]);
        let r = py
            .detach_in(&self.session, || {
                settle(&wait)?;
                self.with(|p| p.load(layer, &selection, &dst.buf, dst_offset))
            })?
            .map_err(to_py)?;
        load_report(py, &r)
    }

    /// Evicts the least important warm entries (below `threshold` first) until `required`
    /// entries of host memory are free; to the cold tier where one is attached.
    fn evict_by_importance<'py>(
        &self,
        py: Python<'py>,
        required: u64,
        threshold: f32,
    ) -> PyResult<Bound<'py, PyDict>> {
        let r = py
            .detach_in(&self.session, || {
                self.with(|p| p.evict_by_importance(required, threshold))
            })?
            .map_err(to_py)?;
        evict_report(py, &r)
    }

    /// Evicts every warm entry less important than `threshold`.
    fn compact<'py>(&self, py: Python<'py>, threshold: f32) -> PyResult<Bound<'py, PyDict>> {
        let r = py
            .detach_in(&self.session, || self.with(|p| p.compact(threshold)))?
            .map_err(to_py)?;
        evict_report(py, &r)
    }

    /// Evicted entries go, compressed with `codec` (`lz4`, `zstd`), to `resource` from now
    /// on: a file opened for writing (its contents are dropped), or another node's export
    /// opened for update (the whole export is the tier's).
    #[pyo3(signature = (resource, codec="lz4", level=3))]
    fn attach_cold_tier(
        &self,
        py: Python<'_>,
        resource: &Resource,
        codec: &str,
        level: i32,
    ) -> PyResult<()> {
        let codec = self::codec(codec, level)?;
        py.detach_in(&self.session, || {
            let tier = match &resource.res {
                gpuio_api::Resource::File(f) => ColdTier::new(f.clone(), codec)?,
                r @ gpuio_api::Resource::Remote(_) => {
                    let capacity = r.len()?;
                    ColdTier::remote(&self.session, r.at(0)?, capacity, codec)?
                }
                _ => {
                    return Err(gpuio_ai::AiError::InvalidArgument(
                        "a cold tier is a file or another node's export, not memory".into(),
                    ));
                }
            };
            self.with(|p| p.attach_cold_tier(tier))
        })?
        .map_err(to_py)
    }

    /// The cold tier's bytes stored and the entries' bytes before compression, or None.
    fn cold_tier_bytes(&self, py: Python<'_>) -> Option<(u64, u64)> {
        self.get(py, |p| {
            p.cold_tier().map(|c| (c.file_bytes(), c.raw_bytes()))
        })
    }

    /// The work its IO is for (`decode` unless set): each call holds a scheduler lease of
    /// that class while it moves data, so less urgent IO waits for it.
    fn set_work(&self, py: Python<'_>, work: &super::Work) -> PyResult<()> {
        let w = work.0;
        self.get(py, |p| p.set_work(w)).map_err(to_py)
    }

    /// Positions `layer` holds.
    fn len(&self, py: Python<'_>, layer: usize) -> u64 {
        self.get(py, |p| p.len(layer))
    }

    /// Entries host memory has room for.
    fn warm_free(&self, py: Python<'_>) -> u64 {
        self.get(py, |p| p.warm_free())
    }

    /// Entries of `layer` with a copy in its hot buffer.
    fn hot_entries(&self, py: Python<'_>, layer: usize) -> usize {
        self.get(py, |p| p.hot_entries(layer))
    }

    /// Where entry `pos` of `layer` is kept: `warm`, `cold`, `dropped`, or None where it was
    /// never stored.
    fn tier_of(&self, py: Python<'_>, layer: usize, pos: u64) -> Option<&'static str> {
        self.get(py, |p| p.tier_of(layer, pos)).map(|t| match t {
            Tier::Warm => "warm",
            Tier::Cold => "cold",
            Tier::Dropped => "dropped",
        })
    }

    /// Entry `pos` of `layer`'s importance score.
    fn importance(&self, py: Python<'_>, layer: usize, pos: u64) -> f32 {
        self.get(py, |p| p.importance(layer, pos))
    }

    /// The pool's shape.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.cfg;
        let d = PyDict::new(py);
        d.set_item("layers", c.layers)?;
        d.set_item("entry_bytes", c.entry_bytes)?;
        d.set_item("max_tokens", c.max_tokens)?;
        d.set_item("warm_entries", c.warm_entries)?;
        d.set_item("hot_slots", c.hot_slots)?;
        d.set_item("max_selection", c.max_selection)?;
        d.set_item("gpu", c.gpu)?;
        d.set_item("placement", c.placement.to_string())?;
        Ok(d)
    }
}

/// A batch of requests' KV loads in one call (a decode step's loads of one layer for every
/// request): one upload, one kernel, one wait; its stage and planning threads kept between
/// calls.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct KvBatch {
    batch: Mutex<kv::KvBatch>,
}

/// A batch's reports, and with `timed` the device's seconds.
type BatchReports<'py> = (Vec<Bound<'py, PyDict>>, Option<f64>);

/// One load of a `KvBatch`: pool, layer, selection, destination, destination offset.
struct KvBatchRow<'py> {
    pool: Bound<'py, KvPool>,
    layer: usize,
    selection: Ids,
    dst: Bound<'py, DeviceBuffer>,
    dst_offset: usize,
}

impl<'py> KvBatchRow<'py> {
    /// `(pool, layer, selection, dst[, dst_offset])` read as given: the pool this binding's
    /// or the Python half's (`_p`), the selection bytes or a host array of 64-bit integers,
    /// the destination a `DeviceBuffer`. None where a part needs the Python half's
    /// conversion first; `strict` (after it) raises why instead.
    fn read(row: &Bound<'py, PyAny>, strict: bool) -> PyResult<Option<Self>> {
        const SHAPE: &str = "a KV batch's load is (pool, layer, selection, dst[, dst_offset])";
        let Some(t) = batch_row(row, 4..=5, strict, SHAPE)? else {
            return Ok(None);
        };
        let py = row.py();
        let pool = t.get_item(0)?;
        let why = "a KV batch's pool is a gpuio.ai.KvPool";
        let Some(pool) = own_class::<KvPool>(pool, intern!(py, "_p"), strict, why)? else {
            return Ok(None);
        };
        let Some(selection) = row_indices(&t.get_item(2)?, strict, "a selection")? else {
            return Ok(None);
        };
        let Ok(dst) = t.get_item(3)?.cast_into::<DeviceBuffer>() else {
            return refuse(strict, "a KV load's destination is GPU memory");
        };
        let dst_offset = match t.len() {
            5 => t.get_item(4)?.extract()?,
            _ => 0,
        };
        Ok(Some(Self {
            pool,
            layer: t.get_item(1)?.extract()?,
            selection,
            dst,
            dst_offset,
        }))
    }
}

#[pymethods]
impl KvBatch {
    #[new]
    fn new() -> Self {
        Self {
            batch: Mutex::new(kv::KvBatch::new()),
        }
    }

    /// Loads every request's selection, as `KvPool.load` does one; their reports in order
    /// (each pool at most once). With `timed`, also the device's seconds for the batch. None,
    /// before anything moves, where a load needs the Python half's conversion first (see
    /// `KvBatchRow::read`; `strict` raises why instead).
    #[pyo3(signature = (loads, timed=false, strict=true))]
    fn load<'py>(
        &self,
        py: Python<'py>,
        loads: &Bound<'py, PyAny>,
        timed: bool,
        strict: bool,
    ) -> PyResult<Option<BatchReports<'py>>> {
        let Ok(loads) = loads.cast::<PyList>() else {
            return refuse(strict, "the loads are a list");
        };
        let mut read = Vec::with_capacity(loads.len());
        for row in loads.iter() {
            match KvBatchRow::read(&row, strict)? {
                Some(r) => read.push(r),
                None => return Ok(None),
            }
        }
        let selections: Vec<&[u64]> = read.iter().map(|r| &*r.selection).collect();
        let rows: Vec<(&KvPool, usize, &DeviceBuffer, usize)> = read
            .iter()
            .map(|r| (r.pool.get(), r.layer, r.dst.get(), r.dst_offset))
            .collect();
        // A pool twice would lock itself.
        for (i, r) in rows.iter().enumerate() {
            if rows[..i].iter().any(|q| std::ptr::eq(q.0, r.0)) {
                return Err(invalid("a KV batch names one pool twice"));
            }
        }
        let mut bufs: Vec<&DeviceBuffer> = rows.iter().map(|r| r.2).collect();
        bufs.dedup_by(|a, b| std::ptr::eq(*a, *b));
        let wait = shared_gpus(&bufs);
        for r in &rows {
            r.0.session.check_process().map_err(crate::error::to_py)?;
        }
        let (reports, device) = py
            .detach_kept(|| {
                settle(&wait)?;
                // Locked in one global order (by address): batches over overlapping pools
                // never wait on each other in a cycle.
                let mut order: Vec<usize> = (0..rows.len()).collect();
                order.sort_by_key(|&i| rows[i].0 as *const KvPool as usize);
                let mut guards: Vec<Option<std::sync::MutexGuard<'_, kv::KvPool>>> =
                    rows.iter().map(|_| None).collect();
                for i in order {
                    guards[i] = Some(
                        rows[i]
                            .0
                            .pool
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner),
                    );
                }
                let mut one: Vec<kv::KvLoad<'_>> = guards
                    .iter_mut()
                    .zip(&rows)
                    .zip(&selections)
                    .filter_map(|((g, r), sel)| {
                        g.as_mut().map(|pool| kv::KvLoad {
                            pool,
                            layer: r.1,
                            selection: sel,
                            dst: &r.2.buf,
                            dst_offset: r.3,
                        })
                    })
                    .collect();
                let mut b = self.batch.lock().unwrap_or_else(PoisonError::into_inner);
                if timed {
                    b.load_timed(&mut one)
                        .map(|(r, d)| (r, Some(d.as_secs_f64())))
                } else {
                    b.load(&mut one).map(|r| (r, None))
                }
            })
            .map_err(to_py)?;
        let out = reports
            .iter()
            .map(|r| load_report(py, r))
            .collect::<PyResult<_>>()?;
        Ok(Some((out, device)))
    }
}

/// One sequence's sparse KV for device-planned loads: entries appended on the host, loaded
/// through a `SwapInBatch` whose selections are already in device memory.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct SwapInKv {
    kv: kv::SwapInKv,
    session: Arc<gpuio_api::Session>,
}

#[pymethods]
impl SwapInKv {
    #[new]
    #[pyo3(signature = (session, layers, entry_bytes, max_tokens, hot_slots=4096,
                        max_selection=2048, gpu=0, placement="memio://cpu/dram"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        session: &Session,
        layers: usize,
        entry_bytes: usize,
        max_tokens: u64,
        hot_slots: usize,
        max_selection: usize,
        gpu: u32,
        placement: &str,
    ) -> PyResult<Self> {
        let cfg = SwapInConfig {
            layers,
            entry_bytes,
            max_tokens,
            hot_slots,
            max_selection,
            gpu,
            placement: super::placement(placement)?,
        };
        let session = Arc::clone(session.session());
        let kv = py
            .detach_kept(|| kv::SwapInKv::new(&session, cfg))
            .map_err(to_py)?;
        Ok(Self { kv, session })
    }

    /// Appends whole entries (host memory: a byte memoryview the Python half made) to
    /// `layer`; the first new position.
    fn append(&self, py: Python<'_>, layer: usize, entries: &Bound<'_, PyAny>) -> PyResult<u64> {
        let lent = Lent::of(entries)?;
        py.detach_in(&self.session, || self.kv.append(layer, lent.bytes()))?
            .map_err(to_py)
    }

    /// Empties `layer` (its hot buffer too).
    fn reset(&self, py: Python<'_>, layer: usize) -> PyResult<()> {
        py.detach_in(&self.session, || self.kv.reset(&self.session, layer))?
            .map_err(to_py)
    }

    /// Entry `pos` of `layer`, as bytes.
    fn entry<'py>(&self, py: Python<'py>, layer: usize, pos: u64) -> PyResult<Bound<'py, PyBytes>> {
        let e = self.kv.entry(layer, pos).map_err(to_py)?;
        Ok(PyBytes::new(py, &e))
    }

    /// Positions `layer` holds.
    fn len(&self, layer: usize) -> u64 {
        self.kv.len(layer)
    }
}

/// A swap-in batch's target as the Python half passes it: sequence, selection, destination,
/// destination offset.
type SwapInRow = (Py<SwapInKv>, Py<DeviceBuffer>, Py<DeviceBuffer>, usize);

/// Each sequence's report or error, and the device's (exposed, install) seconds when timed.
type BatchLoad<'py> = (Vec<Bound<'py, PyAny>>, Option<(f64, f64)>);

/// One layer's device-planned loads for a batch of sequences, made once and loaded every
/// step.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct SwapInBatch {
    batch: Mutex<kv::SwapInBatch>,
    session: Arc<gpuio_api::Session>,
    /// The buffers the batch's tables point into, kept alive with it.
    _keep: Vec<Py<DeviceBuffer>>,
}

#[pymethods]
impl SwapInBatch {
    /// `targets`: (sequence, selection, destination, destination offset) each; a selection
    /// is little-endian u32 positions in device memory.
    #[new]
    fn new(
        py: Python<'_>,
        session: &Session,
        layer: usize,
        targets: Vec<SwapInRow>,
    ) -> PyResult<Self> {
        let refs: Vec<_> = targets
            .iter()
            .map(|(kv, sel, dst, off)| (kv.get(), sel.get(), dst.get(), *off))
            .collect();
        let mut bufs: Vec<&DeviceBuffer> = refs.iter().map(|t| t.1).collect();
        bufs.extend(refs.iter().map(|t| t.2));
        let wait = shared_gpus(&bufs);
        let list: Vec<kv::SwapInTarget<'_>> = refs
            .iter()
            .map(|(kv, sel, dst, off)| kv::SwapInTarget {
                kv: &kv.kv,
                selection: &sel.buf,
                dst: &dst.buf,
                dst_offset: *off,
            })
            .collect();
        let session = session.session();
        let batch = py
            .detach_in(session, || {
                settle(&wait)?;
                kv::SwapInBatch::new(session, layer, &list)
            })?
            .map_err(to_py)?;
        let keep = targets
            .iter()
            .flat_map(|(_, s, d, _)| [s.clone_ref(py), d.clone_ref(py)])
            .collect();
        Ok(Self {
            batch: Mutex::new(batch),
            session: Arc::clone(session),
            _keep: keep,
        })
    }

    /// Loads the first `counts[i]` positions of sequence `i`'s selection into its
    /// destination; each sequence's report (a dict), or its error (a `gpuio.Error`), in
    /// order. With `timed`, also the device's times: (exposed, install) in seconds.
    #[pyo3(signature = (counts, timed=false))]
    fn load<'py>(
        &self,
        py: Python<'py>,
        counts: Vec<usize>,
        timed: bool,
    ) -> PyResult<BatchLoad<'py>> {
        let (reports, times) = py
            .detach_in(&self.session, || {
                let mut b = self.batch.lock().unwrap_or_else(PoisonError::into_inner);
                if timed {
                    b.load_timed(&counts).map(|(r, t)| (r, Some(t)))
                } else {
                    b.load(&counts).map(|r| (r, None))
                }
            })?
            .map_err(to_py)?;
        Ok((
            batch_reports(py, reports)?,
            times.map(|t| (t.exposed.as_secs_f64(), t.install.as_secs_f64())),
        ))
    }

    /// Has every later load also bring the `ahead[i]` positions after sequence `i`'s count
    /// (the indexer's next candidates) into its hot buffer, off the critical path.
    fn set_prefetch(&self, py: Python<'_>, ahead: Vec<usize>) -> PyResult<()> {
        py.detach_kept(|| {
            self.batch
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .set_prefetch(&ahead)
        })
        .map_err(to_py)
    }

    /// Waits for the last load's prefetch: each sequence's report of it (a dict) or error, or
    /// `None` where it prefetched nothing.
    fn prefetched<'py>(&self, py: Python<'py>) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        let reports = py
            .detach_in(&self.session, || {
                let mut b = self.batch.lock().unwrap_or_else(PoisonError::into_inner);
                b.prefetched()
            })?
            .map_err(to_py)?;
        reports.map(|r| batch_reports(py, r)).transpose()
    }

    /// The work its IO is for (`decode` unless set): each call holds a scheduler lease of
    /// that class while it moves data, so less urgent IO waits for it.
    fn set_work(&self, py: Python<'_>, work: &super::Work) -> PyResult<()> {
        let w = work.0;
        py.detach_kept(|| {
            self.batch
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .set_work(w)
        })
        .map_err(to_py)
    }

    /// Sequences in the batch.
    fn __len__(&self, py: Python<'_>) -> usize {
        py.detach_kept(|| {
            self.batch
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .len()
        })
    }
}
