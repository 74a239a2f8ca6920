//! Engram tables: rows in pinned host memory read by id into device memory (a GPU hot tier
//! for the rows read most), written back from device memory, prefetched and written back on
//! side threads (`AiPending`), and searched by similarity.

use super::{Ids, batch_row, indices, own_class, refuse, row_indices, settle, shared_gpus, to_py};
use crate::buffers::{DeviceBuffer, HostBuffer};
use crate::error::DetachIn;
use crate::error::invalid;
use crate::session::Session;
use gpuio_ai::AiWork;
use gpuio_ai::engram::{self, GatherStrategy, HotTierStats, Lookup, Pending, RowValues};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// What a lookup did (its keys and path names interned: a report is made on every call).
fn lookup_report<'py>(py: Python<'py>, r: &Lookup) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(intern!(py, "rows"), r.rows)?;
    d.set_item(intern!(py, "rows_fetched"), r.rows_fetched)?;
    let path = match r.strategy {
        GatherStrategy::Auto => intern!(py, "Auto"),
        GatherStrategy::ZeroCopy => intern!(py, "ZeroCopy"),
        GatherStrategy::Sorted => intern!(py, "Sorted"),
        GatherStrategy::CpuStaged => intern!(py, "CpuStaged"),
        GatherStrategy::Hybrid => intern!(py, "Hybrid"),
    };
    d.set_item(intern!(py, "path"), path)?;
    d.set_item(intern!(py, "hot"), r.hot)?;
    Ok(d)
}

fn hot_report<'py>(py: Python<'py>, s: &HotTierStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("rows", s.rows)?;
    d.set_item("device_bytes", s.device_bytes)?;
    d.set_item("probes", s.probes)?;
    Ok(d)
}

/// One lookup of `EngramTable.lookup_tables` as Python passes it: (table, ids, dst[,
/// dst_offset]).
struct TableRow<'py> {
    table: Bound<'py, EngramTable>,
    ids: Ids,
    dst: Bound<'py, DeviceBuffer>,
    dst_offset: usize,
}

impl<'py> TableRow<'py> {
    /// The lookup read as given: the table this binding's or the Python half's (`_t`), the
    /// ids bytes or a host array of 64-bit integers, the destination a `DeviceBuffer`. None
    /// where a part needs the Python half's conversion first; `strict` (after it) raises why
    /// instead.
    fn read(row: &Bound<'py, PyAny>, strict: bool) -> PyResult<Option<Self>> {
        const SHAPE: &str = "a lookup is (table, ids, dst) or (table, ids, dst, dst_offset)";
        let Some(t) = batch_row(row, 3..=4, strict, SHAPE)? else {
            return Ok(None);
        };
        let why = "a lookup's table is a gpuio.ai.EngramTable";
        let table = t.get_item(0)?;
        let Some(table) = own_class(table, intern!(row.py(), "_t"), strict, why)? else {
            return Ok(None);
        };
        let Some(ids) = row_indices(&t.get_item(1)?, strict, "Engram ids")? else {
            return Ok(None);
        };
        let Ok(dst) = t.get_item(2)?.cast_into::<DeviceBuffer>() else {
            return refuse(strict, "a lookup's destination is GPU memory");
        };
        let dst_offset = match t.len() {
            4 => t.get_item(3)?.extract()?,
            _ => 0,
        };
        Ok(Some(Self {
            table,
            ids,
            dst,
            dst_offset,
        }))
    }
}

/// An Engram table in pinned host memory (DRAM or CXL). Clones on the Rust side share it.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct EngramTable {
    /// A handle of the table: `set_work` replaces it with one of other work (the rows are
    /// shared).
    table: RwLock<engram::EngramTable>,
    session: Arc<gpuio_api::Session>,
}

impl EngramTable {
    /// The handle, read in place (no clone: a lookup's fixed cost is what it is measured
    /// by). Side work clones it.
    fn table(&self) -> std::sync::RwLockReadGuard<'_, engram::EngramTable> {
        self.table.read().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl EngramTable {
    /// A zeroed table of `rows` rows of `row_bytes` in `placement`.
    #[new]
    #[pyo3(signature = (session, rows, row_bytes, placement="memio://cpu/dram"))]
    fn new(
        py: Python<'_>,
        session: &Session,
        rows: u64,
        row_bytes: usize,
        placement: &str,
    ) -> PyResult<Self> {
        let placement = super::placement(placement)?;
        let session = Arc::clone(session.session());
        let table = py
            .detach_kept(|| engram::EngramTable::new(&session, rows, row_bytes, placement))
            .map_err(to_py)?;
        Ok(Self {
            table: RwLock::new(table),
            session,
        })
    }

    /// The work its lookups are for (`decode` unless set): each holds a scheduler lease of
    /// that class while it moves data, so less urgent IO waits for it.
    fn set_work(&self, py: Python<'_>, work: &super::Work) -> PyResult<()> {
        let w = work.0;
        py.detach_kept(|| {
            self.table
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .set_work(w)
        })
        .map_err(to_py)
    }

    /// Rows in the table.
    #[getter]
    fn rows(&self) -> u64 {
        self.table().rows()
    }

    /// Bytes per row.
    #[getter]
    fn row_bytes(&self) -> usize {
        self.table().row_bytes()
    }

    /// The table's memory, to load it (`session.read(path, table.memory())`) or view it with
    /// NumPy. Rows written there after `keep_hot` are not seen by their copies.
    fn memory(&self) -> HostBuffer {
        HostBuffer::new(self.table().memory().clone())
    }

    /// Reads row `ids[i]` into `dst` at `dst_offset + i * row_bytes`.
    #[pyo3(signature = (ids, dst, dst_offset=0))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'_, PyAny>,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ids = indices(ids, "Engram ids")?;
        let wait = shared_gpus(&[dst]);
        let r = py
            .detach_in(&self.session, || {
                settle(&wait)?;
                self.table()
                    .lookup(&self.session, &ids, &dst.buf, dst_offset)
            })?
            .map_err(to_py)?;
        lookup_report(py, &r)
    }

    /// Runs every lookup of `lookups`, each a tuple (table, ids, dst[, dst_offset]),
    /// together: one gather where every table keeps hot rows on its destination's device (one
    /// launch and one wait for all). A report per lookup; None, before anything moves, where
    /// a lookup needs the Python half's conversion first (see `TableRow::read`; `strict`
    /// raises why instead).
    #[staticmethod]
    #[pyo3(signature = (lookups, strict=true))]
    fn lookup_tables<'py>(
        py: Python<'py>,
        lookups: &Bound<'py, PyAny>,
        strict: bool,
    ) -> PyResult<Option<Vec<Bound<'py, PyDict>>>> {
        let Ok(lookups) = lookups.cast::<PyList>() else {
            return refuse(strict, "the lookups are a list");
        };
        let mut rows = Vec::with_capacity(lookups.len());
        for row in lookups.iter() {
            match TableRow::read(&row, strict)? {
                Some(r) => rows.push(r),
                None => return Ok(None),
            }
        }
        let Some(first) = rows.first() else {
            return Ok(Some(Vec::new()));
        };
        let session = Arc::clone(&first.table.get().session);
        if rows
            .iter()
            .any(|r| !Arc::ptr_eq(&r.table.get().session, &session))
        {
            return Err(invalid("the tables of one call must share a session"));
        }
        let parts: Vec<(&EngramTable, &[u64], &DeviceBuffer, usize)> = rows
            .iter()
            .map(|r| (r.table.get(), &r.ids[..], r.dst.get(), r.dst_offset))
            .collect();
        let dsts: Vec<&DeviceBuffer> = parts.iter().map(|p| p.2).collect();
        let wait = shared_gpus(&dsts);
        let reports = py
            .detach_in(&session, || {
                settle(&wait)?;
                // Each handle read-locked once, in address order (a caller naming the same
                // tables in another order cannot deadlock with it beside `set_work`).
                let mut order: Vec<&EngramTable> = parts.iter().map(|p| p.0).collect();
                order.sort_by_key(|t| std::ptr::from_ref(*t));
                order.dedup_by_key(|t| std::ptr::from_ref(*t));
                let guards: Vec<_> = order.iter().map(|t| t.table()).collect();
                let handle = |t: &EngramTable| {
                    let at = order
                        .binary_search_by_key(&std::ptr::from_ref(t), |u| std::ptr::from_ref(*u))
                        .unwrap_or(0);
                    &*guards[at]
                };
                let lookups: Vec<engram::TableLookup<'_>> = parts
                    .iter()
                    .map(|&(t, ids, dst, dst_offset)| engram::TableLookup {
                        table: handle(t),
                        ids,
                        dst: &dst.buf,
                        dst_offset,
                    })
                    .collect();
                engram::EngramTable::lookup_tables(&session, &lookups)
            })?
            .map_err(to_py)?;
        reports
            .iter()
            .map(|r| lookup_report(py, r))
            .collect::<PyResult<_>>()
            .map(Some)
    }

    /// Writes source row `i` (at `src_offset + i * row_bytes` of `src`) to row `ids[i]`.
    #[pyo3(signature = (ids, src, src_offset=0))]
    fn store(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        src: &DeviceBuffer,
        src_offset: usize,
    ) -> PyResult<()> {
        let ids = indices(ids, "Engram ids")?;
        let wait = shared_gpus(&[src]);
        py.detach_in(&self.session, || {
            settle(&wait)?;
            self.table()
                .store(&self.session, &ids, &src.buf, src_offset)
        })?
        .map_err(to_py)
    }

    /// Keeps copies of rows `ids` in device memory of `gpu`; what the tier keeps.
    fn keep_hot<'py>(
        &self,
        py: Python<'py>,
        gpu: u32,
        ids: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let ids = indices(ids, "Engram ids")?;
        let s = py
            .detach_in(&self.session, || {
                self.table().keep_hot(&self.session, gpu, &ids)
            })?
            .map_err(to_py)?;
        hot_report(py, &s)
    }

    /// Lets the kept copies go.
    fn drop_hot(&self, py: Python<'_>) {
        py.detach_kept(|| self.table().drop_hot());
    }

    /// What the hot tier keeps, or None.
    fn hot_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.table()
            .hot_stats()
            .map(|s| hot_report(py, &s))
            .transpose()
    }

    /// Starts `lookup` on a side thread and returns at once.
    #[pyo3(signature = (ids, dst, dst_offset=0))]
    fn prefetch(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        dst: Py<DeviceBuffer>,
        dst_offset: usize,
    ) -> PyResult<AiPending> {
        let ids = indices(ids, "Engram ids")?.into_vec();
        let d = dst.get();
        let wait = shared_gpus(&[d]);
        let buf = d.buf.clone();
        let p = py
            .detach_in(&self.session, || {
                settle(&wait)?;
                self.table().prefetch(&self.session, ids, buf, dst_offset)
            })?
            .map_err(to_py)?;
        Ok(AiPending::new(Work::Lookup(p), dst))
    }

    /// Starts `store` on a side thread and returns at once.
    #[pyo3(signature = (ids, src, src_offset=0))]
    fn store_async(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        src: Py<DeviceBuffer>,
        src_offset: usize,
    ) -> PyResult<AiPending> {
        let ids = indices(ids, "Engram ids")?.into_vec();
        let s = src.get();
        let wait = shared_gpus(&[s]);
        let buf = s.buf.clone();
        let p = py
            .detach_in(&self.session, || {
                settle(&wait)?;
                self.table()
                    .store_async(&self.session, ids, buf, src_offset)
            })?
            .map_err(to_py)?;
        Ok(AiPending::new(Work::Store(p), src))
    }

    /// The `k` rows most similar to `query` (little-endian f32s, one per row value), best
    /// first, with their scores; rows read as `values` (`f32` or `fp8`), scored on `gpu`.
    #[pyo3(signature = (query, k, values="f32", gpu=0))]
    fn similar(
        &self,
        py: Python<'_>,
        query: &[u8],
        k: usize,
        values: &str,
        gpu: u32,
    ) -> PyResult<Vec<(u64, f32)>> {
        let query = super::f32s(query, "a query")?;
        let values = match values {
            "f32" => RowValues::F32,
            "fp8" => RowValues::Fp8,
            v => return Err(invalid(format!("row values {v:?}: f32 or fp8"))),
        };
        py.detach_in(&self.session, || {
            self.table().similar(&self.session, gpu, &query, values, k)
        })?
        .map_err(to_py)
    }
}

enum Work {
    Lookup(Pending<Lookup>),
    Store(Pending<()>),
}

/// A prefetch or write-back running on a side thread: `done()`, `wait()` (a lookup's report,
/// or None for a store), `status`, `work` (its scheduler class's name); `cancel()` returns
/// False, as side work cannot be stopped once started. Dropping it waits for it.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct AiPending {
    work: AiWork,
    /// The work until waited for; held by the thread that waits (others poll past it).
    running: Mutex<Option<Work>>,
    /// Its result once waited for.
    settled: Mutex<Option<Settled>>,
    /// The buffer the work moves, kept alive until it is waited for.
    _keep: Py<DeviceBuffer>,
}

/// Side work's result as the handle keeps it: a lookup's report (none for a store), or the
/// error's parts.
type Settled = Result<Option<Lookup>, (String, i32, &'static str)>;

impl AiPending {
    fn new(work: Work, keep: Py<DeviceBuffer>) -> Self {
        let label = match &work {
            Work::Lookup(p) => p.work(),
            Work::Store(p) => p.work(),
        };
        Self {
            work: label,
            running: Mutex::new(Some(work)),
            settled: Mutex::new(None),
            _keep: keep,
        }
    }

    fn settled(&self) -> Option<Settled> {
        self.settled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[pymethods]
impl AiPending {
    /// Whether it has finished.
    fn done(&self) -> bool {
        if self.settled().is_some() {
            return true;
        }
        // Never blocks: a thread waiting for it holds `running`.
        match self.running.try_lock() {
            Ok(g) => match &*g {
                Some(Work::Lookup(p)) => p.is_done(),
                Some(Work::Store(p)) => p.is_done(),
                None => true,
            },
            Err(_) => false,
        }
    }

    /// `in_progress`, `completed` or `error` (the last two once it has been waited for, or
    /// has finished).
    #[getter]
    fn status(&self) -> &'static str {
        match self.settled() {
            Some(Ok(_)) => "completed",
            Some(Err(_)) => "error",
            None if self.done() => "completed",
            None => "in_progress",
        }
    }

    /// The scheduler class its work belongs to (`background` for a prefetch, `engram_sync`
    /// for a write-back).
    #[getter]
    fn work(&self) -> &'static str {
        crate::session::priority_name(self.work.priority())
    }

    /// Side work cannot be stopped once started: False.
    fn cancel(&self) -> bool {
        false
    }

    /// Waits for it: a lookup's report, or None for a store; raises its error (every call
    /// alike).
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let settled = py.detach_kept(|| {
            let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(w) = running.take() {
                let r = match w {
                    Work::Lookup(p) => p.wait().map(Some),
                    Work::Store(p) => p.wait().map(|()| None),
                };
                *self.settled.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(r.map_err(|e| {
                        let c = e.code();
                        (e.to_string(), c.as_i32(), c.name())
                    }));
            }
            self.settled()
        });
        match settled {
            Some(Ok(Some(l))) => lookup_report(py, &l).map(Some),
            Some(Ok(None)) => Ok(None),
            Some(Err(parts)) => Err(crate::error::Error::new_err(parts)),
            None => Err(invalid("the side work's result was lost")),
        }
    }
}
