#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod ai;
pub mod cache;
pub mod gather;
pub mod kernels;
pub mod load;
pub mod localio;
pub mod memio;
mod model_load;
pub mod nvme;
pub mod ondemand;
mod peers;
mod plot;
pub mod python;
mod relay;
pub mod remote;
mod report;
pub mod ring;
pub mod scheduler;

pub use report::{Record, RowBytes, Target, render_table, write_outputs};

use std::time::{Duration, Instant};

/// The harness's errors.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// gpuio (or the peer, through gpuio's HAL) failed.
    #[error(transparent)]
    Gpuio(#[from] gpuio_api::Error),
    /// A measured operation produced wrong bytes.
    #[error("{case} at {size} bytes produced wrong data (first difference at byte {offset})")]
    Corrupt {
        /// The case.
        case: String,
        /// The transfer size.
        size: usize,
        /// First wrong byte.
        offset: u64,
    },
    /// Writing results failed.
    #[error("writing {path}: {message}")]
    Output {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// Bad harness options.
    #[error("{0}")]
    Options(String),
}

impl From<gpuio_hal::HalError> for BenchError {
    fn from(e: gpuio_hal::HalError) -> Self {
        Self::Gpuio(e.into())
    }
}

/// Harness result type.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;

/// How long to measure each side of a race.
#[derive(Debug, Clone)]
pub struct Budget {
    /// Untimed runs of each side first.
    pub warmup: usize,
    /// Fewest timed runs per side.
    pub min_reps: usize,
    /// Most timed runs per side.
    pub max_reps: usize,
    /// Stop adding runs once each side has run this long in total.
    pub min_time: Duration,
}

impl Budget {
    /// A full measurement.
    pub fn standard() -> Self {
        Self {
            warmup: 2,
            min_reps: 5,
            max_reps: 200,
            min_time: Duration::from_millis(300),
        }
    }

    /// A quick one (CI, smoke runs).
    pub fn quick() -> Self {
        Self {
            warmup: 1,
            min_reps: 3,
            max_reps: 30,
            min_time: Duration::from_millis(40),
        }
    }
}

/// Median wall time of one side of a race.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Median of the timed runs.
    pub median: Duration,
    /// Timed runs.
    pub reps: usize,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// The median of `v` (the upper of the middle two; 0 where `v` is empty).
pub(crate) fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// What a suite run gives: its records, its targets judged, and notes.
pub type SuiteOutcome = (Vec<Record>, Vec<Target>, Vec<String>);

/// The session's GPU 0 where it is a CUDA device; else the outcome of a suite that needs
/// one: nothing recorded, and `why` as its note.
fn cuda_gpu(
    session: &gpuio_api::Session,
    why: &str,
) -> Result<std::result::Result<gpuio_hal::Gpu, SuiteOutcome>> {
    let gpu = session.gpu(0)?.clone();
    if gpu.backend() == gpuio_hal::Backend::Host {
        return Ok(Err((Vec::new(), Vec::new(), vec![why.to_string()])));
    }
    Ok(Ok(gpu))
}

/// Runs `ours` and `peer` alternately (so drift hits both alike), swapping which goes first
/// every repetition (so neither always finds the other's data warm in the caches), and
/// returns their medians. Each closure gets the repetition number, to rotate among inputs.
pub fn race(
    budget: &Budget,
    mut ours: impl FnMut(usize) -> Result<()>,
    mut peer: impl FnMut(usize) -> Result<()>,
) -> Result<(Timing, Timing)> {
    for i in 0..budget.warmup {
        ours(i)?;
        peer(i)?;
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let (mut ta, mut tb) = (Duration::ZERO, Duration::ZERO);
    let mut i = 0;
    while i < budget.max_reps
        && (i < budget.min_reps || ta < budget.min_time || tb < budget.min_time)
    {
        let time = |f: &mut dyn FnMut(usize) -> Result<()>| -> Result<Duration> {
            let t = Instant::now();
            f(i)?;
            Ok(t.elapsed())
        };
        let (da, db) = if i % 2 == 0 {
            let da = time(&mut ours)?;
            (da, time(&mut peer)?)
        } else {
            let db = time(&mut peer)?;
            (time(&mut ours)?, db)
        };
        a.push(da);
        b.push(db);
        ta += da;
        tb += db;
        i += 1;
    }
    Ok((
        Timing {
            median: median(a),
            reps: i,
        },
        Timing {
            median: median(b),
            reps: i,
        },
    ))
}

/// Whether `data` holds the pattern of `seed` from offset `off`, else `Corrupt` for `case`
/// (at the first wrong byte's offset).
pub(crate) fn check_pattern(case: &str, data: &[u8], off: u64, seed: u64) -> Result<()> {
    match gpuio_hal::pattern::first_deviation(data, off, seed) {
        None => Ok(()),
        Some(at) => Err(BenchError::Corrupt {
            case: case.into(),
            size: data.len(),
            offset: off + at as u64,
        }),
    }
}

/// A seed for fresh random data every run.
pub(crate) fn fresh_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    gpuio_hal::pattern::mix64(t ^ std::process::id() as u64)
}

/// Parses a size list such as `4K,1M,64M,1G` (powers of 1024).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .map(|part| {
            let part = part.trim();
            let (digits, mult) = match part.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
                Some((i, _)) => {
                    let mult = match part[i..]
                        .to_ascii_uppercase()
                        .trim_end_matches("IB")
                        .trim_end_matches('B')
                    {
                        "K" => 1 << 10,
                        "M" => 1 << 20,
                        "G" => 1 << 30,
                        "" => 1,
                        _ => return Err(BenchError::Options(format!("bad size unit in {part:?}"))),
                    };
                    (&part[..i], mult)
                }
                None => (part, 1),
            };
            digits
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .filter(|&n| n > 0)
                .ok_or_else(|| BenchError::Options(format!("bad size {part:?} (e.g. 4K, 64M, 1G)")))
        })
        .collect()
}

/// A size for people: `4 KiB`, `64 MiB`, `1 GiB`.
pub fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(
            parse_sizes("4K,1M, 2G,512").unwrap(),
            vec![4096, 1 << 20, 2 << 30, 512]
        );
        assert_eq!(parse_sizes("64MiB").unwrap(), vec![64 << 20]);
        assert!(parse_sizes("4X").is_err());
        assert!(parse_sizes("0").is_err());
        assert!(parse_sizes("").is_err());
        assert_eq!(human(64 << 20), "64 MiB");
        assert_eq!(human(1000), "1000 B");
    }

    #[test]
    fn races_run_both_sides_alike() {
        let (mut x, mut y) = (0, 0);
        let (a, b) = race(
            &Budget::quick(),
            |_| {
                x += 1;
                Ok(())
            },
            |_| {
                y += 1;
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(x, y);
        assert_eq!(a.reps, b.reps);
        assert!(a.reps >= 3);
    }
}
