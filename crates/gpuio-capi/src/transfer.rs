//! Transfers: blocking (`gpuio_transfer`, and `gpuio_read`/`gpuio_write` with the caller's
//! host memory), asynchronous through the scheduler (`gpuio_submit`, then poll, wait, cancel,
//! or a callback), and batches (`gpuio_batch_submit`); the `_ex` forms take the scheduler
//! class and a deadline.

use crate::context::gpuio_context_t;
use crate::error::{Failure, call, invalid};
use crate::memory::{gpuio_handle_t, gpuio_mem_t};
use crate::options::{Scheduling, gpuio_submit_options_t};
use crate::ptr;
use gpuio_api::{Dest, Endpoint, Request, Source, Ticket};
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

/// One end of a transfer: exactly one of `handle` (a resource) and `mem` (gpuio memory) is
/// set, `offset` bytes in.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gpuio_end_t {
    /// A file or device handle, or NULL.
    pub handle: *const gpuio_handle_t,
    /// Memory, or NULL.
    pub mem: *const gpuio_mem_t,
    /// Bytes from the start of the handle or memory.
    pub offset: u64,
}

/// One transfer of a batch.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gpuio_transfer_t {
    /// Where the bytes come from.
    pub src: gpuio_end_t,
    /// Where they go.
    pub dst: gpuio_end_t,
    /// How many.
    pub len: usize,
}

/// Called once when an asynchronous request finishes, on one of gpuio's worker threads (or on
/// the thread that cancels it), before `gpuio_request_test` or `gpuio_request_wait` see it
/// finished: `status` is `GPUIO_SUCCESS` or an error code, `bytes` what moved. It must not
/// free or wait for its own request, nor finalize the context.
pub type gpuio_callback_t =
    Option<unsafe extern "C" fn(user_data: *mut c_void, status: c_int, bytes: usize)>;

/// The endpoint `end` names.
///
/// # Safety
/// `end`'s pointers are NULL or live handles of this library.
unsafe fn endpoint(end: &gpuio_end_t, what: &str) -> Result<Endpoint, Failure> {
    // SAFETY: the caller's contract: live handles or NULL.
    let (handle, mem) = unsafe { (end.handle.as_ref(), end.mem.as_ref()) };
    match (handle, mem) {
        (Some(h), None) => Ok(h.resource.at(end.offset)?),
        (None, Some(m)) => m.endpoint(end.offset),
        _ => Err(invalid(format!(
            "{what}: set exactly one of handle and mem"
        ))),
    }
}

/// Moves `len` bytes from `src` to `dst`, blocking.
///
/// # Safety
/// `ctx` came from `gpuio_init`; the ends' pointers are NULL or live handles.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_transfer(
    ctx: *const gpuio_context_t,
    src: gpuio_end_t,
    dst: gpuio_end_t,
    len: usize,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let (ctx, s, d) = unsafe {
            (
                ptr::object(ctx, "ctx")?,
                endpoint(&src, "src")?,
                endpoint(&dst, "dst")?,
            )
        };
        ctx.session.transfer_owned(&s, &d, len)?;
        Ok(())
    })
}

/// Reads `len` bytes of `handle` at `offset` into the caller's host memory `dst`, blocking.
///
/// # Safety
/// `ctx` came from `gpuio_init`, `handle` from `gpuio_open`; `dst` is writable for `len` bytes
/// and nothing else touches them during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_read(
    ctx: *const gpuio_context_t,
    handle: *const gpuio_handle_t,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let (ctx, h, buf) = unsafe {
            (
                ptr::object(ctx, "ctx")?,
                ptr::object(handle, "handle")?,
                ptr::bytes_mut(dst, len, "dst")?,
            )
        };
        let src = h.resource.at(offset)?;
        ctx.session.transfer(src.source(), Dest::Host(buf), len)?;
        Ok(())
    })
}

/// Writes `len` bytes of the caller's host memory `src` to `handle` at `offset`, blocking.
///
/// # Safety
/// `ctx` came from `gpuio_init`, `handle` from `gpuio_open`; `src` is readable for `len` bytes
/// and nothing writes them during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_write(
    ctx: *const gpuio_context_t,
    handle: *const gpuio_handle_t,
    offset: u64,
    src: *const c_void,
    len: usize,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let (ctx, h, buf) = unsafe {
            (
                ptr::object(ctx, "ctx")?,
                ptr::object(handle, "handle")?,
                ptr::bytes(src, len, "src")?,
            )
        };
        let dst = h.resource.at(offset)?;
        ctx.session.transfer(Source::Host(buf), dst.dest(), len)?;
        Ok(())
    })
}

/// A request's end, as its handle keeps it.
#[derive(Default)]
struct Settled {
    /// `(status, bytes, error message)` once finished.
    result: Mutex<Option<(c_int, usize, String)>>,
    done: Condvar,
}

/// The caller's callback and its argument, moved to the worker that finishes the request.
struct Callback {
    f: unsafe extern "C" fn(*mut c_void, c_int, usize),
    user_data: *mut c_void,
}

// SAFETY: the pointer is only handed back to the caller's callback, which gpuio_submit's
// contract says may run on another thread with it.
unsafe impl Send for Callback {}

/// An asynchronous request: poll it, wait for it, cancel it while queued; free it with
/// `gpuio_request_free` (also while it runs: it still finishes, and its callback still runs).
pub struct gpuio_request_t {
    ticket: Ticket,
    settled: Arc<Settled>,
}

/// Queues a transfer of `len` bytes from `src` to `dst` on the scheduler, into `*out`;
/// `callback` (may be NULL) runs with `user_data` when it finishes. Waits for room when the
/// scheduler's in-flight budget is full.
///
/// # Safety
/// `ctx` came from `gpuio_init`; the ends' pointers are NULL or live handles; `out` is
/// writable; `callback` may be called from another thread with `user_data`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_submit(
    ctx: *const gpuio_context_t,
    src: gpuio_end_t,
    dst: gpuio_end_t,
    len: usize,
    callback: gpuio_callback_t,
    user_data: *mut c_void,
    out: *mut *mut gpuio_request_t,
) -> c_int {
    // SAFETY: the caller's contract, with no options.
    unsafe {
        gpuio_submit_ex(
            ctx,
            src,
            dst,
            len,
            std::ptr::null(),
            callback,
            user_data,
            out,
        )
    }
}

/// `gpuio_submit` in the class and with the deadline `opts` gives (NULL: the defaults).
///
/// # Safety
/// As for `gpuio_submit`; `opts` is NULL or readable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpuio_submit_ex(
    ctx: *const gpuio_context_t,
    src: gpuio_end_t,
    dst: gpuio_end_t,
    len: usize,
    opts: *const gpuio_submit_options_t,
    callback: gpuio_callback_t,
    user_data: *mut c_void,
    out: *mut *mut gpuio_request_t,
) -> c_int {
    call(|| {
        ptr::out(out, "out")?;
        // SAFETY: the caller's contract.
        let (ctx, s, d) = unsafe {
            (
                ptr::object(ctx, "ctx")?,
                endpoint(&src, "src")?,
                endpoint(&dst, "dst")?,
            )
        };
        // SAFETY: the caller's contract for `opts`.
        let scheduling = unsafe { Scheduling::of(opts) }?;
        let req = scheduling.apply(Request::new(s, d, len).map_err(gpuio_api::Error::from)?);
        let settled = Arc::new(Settled::default());
        let mine = settled.clone();
        let cb = callback.map(|f| Callback { f, user_data });
        let ticket = ctx.session.submit_with_callback(req, move |r| {
            let (status, bytes, message) = match r {
                Ok(c) => (crate::GPUIO_SUCCESS, c.outcome.bytes, String::new()),
                Err(e) => (e.code().as_i32(), 0, e.to_string()),
            };
            // The callback first: once a waiter sees the result, the caller may free what
            // `user_data` points to.
            if let Some(cb) = cb {
                // SAFETY: the caller's callback with its own argument (gpuio_submit's
                // contract); it runs once.
                unsafe { (cb.f)(cb.user_data, status, bytes) };
            }
            *mine.result.lock().unwrap_or_else(PoisonError::into_inner) =
                Some((status, bytes, message));
            mine.done.notify_all();
        })?;
        let r = gpuio_request_t { ticket, settled };
        // SAFETY: the caller's contract; checked non-null above.
        unsafe { ptr::put(out, ptr::handle(r), "out") }
    })
}

/// Whether the request has finished, into `*done` (1 or 0).
///
/// # Safety
/// `req` came from `gpuio_submit` and is not freed; `done` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_request_test(
    req: *const gpuio_request_t,
    done: *mut c_int,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { ptr::object(req, "req") }?;
        let finished = r
            .settled
            .result
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        // SAFETY: the caller's contract.
        unsafe { ptr::put(done, finished as c_int, "done") }
    })
}

/// Waits for the request; returns its status (`GPUIO_SUCCESS` or its error code, whose message
/// `gpuio_last_error` has) and puts the bytes moved in `*bytes` (may be NULL).
///
/// # Safety
/// `req` came from `gpuio_submit` and is not freed; `bytes` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_request_wait(
    req: *const gpuio_request_t,
    bytes: *mut usize,
) -> c_int {
    let mut status = crate::GPUIO_SUCCESS;
    let rc = call(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { ptr::object(req, "req") }?;
        let mut g = r
            .settled
            .result
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while g.is_none() {
            g = r
                .settled
                .done
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let (s, n, message) = g.clone().unwrap_or_default();
        status = s;
        if !bytes.is_null() {
            // SAFETY: the caller's contract; non-null.
            unsafe { ptr::put(bytes, n, "bytes") }?;
        }
        match gpuio_api::ErrorCode::from_i32(s) {
            Some(code) => Err(Failure { code, message }),
            None => Ok(()),
        }
    });
    if rc == crate::GPUIO_SUCCESS {
        status
    } else {
        rc
    }
}

/// Cancels the request if no worker has picked it up yet: `GPUIO_SUCCESS` if the cancel won
/// (it finishes with `GPUIO_ERROR_CANCELED`), `GPUIO_ERROR_BUSY` if it had already started or
/// finished.
///
/// # Safety
/// `req` came from `gpuio_submit` and is not freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_request_cancel(req: *const gpuio_request_t) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let r = unsafe { ptr::object(req, "req") }?;
        if r.ticket.cancel() {
            Ok(())
        } else {
            Err(Failure {
                code: gpuio_api::ErrorCode::Busy,
                message: format!("request {} already started or finished", r.ticket.id()),
            })
        }
    })
}

/// Frees a request handle (NULL: nothing); an unfinished request still runs to its end.
///
/// # Safety
/// `req` is NULL or came from `gpuio_submit`, and nothing uses it after the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_request_free(req: *mut gpuio_request_t) -> c_int {
    call(|| {
        // SAFETY: the caller's contract: gpuio_submit's pointer, given back once.
        drop(unsafe { ptr::release(req) });
        Ok(())
    })
}

/// Runs `n` transfers as one batch (sorted, adjacent ones merged, grouped by engine) and waits
/// for all; the total bytes moved go in `*bytes` (may be NULL). Fails if any failed.
///
/// # Safety
/// `ctx` came from `gpuio_init`; `transfers` points to `n` valid `gpuio_transfer_t`s whose
/// pointers are NULL or live handles; `bytes` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_batch_submit(
    ctx: *const gpuio_context_t,
    transfers: *const gpuio_transfer_t,
    n: usize,
    bytes: *mut u64,
) -> c_int {
    // SAFETY: the caller's contract, with no options.
    unsafe { gpuio_batch_submit_ex(ctx, transfers, n, std::ptr::null(), bytes) }
}

/// `gpuio_batch_submit` with every transfer in the class and with the deadline `opts` gives
/// (NULL: the defaults).
///
/// # Safety
/// As for `gpuio_batch_submit`; `opts` is NULL or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_batch_submit_ex(
    ctx: *const gpuio_context_t,
    transfers: *const gpuio_transfer_t,
    n: usize,
    opts: *const gpuio_submit_options_t,
    bytes: *mut u64,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let ctx = unsafe { ptr::object(ctx, "ctx") }?;
        // SAFETY: the caller's contract: n readable transfers.
        let transfers = unsafe { ptr::items(transfers, n, "transfers") }?;
        // SAFETY: the caller's contract for `opts`.
        let scheduling = unsafe { Scheduling::of(opts) }?;
        let mut reqs = Vec::with_capacity(n);
        for t in transfers {
            // SAFETY: the caller's contract for the ends' pointers.
            let (s, d) = unsafe { (endpoint(&t.src, "src")?, endpoint(&t.dst, "dst")?) };
            reqs.push(scheduling.apply(Request::new(s, d, t.len).map_err(gpuio_api::Error::from)?));
        }
        let report = ctx
            .session
            .submit_batch(reqs)?
            .wait()
            .map_err(gpuio_api::Error::from)?;
        if !bytes.is_null() {
            // SAFETY: the caller's contract; non-null.
            unsafe { ptr::put(bytes, report.bytes, "bytes") }?;
        }
        Ok(())
    })
}
