//! `cargo xtask gpu-bundle`: release test and bench binaries for the GPU machine (which has
//! no cargo), with `run.sh`, the one command that runs them there.

use crate::{Result, build_tests, cargo, copy, make_executable, root, run};
use std::path::Path;

/// The bundle carried to the GPU machine: `bin/` (gpuio, xtask), `tests/` (every test
/// binary), `kernels/`, and `run.sh`.
pub fn gpu_bundle() -> Result {
    let root = root();
    let out = root.join("target/gpu-bundle");
    let _ = std::fs::remove_dir_all(&out);
    for d in ["bin", "tests", "kernels"] {
        std::fs::create_dir_all(out.join(d)).map_err(|e| format!("creating {d}: {e}"))?;
    }
    run(
        "build binaries",
        cargo().args([
            "build",
            "--profile",
            "bundle",
            "-p",
            "gpuio-cli",
            "-p",
            "xtask",
        ]),
    )?;
    for bin in ["gpuio", "xtask"] {
        copy(
            &root.join("target/bundle").join(bin),
            &out.join("bin").join(bin),
        )?;
    }
    let tests = build_tests(
        "build test binaries",
        &["--workspace", "--profile", "bundle"],
    )?;
    let mut count = 0;
    for t in tests {
        // These read the source tree, which does not travel, or test the network on hosts
        // the GPU machine lacks (etcd, namespaces), or attack an agent process over loopback;
        // nothing in them needs a GPU (and the bundle must stay under 64 MiB).
        if matches!(
            t.package.as_str(),
            "gpuio-tests" | "xtask" | "gpuio-transport-remoteio"
        ) || matches!(t.target.as_str(), "multinode" | "agent")
        {
            continue;
        }
        copy(
            &t.path,
            &out.join("tests")
                .join(format!("{}--{}", t.package, t.target)),
        )?;
        count += 1;
    }
    for entry in std::fs::read_dir(root.join("kernels")).map_err(|e| format!("kernels/: {e}"))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        if let Some(name) = path.file_name() {
            copy(&path, &out.join("kernels").join(name))?;
        }
    }
    let script = out.join("run.sh");
    std::fs::write(&script, RUN_SH).map_err(|e| format!("writing run.sh: {e}"))?;
    make_executable(&script)?;
    let size = dir_size(&out);
    eprintln!(
        "bundle: {} ({count} test binaries), {:.1} MiB",
        out.display(),
        size as f64 / (1 << 20) as f64
    );
    if size > 60 << 20 {
        return Err(format!(
            "the bundle is {} MiB; the GPU machine takes at most 64",
            size >> 20
        ));
    }
    Ok(())
}

const RUN_SH: &str = r#"#!/usr/bin/env bash
# gpuio's GPU matrix, in one command: every test binary with CUDA required, the kernel compile
# checks (nvcc and NVRTC), gpuio info, a 1 GiB file round trip through GPU memory, and the
# MemIO, LocalIO, core, gather, ring and remote benchmarks against their peers (fio: GPUIO_FIO;
# kvikio and torch: on PYTHONPATH; iperf3 where installed).
# Results (bench JSON, plots) go to $OUT or ./out.
set -u
cd "$(dirname "$0")"
export GPUIO_REQUIRE_CUDA=1
export GPUIO_BIN="$PWD/bin/gpuio"
export GPUIO_E2E_BYTES="${GPUIO_E2E_BYTES:-1073741824}"
out="${OUT:-$PWD/out}"
mkdir -p "$out"
status=0
step() {
    echo "== $*"
    "$@" || { echo "FAILED: $*"; status=1; }
}
# cuFile asks udev for the file system of each disk; containers have no udev database. As
# root, record each block device's real type (blkid) where udev has not.
if [ "$(id -u)" = 0 ] && command -v blkid >/dev/null; then
    mkdir -p /run/udev/data
    for d in /sys/class/block/*; do
        [ -r "$d/dev" ] || continue
        db="/run/udev/data/b$(cat "$d/dev")"; [ -e "$db" ] && continue
        t=$(blkid -o value -s TYPE "/dev/$(basename "$d")" 2>/dev/null) || continue
        [ -n "$t" ] && printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$t" >"$db"
    done
fi
for t in tests/*; do step "$t" --test-threads=4; done
step bin/xtask ptx --kernels kernels
step bin/gpuio info
step bin/gpuio bench memio --out "$out" ${GPUIO_BENCH_ARGS:-}
step bin/gpuio bench localio --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out"
step bin/gpuio bench core --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out"
step bin/gpuio bench gather --out "$out"
step bin/gpuio bench ring --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out"
step bin/gpuio bench remote --out "$out"
echo "== gpu matrix: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
"#;

fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => dir_size(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}
