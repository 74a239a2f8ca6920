//! cuFile's parameters (`cuFileGetParameter*`/`cuFileSetParameter*`, the `cufile.json` keys):
//! every one is kept and reported, and set only while the driver is closed, as cuFile
//! requires. The ones that mean something to gpuio are honoured (see [`Params`]); the rest
//! describe nvidia-fs or cuFile's own thread pool, which this library does not have.

use crate::abi::{self, ConfigParameter};
use crate::fault::{Fault, Result};

/// `CUFileSizeTConfigParameter_t`, in order: default, least, most.
const SIZE_T: [(usize, usize, usize); 12] = [
    (0, 0, 3),                          // PROFILE_STATS: the statistics level
    (128, 1, 65_536),                   // EXECUTION_MAX_IO_QUEUE_DEPTH
    (4, 1, 256),                        // EXECUTION_MAX_IO_THREADS: batch IO threads
    (8192, 0, 1 << 30),                 // EXECUTION_MIN_IO_THRESHOLD_SIZE_KB
    (4, 1, 256),                        // EXECUTION_MAX_REQUEST_PARALLELISM
    (16_384, 4, 1 << 30),               // PROPERTIES_MAX_DIRECT_IO_SIZE_KB
    (131_072, 0, 1 << 30),              // PROPERTIES_MAX_DEVICE_CACHE_SIZE_KB
    (1024, 4, 1 << 30),                 // PROPERTIES_PER_BUFFER_CACHE_SIZE_KB
    (33_554_432, 0, u32::MAX as usize), // PROPERTIES_MAX_DEVICE_PINNED_MEM_SIZE_KB
    (128, 1, 4096),                     // PROPERTIES_IO_BATCHSIZE: entries per batch
    (4, 0, 1 << 30),                    // POLLTHRESHOLD_SIZE_KB
    (5, 0, 1 << 30),                    // PROPERTIES_BATCH_IO_TIMEOUT_MS
];
pub const PROFILE_STATS: usize = 0;
pub const MAX_IO_THREADS: usize = 2;
pub const MAX_DIRECT_IO_SIZE_KB: usize = 5;
pub const MAX_DEVICE_CACHE_SIZE_KB: usize = 6;
pub const PER_BUFFER_CACHE_SIZE_KB: usize = 7;
pub const MAX_DEVICE_PINNED_MEM_SIZE_KB: usize = 8;
pub const IO_BATCHSIZE: usize = 9;
pub const POLLTHRESHOLD_SIZE_KB: usize = 10;
pub const BATCH_IO_TIMEOUT_MS: usize = 11;

/// `CUFileBoolConfigParameter_t` defaults, in order.
const BOOL: [bool; 14] = [
    false, // PROPERTIES_USE_POLL_MODE
    true,  // PROPERTIES_ALLOW_COMPAT_MODE
    false, // FORCE_COMPAT_MODE
    false, // FS_MISC_API_CHECK_AGGRESSIVE
    true,  // EXECUTION_PARALLEL_IO
    false, // PROFILE_NVTX
    true,  // PROPERTIES_ALLOW_SYSTEM_MEMORY: host memory buffers
    false, // USE_PCIP2PDMA
    false, // PREFER_IO_URING
    false, // FORCE_ODIRECT_MODE: keep O_DIRECT's cache bypass
    false, // SKIP_TOPOLOGY_DETECTION
    false, // STREAM_MEMOPS_BYPASS
    false, // PROPERTIES_POSIX_IO_MODE
    true,  // GDS_FALLBACK_IO
];
pub const USE_POLL_MODE: usize = 0;
pub const ALLOW_SYSTEM_MEMORY: usize = 6;
pub const FORCE_ODIRECT_MODE: usize = 9;

/// `CUFileStringConfigParameter_t` defaults, in order.
const STRING: [&str; 4] = ["ERROR", "", "", ""];
/// The longest string parameter kept.
const MAX_STRING: usize = 4096;
/// The most slabs an array parameter holds.
pub const MAX_SLABS: usize = 64;

/// Every parameter's value.
#[derive(Debug, Clone)]
pub struct Params {
    size_t: [usize; 12],
    bools: [bool; 14],
    strings: [String; 4],
    posix_slabs: Vec<(usize, usize)>,
    bounce_slabs: Vec<(usize, usize)>,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            size_t: SIZE_T.map(|(d, _, _)| d),
            bools: BOOL,
            strings: STRING.map(String::from),
            posix_slabs: vec![(4, 128), (1024, 64), (16_384, 64)],
            bounce_slabs: vec![(1024, 16)],
        }
    }
}

fn index(param: ConfigParameter, count: usize, kind: &str) -> Result<usize> {
    usize::try_from(param)
        .ok()
        .filter(|&i| i < count)
        .ok_or_else(|| Fault::invalid(format!("no {kind} parameter {param}")))
}

impl Params {
    /// A `size_t` parameter by index.
    pub fn size(&self, i: usize) -> usize {
        self.size_t[i]
    }

    /// A `bool` parameter by index.
    pub fn flag(&self, i: usize) -> bool {
        self.bools[i]
    }

    pub fn get_size(&self, param: ConfigParameter) -> Result<usize> {
        Ok(self.size_t[index(param, SIZE_T.len(), "size_t")?])
    }

    pub fn size_range(param: ConfigParameter) -> Result<(usize, usize)> {
        let (_, lo, hi) = SIZE_T[index(param, SIZE_T.len(), "size_t")?];
        Ok((lo, hi))
    }

    pub fn set_size(&mut self, param: ConfigParameter, value: usize) -> Result<()> {
        let i = index(param, SIZE_T.len(), "size_t")?;
        let (_, lo, hi) = SIZE_T[i];
        if !(lo..=hi).contains(&value) {
            return Err(Fault::new(
                abi::CU_FILE_DRIVER_UNSUPPORTED_LIMIT,
                format!("size_t parameter {param}: {value} is outside {lo}..={hi}"),
            ));
        }
        self.size_t[i] = value;
        Ok(())
    }

    pub fn get_bool(&self, param: ConfigParameter) -> Result<bool> {
        Ok(self.bools[index(param, BOOL.len(), "bool")?])
    }

    pub fn set_bool(&mut self, param: ConfigParameter, value: bool) -> Result<()> {
        self.bools[index(param, BOOL.len(), "bool")?] = value;
        Ok(())
    }

    pub fn get_string(&self, param: ConfigParameter) -> Result<&str> {
        Ok(&self.strings[index(param, STRING.len(), "string")?])
    }

    pub fn set_string(&mut self, param: ConfigParameter, value: &str) -> Result<()> {
        let i = index(param, STRING.len(), "string")?;
        if value.len() > MAX_STRING {
            return Err(Fault::invalid(format!(
                "string parameter {param}: longer than {MAX_STRING} bytes"
            )));
        }
        self.strings[i] = value.to_string();
        Ok(())
    }

    /// The (size KiB, count) slabs of the POSIX pool (`bounce: false`) or the GPU bounce
    /// buffers.
    pub fn slabs(&self, bounce: bool) -> &[(usize, usize)] {
        if bounce {
            &self.bounce_slabs
        } else {
            &self.posix_slabs
        }
    }

    pub fn set_slabs(&mut self, bounce: bool, slabs: Vec<(usize, usize)>) -> Result<()> {
        if slabs.is_empty() || slabs.len() > MAX_SLABS {
            return Err(Fault::invalid(format!(
                "{} slabs: between 1 and {MAX_SLABS}",
                slabs.len()
            )));
        }
        if slabs.iter().any(|&(size, count)| size == 0 || count == 0) {
            return Err(Fault::invalid("a slab of size or count 0"));
        }
        if bounce {
            self.bounce_slabs = slabs;
        } else {
            self.posix_slabs = slabs;
        }
        Ok(())
    }
}
