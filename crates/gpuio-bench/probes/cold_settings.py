"""Cold reads of a 4 GiB file into cuda:0 through gpuio under several LocalIO settings (lanes,
chunk size, slots per lane), against `dd` reading it buffered (one stream, the kernel's
readahead) and with O_DIRECT, each after the page cache is dropped (needs root). Writes the
file first where missing.

    python cold_settings.py [FILE]

Prints one JSON line per case: GB/s.
"""

import json
import os
import subprocess
import sys
import time

SIZE = 4 << 30

CHILD = r"""
import sys, time, torch, gpuio
t = torch.empty(int(sys.argv[3]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
s = gpuio.Session(toml=sys.argv[2])
f = s.open(sys.argv[1])
t0 = time.perf_counter()
s.read(f, t)
print(round(t.numel() / (time.perf_counter() - t0) / 1e9, 2))
"""


def drop_cache():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cold_settings.bin"
    if not os.path.exists(path) or os.path.getsize(path) != SIZE:
        block = os.urandom(16 << 20)
        with open(path, "wb") as f:
            for _ in range(SIZE // len(block)):
                f.write(block)
            os.fsync(f.fileno())
    cases = [
        ("default", ""),
        ("lanes 16", "[localio]\nlanes = 16\n"),
        ("chunk 16 MiB", '[localio]\nchunk_size = "16 MiB"\n'),
        ("slots 4", "[localio]\nslots_per_lane = 4\n"),
        ("default again", ""),
    ]
    for name, toml in cases:
        drop_cache()
        r = subprocess.run([sys.executable, "-c", CHILD, path, toml, str(SIZE)],
                           capture_output=True, text=True, timeout=300)
        print(json.dumps({name: r.stdout.strip() or r.stderr[-300:]}), flush=True)
    for name, extra in (("dd buffered", []), ("dd O_DIRECT", ["iflag=direct"])):
        drop_cache()
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", *extra],
                       capture_output=True, check=True)
        print(json.dumps({name: round(SIZE / (time.perf_counter() - t0) / 1e9, 2)}), flush=True)


if __name__ == "__main__":
    main()
