#!/usr/bin/env bash
# gpuio's GPU matrix, from the bundle `cargo xtask gpu-bundle` builds: every test binary with
# CUDA required (and NVRTC through each crate's kernels test), nvcc over every module for sm_80,
# sm_90 and sm_100, gpuio info, a 1 GiB file round trip through GPU memory, the MemIO,
# LocalIO, core, gather, ring and remote benchmarks against their peers (fio: GPUIO_FIO;
# kvikio and torch: on PYTHONPATH; iperf3 where installed, or in ./iperf3 with its libraries),
# and the first use of the kernel modules: embedded PTX against NVRTC.
#
#   ./run.sh [tests | bench-a | bench-b | ondemand | nvme | kernel-load | python | load | cufile | all]
#   (default: all)
#
# The parts fit where one command may run ten minutes at most: tests (tests, kernels, info),
# bench-a (memio, gather), bench-b (core, ring, remote, localio), ondemand (on-demand arrays
# against the host engine, a CPU gather, plain device arrays and the raw ring), nvme (GPU-driven
# NVMe queues on the software controller against the request ring), kernel-load (the kernels
# suite: first use of each module, with the driver's JIT cache off and on), python (the wheel
# installed beside torch: its pytests with CUDA required, the CuPy on-demand example, and the
# python bench suite; LMCache's wheels from ../gpu-lmcache where carried: with them the call
# carries target/gpu-bundle/{bin,python,run.sh} and target/gpu-lmcache, 64 MiB with the tree,
# not the whole bundle), load (the wheel and
# the load suite's peers, kvikio and fastsafetensors, installed beside torch: safetensors
# checkpoints loaded by fresh processes), cufile (kvikio and
# torch.cuda.gds, unchanged, on gpuio's libcufile.so.0 against NVIDIA's: the localio bench's
# cufile part).
# Results (bench JSON, plots, test logs) go to $OUT or ./out.
set -u
cd "$(dirname "$0")"
part="${1:-all}"
export GPUIO_REQUIRE_CUDA=1
export GPUIO_BIN="$PWD/bin/gpuio"
export GPUIO_E2E_BYTES="${GPUIO_E2E_BYTES:-1073741824}"
# gpuio's libcufile.so.0 and NVIDIA's header, for gpuio-cufile's C test and the cufile bench.
export GPUIO_CUFILE_LIB_DIR="$PWD/lib" GPUIO_CUFILE_SDK="$PWD/cufile-sdk" GPUIO_REQUIRE_CUFILESDK=1
[ -d iperf3 ] && export PATH="$PWD/iperf3:$PATH" LD_LIBRARY_PATH="$PWD/iperf3:${LD_LIBRARY_PATH:-}"
out="${OUT:-$PWD/out}"
mkdir -p "$out"
status=0
# The executables travel gzipped (the bundle and the tree must fit the 64 MiB a call carries):
# unpack each once.
for z in bin/*.gz lib/*.gz tests/*.gz; do
    [ -e "$z" ] || continue
    gzip -dc "$z" >"${z%.gz}" && chmod +x "${z%.gz}" && rm "$z" || { echo "cannot unpack $z"; exit 1; }
done
step() {
    echo "== $*"
    local t=$SECONDS rc=0
    "$@" || { rc=$?; echo "FAILED: $*"; status=1; }
    echo "   ($((SECONDS - t)) s)"
    return $rc
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
case "$part" in tests | all)
    mkdir -p "$out/tests"
    for t in tests/*; do
        case "$t" in *.args) continue ;; esac
        # tests/<binary>.args: more arguments for it (modules to skip here, see bundle.rs).
        # shellcheck disable=SC2046 # split into words on purpose
        step "$t" --test-threads=4 $(cat "$t.args" 2>/dev/null) >"$out/tests/$(basename "$t").log" 2>&1
        grep -h "test result" "$out/tests/$(basename "$t").log" | sed "s|^|$(basename "$t"): |"
    done
    grep -h "test result" "$out"/tests/*.log | awk '{p += $4; f += $6} END {print "tests: " p " passed, " f " failed"}'
    tar czf "$out/testlogs.tgz" -C "$out" tests && rm -r "$out/tests"
    # The kernel sources travel with the tree: run from its root, where the manifests are.
    step sh -c 'cd ../.. && target/gpu-bundle/bin/xtask ptx'
    step bin/gpuio info ;;
esac
case "$part" in bench-a | all)
    step bin/gpuio bench memio --out "$out" ${GPUIO_BENCH_ARGS:-}
    step bin/gpuio bench gather --out "$out" ;;
esac
case "$part" in bench-b | all)
    step bin/gpuio bench core --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out"
    step bin/gpuio bench ring --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out"
    step bin/gpuio bench remote --out "$out"
    step bin/gpuio bench localio --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out" ;;
esac
case "$part" in ondemand | all)
    step bin/gpuio bench ondemand --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out" ;;
esac
case "$part" in nvme | all)
    step bin/gpuio bench nvme --out "$out" ;;
esac
py="${GPUIO_PYTHON:-python3}"
site="$PWD/python/site"
case "$part" in python | load | cufile | all)
    # The wheel, pytest's wheels and the load suite's peers into a directory of their own,
    # found through PYTHONPATH; torch, NumPy, CuPy and safetensors are the machine's.
    [ -e "$site/.installed" ] || { rm -rf "$site" && step "$py" -m pip install --quiet --no-deps \
        --no-index --target "$site" python/*.whl python/deps/*.whl python/peers/*.whl &&
        touch "$site/.installed"; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
case "$part" in python | all)
    # LMCache and its imports, where `cargo xtask gpu-bundle` left them beside the bundle
    # (target/gpu-lmcache, carried with this part): its own directory, and the connector's
    # tests then require the real package.
    lm="$PWD/../gpu-lmcache"
    if ls "$lm"/*.whl >/dev/null 2>&1; then
        [ -e "$lm/site/.installed" ] || { rm -rf "$lm/site" && step "$py" -m pip install --quiet \
            --no-deps --no-index --target "$lm/site" "$lm"/*.whl && touch "$lm/site/.installed"; }
        export PYTHONPATH="$PYTHONPATH:$lm/site" GPUIO_REQUIRE_LMCACHE=1
    else
        echo "== LMCache's wheels are not beside the bundle: its cases skip (target/gpu-lmcache)"
    fi
    step "$py" -m pytest -q -p no:cacheprovider ../../crates/gpuio-py/pytests
    # The on-demand example (a CuPy kernel over a file 4x its cache), where CuPy is installed.
    if "$py" -c "import cupy" 2>/dev/null; then
        step "$py" ../../crates/gpuio-py/examples/ondemand_cupy.py --scratch "${GPUIO_SCRATCH:-/tmp}"
    else
        echo "== skipped the CuPy example: CuPy is not installed"
    fi
    step bin/gpuio bench python --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out" ;;
esac
case "$part" in load | all)
    step bin/gpuio bench load --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out" ${GPUIO_LOAD_ARGS:-} ;;
esac
case "$part" in cufile | all)
    step bin/gpuio bench localio --localio-parts cufile --scratch "${GPUIO_SCRATCH:-/tmp}" --out "$out" ;;
esac
case "$part" in kernel-load | all)
    # First use of each kernel module: embedded PTX (the driver JIT-compiles it) against NVRTC
    # compiling the source first. With the JIT cache off every load JIT-compiles, as on a
    # machine's first run; with it on, a process finds what an earlier one compiled.
    step env CUDA_CACHE_DISABLE=1 bin/gpuio bench kernels --out "$out/kernel-load-jit-cache-off"
    step bin/gpuio bench kernels --out "$out/kernel-load-jit-cache-on" ;;
esac
echo "== gpu matrix ($part): $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
