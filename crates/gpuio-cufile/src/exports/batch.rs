//! The batch API.

use super::{get, put, status};
use crate::abi::{CUfileBatchHandle_t, CUfileError_t, CUfileIOEvents_t, CUfileIOParams_t};
use crate::batch::Batch;
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use std::ffi::c_uint;
use std::sync::Arc;
use std::time::Duration;

fn batch(id: CUfileBatchHandle_t) -> Result<Arc<Batch>> {
    DRIVER
        .registry()
        .batches
        .get(&(id as usize))
        .cloned()
        .ok_or_else(|| Fault::invalid(format!("batch {id:p} does not exist")))
}

/// # Safety
/// `batch_idp` is NULL or writable for a handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileBatchIOSetUp(
    batch_idp: *mut CUfileBatchHandle_t,
    nr: c_uint,
) -> CUfileError_t {
    let result = status(|| {
        if batch_idp.is_null() {
            return Err(Fault::invalid("batch_idp is NULL"));
        }
        DRIVER.active()?;
        let b = Arc::new(Batch::new(nr as usize)?);
        let key = DRIVER.key();
        DRIVER.registry_mut().batches.insert(key, b);
        // SAFETY: the caller's contract; checked non-null above.
        unsafe { put(batch_idp, key as CUfileBatchHandle_t, "batch_idp") }
    });
    DRIVER.stats.batch_setup.count(result.err == 0);
    result
}

/// # Safety
/// `iocbp` is NULL or points to `nr` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileBatchIOSubmit(
    batch_idp: CUfileBatchHandle_t,
    nr: c_uint,
    iocbp: *mut CUfileIOParams_t,
    flags: c_uint,
) -> CUfileError_t {
    let result = status(|| {
        if iocbp.is_null() || nr == 0 {
            return Err(Fault::invalid("no entries (iocbp NULL or nr 0)"));
        }
        if flags != 0 {
            return Err(Fault::invalid(format!(
                "flags {flags:#x}: none are defined"
            )));
        }
        let b = batch(batch_idp)?;
        if nr as usize > b.capacity() {
            return Err(Fault::new(
                crate::abi::CU_FILE_BATCH_FULL,
                format!("{nr} entries for a batch of {}", b.capacity()),
            ));
        }
        // SAFETY: non-null, nr entries (the caller's contract), nr at most the batch's size.
        let entries = unsafe { std::slice::from_raw_parts(iocbp.cast_const(), nr as usize) };
        let session = DRIVER.active()?;
        b.submit(&session, entries)
    });
    DRIVER.stats.batch_submit.count(result.err == 0);
    result
}

/// # Safety
/// `nr` is NULL or points to an `unsigned` (in: the room in `iocbp`; out: events written);
/// `iocbp` has room for `*nr` events; `timeout` is NULL or points to a `timespec`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileBatchIOGetStatus(
    batch_idp: CUfileBatchHandle_t,
    min_nr: c_uint,
    nr: *mut c_uint,
    iocbp: *mut CUfileIOEvents_t,
    timeout: *const libc::timespec,
) -> CUfileError_t {
    status(|| {
        let b = batch(batch_idp)?;
        // SAFETY: the caller's contract.
        let room = unsafe { get(nr.cast_const(), "nr")? } as usize;
        if iocbp.is_null() && room > 0 {
            return Err(Fault::invalid("iocbp is NULL"));
        }
        let wait = if timeout.is_null() {
            None
        } else {
            // SAFETY: the caller's contract.
            let t = unsafe { get(timeout, "timeout")? };
            if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
                return Err(Fault::invalid("timeout is not a valid timespec"));
            }
            Some(Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
        };
        let events: &mut [CUfileIOEvents_t] = if room == 0 {
            &mut []
        } else {
            // SAFETY: non-null (checked) and room for `room` events (the caller's contract).
            unsafe { std::slice::from_raw_parts_mut(iocbp, room) }
        };
        let n = b.collect(min_nr as usize, events, wait)?;
        // SAFETY: checked readable above; the caller's contract makes it writable.
        unsafe { put(nr, n as c_uint, "nr") }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileBatchIOCancel(batch_idp: CUfileBatchHandle_t) -> CUfileError_t {
    let result = status(|| {
        batch(batch_idp)?.cancel();
        Ok(())
    });
    DRIVER.stats.batch_cancel.count(result.err == 0);
    result
}

/// Cancels what has not started and waits for what has, then forgets the batch.
#[unsafe(no_mangle)]
pub extern "C" fn cuFileBatchIODestroy(batch_idp: CUfileBatchHandle_t) {
    let gone = DRIVER.registry_mut().batches.remove(&(batch_idp as usize));
    if let Some(b) = &gone {
        b.cancel_and_wait();
    }
    DRIVER.stats.batch_destroy.count(gone.is_some());
}
