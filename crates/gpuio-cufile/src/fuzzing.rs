//! Sequences of cuFile calls with arguments a fuzzer chooses, made through the exported C
//! functions exactly as a C program makes them (feature `fuzzing`; the `cufile` target of
//! `fuzz/`). Handles, batch ids, offsets, sizes, parameters and batch entries are the
//! fuzzer's; host memory is the runner's own buffers, passed only where cuFile's contract
//! holds (in bounds, or refused before any byte is touched: a negative offset).
//!
//! What must hold: no call reports `CU_FILE_INTERNAL_ERROR` (a panic inside); a read of the
//! runner's data file that reports `n` bytes put the file's bytes there; a batch never hands
//! over more events than were submitted.

use crate::abi::{self, CUfileDescr_t, CUfileHandle_t, CUfileIOEvents_t, CUfileIOParams_t};
use crate::exports::*;
use arbitrary::Arbitrary;
use std::ffi::{CString, c_void};
use std::os::fd::AsRawFd;

/// Bytes in each of the runner's buffers and in its data file.
pub const BUF: usize = 16 << 10;

/// One call (each variant named after the cuFile call it makes, its fields after the call's
/// arguments).
#[allow(missing_docs)]
#[derive(Arbitrary, Debug, Clone)]
pub enum Op {
    Open,
    Close,
    SetSize {
        param: i32,
        value: usize,
    },
    SetBool {
        param: i32,
        value: bool,
    },
    SetString {
        param: i32,
        value: String,
    },
    GetString {
        param: i32,
        len: i32,
    },
    GetSize {
        param: i32,
    },
    /// Registers one of the runner's descriptors: 0 the data file (read-only), 1 the scratch
    /// file (read-write), 2 a pipe, 3 a closed descriptor, else a negative number (never a
    /// descriptor of the process the runner does not own: the fuzzer's files stay untouched).
    Register {
        fd: i32,
    },
    Deregister {
        handle: Handle,
    },
    Io {
        write: bool,
        handle: Handle,
        buf: Buf,
        size: u32,
        file_offset: i64,
    },
    Readv {
        handle: Handle,
        iov: Vec<(u8, u16)>,
        file_offset: i64,
        flags: u32,
    },
    BufRegister {
        buf: u8,
        len: u32,
    },
    BufDeregister {
        buf: u8,
        shift: u16,
    },
    Async {
        write: bool,
        handle: Handle,
        buf: Buf,
        size: u32,
        file_offset: i64,
    },
    BatchSetUp {
        nr: u32,
    },
    BatchSubmit {
        batch: u8,
        entries: Vec<Entry>,
        flags: u32,
    },
    BatchStatus {
        batch: u8,
        min_nr: u32,
        room: u8,
        wait: bool,
    },
    BatchCancel {
        batch: u8,
    },
    BatchDestroy {
        batch: u8,
    },
    Stats {
        level: i32,
        start: bool,
    },
}

/// A handle: one the runner registered (by index), or any value at all.
#[allow(missing_docs)]
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Handle {
    Registered(u8),
    Raw(u64),
}

/// Where in the runner's buffers an IO lands: buffer, offset (negative ones are refused).
#[allow(missing_docs)]
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Buf {
    pub index: u8,
    pub offset: i64,
}

/// A batch entry (`CUfileIOParams_t`'s fields).
#[allow(missing_docs)]
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Entry {
    pub opcode: i32,
    pub mode: i32,
    pub handle: Handle,
    pub buf: Buf,
    pub size: u32,
    pub file_offset: i64,
}

struct Runner {
    files: &'static Files,
    closed: i32,
    bufs: Vec<Vec<u8>>,
    handles: Vec<CUfileHandle_t>,
    batches: Vec<(CUfileBatchHandle, usize)>,
}

type CUfileBatchHandle = abi::CUfileBatchHandle_t;

fn fails_inside(err: i32) -> bool {
    err == abi::CU_FILE_INTERNAL_ERROR
}

/// The descriptors a runner registers, made once per process (the fuzzer runs one input after
/// another in one process): creating and removing files per input cost more than the calls.
/// The files live in memory where /dev/shm is a tmpfs, and are unlinked once open.
struct Files {
    data: std::fs::File,
    scratch: std::fs::File,
    pipe: (std::io::PipeReader, std::io::PipeWriter),
    content: Vec<u8>,
}

impl Files {
    fn get() -> &'static Files {
        static FILES: std::sync::OnceLock<Files> = std::sync::OnceLock::new();
        FILES.get_or_init(|| {
            let shm = std::path::Path::new("/dev/shm");
            let base = if shm.is_dir() {
                shm.to_path_buf()
            } else {
                std::env::temp_dir()
            };
            let dir = base.join(format!("gpuio-cufile-fuzz-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("scratch dir");
            let content: Vec<u8> = (0..BUF as u32)
                .map(|i| ((i * 131) ^ (i >> 7)) as u8)
                .collect();
            let data_path = dir.join("data");
            std::fs::write(&data_path, &content).expect("data file");
            let data = std::fs::File::open(&data_path).expect("data file");
            let scratch = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.join("scratch"))
                .expect("scratch file");
            // Unlinked now: the descriptors keep the files, and nothing is left behind.
            let _ = std::fs::remove_dir_all(&dir);
            Files {
                data,
                scratch,
                pipe: std::io::pipe().expect("pipe"),
                content,
            }
        })
    }
}

impl Runner {
    fn new() -> Self {
        let files = Files::get();
        // Each input starts from an empty scratch file.
        files.scratch.set_len(0).expect("scratch file");
        Self {
            files,
            closed: i32::MAX - 7,
            bufs: vec![vec![0; BUF]; 4],
            handles: Vec::new(),
            batches: Vec::new(),
        }
    }

    fn handle(&self, h: Handle) -> CUfileHandle_t {
        match h {
            Handle::Registered(i) if !self.handles.is_empty() => {
                self.handles[i as usize % self.handles.len()]
            }
            Handle::Registered(_) => std::ptr::null_mut(),
            Handle::Raw(v) => v as usize as CUfileHandle_t,
        }
    }

    /// The buffer address and offset to pass, or None where the range would leave the buffer
    /// (outside cuFile's contract for host memory).
    fn place(&mut self, b: Buf, size: usize) -> Option<(*mut c_void, i64)> {
        let buf = &mut self.bufs[b.index as usize % 4];
        let fits = b.offset < 0 || (b.offset as usize).saturating_add(size) <= BUF;
        fits.then(|| (buf.as_mut_ptr().cast(), b.offset))
    }

    fn check_read(&self, b: Buf, file_offset: i64, n: isize) {
        if n <= 0 || file_offset < 0 {
            return;
        }
        let (at, n) = (file_offset as usize, n as usize);
        let got = &self.bufs[b.index as usize % 4][b.offset as usize..][..n];
        assert_eq!(
            got,
            &self.files.content[at..at + n],
            "read {n} bytes at {at}"
        );
    }

    fn op(&mut self, op: Op) {
        match op {
            Op::Open => assert!(!fails_inside(cuFileDriverOpen().err)),
            Op::Close => assert!(!fails_inside(cuFileDriverClose_v2().err)),
            Op::SetSize { param, value } => {
                assert!(!fails_inside(cuFileSetParameterSizeT(param, value).err))
            }
            Op::SetBool { param, value } => {
                assert!(!fails_inside(cuFileSetParameterBool(param, value).err))
            }
            Op::SetString { param, value } => {
                let Ok(c) = CString::new(value) else { return };
                // SAFETY: a NUL-terminated string that outlives the call.
                let s = unsafe { cuFileSetParameterString(param, c.as_ptr()) };
                assert!(!fails_inside(s.err));
            }
            Op::GetString { param, len } => {
                let mut out = [0 as std::ffi::c_char; 64];
                let len = len.clamp(i32::MIN, out.len() as i32);
                // SAFETY: `out` has room for `len` bytes (clamped to its size).
                let s = unsafe { cuFileGetParameterString(param, out.as_mut_ptr(), len) };
                assert!(!fails_inside(s.err));
            }
            Op::GetSize { param } => {
                let (mut v, mut lo, mut hi) = (0usize, 0usize, 0usize);
                // SAFETY: live out-pointers.
                let s = unsafe { cuFileGetParameterSizeT(param, &mut v) };
                // SAFETY: as above.
                let r = unsafe { cuFileGetParameterMinMaxValue(param, &mut lo, &mut hi) };
                assert!(!fails_inside(s.err) && !fails_inside(r.err));
                assert!(
                    s.err != 0 || r.err != 0 || (lo <= v && v <= hi),
                    "{v} in {lo}..={hi}"
                );
            }
            Op::Register { fd } => {
                let fd = match fd {
                    0 => self.files.data.as_raw_fd(),
                    1 => self.files.scratch.as_raw_fd(),
                    2 => self.files.pipe.0.as_raw_fd(),
                    3 => self.closed,
                    n => -1 - (n & 7),
                };
                // SAFETY: all-zero is a valid CUfileDescr_t (an int, a union, a null pointer).
                let mut d: CUfileDescr_t = unsafe { std::mem::zeroed() };
                d.type_ = abi::CU_FILE_HANDLE_TYPE_OPAQUE_FD;
                d.handle.fd = fd;
                let mut fh = std::ptr::null_mut();
                // SAFETY: live pointers to a descriptor and an out-handle.
                let s = unsafe { cuFileHandleRegister(&mut fh, &mut d) };
                assert!(!fails_inside(s.err));
                if s.err == 0 && self.handles.len() < 16 {
                    self.handles.push(fh);
                }
            }
            Op::Deregister { handle } => cuFileHandleDeregister(self.handle(handle)),
            Op::Io {
                write,
                handle,
                buf,
                size,
                file_offset,
            } => {
                let size = size as usize % (2 * BUF);
                let fh = self.handle(handle);
                let Some((p, off)) = self.place(buf, size) else {
                    return;
                };
                let n = if write {
                    // SAFETY: the runner's buffer, in bounds (place) or refused (negative).
                    unsafe { cuFileWrite(fh, p, size, file_offset, off) }
                } else {
                    // SAFETY: as above.
                    unsafe { cuFileRead(fh, p, size, file_offset, off) }
                };
                assert!(n != -(abi::CU_FILE_INTERNAL_ERROR as isize));
                assert!(n <= size as isize, "{n} bytes of {size}");
                let data = self.handles.first().is_some_and(|h| *h == fh);
                if !write && data {
                    self.check_read(buf, file_offset, n);
                }
            }
            Op::Readv {
                handle,
                iov,
                file_offset,
                flags,
            } => {
                let fh = self.handle(handle);
                let v: Vec<abi::CUfileIOVec_t> = iov
                    .iter()
                    .take(8)
                    .map(|&(b, len)| abi::CUfileIOVec_t {
                        base: self.bufs[b as usize % 4].as_mut_ptr().cast(),
                        len: len as usize % BUF,
                    })
                    .collect();
                // SAFETY: every vector lies in one of the runner's buffers.
                let n = unsafe { cuFileReadv(fh, v.as_ptr(), v.len(), file_offset, flags) };
                assert!(n != -(abi::CU_FILE_INTERNAL_ERROR as isize));
            }
            Op::BufRegister { buf, len } => {
                let p = self.bufs[buf as usize % 4].as_ptr().cast();
                let s = cuFileBufRegister(p, len as usize % (BUF + 1), 0);
                assert!(!fails_inside(s.err));
            }
            Op::BufDeregister { buf, shift } => {
                let p = self.bufs[buf as usize % 4]
                    .as_ptr()
                    .wrapping_add(shift as usize % 3);
                assert!(!fails_inside(cuFileBufDeregister(p.cast()).err));
            }
            Op::Async {
                write,
                handle,
                buf,
                size,
                file_offset,
            } => {
                let mut size = size as usize % (2 * BUF);
                let fh = self.handle(handle);
                let Some((p, mut off)) = self.place(buf, size) else {
                    return;
                };
                let (mut at, mut done) = (file_offset, 0isize);
                let s = if write {
                    // SAFETY: live pointers; the buffer as for `Io`; the null stream.
                    unsafe {
                        cuFileWriteAsync(
                            fh,
                            p,
                            &mut size,
                            &mut at,
                            &mut off,
                            &mut done,
                            std::ptr::null_mut(),
                        )
                    }
                } else {
                    // SAFETY: as above.
                    unsafe {
                        cuFileReadAsync(
                            fh,
                            p,
                            &mut size,
                            &mut at,
                            &mut off,
                            &mut done,
                            std::ptr::null_mut(),
                        )
                    }
                };
                assert!(!fails_inside(s.err));
            }
            Op::BatchSetUp { nr } => {
                let mut b = std::ptr::null_mut();
                // SAFETY: a live out-pointer.
                let s = unsafe { cuFileBatchIOSetUp(&mut b, nr % 300) };
                assert!(!fails_inside(s.err));
                if s.err == 0 {
                    self.batches.push((b, 0));
                }
            }
            Op::BatchSubmit {
                batch,
                entries,
                flags,
            } => {
                let Some(&(b, _)) = self.batches.get(batch as usize % self.batches.len().max(1))
                else {
                    return;
                };
                let mut params = Vec::new();
                for e in entries.iter().take(300) {
                    let size = e.size as usize % (2 * BUF);
                    let Some((p, off)) = self.place(e.buf, size) else {
                        continue;
                    };
                    params.push(CUfileIOParams_t {
                        mode: e.mode,
                        batch: abi::CUfileIOParamsBatch {
                            devPtr_base: p,
                            file_offset: e.file_offset,
                            devPtr_offset: off,
                            size,
                        },
                        fh: self.handle(e.handle),
                        opcode: e.opcode,
                        cookie: std::ptr::null_mut(),
                    });
                }
                // SAFETY: `params.len()` live entries, each over the runner's buffers.
                let s = unsafe {
                    cuFileBatchIOSubmit(b, params.len() as u32, params.as_mut_ptr(), flags)
                };
                assert!(!fails_inside(s.err));
                if s.err == 0 {
                    let i = batch as usize % self.batches.len();
                    self.batches[i].1 += params.len();
                }
            }
            Op::BatchStatus {
                batch,
                min_nr,
                room,
                wait,
            } => {
                let Some(&(b, submitted)) =
                    self.batches.get(batch as usize % self.batches.len().max(1))
                else {
                    return;
                };
                let mut events = vec![
                    CUfileIOEvents_t {
                        cookie: std::ptr::null_mut(),
                        status: 0,
                        ret: 0,
                    };
                    room as usize
                ];
                let mut nr = room as u32;
                let zero = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                let timeout = if wait {
                    std::ptr::null()
                } else {
                    &zero as *const _
                };
                // SAFETY: room for `nr` events; live pointers.
                let s = unsafe {
                    cuFileBatchIOGetStatus(b, min_nr % 8, &mut nr, events.as_mut_ptr(), timeout)
                };
                assert!(!fails_inside(s.err));
                if s.err == 0 {
                    assert!(nr as usize <= submitted && nr <= room as u32);
                    let i = batch as usize % self.batches.len();
                    self.batches[i].1 -= nr as usize;
                }
            }
            Op::BatchCancel { batch } => {
                if let Some(&(b, _)) = self.batches.get(batch as usize % self.batches.len().max(1))
                {
                    assert!(!fails_inside(cuFileBatchIOCancel(b).err));
                }
            }
            Op::BatchDestroy { batch } => {
                if !self.batches.is_empty() {
                    let (b, _) = self.batches.remove(batch as usize % self.batches.len());
                    cuFileBatchIODestroy(b);
                }
            }
            Op::Stats { level, start } => {
                assert!(!fails_inside(cuFileSetStatsLevel(level).err));
                if start {
                    assert!(!fails_inside(cuFileStatsStart().err));
                }
                let mut s1 = abi::CUfileStatsLevel1_t::default();
                // SAFETY: a live out-pointer.
                assert!(!fails_inside(unsafe { cuFileGetStatsL1(&mut s1) }.err));
            }
        }
    }

    /// Leaves nothing behind for the next input: batches destroyed (their IO waited for),
    /// handles deregistered, the driver closed.
    fn finish(&mut self) {
        for (b, _) in self.batches.drain(..) {
            cuFileBatchIODestroy(b);
        }
        for h in self.handles.drain(..) {
            cuFileHandleDeregister(h);
        }
        while cuFileUseCount() > 0 {
            cuFileDriverClose_v2();
        }
        // Parameters back to their defaults, for the next input.
        crate::driver::DRIVER
            .set_params(|p| {
                *p = crate::params::Params::default();
                Ok(())
            })
            .expect("the driver is closed");
    }
}

/// Runs `ops` (at most 64) against the library; panics where a property fails.
pub fn run(ops: &[Op]) {
    let mut r = Runner::new();
    // The data file is handle 0, so reads of it can be checked.
    r.op(Op::Register { fd: 0 });
    for op in ops.iter().take(64) {
        r.op(op.clone());
    }
    r.finish();
}
