"""Which pattern reads a cold 4 GiB safetensors file fastest on this disk: one sequential
stream of 16 MiB `pread`s, several readers each over its own contiguous range (gpuio's
lanes), or fastsafetensors' way without GDS (O_DIRECT by default, 16 MiB bounce buffers).
Cases, in rounds, in an order turned each round, the page cache dropped before each (needs
root):

- gpuio with its default lanes, with 1 and 2 lanes, and with 1 lane of 16 MiB chunks;
- fastsafetensors (`nogds`), where installed;
- Python threads reading into host memory: one stream of 16 MiB reads (with and without
  `FADV_SEQUENTIAL`), 8 contiguous ranges, and 8 threads taking 4 MiB chunks in turn behind
  one thread that asks for the file 64 MiB at a time ahead of them (`FADV_WILLNEED`);
- `dd` (buffered, 16 MiB blocks).

    python cold_pattern.py [FILE] [ROUNDS] [depth | ahead | turn | order OTHER]

With `depth`, other cases: gpuio with O_DIRECT and with 16 MiB chunks, 16 threads' O_DIRECT
16 MiB reads, and fastsafetensors with and without O_DIRECT (its default where the file
system allows it). With `order OTHER`: gpuio's O_DIRECT reads by this build and by the
build installed in the directory OTHER, with fastsafetensors. With `ahead`: whether
buffered readers over contiguous ranges reach O_DIRECT's rate when each asks for its chunks
ahead (`FADV_WILLNEED`) or when there are more of them. With `turn`: readers taking the
next block of the file in turn (fastsafetensors' pattern), O_DIRECT and buffered.

Prints the disk's queue settings, then one JSON line per case and round: GB/s.
"""

import json
import os
import struct
import subprocess
import sys
import time

from scratch import GPUIO_READ, disk_settings, drop_cache, run_child, timed_threads

SIZE = 4 << 30
CHUNK = 4 << 20

FASTSAFETENSORS = r"""
import sys, time, torch
from fastsafetensors import SafeTensorsFileLoader, SingleGroup
torch.empty(1, device="cuda:0")
t0 = time.perf_counter()
fl = SafeTensorsFileLoader(SingleGroup(), torch.device("cuda:0"), nogds=True)
fl.add_filenames({0: [sys.argv[1]]})
fb = fl.copy_files_to_device()
n = fb.get_tensor("x").numel()
torch.cuda.synchronize()
print(round(n / (time.perf_counter() - t0) / 1e9, 2))
"""


def safetensors_file(path):
    """One U8 tensor filling SIZE bytes of 16 MiB random blocks, written once."""
    head = json.dumps({"x": {"dtype": "U8", "shape": [SIZE], "data_offsets": [0, SIZE]}})
    head = head.encode() + b" " * (-len(head) % 8)
    if os.path.exists(path) and os.path.getsize(path) == 8 + len(head) + SIZE:
        return
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _ in range(SIZE // (16 << 20)):
            f.write(os.urandom(16 << 20))
        os.fsync(f.fileno())


def direct_uri(path):
    """`path`'s URI asking gpuio for O_DIRECT (percent-encoded: any name works)."""
    from urllib.parse import quote

    return "localio://" + quote(os.fsencode(os.path.abspath(path))) + "?direct=1"


def child(script, *args, env=None):
    out = run_child(script, *args, env=env)
    try:
        return float(out)
    except ValueError:
        return out


def threads(path, ranges, chunk, advice=None, ahead=False, hint=None):
    """Each thread preads `chunk` bytes at the offsets its range yields; with `ahead`, one
    more thread asks for the file 64 MiB at a time, at most 256 MiB ahead of the readers;
    with `hint` = k, each thread asks for its chunk k chunks on (`FADV_WILLNEED`, which
    puts all of a chunk's reads in flight at once) before reading each chunk (0: the chunk
    itself)."""
    fd = os.open(path, os.O_RDONLY)
    if advice is not None:
        os.posix_fadvise(fd, 0, 0, advice)
    size = os.fstat(fd).st_size
    done = [0]

    def work(offsets):
        buf = bytearray(chunk)
        n = 0
        offsets = list(offsets)
        if hint:
            for off in offsets[:hint]:
                os.posix_fadvise(fd, off, chunk, os.POSIX_FADV_WILLNEED)
        for i, off in enumerate(offsets):
            if hint is not None and i + hint < len(offsets):
                os.posix_fadvise(fd, offsets[i + hint], chunk, os.POSIX_FADV_WILLNEED)
            n += os.preadv(fd, [buf], off)
            done[0] += chunk
        return n

    def prefetch():
        step = 64 << 20
        for off in range(0, size, step):
            while off - done[0] > (256 << 20):
                time.sleep(0.0005)
            os.posix_fadvise(fd, off, step, os.POSIX_FADV_WILLNEED)
        return 0

    jobs = [(work, r) for r in ranges] + ([(prefetch,)] if ahead else [])
    rate = timed_threads(lambda f, *a: f(*a), jobs)
    os.close(fd)
    return rate


def direct_threads(path, n, chunk):
    """`n` threads, each O_DIRECT `pread`s of `chunk` bytes over its contiguous range."""
    import mmap

    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size // chunk * chunk

    def work(lo, hi):
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        return sum(os.preadv(fd, [buf], off) for off in range(lo, hi, chunk))

    per = size // chunk // n * chunk
    rate = timed_threads(work, [(t * per, size if t == n - 1 else (t + 1) * per)
                                for t in range(n)])
    os.close(fd)
    return rate


def in_turn(path, n, chunk, direct):
    """`n` threads taking the next `chunk` bytes of the file in turn, as fastsafetensors'
    readers do (its 16 MiB of bounce buffers are 32 slots of 512 KiB, two per thread):
    one ascending stream with `n` reads in flight."""
    import mmap

    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    size = os.fstat(fd).st_size // chunk * chunk
    offsets = iter(range(0, size, chunk))  # shared: each next() is one step under the GIL

    def work():
        buf = mmap.mmap(-1, chunk)
        return sum(os.preadv(fd, [buf], off) for off in offsets)

    rate = timed_threads(work, [()] * n)
    os.close(fd)
    return rate


def dd(path):
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], capture_output=True,
                   check=True)
    return round(os.path.getsize(path) / (time.perf_counter() - t0) / 1e9, 2)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cold_pattern.safetensors"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    depth = len(sys.argv) > 3 and sys.argv[3] == "depth"
    ahead = len(sys.argv) > 3 and sys.argv[3] == "ahead"
    turn = len(sys.argv) > 3 and sys.argv[3] == "turn"
    other = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "order" else None
    safetensors_file(path)
    print(json.dumps({"disk": disk_settings(path)}), flush=True)
    size = os.path.getsize(path)
    n = size // CHUNK + 1
    cases = {
        "gpuio default": lambda: child(GPUIO_READ, path, "", str(size)),
        "gpuio 1 lane": lambda: child(GPUIO_READ, path, "[localio]\nlanes = 1\n", str(size)),
        "gpuio 2 lanes": lambda: child(GPUIO_READ, path, "[localio]\nlanes = 2\n", str(size)),
        "gpuio 1 lane, 16 MiB chunks": lambda: child(
            GPUIO_READ, path, '[localio]\nlanes = 1\nchunk_size = "16 MiB"\n', str(size)),
        "1 thread, 16 MiB reads": lambda: threads(path, [range(0, size, 16 << 20)], 16 << 20),
        "1 thread, 16 MiB reads, FADV_SEQUENTIAL": lambda: threads(
            path, [range(0, size, 16 << 20)], 16 << 20, advice=os.POSIX_FADV_SEQUENTIAL),
        "8 threads, contiguous ranges": lambda: threads(
            path, [range(t * n // 8 * CHUNK, (t + 1) * n // 8 * CHUNK, CHUNK) for t in range(8)],
            CHUNK),
        "8 threads in turn behind WILLNEED": lambda: threads(
            path, [range(t * CHUNK, size, 8 * CHUNK) for t in range(8)], CHUNK, ahead=True),
        "dd buffered 16 MiB": lambda: dd(path),
    }
    if depth:  # how deep a queue of how large reads the disk wants, O_DIRECT and buffered
        direct = direct_uri(path)
        big = '[localio]\nchunk_size = "16 MiB"\n'
        cases = {
            "gpuio default": cases["gpuio default"],
            "gpuio, 16 MiB chunks": lambda: child(GPUIO_READ, path, big, str(size)),
            "gpuio O_DIRECT": lambda: child(GPUIO_READ, direct, "", str(size)),
            "gpuio O_DIRECT, 16 MiB chunks": lambda: child(GPUIO_READ, direct, big, str(size)),
            "gpuio O_DIRECT, 16 lanes, 16 MiB chunks": lambda: child(
                GPUIO_READ, direct, big + "lanes = 16\n", str(size)),
            "16 threads, O_DIRECT 16 MiB reads": lambda: direct_threads(path, 16, 16 << 20),
        }
    if ahead:  # buffered readers with their IO in flight ahead of them, or more of them
        def ranges(k):
            return [range(t * n // k * CHUNK, (t + 1) * n // k * CHUNK, CHUNK) for t in range(k)]

        cases = {
            "gpuio default": cases["gpuio default"],
            "8 threads, contiguous ranges": cases["8 threads, contiguous ranges"],
            "8 threads, WILLNEED each chunk": lambda: threads(path, ranges(8), CHUNK, hint=0),
            "8 threads, WILLNEED 1 chunk on": lambda: threads(path, ranges(8), CHUNK, hint=1),
            "8 threads, WILLNEED 3 chunks on": lambda: threads(path, ranges(8), CHUNK, hint=3),
            "16 threads, contiguous ranges": lambda: threads(path, ranges(16), CHUNK),
            "32 threads, contiguous ranges": lambda: threads(path, ranges(32), CHUNK),
            "8 threads, O_DIRECT 4 MiB reads": lambda: direct_threads(path, 8, CHUNK),
            "16 threads, O_DIRECT 16 MiB reads": lambda: direct_threads(path, 16, 16 << 20),
        }
    if turn:  # one ascending stream of reads in flight, as fastsafetensors reads
        k = 512 << 10
        cases = {
            "gpuio default": cases["gpuio default"],
            "8 threads, contiguous ranges": cases["8 threads, contiguous ranges"],
            "16 threads in turn, O_DIRECT 512 KiB": lambda: in_turn(path, 16, k, True),
            "8 threads in turn, O_DIRECT 512 KiB": lambda: in_turn(path, 8, k, True),
            "16 threads in turn, O_DIRECT 4 MiB": lambda: in_turn(path, 16, CHUNK, True),
            "16 threads in turn, O_DIRECT 1 MiB": lambda: in_turn(path, 16, 1 << 20, True),
            "16 threads in turn, buffered 512 KiB": lambda: in_turn(path, 16, k, False),
            "16 threads in turn, buffered 4 MiB": lambda: in_turn(path, 16, CHUNK, False),
        }
    if other:  # O_DIRECT chunks in lanes' runs (this build) against another build's
        direct = direct_uri(path)
        b = {"PYTHONPATH": other}
        cases = {
            "gpuio default": cases["gpuio default"],
            "gpuio O_DIRECT": lambda: child(GPUIO_READ, direct, "", str(size)),
            "other: gpuio O_DIRECT": lambda: child(GPUIO_READ, direct, "", str(size), env=b),
            "other: gpuio O_DIRECT, 16 MiB chunks": lambda: child(
                GPUIO_READ, direct, '[localio]\nchunk_size = "16 MiB"\n', str(size), env=b),
            "other: gpuio O_DIRECT, 16 lanes": lambda: child(
                GPUIO_READ, direct, "[localio]\nlanes = 16\n", str(size), env=b),
        }
    try:
        import fastsafetensors  # noqa: F401
    except ImportError:
        print(json.dumps({"fastsafetensors": "not installed"}), flush=True)
    else:
        cases["fastsafetensors"] = lambda: child(FASTSAFETENSORS, path)
        if depth:
            cases["fastsafetensors, buffered"] = lambda: child(
                FASTSAFETENSORS, path, env={"FASTSAFETENSORS_ODIRECT": "0"})
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            drop_cache()
            print(json.dumps({"round": r + 1, name: cases[name]()}), flush=True)


if __name__ == "__main__":
    main()
