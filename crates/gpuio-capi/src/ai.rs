//! The AI tier's core calls from C: a sequence's KV pool (`gpuio_kv_pool_*`: store entries
//! from GPU memory, load a selection into GPU memory) and Engram tables (`gpuio_engram_*`:
//! rows in pinned host memory looked up by id into GPU memory, stored back from it).

use crate::context::gpuio_context_t;
use crate::error::{Failure, call, invalid};
use crate::memory::{Mem, gpuio_mem_t};
use crate::ptr;
use gpuio_ai::AiError;
use gpuio_ai::engram::EngramTable;
use gpuio_ai::kv::{KvPool, KvPoolConfig};
use gpuio_api::{DeviceBuffer, HostPlacement};
use std::ffi::c_int;
use std::sync::{Mutex, PoisonError};

impl From<AiError> for Failure {
    fn from(e: AiError) -> Self {
        Self {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

/// The GPU memory `mem` holds (host memory is refused: the AI tier's ends are on the GPU).
///
/// # Safety
/// `mem` is NULL or a live `gpuio_mem_t`.
unsafe fn device<'a>(mem: *const gpuio_mem_t, what: &str) -> Result<&'a DeviceBuffer, Failure> {
    // SAFETY: the caller's contract.
    match &unsafe { ptr::object(mem, what) }?.kind {
        Mem::Device(buf) => Ok(buf),
        Mem::Host { .. } => Err(invalid(format!(
            "{what}: GPU memory (gpuio_mem_alloc_device or gpuio_mem_register_device)"
        ))),
    }
}

/// DRAM, on NUMA node `numa` where it is not negative.
fn dram(numa: i32) -> HostPlacement {
    HostPlacement::Dram {
        numa: u32::try_from(numa).ok(),
    }
}

/// A KV pool's shape: zero-initialise it and set every field (0 fields are refused, but
/// `warm_entries`: 0 means `layers * max_tokens`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gpuio_kv_pool_config_t {
    /// Attention layers.
    pub layers: u32,
    /// GPU whose memory holds the hot buffers.
    pub gpu: u32,
    /// Bytes per entry (one token of one layer).
    pub entry_bytes: u64,
    /// Tokens the sequence may hold.
    pub max_tokens: u64,
    /// Entries pinned host memory holds, over all layers (0: `layers * max_tokens`).
    pub warm_entries: u64,
    /// Slots of each layer's hot buffer in GPU memory.
    pub hot_slots: u64,
    /// The largest selection one load takes (at most `hot_slots`).
    pub max_selection: u64,
    /// NUMA node of the host memory (-1: the kernel's choice).
    pub numa: i32,
    /// Reserved: 0.
    pub flags: u32,
}

/// What one KV load did.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct gpuio_kv_load_report_t {
    /// Entries written to the destination.
    pub selected: u64,
    /// Of them, found in the hot buffer.
    pub hits: u64,
    /// Distinct entries read from host memory.
    pub misses: u64,
    /// Of those, brought back from the cold tier first.
    pub from_cold: u64,
    /// Bytes that crossed from host memory.
    pub bytes_from_host: u64,
}

/// One sequence's KV entries across GPU and pinned host memory. Calls on one pool take
/// turns; free it before the context.
pub struct gpuio_kv_pool_t {
    pool: Mutex<KvPool>,
}

/// A KV pool of `config`'s shape, its memory allocated now, into `*out`.
///
/// # Safety
/// `ctx` came from `gpuio_init`; `config` is readable; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_kv_pool_create(
    ctx: *const gpuio_context_t,
    config: *const gpuio_kv_pool_config_t,
    out: *mut *mut gpuio_kv_pool_t,
) -> c_int {
    call(|| {
        ptr::out(out, "out")?;
        // SAFETY: the caller's contract.
        let (ctx, c) = unsafe { (ptr::object(ctx, "ctx")?, *ptr::object(config, "config")?) };
        if c.flags != 0 {
            return Err(invalid(format!(
                "KV pool flags {:#x}: reserved, 0",
                c.flags
            )));
        }
        let size = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| invalid(format!("{what} {v} too large")))
        };
        let cfg = KvPoolConfig {
            layers: c.layers as usize,
            entry_bytes: size(c.entry_bytes, "entry_bytes")?,
            max_tokens: c.max_tokens,
            warm_entries: match c.warm_entries {
                0 => u64::from(c.layers).saturating_mul(c.max_tokens),
                n => n,
            },
            hot_slots: size(c.hot_slots, "hot_slots")?,
            max_selection: size(c.max_selection, "max_selection")?,
            gpu: c.gpu,
            placement: dram(c.numa),
        };
        let pool = KvPool::new(&ctx.session, cfg)?;
        let p = gpuio_kv_pool_t {
            pool: Mutex::new(pool),
        };
        // SAFETY: the caller's contract; checked non-null above.
        unsafe { ptr::put(out, ptr::handle(p), "out") }
    })
}

/// Stores `count` entries of `layer` from `src` (GPU memory) at `src_offset`, entry after
/// entry, at positions `first..first + count`, with their importance `scores` (`count` of
/// them; NULL: none).
///
/// # Safety
/// `ctx` came from `gpuio_init`, `pool` from `gpuio_kv_pool_create`, `src` from a
/// `gpuio_mem_*` function; `scores` is NULL or readable for `count` floats.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpuio_kv_pool_store(
    ctx: *const gpuio_context_t,
    pool: *const gpuio_kv_pool_t,
    layer: u32,
    first: u64,
    count: usize,
    src: *const gpuio_mem_t,
    src_offset: usize,
    scores: *const f32,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let (ctx, pool, src) = unsafe {
            (
                ptr::object(ctx, "ctx")?,
                ptr::object(pool, "pool")?,
                device(src, "src")?,
            )
        };
        let scores = if scores.is_null() {
            None
        } else {
            // SAFETY: the caller's contract: `count` readable floats.
            Some(unsafe { ptr::items(scores, count, "scores") }?)
        };
        let mut p = pool.pool.lock().unwrap_or_else(PoisonError::into_inner);
        p.store(
            &ctx.session,
            layer as usize,
            first,
            count,
            src,
            src_offset,
            scores,
        )?;
        Ok(())
    })
}

/// Loads `layer`'s entries at the `n` positions of `selection` into `dst` (GPU memory) from
/// `dst_offset`, entry `i` being position `selection[i]`; what it did into `*report` (may be
/// NULL).
///
/// # Safety
/// `pool` came from `gpuio_kv_pool_create`, `dst` from a `gpuio_mem_*` function;
/// `selection` is readable for `n` positions; `report` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_kv_pool_load(
    pool: *const gpuio_kv_pool_t,
    layer: u32,
    selection: *const u64,
    n: usize,
    dst: *const gpuio_mem_t,
    dst_offset: usize,
    report: *mut gpuio_kv_load_report_t,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let (pool, sel, dst) = unsafe {
            (
                ptr::object(pool, "pool")?,
                ptr::items(selection, n, "selection")?,
                device(dst, "dst")?,
            )
        };
        let r = pool
            .pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .load(layer as usize, sel, dst, dst_offset)?;
        if !report.is_null() {
            let out = gpuio_kv_load_report_t {
                selected: r.selected as u64,
                hits: r.hits as u64,
                misses: r.misses as u64,
                from_cold: r.from_cold as u64,
                bytes_from_host: r.bytes_from_host,
            };
            // SAFETY: the caller's contract; non-null.
            unsafe { ptr::put(report, out, "report") }?;
        }
        Ok(())
    })
}

/// Frees a KV pool and its memory (NULL: nothing).
///
/// # Safety
/// `pool` is NULL or came from `gpuio_kv_pool_create`, and nothing uses it after the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_kv_pool_free(pool: *mut gpuio_kv_pool_t) -> c_int {
    call(|| {
        // SAFETY: the caller's contract: gpuio_kv_pool_create's pointer, given back once.
        drop(unsafe { ptr::release(pool) });
        Ok(())
    })
}

/// An Engram table: rows in pinned host memory, read by id into GPU memory.
pub struct gpuio_engram_table_t {
    table: EngramTable,
}

/// A zeroed table of `rows` rows of `row_bytes` in pinned DRAM (on NUMA node `numa` where
/// it is not negative), into `*out`.
///
/// # Safety
/// `ctx` came from `gpuio_init`; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engram_table_create(
    ctx: *const gpuio_context_t,
    rows: u64,
    row_bytes: usize,
    numa: i32,
    out: *mut *mut gpuio_engram_table_t,
) -> c_int {
    call(|| {
        ptr::out(out, "out")?;
        // SAFETY: the caller's contract.
        let ctx = unsafe { ptr::object(ctx, "ctx") }?;
        let table = EngramTable::new(&ctx.session, rows, row_bytes, dram(numa))?;
        // SAFETY: the caller's contract; checked non-null above.
        unsafe { ptr::put(out, ptr::handle(gpuio_engram_table_t { table }), "out") }
    })
}

/// The table's host memory as a `gpuio_mem_t` (into `*out`; free it with `gpuio_mem_free`,
/// the table keeps its own reference): fill it through `gpuio_mem_host_ptr` or a transfer
/// from a file. Write rows there only while no lookup or store runs.
///
/// # Safety
/// `table` came from `gpuio_engram_table_create`; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engram_table_memory(
    table: *const gpuio_engram_table_t,
    out: *mut *mut gpuio_mem_t,
) -> c_int {
    call(|| {
        ptr::out(out, "out")?;
        // SAFETY: the caller's contract.
        let t = unsafe { ptr::object(table, "table") }?;
        let mem = t.table.memory().clone();
        // SAFETY: the caller's contract; checked non-null above.
        unsafe { crate::memory::give(out, crate::memory::host(mem)) }
    })
}

/// Reads row `ids[i]` into `dst` (GPU memory) at `dst_offset + i * row_bytes`, for each of the
/// `n` ids; rows read from the table (distinct) into `*fetched` (may be NULL).
///
/// # Safety
/// `ctx` came from `gpuio_init`, `table` from `gpuio_engram_table_create`, `dst` from a
/// `gpuio_mem_*` function; `ids` is readable for `n` ids; `fetched` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engram_lookup(
    ctx: *const gpuio_context_t,
    table: *const gpuio_engram_table_t,
    ids: *const u64,
    n: usize,
    dst: *const gpuio_mem_t,
    dst_offset: usize,
    fetched: *mut u64,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let (ctx, t, ids, dst) = unsafe {
            (
                ptr::object(ctx, "ctx")?,
                ptr::object(table, "table")?,
                ptr::items(ids, n, "ids")?,
                device(dst, "dst")?,
            )
        };
        let r = t.table.lookup(&ctx.session, ids, dst, dst_offset)?;
        if !fetched.is_null() {
            // SAFETY: the caller's contract; non-null.
            unsafe { ptr::put(fetched, r.rows_fetched as u64, "fetched") }?;
        }
        Ok(())
    })
}

/// Writes source row `i` (at `src_offset + i * row_bytes` of `src`, GPU memory) to table row
/// `ids[i]`, for each of the `n` ids.
///
/// # Safety
/// `ctx` came from `gpuio_init`, `table` from `gpuio_engram_table_create`, `src` from a
/// `gpuio_mem_*` function; `ids` is readable for `n` ids.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engram_store(
    ctx: *const gpuio_context_t,
    table: *const gpuio_engram_table_t,
    ids: *const u64,
    n: usize,
    src: *const gpuio_mem_t,
    src_offset: usize,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let (ctx, t, ids, src) = unsafe {
            (
                ptr::object(ctx, "ctx")?,
                ptr::object(table, "table")?,
                ptr::items(ids, n, "ids")?,
                device(src, "src")?,
            )
        };
        t.table.store(&ctx.session, ids, src, src_offset)?;
        Ok(())
    })
}

/// Frees an Engram table (NULL: nothing); its memory goes once no `gpuio_mem_t` of it is left.
///
/// # Safety
/// `table` is NULL or came from `gpuio_engram_table_create`, and nothing uses it after the
/// call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engram_table_free(table: *mut gpuio_engram_table_t) -> c_int {
    call(|| {
        // SAFETY: the caller's contract: gpuio_engram_table_create's pointer, given back once.
        drop(unsafe { ptr::release(table) });
        Ok(())
    })
}
