//! The retry policy (docs/REFERENCE.md#retry-policy): retry retryable errors with exponential
//! backoff.

use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// How often and how patiently to retry (`gpuio_retry_policy_t`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RetryPolicy {
    /// Retries after the first attempt (0: try once).
    pub max_retries: u32,
    /// Wait before the first retry, in microseconds.
    pub initial_backoff_us: u64,
    /// Longest wait between attempts, in microseconds.
    pub max_backoff_us: u64,
    /// Growth of the wait per retry.
    pub backoff_multiplier: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 3,
            initial_backoff_us: 100,
            max_backoff_us: 100_000,
            backoff_multiplier: 2.0,
        }
    }
}

impl RetryPolicy {
    /// Try once, never retry.
    pub const NONE: Self = Self {
        max_retries: 0,
        initial_backoff_us: 0,
        max_backoff_us: 0,
        backoff_multiplier: 1.0,
    };

    /// The wait before retry number `n` (0-based).
    pub fn backoff(&self, n: u32) -> Duration {
        let grown =
            self.initial_backoff_us as f64 * self.backoff_multiplier.max(1.0).powi(n as i32);
        Duration::from_micros(grown.min(self.max_backoff_us as f64) as u64)
    }

    /// Runs `op` until it succeeds, fails with an error that is not retryable, or the retries
    /// run out (then [`CoreError::RetriesExhausted`], carrying the last error and its code).
    pub fn run<T>(&self, op: impl FnMut() -> Result<T>) -> Result<T> {
        self.run_until(None, || {}, op)
    }

    /// Like [`run`](Self::run), but no retry starts after `until` (the request's timeout),
    /// and `on_retry` hears of each retry.
    pub fn run_until<T>(
        &self,
        until: Option<Instant>,
        mut on_retry: impl FnMut(),
        mut op: impl FnMut() -> Result<T>,
    ) -> Result<T> {
        let mut attempt = 0;
        loop {
            match op() {
                Ok(v) => return Ok(v),
                Err(e) if !e.code().is_retryable() => return Err(e),
                Err(e)
                    if attempt >= self.max_retries
                        || until.is_some_and(|t| Instant::now() + self.backoff(attempt) > t) =>
                {
                    return Err(if attempt == 0 {
                        e
                    } else {
                        CoreError::RetriesExhausted {
                            attempts: attempt + 1,
                            last: Box::new(e),
                        }
                    });
                }
                Err(e) => {
                    tracing::debug!(attempt, error = %e, "retrying");
                    on_retry();
                    std::thread::sleep(self.backoff(attempt));
                    attempt += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuio_hal::{ErrorCode, HalError};

    fn busy() -> CoreError {
        CoreError::Hal(HalError::Os {
            op: "test",
            source: std::io::ErrorKind::WouldBlock.into(),
        })
    }

    #[test]
    fn backoff_grows_and_caps() {
        let p = RetryPolicy {
            max_retries: 10,
            initial_backoff_us: 100,
            max_backoff_us: 1000,
            backoff_multiplier: 2.0,
        };
        let waits: Vec<u64> = (0..6).map(|n| p.backoff(n).as_micros() as u64).collect();
        assert_eq!(waits, vec![100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn retryable_errors_are_retried_until_success() {
        let p = RetryPolicy {
            initial_backoff_us: 1,
            ..RetryPolicy::default()
        };
        let mut calls = 0;
        let r = p.run(|| {
            calls += 1;
            if calls < 3 { Err(busy()) } else { Ok(calls) }
        });
        assert_eq!(r.unwrap(), 3);
    }

    #[test]
    fn exhausted_retries_report_the_last_error() {
        let p = RetryPolicy {
            max_retries: 2,
            initial_backoff_us: 1,
            ..RetryPolicy::default()
        };
        let mut calls = 0;
        let err = p
            .run(|| -> Result<()> {
                calls += 1;
                Err(busy())
            })
            .unwrap_err();
        assert_eq!(calls, 3);
        assert!(matches!(
            err,
            CoreError::RetriesExhausted { attempts: 3, .. }
        ));
        // The code is the last error's (busy), not a made-up timeout.
        assert_eq!(err.code(), ErrorCode::Busy);
    }

    #[test]
    fn fatal_errors_are_not_retried() {
        let mut calls = 0;
        let err = RetryPolicy::default()
            .run(|| -> Result<()> {
                calls += 1;
                Err(CoreError::InvalidRequest("bad".into()))
            })
            .unwrap_err();
        assert_eq!(calls, 1);
        assert_eq!(err.code(), ErrorCode::InvalidArg);
    }
}
