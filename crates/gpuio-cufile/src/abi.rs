//! cuFile's C types, laid out as `cufile.h` (cuFile 1.20) lays them out. The sizes and field
//! offsets are pinned here by `const` assertions and, on the C side, by `tests/it/layout.c`
//! compiled against NVIDIA's own header with the same numbers.
#![allow(non_camel_case_types, non_snake_case, missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::{offset_of, size_of};

/// `CUfileOpError` (an `int` enum): 0 is success, the rest `CUFILEOP_BASE_ERR + n`.
pub type CUfileOpError = c_int;
pub const CUFILEOP_BASE_ERR: c_int = 5000;
pub const CU_FILE_SUCCESS: c_int = 0;
pub const CU_FILE_DRIVER_NOT_INITIALIZED: c_int = 5001;
pub const CU_FILE_DRIVER_UNSUPPORTED_LIMIT: c_int = 5003;
pub const CU_FILE_PLATFORM_NOT_SUPPORTED: c_int = 5007;
pub const CU_FILE_IO_NOT_SUPPORTED: c_int = 5008;
pub const CU_FILE_DEVICE_NOT_SUPPORTED: c_int = 5009;
pub const CU_FILE_CUDA_DRIVER_ERROR: c_int = 5011;
pub const CU_FILE_CUDA_POINTER_INVALID: c_int = 5012;
pub const CU_FILE_CUDA_POINTER_RANGE_ERROR: c_int = 5014;
pub const CU_FILE_INVALID_MAPPING_RANGE: c_int = 5017;
pub const CU_FILE_INVALID_FILE_TYPE: c_int = 5018;
pub const CU_FILE_INVALID_VALUE: c_int = 5022;
pub const CU_FILE_MEMORY_ALREADY_REGISTERED: c_int = 5023;
pub const CU_FILE_MEMORY_NOT_REGISTERED: c_int = 5024;
pub const CU_FILE_PERMISSION_DENIED: c_int = 5025;
pub const CU_FILE_DRIVER_ALREADY_OPEN: c_int = 5026;
pub const CU_FILE_HANDLE_NOT_REGISTERED: c_int = 5027;
pub const CU_FILE_HANDLE_ALREADY_REGISTERED: c_int = 5028;
pub const CU_FILE_DEVICE_NOT_FOUND: c_int = 5029;
pub const CU_FILE_INTERNAL_ERROR: c_int = 5030;
pub const CU_FILE_BATCH_FULL: c_int = 5037;
pub const CU_FILE_NOMEM_ERROR: c_int = 5043;
pub const CU_FILE_IO_ERROR: c_int = 5044;

/// `CUresult` (an `int` enum); the values cuFile reports here.
pub type CUresult = c_int;
pub const CUDA_SUCCESS: CUresult = 0;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUfileError_t {
    pub err: CUfileOpError,
    pub cu_err: CUresult,
}

/// `CUfileDriverStatusFlags_t`: the file systems and devices a driver serves; the count.
pub const CU_FILE_MAX_TARGET_TYPES: c_int = 15;
/// `CUfileDriverControlFlags_t` bits.
pub const CU_FILE_ALLOW_COMPAT_MODE: c_uint = 1;
/// `CUfileFeatureFlags_t` bits.
pub const CU_FILE_BATCH_IO_SUPPORTED: c_uint = 1;
pub const CU_FILE_STREAMS_SUPPORTED: c_uint = 2;
pub const CU_FILE_PARALLEL_IO_SUPPORTED: c_uint = 3;

/// `CUfileOpcode_t`.
pub const CUFILE_READ: c_int = 0;
pub const CUFILE_WRITE: c_int = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUfileDrvPropsNvfs {
    pub major_version: c_uint,
    pub minor_version: c_uint,
    pub poll_thresh_size: usize,
    pub max_direct_io_size: usize,
    pub dstatusflags: c_uint,
    pub dcontrolflags: c_uint,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUfileDrvProps_t {
    pub nvfs: CUfileDrvPropsNvfs,
    pub fflags: c_uint,
    pub max_device_cache_size: c_uint,
    pub per_buffer_cache_size: c_uint,
    pub max_device_pinned_mem_size: c_uint,
    pub max_batch_io_size: c_uint,
    pub max_batch_io_timeout_msecs: c_uint,
}

/// `enum CUfileFileHandleType`.
pub const CU_FILE_HANDLE_TYPE_OPAQUE_FD: c_int = 1;

#[repr(C)]
#[derive(Clone, Copy)]
pub union CUfileDescrHandle {
    pub fd: c_int,
    pub handle: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUfileDescr_t {
    pub type_: c_int,
    pub handle: CUfileDescrHandle,
    /// `const CUfileFSOps_t *`: user-space file systems, which this library does not serve.
    pub fs_ops: *const c_void,
}

pub type CUfileHandle_t = *mut c_void;
pub type CUfileBatchHandle_t = *mut c_void;
/// `CUstream`.
pub type CUstream = *mut c_void;

/// `CUfileStatus_t`.
pub type CUfileStatus_t = c_int;
pub const CUFILE_WAITING: CUfileStatus_t = 0x01;
pub const CUFILE_PENDING: CUfileStatus_t = 0x02;
pub const CUFILE_INVALID: CUfileStatus_t = 0x04;
pub const CUFILE_CANCELED: CUfileStatus_t = 0x08;
pub const CUFILE_COMPLETE: CUfileStatus_t = 0x10;
pub const CUFILE_FAILED: CUfileStatus_t = 0x40;

/// `CUfileBatchMode_t`.
pub const CUFILE_BATCH: c_int = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUfileIOParamsBatch {
    pub devPtr_base: *mut c_void,
    pub file_offset: libc::off_t,
    pub devPtr_offset: libc::off_t,
    pub size: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUfileIOParams_t {
    pub mode: c_int,
    pub batch: CUfileIOParamsBatch,
    pub fh: CUfileHandle_t,
    pub opcode: c_int,
    pub cookie: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUfileIOEvents_t {
    pub cookie: *mut c_void,
    pub status: CUfileStatus_t,
    pub ret: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUfileIOVec_t {
    pub base: *mut c_void,
    pub len: usize,
}

/// `CUFileSizeTConfigParameter_t`, `CUFileBoolConfigParameter_t`,
/// `CUFileStringConfigParameter_t`, `CUFileArrayConfigParameter_t`: `int` enums numbered from 0.
pub type ConfigParameter = c_int;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUfileOpCounter_t {
    pub ok: u64,
    pub err: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUfileStatsLevel1_t {
    pub read_ops: CUfileOpCounter_t,
    pub write_ops: CUfileOpCounter_t,
    pub hdl_register_ops: CUfileOpCounter_t,
    pub hdl_deregister_ops: CUfileOpCounter_t,
    pub buf_register_ops: CUfileOpCounter_t,
    pub buf_deregister_ops: CUfileOpCounter_t,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_bw_bytes_per_sec: u64,
    pub write_bw_bytes_per_sec: u64,
    pub read_lat_avg_us: u64,
    pub write_lat_avg_us: u64,
    pub read_ops_per_sec: u64,
    pub write_ops_per_sec: u64,
    pub read_lat_sum_us: u64,
    pub write_lat_sum_us: u64,
    pub batch_submit_ops: CUfileOpCounter_t,
    pub batch_complete_ops: CUfileOpCounter_t,
    pub batch_setup_ops: CUfileOpCounter_t,
    pub batch_cancel_ops: CUfileOpCounter_t,
    pub batch_destroy_ops: CUfileOpCounter_t,
    pub batch_enqueued_ops: CUfileOpCounter_t,
    pub batch_posix_enqueued_ops: CUfileOpCounter_t,
    pub batch_processed_ops: CUfileOpCounter_t,
    pub batch_posix_processed_ops: CUfileOpCounter_t,
    pub batch_nvfs_submit_ops: CUfileOpCounter_t,
    pub batch_p2p_submit_ops: CUfileOpCounter_t,
    pub batch_aio_submit_ops: CUfileOpCounter_t,
    pub batch_iouring_submit_ops: CUfileOpCounter_t,
    pub batch_mixed_io_submit_ops: CUfileOpCounter_t,
    pub batch_total_submit_ops: CUfileOpCounter_t,
    pub batch_read_bytes: u64,
    pub batch_write_bytes: u64,
    pub batch_read_bw_bytes: u64,
    pub batch_write_bw_bytes: u64,
    pub batch_submit_lat_avg_us: u64,
    pub batch_completion_lat_avg_us: u64,
    pub batch_submit_ops_per_sec: u64,
    pub batch_complete_ops_per_sec: u64,
    pub batch_submit_lat_sum_us: u64,
    pub batch_completion_lat_sum_us: u64,
    pub last_batch_read_bytes: u64,
    pub last_batch_write_bytes: u64,
    pub readv_ops: CUfileOpCounter_t,
    pub writev_ops: CUfileOpCounter_t,
    pub readv_bytes: u64,
    pub writev_bytes: u64,
    pub readv_bw_bytes_per_sec: u64,
    pub writev_bw_bytes_per_sec: u64,
    pub readv_lat_avg_us: u64,
    pub writev_lat_avg_us: u64,
    pub readv_ops_per_sec: u64,
    pub writev_ops_per_sec: u64,
    pub readv_lat_sum_us: u64,
    pub writev_lat_sum_us: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUfileStatsLevel2_t {
    pub basic: CUfileStatsLevel1_t,
    pub read_size_kb_hist: [u64; 32],
    pub write_size_kb_hist: [u64; 32],
}

pub const CUFILE_GPU_UUID_LEN: usize = 16;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUfilePerGpuStats_t {
    pub uuid: [c_char; CUFILE_GPU_UUID_LEN],
    pub read_bytes: u64,
    pub read_bw_bytes_per_sec: u64,
    pub read_utilization: u64,
    pub read_duration_us: u64,
    pub n_total_reads: u64,
    pub n_p2p_reads: u64,
    pub n_nvfs_reads: u64,
    pub n_posix_reads: u64,
    pub n_unaligned_reads: u64,
    pub n_dr_reads: u64,
    pub n_sparse_regions: u64,
    pub n_inline_regions: u64,
    pub n_reads_err: u64,
    pub writes_bytes: u64,
    pub write_bw_bytes_per_sec: u64,
    pub write_utilization: u64,
    pub write_duration_us: u64,
    pub n_total_writes: u64,
    pub n_p2p_writes: u64,
    pub n_nvfs_writes: u64,
    pub n_posix_writes: u64,
    pub n_unaligned_writes: u64,
    pub n_dr_writes: u64,
    pub n_writes_err: u64,
    pub n_mmap: u64,
    pub n_mmap_ok: u64,
    pub n_mmap_err: u64,
    pub n_mmap_free: u64,
    pub reg_bytes: u64,
}

/// The per-GPU entries of level 3 statistics.
pub const STATS_MAX_GPUS: usize = 16;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUfileStatsLevel3_t {
    pub detailed: CUfileStatsLevel2_t,
    pub num_gpus: u32,
    pub per_gpu_stats: [CUfilePerGpuStats_t; STATS_MAX_GPUS],
}

impl Default for CUfileStatsLevel3_t {
    fn default() -> Self {
        Self {
            detailed: CUfileStatsLevel2_t::default(),
            num_gpus: 0,
            per_gpu_stats: [CUfilePerGpuStats_t::default(); STATS_MAX_GPUS],
        }
    }
}

/// Every size and offset `tests/it/layout.c` checks against NVIDIA's header, by C name.
pub const LAYOUT: &[(&str, usize)] = &[
    ("sizeof(CUfileError_t)", size_of::<CUfileError_t>()),
    ("sizeof(CUfileDrvProps_t)", size_of::<CUfileDrvProps_t>()),
    (
        "offsetof(CUfileDrvProps_t, fflags)",
        offset_of!(CUfileDrvProps_t, fflags),
    ),
    (
        "offsetof(CUfileDrvProps_t, max_batch_io_timeout_msecs)",
        offset_of!(CUfileDrvProps_t, max_batch_io_timeout_msecs),
    ),
    ("sizeof(CUfileDescr_t)", size_of::<CUfileDescr_t>()),
    (
        "offsetof(CUfileDescr_t, handle)",
        offset_of!(CUfileDescr_t, handle),
    ),
    (
        "offsetof(CUfileDescr_t, fs_ops)",
        offset_of!(CUfileDescr_t, fs_ops),
    ),
    ("sizeof(CUfileIOParams_t)", size_of::<CUfileIOParams_t>()),
    (
        "offsetof(CUfileIOParams_t, u.batch.size)",
        offset_of!(CUfileIOParams_t, batch) + offset_of!(CUfileIOParamsBatch, size),
    ),
    (
        "offsetof(CUfileIOParams_t, fh)",
        offset_of!(CUfileIOParams_t, fh),
    ),
    (
        "offsetof(CUfileIOParams_t, opcode)",
        offset_of!(CUfileIOParams_t, opcode),
    ),
    (
        "offsetof(CUfileIOParams_t, cookie)",
        offset_of!(CUfileIOParams_t, cookie),
    ),
    ("sizeof(CUfileIOEvents_t)", size_of::<CUfileIOEvents_t>()),
    (
        "offsetof(CUfileIOEvents_t, ret)",
        offset_of!(CUfileIOEvents_t, ret),
    ),
    ("sizeof(CUfileIOVec_t)", size_of::<CUfileIOVec_t>()),
    (
        "sizeof(CUfileStatsLevel1_t)",
        size_of::<CUfileStatsLevel1_t>(),
    ),
    (
        "offsetof(CUfileStatsLevel1_t, batch_submit_ops)",
        offset_of!(CUfileStatsLevel1_t, batch_submit_ops),
    ),
    (
        "offsetof(CUfileStatsLevel1_t, readv_ops)",
        offset_of!(CUfileStatsLevel1_t, readv_ops),
    ),
    (
        "sizeof(CUfileStatsLevel2_t)",
        size_of::<CUfileStatsLevel2_t>(),
    ),
    (
        "sizeof(CUfilePerGpuStats_t)",
        size_of::<CUfilePerGpuStats_t>(),
    ),
    (
        "offsetof(CUfilePerGpuStats_t, writes_bytes)",
        offset_of!(CUfilePerGpuStats_t, writes_bytes),
    ),
    (
        "sizeof(CUfileStatsLevel3_t)",
        size_of::<CUfileStatsLevel3_t>(),
    ),
    (
        "offsetof(CUfileStatsLevel3_t, per_gpu_stats)",
        offset_of!(CUfileStatsLevel3_t, per_gpu_stats),
    ),
];

// The same numbers, worked out from cufile.h by hand: a field added or moved here fails the
// build before any C compiler is involved.
const _: () = {
    assert!(size_of::<CUfileError_t>() == 8);
    assert!(size_of::<CUfileDrvProps_t>() == 56);
    assert!(size_of::<CUfileDescr_t>() == 24);
    assert!(size_of::<CUfileIOParams_t>() == 64);
    assert!(offset_of!(CUfileIOParams_t, fh) == 40);
    assert!(size_of::<CUfileIOEvents_t>() == 24);
    assert!(size_of::<CUfileIOVec_t>() == 16);
    assert!(size_of::<CUfileStatsLevel1_t>() == 624);
    assert!(size_of::<CUfileStatsLevel2_t>() == 1136);
    assert!(size_of::<CUfilePerGpuStats_t>() == 248);
    assert!(size_of::<CUfileStatsLevel3_t>() == 5112);
};
