"""safetensors checkpoints through gpuio, with the ``safetensors`` package's API:

    from gpuio.safetensors import load_file, safe_open
    weights = load_file("model.safetensors", device="cuda:0")
    with safe_open("model.safetensors", framework="pt", device="cuda:0") as f:
        for name in f.keys():
            t = f.get_tensor(name)
        rows = f.get_slice("embed.weight")[1024:2048]   # reads only those rows

The header is read and checked by gpuio (the rules of safetensors' own loaders, and the data
must end where the file ends): a malformed or truncated file raises :class:`gpuio.Error` and
gives no tensor. ``load_file`` moves every tensor's bytes in one transfer into one allocation on
the device and returns views of it (a tensor whose offset does not suit its element size gets
its own allocation, copied on the device); ``get_tensor`` and ``get_slice`` read only what they
return; a sharded checkpoint's ``*.index.json`` loads as one. Frameworks: ``"pt"`` (torch, any
device) and ``"numpy"`` (host memory).

Onto several GPUs: ``load_replicated(path, ["cuda:0", "cuda:1"])`` gives each GPU every tensor,
``load_split(path, devices, split)`` each GPU its part of each tensor (tensor parallelism);
both read each byte from host memory once and let the GPUs exchange the rest.

``direct=True`` (every loader and ``safe_open``) reads the data with O_DIRECT: past the page
cache, as fastsafetensors does by default. A checkpoint that is not in the page cache may
then load faster (the disk's own pace, with no readahead between), but it stays out of the
cache, so the next load of it reads the disk again; the default, buffered reads, leaves it in
the cache, from where the next load runs at the speed of memory.
"""

import array
import operator

from . import Error, Session, _gpuio, _interop, _invalid

__all__ = ["load_file", "load_numpy", "load_replicated", "load_split", "safe_open"]

# safetensors' dtypes by their names in torch and NumPy (where a library lacks one, such as
# NumPy's BF16 and FP8, getattr finds nothing and the tensor is refused).
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
}

_session = None


def _default_session():
    global _session
    if _session is None:
        _session = Session()
    return _session


class _Framework:
    """Allocation and views for one framework on one device."""

    def __init__(self, framework, device):
        if framework in ("pt", "torch", "pytorch"):
            import torch

            self.torch = torch
            self.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
            self.numpy = None
        elif framework in ("np", "numpy"):
            import numpy

            if str(device) != "cpu":
                raise _invalid(f"framework numpy loads into host memory, not {device}")
            self.numpy, self.torch = numpy, None
        else:
            raise _invalid(f"framework {framework!r}: gpuio.safetensors has pt and numpy")

    def dtype(self, name, st_dtype):
        lib = self.torch or self.numpy
        dt = getattr(lib, _DTYPES[st_dtype], None) if st_dtype in _DTYPES else None
        if dt is None:
            raise Error(
                f"tensor {name!r}: dtype {st_dtype} has no {lib.__name__} type here",
                -8,
                "GPUIO_ERROR_UNSUPPORTED",
            )
        return dt

    def empty(self, nbytes):
        if self.torch:
            return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)
        return self.numpy.empty(nbytes, dtype=self.numpy.uint8)

    def views(self, blob, rows, copies=None):
        """Each tensor of ``rows`` (file order, offsets contiguous from 0) viewed in ``blob``.
        With ``copies`` (a list), the views can be made before ``blob``'s bytes land: a
        tensor that needs a copy of its bytes (an offset torch cannot view) is left out and
        its row appended to ``copies``, for another call once they have landed."""
        if self.torch:
            return self._torch_views(blob, rows, copies)
        return {
            name: self.view(blob[begin:end], name, st_dtype, shape)
            for name, st_dtype, shape, begin, end, _ in rows
        }

    def _torch_views(self, blob, rows, copies):
        """As :meth:`views`, for torch: one ``as_strided`` per tensor on ``blob`` viewed once
        per dtype, with the strides the header's rows carry and each dtype looked up once
        (4096 views on the H200 machine: ~7 ms; computing the strides here, ~13)."""
        bases, kinds, out = {}, {}, {}
        whole = blob.storage_offset() == 0  # as_strided's offsets count from the storage's start
        for row in rows:
            name, st_dtype, shape, begin, end, strides = row
            kind = kinds.get(st_dtype)
            if kind is None:
                dt = self.dtype(name, st_dtype)
                kind = kinds[st_dtype] = (dt, dt.itemsize)
            dt, size = kind
            if copies is not None and (blob.storage_offset() + begin) % size and begin != end:
                copies.append(row)  # a copy of bytes not yet there: made later
                continue
            if not whole or begin % size or begin == end:
                # Not on a whole element (a copy), or empty: the general way.
                out[name] = self.view(blob[begin:end], name, st_dtype, shape)
                continue
            base = bases.get(dt)
            if base is None:
                base = bases[dt] = blob[: blob.numel() // size * size].view(dt)
            out[name] = base.as_strided(shape, strides, begin // size)
        return out

    def view(self, raw, name, st_dtype, shape):
        """``raw`` (bytes on the device) as the tensor: a view where its offset suits the
        element size, else a copy into an allocation of its own."""
        dt = self.dtype(name, st_dtype)
        if self.torch and raw.storage_offset() % dt.itemsize:
            raw = raw.clone()  # NumPy views any offset; torch needs one of whole elements
        return raw.view(dt).reshape(shape)


class safe_open:
    """A checkpoint opened for reading tensors one at a time (the ``safetensors.safe_open``
    API): ``keys()``, ``offset_keys()``, ``metadata()``, ``get_tensor(name)``,
    ``get_slice(name)``. ``session``: the gpuio session to read through (default: one shared
    by the module); ``direct``: read with O_DIRECT (the module's docs)."""

    def __init__(self, filename, framework, device="cpu", session=None, direct=False):
        self._fw = _Framework(framework, device)
        self._session = session or _default_session()
        self._start, self._metadata, rows = _gpuio.safetensors_header(str(filename))
        self._rows = {r[0]: r for r in rows}
        self._order = [r[0] for r in rows]
        self._file = self._session.open(_source(str(filename), direct))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file = None
        return False

    def keys(self):
        """The tensors' names, sorted."""
        return sorted(self._rows)

    def offset_keys(self):
        """The tensors' names in file order."""
        return list(self._order)

    def metadata(self):
        """The header's ``__metadata__`` map, or None."""
        return None if self._metadata is None else dict(self._metadata)

    def _row(self, name):
        if name not in self._rows:
            raise Error(f"no tensor {name!r} in this file", -4, "GPUIO_ERROR_NOT_FOUND")
        return self._rows[name]

    def _read(self, begin, nbytes):
        raw = self._fw.empty(nbytes)
        if nbytes:
            self._session.read(self._file, raw, offset=self._start + begin)
        return raw

    def get_tensor(self, name):
        """The tensor ``name``, read into its own allocation."""
        _, dtype, shape, begin, end, _ = self._row(name)
        return self._fw.view(self._read(begin, end - begin), name, dtype, shape)

    def get_slice(self, name):
        """A lazy view of ``name``: ``get_shape()``, ``get_dtype()``, and indexing, which reads
        only the rows a leading slice selects."""
        return _Slice(self, self._row(name))


class _Slice:
    def __init__(self, f, row):
        self._f, self._row = f, row

    def get_shape(self):
        return list(self._row[2])

    def get_dtype(self):
        return self._row[1]

    def __getitem__(self, index):
        name, dtype, shape, begin, end, _ = self._row
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if not shape or not isinstance(first, slice) or first.step not in (None, 1):
            return self._f.get_tensor(name)[index]
        lo, hi, _ = first.indices(shape[0])
        hi = max(lo, hi)
        row_bytes = (end - begin) // shape[0] if shape[0] else 0
        raw = self._f._read(begin + lo * row_bytes, (hi - lo) * row_bytes)
        rows = self._f._fw.view(raw, name, dtype, [hi - lo, *shape[1:]])
        return rows[(slice(None), *rest)] if rest else rows


def load_file(filename, device="cpu", session=None, progress=None, direct=False):
    """Every tensor of ``filename`` as a dict (torch tensors on ``device``), as
    ``safetensors.torch.load_file`` gives them: one read of the file's data into one
    allocation, viewed as each tensor. A sharded checkpoint's index
    (``model.safetensors.index.json``) loads every shard it names. ``progress``: called as
    ``progress(bytes_done, bytes_total)`` on the calling thread as the data lands (the reads
    then go in pieces of at most 1 GiB; with several devices, the total is reached before the
    devices have exchanged their parts). ``direct``: read with O_DIRECT, past the page cache
    (the module's docs say when that pays)."""
    fws = [_Framework("pt", device)]
    return _load_shards(filename, fws, _Whole(), session, progress, direct)[0]


def load_numpy(filename, session=None, progress=None, direct=False):
    """Every tensor of ``filename`` (or of a sharded checkpoint's index) as NumPy arrays
    (``safetensors.numpy.load_file``); ``progress`` and ``direct`` as for :func:`load_file`."""
    fws = [_Framework("numpy", "cpu")]
    return _load_shards(filename, fws, _Whole(), session, progress, direct)[0]


def load_replicated(filename, devices, session=None, progress=None, direct=False):
    """Every tensor on each of ``devices`` (CUDA devices): a list of dicts, one per device.
    Each device reads its own 1/N of the data from the file, side by side, and the devices
    copy their parts to each other (over NVLink where they have it): the host's memory is
    read once, each GPU's link carries 1/N. ``progress`` and ``direct`` as for
    :func:`load_file`."""
    return _load_shards(filename, _devices(devices), _Whole(), session, progress, direct)


def load_split(filename, devices, split, session=None, progress=None, direct=False):
    """Tensor-parallel loading: a list of dicts, one per device, where device ``r`` holds
    part ``r`` of each tensor as ``torch.tensor_split(tensor, N, dim)`` cuts it. ``split``
    gives each tensor's ``dim``: a dict by name, or a callable ``split(name, shape)``; a
    tensor whose dim is None (or missing from the dict) goes whole to every device. Each
    byte is read from host memory once: each device reads a contiguous 1/N of the data (cut
    at tensor boundaries), then writes each tensor's parts into their devices (over NVLink
    where the GPUs have it), one kernel per pair of devices. Each device's parts are views
    of one allocation of its own. ``progress`` and ``direct`` as for :func:`load_file`."""
    if not callable(split) and not isinstance(split, dict):
        raise _invalid("split is a dict of tensor names to dims, or a callable(name, shape)")
    return _load_shards(filename, _devices(devices), _Parts(split), session, progress, direct)


def _devices(devices):
    if not isinstance(devices, (list, tuple)) or not devices:
        raise _invalid("devices: a list of CUDA devices, e.g. ['cuda:0', 'cuda:1']")
    fws = [_Framework("pt", d) for d in devices]
    if any(fw.device.type != "cuda" for fw in fws):
        raise _invalid(f"devices {list(devices)}: each a CUDA device")
    torch = fws[0].torch
    for fw in fws:  # "cuda" is the current device: compare by index
        if fw.device.index is None:
            fw.device = torch.device("cuda", torch.cuda.current_device())
    if len({fw.device for fw in fws}) < len(fws):
        raise _invalid(f"devices {list(devices)}: each a different CUDA device")
    return fws


def _shards(name):
    """The files of the checkpoint ``name`` and the tensor names its index promises (None for
    a single file)."""
    if not name.endswith(".json"):
        return [name], None
    import json
    import os

    with open(name, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and os.path.basename(v) == v for v in weight_map.values()
    ):
        raise _invalid(f"{name}: a sharded index needs a weight_map of shard file names")
    folder = os.path.dirname(name)
    return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))], weight_map


def _source(path, direct):
    """What the session opens for ``path``: its ``localio://`` URI, so that no file name is
    taken for another kind of resource; with ``direct``, asking for O_DIRECT. The path goes
    in as its bytes, percent-encoded, and a relative one is joined to the working directory
    as it is: "a/../b" stays, for the kernel to resolve after any symlink, as it did when
    the header was read."""
    import os
    from urllib.parse import quote

    full = os.fsencode(os.path.join(os.getcwd(), path))
    return "localio://" + quote(full) + ("?direct=1" if direct else "")


def _load_shards(filename, fws, how, session, progress, direct):
    name = str(filename)
    files, promised = _shards(name)
    session = session or _default_session()
    headers = [(f, *_gpuio.safetensors_header(f)) for f in files]
    how.prepare([r for *_, rows in headers for r in rows])  # checks, before any byte is read
    moved = _Progress(progress, sum(rows[-1][4] for *_, rows in headers if rows))
    outs = [{} for _ in fws]
    for path, start, _, rows in headers:
        source = _source(path, direct)
        for out, got in zip(outs, how.load(session, source, start, rows, fws, moved)):
            out.update(got)
    if promised is not None:
        missing = sorted(set(promised) - set(outs[0]))
        if missing:
            raise _invalid(
                f"{name}: {len(missing)} tensors of its weight_map are in no shard, "
                f"e.g. {missing[0]!r}"
            )
    return [{k: out[k] for k in sorted(out)} for out in outs]


# Pieces of a read when progress is reported: big enough that the pipeline's start and end
# (about a millisecond) stay a small part of each.
_PIECE = 1 << 30


class _Progress:
    """Bytes landed so far, reported to the caller's callback on the calling thread. A
    callback that raises is not called again; its exception is raised once the reads that
    are running have ended."""

    def __init__(self, callback, total):
        self.callback, self.total, self.done = callback, total, 0
        self.piece = _PIECE if callback else None
        self.failed = None

    def add(self, n):
        self.done += n
        if self.callback and n and self.failed is None:
            try:
                self.callback(self.done, self.total)
            except BaseException as e:
                self.failed = e

    def raise_failure(self):
        if self.failed is not None:
            raise self.failed


def _read_side_by_side(session, path, jobs, moved, meanwhile=None):
    """Reads each ``(dst, file_offset)`` of ``jobs`` (one per device) whole, one thread per
    device, while ``meanwhile()`` runs on the calling thread (a lone job with nothing to do
    meanwhile is read on the calling thread); ``moved`` counts the bytes."""
    f = session.open(path)

    def pieces(dst, offset):
        n = _nbytes(dst)
        step = moved.piece or max(n, 1)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            session.read(f, dst[lo:hi], offset=offset + lo)
            yield hi - lo

    jobs = [(d, o) for d, o in jobs if _nbytes(d)]
    if not jobs or (len(jobs) == 1 and meanwhile is None):
        if meanwhile:
            meanwhile()
        for d, o in jobs:
            for n in pieces(d, o):
                moved.add(n)
                moved.raise_failure()
        return
    import queue
    import threading

    landed = queue.Queue()

    def run(d, o):
        try:
            for n in pieces(d, o):
                landed.put(n)
            landed.put(None)
        except BaseException as e:  # handed to the calling thread, which raises it
            landed.put(e)

    threads = [threading.Thread(target=run, args=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    # Every thread is waited for, whatever fails: none may still write when this returns.
    failed, running = None, len(threads)
    try:
        if meanwhile:
            meanwhile()
    except BaseException as e:
        failed = e
    while running:
        try:
            item = landed.get()
        except BaseException as e:  # e.g. KeyboardInterrupt: wait on, then raise it
            failed = failed or e
            continue
        if item is None or isinstance(item, BaseException):
            running -= 1
            failed = failed or item
        else:
            moved.add(item)
    if failed:
        raise failed
    moved.raise_failure()


def _nbytes(x):
    return x.nbytes if hasattr(x, "nbytes") else x.numel() * x.element_size()


def _cuts(total, n, bounds=None):
    """``n + 1`` offsets cutting ``total`` bytes into near-equal parts; with ``bounds`` (the
    tensors' end offsets) each cut is the nearest tensor boundary."""
    cuts = [total * i // n for i in range(n + 1)]
    if bounds:
        import bisect

        for i in range(1, n):
            k = bisect.bisect_left(bounds, cuts[i])
            near = [b for b in bounds[max(k - 1, 0) : k + 1]]
            cuts[i] = max(min(near, key=lambda b: abs(b - cuts[i])), cuts[i - 1])
    return cuts


class _Whole:
    """Every tensor to every device: device ``r`` reads part ``r`` of the data into its
    allocation, then the devices copy their parts to each other."""

    def prepare(self, rows):
        pass

    def load(self, session, path, start, rows, fws, moved):
        total = rows[-1][4] if rows else 0
        blobs = [fw.empty(total) for fw in fws]
        cuts = _cuts(total, len(fws))
        views, copies = [], [[] for _ in fws]  # views made while the bytes are read

        def make_views():
            views.extend(fw.views(b, rows, c) for fw, b, c in zip(fws, blobs, copies))

        _read_side_by_side(
            session, path, [(b[lo:hi], start + lo) for b, lo, hi in zip(blobs, cuts, cuts[1:])],
            moved, meanwhile=make_views,
        )
        if len(fws) > 1:
            for r, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                for j, b in enumerate(blobs):
                    if j != r and hi > lo:
                        b[lo:hi].copy_(blobs[r][lo:hi], non_blocking=True)
            for fw in fws:
                fw.torch.cuda.synchronize(fw.device)
        for fw, blob, out, late in zip(fws, blobs, views, copies):
            out.update(fw.views(blob, late))
        return views


class _Parts:
    """Tensor-parallel parts: device ``r`` reads a contiguous 1/N of the data (cut at tensor
    boundaries), then writes the parts of every tensor it read into their devices."""

    def __init__(self, split):
        self.split = split

    def dim(self, name, shape):
        d = self.split.get(name) if isinstance(self.split, dict) else self.split(name, list(shape))
        if d is None:
            return None
        try:
            if isinstance(d, bool):
                raise TypeError
            d = operator.index(d)  # ints, NumPy's too; not bools
        except TypeError:
            d = repr(d)
        if not isinstance(d, int) or not -len(shape) <= d < len(shape):
            raise _invalid(f"tensor {name!r} of shape {list(shape)}: no dim {d} to split")
        return d

    def prepare(self, rows):
        """Every tensor's dim, checked; a split dict naming no tensor of the checkpoint is a
        mistake, not a no-op."""
        self.dims = {name: self.dim(name, shape) for name, _, shape, *_ in rows}
        unknown = sorted(set(self.split) - set(self.dims)) if isinstance(self.split, dict) else []
        if unknown:
            raise _invalid(
                f"split names {len(unknown)} tensor(s) the checkpoint lacks, e.g. {unknown[0]!r}"
            )

    def load(self, session, path, start, rows, fws, moved):
        n = len(fws)
        total = rows[-1][4] if rows else 0
        cuts = _cuts(total, n, [r[4] for r in rows])
        reads = [fw.empty(hi - lo) for fw, lo, hi in zip(fws, cuts, cuts[1:])]
        # The destinations, their views and the copies' pieces are made while the reads run
        # (allocations and thousands of views cost as much as a third of the reads' time).
        plan = []
        _read_side_by_side(
            session, path, [(b, start + lo) for b, lo in zip(reads, cuts)], moved,
            meanwhile=lambda: plan.append(self.plan(rows, cuts, fws)),
        )
        blobs, pieces, outs = plan[0]
        for j, blob in enumerate(blobs):
            for r, p in enumerate(pieces[j]):
                if p:
                    session._copy_pieces(_on_device(session, reads[r]),
                                         _on_device(session, blob), p)
        return outs

    def plan(self, rows, cuts, fws):
        """Per device its allocation, the pieces each reader writes into it (a kernel on the
        reader writing this device's memory: over NVLink where the GPUs reach each other,
        staged by gpuio where they do not), and its tensors' views."""
        n = len(fws)
        # Each tensor's parts as strided pieces of the bytes its reader read; reader r's
        # tensors are a run of the file order. A model repeats its shapes: each shape's cut
        # is worked out once.
        readers, parts, starts, cut_of, itemsizes = [], [], [], {}, {}
        r = 0
        for name, st_dtype, shape, begin, end, _ in rows:
            while begin >= cuts[r + 1] and r + 1 < n:
                r += 1
            size = itemsizes.get(st_dtype)
            if size is None:
                size = itemsizes[st_dtype] = fws[0].dtype(name, st_dtype).itemsize
            key = (tuple(shape), size, self.dims[name])
            cut = cut_of.get(key)
            if cut is None:
                cut = cut_of[key] = _part_cuts(*key, n)
            readers.append(r)
            parts.append(cut)
            starts.append(begin - cuts[r])
        # Device j's parts lie in one allocation, in file order, each at an offset that suits
        # its element size.
        blobs, pieces, outs = [], [], []
        for j, fw in enumerate(fws):
            at, views, place = [], [], 0
            for row, cut in zip(rows, parts):
                _, _, _, _, shape, strides, nbytes, room = cut[j]
                at.append(place)
                views.append((row[0], row[1], shape, place, place + nbytes, strides))
                place += room
            at.append(place)
            from_readers = []
            for r in range(n):
                p = array.array("Q")
                for k in range(_first(readers, r), _first(readers, r + 1)):
                    offset, pitch, width, height = parts[k][j][:4]
                    p.extend((starts[k] + offset, pitch, at[k], width, width, height))
                from_readers.append(p)
            blobs.append(fw.empty(place))
            pieces.append(from_readers)
            outs.append(fw.views(blobs[-1], views))
        return blobs, pieces, outs


def _part_cuts(shape, itemsize, dim, n):
    """How ``n`` parts of a tensor (``torch.tensor_split(t, n, dim)``; the whole tensor for
    each where ``dim`` is None) lie among its bytes: per part ``(offset, pitch, width, rows,
    shape, strides, nbytes, room)``, its rows of ``width`` bytes one ``pitch`` apart from
    ``offset``, and the room it takes in an allocation (a multiple of 16, so that every part
    starts where any element size may)."""
    count = 1
    for s in shape:
        count *= s

    def part(offset, pitch, width, rows, part_shape):
        nbytes = width * rows
        return (offset, pitch, width, rows, part_shape, _contiguous(part_shape), nbytes,
                -(-nbytes // 16) * 16)

    if dim is None:
        return [part(0, 0, count * itemsize, 1, shape)] * n
    dim %= len(shape)
    outer = 1
    for s in shape[:dim]:
        outer *= s
    inner = itemsize
    for s in shape[dim + 1 :]:
        inner *= s
    length = shape[dim]
    q, extra = divmod(length, n)
    out, first = [], 0
    for j in range(n):
        take = q + (j < extra)
        out.append(part(first * inner, length * inner, take * inner, outer,
                        shape[:dim] + (take,) + shape[dim + 1 :]))
        first += take
    return out


def _contiguous(shape):
    """Element strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= s
    return tuple(reversed(strides))


def _on_device(session, tensor):
    """``tensor`` (CUDA memory) as a gpuio DeviceBuffer, borrowed for one call."""
    return _interop.resolve(session, tensor, True)


def _first(readers, r):
    """Index of the first tensor read by reader ``r`` or a later one (``readers`` ascends)."""
    import bisect

    return bisect.bisect_left(readers, r)


