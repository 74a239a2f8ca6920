"""A KV-cache store for LMCache on gpuio's tiers: LMCache's multiprocess server hands its L2
adapter chunks (opaque string keys, bytes in its pinned L1 memory) and gets them back; this
connector keeps them in pinned host memory gpuio holds, and spills the oldest to files when
that is full (written and read by gpuio's LocalIO: page-cache DMA for warm files, O_DIRECT
where asked). Every chunk carries its crc32c: a chunk that does not match is a miss, never
bytes.

It is LMCache's ``native_plugin`` L2 adapter (the interface LMCache offers out-of-tree
stores in its recommended multiprocess mode: six methods, byte buffers and string keys, no
torch or LMCache types), so the server loads it by name::

    lmcache server --l1-size-gb 20 --l2-adapter '{"type": "native_plugin",
        "module_path": "gpuio.lmcache", "class_name": "GpuioConnector",
        "adapter_params": {"host_gb": 64, "root": "/mnt/nvme0/kv", "workers": 8},
        "max_capacity_gb": 500}'

Calls return at once with a future id; the work runs on ``workers`` threads (each gpuio call
releases the GIL), and completions are announced on an eventfd and collected by
``drain_completions``, as LMCache's bridge expects. Importing it needs neither torch nor
LMCache.
"""

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from . import Session, _gpuio

__all__ = ["GpuioConnector"]


class _Extents:
    """First-fit allocation of byte ranges in one buffer, freed ranges merged."""

    def __init__(self, size):
        self._free = [(0, size)] if size > 0 else []

    def take(self, n):
        for i, (at, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (at + n, length - n)
                return at
        return None

    def give(self, at, n):
        self._free.append((at, n))
        self._free.sort()
        merged = []
        for a, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((a, length))
        self._free = merged


class _Chunk:
    __slots__ = ("size", "crc", "at", "path")

    def __init__(self, size, crc, at=None, path=None):
        self.size, self.crc, self.at, self.path = size, crc, at, path


def _bytes_view(mv):
    """LMCache's buffers are ctypes-backed ('<B'): the byte view gpuio reads and writes."""
    view = mv if isinstance(mv, memoryview) else memoryview(mv)
    return view if view.format == "B" else view.cast("B")


class GpuioConnector:
    """LMCache's ``native_plugin`` L2 connector over gpuio: ``host_gb`` of pinned host memory
    first, then files under ``root`` (none: host memory only, and a chunk that does not fit
    is refused), written ``odirect`` where asked. ``session`` or ``toml`` configure gpuio."""

    def __init__(self, host_gb=1.0, root=None, workers=4, odirect=False, session=None,
                 toml=None):
        self._s = session if session is not None else Session(toml=toml)
        size = int(float(host_gb) * (1 << 30))
        self._host = self._s.alloc_host(size) if size > 0 else None
        self._extents = _Extents(size)
        self._root = root
        if root is not None:
            os.makedirs(root, exist_ok=True)
        self._direct = bool(odirect)
        self._index = {}  # key -> _Chunk, oldest first (dicts keep insertion order)
        self._lock = threading.Lock()
        self._done = []
        self._ids = itertools.count(1)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._pool = ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="gpuio-lmc")
        self._files = itertools.count()

    # The six methods LMCache's bridge calls (and the optional delete).

    def event_fd(self):
        return self._efd

    def submit_batch_set(self, keys, memoryviews):
        return self._submit(self._set, list(keys), list(memoryviews))

    def submit_batch_get(self, keys, memoryviews):
        return self._submit(self._get, list(keys), list(memoryviews))

    def submit_batch_exists(self, keys):
        return self._submit(self._exists, list(keys))

    def submit_batch_delete(self, keys):
        return self._submit(self._delete, list(keys))

    def drain_completions(self):
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self):
        self._pool.shutdown(wait=True)
        with self._lock:
            for chunk in self._index.values():
                self._unlink(chunk)
            self._index.clear()
        os.close(self._efd)

    # What the workers do.

    def _submit(self, fn, *args):
        fid = next(self._ids)
        self._pool.submit(self._run, fid, fn, args)
        return fid

    def _run(self, fid, fn, args):
        try:
            ok, bools = fn(*args)
            result = (fid, ok, "", bools)
        except Exception as e:  # a completion LMCache can see, not a lost future
            result = (fid, False, f"{type(e).__name__}: {e}", None)
        with self._lock:
            self._done.append(result)
        os.eventfd_write(self._efd, 1)

    def _set(self, keys, views):
        for key, mv in zip(keys, views):
            data = _bytes_view(mv)
            chunk = _Chunk(len(data), _gpuio.crc32c(data))
            with self._lock:
                self._drop(key)
                chunk.at = self._place(chunk.size)
            if chunk.at is not None:
                self._s.copy(data, self._host, size=chunk.size, dst_offset=chunk.at)
            else:
                chunk.path = self._spill_path()
                self._s.write(self._uri(chunk.path), data, durable=False)
            with self._lock:
                self._drop(key)
                self._index[key] = chunk
        return True, None

    def _get(self, keys, views):
        loaded = []
        for key, mv in zip(keys, views):
            data = _bytes_view(mv)
            with self._lock:
                chunk = self._index.get(key)
            if chunk is None or chunk.size != len(data):
                loaded.append(False)
                continue
            try:
                if chunk.at is not None:
                    self._s.copy(self._host, data, size=chunk.size, src_offset=chunk.at)
                else:
                    self._s.read(self._uri(chunk.path), data)
                good = _gpuio.crc32c(data) == chunk.crc
            except _gpuio.Error:
                good = False
            if not good:  # damaged or gone: a miss, and forgotten
                with self._lock:
                    if self._index.get(key) is chunk:
                        self._drop(key)
            loaded.append(good)
        return True, loaded

    def _exists(self, keys):
        with self._lock:
            return True, [k in self._index for k in keys]

    def _delete(self, keys):
        with self._lock:
            return True, [self._drop(k) for k in keys]

    # Tiers (called with the lock held).

    def _place(self, n):
        """Room for `n` bytes in host memory, the oldest host chunks spilled to files first
        where there is a root; None where it does not fit."""
        if self._host is None or n > len(self._host):
            return None
        at = self._extents.take(n)
        while at is None and self._root is not None:
            victim = next(((k, c) for k, c in self._index.items() if c.at is not None), None)
            if victim is None:
                return None
            self._spill(*victim)
            at = self._extents.take(n)
        return at

    def _spill(self, key, chunk):
        path = self._spill_path()
        self._s.write(self._uri(path), self._host_view(chunk), durable=False)
        self._extents.give(chunk.at, chunk.size)
        chunk.at, chunk.path = None, path

    def _host_view(self, chunk):
        import numpy  # the host tier's bytes, viewed in place

        return memoryview(numpy.asarray(self._host))[chunk.at : chunk.at + chunk.size]

    def _drop(self, key):
        chunk = self._index.pop(key, None)
        if chunk is None:
            return False
        if chunk.at is not None:
            self._extents.give(chunk.at, chunk.size)
        self._unlink(chunk)
        return True

    def _unlink(self, chunk):
        if chunk.path is not None:
            try:
                os.remove(chunk.path)
            except FileNotFoundError:
                pass

    def _spill_path(self):
        if self._root is None:
            raise _gpuio.Error("no room in host memory and no root for files", -2,
                               "GPUIO_ERROR_NOMEM")
        return os.path.join(self._root, f"chunk-{os.getpid()}-{next(self._files)}.kv")

    def _uri(self, path):
        return f"localio://{os.path.abspath(path)}?direct=1" if self._direct else path
