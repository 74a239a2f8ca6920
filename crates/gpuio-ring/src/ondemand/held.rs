//! Arrays held in their cache ([`HeldPages`]): every page of a read-only array pinned once more
//! for as long as the hold lives. No held page can be evicted or change frame, so kernels read
//! the array through a frame table that stays as it is (`gpuio_resident_array<T>`), with no pin
//! or check per access: the hit path of an array the caller knows fits.

use super::layout::{ArrayDevice, ResidentDevice};
use super::{HostAccessor, PageCacheMemory, PageTable};
use crate::{HostProducer, RingMemory};
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::gpu::{Backend, DeviceBuffer};
use std::sync::Arc;

/// A frame-table entry of a page that is not held.
pub const NOT_HELD: u32 = u32::MAX;

/// Who takes the pins off again: a kernel on a GPU, host threads on the host backend (with
/// the frames they hold, kept here so that letting go needs no device memory read).
enum Holder {
    Gpu(ArrayDevice),
    Host(HostAccessor, Vec<u32>),
}

/// Every page of one read-only array held in its cache, and the table of the frames holding
/// them (device memory, a `u32` per page). Dropping it lets the pages go again (logging a
/// failure; [`let_go`](Self::let_go) reports it). The array must stay in its cache meanwhile:
/// removing it frees its frames pins or not, and readers of the frame table would then read
/// whatever other pages the frames come to hold (`OnDemandArray::resident` borrows the array,
/// so its users cannot).
pub struct HeldPages {
    cache: Arc<PageCacheMemory>,
    /// The array's page table, kept allocated while pins on it are outstanding.
    _table: DeviceBuffer,
    holder: Holder,
    frames: DeviceBuffer,
    device: ResidentDevice,
    pages: u64,
    held: bool,
}

impl std::fmt::Debug for HeldPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldPages")
            .field("pages", &self.pages)
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl PageCacheMemory {
    /// Holds every page of the read-only array `table` in the cache, bringing in those not
    /// cached (misses through `ring`, whose proxy must be serving it). Refused for a writable
    /// array (a held dirty page could never be written back) and for one with more pages
    /// than the cache has frames; a page that cannot be held (no frame came free: other holds
    /// keep them, or its read failed) lets every page held so far go and returns the error.
    pub fn hold(self: &Arc<Self>, table: &PageTable, ring: &Arc<RingMemory>) -> Result<HeldPages> {
        if table.writable() {
            return Err(HalError::InvalidArgument(
                "only a read-only array is held in its cache: a held dirty page could never \
                 be written back"
                    .into(),
            ));
        }
        let pages = table.pages();
        if pages > self.frames() as u64 {
            return Err(HalError::InvalidArgument(format!(
                "an array of {pages} pages does not fit a cache of {} frames",
                self.frames()
            )));
        }
        let frames = self.gpu().alloc(pages as usize * 4)?;
        // Every page not held until the hold says otherwise: what a let-go after a failed
        // launch leaves alone.
        self.gpu()
            .stream()?
            .upload(&vec![0xFF; pages as usize * 4], &frames, 0)?;
        let holder = match self.gpu().backend() {
            Backend::Host => {
                let acc = HostAccessor::new(self.clone(), table, HostProducer::new(ring.clone())?)?;
                let mut got = Vec::with_capacity(pages as usize);
                for page in 0..pages {
                    match acc.hold(page) {
                        Ok(f) => got.push(f),
                        Err(e) => {
                            // The failure stays recorded for `check`, as a kernel's would.
                            (0..page).for_each(|p| acc.let_go(p));
                            return Err(e);
                        }
                    }
                }
                let bytes: Vec<u8> = got.iter().flat_map(|f| f.to_le_bytes()).collect();
                if let Err(e) = self
                    .gpu()
                    .stream()
                    .and_then(|s| s.upload(&bytes, &frames, 0))
                {
                    (0..pages).for_each(|p| acc.let_go(p));
                    return Err(e);
                }
                Holder::Host(acc, got)
            }
            _ => Holder::Gpu(self.array_device(ring.device()?, table)),
        };
        let mut held = HeldPages {
            cache: self.clone(),
            _table: table.table().clone(),
            holder,
            device: ResidentDevice {
                frames: frames.device_addr(),
                base: self.frame_memory().device_addr(),
                bytes: table.bytes(),
                slots: self.slots.device_addr(),
                page_shift: self.page_size().trailing_zeros(),
                slot: table.slot(),
            },
            frames,
            pages,
            held: true,
        };
        if let Holder::Gpu(array) = &held.holder {
            let stream = self.gpu().stream()?;
            super::ops::hold(&stream, *array, &held.frames, true)?;
            // Pages that could not be held recorded why (left recorded for `check`); the hold
            // lets go of the others.
            if held.frames()?.contains(&NOT_HELD) {
                let why = self.recorded_error(table)?;
                held.let_go()?;
                return Err(match why {
                    Some(code) => HalError::OnDemand { code },
                    None => HalError::Busy("a page of the array could not be held".into()),
                });
            }
        }
        Ok(held)
    }
}

impl HeldPages {
    /// The descriptor a kernel takes by value as `gpuio_resident_desc` (wrap it in
    /// `gpuio_resident_array<T>`); valid while this hold lives.
    pub fn device(&self) -> ResidentDevice {
        self.device
    }

    /// Pages held.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// The frame holding each page ([`NOT_HELD`] for one that is not).
    pub fn frames(&self) -> Result<Vec<u32>> {
        let mut raw = vec![0u8; self.pages as usize * 4];
        self.cache
            .gpu()
            .stream()?
            .download(&self.frames, 0, &mut raw)?;
        Ok(raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Lets every held page go (they may be evicted again). Done once; later calls do nothing.
    /// On a GPU a failed let-go is not tried again (a kernel that ran in part would take pins
    /// off twice): its pages stay held until the array leaves the cache.
    pub fn let_go(&mut self) -> Result<()> {
        if !std::mem::replace(&mut self.held, false) {
            return Ok(());
        }
        match &self.holder {
            Holder::Host(acc, frames) => {
                for (page, &f) in frames.iter().enumerate() {
                    if f != NOT_HELD {
                        acc.let_go(page as u64);
                    }
                }
                Ok(())
            }
            Holder::Gpu(array) => {
                let stream = self.cache.gpu().stream()?;
                super::ops::hold(&stream, *array, &self.frames, false)
            }
        }
    }
}

impl Drop for HeldPages {
    fn drop(&mut self) {
        if let Err(e) = self.let_go() {
            tracing::warn!(error = %e, pages = self.pages, "letting held pages go");
        }
    }
}
