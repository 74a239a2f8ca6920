//! The block cache from the command line: `gpuio bench cache` reads through a cache built from
//! the `[cache]` configuration (here set through `GPUIO_CACHE_*`), and `gpuio stat` reads the
//! levels' hit rates from its metrics endpoint while it runs.

use crate::common;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn stat(addr: &str) -> Output {
    Command::new(common::bin())
        .args(["stat", "--addr", addr])
        .output()
        .expect("gpuio runs")
}

/// The hit rate and lookups of `level` in a `gpuio stat` summary.
fn level_line(summary: &str, level: &str) -> Option<(f64, f64)> {
    let line = summary
        .lines()
        .find(|l| l.starts_with(&format!("cache {level}: ")))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    // "cache l2: 43.1% hits of 20480 lookups, 9 evictions"
    let pct = words.get(2)?.trim_end_matches('%').parse().ok()?;
    let lookups = words.get(5)?.parse().ok()?;
    Some((pct, lookups))
}

#[test]
fn stat_shows_the_hit_rates_of_a_cached_bench() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let out = tempfile::tempdir().unwrap();
    let l3 = tempfile::tempdir().unwrap();
    // L2 4 MiB over L3 8 MiB: a working set of 9 MiB, all of it in the cache once warm.
    let mut child = Command::new(common::bin())
        .args(["--metrics-addr", &addr, "--metrics-linger", "60"])
        .args(["bench", "cache", "--quick", "--out"])
        .arg(out.path())
        .arg("--scratch")
        .arg(out.path())
        .envs([
            ("GPUIO_CACHE_L2_SIZE", "4MiB"),
            ("GPUIO_CACHE_L3_SIZE", "8MiB"),
            ("GPUIO_CACHE_L3_DIR", l3.path().to_str().unwrap()),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The records are written when the suite is done; the endpoint lingers for the scrape.
    let records = out.path().join("cache.json");
    let deadline = Instant::now() + Duration::from_secs(180);
    while !records.exists() {
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            child.kill().ok();
            let o = child.wait_with_output().unwrap();
            panic!(
                "gpuio bench cache wrote no records: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let o = stat(&addr);
    child.kill().ok();
    child.wait().ok();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (l2, l2_lookups) = level_line(&text, "l2").unwrap_or_else(|| panic!("{text}"));
    let (l3, l3_lookups) = level_line(&text, "l3").unwrap_or_else(|| panic!("{text}"));
    assert!(
        level_line(&text, "l1").is_none(),
        "no L1 configured: {text}"
    );
    // Every read of the timed runs found its block in L2 or L3: only the first reads missed.
    assert!(l2 > 0.0 && l2 < 100.0, "{text}");
    assert!(l3 > 90.0, "{text}");
    assert!(l3_lookups < l2_lookups && l2_lookups > 10_000.0, "{text}");

    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&records).unwrap()).unwrap();
    let recs = json["records"].as_array().unwrap();
    // Host and GPU memory against pread, and O_DIRECT where the scratch file system has it.
    assert!(recs.len() == 2 || recs.len() == 3, "{json}");
    for r in recs {
        assert!(r["value"].as_f64().unwrap() > 0.0, "{r}");
        let route = r["route"].as_str().unwrap();
        assert!(
            route.starts_with("cache l2 ") && route.contains(", l3 "),
            "{route}"
        );
    }
    // The scratch file is gone.
    let left: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("bench-cache"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
