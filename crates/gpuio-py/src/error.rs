//! gpuio errors as one Python exception class, `gpuio.Error`, whose arguments are the message,
//! the numeric error code (`GPUIO_ERROR_*`, the same table as the C API's) and its name.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    gpuio,
    Error,
    PyException,
    "A gpuio failure: `args` are (message, code, name), the code one of `GPUIO_ERROR_*`."
);

/// The Python exception for a gpuio error.
pub(crate) fn to_py(e: gpuio_api::Error) -> PyErr {
    let code = e.code();
    Error::new_err((e.to_string(), code.as_i32(), code.name()))
}

/// A malformed argument the binding itself refuses (gpuio's `InvalidArg`).
pub(crate) fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(gpuio_api::Error::Invalid(msg.into()))
}

/// How the binding releases the GIL around gpuio's work: [`Python::detach`], keeping the
/// calling thread's CUDA context. gpuio binds the context of the GPU it works on to the
/// calling thread; a framework keys its current device on that context (torch's `"cuda"`
/// would mean GPU 1 after a read into GPU 1), so the caller's is made current again after.
pub(crate) trait DetachIn {
    /// Runs `f` with the GIL released, the caller's CUDA context current again after.
    fn detach_kept<T, F>(self, f: F) -> T
    where
        F: Send + FnOnce() -> T,
        T: Send;

    /// [`detach_kept`](Self::detach_kept) for a call on a gpuio session: refused, before the
    /// GIL is released, in a process forked from the one that opened the session (the call
    /// would wait forever on threads that stayed in the parent).
    fn detach_in<T, F>(self, session: &gpuio_api::Session, f: F) -> PyResult<T>
    where
        F: Send + FnOnce() -> T,
        T: Send;
}

impl DetachIn for Python<'_> {
    fn detach_kept<T, F>(self, f: F) -> T
    where
        F: Send + FnOnce() -> T,
        T: Send,
    {
        self.detach(|| gpuio_hal::keeping_cuda_context(f))
    }

    fn detach_in<T, F>(self, session: &gpuio_api::Session, f: F) -> PyResult<T>
    where
        F: Send + FnOnce() -> T,
        T: Send,
    {
        session.check_process().map_err(to_py)?;
        Ok(self.detach_kept(f))
    }
}
