"""cuFile programs, unchanged, on gpuio's libcufile.so.0 and on NVIDIA's: kvikio (CuFile.read,
pread/pwrite futures, raw_read_async) and torch.cuda.gds (GdsFile load_storage/save_storage,
registered buffers). Every byte is checked; the timings go to stdout as JSON lines.

    python3 cufile_suite.py FILE GPUIO_LIB_DIR [--threads 8,16,32]

Each case runs in a fresh child process whose LD_LIBRARY_PATH picks the library ("gpuio":
GPUIO_LIB_DIR first; "nvidia": the loader's default, NVIDIA's wheel). The child reports which
library it got (gpuio's exports gpuio_cufile_version).
"""

import ctypes
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
# Reads of the file in a warm process, the first included: the last five are its steady
# state.
HOT_READS = 30


def emit(**kw):
    print(json.dumps(kw), flush=True)


def loaded_cufile():
    """Which libcufile.so.0 this process has (kvikio dlopens it by that name)."""
    try:
        lib = ctypes.CDLL("libcufile.so.0")
    except OSError as e:
        return f"none ({e})"
    return "gpuio" if hasattr(lib, "gpuio_cufile_version") else "nvidia"


def drop(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def reference(path, torch):
    """The file's bytes on the GPU, read without cuFile: what every load is compared with."""
    import numpy as np

    host = np.fromfile(path, dtype=np.uint8)
    return torch.from_numpy(host).cuda()


def child_kvikio(path, threads, lib, cold=False):
    os.environ["KVIKIO_NTHREADS"] = str(threads)
    import torch
    import kvikio
    import kvikio.defaults

    torch.cuda.init()
    size = os.path.getsize(path)
    want = reference(path, torch)
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    got_lib = loaded_cufile()
    compat = None
    try:
        compat = str(kvikio.defaults.get("compat_mode"))
    except Exception as e:  # noqa: BLE001 - report, whatever the API says
        compat = f"? ({e})"
    # Cold runs in a process of its own: a process that read the file keeps its page cache
    # registered (pinned), which no drop can evict while it lives. The drop is the reading
    # process's own (under gVisor, a drop by another process does not reach the pages).
    # Warm: the process's first read. Then the file read back to back, as a loop over it
    # does: "hot_first" is the next three reads, "hot" the loop's steady state, its last
    # five of HOT_READS.
    cases = ["cold"] if cold else ["warm"] + ["hot_first"] * 3 + ["loop"] * (HOT_READS - 9) + ["hot"] * 5
    for case in cases:
        if cold:
            drop(path)
        dst.zero_()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with kvikio.CuFile(path, "r") as f:
            n = f.read(dst)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        ok = n == size and torch.equal(dst, want)
        if case == "loop" and ok:
            continue
        emit(suite="kvikio", lib=lib, got=got_lib, compat=compat, threads=threads,
             case=case, gbps=size / dt / 1e9, ok=bool(ok))
    if cold:
        return
    # pread/pwrite futures and raw_read_async, checked on a 64 MiB window.
    out = path + f".w{threads}{lib}"
    win = 64 * MiB
    with kvikio.CuFile(out, "w") as f:
        fut = f.pwrite(want[:win], win, 0)
        wrote = fut.get()
    back = torch.empty(win, dtype=torch.uint8, device="cuda")
    with kvikio.CuFile(out, "r") as f:
        got = f.pread(back, win, 0).get()
    ok_rw = wrote == win and got == win and torch.equal(back, want[:win])
    ok_async = None
    try:
        stream = torch.cuda.Stream()
        back.zero_()
        with kvikio.CuFile(path, "r") as f:
            fut = f.raw_read_async(back, stream.cuda_stream, win, 4096, 0)
            n = fut.check_bytes_done()
        torch.cuda.synchronize()
        ok_async = n == win and torch.equal(back, want[4096:4096 + win])
    except Exception as e:  # noqa: BLE001
        ok_async = f"error: {e}"
    os.unlink(out)
    emit(suite="kvikio-api", lib=lib, got=got_lib, threads=threads,
         pread_pwrite=bool(ok_rw), raw_read_async=ok_async)
    # 4 KiB reads at random offsets, one at a time from one thread.
    import random

    rnd = random.Random(7)
    offsets = [rnd.randrange(0, size // 4096) * 4096 for _ in range(4000)]
    small = torch.empty(4096, dtype=torch.uint8, device="cuda")
    with kvikio.CuFile(path, "r") as f:
        f.read(small, 4096, offsets[0])
        t = time.perf_counter()
        for o in offsets:
            f.read(small, 4096, o)
        dt = time.perf_counter() - t
        ok = torch.equal(small, want[offsets[-1]:offsets[-1] + 4096])
    # The floor under any 4 KiB read into GPU memory: one synchronous 4 KiB copy from pinned
    # host memory, as torch makes it.
    pinned = torch.empty(4096, dtype=torch.uint8).pin_memory()
    small.copy_(pinned)
    t2 = time.perf_counter()
    for _ in range(len(offsets)):
        small.copy_(pinned)
    floor = (time.perf_counter() - t2) / len(offsets) * 1e6
    emit(suite="kvikio-4k", lib=lib, got=got_lib, threads=threads,
         iops=len(offsets) / dt, us=dt / len(offsets) * 1e6, ok=bool(ok),
         h2d_copy_floor_us=floor)


def child_gds(path, lib):
    import torch
    from torch.cuda import gds

    size = os.path.getsize(path)
    want = reference(path, torch)
    got_lib = loaded_cufile()
    rows = {}
    try:
        dst = torch.empty(size, dtype=torch.uint8, device="cuda")
        storage = dst.untyped_storage()
        gds.gds_register_buffer(storage)
        for case in ("warm", "hot"):
            dst.zero_()
            torch.cuda.synchronize()
            t = time.perf_counter()
            f = gds.GdsFile(path, os.O_RDONLY)
            f.load_storage(storage, 0)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            rows[case] = size / dt / 1e9
            rows[case + "_ok"] = bool(torch.equal(dst, want))
            del f
        gds.gds_deregister_buffer(storage)
        # save_storage, then a load of what was saved.
        out = path + ".gds" + lib
        win = want[: 256 * MiB].clone()
        fd = os.open(out, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
        os.close(fd)
        f = gds.GdsFile(out, os.O_RDWR)
        f.save_storage(win.untyped_storage(), 0)
        back = torch.empty_like(win)
        f.load_storage(back.untyped_storage(), 0)
        torch.cuda.synchronize()
        rows["save_load_ok"] = bool(torch.equal(back, win))
        del f
        os.unlink(out)
        rows["works"] = True
    except Exception as e:  # noqa: BLE001 - the failure is the result
        rows["works"] = False
        rows["error"] = str(e)[:300]
    emit(suite="torch.gds", lib=lib, got=got_lib, **rows)
    # The peer: the same bytes as a torch tensor saved with torch.save, loaded and moved.
    pt = path + ".pt"
    if os.path.exists(pt):
        t = time.perf_counter()
        x = torch.load(pt, mmap=True).cuda()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        emit(suite="torch.load", gbps=size / dt / 1e9, ok=bool(torch.equal(x, want)))


def main():
    if sys.argv[1] == "child":
        kind, path, lib = sys.argv[2], sys.argv[3], sys.argv[4]
        if kind in ("kvikio", "kvikio-cold"):
            child_kvikio(path, int(sys.argv[5]), lib, cold=kind == "kvikio-cold")
        elif kind == "bus":
            import torch

            bus(torch)
        else:
            child_gds(path, lib)
        return
    path, libdir = sys.argv[1], sys.argv[2]
    threads = [8, 16, 32]
    args = sys.argv[3:]
    while args:
        a = args.pop(0)
        if a == "--threads":
            threads = [int(t) for t in args.pop(0).split(",")]
    # The torch.load peer's copy of the same bytes, removed at the end.
    import numpy as np
    import torch

    torch.save(torch.from_numpy(np.fromfile(path, dtype=np.uint8)), path + ".pt")
    ours = os.path.join(libdir, "libcufile.so.0")
    # torch loads NVIDIA's library by its full path, which LD_LIBRARY_PATH cannot redirect:
    # preloading ours binds every cuFile symbol to it first.
    gpuio_env = dict(os.environ, KVIKIO_COMPAT_MODE="OFF", LD_PRELOAD=ours,
                     LD_LIBRARY_PATH=libdir + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    runs = [
        ("gpuio", gpuio_env),
        # NVIDIA's cuFile as kvikio uses it by default (AUTO: its own POSIX path where cuFile
        # cannot register a file), and with cuFile forced (OFF).
        ("nvidia", dict(os.environ, KVIKIO_COMPAT_MODE="AUTO")),
        ("nvidia-cufile-forced", dict(os.environ, KVIKIO_COMPAT_MODE="OFF")),
    ]
    me = os.path.abspath(__file__)
    # Every warm and hot case first, then every cold one: a cold case drops the file's pages,
    # and a page cache refilled after a drop is not what a warm case means (under gVisor a
    # refilled file reads several times slower than one never dropped).
    jobs = [("nvidia", runs[1][1], ["bus"])]
    for lib, env in runs:
        if lib == "nvidia-cufile-forced":
            jobs.append((lib, env, ["kvikio", str(threads[0])]))
            continue
        jobs.append((lib, env, ["gds"]))
        jobs += [(lib, env, ["kvikio", str(t)]) for t in threads]
    jobs += [(lib, env, ["kvikio-cold", str(t)]) for lib, env in runs[:2] for t in threads]
    for lib, env, job in jobs:
        cmd = [sys.executable, me, "child", job[0], path, lib] + job[1:]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
            sys.stdout.write(r.stdout)
            if r.returncode != 0:
                emit(suite=job[0], lib=lib, failed=r.returncode, stderr=r.stderr[-1500:])
        except subprocess.TimeoutExpired:
            emit(suite=job[0], lib=lib, failed="timeout")
        sys.stdout.flush()
    disk(path)
    os.unlink(path + ".pt")


def bus(torch):
    """What the bus moves: 1 GiB of pinned host memory copied into GPU memory, best of five
    (the limit under any read of a hot file)."""
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, src.numel() / (time.perf_counter() - t) / 1e9)
    emit(suite="bus", gbps=best)


def disk(path, streams=16):
    """What the disk gives: the file read cold with O_DIRECT by `streams` dd processes, each
    over its own slice, after the pages were dropped."""
    size = os.path.getsize(path)
    drop(path)
    block = 16 * MiB
    blocks = size // block
    per = -(-blocks // streams)
    t = time.perf_counter()
    procs = [
        subprocess.Popen(["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct",
                          f"skip={i * per}", f"count={per}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(streams) if i * per < blocks
    ]
    ok = all(p.wait() == 0 for p in procs)
    dt = time.perf_counter() - t
    emit(suite="disk", streams=streams, gbps=blocks * block / dt / 1e9, ok=ok)


if __name__ == "__main__":
    main()
