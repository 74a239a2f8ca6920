//! The driver: what `cuFileDriverOpen` opens. One gpuio session per process, made on the first
//! open (or the first call that needs it, as cuFile opens itself implicitly) and kept for the
//! process's life: `cuFileDriverClose` forgets the handles, buffers, batches and streams
//! registered under it, but does not tear the session down, since programs close the driver
//! from static destructors, after CUDA may already be gone.

use crate::abi;
use crate::batch::Batch;
use crate::fault::{Fault, Result};
use crate::handle::Handle;
use crate::memory::Registered;
use crate::params::Params;
use crate::stats::Stats;
use gpuio_api::{Config, GdsPolicy, Session};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};

/// What is registered under an open driver.
#[derive(Default)]
pub struct Registry {
    /// File handles by key.
    pub handles: HashMap<usize, Arc<Handle>>,
    /// Registered buffers by base address.
    pub buffers: BTreeMap<u64, Arc<Registered>>,
    /// Batches by key.
    pub batches: HashMap<usize, Arc<Batch>>,
    /// Registered streams and their flags.
    pub streams: HashMap<usize, u32>,
}

/// The process's cuFile state.
pub struct Driver {
    /// Opens not yet closed (`cuFileUseCount`).
    opens: Mutex<u64>,
    session: Mutex<Option<Arc<Session>>>,
    /// What is registered; read by every IO call, written by (de)registration.
    registry: RwLock<Registry>,
    params: Mutex<Params>,
    /// Counters for `cuFileGetStats*`.
    pub stats: Stats,
    next_key: AtomicUsize,
}

/// The driver.
pub static DRIVER: LazyLock<Driver> = LazyLock::new(|| Driver {
    opens: Mutex::new(0),
    session: Mutex::new(None),
    registry: RwLock::new(Registry::default()),
    params: Mutex::new(Params::default()),
    stats: Stats::default(),
    next_key: AtomicUsize::new(1),
});

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// gpuio's configuration for this library: the user's (`GPUIO_CONFIG`, `GPUIO_*`), except that
/// LocalIO never takes cuFile itself, which in this process is this library.
fn config() -> Result<Config> {
    let mut config = Config::load(None).map_err(|e| {
        Fault::new(
            abi::CU_FILE_DRIVER_NOT_INITIALIZED,
            format!("gpuio configuration: {e}"),
        )
    })?;
    config.localio.gds = GdsPolicy::Off;
    Ok(config)
}

impl Driver {
    /// `cuFileDriverOpen`: opens (the first time, makes the session).
    pub fn open(&self) -> Result<()> {
        let mut opens = lock(&self.opens);
        self.session()?;
        *opens += 1;
        Ok(())
    }

    /// The session, made on first use.
    fn session(&self) -> Result<Arc<Session>> {
        let mut slot = lock(&self.session);
        if let Some(s) = slot.as_ref() {
            return Ok(s.clone());
        }
        let session = Session::new(config()?).map_err(|e| {
            Fault::new(
                abi::CU_FILE_DRIVER_NOT_INITIALIZED,
                format!("gpuio session: {e}"),
            )
        })?;
        Ok(slot.insert(Arc::new(session)).clone())
    }

    /// The session of an open driver, opening it implicitly as cuFile does for a program's
    /// first call.
    pub fn active(&self) -> Result<Arc<Session>> {
        let mut opens = lock(&self.opens);
        let session = self.session()?;
        if *opens == 0 {
            *opens = 1;
        }
        Ok(session)
    }

    /// `cuFileDriverClose`: the last close forgets everything registered.
    pub fn close(&self) -> Result<()> {
        let mut opens = lock(&self.opens);
        if *opens == 0 {
            return Err(Fault::new(
                abi::CU_FILE_DRIVER_NOT_INITIALIZED,
                "the driver is not open",
            ));
        }
        *opens -= 1;
        if *opens == 0 {
            let old = std::mem::take(&mut *self.registry_mut());
            for batch in old.batches.values() {
                batch.cancel_and_wait();
            }
        }
        Ok(())
    }

    /// `cuFileUseCount`.
    pub fn use_count(&self) -> u64 {
        *lock(&self.opens)
    }

    /// What is registered, to read.
    pub fn registry(&self) -> RwLockReadGuard<'_, Registry> {
        self.registry.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// What is registered, to change.
    pub fn registry_mut(&self) -> std::sync::RwLockWriteGuard<'_, Registry> {
        self.registry
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A fresh key for a handle or batch: never 0 (a null handle), never reused.
    pub fn key(&self) -> usize {
        self.next_key.fetch_add(1, Ordering::Relaxed)
    }

    /// The parameters, to read.
    pub fn params(&self) -> MutexGuard<'_, Params> {
        lock(&self.params)
    }

    /// Changes the parameters: only while the driver is closed, as cuFile requires.
    pub fn set_params(&self, change: impl FnOnce(&mut Params) -> Result<()>) -> Result<()> {
        let opens = lock(&self.opens);
        if *opens > 0 {
            return Err(Fault::new(
                abi::CU_FILE_DRIVER_ALREADY_OPEN,
                "parameters are set before cuFileDriverOpen",
            ));
        }
        change(&mut lock(&self.params))
    }

    /// Changes the driver's own properties (`cuFileDriverSet*`): any time.
    pub fn set_property(&self, change: impl FnOnce(&mut Params) -> Result<()>) -> Result<()> {
        change(&mut lock(&self.params))
    }
}
