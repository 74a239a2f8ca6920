//! Every raw pointer C hands over becomes a Rust value here, and only here: null is refused as
//! `GPUIO_ERROR_INVALID_ARG` naming the argument, lengths are checked, text must be UTF-8.
//! What cannot be checked (that a non-null pointer is live and of the right type) is the C
//! caller's contract, stated in `gpuio.h` for each function.

use crate::error::{Failure, invalid};
use std::ffi::{CStr, c_char, c_void};

/// The object `p` points to.
///
/// # Safety
/// A non-null `p` points to a live, properly aligned `T` that nothing mutates during `'a`.
pub(crate) unsafe fn object<'a, T>(p: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: the caller's contract, for a pointer `as_ref` found non-null.
    unsafe { p.as_ref() }.ok_or_else(|| invalid(format!("{what} is null")))
}

/// Stores `v` where `p` points.
///
/// # Safety
/// A non-null `p` is valid for writing a `T` (what it held is not dropped).
pub(crate) unsafe fn put<T>(p: *mut T, v: T, what: &str) -> Result<(), Failure> {
    if p.is_null() {
        return Err(invalid(format!("{what} is null")));
    }
    // SAFETY: the caller's contract; `p` is non-null.
    unsafe { p.write(v) };
    Ok(())
}

/// Refuses a null output pointer before any work is done (so nothing made for it leaks).
pub(crate) fn out<T>(p: *mut T, what: &str) -> Result<(), Failure> {
    if p.is_null() {
        return Err(invalid(format!("{what} is null")));
    }
    Ok(())
}

fn span(p: *const c_void, len: usize, what: &str) -> Result<(), Failure> {
    if p.is_null() && len > 0 {
        return Err(invalid(format!("{what} is null")));
    }
    if len > isize::MAX as usize {
        return Err(invalid(format!("{what}: {len} bytes is too long")));
    }
    Ok(())
}

/// `len` bytes at `p` (null allowed when `len` is 0).
///
/// # Safety
/// A non-null `p` is readable for `len` bytes, which nothing writes during `'a`.
pub(crate) unsafe fn bytes<'a>(
    p: *const c_void,
    len: usize,
    what: &str,
) -> Result<&'a [u8], Failure> {
    span(p, len, what)?;
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: non-null, at most isize::MAX bytes (checked above), readable and unaliased by
    // writers for 'a (the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// `len` writable bytes at `p` (null allowed when `len` is 0).
///
/// # Safety
/// A non-null `p` is writable for `len` bytes, which nothing else reads or writes during `'a`.
pub(crate) unsafe fn bytes_mut<'a>(
    p: *mut c_void,
    len: usize,
    what: &str,
) -> Result<&'a mut [u8], Failure> {
    span(p, len, what)?;
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: non-null, at most isize::MAX bytes (checked above), exclusively the caller's for
    // 'a (its contract).
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
}

/// The `n` values at `p` (null allowed when `n` is 0).
///
/// # Safety
/// A non-null `p` points to `n` initialised, properly aligned `T`s that nothing mutates
/// during `'a`.
pub(crate) unsafe fn items<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Failure> {
    let size = n
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| invalid(format!("{what}: {n} items is too many")))?;
    span(p.cast(), size, what)?;
    if n == 0 {
        return Ok(&[]);
    }
    if !p.is_aligned() {
        return Err(invalid(format!("{what} is misaligned")));
    }
    // SAFETY: non-null, aligned, at most isize::MAX bytes (checked above), n initialised values
    // unchanged for 'a (the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// The NUL-terminated UTF-8 text at `p`.
///
/// # Safety
/// A non-null `p` points to a NUL-terminated string that stays unchanged during `'a`.
pub(crate) unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(invalid(format!("{what} is null")));
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// A new handle for C: `v` on the heap, owned by the caller until it gives it back.
pub(crate) fn handle<T>(v: T) -> *mut T {
    Box::into_raw(Box::new(v))
}

/// Takes back a handle made by [`handle`] (null: nothing to free).
///
/// # Safety
/// A non-null `p` came from [`handle`] for a `T` and is given back once; nothing uses it after.
pub(crate) unsafe fn release<T>(p: *mut T) -> Option<Box<T>> {
    // SAFETY: the caller's contract: p is Box::into_raw's, not yet released.
    (!p.is_null()).then(|| unsafe { Box::from_raw(p) })
}
