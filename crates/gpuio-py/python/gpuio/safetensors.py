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
"""

from . import Error, Session, _gpuio, _invalid

__all__ = ["load_file", "load_numpy", "safe_open"]

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
    by the module)."""

    def __init__(self, filename, framework, device="cpu", session=None):
        self._fw = _Framework(framework, device)
        self._session = session or _default_session()
        self._start, self._metadata, rows = _gpuio.safetensors_header(str(filename))
        self._rows = {r[0]: r for r in rows}
        self._order = [r[0] for r in rows]
        self._file = self._session.open(str(filename))

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
        _, dtype, shape, begin, end = self._row(name)
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
        name, dtype, shape, begin, end = self._row
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if not shape or not isinstance(first, slice) or first.step not in (None, 1):
            return self._f.get_tensor(name)[index]
        lo, hi, _ = first.indices(shape[0])
        hi = max(lo, hi)
        row_bytes = (end - begin) // shape[0] if shape[0] else 0
        raw = self._f._read(begin + lo * row_bytes, (hi - lo) * row_bytes)
        rows = self._f._fw.view(raw, name, dtype, [hi - lo, *shape[1:]])
        return rows[(slice(None), *rest)] if rest else rows


def load_file(filename, device="cpu", session=None):
    """Every tensor of ``filename`` as a dict (torch tensors on ``device``), as
    ``safetensors.torch.load_file`` gives them: one read of the file's data into one
    allocation, viewed as each tensor. A sharded checkpoint's index
    (``model.safetensors.index.json``) loads every shard it names."""
    return _load_any(filename, "pt", device, session)


def load_numpy(filename, session=None):
    """Every tensor of ``filename`` (or of a sharded checkpoint's index) as NumPy arrays
    (``safetensors.numpy.load_file``)."""
    return _load_any(filename, "numpy", "cpu", session)


def _load_any(filename, framework, device, session):
    name = str(filename)
    if not name.endswith(".json"):
        return _load(name, framework, device, session)
    import json
    import os

    with open(name, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and os.path.basename(v) == v for v in weight_map.values()
    ):
        raise _invalid(f"{name}: a sharded index needs a weight_map of shard file names")
    out = {}
    for shard in sorted(set(weight_map.values())):
        out.update(_load(os.path.join(os.path.dirname(name), shard), framework, device, session))
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise _invalid(
            f"{name}: {len(missing)} tensors of its weight_map are in no shard, "
            f"e.g. {missing[0]!r}"
        )
    return {k: out[k] for k in sorted(out)}


def _load(filename, framework, device, session):
    fw = _Framework(framework, device)
    session = session or _default_session()
    start, _, rows = _gpuio.safetensors_header(str(filename))
    total = rows[-1][4] if rows else 0
    blob = fw.empty(total)
    if total:
        session.read(str(filename), blob, offset=start)
    out = {}
    for name, dtype, shape, begin, end in sorted(rows):
        out[name] = fw.view(blob[begin:end], name, dtype, shape)
    return out
