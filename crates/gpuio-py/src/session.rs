//! `gpuio._gpuio.Session` (subclassed by `gpuio.Session` in Python) and the handle of an
//! asynchronous request. Every call that moves data releases the GIL.

use crate::buffers::{DeviceBuffer, HostBuffer, Resource, Target};
use crate::error::DetachIn;
use crate::error::{invalid, to_py};
use gpuio_api::{
    Access, Config, Dest, HostPlacement, Priority, Request, RequestHandle, Source, Status, Ticket,
    Uri,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

/// A gpuio session: devices, engines and the scheduler, shared by every call made through it.
#[pyclass(module = "gpuio", subclass, frozen)]
pub struct Session {
    inner: Arc<gpuio_api::Session>,
}

/// One transfer of a batch as Python passes it: source, its offset, destination, its offset,
/// size.
type BatchOp<'py> = (Bound<'py, PyAny>, u64, Bound<'py, PyAny>, u64, usize);

/// What must happen before a transfer touches `ends`: the GPUs another library may have
/// queued copies of gpuio buffers on (it was given a view of them) are synchronized. Runs
/// without the GIL.
fn settle(
    session: &gpuio_api::Session,
    ends: &[&Target<'_>],
) -> impl Fn() -> gpuio_api::Result<()> + Send + use<> {
    let mut gpus: Vec<gpuio_api::Gpu> = ends.iter().flat_map(|t| t.shared_gpus(session)).collect();
    gpus.dedup_by_key(|g| g.ordinal());
    move || {
        for g in &gpus {
            g.synchronize()?;
        }
        Ok(())
    }
}

/// `data` from `offset` on.
fn part(data: &[u8], offset: u64) -> PyResult<&[u8]> {
    usize::try_from(offset)
        .ok()
        .and_then(|start| data.get(start..))
        .ok_or_else(|| invalid(format!("offset {offset} past the source's end")))
}

/// `data` from `offset` on, to write.
fn part_mut(data: &mut [u8], offset: u64) -> PyResult<&mut [u8]> {
    let len = data.len();
    usize::try_from(offset)
        .ok()
        .and_then(|start| data.get_mut(start..))
        .ok_or_else(|| invalid(format!("offset {offset} past the {len}-byte destination")))
}

/// A transfer's result, in bytes.
fn moved(o: gpuio_api::Outcome) -> usize {
    o.bytes
}

impl Session {
    /// The gpuio-api session behind it.
    pub(crate) fn session(&self) -> &Arc<gpuio_api::Session> {
        &self.inner
    }
}

#[pymethods]
impl Session {
    /// `config`: a TOML file's path; `toml`: the configuration's text. Neither: the defaults,
    /// or `$GPUIO_CONFIG`. `GPUIO_*` environment overrides apply in every case.
    #[new]
    #[pyo3(signature = (config=None, toml=None))]
    fn new(py: Python<'_>, config: Option<&str>, toml: Option<&str>) -> PyResult<Self> {
        let config = match (config, toml) {
            (Some(_), Some(_)) => {
                return Err(invalid("give a configuration path or text, not both"));
            }
            (_, Some(text)) => Config::from_toml(text, None).and_then(|mut c| {
                c.apply_env(|k| std::env::var(k).ok())?;
                Ok(c)
            }),
            (path, None) => Config::load(path.map(Path::new)),
        }
        .map_err(to_py)?;
        let inner = py
            .detach_kept(|| gpuio_api::Session::new(config))
            .map_err(to_py)?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Opens a file or remote export (or allocates the memory a `gpu0`/`dram` URI names, of
    /// `size` bytes) for reading, or with `write=True` for writing (files are created or
    /// truncated), or with `update=True` for reading and writing in place (files must exist).
    #[pyo3(signature = (uri, write=false, size=0, update=false))]
    fn open(
        &self,
        py: Python<'_>,
        uri: &str,
        write: bool,
        size: usize,
        update: bool,
    ) -> PyResult<Resource> {
        let parsed = Uri::parse(uri).map_err(to_py)?;
        let access = match (write, update) {
            (false, false) => Access::Read,
            (true, false) => Access::Write,
            (false, true) => Access::Update,
            (true, true) => return Err(invalid("open for write or for update, not both")),
        };
        let res = py
            .detach_in(&self.inner, || self.inner.open(&parsed, size, access))?
            .map_err(to_py)?;
        Ok(Resource::new(res, uri.to_string()))
    }

    /// `size` bytes of host memory, page-locked for DMA unless `pinned=False`.
    #[pyo3(signature = (size, pinned=true))]
    fn alloc_host(&self, py: Python<'_>, size: usize, pinned: bool) -> PyResult<HostBuffer> {
        let dram = HostPlacement::Dram { numa: None };
        let mem = py
            .detach_in(&self.inner, || self.inner.alloc_host(dram, size, pinned))?
            .map_err(to_py)?;
        Ok(HostBuffer::new(mem))
    }

    /// `size` bytes of memory on GPU `gpu`.
    #[pyo3(signature = (size, gpu=0))]
    fn alloc_device(&self, py: Python<'_>, size: usize, gpu: u32) -> PyResult<DeviceBuffer> {
        let buf = py
            .detach_in(&self.inner, || self.inner.alloc_device(gpu, size))?
            .map_err(to_py)?;
        Ok(DeviceBuffer::new(buf, None))
    }

    /// Borrows `size` bytes of another library's GPU memory at `address` on GPU `gpu` (the
    /// GPU whose allocation holds it, when `None`), checked with the driver, keeping `owner`
    /// alive; waits for the GPU's queued work first, so what the owner's streams were
    /// writing is in place.
    fn _borrow_device(
        &self,
        py: Python<'_>,
        gpu: Option<u32>,
        address: u64,
        size: usize,
        owner: Py<PyAny>,
    ) -> PyResult<DeviceBuffer> {
        // The buffer (and every queued transfer's clone of it) holds the owner: dropping the
        // Python objects early cannot free memory a transfer still writes.
        let gpus: Vec<&gpuio_api::Gpu> = match gpu {
            Some(n) => vec![self.inner.gpu(n).map_err(to_py)?],
            None => self.inner.gpus().iter().collect(),
        };
        let owners: Vec<Py<PyAny>> = gpus.iter().map(|_| owner.clone_ref(py)).collect();
        let buf = py
            .detach_in(&self.inner, || {
                let mut first_err = None;
                for (g, keep) in gpus.into_iter().zip(owners) {
                    let borrowed = g
                        .borrow_device(address, size, keep)
                        .and_then(|b| g.synchronize().map(|()| b));
                    match borrowed {
                        Ok(b) => return Ok(b),
                        Err(e) => {
                            first_err.get_or_insert(gpuio_api::Error::from(e));
                        }
                    }
                }
                Err(first_err
                    .unwrap_or_else(|| gpuio_api::Error::Invalid("this session has no GPU".into())))
            })?
            .map_err(to_py)?;
        Ok(DeviceBuffer::new(buf, Some(owner)))
    }

    /// Moves `size` bytes, blocking: from `src` at `src_offset` to `dst` at `dst_offset`;
    /// `durable`: on stable storage when it returns. Memory Python lends (a byte
    /// `memoryview`) is read or written in place, where the other end is a resource or GPU
    /// memory.
    #[pyo3(signature = (src, src_offset, dst, dst_offset, size, durable=false))]
    #[allow(clippy::too_many_arguments)]
    fn _transfer(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        src_offset: u64,
        dst: &Bound<'_, PyAny>,
        dst_offset: u64,
        size: usize,
        durable: bool,
    ) -> PyResult<usize> {
        let (src, dst) = (Target::of(src)?, Target::of(dst)?);
        let wait = settle(&self.inner, &[&src, &dst]);
        let far = |t: &Target<'_>, offset| match t {
            Target::Resource(_) | Target::Device(_) | Target::Host(_) => t.endpoint(offset),
            _ => Err(invalid(
                "memory gpuio does not own moves in place only to or from a resource, GPU \
                 memory or a gpuio host buffer",
            )),
        };
        let inner = &self.inner;
        let go = |s: Source<'_>, d: Dest<'_>| {
            wait()?;
            if durable {
                inner.transfer_durable(s, d, size)
            } else {
                inner.transfer(s, d, size)
            }
        };
        let outcome = match (src, dst) {
            (Target::Bytes(b), d) => {
                let d = d
                    .endpoint(dst_offset)?
                    .ok_or_else(|| invalid("bytes to bytes needs no gpuio call"))?;
                let part = part(b.as_bytes(), src_offset)?;
                py.detach_kept(|| go(Source::Host(part), d.dest()))
            }
            (Target::Lent(s), d) => {
                let d = far(&d, dst_offset)?.ok_or_else(|| invalid("no destination"))?;
                let part = part(s.bytes(), src_offset)?;
                py.detach_kept(|| go(Source::Host(part), d.dest()))
            }
            (s, Target::Lent(mut d)) => {
                let s = far(&s, src_offset)?.ok_or_else(|| invalid("no source"))?;
                let part = part_mut(d.bytes_mut()?, dst_offset)?;
                py.detach_kept(|| go(s.source(), Dest::Host(part)))
            }
            (s, d) => {
                let s = s
                    .endpoint(src_offset)?
                    .ok_or_else(|| invalid("a source with no endpoint"))?;
                let d = d.endpoint(dst_offset)?.ok_or_else(|| {
                    invalid("bytes are immutable: a destination must be writable")
                })?;
                py.detach_kept(|| go(s.source(), d.dest()))
            }
        };
        outcome.map(moved).map_err(to_py)
    }

    /// Queues a transfer on the scheduler, in class `priority` (a [`priority`] name; the
    /// default class where None) and due `deadline` seconds from now where given. The request
    /// holds both ends until it is done (a borrowed tensor through its buffer's owner),
    /// whatever becomes of the handle.
    #[pyo3(signature = (src, src_offset, dst, dst_offset, size, priority=None, deadline=None))]
    #[allow(clippy::too_many_arguments)]
    fn _submit(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        src_offset: u64,
        dst: &Bound<'_, PyAny>,
        dst_offset: u64,
        size: usize,
        priority: Option<&str>,
        deadline: Option<f64>,
    ) -> PyResult<Handle> {
        let (src, dst) = (Target::of(src)?, Target::of(dst)?);
        let (Some(s), Some(d)) = (src.endpoint(src_offset)?, dst.endpoint(dst_offset)?) else {
            return Err(invalid(
                "an asynchronous transfer needs gpuio memory, a tensor or a resource on both \
                 ends, not bytes",
            ));
        };
        let mut req = Request::new(s, d, size).map_err(|e| to_py(e.into()))?;
        if let Some(p) = priority {
            req = req.with_priority(self::priority(p)?);
        }
        if let Some(secs) = deadline {
            req = req.with_deadline(due(secs)?);
        }
        // Submission waits for room under backpressure: not with the GIL held.
        let wait = settle(&self.inner, &[&src, &dst]);
        let h = py
            .detach_in(&self.inner, || {
                wait()?;
                self.inner.submit(req)
            })?
            .map_err(to_py)?;
        Ok(Handle {
            ticket: h.ticket().clone(),
            waiter: Mutex::new((Some(h), None)),
        })
    }

    /// Holds scheduler class `priority` (a [`priority`] name) for IO the caller runs outside
    /// the scheduler, due `deadline` seconds from now where given; waits for admission
    /// without the GIL.
    #[pyo3(signature = (priority, deadline=None))]
    fn _lease(&self, py: Python<'_>, priority: &str, deadline: Option<f64>) -> PyResult<Lease> {
        let class = self::priority(priority)?;
        let due = deadline.map(due).transpose()?;
        let held = py.detach_in(&self.inner, || self.inner.lease(class, due))?;
        Ok(Lease {
            held: Mutex::new(Some(held)),
        })
    }

    /// Runs transfers `(src, src_offset, dst, dst_offset, size)` as one batch (sorted,
    /// adjacent ones merged, grouped by engine) and waits for all; fails with the first error.
    fn _batch<'py>(&self, py: Python<'py>, ops: Vec<BatchOp<'py>>) -> PyResult<Bound<'py, PyDict>> {
        let mut reqs = Vec::with_capacity(ops.len());
        let mut gpus = Vec::new();
        for (src, so, dst, dof, size) in &ops {
            let (src, dst) = (Target::of(src)?, Target::of(dst)?);
            gpus.extend(
                [&src, &dst]
                    .into_iter()
                    .flat_map(|t| t.shared_gpus(&self.inner)),
            );
            let (Some(s), Some(d)) = (src.endpoint(*so)?, dst.endpoint(*dof)?) else {
                return Err(invalid(
                    "a batch moves between gpuio memory, tensors and resources",
                ));
            };
            reqs.push(Request::new(s, d, *size).map_err(|e| to_py(e.into()))?);
        }
        let report = py
            .detach_in(&self.inner, || {
                for g in &gpus {
                    g.synchronize()?;
                }
                self.inner.submit_batch(reqs)?.wait().map_err(Into::into)
            })?
            .map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("requests", report.requests)?;
        d.set_item("segments", report.segments)?;
        d.set_item("bytes", report.bytes)?;
        Ok(d)
    }

    /// Copies strided pieces from `src` to `dst`, device buffers apart from each other, on
    /// `src`'s GPU, and waits: `dst` may be another GPU's (written over the peer link where
    /// `src`'s reaches it, else staged). `pieces` holds six 64-bit integers per piece
    /// (src_offset, src_pitch, dst_offset, dst_pitch, width, rows; `gpuio_hal::Piece2d`), as
    /// bytes or a host array. What a tensor-parallel load sends each device its parts of
    /// every tensor by.
    fn _copy_pieces(
        &self,
        py: Python<'_>,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
        pieces: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let raw = crate::ai::indices(pieces, "pieces")?;
        if !raw.len().is_multiple_of(6) {
            return Err(invalid("pieces are six 64-bit integers each"));
        }
        let size = |v: u64| usize::try_from(v).ok();
        let list = raw
            .chunks_exact(6)
            .map(|c| {
                Some(gpuio_hal::Piece2d {
                    src_offset: size(c[0])?,
                    src_pitch: size(c[1])?,
                    dst_offset: size(c[2])?,
                    dst_pitch: size(c[3])?,
                    width: size(c[4])?,
                    rows: size(c[5])?,
                })
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| invalid("a piece's numbers exceed the address space"))?;
        let mut gpus: Vec<gpuio_api::Gpu> = [src, dst]
            .iter()
            .filter_map(|b| b.shared_with().cloned())
            .collect();
        gpus.dedup_by_key(|g| g.ordinal());
        py.detach_in(&self.inner, || {
            for g in &gpus {
                g.synchronize()?;
            }
            src.buf
                .gpu()
                .stream()?
                .copy_pieces(&src.buf, &dst.buf, &list)
        })?
        .map_err(|e| to_py(e.into()))
    }

    /// Gathers rows of `row_bytes` from `pool` into `out` at `out_offset`: output row `i` is
    /// pool row `indices[i]`, `indices` the little-endian u64s of a bytes object.
    fn _gather<'py>(
        &self,
        py: Python<'py>,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: &[u8],
        out: &DeviceBuffer,
        out_offset: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        if !indices.len().is_multiple_of(8) {
            return Err(invalid("indices must be 64-bit integers"));
        }
        let mut gpus: Vec<gpuio_api::Gpu> = out.shared_with().cloned().into_iter().collect();
        if pool.is_shared() {
            gpus = self.inner.gpus().to_vec();
        }
        let list: Vec<u64> = indices
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let report = py
            .detach_in(&self.inner, || {
                for g in &gpus {
                    g.synchronize()?;
                }
                let pool = pool.mem.read();
                self.inner.memio().gather(
                    &pool,
                    row_bytes,
                    list.as_slice(),
                    &out.buf,
                    out_offset,
                    &Default::default(),
                )
            })?
            .map_err(|e| to_py(e.into()))?;
        let d = PyDict::new(py);
        d.set_item("rows", report.rows)?;
        d.set_item("rows_fetched", report.rows_fetched)?;
        d.set_item("path", format!("{:?}", report.strategy))?;
        Ok(d)
    }
}

/// A scheduler lease (`Session.lease`): while it is held, less urgent queued requests and
/// leases (the AI tier's prefetches, write-backs, a checkpoint's chunks) wait, at most the
/// scheduler's `max_wait`. A context manager; `release()` ends it early.
#[pyclass(module = "gpuio", frozen)]
pub struct Lease {
    held: Mutex<Option<gpuio_api::Lease>>,
}

#[pymethods]
impl Lease {
    /// Ends it (again: nothing).
    fn release(&self) {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.release();
        false
    }
}

/// The instant `secs` seconds from now (a deadline); refused where it is negative, not a
/// number, or past what the clock can hold.
fn due(secs: f64) -> PyResult<std::time::Instant> {
    std::time::Duration::try_from_secs_f64(secs)
        .ok()
        .and_then(|d| std::time::Instant::now().checked_add(d))
        .ok_or_else(|| invalid(format!("a deadline of {secs} s")))
}

/// The scheduler class a Python name gives (the C API's `GPUIO_PRIORITY_*` names, lower
/// case, without the prefix).
pub(crate) fn priority(name: &str) -> PyResult<Priority> {
    Ok(match name {
        "inference_realtime" => Priority::InferenceRealtime,
        "training_forward" => Priority::TrainingForward,
        "training_backward" => Priority::TrainingBackward,
        "checkpoint" => Priority::Checkpoint,
        "engram_sync" => Priority::EngramSync,
        "background" => Priority::Background,
        _ => {
            return Err(invalid(format!(
                "priority {name:?}: inference_realtime, training_forward, training_backward, \
                 checkpoint, engram_sync or background"
            )));
        }
    })
}

/// The Python name of a scheduler class.
pub(crate) fn priority_name(p: Priority) -> &'static str {
    match p {
        Priority::InferenceRealtime => "inference_realtime",
        Priority::TrainingForward => "training_forward",
        Priority::TrainingBackward => "training_backward",
        Priority::Checkpoint => "checkpoint",
        Priority::EngramSync => "engram_sync",
        Priority::Background => "background",
    }
}

/// A request's result as the handle keeps it: bytes moved, or the error's parts.
type Settled = Result<usize, (String, i32, &'static str)>;

/// An asynchronous request: `done()` polls, `wait()` blocks (without the GIL), `await` works
/// in asyncio (see the Python half), `cancel()` stops it while it is still queued.
#[pyclass(module = "gpuio", frozen)]
pub struct Handle {
    ticket: Ticket,
    /// Taken by the first `wait`, which keeps the result for later ones.
    waiter: Mutex<(Option<RequestHandle>, Option<Settled>)>,
}

#[pymethods]
impl Handle {
    /// Whether it has finished (successfully or not).
    fn done(&self) -> bool {
        self.ticket.status().is_final()
    }

    /// Its status: pending, submitted, in_progress, completed, error or cancelled.
    #[getter]
    fn status(&self) -> &'static str {
        match self.ticket.status() {
            Status::Pending => "pending",
            Status::Submitted => "submitted",
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Error => "error",
            Status::Cancelled => "cancelled",
        }
    }

    /// Cancels it if no worker has picked it up yet; returns whether the cancel won.
    fn cancel(&self) -> bool {
        self.ticket.cancel()
    }

    /// Waits for it and returns the bytes moved, or raises its error (every call alike).
    fn wait(&self, py: Python<'_>) -> PyResult<usize> {
        let settled = py.detach_kept(|| {
            let mut w = self.waiter.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(h) = w.0.take() {
                w.1 = Some(h.wait().map(|c| c.outcome.bytes).map_err(|e| {
                    let e = gpuio_api::Error::from(e);
                    (e.to_string(), e.code().as_i32(), e.code().name())
                }));
            }
            w.1.clone()
        });
        match settled {
            Some(Ok(n)) => Ok(n),
            Some(Err(parts)) => Err(crate::error::Error::new_err(parts)),
            None => Err(invalid("the request's handle was lost")),
        }
    }
}
