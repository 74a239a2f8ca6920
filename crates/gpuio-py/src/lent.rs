//! Host memory Python lends through the buffer protocol (NumPy arrays, CPU tensors,
//! `bytearray`, `memoryview`), as a Rust slice for the length of one blocking call: files are
//! read into it and written from it in place, on many threads, with the GIL released. The one
//! place this crate turns a raw pointer into a slice.
#![allow(unsafe_code)]

use crate::error::invalid;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

/// A C-contiguous byte buffer held from Python (its exporter keeps it alive and unresized
/// until this is dropped).
pub(crate) struct Lent(PyBuffer<u8>);

impl Lent {
    /// The buffer of `obj` (a byte `memoryview` the Python half made); refused where it is
    /// not C-contiguous.
    pub(crate) fn of(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let buf = PyBuffer::<u8>::get(obj)?;
        if !buf.is_c_contiguous() {
            return Err(invalid(
                "gpuio moves contiguous memory: pass a C-contiguous array",
            ));
        }
        Ok(Self(buf))
    }

    /// Its bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        let len = self.0.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: the buffer was acquired with PyObject_GetBuffer and is released only when
        // `self.0` drops, so its `len` contiguous bytes at `buf_ptr` (non-null for a
        // non-empty buffer) stay allocated and unresized for the borrow of `self`. Python
        // code on other threads may write them while the GIL is released: the contract of
        // every buffer-protocol consumer that releases the GIL (`readinto` included).
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr().cast::<u8>(), len) }
    }

    /// Its bytes to write; refused where the buffer is read-only.
    pub(crate) fn bytes_mut(&mut self) -> PyResult<&mut [u8]> {
        if self.0.readonly() {
            return Err(invalid("this buffer is read-only"));
        }
        let len = self.0.len_bytes();
        if len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `bytes`; the buffer is writable (checked above), and `&mut self`
        // makes this the only slice of it this crate holds.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.0.buf_ptr().cast::<u8>(), len) })
    }
}
