//! `gpuio cp` and `gpuio agent` where the machine or the user gets in the way: copies
//! interrupted by signals (no partial file may stay behind, except what SIGKILL leaves, which
//! the next copy removes), sizes the host cannot back (a typed out-of-memory error before any
//! page is touched, never the OOM killer), agent exports whose files are missing or are
//! directories (typed errors, not network ones), and copies racing to one destination (each
//! commits; none takes another's partial file for abandoned).

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;

use common::bin;

/// A strong secret for the agents these tests start (they must refuse to start anyway).
const ENV: [(&str, &str); 1] = [(
    "GPUIO_TEST_SECRET",
    "0b6e2f9d4c1a8e7f3d5b9a0c2e4f6a8b1d3f5e7a9c0b2d4f6e8a1c3e5b7d9f0a",
)];

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn partials(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".gpuio-partial"))
        .collect()
}

/// A copy slow enough to interrupt: 4 KiB windows over 64 MiB.
fn slow_copy(src: &Path, dst: &Path) -> Child {
    Command::new(bin())
        .args(["cp", "-q", "--window", "4KiB"])
        .arg(src)
        .arg(dst)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until the copy's partial file exists (it is under way), at most 10 s.
fn wait_for_partial(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while partials(dir).is_empty() {
        assert!(Instant::now() < deadline, "the copy never started");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig}");
}

#[test]
fn interrupted_copies_leave_no_partial_files() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    std::fs::write(&src, vec![0x3cu8; 64 << 20]).unwrap();
    let dst = dir.path().join("dst.bin");
    for (sig, code) in [("INT", 130), ("TERM", 143), ("HUP", 129)] {
        let child = slow_copy(&src, &dst);
        wait_for_partial(dir.path());
        signal(&child, sig);
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(code), "SIG{sig}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("removed 1 partial file"),
            "{}",
            stderr(&o)
        );
        assert!(
            partials(dir.path()).is_empty(),
            "SIG{sig} left {:?}",
            partials(dir.path())
        );
        assert!(!dst.exists());
    }
    // SIGKILL cannot be caught: its partial file stays until the next copy there.
    let child = slow_copy(&src, &dst);
    wait_for_partial(dir.path());
    signal(&child, "KILL");
    let _ = child.wait_with_output();
    assert_eq!(partials(dir.path()).len(), 1);
    let o = Command::new(bin())
        .args(["cp", "-q"])
        .arg(&src)
        .arg(&dst)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        partials(dir.path()).is_empty(),
        "{:?}",
        partials(dir.path())
    );
    assert_eq!(std::fs::read(&dst).unwrap().len(), 64 << 20);
}

#[test]
fn sizes_the_host_cannot_back_are_out_of_memory_errors() {
    let dir = tempfile::tempdir().unwrap();
    let huge = dir.path().join("sparse-1TiB");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    for dst in ["memio://cpu/dram", "gpu0"] {
        let t = Instant::now();
        let o = Command::new(bin())
            .args(["cp", "-q"])
            .arg(&huge)
            .arg(dst)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{dst}: {}", stderr(&o));
        assert!(stderr(&o).contains("NOMEM"), "{dst}: {}", stderr(&o));
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{dst}: {:?}",
            t.elapsed()
        );
    }
    // An agent asked to export more host memory than there is refuses to start.
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        "[agent]\nlisten = \"127.0.0.1:0\"\n[[agent.keys]]\nid = \"k\"\nrole = \"read-only\"\n\
         secret_env = \"GPUIO_TEST_SECRET\"\n[[agent.exports]]\nname = \"big\"\n\
         access = \"read-only\"\nmemory = \"1 TiB\"\n",
    )
    .unwrap();
    let o = common::agent_refusing(&cfg, &ENV);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("out of memory"), "{}", stderr(&o));
}

#[test]
fn missing_or_directory_export_files_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    for (file, code) in [
        (dir.path().join("missing.bin"), 4),
        (dir.path().to_path_buf(), 3),
    ] {
        let cfg = dir.path().join("agent.toml");
        std::fs::write(
            &cfg,
            format!(
                "[agent]\nlisten = \"127.0.0.1:0\"\n[[agent.keys]]\nid = \"k\"\n\
                 role = \"read-only\"\nsecret_env = \"GPUIO_TEST_SECRET\"\n\
                 [[agent.exports]]\nname = \"f\"\naccess = \"read-only\"\nfile = \"{}\"\n",
                file.display()
            ),
        )
        .unwrap();
        let o = common::agent_refusing(&cfg, &ENV);
        assert_eq!(
            o.status.code(),
            Some(code),
            "{}: {}",
            file.display(),
            stderr(&o)
        );
        assert!(stderr(&o).contains("export \"f\""), "{}", stderr(&o));
    }
}

/// Names in `dir` that a copy writes before it commits.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".gpuio-partial") || n.ends_with(".gpuio-creating"))
        .collect()
}

/// Issue 40: some of many copies to one destination failed (rename: ENOENT) when another
/// copy's cleanup removed their partial file in the instant before it was locked.
#[test]
fn concurrent_copies_to_one_destination_all_succeed() {
    const PROCESSES: usize = 8;
    const ROUNDS: usize = 25;
    let dir = tempfile::tempdir().unwrap();
    let sources: Vec<(std::path::PathBuf, Vec<u8>)> = (0..PROCESSES)
        .map(|i| {
            let path = dir.path().join(format!("src{i}"));
            let bytes: Vec<u8> = (0..256 << 10).map(|b| (b % 251) as u8 ^ i as u8).collect();
            std::fs::write(&path, &bytes).unwrap();
            (path, bytes)
        })
        .collect();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let dst = out.join("dest");
    for round in 0..ROUNDS {
        let copies: Vec<_> = sources
            .iter()
            .map(|(src, _)| {
                Command::new(bin())
                    .args(["cp", "-q"])
                    .arg(src)
                    .arg(&dst)
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (i, c) in copies.into_iter().enumerate() {
            let o = c.wait_with_output().unwrap();
            assert!(
                o.status.success(),
                "round {round}, copy {i}: {}",
                stderr(&o)
            );
        }
        let got = std::fs::read(&dst).unwrap();
        assert!(
            sources.iter().any(|(_, bytes)| *bytes == got),
            "round {round}: the destination is none of the sources ({} bytes)",
            got.len()
        );
        assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
    }
}
