"""What the probes share: a file of random bytes to read, and dropping the page cache."""

import os
import subprocess


def random_file(path, size):
    """Writes `size` bytes (a multiple of 16 MiB) of one random 16 MiB block repeated to
    `path`, durably, unless a file of that size is there already."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    block = os.urandom(16 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        os.fsync(f.fileno())


def drop_cache():
    """Writes dirty pages back, then drops the page cache (needs root)."""
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
