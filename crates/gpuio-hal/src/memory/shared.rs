//! Host memory shared between threads and locked by range ([`SharedHostBuffer`]): requests
//! touching different parts of one buffer run at once, where a single lock would run them one
//! after another (the chunks of one large read spread over workers).
//!
//! The buffer is cut into granules (a sixteenth of its length rounded down to a power of two,
//! 4 KiB to 1 MiB, fixed when it is made) that map onto 16 reader-writer locks in turn, each on
//! its own cache line. A range takes the locks of the granules it covers — all 16 once it spans
//! 16 granules — and the whole buffer takes all 16. Any two ranges that share a byte share a
//! granule, hence a lock, so a writer excludes everyone else on its bytes; ranges in one
//! granule (or in granules 16 apart) take turns even where their bytes differ. Locks are
//! always taken in ascending index order, so no two holders can wait for each other.

use super::{BufferInfo, HostBuffer, MappingHold};
use crate::error::{Result, check_range};
use crossbeam_utils::CachePadded;
use parking_lot::RawRwLock;
use parking_lot::lock_api::RawRwLock as _;
use std::cell::UnsafeCell;
use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// Locks per buffer.
const STRIPES: u32 = 16;
/// The smallest granule (a page) and the largest (so that large buffers' consecutive 1 MiB
/// chunks land on different locks).
const GRANULE_SHIFTS: std::ops::RangeInclusive<u32> = 12..=20;

/// A [`HostBuffer`] shared between threads, read and written through range or whole-buffer
/// guards. Holders of a buffer's [`write`](Self::write) guard may replace the buffer itself.
pub struct SharedHostBuffer {
    buf: UnsafeCell<HostBuffer>,
    locks: [CachePadded<RawRwLock>; STRIPES as usize],
    granule_shift: u32,
}

// SAFETY: the buffer is reached only through guards: `&HostBuffer` while every lock is held
// shared, `&mut HostBuffer` while every lock is held exclusive, and byte ranges while the
// locks of their granules are held (shared for reads, exclusive for writes). HostBuffer itself
// is Send and Sync.
unsafe impl Sync for SharedHostBuffer {}
// SAFETY: owning it owns the HostBuffer, which is Send.
unsafe impl Send for SharedHostBuffer {}

/// Which of the 16 locks a guard holds, one bit each.
type Mask = u16;
const ALL: Mask = Mask::MAX;

impl SharedHostBuffer {
    /// Shares `buf`; its granule size follows its length.
    pub fn new(buf: HostBuffer) -> Self {
        Self {
            granule_shift: granule_shift(buf.len()),
            buf: UnsafeCell::new(buf),
            locks: std::array::from_fn(|_| CachePadded::new(RawRwLock::INIT)),
        }
    }

    /// The whole buffer, shared (waits for writers of any part of it).
    pub fn read(&self) -> HostRead<'_> {
        self.lock(ALL, false);
        WholeGuard {
            owner: self,
            _here: PhantomData,
        }
    }

    /// The whole buffer, exclusive (waits for every other guard).
    pub fn write(&self) -> HostWrite<'_> {
        self.lock(ALL, true);
        WholeGuard {
            owner: self,
            _here: PhantomData,
        }
    }

    /// `len` bytes from `offset`, shared: waits only for writers of granules they share.
    /// A range past the buffer's end is refused once its locks are held.
    pub fn read_range(&self, offset: usize, len: usize) -> Result<RangeRead<'_>> {
        self.range(offset, len)
    }

    /// `len` bytes from `offset`, exclusive: waits only for guards on granules they share.
    pub fn write_range(&self, offset: usize, len: usize) -> Result<RangeWrite<'_>> {
        self.range(offset, len)
    }

    fn range<const WRITE: bool>(&self, offset: usize, len: usize) -> Result<RangeGuard<'_, WRITE>> {
        let mask = self.mask(offset, len);
        self.lock(mask, WRITE);
        let ptr = self.checked_ptr(offset, len, WRITE)?;
        Ok(RangeGuard {
            owner: self,
            mask,
            ptr,
            len,
        })
    }

    /// [`write_range`](Self::write_range) without waiting: `None` while another guard holds
    /// any of its locks (the tests' way to see which locks are held).
    #[cfg(test)]
    fn try_write_range(&self, offset: usize, len: usize) -> Option<Result<RangeWrite<'_>>> {
        let mask = self.mask(offset, len);
        if !self.try_lock_exclusive(mask) {
            return None;
        }
        Some(self.checked_ptr(offset, len, true).map(|ptr| RangeGuard {
            owner: self,
            mask,
            ptr,
            len,
        }))
    }

    /// The address of `offset..offset+len` and a hold on the mapping it lies in, taken under
    /// the range's read locks: for registrations that keep the pages mapped while the buffer
    /// stays usable (and even if a whole-buffer writer replaces it meanwhile).
    pub(crate) fn hold_range(&self, offset: usize, len: usize) -> Result<(*mut u8, MappingHold)> {
        let guard = self.read_range(offset, len)?;
        // SAFETY: the guard holds at least one lock, so no `&mut HostBuffer` exists; the hold
        // reads the buffer's fields, not its bytes.
        let hold = unsafe { &*self.buf.get() }.hold_mapping();
        Ok((guard.ptr, hold))
    }

    /// Takes the buffer back.
    pub fn into_inner(self) -> HostBuffer {
        self.buf.into_inner()
    }

    /// The buffer, through exclusive ownership (no locking).
    pub fn get_mut(&mut self) -> &mut HostBuffer {
        self.buf.get_mut()
    }

    fn mask(&self, offset: usize, len: usize) -> Mask {
        mask(self.granule_shift, offset, len)
    }

    /// The address of `offset`, once the range is checked against the buffer (under the
    /// range's locks, which the caller took `exclusive` or shared; released on an error).
    fn checked_ptr(&self, offset: usize, len: usize, exclusive: bool) -> Result<*mut u8> {
        // SAFETY: the caller holds at least one lock, so no `&mut HostBuffer` exists (that
        // takes all of them); reading the buffer's fields does not touch its bytes.
        let buf = unsafe { &*self.buf.get() };
        if let Err(e) = check_range("shared host memory", offset, len, buf.len()) {
            // The caller's guard was never made: release what it took.
            self.unlock(self.mask(offset, len), exclusive);
            return Err(e);
        }
        Ok(buf.base_ptr().wrapping_add(offset))
    }

    fn lock(&self, mask: Mask, exclusive: bool) {
        for (i, l) in self.locks.iter().enumerate() {
            if mask & (1 << i) != 0 {
                if exclusive {
                    l.lock_exclusive();
                } else {
                    l.lock_shared();
                }
            }
        }
    }

    #[cfg(test)]
    fn try_lock_exclusive(&self, mask: Mask) -> bool {
        for (i, l) in self.locks.iter().enumerate() {
            if mask & (1 << i) != 0 && !l.try_lock_exclusive() {
                self.unlock(mask & ((1 << i) - 1), true);
                return false;
            }
        }
        true
    }

    /// Releases locks of `mask` taken (`exclusive` or shared) by a guard being dropped or
    /// never made.
    fn unlock(&self, mask: Mask, exclusive: bool) {
        for (i, l) in self.locks.iter().enumerate() {
            if mask & (1 << i) != 0 {
                // SAFETY: callers pass only locks they took in that mode and have not
                // released.
                unsafe {
                    if exclusive {
                        l.unlock_exclusive();
                    } else {
                        l.unlock_shared();
                    }
                }
            }
        }
    }
}

/// The granule for a buffer of `len` bytes: a sixteenth of it rounded down to a power of two
/// (so all 16 locks are used), within bounds.
fn granule_shift(len: usize) -> u32 {
    let sixteenth = (len / STRIPES as usize).max(1);
    let shift = usize::BITS - 1 - sixteenth.leading_zeros();
    shift.clamp(*GRANULE_SHIFTS.start(), *GRANULE_SHIFTS.end())
}

/// The locks of the granules (of `1 << shift` bytes) that `offset..offset+len` covers: the
/// granule at `offset` for an empty range, so that even it reads the buffer's length under a
/// lock.
fn mask(shift: u32, offset: usize, len: usize) -> Mask {
    let first = offset >> shift;
    let last = offset.saturating_add(len.max(1) - 1) >> shift;
    let count = last - first + 1;
    if count >= STRIPES as usize {
        return ALL;
    }
    let run = (1u32 << count) - 1;
    let turn = (first % STRIPES as usize) as u32;
    ((run << turn) | (run >> (STRIPES - turn))) as Mask
}

impl fmt::Debug for SharedHostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedHostBuffer")
            .field("granule", &(1usize << self.granule_shift))
            .finish_non_exhaustive()
    }
}

/// The whole buffer: shared (`WRITE = false`, [`HostRead`]) or exclusive ([`HostWrite`]).
pub struct WholeGuard<'a, const WRITE: bool> {
    owner: &'a SharedHostBuffer,
    /// Not Send: the raw locks are released on the thread that took them.
    _here: PhantomData<*const ()>,
}

/// The whole buffer, shared ([`SharedHostBuffer::read`]).
pub type HostRead<'a> = WholeGuard<'a, false>;
/// The whole buffer, exclusive ([`SharedHostBuffer::write`]): the buffer itself may be replaced.
pub type HostWrite<'a> = WholeGuard<'a, true>;

impl<const WRITE: bool> Deref for WholeGuard<'_, WRITE> {
    type Target = HostBuffer;
    fn deref(&self) -> &HostBuffer {
        // SAFETY: every lock is held, shared or exclusive: no guard can write any byte or the
        // buffer, or (exclusive) none but this one exists.
        unsafe { &*self.owner.buf.get() }
    }
}

impl DerefMut for WholeGuard<'_, true> {
    fn deref_mut(&mut self) -> &mut HostBuffer {
        // SAFETY: every lock is held exclusive, and &mut self makes this the only reference
        // through the one guard there is.
        unsafe { &mut *self.owner.buf.get() }
    }
}

impl<const WRITE: bool> Drop for WholeGuard<'_, WRITE> {
    fn drop(&mut self) {
        self.owner.unlock(ALL, WRITE);
    }
}

/// Bytes of a shared buffer: shared (`WRITE = false`, [`RangeRead`]) or exclusive
/// ([`RangeWrite`]).
pub struct RangeGuard<'a, const WRITE: bool> {
    owner: &'a SharedHostBuffer,
    mask: Mask,
    ptr: *mut u8,
    len: usize,
}

/// Bytes of a shared buffer, shared ([`SharedHostBuffer::read_range`]).
pub type RangeRead<'a> = RangeGuard<'a, false>;
/// Bytes of a shared buffer, exclusive ([`SharedHostBuffer::write_range`]).
pub type RangeWrite<'a> = RangeGuard<'a, true>;

impl<const WRITE: bool> RangeGuard<'_, WRITE> {
    /// The buffer these bytes lie in, as it stands while the guard lives (replacing it takes
    /// every lock): for registrations of the whole buffer kept past the call.
    pub fn buffer(&self) -> BufferInfo {
        // SAFETY: the guard holds at least one lock, so no `&mut HostBuffer` exists; this reads
        // the buffer's fields, not its bytes.
        unsafe { &*self.owner.buf.get() }.info()
    }
}

impl<const WRITE: bool> Deref for RangeGuard<'_, WRITE> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len was checked inside the live buffer, whose mapping cannot go
        // (replacing the buffer takes every lock); the locks of its granules are held, so no
        // other guard writes these bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for RangeGuard<'_, true> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for deref, with the locks held exclusive (no other guard reaches these
        // bytes), and &mut self makes this the only reference through this guard.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<const WRITE: bool> Drop for RangeGuard<'_, WRITE> {
    fn drop(&mut self) {
        self.owner.unlock(self.mask, WRITE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostAllocOptions;

    fn shared(len: usize) -> SharedHostBuffer {
        SharedHostBuffer::new(HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap())
    }

    #[test]
    fn a_range_guard_names_the_buffer_it_lies_in() {
        let buf = HostBuffer::alloc(1 << 20, &HostAllocOptions::default()).unwrap();
        let (id, base) = (buf.id(), buf.base_ptr() as usize);
        let shared = SharedHostBuffer::new(buf);
        let info = shared.write_range(4096, 100).unwrap().buffer();
        assert_eq!((info.id(), info.addr(), info.len()), (id, base, 1 << 20));
        // Replaced (only with every lock held): the old buffer is gone, the new one named.
        *shared.write() = HostBuffer::alloc(4096, &HostAllocOptions::default()).unwrap();
        assert!(!info.is_mapped());
        let now = shared.read_range(0, 1).unwrap().buffer();
        assert!(now.id() != id && now.is_mapped());
    }

    #[test]
    fn granules_follow_the_length_within_bounds() {
        assert_eq!(shared(1 << 20).granule_shift, 16);
        assert_eq!(granule_shift(4096), 12);
        assert_eq!(granule_shift(0), 12);
        assert_eq!(granule_shift(1 << 30), 20);
        assert_eq!(granule_shift(100_000), 12);
        // Rounded down: a buffer a little over 1 MiB still spreads over all 16 locks.
        assert_eq!(granule_shift((1 << 20) + 4096), 16);
        assert_eq!(granule_shift((2 << 20) - 1), 16);
    }

    #[test]
    fn masks_cover_each_granule_and_wrap() {
        let m = |off, len| mask(20, off, len); // 1 MiB granules
        assert_eq!(m(0, 1), 0b1);
        assert_eq!(m(0, 0), 0b1);
        assert_eq!(m((1 << 20) - 1, 2), 0b11);
        assert_eq!(m(15 << 20, 2 << 20), 0b1000_0000_0000_0001);
        assert_eq!(m(17 << 20, 1), 0b10);
        assert_eq!(m(3 << 20, 16 << 20), ALL);
        assert_eq!(m(usize::MAX - 5, 100), m(usize::MAX - 5, 6));
        // Every granule a range touches has its lock in the mask.
        for (off, len) in [
            (5 << 20, 7 << 20),
            (14 << 20, 3 << 20),
            (123_456, 9_999_999),
        ] {
            let got = m(off, len);
            for b in (off..off + len).step_by(4096).chain([off + len - 1]) {
                assert_ne!(got & (1 << ((b >> 20) % 16)), 0, "{off} {len} {b}");
            }
        }
    }

    proptest::proptest! {
        /// The soundness of range guards rests on this: two ranges that share a byte share a
        /// lock, whatever the granule, offsets and lengths (empty ranges included).
        #[test]
        fn ranges_sharing_a_byte_share_a_lock(
            shift in 12u32..=20,
            // In granules and a part of one: up to 40 granules in, up to 20 long, so that
            // ranges wrap round the 16 locks and stop short of all of them.
            (ga, oa, ka, ja) in (0usize..40, 0usize..(1 << 20), 0usize..20, 0usize..(1 << 20)),
            (gb, ob, kb, jb) in (0usize..40, 0usize..(1 << 20), 0usize..20, 0usize..(1 << 20)),
        ) {
            let g = 1usize << shift;
            let (a, alen) = (ga * g + oa % g, ka * g + ja % g);
            let (b, blen) = (gb * g + ob % g, kb * g + jb % g);
            let (ma, mb) = (mask(shift, a, alen), mask(shift, b, blen));
            proptest::prop_assert_ne!(ma, 0);
            proptest::prop_assert_ne!(mb, 0);
            // An empty range reads the length at its offset's granule: count it as one byte.
            let (ea, eb) = (a + alen.max(1), b + blen.max(1));
            if a < eb && b < ea {
                proptest::prop_assert_ne!(ma & mb, 0, "{}+{} and {}+{}", a, alen, b, blen);
            }
        }
    }

    #[test]
    fn disjoint_ranges_write_at_once_and_overlapping_ones_wait() {
        let s = shared(1 << 20); // 64 KiB granules
        let mut a = s.write_range(0, 4096).unwrap();
        let mut b = s.write_range(64 << 10, 4096).unwrap();
        a.fill(1);
        b.fill(2);
        assert!(s.try_write_range(100, 8).is_none(), "overlaps a");
        assert!(s.try_write_range(60 << 10, 8 << 10).is_none(), "reaches b");
        let c = s.try_write_range(128 << 10, 4096).unwrap().unwrap();
        drop((a, b, c));
        let r = s.read_range(0, 128 << 10).unwrap();
        assert_eq!(r[4095], 1);
        assert_eq!(r[64 << 10], 2);
        assert!(
            s.try_write_range(70 << 10, 1).is_none(),
            "a reader holds it"
        );
        drop(r);
        assert!(s.try_write_range(70 << 10, 1).is_some());
    }

    #[test]
    fn whole_guards_exclude_every_range() {
        let s = shared(1 << 20);
        let r = s.read();
        assert!(s.try_write_range(900 << 10, 1).is_none());
        let also = s.read_range(900 << 10, 1).unwrap();
        drop((r, also));
        let mut w = s.write();
        w.as_mut_slice()[5] = 9;
        std::thread::scope(|t| {
            let h = t.spawn(|| s.try_write_range(0, 1).is_none());
            assert!(h.join().unwrap());
        });
        drop(w);
        assert_eq!(s.read_range(5, 1).unwrap()[0], 9);
    }

    #[test]
    fn ranges_past_the_end_are_refused_and_release_their_locks() {
        let s = shared(8192);
        let err = s.write_range(4096, 8192).err().unwrap();
        assert!(err.to_string().contains("shared host memory"), "{err}");
        assert!(s.read_range(usize::MAX, 2).is_err());
        assert!(s.try_write_range(0, 8192).unwrap().is_ok());
        assert!(s.write_range(8192, 0).unwrap().is_empty());
    }

    #[test]
    fn threads_on_random_ranges_never_see_a_torn_write() {
        // Writers fill whole slots (3000 bytes, most straddling two granules) with one value;
        // readers of a slot must see one value throughout.
        let s = shared(64 << 10); // 4 KiB granules
        const SLOT: usize = 3000;
        let slots = (64 << 10) / SLOT;
        std::thread::scope(|t| {
            for id in 0..4u8 {
                let s = &s;
                t.spawn(move || {
                    for k in 0..2000usize {
                        let slot = (k * 7 + usize::from(id) * 13) % slots;
                        if k % 2 == 0 {
                            let mut w = s.write_range(slot * SLOT, SLOT).unwrap();
                            w.fill(id.wrapping_mul(31).wrapping_add(k as u8));
                        } else {
                            let r = s.read_range(slot * SLOT, SLOT).unwrap();
                            assert!(r.iter().all(|&b| b == r[0]), "torn slot {slot}");
                        }
                    }
                });
            }
        });
    }
}
