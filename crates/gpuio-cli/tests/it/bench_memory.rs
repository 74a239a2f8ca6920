//! `gpuio bench memio` checks the host memory one size's buffers need together before it
//! allocates any of them (each buffer alone was checked, and their sum ran the machine out).

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

/// A size whose buffers together (four of it on the host backend) need 1.6 times what the
/// machine can back, though each alone fits: refused at once, naming both figures.
#[test]
fn memio_refuses_sizes_whose_buffers_together_do_not_fit() {
    let room = gpuio_hal::memory::backing::backable_bytes(true).expect("/proc/meminfo");
    let size = (room * 2 / 5) & !((1 << 20) - 1);
    let out = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let o = Command::new(common::bin())
        .args(["--backend", "host", "bench", "memio", "--quick", "--sizes"])
        .arg(size.to_string())
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("GPUIO_ERROR_NOMEM")
            && err.contains(&format!("needs {} bytes", 4 * size))
            && err.contains("nothing was allocated"),
        "{err}"
    );
    // Refused before touching gigabytes: no time spent filling buffers.
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}
