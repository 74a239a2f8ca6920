//! Parameters: `cuFileGetParameter*`, `cuFileSetParameter*`.

use super::driver::text;
use super::{put, status};
use crate::abi::{CUfileError_t, ConfigParameter};
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use crate::params::MAX_SLABS;
use std::ffi::{c_char, c_int};

/// # Safety
/// `value` is NULL or writable for a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetParameterSizeT(
    param: ConfigParameter,
    value: *mut usize,
) -> CUfileError_t {
    status(|| {
        let v = DRIVER.params().get_size(param)?;
        // SAFETY: the caller's contract.
        unsafe { put(value, v, "value") }
    })
}

/// # Safety
/// `value` is NULL or writable for a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetParameterBool(
    param: ConfigParameter,
    value: *mut bool,
) -> CUfileError_t {
    status(|| {
        let v = DRIVER.params().get_bool(param)?;
        // SAFETY: the caller's contract.
        unsafe { put(value, v, "value") }
    })
}

/// Copies the value and its NUL into `desc_str` (`len` bytes of room).
///
/// # Safety
/// `desc_str` is NULL or writable for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetParameterString(
    param: ConfigParameter,
    desc_str: *mut c_char,
    len: c_int,
) -> CUfileError_t {
    status(|| {
        let v = DRIVER.params().get_string(param)?.to_string();
        let room = usize::try_from(len).unwrap_or(0);
        if desc_str.is_null() || room <= v.len() {
            return Err(Fault::invalid(format!(
                "room for {} bytes and a NUL needed, {len} given",
                v.len()
            )));
        }
        // SAFETY: non-null and writable for `room` > v.len() bytes (the caller's contract).
        unsafe {
            std::ptr::copy_nonoverlapping(v.as_ptr(), desc_str.cast::<u8>(), v.len());
            desc_str.add(v.len()).write(0);
        }
        Ok(())
    })
}

/// # Safety
/// `min_value` and `max_value` are NULL or writable for a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetParameterMinMaxValue(
    param: ConfigParameter,
    min_value: *mut usize,
    max_value: *mut usize,
) -> CUfileError_t {
    status(|| {
        let (lo, hi) = crate::params::Params::size_range(param)?;
        if min_value.is_null() || max_value.is_null() {
            return Err(Fault::invalid("min_value or max_value is NULL"));
        }
        // SAFETY: the caller's contract; both checked non-null.
        unsafe {
            put(min_value, lo, "min_value")?;
            put(max_value, hi, "max_value")
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileSetParameterSizeT(param: ConfigParameter, value: usize) -> CUfileError_t {
    status(|| DRIVER.set_params(|p| p.set_size(param, value)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileSetParameterBool(param: ConfigParameter, value: bool) -> CUfileError_t {
    status(|| DRIVER.set_params(|p| p.set_bool(param, value)))
}

/// # Safety
/// `desc_str` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileSetParameterString(
    param: ConfigParameter,
    desc_str: *const c_char,
) -> CUfileError_t {
    status(|| {
        // SAFETY: the caller's contract.
        let v = unsafe { text(desc_str, "desc_str")? };
        DRIVER.set_params(|p| p.set_string(param, v))
    })
}

/// `len` slabs from the two arrays.
///
/// # Safety
/// Non-null arrays hold `len` values each.
unsafe fn read_slabs(
    sizes: *const usize,
    counts: *const usize,
    len: c_int,
) -> Result<Vec<(usize, usize)>> {
    let n = usize::try_from(len)
        .ok()
        .filter(|n| (1..=MAX_SLABS).contains(n))
        .ok_or_else(|| Fault::invalid(format!("len {len}: 1 to {MAX_SLABS} slabs")))?;
    if sizes.is_null() || counts.is_null() {
        return Err(Fault::invalid("size_values or count_values is NULL"));
    }
    // SAFETY: non-null, `n` values each (the caller's contract).
    let (s, c) = unsafe {
        (
            std::slice::from_raw_parts(sizes, n),
            std::slice::from_raw_parts(counts, n),
        )
    };
    Ok(s.iter().copied().zip(c.iter().copied()).collect())
}

/// Fills the two arrays with the slabs; `len` must be room for all of them.
///
/// # Safety
/// Non-null arrays are writable for `len` values each.
unsafe fn write_slabs(
    bounce: bool,
    sizes: *mut usize,
    counts: *mut usize,
    len: c_int,
) -> Result<()> {
    let slabs = DRIVER.params().slabs(bounce).to_vec();
    let room = usize::try_from(len).unwrap_or(0);
    if room < slabs.len() || sizes.is_null() || counts.is_null() {
        return Err(Fault::invalid(format!(
            "room for {} slabs needed in two non-NULL arrays, {len} given",
            slabs.len()
        )));
    }
    for (i, (size, count)) in slabs.into_iter().enumerate() {
        // SAFETY: non-null and writable for `room` > i values (the caller's contract).
        unsafe {
            sizes.add(i).write(size);
            counts.add(i).write(count);
        }
    }
    Ok(())
}

/// # Safety
/// As `read_slabs`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileSetParameterPosixPoolSlabArray(
    size_values: *const usize,
    count_values: *const usize,
    len: c_int,
) -> CUfileError_t {
    status(|| {
        // SAFETY: the caller's contract.
        let slabs = unsafe { read_slabs(size_values, count_values, len)? };
        DRIVER.set_params(|p| p.set_slabs(false, slabs))
    })
}

/// # Safety
/// As `write_slabs`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetParameterPosixPoolSlabArray(
    size_values: *mut usize,
    count_values: *mut usize,
    len: c_int,
) -> CUfileError_t {
    // SAFETY: the caller's contract.
    status(|| unsafe { write_slabs(false, size_values, count_values, len) })
}

/// # Safety
/// As `read_slabs`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileSetParameterGpuBounceBufferSlabArray(
    size_values: *const usize,
    count_values: *const usize,
    len: c_int,
) -> CUfileError_t {
    status(|| {
        // SAFETY: the caller's contract.
        let slabs = unsafe { read_slabs(size_values, count_values, len)? };
        DRIVER.set_params(|p| p.set_slabs(true, slabs))
    })
}

/// # Safety
/// As `write_slabs`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetParameterGpuBounceBufferSlabArray(
    size_values: *mut usize,
    count_values: *mut usize,
    len: c_int,
) -> CUfileError_t {
    // SAFETY: the caller's contract.
    status(|| unsafe { write_slabs(true, size_values, count_values, len) })
}
