//! A dma-buf exporter with no hardware: the kernel's virtual GEM driver (vgem, loaded in
//! `cargo xtask qemu-nvme`'s guest), a dumb buffer exported through PRIME and mapped here.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `struct drm_mode_create_dumb`.
#[repr(C)]
#[derive(Default)]
struct CreateDumb {
    height: u32,
    width: u32,
    bpp: u32,
    flags: u32,
    handle: u32,
    pitch: u32,
    size: u64,
}

/// `struct drm_prime_handle`.
#[repr(C)]
#[derive(Default)]
struct PrimeHandle {
    handle: u32,
    flags: u32,
    fd: i32,
}

/// `DRM_IOWR(0xB2, struct drm_mode_create_dumb)`, `DRM_IOWR(0x2d, struct drm_prime_handle)`.
const CREATE_DUMB: u64 = 0xc020_64b2;
const PRIME_HANDLE_TO_FD: u64 = 0xc00c_642d;

pub struct Buffer {
    _card: std::fs::File,
    dmabuf: OwnedFd,
    map: *mut u8,
    len: usize,
}

impl Buffer {
    /// `len` bytes (whole 4 KiB rows), exported and mapped; why not where vgem is absent.
    pub fn new(len: usize) -> Result<Self, String> {
        let card = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/dri/card0")
            .map_err(|e| format!("/dev/dri/card0: {e} (load vgem)"))?;
        let mut create = CreateDumb {
            width: 1024,
            bpp: 32,
            height: (len / 4096) as u32,
            ..CreateDumb::default()
        };
        let ioctl = |request: u64, arg: *mut libc::c_void, what: &str| {
            // SAFETY: each request's argument is the `#[repr(C)]` struct the DRM ioctl
            // reads and writes, living across the call.
            let rc = unsafe { libc::ioctl(card.as_raw_fd(), request as libc::c_ulong, arg) };
            if rc < 0 {
                return Err(format!("{what}: {}", std::io::Error::last_os_error()));
            }
            Ok(())
        };
        ioctl(
            CREATE_DUMB,
            (&raw mut create).cast(),
            "DRM_IOCTL_MODE_CREATE_DUMB",
        )?;
        let mut prime = PrimeHandle {
            handle: create.handle,
            flags: (libc::O_RDWR | libc::O_CLOEXEC) as u32,
            fd: -1,
        };
        ioctl(
            PRIME_HANDLE_TO_FD,
            (&raw mut prime).cast(),
            "DRM_IOCTL_PRIME_HANDLE_TO_FD",
        )?;
        // SAFETY: the ioctl returned a new descriptor that nothing else owns.
        let dmabuf = unsafe { OwnedFd::from_raw_fd(prime.fd) };
        // SAFETY: a fresh shared mapping of the dma-buf; the kernel picks the address.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                dmabuf.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(format!(
                "mmap of the dma-buf: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Self {
            _card: card,
            dmabuf,
            map: map.cast(),
            len,
        })
    }

    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds of the mapping, which lives as long as `self`; no DMA runs
        // while the test writes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.add(offset), data.len()) };
    }

    /// All of its bytes.
    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: as in `write`: the whole mapping, read after the DMA completed.
        unsafe { std::ptr::copy_nonoverlapping(self.map, out.as_mut_ptr(), self.len) };
        out
    }
}

impl AsFd for Buffer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.dmabuf.as_fd()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: the mapping `new` made, unmapped once.
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}
