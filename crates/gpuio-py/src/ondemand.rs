//! `gpuio._gpuio.PageCache` and `OnDemandArray`: on-demand arrays for kernels that another
//! library compiles and launches (CuPy's `RawModule`, a torch extension, Numba): gpuio keeps
//! the page cache in GPU memory and serves its misses; the kernel takes the array's
//! descriptor (`descriptor`, the bytes of `struct gpuio_array_desc`) and indexes it through
//! `gpuio_array<T>` (`device_header()` is the text to compile it with). A read-only array that
//! fits its cache can be held there (`resident()`): kernels then read it through
//! `gpuio_resident_array<T>` with no pin or check per access.

use crate::buffers::Target;
use crate::error::{DetachIn, invalid, to_py};
use crate::session::Session;
use gpuio_api::{ArrayMode, PageCacheConfig};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

/// A core or HAL error (what the array calls return) as `gpuio.Error`.
fn core(e: impl Into<gpuio_api::Error>) -> PyErr {
    to_py(e.into())
}

/// A page cache in one GPU's memory, shared by the arrays made from it.
#[pyclass(module = "gpuio", subclass, frozen)]
pub struct PageCache {
    inner: gpuio_api::PageCache,
    session: Arc<gpuio_api::Session>,
}

#[pymethods]
impl PageCache {
    /// `capacity` bytes of GPU `gpu`'s memory in pages of `page_size` bytes (a power of two,
    /// 512 B to 64 KiB), its misses served through `session`'s engines by a ring of `slots`
    /// slots (the default where `None`); `in_place`: read-only arrays over warm files (or
    /// host memory) read misses from the pinned pages where the device can (no ring), a page
    /// serving its first `admit_after` touches (the default where `None`) from there before
    /// it is cached.
    #[new]
    #[pyo3(signature = (session, gpu=0, page_size=4096, capacity=256 << 20, slots=None, in_place=true, admit_after=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        session: &Bound<'_, Session>,
        gpu: u32,
        page_size: usize,
        capacity: usize,
        slots: Option<usize>,
        in_place: bool,
        admit_after: Option<u32>,
    ) -> PyResult<Self> {
        let mut cfg = PageCacheConfig {
            page_size,
            capacity,
            in_place,
            ..PageCacheConfig::default()
        };
        if let Some(n) = admit_after {
            cfg.admit_after = n;
        }
        if let Some(n) = slots {
            cfg.ring.slots = n;
        }
        let session = Arc::clone(session.get().session());
        let inner = py
            .detach_in(&session, || session.page_cache(gpu, cfg))?
            .map_err(to_py)?;
        Ok(Self { inner, session })
    }

    /// Bytes per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    /// Pages the cache holds at once.
    #[getter]
    fn frames(&self) -> usize {
        self.inner.frames()
    }

    /// An array of `nbytes` bytes of `source` (an opened resource or gpuio memory) from
    /// `offset`, seen by kernels as elements of `itemsize` bytes; `writable`: pages kernels
    /// store into go back to the source (on eviction, `synchronize` and `close`).
    #[pyo3(signature = (source, nbytes, itemsize=1, offset=0, writable=false))]
    fn _array(
        &self,
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
        nbytes: u64,
        itemsize: u64,
        offset: u64,
        writable: bool,
    ) -> PyResult<OnDemandArray> {
        if itemsize == 0 || !nbytes.is_multiple_of(itemsize) {
            return Err(invalid(format!(
                "{nbytes} bytes are not a whole number of {itemsize}-byte elements"
            )));
        }
        let endpoint = Target::of(source)?
            .endpoint(offset)?
            .ok_or_else(|| invalid("an on-demand array's source is a resource or gpuio memory"))?;
        let mode = if writable {
            ArrayMode::ReadWrite
        } else {
            ArrayMode::ReadOnly
        };
        let array = py
            .detach_in(&self.session, || {
                self.inner.array::<u8>(endpoint, nbytes, mode)
            })?
            .map_err(core)?;
        Ok(OnDemandArray {
            inner: Mutex::new(Some(Open {
                views: BTreeMap::new(),
                next_view: 0,
                array: Arc::new(array),
            })),
            session: Arc::clone(&self.session),
            itemsize,
            nbytes,
        })
    }

    /// Shuts the cache's ring down: misses after it fail (hits still read cached pages).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        py.detach_kept(|| self.inner.shutdown()).map_err(core)?;
        Ok(())
    }
}

/// An array over a source, read (and written) by GPU threads through a [`PageCache`].
#[pyclass(module = "gpuio", frozen)]
pub struct OnDemandArray {
    /// `None` once closed.
    inner: Mutex<Option<Open>>,
    /// Its cache's session (checked to belong to this process before each call).
    session: Arc<gpuio_api::Session>,
    itemsize: u64,
    nbytes: u64,
}

/// An open array and the resident views it holds. The views live here, not in the Python
/// objects that name them, so a view object collected while kernels still use its
/// descriptor (`desc = arr.resident().descriptor`) lets nothing go: only `release()` or
/// closing the array does.
struct Open {
    // Dropped before the array: their pages are let go while it is still in its cache.
    views: BTreeMap<u64, gpuio_api::ResidentArray<'static, u8>>,
    next_view: u64,
    /// On the heap: the array holds 64-byte-aligned slot copies, more than a Python object's
    /// memory is aligned to. Shared with its views.
    array: Arc<gpuio_api::OnDemandArray<u8>>,
}

impl Open {
    /// Waits for the GPU's queued work (kernels another library launched may still read
    /// through a view), then lets every view go; the first failure.
    fn let_views_go(&mut self) -> Result<(), gpuio_api::Error> {
        if self.views.is_empty() {
            return Ok(());
        }
        let mut first = self.array.cache().gpu().synchronize().err().map(Into::into);
        for (_, view) in std::mem::take(&mut self.views) {
            if let Err(e) = view.release() {
                first.get_or_insert(e.into());
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl OnDemandArray {
    /// Runs `f` on the array unless it was closed.
    fn with<R: Send, E: Into<gpuio_api::Error>>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&gpuio_api::OnDemandArray<u8>) -> Result<R, E> + Send,
    ) -> PyResult<R> {
        // The lock is held throughout, so a close waits for calls under way.
        py.detach_in(&self.session, || {
            let guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            match guard.as_ref() {
                Some(open) => f(&open.array).map_err(core),
                None => Err(invalid("the on-demand array is closed")),
            }
        })?
    }

    /// Elements `start .. start + count` as bytes, checked against the array.
    fn byte_range(&self, start: u64, count: u64) -> PyResult<(u64, u64)> {
        let bytes = |n: u64| n.checked_mul(self.itemsize);
        match (bytes(start), bytes(count)) {
            (Some(s), Some(c)) if s.checked_add(c).is_some_and(|e| e <= self.nbytes) => Ok((s, c)),
            _ => Err(invalid(format!(
                "elements {start} + {count} of an array of {}",
                self.nbytes / self.itemsize
            ))),
        }
    }
}

#[pymethods]
impl OnDemandArray {
    /// Elements.
    fn __len__(&self) -> usize {
        (self.nbytes / self.itemsize) as usize
    }

    /// How misses are read: in place from the file's pinned page cache pages, or through the
    /// ring (and why not in place).
    #[getter]
    fn miss_path(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |a| Ok::<_, gpuio_api::Error>(a.miss_path().to_string()))
    }

    /// Bytes of the source the array covers.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// The kernel's descriptor: the bytes of `struct gpuio_array_desc`, to pass by value or
    /// to copy into device memory for a kernel taking `const gpuio_array_desc*`. Good until
    /// the array is closed: kernels using it must have finished by then (synchronize first).
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let d = self.with(py, |a| a.device())?;
        Ok(PyBytes::new(py, &d.to_bytes()))
    }

    /// Brings elements `start .. start + count` into the cache.
    fn prefetch(&self, py: Python<'_>, start: u64, count: u64) -> PyResult<()> {
        let (s, c) = self.byte_range(start, count)?;
        self.with(py, |a| a.prefetch(s, c))
    }

    /// Writes dirty pages back and makes a file source's data durable.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |a| a.synchronize())
    }

    /// Raises the first error kernels' accesses met since the last check (a failed access
    /// reads as zero, so call it after every kernel whose data matters).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |a| a.check())
    }

    /// Hits, misses, waits, evictions, write-backs, bytes in and out, failures, reads served
    /// in place (`direct_reads`) and the bytes they moved (`direct_bytes`, whole 32-byte
    /// sectors), and miss latency p50 / p99 in ns (`None` before any miss).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |a| a.stats())?;
        let d = PyDict::new(py);
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("waits", s.waits)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("writebacks", s.writebacks)?;
        d.set_item("bytes_in", s.bytes_in)?;
        d.set_item("bytes_out", s.bytes_out)?;
        d.set_item("failures", s.failures)?;
        d.set_item("direct_reads", s.direct_reads)?;
        d.set_item("direct_bytes", s.direct_bytes)?;
        d.set_item("miss_p50_ns", s.miss_quantile_ns(0.5))?;
        d.set_item("miss_p99_ns", s.miss_quantile_ns(0.99))?;
        Ok(d)
    }

    /// Holds every page of this read-only array in the cache (bringing in those not cached)
    /// until the returned view is released (`release()`, the end of a `with` block, or
    /// closing the array; not the view's garbage collection, so a descriptor taken from it
    /// stays good): kernels then read it through `gpuio_resident_array<T>` with no pin or
    /// check per access. Raises for a writable array and for one with more pages than the
    /// cache has frames free.
    fn resident(slf: &Bound<'_, Self>) -> PyResult<ResidentArray> {
        let this = slf.get();
        let id = slf.py().detach_kept(|| {
            let mut guard = this.inner.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(open) = guard.as_mut() else {
                return Err(invalid("the on-demand array is closed"));
            };
            let view = open.array.resident_shared().map_err(core)?;
            let id = open.next_view;
            open.next_view += 1;
            open.views.insert(id, view);
            Ok(id)
        })?;
        Ok(ResidentArray {
            array: slf.clone().unbind(),
            id,
        })
    }

    /// Lets its resident views go (after waiting for the GPU's queued work), writes dirty
    /// pages back and frees the array's frames; only while no kernel uses it. Later calls
    /// raise; closing again does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach_kept(|| {
            let taken = self
                .inner
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            let Some(mut open) = taken else {
                return Ok(());
            };
            let released = open.let_views_go();
            let closed = match Arc::try_unwrap(open.array) {
                Ok(a) => a.close(),
                // Nothing else keeps a handle: the views were its only other owners.
                Err(_) => Ok(()),
            };
            released.map_err(to_py)?;
            closed.map_err(core)
        })
    }
}

/// A read-only [`OnDemandArray`] held in its cache (`OnDemandArray.resident()`): kernels read
/// it through `gpuio_resident_array<T>` from its `descriptor` (the bytes of
/// `struct gpuio_resident_desc`) until `release()`, the end of a `with` block, or the array's
/// `close()` lets the pages go. The hold belongs to the array: collecting this object lets
/// nothing go.
#[pyclass(module = "gpuio", frozen)]
pub struct ResidentArray {
    array: Py<OnDemandArray>,
    /// The view's key in the array's views.
    id: u64,
}

#[pymethods]
impl ResidentArray {
    /// The kernel's descriptor, the bytes of `struct gpuio_resident_desc`: good until the
    /// view is released.
    #[getter]
    fn descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let array = self.array.get();
        let d = py.detach_kept(|| {
            let guard = array.inner.lock().unwrap_or_else(PoisonError::into_inner);
            match guard.as_ref().and_then(|open| open.views.get(&self.id)) {
                Some(view) => view.device().map_err(core),
                None => Err(invalid("the resident view was released")),
            }
        })?;
        Ok(PyBytes::new(py, &d.to_bytes()))
    }

    /// Waits for the GPU's queued work (kernels reading through the view), then lets the
    /// pages go; releasing again does nothing.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let array = self.array.get();
        py.detach_kept(|| {
            let mut guard = array.inner.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(open) = guard.as_mut() else {
                return Ok(());
            };
            let Some(view) = open.views.remove(&self.id) else {
                return Ok(());
            };
            open.array.cache().gpu().synchronize().map_err(core)?;
            view.release().map_err(core)
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }
}
