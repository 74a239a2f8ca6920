//! What Python holds of gpuio: host and device buffers (with the array interfaces that let
//! NumPy, PyTorch and CuPy view them without a copy) and opened resources; and [`Target`],
//! the one argument type of every transfer.

use crate::error::to_py;
use crate::lent::Lent;
use gpuio_api::{Endpoint, HostMemory};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyMemoryView};
use std::sync::atomic::{AtomicBool, Ordering};

/// Host memory gpuio allocated (pinned where asked): `numpy.asarray(buf)` and
/// `torch.from_numpy` view it in place. Python must not write it while a transfer uses it.
#[pyclass(module = "gpuio", frozen)]
pub struct HostBuffer {
    pub(crate) mem: HostMemory,
    addr: u64,
    len: usize,
    pinned: bool,
    /// Whether another library was given a view of it: a GPU copy it queued (a non-blocking
    /// `.to("cuda")`) may still read or write it, so a transfer waits for the GPUs first.
    shared: AtomicBool,
}

impl HostBuffer {
    /// Whether another library was given a view of it.
    pub(crate) fn is_shared(&self) -> bool {
        self.shared.load(Ordering::Acquire)
    }

    pub(crate) fn new(mem: HostMemory) -> Self {
        let (addr, len, pinned) = {
            let b = mem.read();
            (b.as_slice().as_ptr() as u64, b.len(), b.is_pinned())
        };
        Self {
            mem,
            addr,
            len,
            pinned,
            shared: AtomicBool::new(false),
        }
    }
}

#[pymethods]
impl HostBuffer {
    fn __len__(&self) -> usize {
        self.len
    }

    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// Whether it is page-locked for DMA.
    #[getter]
    fn pinned(&self) -> bool {
        self.pinned
    }

    /// The address of its first byte.
    #[getter]
    fn address(&self) -> u64 {
        self.addr
    }

    /// NumPy's array interface (version 3): one dimension of bytes, writable.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.shared.store(true, Ordering::Release);
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.len,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.addr, false))?;
        Ok(d)
    }

    /// DLPack export (through NumPy's view of it): `torch.from_dlpack(buf)` shares it.
    #[pyo3(signature = (**kwargs))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let view = py.import("numpy")?.call_method1("asarray", (slf,))?;
        view.call_method("__dlpack__", (), kwargs)
    }

    /// `(kDLCPU, 0)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (1, 0)
    }

    fn __repr__(&self) -> String {
        format!(
            "gpuio.HostBuffer({} bytes{})",
            self.len,
            if self.pinned { ", pinned" } else { "" }
        )
    }
}

/// GPU memory: allocated by gpuio, or another library's (a tensor's) that gpuio borrows and
/// keeps a reference to. On CUDA, `__cuda_array_interface__` lets PyTorch and CuPy view it.
#[pyclass(module = "gpuio", frozen)]
pub struct DeviceBuffer {
    pub(crate) buf: gpuio_api::DeviceBuffer,
    /// The Python object whose memory this is, kept alive with it.
    owner: Option<Py<PyAny>>,
    /// Whether another library was given a view of it (CUDA array interface, DLPack): its
    /// work on that view is queued on its own streams, so a transfer waits for the device
    /// first.
    shared: AtomicBool,
}

impl DeviceBuffer {
    pub(crate) fn new(buf: gpuio_api::DeviceBuffer, owner: Option<Py<PyAny>>) -> Self {
        Self {
            buf,
            owner,
            shared: AtomicBool::new(false),
        }
    }

    /// The GPU to wait for before a transfer uses it, if another library may have work queued
    /// on it.
    pub(crate) fn shared_with(&self) -> Option<&gpuio_api::Gpu> {
        self.shared.load(Ordering::Acquire).then(|| self.buf.gpu())
    }
}

#[pymethods]
impl DeviceBuffer {
    fn __len__(&self) -> usize {
        self.buf.len()
    }

    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buf.len()
    }

    /// The GPU's ordinal.
    #[getter]
    fn gpu(&self) -> u32 {
        self.buf.gpu().ordinal()
    }

    /// The device address of its first byte.
    #[getter]
    fn address(&self) -> u64 {
        self.buf.device_addr()
    }

    /// The object whose memory this is (`None` when gpuio allocated it).
    #[getter]
    fn owner(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.owner.as_ref().map(|o| o.clone_ref(py))
    }

    /// The CUDA array interface (version 3): one dimension of bytes. Absent on the host
    /// backend, whose "device" memory is host memory no CUDA library may touch.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if self.buf.gpu().backend() != gpuio_api::Backend::Cuda {
            return Err(pyo3::exceptions::PyAttributeError::new_err(
                "host-backend device memory has no CUDA array interface",
            ));
        }
        self.shared.store(true, Ordering::Release);
        let d = PyDict::new(py);
        d.set_item("version", 3)?;
        d.set_item("shape", (self.buf.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.buf.device_addr(), false))?;
        // gpuio's calls return with their work done: nothing to wait for.
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// DLPack export (a "dltensor" capsule of bytes on its CUDA device): `torch.from_dlpack`
    /// and CuPy share it. The stream argument is accepted and needs nothing: gpuio's calls
    /// return with their work done.
    #[pyo3(signature = (**_kwargs))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        _kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if slf.get().buf.gpu().backend() != gpuio_api::Backend::Cuda {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "host-backend device memory cannot be exported as CUDA memory",
            ));
        }
        slf.get().shared.store(true, Ordering::Release);
        let py = slf.py();
        py.import("gpuio._interop")?
            .call_method1("export_device", (slf,))
    }

    /// `(kDLCUDA, gpu)`; `(kDLCPU, 0)` on the host backend, whose export refuses.
    fn __dlpack_device__(&self) -> (i32, i32) {
        if self.buf.gpu().backend() == gpuio_api::Backend::Cuda {
            (2, self.buf.gpu().ordinal() as i32)
        } else {
            (1, 0)
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "gpuio.DeviceBuffer(gpu {}, {} bytes{})",
            self.buf.gpu().ordinal(),
            self.buf.len(),
            if self.owner.is_some() {
                ", borrowed"
            } else {
                ""
            }
        )
    }
}

/// A resource a URI names, opened once for many transfers (a file, a remote export, or
/// memory a `gpu0`/`dram` URI allocated).
#[pyclass(module = "gpuio", frozen)]
pub struct Resource {
    pub(crate) res: gpuio_api::Resource,
    uri: String,
    /// The process that opened it, in its line of forks: a remote export's connection and a
    /// session's engines stay with that process.
    generation: u64,
}

impl Resource {
    pub(crate) fn new(res: gpuio_api::Resource, uri: String) -> Self {
        Self {
            res,
            uri,
            generation: gpuio_hal::sys::fork_generation(),
        }
    }
}

#[pymethods]
impl Resource {
    /// The URI it was opened from.
    #[getter]
    fn uri(&self) -> &str {
        &self.uri
    }

    /// Its size in bytes now (a file's current length; asks a remote agent).
    fn size(&self, py: Python<'_>) -> PyResult<u64> {
        if gpuio_hal::sys::fork_generation() != self.generation {
            return Err(to_py(gpuio_api::Error::Invalid(
                "this resource was opened before fork(): open it again in the child".into(),
            )));
        }
        py.detach(|| self.res.len()).map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!("gpuio.Resource({:?})", self.uri)
    }
}

/// One end of a transfer as Python passes it: gpuio memory, an opened resource, (as a
/// source only) immutable `bytes`, or other host memory as a byte `memoryview` (a blocking
/// call's only). Other objects are resolved into these by the Python half.
pub(crate) enum Target<'py> {
    Host(Bound<'py, HostBuffer>),
    Device(Bound<'py, DeviceBuffer>),
    Resource(Bound<'py, Resource>),
    Bytes(Bound<'py, PyBytes>),
    Lent(Lent),
}

impl<'py> Target<'py> {
    /// The end `obj` is. Checked by type, one cast after another: a failed cast costs a type
    /// comparison, where a failed extraction would build an exception (a microsecond a call).
    pub(crate) fn of(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(r) = obj.cast::<Resource>() {
            Ok(Self::Resource(r.clone()))
        } else if let Ok(h) = obj.cast::<HostBuffer>() {
            Ok(Self::Host(h.clone()))
        } else if let Ok(d) = obj.cast::<DeviceBuffer>() {
            Ok(Self::Device(d.clone()))
        } else if let Ok(b) = obj.cast::<PyBytes>() {
            Ok(Self::Bytes(b.clone()))
        } else if obj.cast::<PyMemoryView>().is_ok() {
            Ok(Self::Lent(Lent::of(obj)?))
        } else {
            Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "a transfer end must be gpuio memory, a resource or bytes, not {}",
                obj.get_type().name()?
            )))
        }
    }

    /// The endpoint `offset` bytes in (`None` for `bytes` and lent memory, which only a
    /// blocking call moves).
    pub(crate) fn endpoint(&self, offset: u64) -> PyResult<Option<Endpoint>> {
        let small = || {
            usize::try_from(offset)
                .map_err(|_| crate::error::invalid(format!("offset {offset} too large")))
        };
        Ok(Some(match self {
            Self::Host(h) => Endpoint::host(&h.get().mem, small()?),
            Self::Device(d) => Endpoint::device(&d.get().buf, small()?),
            Self::Resource(r) => r.get().res.at(offset).map_err(to_py)?,
            Self::Bytes(_) | Self::Lent(_) => return Ok(None),
        }))
    }

    /// The GPUs to wait for first: a gpuio device buffer's, or every GPU for a gpuio host
    /// buffer, once another library has a view of it (its copies are queued on its streams).
    pub(crate) fn shared_gpus(&self, session: &gpuio_api::Session) -> Vec<gpuio_api::Gpu> {
        match self {
            Self::Device(d) => d.get().shared_with().cloned().into_iter().collect(),
            Self::Host(h) if h.get().is_shared() => session.gpus().to_vec(),
            _ => Vec::new(),
        }
    }
}
