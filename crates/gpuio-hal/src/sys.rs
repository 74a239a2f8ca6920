//! Every host operating-system call the HAL makes (mmap, madvise, mbind, move_pages, fcntl), each
//! behind a safe function with its `// SAFETY:` note. The rest of the crate, and the device
//! crates above it (gpuio-nvme maps BARs and DMA memory with these), call these.

use crate::error::{HalError, Result};
use std::ptr::NonNull;

/// The CPUs this process may run on (affinity and cgroup quota), read once: std reads the
/// cgroup's files on every call, and configuration defaults ask for it often.
pub fn cpu_count() -> usize {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Which process this is in a line of forks: a count that grows in each child `fork()`
/// makes. Threads do not cross a fork, so whatever waits on threads started before one (a
/// session's workers, a pool's threads) must refuse to run in the child, where it would
/// wait forever: it records this when it starts them and compares it before it waits.
pub fn fork_generation() -> u64 {
    use std::sync::atomic::{AtomicBool, Ordering};
    // A flag, not a `Once`: a fork while another thread ran the `Once` would leave the
    // child waiting on it forever.
    static HOOKED: AtomicBool = AtomicBool::new(false);
    // Read first: the swap writes, and this is asked on every request.
    if !HOOKED.load(Ordering::Acquire) && !HOOKED.swap(true, Ordering::AcqRel) {
        // SAFETY: the handler only increments an atomic (async-signal-safe, as a child's
        // handler between fork and return must be); registration has no other effect.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        if rc != 0 {
            tracing::warn!(
                rc,
                "pthread_atfork failed: a forked child may wait on its parent's threads"
            );
        }
    }
    FORK_GENERATION.load(Ordering::Relaxed)
}

static FORK_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

extern "C" fn forked_child() {
    FORK_GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Size of a base page on this machine.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as usize } else { 4096 }
}

/// Clears `O_NONBLOCK` on an open file. A file opened non-blocking only so that the open itself
/// could not wait (a read-only open of a FIFO waits for a writer) goes back to ordinary IO:
/// io_uring fails reads with `EAGAIN` on non-blocking files of file systems that cannot read
/// without waiting, instead of handing them to its workers.
pub fn clear_nonblocking(file: &impl std::os::fd::AsFd) -> Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_fd().as_raw_fd();
    // SAFETY: F_GETFL reads the status flags of a descriptor the borrow keeps open.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(HalError::last_os("fcntl(F_GETFL)"));
    }
    if flags & libc::O_NONBLOCK != 0 {
        // SAFETY: F_SETFL changes only that open file's status flags; no memory is involved.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) };
        if rc < 0 {
            return Err(HalError::last_os("fcntl(F_SETFL)"));
        }
    }
    Ok(())
}

/// The size of a transparent huge page (2 MiB on x86-64).
pub const HUGE_PAGE: usize = 2 << 20;

/// The size of what `fd` refers to, as a seek to its end finds it (a dma-buf's size: its
/// file's `st_size` is 0). Leaves the descriptor's position at the end.
pub fn seekable_size(fd: std::os::fd::BorrowedFd<'_>) -> Result<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on a descriptor the borrow keeps open; no memory is involved.
    let end = unsafe { libc::lseek(fd.as_raw_fd(), 0, libc::SEEK_END) };
    u64::try_from(end).map_err(|_| HalError::last_os("lseek to the end"))
}

/// An anonymous private mapping of `len` bytes whose start is aligned to `align`
/// (a power of two, at least the page size). Returns the aligned start; the mapping is exactly
/// `len` bytes rounded up to a page, so [`unmap`] takes the same rounded length.
pub fn map_anonymous(len: usize, align: usize) -> Result<NonNull<u8>> {
    let page = page_size();
    let too_large = || HalError::OutOfMemory {
        what: "host memory (larger than the address space allows)",
        len,
    };
    if len > isize::MAX as usize / 2 {
        return Err(too_large());
    }
    let len = len.checked_next_multiple_of(page).ok_or_else(too_large)?;
    let align = align.max(page);
    let reserve = len.checked_add(align - page).ok_or_else(too_large)?;
    // SAFETY: an anonymous private mapping at a kernel-chosen address cannot alias any memory
    // Rust owns; the result is checked against MAP_FAILED before use.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        let err = std::io::Error::last_os_error();
        return Err(if err.raw_os_error() == Some(libc::ENOMEM) {
            HalError::OutOfMemory {
                what: "host memory",
                len,
            }
        } else {
            HalError::Os {
                op: "mmap",
                source: err,
            }
        });
    }
    let base = raw as usize;
    let start = base.next_multiple_of(align);
    let head = start - base;
    let tail = reserve - head - len;
    // Trim the alignment slack so the mapping is exactly [start, start+len).
    if head > 0 {
        // SAFETY: [base, base+head) is part of the mapping made above and nothing refers to it.
        unsafe { libc::munmap(raw, head) };
    }
    if tail > 0 {
        // SAFETY: [start+len, start+len+tail) is the end of the same mapping, unused.
        unsafe { libc::munmap((start + len) as *mut libc::c_void, tail) };
    }
    NonNull::new(start as *mut u8).ok_or_else(|| HalError::last_os("mmap"))
}

/// A shared read-write mapping of `len` bytes of `fd` from `offset` (a device region: a VFIO
/// BAR). Undo with [`unmap`].
pub fn map_shared(fd: std::os::fd::RawFd, offset: u64, len: usize) -> Result<NonNull<u8>> {
    let offset = libc::off_t::try_from(offset)
        .map_err(|_| HalError::InvalidArgument(format!("mapping offset {offset} too large")))?;
    // SAFETY: a shared mapping at a kernel-chosen address cannot alias memory Rust owns; the
    // result is checked against MAP_FAILED before use.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            offset,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(HalError::last_os("mmap (device region)"));
    }
    NonNull::new(raw.cast()).ok_or_else(|| HalError::last_os("mmap (device region)"))
}

/// Unmaps a region made by [`map_anonymous`] or [`map_shared`].
///
/// # Safety
/// `ptr`/`len` must be exactly a live mapping returned by one of those, and nothing may use it
/// afterwards.
pub unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
    let page = page_size();
    let len = len.div_ceil(page) * page;
    // SAFETY: the caller hands over a live mapping of this length that nothing uses any more.
    let rc = unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
    if rc != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "munmap failed");
    }
}

/// Asks for transparent huge pages on a mapping (`madvise(MADV_HUGEPAGE)`). Advisory: where THP
/// is off the kernel ignores it, so failure is only logged.
pub fn advise_huge_pages(ptr: NonNull<u8>, len: usize) -> bool {
    // SAFETY: madvise only changes the kernel's paging policy for a range we own; it never
    // changes its contents.
    let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
    rc == 0
}

const MPOL_BIND: libc::c_int = 2;
const MPOL_MF_STRICT: libc::c_uint = 1;
const MPOL_MF_MOVE: libc::c_uint = 1 << 1;

/// Binds a mapping's pages to one NUMA node (`mbind(MPOL_BIND)`). Call before the pages are
/// touched so that first-touch allocates them there.
pub fn bind_to_node(ptr: NonNull<u8>, len: usize, node: u32) -> Result<()> {
    let bits = 8 * std::mem::size_of::<libc::c_ulong>();
    let words = (node as usize / bits) + 1;
    let mut mask = vec![0 as libc::c_ulong; words];
    mask[node as usize / bits] |= 1 << (node as usize % bits);
    // SAFETY: mbind reads `words` words of `mask`, which lives across the call, and only
    // changes the placement policy of our own mapping.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr.as_ptr(),
            len,
            MPOL_BIND,
            mask.as_ptr(),
            (words * bits) as libc::c_ulong,
            MPOL_MF_STRICT | MPOL_MF_MOVE,
        )
    };
    if rc != 0 {
        return Err(HalError::last_os("mbind"));
    }
    Ok(())
}

/// Faults in every page of a mapping now (`MADV_POPULATE_WRITE`, or a write per page where
/// the kernel predates it), so later copies do not pay page faults and NUMA placement happens.
/// Running out of memory is an error, not something to discover later as a SIGBUS.
pub fn populate(ptr: NonNull<u8>, len: usize) -> Result<()> {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    // SAFETY: populating only faults in pages of our own mapping; contents stay zero.
    let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(match err.raw_os_error() {
            Some(libc::ENOMEM) | Some(libc::EFAULT) | Some(libc::EHWPOISON) => {
                HalError::OutOfMemory {
                    what: "host memory (populating pages)",
                    len,
                }
            }
            _ => HalError::Os {
                op: "madvise(MADV_POPULATE_WRITE)",
                source: err,
            },
        });
    }
    // EINVAL: a kernel older than 5.14; touch each page instead.
    let page = page_size();
    let mut off = 0;
    while off < len {
        // SAFETY: off < len, inside our mapping; writing a zero over a zero keeps the contents.
        unsafe { ptr.as_ptr().add(off).write_volatile(0) };
        off += page;
    }
    Ok(())
}

/// The NUMA node each sampled page of a mapping currently lives on (`move_pages` in query
/// mode), or a negative errno for a page that is not resident.
pub fn page_nodes(ptr: NonNull<u8>, len: usize, samples: usize) -> Result<Vec<i32>> {
    let page = page_size();
    let pages = len.div_ceil(page).max(1);
    let step = (pages / samples.max(1)).max(1);
    let addrs: Vec<*mut libc::c_void> = (0..pages)
        .step_by(step)
        .map(|p| ptr.as_ptr().wrapping_add(p * page).cast())
        .collect();
    let mut status = vec![0 as libc::c_int; addrs.len()];
    // SAFETY: with a null `nodes` argument move_pages only reports where the listed pages of
    // our own process live, writing `addrs.len()` ints into `status`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0,
            addrs.len() as libc::c_ulong,
            addrs.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0,
        )
    };
    if rc < 0 {
        return Err(HalError::last_os("move_pages"));
    }
    Ok(status)
}

/// Hints the CPU to start loading the cache line holding `data`'s first byte (random row
/// gathers issue these a few rows ahead so that many misses are in flight at once).
#[inline]
pub fn prefetch(data: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults, and the pointer comes from a live slice.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(data.as_ptr().cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Writes `src` as little-endian u64s into the start of `dst` (as many as fit) with stores
/// that bypass the CPU caches where the CPU has them (x86-64): for a buffer a device reads
/// next by DMA, which then finds the data in memory instead of snooping it out of the cores'
/// caches.
pub fn write_u64s_streaming(dst: &mut [u8], src: &[u64]) {
    let n = src.len().min(dst.len() / 8);
    let dst = &mut dst[..n * 8];
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the first `n` u64s of `src` are `n * 8` initialized bytes (u8 needs no
        // alignment), borrowed as long as `src`; on a little-endian machine they are the
        // values' encoding.
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), n * 8) };
        copy_streaming(dst, bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for (o, v) in dst.chunks_exact_mut(8).zip(src) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

/// Copies `src` into `dst` (the same length: the shorter of the two) with stores that bypass
/// the CPU caches where the CPU has them (x86-64): for a large copy whose destination is not
/// read again by this core soon (a device reads it by DMA, or a later copy). The destination's
/// lines are written whole instead of first being read into the cache, so the copy moves two
/// bytes of memory traffic per byte where an ordinary one moves three.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    let n = src.len().min(dst.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Streaming stores want 16-byte aligned addresses: the bytes before the first one, and
        // the tail of less than a line, are copied the ordinary way.
        let head = (16 - dst.as_ptr() as usize % 16) % 16;
        let head = head.min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let lines = (n - head) / 64;
        let (body, tail) = dst[head..].split_at_mut(lines * 64);
        let (from, rest) = src[head..].split_at(lines * 64);
        for (o, v) in body.chunks_exact_mut(64).zip(from.chunks_exact(64)) {
            // SAFETY: `o` is 64 writable bytes starting at a 16-byte aligned address (the body
            // starts aligned and steps by 64), `v` 64 readable bytes (unaligned loads); the
            // four 16-byte pieces at offsets 0, 16, 32 and 48 lie inside both.
            unsafe {
                let (s, d) = (
                    v.as_ptr().cast::<__m128i>(),
                    o.as_mut_ptr().cast::<__m128i>(),
                );
                let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
        }
        tail.copy_from_slice(rest);
        // SAFETY: a store fence has no preconditions; it orders the streaming stores before
        // every later store (a hand-off to another thread or device among them).
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Copies `len` bytes between two raw regions.
///
/// # Safety
/// Both regions must be valid for `len` bytes and must not overlap.
pub unsafe fn copy_raw(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// A peek at one byte of a socket without blocking and without consuming it: `Ok(0)` when
/// the peer has closed it, `Ok(1)` when bytes are waiting, `Err(WouldBlock)` when it is open
/// and quiet. One system call, whatever the socket's blocking mode.
pub fn peek_nonblocking(socket: std::os::fd::BorrowedFd<'_>) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut byte = 0u8;
    // SAFETY: recv writes at most one byte, into `byte`, which outlives the call; the
    // descriptor is borrowed, so it is open for the call's duration.
    let n = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Raises this process's soft limit on open file descriptors to its hard limit; returns the
/// limit now in force. A server that must hold many sockets calls it once at start (the soft
/// limit is often 1024 while the hard one is far higher).
pub fn raise_fd_limit() -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads `raised`, which lives across the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Ok(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_u64_writes_match_the_le_encoding_at_every_alignment() {
        let src: Vec<u64> = (0..37u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        for start in 0..16 {
            for n in [0, 1, 2, 3, 36, 37] {
                let mut buf = vec![0u8; 16 + 37 * 8 + 5];
                let dst = &mut buf[start..start + n * 8 + 3];
                write_u64s_streaming(dst, &src[..n]);
                let want: Vec<u8> = src[..n].iter().flat_map(|v| v.to_le_bytes()).collect();
                assert_eq!(&dst[..n * 8], &want[..], "start {start} n {n}");
                assert_eq!(&dst[n * 8..], &[0, 0, 0], "start {start} n {n}");
            }
        }
        // A destination too short takes the values that fit.
        let mut short = [0u8; 12];
        write_u64s_streaming(&mut short, &src);
        assert_eq!(&short[..8], &src[0].to_le_bytes());
        assert_eq!(&short[8..], &[0; 4]);
    }

    #[test]
    fn a_forked_child_is_a_new_generation() {
        let parent = fork_generation();
        assert_eq!(fork_generation(), parent, "no fork, no change");
        // SAFETY: the child only loads an atomic and exits without unwinding or running
        // destructors; the parent waits for it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = if fork_generation() == parent + 1 {
                0
            } else {
                1
            };
            // SAFETY: _exit ends the child at once, as a forked child of a threaded process must.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just made; `status` is a valid out-pointer.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(libc::WIFEXITED(status), "child did not exit: {status}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child saw the parent's generation"
        );
        assert_eq!(fork_generation(), parent, "the parent's generation stays");
    }

    #[test]
    fn streaming_copies_match_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..700u32).map(|i| (i * 131 % 251) as u8).collect();
        for dst_at in 0..17 {
            for src_at in [0, 1, 8, 15] {
                for n in [0, 1, 15, 16, 17, 63, 64, 65, 200, 640] {
                    let mut buf = vec![0xAAu8; dst_at + n + 9];
                    copy_streaming(&mut buf[dst_at..dst_at + n], &src[src_at..src_at + n]);
                    let what = format!("dst at {dst_at}, src at {src_at}, {n} bytes");
                    assert_eq!(&buf[dst_at..dst_at + n], &src[src_at..src_at + n], "{what}");
                    assert!(buf[..dst_at].iter().all(|&b| b == 0xAA), "{what}: before");
                    assert!(
                        buf[dst_at + n..].iter().all(|&b| b == 0xAA),
                        "{what}: after"
                    );
                }
            }
        }
        // Lengths differing: the shorter one's bytes.
        let mut short = [0u8; 70];
        copy_streaming(&mut short, &src);
        assert_eq!(&short[..], &src[..70]);
    }

    #[test]
    fn absurd_lengths_are_refused_not_wrapped() {
        for len in [usize::MAX, usize::MAX - 10, isize::MAX as usize] {
            assert!(map_anonymous(len, HUGE_PAGE).is_err(), "{len}");
        }
    }

    #[test]
    fn aligned_mapping_is_aligned_and_usable() {
        let len = 3 * HUGE_PAGE + 123;
        let ptr = map_anonymous(len, HUGE_PAGE).unwrap();
        assert_eq!(ptr.as_ptr() as usize % HUGE_PAGE, 0);
        advise_huge_pages(ptr, len);
        populate(ptr, len).unwrap();
        // SAFETY: the mapping is len bytes and owned here.
        let s = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
        s[len - 1] = 7;
        assert_eq!(s[len - 1], 7);
        // SAFETY: the mapping above, no longer used.
        unsafe { unmap(ptr, len) };
    }
}
