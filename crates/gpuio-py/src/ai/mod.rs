//! `gpuio._gpuio.ai`: the AI memory tier (gpuio-ai) for Python. Device memory arrives here
//! as the binding's `DeviceBuffer` (CUDA tensors and arrays borrowed in place by the Python
//! half, `gpuio/ai.py`), ids and positions as little-endian integer bytes or host arrays of 64-bit integers; every call that
//! moves data or runs device work releases the GIL.

mod compress;
mod engram;
mod graph;
mod kv;

use crate::buffers::DeviceBuffer;
use crate::error::Error;
use crate::lent::LentU64s;
use gpuio_ai::{AiError, AiWork, Criticality, InferenceQos};
use gpuio_api::HostPlacement;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString, PyTuple};
use std::time::{Duration, Instant};

/// The Python exception for an AI-tier error: `gpuio.Error`, with its code.
pub(crate) fn to_py(e: AiError) -> PyErr {
    let code = e.code();
    Error::new_err((e.to_string(), code.as_i32(), code.name()))
}

/// Ids or positions from Python: little-endian u64 bytes (what the Python half makes of lists
/// and tensors), or a host array of 64-bit integers (NumPy, `array('q')`) read in place
/// through the buffer protocol: no copy and no pass over them here, where a call's fixed cost
/// is counted in microseconds (eight 2048-entry selections copied, or only scanned, cost a B1
/// step 9-30 us: their first read from memory, on one core). An int64's bits are read as a
/// u64, so a negative id is a huge one, which every call refuses as out of range.
pub(crate) fn indices(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Ids> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return u64s(b.as_bytes(), what).map(Ids::Owned);
    }
    if let Some(lent) = LentU64s::of(obj) {
        return Ok(Ids::Lent(lent));
    }
    // A strided array: its values copied out in order.
    let py = obj.py();
    if let Ok(buf) = PyBuffer::<i64>::get(obj) {
        let values = buf.to_vec(py)?;
        return Ok(Ids::Owned(values.into_iter().map(|v| v as u64).collect()));
    }
    if let Ok(buf) = PyBuffer::<u64>::get(obj) {
        return buf.to_vec(py).map(Ids::Owned);
    }
    Err(crate::error::invalid(format!(
        "{what} must be 64-bit integers: a list, bytes, or a host array of int64 or uint64"
    )))
}

/// [`indices`] of what needs no conversion in the Python half first (bytes, a contiguous
/// host array of 64-bit integers); None for the rest, and for bytes it refuses.
pub(crate) fn fast_indices(obj: &Bound<'_, PyAny>) -> Option<Ids> {
    match obj.cast::<PyBytes>() {
        Ok(b) => u64s(b.as_bytes(), "").ok().map(Ids::Owned),
        Err(_) => LentU64s::of(obj).map(Ids::Lent),
    }
}

/// A row of a batch call as Python passes it: a tuple of `lens` items. Where it is not, an
/// error of `shape` (`strict`: the Python half's conversion has run) or None (it has not).
pub(crate) fn batch_row<'py>(
    row: &Bound<'py, PyAny>,
    lens: std::ops::RangeInclusive<usize>,
    strict: bool,
    shape: &str,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    match row.cast::<PyTuple>() {
        Ok(t) if lens.contains(&t.len()) => Ok(Some(t.clone())),
        _ => refuse(strict, shape),
    }
}

/// `obj` as this binding's `T`, or as the `T` the Python half's wrapper keeps in `attr`
/// (`_p`, `_t`); otherwise `why` (`strict`) or None.
pub(crate) fn own_class<'py, T: pyo3::PyClass>(
    obj: Bound<'py, PyAny>,
    attr: &Bound<'py, PyString>,
    strict: bool,
    why: &str,
) -> PyResult<Option<Bound<'py, T>>> {
    let inner = match obj.cast_into::<T>() {
        Ok(t) => return Ok(Some(t)),
        Err(e) => e.into_inner().getattr(attr),
    };
    match inner.map(|i| i.cast_into::<T>()) {
        Ok(Ok(t)) => Ok(Some(t)),
        _ => refuse(strict, why),
    }
}

/// A batch row the Rust half cannot read as given: a TypeError saying `why` where the Python
/// half's conversion already ran (`strict`), else None (it runs next).
pub(crate) fn refuse<T>(strict: bool, why: &str) -> PyResult<Option<T>> {
    match strict {
        true => Err(pyo3::exceptions::PyTypeError::new_err(why.to_owned())),
        false => Ok(None),
    }
}

/// A batch row's ids: as [`indices`] reads them (`strict`), or as [`fast_indices`] does
/// (None where the Python half must convert them first).
pub(crate) fn row_indices(
    obj: &Bound<'_, PyAny>,
    strict: bool,
    what: &str,
) -> PyResult<Option<Ids>> {
    match strict {
        true => indices(obj, what).map(Some),
        false => Ok(fast_indices(obj)),
    }
}

/// Ids as [`indices`] reads them: lent by Python in place, or converted from bytes.
pub(crate) enum Ids {
    Lent(LentU64s),
    Owned(Vec<u64>),
}

impl Ids {
    /// The ids as a vector of their own (a lent buffer's copied), for work that outlives
    /// the call.
    pub(crate) fn into_vec(self) -> Vec<u64> {
        match self {
            Self::Lent(l) => l.values().to_vec(),
            Self::Owned(v) => v,
        }
    }
}

impl std::ops::Deref for Ids {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        match self {
            Self::Lent(l) => l.values(),
            Self::Owned(v) => v,
        }
    }
}

/// Little-endian u64s of a bytes object (the Python half packs them).
fn u64s(raw: &[u8], what: &str) -> PyResult<Vec<u64>> {
    if !raw.len().is_multiple_of(8) {
        return Err(crate::error::invalid(format!(
            "{what} must be 64-bit integers"
        )));
    }
    Ok(raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Little-endian f32s of a bytes object.
pub(crate) fn f32s(raw: &[u8], what: &str) -> PyResult<Vec<f32>> {
    if !raw.len().is_multiple_of(4) {
        return Err(crate::error::invalid(format!(
            "{what} must be 32-bit floats"
        )));
    }
    Ok(raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect())
}

/// A host placement from its URI (`memio://cpu/dram`, `memio://cpu/dram?numa=1`,
/// `memio://cxl/pool?device=0`).
pub(crate) fn placement(uri: &str) -> PyResult<HostPlacement> {
    let parsed = gpuio_api::Uri::parse(uri).map_err(crate::error::to_py)?;
    parsed.host_placement().ok_or_else(|| {
        crate::error::invalid(format!(
            "{uri} is not host memory (memio://cpu/dram, memio://cxl/...)"
        ))
    })
}

/// The GPUs to wait for before device work reads or writes `bufs`: those of gpuio buffers
/// another library was given a view of (its work on them is queued on its own streams).
pub(crate) fn shared_gpus(bufs: &[&DeviceBuffer]) -> Vec<gpuio_api::Gpu> {
    bufs.iter()
        .filter_map(|b| b.shared_with().cloned())
        .collect()
}

/// Synchronizes `gpus` (without the GIL: called inside `detach`).
pub(crate) fn settle(gpus: &[gpuio_api::Gpu]) -> gpuio_ai::Result<()> {
    for g in gpus {
        g.synchronize()?;
    }
    Ok(())
}

/// AI work as Python names it (`Work(kind, deadline, compute, best_effort)`, spelled as
/// [`work`] takes it), checked once and handed to the structures' `set_work`.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct Work(pub(crate) AiWork);

#[pymethods]
impl Work {
    #[new]
    #[pyo3(signature = (kind, deadline=None, compute=0.0, best_effort=false))]
    fn new(kind: &str, deadline: Option<f64>, compute: f64, best_effort: bool) -> PyResult<Self> {
        let w = work(kind, deadline, compute, best_effort)?;
        w.checked().map(Self).map_err(to_py)
    }
}

/// AI work from its Python spelling: `kind` is `decode` (the realtime class, no deadline),
/// `inference` (due in `deadline` seconds, `compute` of them after its IO; `best_effort`
/// ranks it with training), `training_forward`, `training_backward`, `checkpoint`,
/// `engram_sync` or `prefetch`.
fn work(kind: &str, deadline: Option<f64>, compute: f64, best_effort: bool) -> PyResult<AiWork> {
    let secs = |s: f64, what: &str| {
        Duration::try_from_secs_f64(s)
            .map_err(|_| crate::error::invalid(format!("{what} of {s} s")))
    };
    Ok(match kind {
        "decode" => AiWork::Decode,
        "inference" => AiWork::Inference(InferenceQos {
            deadline: secs(
                deadline.ok_or_else(|| crate::error::invalid("inference work needs a deadline"))?,
                "a deadline",
            )?,
            estimated_duration: secs(compute, "a compute time")?,
            criticality: if best_effort {
                Criticality::BestEffort
            } else {
                Criticality::Standard
            },
        }),
        "training_forward" => AiWork::TrainingStep { backward: false },
        "training_backward" => AiWork::TrainingStep { backward: true },
        "checkpoint" => AiWork::Checkpoint,
        "engram_sync" => AiWork::EngramSync,
        "prefetch" => AiWork::Prefetch,
        _ => {
            return Err(crate::error::invalid(format!(
                "AI work {kind:?}: decode, inference, training_forward, training_backward, \
                 checkpoint, engram_sync or prefetch"
            )));
        }
    })
}

/// The scheduler class (its Python name) and the IO deadline, in seconds from now, of AI
/// work (as [`work`] spells it).
#[pyfunction]
#[pyo3(signature = (kind, deadline=None, compute=0.0, best_effort=false))]
fn work_class(
    kind: &str,
    deadline: Option<f64>,
    compute: f64,
    best_effort: bool,
) -> PyResult<(&'static str, Option<f64>)> {
    let work = work(kind, deadline, compute, best_effort)?;
    let now = Instant::now();
    let due = work.io_deadline(now).map_err(to_py)?;
    Ok((
        crate::session::priority_name(work.priority()),
        due.map(|d| d.duration_since(now).as_secs_f64()),
    ))
}

/// Adds the `ai` submodule's classes and functions to `m`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(work_class, m)?)?;
    m.add_class::<Work>()?;
    m.add_class::<kv::KvPool>()?;
    m.add_class::<kv::KvBatch>()?;
    m.add_class::<kv::SwapInKv>()?;
    m.add_class::<kv::SwapInBatch>()?;
    m.add_class::<engram::EngramTable>()?;
    m.add_class::<engram::AiPending>()?;
    m.add_class::<graph::CsrGraph>()?;
    m.add_function(wrap_pyfunction!(graph::graph_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(graph::graph_gather, m)?)?;
    compress::register(m)
}
