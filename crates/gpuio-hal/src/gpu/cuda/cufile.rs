//! cuFile (GPUDirect Storage), loaded at run time.
//!
//! Not through cudarc's `cufile` module: its loader does not try `libcufile.so.0` (the soname
//! the CUDA toolkit and the `nvidia-cufile` wheel ship) and panics where the library is
//! missing, and its status enums would be undefined behaviour for a code a newer library
//! adds. gpuio needs six entry points; they are resolved here with `dlopen`/`dlsym`, checked
//! before use, and every status is read as a plain integer.

use crate::error::{ErrorCode, HalError, Result};
use crate::gpu::GdsMode;
use std::ffi::{CStr, CString, c_int, c_void};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

/// `CUfileError_t`: a cuFile status and, for `CU_FILE_CUDA_DRIVER_ERROR`, the driver's.
#[repr(C)]
#[derive(Clone, Copy)]
struct Status {
    err: c_int,
    cu_err: c_int,
}

/// `CUfileDescr_t` for a Linux file descriptor.
#[repr(C)]
struct Descr {
    kind: c_int,
    /// The `fd` member of a union with a pointer: an int padded to the pointer's size.
    handle: FdOrPtr,
    fs_ops: *const c_void,
}

#[repr(C)]
union FdOrPtr {
    fd: c_int,
    ptr: *mut c_void,
}

const HANDLE_TYPE_OPAQUE_FD: c_int = 1;

type DriverOpen = unsafe extern "C" fn() -> Status;
type HandleRegister = unsafe extern "C" fn(*mut *mut c_void, *mut Descr) -> Status;
type HandleDeregister = unsafe extern "C" fn(*mut c_void);
type Read = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i64, i64) -> isize;
type Write = unsafe extern "C" fn(*mut c_void, *const c_void, usize, i64, i64) -> isize;
type GetVersion = unsafe extern "C" fn(*mut c_int) -> Status;

/// The library, its entry points, and the driver opened once for the process (cuFile closes
/// it at exit).
struct Library {
    name: String,
    register: HandleRegister,
    deregister: HandleDeregister,
    read: Read,
    write: Write,
    mode: GdsMode,
    version: Option<i32>,
}

/// The symbol only gpuio's `libcufile.so.0` exports.
pub(crate) const GPUIO_MARKER: &str = "gpuio_cufile_version";

/// Candidate names: an explicit path first, then the soname, then the development link.
pub(crate) fn candidates() -> Vec<String> {
    let mut names: Vec<String> = std::env::var("GPUIO_CUFILE_LIB").into_iter().collect();
    names.extend(["libcufile.so.0".into(), "libcufile.so".into()]);
    names
}

fn library() -> std::result::Result<&'static Library, String> {
    static LIB: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> std::result::Result<Library, String> {
    let names = candidates();
    let Some((name, handle)) = names.iter().find_map(|n| {
        let c = CString::new(n.as_str()).ok()?;
        // SAFETY: dlopen of a vendor library by name. The handle is never closed: the
        // function pointers taken from it live for the rest of the process.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        (!h.is_null()).then(|| (n.clone(), h))
    }) else {
        return Err(format!(
            "libcufile not found (tried {}: {}; set GPUIO_CUFILE_LIB to its path)",
            names.join(", "),
            last_dl_error().unwrap_or_default()
        ));
    };
    let sym = |s: &str| -> std::result::Result<*mut c_void, String> {
        let c = CString::new(s).map_err(|e| e.to_string())?;
        // SAFETY: looks a symbol up in a live handle; nothing is called.
        let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
        if p.is_null() {
            Err(format!("{name} does not export {s} (too old for gpuio)"))
        } else {
            Ok(p)
        }
    };
    if sym(GPUIO_MARKER).is_ok() {
        // gpuio's own libcufile.so.0 (gpuio-cufile) serves cuFile with this very engine:
        // taking it here would send every transfer round in a circle.
        return Err(format!(
            "{name} is gpuio's own cuFile library (gpuio-cufile), not NVIDIA's: gpuio moves \
             these transfers itself"
        ));
    }
    let entry_points = (
        sym("cuFileDriverOpen")?,
        sym("cuFileHandleRegister")?,
        sym("cuFileHandleDeregister")?,
        sym("cuFileRead")?,
        sym("cuFileWrite")?,
    );
    // SAFETY: each pointer is the cuFile entry point of that name, whose C signature
    // (cufile.h, CUDA 12.3 and later) the target type spells out.
    let (open, register, deregister, read, write) = unsafe {
        use std::mem::transmute;
        (
            transmute::<*mut c_void, DriverOpen>(entry_points.0),
            transmute::<*mut c_void, HandleRegister>(entry_points.1),
            transmute::<*mut c_void, HandleDeregister>(entry_points.2),
            transmute::<*mut c_void, Read>(entry_points.3),
            transmute::<*mut c_void, Write>(entry_points.4),
        )
    };
    let version = sym("cuFileGetVersion").ok().and_then(|p| {
        // SAFETY: the entry point of that name, `CUfileError_t cuFileGetVersion(int *)`.
        let get = unsafe { std::mem::transmute::<*mut c_void, GetVersion>(p) };
        let mut v = 0;
        // SAFETY: `v` is a live int for the call.
        (unsafe { get(&mut v) }.err == 0).then_some(v)
    });
    // SAFETY: takes no arguments; opening an already open driver is reported, not undefined.
    let status = unsafe { open() };
    if status.err != 0 {
        return Err(format!(
            "cuFileDriverOpen failed: {} (without the nvidia-fs driver cuFile needs \
             \"allow_compat_mode\": true in cufile.json)",
            describe(status)
        ));
    }
    let mode = if super::probe::nvidia_fs_loaded() {
        GdsMode::Native
    } else {
        GdsMode::Compat
    };
    Ok(Library {
        name,
        register,
        deregister,
        read,
        write,
        mode,
        version,
    })
}

/// cuFile's mode on this machine, with the library and version, or why it cannot run.
pub(crate) fn open() -> Result<(GdsMode, String)> {
    let lib = library().map_err(|reason| HalError::Unsupported {
        what: "GPUDirect Storage (cuFile)",
        reason,
    })?;
    let version = lib
        .version
        .map(|v| format!(" {}.{}", v / 1000, v % 1000 / 10))
        .unwrap_or_default();
    Ok((lib.mode, format!("{}{version}", lib.name)))
}

/// A file registered with cuFile; deregistered on drop. The registration refers to the
/// descriptor, so the file is kept open here for as long.
pub(crate) struct FileRegistration {
    lib: &'static Library,
    handle: *mut c_void,
    _file: std::sync::Arc<File>,
}

// SAFETY: a cuFile handle is an opaque token the library locks internally; cuFile documents
// concurrent IO on one handle from many threads.
unsafe impl Send for FileRegistration {}
// SAFETY: as above.
unsafe impl Sync for FileRegistration {}

impl FileRegistration {
    pub(crate) fn new(file: std::sync::Arc<File>) -> Result<Self> {
        let lib = library().map_err(|reason| HalError::Unsupported {
            what: "GPUDirect Storage (cuFile)",
            reason,
        })?;
        let mut descr = Descr {
            kind: HANDLE_TYPE_OPAQUE_FD,
            handle: FdOrPtr {
                ptr: std::ptr::null_mut(),
            },
            fs_ops: std::ptr::null(),
        };
        descr.handle.fd = file.as_raw_fd();
        let mut handle = std::ptr::null_mut();
        // SAFETY: `descr` is a valid descriptor of an open fd (kept open by `_file` for the
        // registration's life); cuFile writes the handle through the pointer.
        let status = unsafe { (lib.register)(&mut handle, &mut descr) };
        if status.err != 0 {
            return Err(HalError::Unsupported {
                what: "cuFile on this file",
                reason: format!(
                    "cuFileHandleRegister: {}; cufile.log says why (in containers, often \
                     the file system's udev properties are missing)",
                    describe(status)
                ),
            });
        }
        Ok(Self {
            lib,
            handle,
            _file: file,
        })
    }

    /// Reads `len` bytes at `offset` into device memory at `dst`; the count, short only at
    /// end of file.
    ///
    /// # Safety
    /// `dst..dst+len` must be device memory of the bound context, alive for the call.
    pub(crate) unsafe fn read(&self, dst: u64, len: usize, offset: u64) -> Result<usize> {
        whole("cuFileRead", len, |done| {
            let at = (dst + done as u64) as *mut c_void;
            // SAFETY: the caller guarantees the device range; the handle is registered.
            unsafe {
                (self.lib.read)(
                    self.handle,
                    at,
                    len - done,
                    (offset + done as u64) as i64,
                    0,
                )
            }
        })
    }

    /// Writes `len` bytes of device memory at `src` to the file at `offset`; the count
    /// written (short only when the device filled up). An error may follow a partial write:
    /// callers count only what they were told was written.
    ///
    /// # Safety
    /// `src..src+len` must be device memory of the bound context, alive for the call.
    pub(crate) unsafe fn write(&self, src: u64, len: usize, offset: u64) -> Result<usize> {
        whole("cuFileWrite", len, |done| {
            let at = (src + done as u64) as *const c_void;
            // SAFETY: the caller guarantees the device range; the handle is registered.
            unsafe {
                (self.lib.write)(
                    self.handle,
                    at,
                    len - done,
                    (offset + done as u64) as i64,
                    0,
                )
            }
        })
    }
}

/// Calls `io(done)` — one cuFile call for the rest of a `len`-byte range — until the range is
/// done or a call moves nothing; the count moved.
fn whole(op: &'static str, len: usize, mut io: impl FnMut(usize) -> isize) -> Result<usize> {
    let mut done = 0usize;
    while done < len {
        match io(done) {
            0 => break,
            n if n > 0 => done += n as usize,
            n => return Err(io_err(op, n)),
        }
    }
    Ok(done)
}

impl Drop for FileRegistration {
    fn drop(&mut self) {
        if super::probe::driver_forked() {
            return;
        }
        // SAFETY: the handle was registered once and is deregistered once; no IO on it can be
        // running (IO borrows the registration).
        unsafe { (self.lib.deregister)(self.handle) }
    }
}

/// A negative IO return: -1 is an OS error in `errno`, below that a cuFile status.
fn io_err(op: &'static str, n: isize) -> HalError {
    if n == -1 {
        HalError::Os {
            op,
            source: std::io::Error::last_os_error(),
        }
    } else {
        cufile_err(op, -n, Status { err: 0, cu_err: 0 })
    }
}

fn cufile_err(op: &'static str, code: isize, status: Status) -> HalError {
    let name = name(code as i64).map_or_else(|| format!("CU_FILE_ERROR_{code}"), Into::into);
    let code_class = match code {
        5008 | 5009 | 5007 | 5034 | 5038 => ErrorCode::Unsupported,
        5012..=5019 | 5022 | 5027 => ErrorCode::InvalidArg,
        5025 => ErrorCode::Permission,
        _ => ErrorCode::Io,
    };
    HalError::Cuda {
        op,
        message: if status.cu_err != 0 {
            format!("cuFile status {code}, CUDA driver error {}", status.cu_err)
        } else {
            format!("cuFile status {code}")
        },
        name,
        code: code_class,
    }
}

fn describe(status: Status) -> String {
    let code = status.err as i64;
    let name = name(code).unwrap_or("unknown status");
    format!("{name} ({code})")
}

/// The `CUfileOpError` names (cufile.h).
fn name(code: i64) -> Option<&'static str> {
    Some(match code {
        5001 => "CU_FILE_DRIVER_NOT_INITIALIZED",
        5002 => "CU_FILE_DRIVER_INVALID_PROPS",
        5003 => "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
        5004 => "CU_FILE_DRIVER_VERSION_MISMATCH",
        5005 => "CU_FILE_DRIVER_VERSION_READ_ERROR",
        5006 => "CU_FILE_DRIVER_CLOSING",
        5007 => "CU_FILE_PLATFORM_NOT_SUPPORTED",
        5008 => "CU_FILE_IO_NOT_SUPPORTED",
        5009 => "CU_FILE_DEVICE_NOT_SUPPORTED",
        5010 => "CU_FILE_NVFS_DRIVER_ERROR",
        5011 => "CU_FILE_CUDA_DRIVER_ERROR",
        5012 => "CU_FILE_CUDA_POINTER_INVALID",
        5013 => "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
        5014 => "CU_FILE_CUDA_POINTER_RANGE_ERROR",
        5015 => "CU_FILE_CUDA_CONTEXT_MISMATCH",
        5016 => "CU_FILE_INVALID_MAPPING_SIZE",
        5017 => "CU_FILE_INVALID_MAPPING_RANGE",
        5018 => "CU_FILE_INVALID_FILE_TYPE",
        5019 => "CU_FILE_INVALID_FILE_OPEN_FLAG",
        5020 => "CU_FILE_DIO_NOT_SET",
        5022 => "CU_FILE_INVALID_VALUE",
        5023 => "CU_FILE_MEMORY_ALREADY_REGISTERED",
        5024 => "CU_FILE_MEMORY_NOT_REGISTERED",
        5025 => "CU_FILE_PERMISSION_DENIED",
        5026 => "CU_FILE_DRIVER_ALREADY_OPEN",
        5027 => "CU_FILE_HANDLE_NOT_REGISTERED",
        5028 => "CU_FILE_HANDLE_ALREADY_REGISTERED",
        5029 => "CU_FILE_DEVICE_NOT_FOUND",
        5030 => "CU_FILE_INTERNAL_ERROR",
        5031 => "CU_FILE_GETNEWFD_FAILED",
        5033 => "CU_FILE_NVFS_SETUP_ERROR",
        5034 => "CU_FILE_IO_DISABLED",
        5035 => "CU_FILE_BATCH_SUBMIT_FAILED",
        5036 => "CU_FILE_GPU_MEMORY_PINNING_FAILED",
        5037 => "CU_FILE_BATCH_FULL",
        5038 => "CU_FILE_ASYNC_NOT_SUPPORTED",
        _ => return None,
    })
}

/// Why the last `dlopen` failed.
fn last_dl_error() -> Option<String> {
    // SAFETY: dlerror returns a thread-local string or null.
    let p = unsafe { libc::dlerror() };
    // SAFETY: non-null dlerror results are NUL-terminated strings.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
