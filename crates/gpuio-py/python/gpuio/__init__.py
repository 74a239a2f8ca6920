"""gpuio: move data between GPU memory, host memory, files and other nodes.

    import gpuio, torch
    s = gpuio.Session()
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    s.read("weights.bin", t)            # file -> CUDA tensor, in place
    s.write("copy.bin", t)              # CUDA tensor -> file

Ends of a transfer may be URIs or opened resources (``s.open``), gpuio buffers
(``s.alloc_host``, ``s.alloc_device``), CUDA tensors and arrays (PyTorch, CuPy, JAX: borrowed in
place), NumPy arrays, CPU tensors, ``bytearray``/``memoryview`` (read and written in place to
and from files, other nodes and GPU memory), ``bytes`` (a source). Every call releases the GIL
while data moves; failures raise :class:`gpuio.Error`, whose ``code`` is one
of the ``GPUIO_ERROR_*`` codes the C API shares.
"""

import json

from . import _gpuio, _interop
from ._gpuio import (
    DeviceBuffer,
    Error,
    HostBuffer,
    OnDemandArray,
    ResidentArray,
    Resource,
    __version__,
)
from ._gpuio import device_header

__all__ = [
    "DeviceBuffer",
    "Error",
    "HostBuffer",
    "OnDemandArray",
    "PageCache",
    "Request",
    "ResidentArray",
    "Resource",
    "Session",
    "__version__",
    "device_header",
    "info",
]

# gpuio memory: a transfer end as it is.
_MEMORY = (HostBuffer, DeviceBuffer)
# Ends that Python's own host memory moves to and from in place.
_IN_PLACE = _interop.NATIVE

Error.message = property(lambda e: e.args[0], doc="What went wrong.")
Error.code = property(lambda e: e.args[1], doc="The GPUIO_ERROR_* code (a negative int).")
Error.name = property(lambda e: e.args[2], doc="The code's name, e.g. GPUIO_ERROR_IO.")


def _invalid(message):
    return Error(message, -3, "GPUIO_ERROR_INVALID_ARG")


def _nonnegative(**values):
    for name, v in values.items():
        if v is not None and v < 0:
            raise _invalid(f"{name} {v} is negative")


def info():
    """Devices, capabilities and IO paths (what ``gpuio info`` prints), as a dict."""
    return json.loads(_gpuio.info_json())


class Request:
    """An asynchronous transfer: ``done()`` polls, ``wait()`` blocks and returns the bytes
    moved (or raises its error), ``await request`` works in asyncio, ``cancel()`` stops it
    while it is still queued. The transfer holds both ends until it is done, even if the
    request object is dropped."""

    __slots__ = ("_handle",)

    def __init__(self, handle):
        self._handle = handle

    def done(self):
        return self._handle.done()

    def wait(self):
        return self._handle.wait()

    def cancel(self):
        return self._handle.cancel()

    @property
    def status(self):
        return self._handle.status

    def __await__(self):
        import asyncio

        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self._handle.wait).__await__()


class Session(_gpuio.Session):
    """A gpuio session: ``Session()`` (defaults, ``$GPUIO_CONFIG``), ``Session(config=path)``
    or ``Session(toml=text)``; ``GPUIO_*`` environment variables override either."""

    def _resource(self, end, write):
        return self.open(end, write=write) if isinstance(end, str) else end

    def _ends(self, src, dst, write_dst):
        if write_dst and isinstance(src, str) and src == dst:
            raise _invalid(f"{src} onto itself: opening the destination would truncate it")
        s = _interop.resolve(self, self._resource(src, False), writable=False)
        d = _interop.resolve(self, self._resource(dst, write_dst), writable=True)
        return s, d

    def _move(self, s, src_offset, d, dst_offset, size, durable=False):
        _nonnegative(offset=src_offset, dst_offset=dst_offset, size=size)
        # Host memory gpuio does not own moves in place to and from resources, GPU memory and
        # gpuio host buffers (on the IO threads, the GIL released); to and from other host
        # memory it is copied.
        if isinstance(s, memoryview) and isinstance(d, _IN_PLACE) or (
            isinstance(d, memoryview) and isinstance(s, _IN_PLACE)
        ):
            return self._transfer(s, src_offset, d, dst_offset, size, durable)
        if isinstance(s, memoryview):
            s = s.tobytes()
        if isinstance(d, memoryview):  # host to host, neither gpuio's: a plain copy
            if dst_offset + size > d.nbytes:
                raise _invalid(
                    f"{size} bytes at offset {dst_offset} do not fit a {d.nbytes}-byte destination"
                )
            if src_offset + size > len(s):
                raise _invalid(f"{size} bytes at offset {src_offset} of a {len(s)}-byte source")
            d[dst_offset : dst_offset + size] = s[src_offset : src_offset + size]
            return size
        return self._transfer(s, src_offset, d, dst_offset, size, durable)

    def read(self, src, dst, offset=0, size=None):
        """Reads ``size`` bytes (default: all of ``dst``) from ``src`` (a URI or resource) at
        ``offset`` into ``dst``; returns the bytes read."""
        if type(src) is Resource and type(dst) in _MEMORY and offset >= 0:  # the hot call
            return self._transfer(src, offset, dst, 0, len(dst) if size is None else size)
        s, d = self._ends(src, dst, write_dst=False)
        return self._move(s, offset, d, 0, _interop.nbytes(d) if size is None else size)

    def write(self, dst, src, offset=0, size=None, durable=False):
        """Writes ``size`` bytes (default: all of ``src``) of ``src`` to ``dst`` (a URI, whose
        file is created or truncated, or a resource) at ``offset``; returns the bytes
        written. ``durable``: on stable storage when it returns (a file's writeback starts as
        the bytes land, then one ``fdatasync``; another node's export is flushed)."""
        if type(dst) is Resource and type(src) in _MEMORY and offset >= 0:  # the hot call
            n = len(src) if size is None else size
            return self._transfer(src, 0, dst, offset, n, durable)
        s, d = self._ends(src, dst, write_dst=True)
        return self._move(s, 0, d, offset, _interop.nbytes(s) if size is None else size, durable)

    def copy(self, src, dst, size=None, src_offset=0, dst_offset=0, durable=False):
        """Copies ``size`` bytes (default: the smaller of the two) between any two ends (a URI
        destination's file is created or truncated); ``durable`` as for :meth:`write`."""
        s, d = self._ends(src, dst, write_dst=True)
        if size is None:
            size = min(_interop.nbytes(s) - src_offset, _interop.nbytes(d) - dst_offset)
        return self._move(s, src_offset, d, dst_offset, size, durable)

    def _submit_ends(self, s, src_offset, d, dst_offset, size, priority, deadline):
        _nonnegative(offset=src_offset, dst_offset=dst_offset, size=size)
        if isinstance(s, (memoryview, bytes)) or isinstance(d, memoryview):
            raise TypeError(
                "asynchronous transfers run after the call returns, so both ends must be "
                "memory gpuio can hold: gpuio buffers, CUDA tensors or resources"
            )
        return Request(self._submit(s, src_offset, d, dst_offset, size, priority, deadline))

    # The asynchronous calls take the scheduler's class, ``priority``: inference_realtime,
    # training_forward (the default), training_backward, checkpoint, engram_sync or
    # background; and a ``deadline`` in seconds from now, which orders requests within a
    # class and is counted as met or missed.

    def read_async(self, src, dst, offset=0, size=None, priority=None, deadline=None):
        """:meth:`read`, queued on the scheduler: returns a :class:`Request`."""
        s, d = self._ends(src, dst, write_dst=False)
        size = _interop.nbytes(d) if size is None else size
        return self._submit_ends(s, offset, d, 0, size, priority, deadline)

    def write_async(self, dst, src, offset=0, size=None, priority=None, deadline=None):
        """:meth:`write`, queued on the scheduler: returns a :class:`Request`."""
        s, d = self._ends(src, dst, write_dst=True)
        size = _interop.nbytes(s) if size is None else size
        return self._submit_ends(s, 0, d, offset, size, priority, deadline)

    def copy_async(self, src, dst, size=None, src_offset=0, dst_offset=0, priority=None,
                   deadline=None):
        """:meth:`copy`, queued on the scheduler: returns a :class:`Request`."""
        s, d = self._ends(src, dst, write_dst=True)
        if size is None:
            size = min(_interop.nbytes(s) - src_offset, _interop.nbytes(d) - dst_offset)
        return self._submit_ends(s, src_offset, d, dst_offset, size, priority, deadline)

    def lease(self, priority, deadline=None):
        """Holds scheduler class ``priority`` while the caller runs IO of its own (a kernel
        that reads host memory, a copy on its own stream): less urgent queued requests and
        leases — gpuio.ai's prefetches and write-backs among them — wait until it is released,
        at most the scheduler's ``max_wait``. A context manager: ``with s.lease(
        "inference_realtime"): ...``; ``deadline`` (seconds) counts as met or missed. Leases
        do not nest: taking a less urgent one (a gpuio.ai store, say) while holding one waits
        the scheduler's ``max_wait`` for itself."""
        return self._lease(priority, deadline)

    def device_buffer(self, obj, writable=True):
        """``obj`` (a CUDA tensor or array) borrowed once as a gpuio :class:`DeviceBuffer`,
        for loops that pass the same memory every step: borrowing checks it with the driver
        and waits for the GPU's queued work, which a DeviceBuffer passed later does not
        repeat — finish work queued on the tensor first (``torch.cuda.synchronize()``)."""
        d = _interop.resolve(self, obj, writable)
        if not isinstance(d, DeviceBuffer):
            raise TypeError("device_buffer borrows GPU memory: a CUDA tensor or array")
        return d

    def batch(self, transfers):
        """Runs ``(src, dst, size, src_offset, dst_offset)`` tuples (the offsets optional) as
        one batch: sorted, adjacent transfers merged, grouped by engine; waits for all and
        returns a report (requests, segments, bytes). One failure raises, naming each."""
        ops, opened = [], {}

        def end(x, write):
            # Each URI opened once per batch (a destination's file created or truncated once).
            if not isinstance(x, str):
                return x
            if (x, not write) in opened:
                raise _invalid(f"{x} is both read and written in one batch")
            if (x, write) not in opened:
                opened[(x, write)] = self.open(x, write=write)
            return opened[(x, write)]

        for t in transfers:
            src, dst, size, src_offset, dst_offset = (tuple(t) + (0, 0))[:5]
            _nonnegative(size=size, src_offset=src_offset, dst_offset=dst_offset)
            s = _interop.resolve(self, end(src, False), writable=False)
            d = _interop.resolve(self, end(dst, True), writable=True)
            if isinstance(s, (memoryview, bytes)) or isinstance(d, memoryview):
                raise TypeError("a batch moves between gpuio buffers, CUDA tensors and resources")
            ops.append((s, src_offset, d, dst_offset, size))
        return self._batch(ops)

    def gather(self, pool, indices, out, row_bytes=None, out_offset=0):
        """Gathers rows from ``pool`` (a gpuio HostBuffer, pinned for the GPU's paths) into
        ``out`` (GPU memory): output row ``i`` is pool row ``indices[i]``. ``row_bytes``
        defaults to ``out``'s size over the number of indices."""
        if not isinstance(pool, HostBuffer):
            raise TypeError("a gather's pool is a gpuio HostBuffer (Session.alloc_host)")
        d = _interop.resolve(self, out, writable=True)
        if not isinstance(d, DeviceBuffer):
            raise TypeError("a gather writes GPU memory: a CUDA tensor or a gpuio DeviceBuffer")
        _nonnegative(out_offset=out_offset, row_bytes=row_bytes)
        idx = _interop.indices_bytes(indices)
        count = len(idx) // 8
        if row_bytes is None:
            if count == 0 or (len(d) - out_offset) % count:
                raise ValueError("give row_bytes: it does not follow from out's size")
            row_bytes = (len(d) - out_offset) // count
        return self._gather(pool, row_bytes, idx, d, out_offset)

    def page_cache(
        self, gpu=0, page_size=4096, capacity=256 << 20, slots=None, in_place=True, admit_after=None
    ):
        """A :class:`PageCache` of ``capacity`` bytes of GPU ``gpu``'s memory for on-demand
        arrays, its misses served through this session. Read-only arrays over warm files (or
        gpuio host memory) read in place, from the pinned pages, where the device can, unless
        ``in_place=False``; there a page not cached serves its first ``admit_after`` touches
        (default 128) from the source, only the bytes asked for, and the next one caches it
        (``admit_after=0``: every miss caches its page)."""
        return PageCache(self, gpu, page_size, capacity, slots, in_place, admit_after)


def _itemsize(dtype):
    size = getattr(dtype, "itemsize", None)  # a torch or NumPy dtype instance
    if not isinstance(size, int):  # a name, or a scalar type such as numpy.float32
        import numpy

        size = numpy.dtype(dtype).itemsize
    return size


class PageCache(_gpuio.PageCache):
    """A page cache in GPU memory for on-demand arrays (``Session.page_cache``): kernels
    index arrays bigger than GPU memory through it, compiled with :func:`device_header` in
    front (``gpuio_array<T> a(desc); a[i]``), each taking an array's ``descriptor``."""

    def __init__(
        self, session, gpu=0, page_size=4096, capacity=256 << 20, slots=None, in_place=True, admit_after=None
    ):
        self._session = session

    def array(self, source, dtype="uint8", length=None, offset=0, writable=False):
        """An :class:`OnDemandArray` of ``length`` elements of ``dtype`` (default: as many as
        ``source`` holds from ``offset``) over ``source``: a URI or path (opened for reading,
        or for reading and writing where ``writable``), an opened resource, or gpuio memory.
        ``writable``: pages kernels store into go back to the source."""
        _nonnegative(offset=offset, length=length)
        if isinstance(source, str):
            source = self._session.open(source, update=writable)
        item = _itemsize(dtype)
        if item <= 0:
            raise _invalid(f"elements of {item} bytes")
        if length is None:
            total = source.size() if isinstance(source, Resource) else len(source)
            length = max(total - offset, 0) // item
        return self._array(source, length * item, item, offset, writable)


from . import ai  # noqa: E402  (gpuio.ai: the AI memory tier, after the names it uses)
