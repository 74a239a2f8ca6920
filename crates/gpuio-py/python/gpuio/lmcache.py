"""A KV-cache store for LMCache on gpuio's tiers: LMCache's multiprocess server hands its L2
adapter chunks (opaque string keys, bytes in its pinned L1 memory) and gets them back; this
connector keeps them in pinned host memory gpuio holds, and spills the oldest to files when
that is full (written and read by gpuio's LocalIO: page-cache DMA for warm files, O_DIRECT
where asked). Every chunk carries a crc32c per 4 MiB piece, taken as the chunk is copied on
several threads: a chunk that does not match is a miss, never bytes. A batch with a buffer
that is not one run of bytes (or is read-only, to read into) is refused whole, before
anything is stored, dropped or read.

It is LMCache's ``native_plugin`` L2 adapter (the interface LMCache offers out-of-tree
stores in its recommended multiprocess mode: six methods, byte buffers and string keys, no
torch or LMCache types), so the server loads it by name::

    lmcache server --l1-size-gb 20 --l2-adapter '{"type": "native_plugin",
        "module_path": "gpuio.lmcache", "class_name": "GpuioConnector",
        "adapter_params": {"host_gb": 64, "root": "/mnt/nvme0/kv", "workers": 8},
        "max_capacity_gb": 500}'

Calls return at once with a future id; the work runs on ``workers`` threads. A batch's chunks
in host memory are copied in one call, their pieces spread over a thread per core; its
files are read and written on ``workers`` more (each gpuio call releases the GIL).
Completions are announced on an eventfd and collected by ``drain_completions``, as LMCache's
bridge expects. Importing it needs neither torch nor
LMCache.
"""

import bisect
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from . import Session, _gpuio, _invalid

__all__ = ["GpuioConnector"]


class _Extents:
    """First-fit allocation of byte ranges in one buffer, freed ranges merged."""

    def __init__(self, size):
        self._free = [(0, size)] if size > 0 else []

    def take(self, n):
        if n == 0:
            return 0
        for i, (at, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (at + n, length - n)
                return at
        return None

    def give(self, at, n):
        if n == 0:
            return
        i = bisect.bisect(self._free, (at, n))
        self._free.insert(i, (at, n))
        # Merge with the neighbours (the list stays sorted and disjoint).
        if i + 1 < len(self._free) and at + n == self._free[i + 1][0]:
            self._free[i] = (at, n + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == at:
            prev = self._free[i - 1]
            self._free[i - 1] = (prev[0], prev[1] + self._free[i][1])
            del self._free[i]


# A chunk is copied and checked in pieces of this size, side by side, each with its crc32c.
_PIECE = 4 << 20


class _Chunk:
    """Where a chunk is (host memory at `at`, or the file `path`), its size, its pieces'
    crc32c, and how many reads are copying it out (a chunk being read is neither spilled nor
    freed)."""

    __slots__ = ("size", "crc", "at", "path", "readers", "dead")

    def __init__(self, size, crc):
        self.size, self.crc, self.at, self.path = size, crc, None, None
        self.readers, self.dead = 0, False


def _check_buffers(views, write):
    """Refuses a batch, before anything is stored, dropped or read, where a buffer cannot be
    copied as one run of bytes (or, to `write`, is read-only): the caller's mistake, not a
    damaged chunk."""
    for v in views:
        if not v.c_contiguous:
            raise ValueError("a chunk's buffer is not contiguous")
        if write and v.readonly:
            raise ValueError("a chunk's buffer to read into is read-only")


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
        self._lock = threading.Lock()  # the index and the host tier's extents
        self._done_lock = threading.Lock()  # completions: never held across IO
        self._done = []
        self._closed = False
        self._ids = itertools.count(1)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._pool = ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="gpuio-lmc")
        # A batch's chunks stored and read side by side. Its tasks never wait on anything, so
        # a batch waiting on them cannot deadlock.
        self._io = ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="gpuio-lmc-io")
        self._files = itertools.count()
        self._pid = os.getpid()

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
        self._check_process()
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._done_lock:
            done, self._done = self._done, []
        return done

    def close(self):
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:  # a forked child: the tiers and their files are the parent's
            os.close(self._efd)
            return
        self._pool.shutdown(wait=True)
        self._io.shutdown(wait=True)
        with self._lock:
            for chunk in self._index.values():
                self._unlink(chunk.path)
            self._index.clear()
        os.close(self._efd)

    # What the workers do.

    def _check_process(self):
        """Refuses a forked child: the connector's threads stayed in the parent (its work
        would never run) and its event fd is the parent's too."""
        if os.getpid() != self._pid:
            raise _invalid("this GpuioConnector was made before fork(): make one in the child")

    def _submit(self, fn, *args):
        self._check_process()
        fid = next(self._ids)
        self._pool.submit(self._run, fid, fn, args)
        return fid

    def _run(self, fid, fn, args):
        try:
            ok, bools = fn(*args)
            result = (fid, ok, "", bools)
        except BaseException as e:  # a completion LMCache can see, not a lost future
            result = (fid, False, f"{type(e).__name__}: {e}", None)
        with self._done_lock:
            self._done.append(result)
        os.eventfd_write(self._efd, 1)

    def _set(self, keys, views):
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys for {len(views)} buffers")
        data = [_bytes_view(mv) for mv in views]
        _check_buffers(data, write=False)
        # Room first, in order (what fits is kept, as if stored one by one); then every
        # chunk's crc and copy side by side; then the index, in order.
        chunks = []
        with self._lock:
            try:
                for key, d in zip(keys, data):
                    self._drop(key)
                    chunk = _Chunk(len(d), None)
                    chunk.at = self._place(chunk.size)
                    chunks.append(chunk)
            except BaseException:
                for chunk in chunks:
                    self._release(chunk)
                raise
        # Spilled chunks are written on the IO threads while the host tier's are copied here,
        # all of them in one call. Whatever happens, every chunk is then indexed or released,
        # once every write has finished.
        failed = [None] * len(chunks)
        spilled = [i for i, c in enumerate(chunks) if c.at is None]
        held = [i for i, c in enumerate(chunks) if c.at is not None]
        writes = []
        try:
            for i in spilled:
                writes.append((i, self._io.submit(self._put_file, chunks[i], data[i])))
            if held:
                got = self._copy_held([(chunks[i].at, data[i]) for i in held], True)
                for i, r in zip(held, got):
                    if isinstance(r, Exception):
                        failed[i] = r
                    else:
                        chunks[i].crc = r
        except BaseException as e:
            for i in range(len(chunks)):
                failed[i] = failed[i] or e
            raise
        finally:
            for i, w in writes:
                try:
                    error = w.result()
                except BaseException as e:
                    error = e
                failed[i] = failed[i] or error
            with self._lock:
                for key, chunk, error in zip(keys, chunks, failed):
                    if error is None:
                        self._drop(key)
                        self._index[key] = chunk
                    else:
                        self._release(chunk)
        first = next((e for e in failed if e is not None), None)
        if first is not None:
            raise first
        return True, None

    def _put_file(self, chunk, data):
        """A spilled chunk's crc and its file; the error, if it failed."""
        try:
            chunk.crc = _gpuio.crc32c_pieces(data, _PIECE)
            chunk.path = self._spill_path()
            self._s.write(self._uri(chunk.path), data, durable=False)
            return None
        except Exception as e:
            return e

    def _get(self, keys, views):
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys for {len(views)} buffers")
        data = [_bytes_view(mv) for mv in views]
        _check_buffers(data, write=True)
        # Each chunk found is claimed (neither spilled nor freed while read); then the files'
        # are read on the IO threads while the host tier's are copied here, in one call.
        with self._lock:
            claims = [self._claim(key, d) for key, d in zip(keys, data)]
        crcs = [None] * len(keys)
        in_files = [i for i, c in enumerate(claims) if c is not None and c[1] is None]
        held = [i for i, c in enumerate(claims) if c is not None and c[1] is not None]
        reads = []
        try:
            for i in in_files:
                reads.append((i, self._io.submit(self._read_file, claims[i][2], data[i])))
            if held:
                got = self._copy_held([(claims[i][1], data[i]) for i in held], False)
                for i, r in zip(held, got):
                    if not isinstance(r, Exception):
                        crcs[i] = r
        finally:
            # Every read finished (none still writing the caller's buffers), every claim
            # settled, whatever was raised.
            for i, r in reads:
                try:
                    crcs[i] = r.result()
                except BaseException:
                    crcs[i] = None
            good = [c is not None and crc == c[0].crc for c, crc in zip(claims, crcs)]
            with self._lock:
                for key, claim, ok in zip(keys, claims, good):
                    if claim is not None:
                        self._settle(key, claim, ok)
        return True, good

    def _copy_held(self, jobs, to_host):
        """`copy_checked` of a batch's chunks in the host tier: each one's crcs, or the
        exception its copy raised. A batch that fails is copied again chunk by chunk, so that
        one bad buffer costs only its own chunk."""
        try:
            return _gpuio.copy_checked(self._host, jobs, to_host, _PIECE)
        except Exception as e:
            if len(jobs) == 1:
                return [e]
        out = []
        for job in jobs:
            try:
                out.append(_gpuio.copy_checked(self._host, [job], to_host, _PIECE)[0])
            except Exception as e:
                out.append(e)
        return out

    def _claim(self, key, data):
        """(chunk, host offset, path) of `key` where it is stored with `data`'s size, one more
        reader counted on it; None otherwise. Called with the lock held."""
        chunk = self._index.get(key)
        if chunk is None or chunk.size != len(data):
            return None
        chunk.readers += 1
        return chunk, chunk.at, chunk.path

    def _read_file(self, path, data):
        """A spilled chunk read into `data`: its pieces' crc32c, or None where it failed."""
        try:
            self._s.read(self._uri(path), data)
            return _gpuio.crc32c_pieces(data, _PIECE)
        except Exception:
            return None

    def _settle(self, key, claim, good):
        """A read of `claim` done: its reader uncounted, its room freed where it was dropped
        meanwhile, and forgotten where it came back damaged or gone (unless it moved
        meanwhile). Called with the lock held."""
        chunk, at, path = claim
        chunk.readers -= 1
        if chunk.dead and chunk.readers == 0:
            self._release(chunk)
        elif not good and self._index.get(key) is chunk and (chunk.at, chunk.path) == (at, path):
            self._drop(key)

    def _exists(self, keys):
        with self._lock:
            return True, [k in self._index for k in keys]

    def _delete(self, keys):
        with self._lock:
            return True, [self._drop(k) for k in keys]

    # Tiers (called with the lock held).

    def _place(self, n):
        """Room for `n` bytes in host memory, the oldest host chunks no read is copying
        spilled to files first where there is a root; None where it does not fit. (Spills
        write with the lock held: stores and reads wait for them, completions do not.)"""
        if self._host is None or n > len(self._host):
            return None
        at = self._extents.take(n)
        while at is None and self._root is not None:
            victim = next(
                (c for c in self._index.values() if c.at is not None and c.readers == 0), None
            )
            if victim is None:
                return None
            self._spill(victim)
            at = self._extents.take(n)
        return at

    def _spill(self, chunk):
        path = self._spill_path()
        try:
            # Straight from the pinned tier to the new file.
            self._s.copy(self._host, self._uri(path), size=chunk.size, src_offset=chunk.at)
        except BaseException:
            self._unlink(path)
            raise
        self._extents.give(chunk.at, chunk.size)
        chunk.path, chunk.at = path, None

    def _drop(self, key):
        """Forgets `key`; its room goes once no read is copying it."""
        chunk = self._index.pop(key, None)
        if chunk is None:
            return False
        if chunk.readers > 0:
            chunk.dead = True
        else:
            self._release(chunk)
        return True

    def _release(self, chunk):
        if chunk.at is not None:
            self._extents.give(chunk.at, chunk.size)
            chunk.at = None
        self._unlink(chunk.path)
        chunk.path = None

    def _unlink(self, path):
        if path is not None:
            try:
                os.remove(path)
            except OSError:  # gone already, or not ours to remove: nothing to undo
                pass

    def _spill_path(self):
        if self._root is None:
            raise _gpuio.Error("no room in host memory and no root for files", -2,
                               "GPUIO_ERROR_NOMEM")
        return os.path.join(self._root, f"chunk-{os.getpid()}-{next(self._files)}.kv")

    def _uri(self, path):
        return f"localio://{os.path.abspath(path)}?direct=1" if self._direct else path
