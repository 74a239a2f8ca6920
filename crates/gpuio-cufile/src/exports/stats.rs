//! Statistics: `cuFileSetStatsLevel`, `cuFileStatsStart`, `cuFileGetStatsL1/L2/L3`.

use super::{put, status};
use crate::abi::{
    self, CUfileError_t, CUfileStatsLevel1_t, CUfileStatsLevel2_t, CUfileStatsLevel3_t,
};
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use std::ffi::c_int;
use std::sync::atomic::Ordering::Relaxed;

#[unsafe(no_mangle)]
pub extern "C" fn cuFileSetStatsLevel(level: c_int) -> CUfileError_t {
    status(|| {
        if !(0..=3).contains(&level) {
            return Err(Fault::invalid(format!("statistics level {level}: 0 to 3")));
        }
        DRIVER.stats.level.store(level, Relaxed);
        Ok(())
    })
}

/// The level in effect: the one set, else the `PROFILE_STATS` parameter.
fn level() -> c_int {
    match DRIVER.stats.level.load(Relaxed) {
        0 => DRIVER.params().size(crate::params::PROFILE_STATS) as c_int,
        l => l,
    }
}

/// # Safety
/// `level` is NULL or writable for an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetStatsLevel(out: *mut c_int) -> CUfileError_t {
    // SAFETY: the caller's contract.
    status(|| unsafe { put(out, level(), "level") })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileStatsStart() -> CUfileError_t {
    status(|| {
        if level() == 0 {
            return Err(Fault::invalid(
                "statistics are at level 0: set a level first",
            ));
        }
        DRIVER.stats.started.store(true, Relaxed);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileStatsStop() -> CUfileError_t {
    status(|| {
        DRIVER.stats.started.store(false, Relaxed);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileStatsReset() -> CUfileError_t {
    status(|| {
        DRIVER.stats.reset();
        Ok(())
    })
}

/// Refuses a report above the level in effect, or before `cuFileStatsStart`.
fn allowed(want: c_int) -> Result<()> {
    if !DRIVER.stats.started.load(Relaxed) || level() < want {
        return Err(Fault::new(
            abi::CU_FILE_INVALID_VALUE,
            format!("level {want} statistics: set level {want} or more and call cuFileStatsStart"),
        ));
    }
    Ok(())
}

/// # Safety
/// `stats` is NULL or writable for the struct.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetStatsL1(stats: *mut CUfileStatsLevel1_t) -> CUfileError_t {
    status(|| {
        allowed(1)?;
        // SAFETY: the caller's contract.
        unsafe { put(stats, DRIVER.stats.level1(), "stats") }
    })
}

/// # Safety
/// `stats` is NULL or writable for the struct.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetStatsL2(stats: *mut CUfileStatsLevel2_t) -> CUfileError_t {
    status(|| {
        allowed(2)?;
        // SAFETY: the caller's contract.
        unsafe { put(stats, DRIVER.stats.level2(), "stats") }
    })
}

/// # Safety
/// `stats` is NULL or writable for the struct.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetStatsL3(stats: *mut CUfileStatsLevel3_t) -> CUfileError_t {
    status(|| {
        allowed(3)?;
        let gpus = DRIVER.active()?.gpus().len();
        // SAFETY: the caller's contract.
        unsafe { put(stats, DRIVER.stats.level3(gpus), "stats") }
    })
}
