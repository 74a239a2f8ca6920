//! Registrations kept for hot files. A file read from the page cache a second time, unchanged
//! (or, in reads below the threshold, read more than once over), keeps its whole registration
//! (in chunks from its start), so later reads of it, of any size, skip registering: one copy
//! from pinned pages, at the copy engine's pinned rate, for weights loaded again and again,
//! onto several GPUs (the registration is portable across devices), or a cuFile program's
//! 4 MiB reads of a file it reads over and over.
//!
//! The registration is made on a thread of its own while the read that asked for it goes
//! through the lanes (registering 4 GiB takes ~150 ms, which no read should wait for); reads
//! use it from when it is whole. The driver serializes registration with copies (a read whose
//! DMAs overlapped one ran 2-3x slower), so registering threads take turns, one chunk of
//! [`KEEP_CHUNK`] at a time across all files, each once the engine has run no GPU transfer
//! for [`QUIET`] ([`Patience`]): reads go on through the lanes untouched, and a read that
//! starts during a chunk waits at most for that chunk. A file read more than once over in
//! small reads waits at most [`MAX_WAIT`] per chunk, or a loop of them reading it back to back
//! would never get it kept. Bounded in pinned bytes (the least recently used go
//! first), let go when the file changes, and all let go when the machine runs short of memory.

use super::{Identity, chunks, is_warm, map_warm};
use crate::Result;
use crate::file::FileHandle;
use gpuio_hal::memory::backing::backable_bytes;
use gpuio_hal::memory::mapped::{FileMapping, MappingPin};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{DeviceBuffer, Gpu, Stream};

use std::fs::File;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Files remembered as read once, waiting for a second read to be kept.
const SEEN: usize = 64;

/// Bytes a kept registration registers at a time (~1.5 ms of the driver's time).
const KEEP_CHUNK: usize = 32 << 20;

/// How long the engine must have run no GPU transfer before a chunk is registered (reads
/// issued back to back leave gaps of tens of microseconds).
const QUIET: Duration = Duration::from_millis(2);

/// The longest a chunk of a file read more than once over in small reads waits for the engine
/// to be quiet ([`Patience::Bounded`]): one chunk (~1.5 ms of the driver's time) in this long
/// at most delays the reads beside it, and a file read back to back is kept within seconds.
const MAX_WAIT: Duration = Duration::from_millis(20);

/// Below this much memory the machine could still back, every kept registration is let go.
const FLOOR: u64 = 1 << 30;

/// How often a lookup reads how much memory the machine can back.
const PRESSURE_EVERY: Duration = Duration::from_millis(100);

/// A read of this many bytes, as it counts towards keeping its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Read {
    /// From the page cache threshold up: a second read of the file keeps it.
    Large(u64),
    /// Below it: a file read more than once over in such reads is kept.
    Small(u64),
}

/// How long a registration waits for the engine to be quiet before each chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Patience {
    /// Until it is, for files asked for by large reads: no read waits on the registration
    /// (a model's first load asks for it at its second tensor), and large reads through the
    /// lanes run near the kept rate anyway.
    Quiet,
    /// At most [`MAX_WAIT`], for files read more than once over in small reads: staged small
    /// reads run well under the kept rate, and a loop of them may never pause.
    Bounded,
}

/// A file's whole registration.
pub(crate) struct Kept {
    identity: Identity,
    /// The file, to notice it changed or was deleted while nobody reads it.
    file: Arc<File>,
    /// Consecutive chunks from the file's start.
    pins: Vec<MappingPin>,
}

impl Kept {
    /// Registers all of `map` (the whole file, unchanged since `identity` was read), a chunk
    /// at a time, each on `keeper`'s turn ([`KeptFiles::turn`]); `None` if any chunk fails,
    /// or the engine goes (nothing is kept then).
    fn register(
        gpu: &Gpu,
        file: Arc<File>,
        map: &Arc<FileMapping>,
        identity: Identity,
        keeper: &KeptFiles,
        patience: Patience,
    ) -> Option<Self> {
        let mut pins = Vec::new();
        for r in chunks(0, map.len(), map.page_size(), KEEP_CHUNK) {
            let _turn = keeper.turn(patience)?;
            // Populated pages register faster (see `copy_registered`).
            let _ = map.populate(r.clone());
            pins.push(gpu.pin_mapping(map, r).ok()?);
        }
        Some(Self {
            identity,
            file,
            pins,
        })
    }

    fn bytes(&self) -> u64 {
        self.identity.len
    }

    /// Whether the file is as it was when registered, and still has a name (a deleted file's
    /// registration would only hold pinned memory that no read can use).
    fn still_current(&self) -> bool {
        Identity::of(&self.file).is_ok_and(|(now, links)| now == self.identity && links > 0)
    }

    /// Copies file bytes `offset..offset + len` into `dst` at `dst_offset`.
    pub(super) fn copy(
        &self,
        stream: &Stream,
        offset: u64,
        len: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let want = offset as usize..offset as usize + len;
        for pin in &self.pins {
            let r = pin.range();
            let part: Range<usize> = r.start.max(want.start)..r.end.min(want.end);
            if part.is_empty() {
                continue;
            }
            let at = dst_offset + (part.start - want.start);
            pin.copy_to_device(part, stream, dst, at)?;
        }
        Ok(())
    }
}

/// A GPU transfer running ([`KeptFiles::busy`]).
pub(crate) struct Busy<'a>(&'a KeptFiles);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let k = self.0;
        k.last_busy
            .store(k.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
        k.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counters of the kept registrations, for `gpuio stat`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageCacheStats {
    /// Pinned bytes the kept registrations may hold (`page_cache_keep`).
    pub limit: u64,
    /// Pinned bytes they hold now.
    pub kept_bytes: u64,
    /// Files kept.
    pub kept_files: u64,
    /// Reads served by a kept registration.
    pub hits: u64,
    /// Reads from the page cache that had to register.
    pub misses: u64,
    /// Registrations let go (for room, a changed file, or memory pressure).
    pub released: u64,
}

#[derive(Default)]
struct State {
    /// Least recently used first.
    kept: Vec<Arc<Kept>>,
    /// Files read, not yet asked to be kept, with the bytes read from them.
    seen: Vec<(Identity, u64)>,
    /// Files being registered to keep, their bytes reserved under the limit.
    registering: Vec<Identity>,
    /// Bytes kept, and reserved for the files being registered: together never above the
    /// limit.
    bytes: u64,
    reserved: u64,
    /// When the machine's memory was last read (`pressed`).
    pressure_read: Option<Instant>,
}

impl State {
    /// Takes out the kept files `gone` says to let go, counting them; their pins are dropped
    /// by the caller, outside the lock (unregistering takes milliseconds per gigabyte).
    fn take(&mut self, gone: impl Fn(&Kept) -> bool) -> Vec<Arc<Kept>> {
        let (out, keep): (Vec<_>, Vec<_>) = self.kept.drain(..).partition(|k| gone(k));
        self.kept = keep;
        self.bytes = self.kept.iter().map(|k| k.bytes()).sum();
        out
    }
}

/// The kept registrations of one LocalIO engine.
pub(crate) struct KeptFiles {
    limit: u64,
    state: Mutex<State>,
    /// The threads registering files to keep (finished ones pruned as new ones start).
    registrars: Mutex<Vec<JoinHandle<()>>>,
    /// Held by the registering thread whose turn it is ([`turn`](Self::turn)).
    one_at_a_time: Mutex<()>,
    /// Raised when the engine goes: registrations in flight stop at their next chunk.
    closing: AtomicBool,
    /// The engine's GPU transfers running now (registrations wait for none).
    busy: AtomicUsize,
    /// When the last one ended, in nanoseconds from `epoch`.
    last_busy: AtomicU64,
    epoch: Instant,
    hits: AtomicU64,
    misses: AtomicU64,
    released: AtomicU64,
}

impl KeptFiles {
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            limit,
            state: Mutex::new(State::default()),
            registrars: Mutex::new(Vec::new()),
            one_at_a_time: Mutex::new(()),
            closing: AtomicBool::new(false),
            busy: AtomicUsize::new(0),
            last_busy: AtomicU64::new(0),
            epoch: Instant::now(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            released: AtomicU64::new(0),
        }
    }

    /// Counts `gone` as let go and drops them (unregistering, outside the lock).
    fn release(&self, gone: Vec<Arc<Kept>>) {
        self.released
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        drop(gone);
    }

    /// The kept registration of the file `now` identifies, if it is kept and unchanged. Kept
    /// files changed or deleted since are let go first, and all of them under memory pressure.
    /// A small read that finds none is no miss (it would not have registered).
    pub(super) fn get(&self, now: &Identity, read: Read) -> Option<Arc<Kept>> {
        let mut st = self.state.lock_unpoisoned();
        let mut gone = if self.pressed(&mut st) {
            tracing::warn!(
                bytes = st.bytes,
                "memory is short: letting go of kept page cache registrations"
            );
            st.take(|_| true)
        } else {
            // One `fstat` per kept file.
            st.take(|k| !k.still_current())
        };
        let found = st.kept.iter().position(|k| k.identity == *now);
        let hit = found.map(|i| {
            let k = st.kept.remove(i);
            st.kept.push(k.clone());
            k
        });
        if hit.is_none() {
            gone.extend(st.take(|k| k.identity.same_file(now)));
        }
        drop(st);
        self.release(gone);
        match (&hit, read) {
            (Some(_), _) => self.hits.fetch_add(1, Ordering::Relaxed),
            (None, Read::Large(_)) => self.misses.fetch_add(1, Ordering::Relaxed),
            (None, Read::Small(_)) => 0,
        };
        hit
    }

    /// Whether to keep the registration of this file now, and how patiently: the second read
    /// of it unchanged (small reads: once they have read more than the whole file), when no
    /// other read is registering it and room is made for it under the limit (the least
    /// recently used kept files let go). `Some` reserves its bytes until
    /// [`insert`](Self::insert) or [`abandon`](Self::abandon). The first read is remembered.
    pub(super) fn wants(&self, now: &Identity, read: Read) -> Option<Patience> {
        if now.len > self.limit {
            return None;
        }
        let mut st = self.state.lock_unpoisoned();
        if st.registering.iter().any(|r| r.same_file(now)) {
            return None;
        }
        let (Read::Large(bytes) | Read::Small(bytes)) = read;
        // Small files gain little, and every kept file costs each lookup a `fstat`: small
        // reads count only towards files of a chunk or more.
        if matches!(read, Read::Small(_)) && now.len < KEEP_CHUNK as u64 {
            return None;
        }
        let seen = st.seen.iter().position(|(s, _)| s == now);
        let Some(i) = seen else {
            st.seen.retain(|(s, _)| !s.same_file(now));
            if st.seen.len() >= SEEN {
                st.seen.remove(0);
            }
            st.seen.push((now.clone(), bytes));
            return None;
        };
        st.seen[i].1 = st.seen[i].1.saturating_add(bytes);
        let patience = match read {
            Read::Small(_) if st.seen[i].1 <= now.len => return None,
            Read::Small(_) => Patience::Bounded,
            Read::Large(_) => Patience::Quiet,
        };
        // Room held for files being registered cannot be made: evict nothing in vain.
        if st.reserved + now.len > self.limit {
            return None;
        }
        let mut gone = Vec::new();
        while st.bytes + st.reserved + now.len > self.limit && !st.kept.is_empty() {
            let k = st.kept.remove(0);
            st.bytes -= k.bytes();
            gone.push(k);
        }
        let fits = st.bytes + st.reserved + now.len <= self.limit;
        if fits {
            st.seen.remove(i);
            st.registering.push(now.clone());
            st.reserved += now.len;
        }
        drop(st);
        self.release(gone);
        fits.then_some(patience)
    }

    /// Registers the whole of `file` (unchanged since `identity`, which
    /// [`wants`](Self::wants) took) on a thread of its own while the engine is idle, and
    /// keeps it; gives its room back where the file is not warm enough or a registration
    /// fails.
    pub(super) fn register_in_background(
        self: &Arc<Self>,
        file: FileHandle,
        identity: Identity,
        gpu: Gpu,
        patience: Patience,
    ) {
        let this = self.clone();
        let id = identity.clone();
        let work = move || {
            let len = identity.len as usize;
            // Mapping the file and reading its residency cost CPU time and the process's
            // mapping lock too: not while the read that asked for it runs.
            let map = this.turn(patience).and_then(|_turn| {
                // A mapping the kernel refuses is a reason to read another way, not to fail.
                map_warm(&file, 0, len, |map| Ok(is_warm(map.resident(0..len)?, len)))
            });
            let kept = map.and_then(|map| {
                Kept::register(
                    &gpu,
                    file.os_file().ok()?,
                    &map,
                    id.clone(),
                    &this,
                    patience,
                )
            });
            match kept {
                Some(k) => this.insert(k),
                None => this.abandon(&id),
            }
        };
        let spawned = std::thread::Builder::new()
            .name("gpuio-keep".into())
            .spawn(work);
        match spawned {
            Ok(h) => {
                let mut registrars = self.registrars.lock_unpoisoned();
                registrars.retain(|h| !h.is_finished());
                registrars.push(h);
            }
            Err(e) => {
                tracing::warn!(error = %e, "no thread to keep a page cache registration");
                self.abandon(&identity);
            }
        }
    }

    /// Counts a GPU transfer of the engine as running until the guard drops.
    pub(crate) fn busy(&self) -> Busy<'_> {
        self.busy.fetch_add(1, Ordering::Relaxed);
        Busy(self)
    }

    /// A registering thread's turn to touch the driver: one at a time (however many files
    /// are being kept, a read that starts meanwhile waits for one chunk at most), once the
    /// engine has been quiet, or waited as long as `patience` allows
    /// ([`wait_quiet`](Self::wait_quiet)); `None` once it is going.
    fn turn(&self, patience: Patience) -> Option<std::sync::MutexGuard<'_, ()>> {
        // Waited for before the turn is taken: a registration waiting for a quiet moment that
        // never comes must not hold back a bounded one.
        loop {
            if !self.wait_quiet(patience) {
                return None;
            }
            match self.one_at_a_time.try_lock() {
                Ok(turn) => return Some(turn),
                Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => std::thread::sleep(QUIET / 4),
            }
        }
    }

    /// Waits until the engine has run no GPU transfer for [`QUIET`], or for [`MAX_WAIT`] where
    /// `patience` is bounded; `false` once the engine is going.
    fn wait_quiet(&self, patience: Patience) -> bool {
        let started = Instant::now();
        loop {
            if self.closing.load(Ordering::Relaxed) {
                return false;
            }
            let idle = Duration::from_nanos(
                (self.epoch.elapsed().as_nanos() as u64)
                    .saturating_sub(self.last_busy.load(Ordering::Relaxed)),
            );
            if self.busy.load(Ordering::Relaxed) == 0 && idle >= QUIET {
                return true;
            }
            if patience == Patience::Bounded && started.elapsed() >= MAX_WAIT {
                return true;
            }
            std::thread::sleep(QUIET / 4);
        }
    }

    /// Waits for the registrations in flight to be kept or given up.
    pub(super) fn wait(&self) {
        let registrars = std::mem::take(&mut *self.registrars.lock_unpoisoned());
        for h in registrars {
            let _ = h.join();
        }
    }

    /// Stops the registrations in flight at their next chunk and waits for them (the engine
    /// is going; nothing may touch the device after it).
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Relaxed);
        self.wait();
    }

    /// Keeps `kept`, whose room [`wants`](Self::wants) reserved.
    fn insert(&self, kept: Kept) {
        let kept = Arc::new(kept);
        let mut st = self.state.lock_unpoisoned();
        Self::unreserve(&mut st, &kept.identity);
        st.bytes += kept.bytes();
        st.kept.push(kept);
    }

    /// Gives back the room [`wants`](Self::wants) reserved for a file that was not kept.
    fn abandon(&self, file: &Identity) {
        Self::unreserve(&mut self.state.lock_unpoisoned(), file);
    }

    fn unreserve(st: &mut State, file: &Identity) {
        if let Some(i) = st.registering.iter().position(|r| r == file) {
            st.registering.remove(i);
            st.reserved -= file.len;
        }
    }

    /// Lets go of the file's kept registration (it changed under a read).
    pub(super) fn forget(&self, file: &Identity) {
        let gone = self
            .state
            .lock_unpoisoned()
            .take(|k| k.identity.same_file(file));
        self.release(gone);
    }

    /// Lets go of every kept registration (reads holding one finish with it first).
    pub(super) fn clear(&self) {
        let gone = self.state.lock_unpoisoned().take(|_| true);
        self.release(gone);
    }

    /// Whether the machine can back less than [`FLOOR`] more. The kernel counts the page
    /// cache pages the kept registrations pin as reclaimable, which they are not: they are
    /// taken off what it reports.
    ///
    /// Read at most every [`PRESSURE_EVERY`]: reading it takes a few files of `/proc` and the
    /// cgroup tree, tens of microseconds against a millisecond's read.
    fn pressed(&self, st: &mut State) -> bool {
        if st.kept.is_empty()
            || st
                .pressure_read
                .is_some_and(|t| t.elapsed() < PRESSURE_EVERY)
        {
            return false;
        }
        st.pressure_read = Some(Instant::now());
        backable_bytes(false).is_some_and(|b| b.saturating_sub(st.bytes + st.reserved) < FLOOR)
    }

    pub(super) fn stats(&self) -> PageCacheStats {
        let st = self.state.lock_unpoisoned();
        PageCacheStats {
            limit: self.limit,
            kept_bytes: st.bytes,
            kept_files: st.kept.len() as u64,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl KeptFiles {
        /// Whether a read of the whole file asks for it to be kept.
        fn wants_large(&self, now: &Identity) -> bool {
            self.wants(now, Read::Large(now.len)).is_some()
        }
    }

    fn id(ino: u64, len: u64, mtime: i64) -> Identity {
        Identity {
            len,
            mtime: (mtime, 0),
            ctime: (mtime, 0),
            ino,
            dev: 1,
        }
    }

    #[test]
    fn a_file_is_wanted_on_its_second_unchanged_read_under_the_limit() {
        let k = KeptFiles::new(1000);
        assert!(
            !k.wants_large(&id(1, 100, 5)),
            "the first read is only remembered"
        );
        assert!(k.wants_large(&id(1, 100, 5)));
        // Changed in between: remembered again, not wanted yet.
        assert!(!k.wants_large(&id(2, 100, 5)));
        assert!(!k.wants_large(&id(2, 100, 6)));
        assert!(k.wants_large(&id(2, 100, 6)));
        // Above the limit: never.
        assert!(!k.wants_large(&id(3, 2000, 1)));
        assert!(!k.wants_large(&id(3, 2000, 1)));
        // Nothing kept: every lookup misses.
        assert!(k.get(&id(1, 100, 5), Read::Large(100)).is_none());
        assert_eq!(k.stats().misses, 1);
    }

    #[test]
    fn room_is_reserved_while_a_file_registers_and_given_back_if_it_is_not_kept() {
        let k = KeptFiles::new(150);
        let (a, b) = (id(1, 100, 1), id(2, 100, 1));
        for f in [&a, &b] {
            assert!(!k.wants_large(f));
        }
        assert!(k.wants_large(&a), "a's second read registers it");
        assert!(
            !k.wants_large(&a),
            "a second reader of a file being registered does not"
        );
        assert!(!k.wants_large(&b), "no room beside a's 100 reserved bytes");
        k.abandon(&a);
        assert!(k.wants_large(&b), "room given back");
    }

    #[test]
    fn registrations_wait_for_a_quiet_engine_and_stop_when_it_goes() {
        let k = Arc::new(KeptFiles::new(1));
        let busy = k.busy();
        let waiter = {
            let k = k.clone();
            std::thread::spawn(move || (k.wait_quiet(Patience::Quiet), Instant::now()))
        };
        std::thread::sleep(Duration::from_millis(20));
        let released = Instant::now();
        drop(busy);
        let (quiet, when) = waiter.join().unwrap();
        assert!(quiet, "an idle engine's registration stopped");
        assert!(
            when.duration_since(released) >= QUIET,
            "went on while a transfer ran, or without waiting for a quiet moment"
        );
        let _busy = k.busy();
        k.closing.store(true, Ordering::Relaxed);
        assert!(
            !k.wait_quiet(Patience::Bounded),
            "a closing engine's registration goes on"
        );
    }

    #[test]
    fn a_hot_files_registration_waits_a_bounded_time() {
        let k = KeptFiles::new(1);
        let _busy = k.busy();
        let t = Instant::now();
        assert!(k.wait_quiet(Patience::Bounded));
        let waited = t.elapsed();
        assert!(
            waited >= MAX_WAIT && waited < MAX_WAIT * 10,
            "waited {waited:?} beside a transfer that never ends"
        );
    }

    #[test]
    fn small_reads_ask_for_a_file_read_more_than_once_over_and_wait_less() {
        const MB: u64 = 1 << 20;
        let k = KeptFiles::new(1000 * MB);
        let f = id(1, 100 * MB, 5);
        for _ in 0..4 {
            let no = k.wants(&f, Read::Small(25 * MB));
            assert_eq!(no, None, "not yet read once over");
        }
        assert_eq!(k.wants(&f, Read::Small(25 * MB)), Some(Patience::Bounded));
        let again = k.wants(&f, Read::Small(25 * MB));
        assert_eq!(again, None, "already being registered");
        // A file under a chunk: small reads never ask, nor are they remembered.
        let tiny = id(9, 4096, 5);
        for _ in 0..4 {
            assert_eq!(k.wants(&tiny, Read::Small(4096)), None);
        }
        assert!(
            k.state
                .lock_unpoisoned()
                .seen
                .iter()
                .all(|(s, _)| s != &tiny)
        );
        // Large reads ask at their second and wait for quiet moments, read whole or not.
        for (ino, n) in [(2, 10), (3, 100)] {
            let g = id(ino, 100, 5);
            assert_eq!(k.wants(&g, Read::Large(n)), None);
            assert_eq!(k.wants(&g, Read::Large(n)), Some(Patience::Quiet));
        }
    }

    #[test]
    fn only_so_many_files_are_remembered() {
        let k = KeptFiles::new(u64::MAX);
        for ino in 0..=SEEN as u64 {
            assert!(!k.wants_large(&id(ino, 1, 1)));
        }
        // The oldest was forgotten to make room; the newest is still remembered.
        assert!(!k.wants_large(&id(0, 1, 1)));
        assert!(k.wants_large(&id(SEEN as u64, 1, 1)));
    }
}
