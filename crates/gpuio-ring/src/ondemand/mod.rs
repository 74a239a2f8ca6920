//! On-demand arrays' GPU-resident page cache: the memory and the protocol that GPU threads
//! (`kernels/gpuio_array.cuh`) and host threads ([`HostAccessor`]) follow to read and write
//! elements of an array bigger than GPU memory, with misses and write-backs going through the
//! request ring ([`crate`]). What an array *is* to users (its source, prefetch,
//! synchronize, statistics) is gpuio-core's `OnDemandArray`.
//!
//! Its files: `layout.rs` (entry and owner bits, the slot and statistics blocks, the
//! descriptors kernels receive; mirrored by `gpuio_array.cuh`), `memory.rs`
//! ([`PageCacheMemory`], [`PageTable`]: allocation, arrays in and out, counters, errors, all
//! between kernels), `twin.rs` ([`HostAccessor`]: the protocol on host threads).
//!
//! # Protocol
//!
//! A cache has `nframes` frames of `page_size` bytes in device memory, shared by up to 64
//! arrays. Each array has a page table of one u64 **entry** per page: a state (EMPTY,
//! FILLING, VALID, EVICTING), a dirty bit, a pin count and a frame. Each frame has an
//! **owner** word (free, or the slot and page it holds, with a LOCKED bit) and a reference
//! bit.
//!
//! - **Hit**: add a pin to the entry (one atomic add). If the old value was VALID, the frame
//!   is this thread's to read (and, for a store, to write after setting DIRTY) until it
//!   takes the pin off. Otherwise it takes the pin off again. A gather's thread pins the pages
//!   of several elements at once (relaxed adds, then one acquire fence) and takes those pins
//!   off together behind one release fence, so its round trips overlap.
//! - **Miss**: a thread that finds the entry EMPTY claims it with a compare-and-swap to
//!   FILLING; others wait for it (a page is read once however many threads want it). The
//!   claimer takes a frame, reads the page into it through the ring (or, for a read-only array
//!   over a file pinned for the device, copies it from the page cache pages in place:
//!   `ArraySlot::direct`), and turns the entry VALID with its own pin already added (so the
//!   page it paid for is its to read).
//! - **Admission** (arrays read in place with [`InPlace::admit_after`] > 0, accesses under a
//!   quarter page): a thread that finds the entry EMPTY with fewer than `admit_after` touches
//!   counted in its frame bits adds its touches with a compare-and-swap (a lost race only
//!   delays the admission) and reads its bytes from the source in place; so does one that
//!   finds it FILLING or EVICTING (the source holds the same bytes). The touch after
//!   `admit_after` claims the page as a miss does, clearing the count; an eviction clears it
//!   too.
//! - **Fetched ahead** (`get_async`): a staged ring read of a page not cached, posted without
//!   claiming it; `wait` claims the page only if it is still EMPTY, no write-back of the array
//!   began since the read was posted and none was in flight then (the slot's
//!   `writebacks_begun` / `writebacks_ended`), and a clean frame comes free at once.
//! - **Taking a frame** (CLOCK): advance the shared hand; skip frames referenced since the
//!   last pass (clearing the bit: a second chance) and frames LOCKED by another thread; lock
//!   one with a compare-and-swap of its owner. A free frame is taken. An
//!   owned one is evicted only if its page's entry is VALID, unpinned and points at it: one
//!   compare-and-swap of the entry turns it EVICTING, which no pin can race, since the pins
//!   live in the same word. A dirty page is written back through the ring before the entry
//!   is emptied; if that fails, the page stays VALID and dirty and the miss fails. A GPU lane
//!   looks at 128 frames per round of its warp and tries again next round, so that the lanes
//!   of its warp holding frames for their fills finish them meanwhile (a lane spinning for a
//!   frame while its own warp holds frames could wait for ever); after 5 s without a frame
//!   the miss fails with `RESULT_NO_FRAME` (every frame stayed pinned), so a kernel gets an
//!   error instead of hanging.
//! - **Flush**: a VALID dirty page with no pins goes EVICTING with its dirty bit cleared, is
//!   written back, and goes VALID again (dirty again if the write-back failed). A store after
//!   that sets the bit again.
//!
//! Write-back order: a page reaches its source when it is evicted or flushed, each page as
//! one ring WRITE of the page (the last page of the source only up to its end). Nothing
//! orders write-backs of different pages; a flush returns once every page it wrote back is
//! written (`OnDemandArray::synchronize`).
//!
//! Holding ([`HeldPages`]): every page of a read-only array pinned once more until the hold is
//! let go, so no held page is evicted or moves, and kernels read it through the hold's frame
//! table (`gpuio_resident_array<T>`) with no pin per access. Held pages count against the
//! cache's frames; a hold that cannot get every page lets go of what it had.
//!
//! Errors: a device access that fails records the first failure's code in the array's slot
//! (`ArraySlot::error`); the host reads it with [`PageCacheMemory::take_error`] after the
//! kernel, so a kernel's failed reads never pass for data.

mod held;
mod layout;
mod memory;
pub mod ops;
mod twin;

pub use held::{HeldPages, NOT_HELD};
pub use layout::*;
pub use memory::{ArrayCounters, InPlace, PageCacheMemory, PageTable};
#[cfg(feature = "test-kernels")]
pub use ops::ArrayReadCheck;
pub use twin::{HostAccessor, SourceReader};
