//! Host memory Python lends through the buffer protocol (NumPy arrays, CPU tensors,
//! `bytearray`, `memoryview`, `array`), as a Rust slice for the length of one blocking call:
//! files are read into it and written from it in place, on many threads, and ids are read
//! where they lie, with the GIL released. The one place this crate turns a raw pointer into a
//! slice.
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

    /// Where its bytes are: address and length.
    pub(crate) fn span(&self) -> (usize, usize) {
        (self.0.buf_ptr() as usize, self.0.len_bytes())
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

/// 64-bit integers Python lends (an `array('q')`, a NumPy int64 or uint64 array), read in
/// place as u64s: an id list is not copied before a call reads it.
pub(crate) enum LentU64s {
    Signed(PyBuffer<i64>),
    Unsigned(PyBuffer<u64>),
}

impl LentU64s {
    /// The buffer of `obj` where it holds C-contiguous 64-bit integers; None where it holds
    /// something else, strided ones included (or lends no buffer).
    pub(crate) fn of(obj: &Bound<'_, PyAny>) -> Option<Self> {
        // Signed first: NumPy's and `array('q')`'s usual type.
        let lent = match PyBuffer::<i64>::get(obj) {
            Ok(b) => Self::Signed(b),
            Err(_) => Self::Unsigned(PyBuffer::<u64>::get(obj).ok()?),
        };
        let contiguous = match &lent {
            Self::Signed(b) => b.is_c_contiguous(),
            Self::Unsigned(b) => b.is_c_contiguous(),
        };
        contiguous.then_some(lent)
    }

    /// The values as u64s (a signed one's two's-complement bits).
    pub(crate) fn values(&self) -> &[u64] {
        let (ptr, count) = match self {
            Self::Signed(b) => (b.buf_ptr(), b.item_count()),
            Self::Unsigned(b) => (b.buf_ptr(), b.item_count()),
        };
        if count == 0 {
            return &[];
        }
        // SAFETY: `PyBuffer::get` checked that the buffer holds `count` items of 8 bytes in
        // an i64 or u64 format, aligned for them, and `of` that they are C-contiguous; i64
        // and u64 share size and alignment and every bit pattern is a valid u64. The buffer
        // is released only when `self` drops, so the memory stays allocated and unresized
        // for the borrow; Python threads may write it meanwhile, as in `Lent::bytes`.
        unsafe { std::slice::from_raw_parts(ptr.cast::<u64>(), count) }
    }
}
