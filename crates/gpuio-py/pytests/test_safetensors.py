"""gpuio.safetensors against the real safetensors package (NumPy framework, host memory):
the same tensors from checkpoints safetensors writes, the same names, metadata and slices,
and files it refuses refused with gpuio.Error, no tensor given."""

import struct

import numpy as np
import pytest

import safetensors
from safetensors.numpy import load_file as st_load, save_file as st_save

import gpuio
from gpuio import safetensors as gst

DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64"]


def _tensors(rng):
    out = {}
    for i, dt in enumerate(DTYPES):
        shape = [(3, 5), (7,), (), (2, 0, 4), (1, 3, 2)][i % 5]
        if dt == "bool":
            a = rng.integers(0, 2, shape).astype(bool)
        elif dt.startswith(("float", "complex")):
            a = rng.standard_normal(shape).astype(dt)
        else:
            a = rng.integers(0, 100, shape).astype(dt)
        out[f"t{i:02d}.{dt}"] = a
    out["big"] = rng.standard_normal((257, 129)).astype("float32")
    return out


@pytest.fixture
def checkpoint(tmp_path):
    tensors = _tensors(np.random.default_rng(3))
    path = tmp_path / "model.safetensors"
    st_save(tensors, str(path), metadata={"format": "np", "note": "gpuio test"})
    return str(path), tensors


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def test_load_gives_what_safetensors_gives(checkpoint):
    path, tensors = checkpoint
    ours, theirs = gst.load_numpy(path), st_load(path)
    assert list(ours) == sorted(theirs)
    for name in theirs:
        _same(ours[name], theirs[name])
        _same(ours[name], tensors[name])


def _cached_bytes(path):
    """Bytes of ``path`` in the page cache (``mincore`` over a private mapping of it)."""
    import ctypes
    import mmap
    import os

    size, page = os.path.getsize(path), mmap.PAGESIZE
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        buf = (ctypes.c_char * size).from_buffer(m)
        vec = (ctypes.c_ubyte * (-(-size // page)))()
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
        del buf
        assert rc == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec) * page
    finally:
        m.close()


def test_direct_loads_give_the_same_tensors_and_leave_the_page_cache_alone(tmp_path):
    import os

    tensors = _tensors(np.random.default_rng(9))
    tensors["wide"] = np.arange(1 << 20, dtype="float32")  # 4 MiB: most of the file
    plain = str(tmp_path / "m.safetensors")
    st_save(tensors, plain)
    theirs = st_load(plain)
    # A name a URI would misread, and not UTF-8: the loaders must open this file.
    folder = tmp_path / os.fsdecode(b"a dir?direct=0&x=%41#\xff")
    folder.mkdir()
    path = str(folder / "m.safetensors")
    os.rename(plain, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    size = os.path.getsize(path)
    if _cached_bytes(path) >= size // 8:
        pytest.skip("this file system keeps its pages whatever one advises (tmpfs)")
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        pytest.skip(f"this file system refuses O_DIRECT: {e}")
    s = gpuio.Session()
    ours = gst.load_numpy(path, session=s, direct=True)
    for name in theirs:
        _same(ours[name], theirs[name])
    with gst.safe_open(path, framework="numpy", session=s, direct=True) as f:
        _same(f.get_tensor("big"), tensors["big"])
        _same(f.get_slice("big")[7:9], tensors["big"][7:9])
    # O_DIRECT reads left the data out of the page cache (the header is read buffered); a
    # buffered load of the same name puts it in.
    assert _cached_bytes(path) < size // 8
    buffered = gst.load_numpy(path, session=s)
    assert _cached_bytes(path) >= size // 2
    for name in theirs:
        _same(buffered[name], theirs[name])
    # A relative name with ".." after a symlink is the kernel's to resolve, as it was for
    # the header: the data comes from the same file.
    (tmp_path / "real" / "sub").mkdir(parents=True)
    os.rename(path, tmp_path / "real" / "m.safetensors")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "m.safetensors").write_bytes(b"not this one")
    os.symlink(tmp_path / "real" / "sub", tmp_path / "work" / "link")
    here = os.getcwd()
    os.chdir(tmp_path / "work")
    try:
        for direct in (False, True):
            got = gst.load_numpy("link/../m.safetensors", session=s, direct=direct)
            _same(got["wide"], tensors["wide"])
    finally:
        os.chdir(here)


def test_safe_open_keys_metadata_tensors_and_slices(checkpoint):
    path, tensors = checkpoint
    with safetensors.safe_open(path, framework="numpy") as theirs, gst.safe_open(
        path, framework="numpy"
    ) as ours:
        assert ours.keys() == sorted(theirs.keys())
        assert ours.metadata() == theirs.metadata()
        assert sorted(ours.offset_keys()) == ours.keys()
        for name in theirs.keys():
            _same(ours.get_tensor(name), theirs.get_tensor(name))
        for index in [slice(3, 40), slice(250, 999), slice(5, 2), (slice(0, 9), slice(1, 4))]:
            _same(ours.get_slice("big")[index], tensors["big"][index])
        assert ours.get_slice("big").get_shape() == [257, 129]
        assert ours.get_slice("big").get_dtype() == "F32"
        with pytest.raises(gpuio.Error) as e:
            ours.get_tensor("absent")
        assert e.value.name == "GPUIO_ERROR_NOT_FOUND"


def _write(path, header, data):
    h = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_an_offset_that_does_not_suit_the_element_size_still_loads(tmp_path):
    # Written by hand: safetensors' writer orders tensors so that this does not happen.
    path = tmp_path / "odd.safetensors"
    a, b = np.arange(3, dtype=np.uint8), np.arange(4, dtype=np.float32)
    header = (
        '{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},'
        '"b":{"dtype":"F32","shape":[4],"data_offsets":[3,19]}}'
    )
    _write(path, header, a.tobytes() + b.tobytes())
    ours, theirs = gst.load_numpy(str(path)), st_load(str(path))
    for name, want in [("a", a), ("b", b)]:
        _same(ours[name], want)
        _same(ours[name], theirs[name])


@pytest.mark.parametrize(
    "header, data, why",
    [
        ('{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 7, "truncated data"),
        ('{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 9, "bytes past the data"),
        ('{"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', 8, "shape against size"),
        ('{"t":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}}', 8, "unknown dtype"),
        ('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
         '"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}', 6, "overlapping"),
        ('{"t":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}', 6, "a gap at the start"),
        ('{"t":', 0, "not JSON"),
        (b'{"t\xff":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', 1, "not UTF-8"),
    ],
)
def test_malformed_files_are_refused_as_safetensors_refuses_them(tmp_path, header, data, why):
    path = tmp_path / "bad.safetensors"
    _write(path, header, bytes(data))
    with pytest.raises(Exception):
        st_load(str(path))
    with pytest.raises(gpuio.Error) as e:
        gst.load_numpy(str(path))
    assert e.value.name == "GPUIO_ERROR_INVALID_ARG", why
    assert "safetensors file" in e.value.message, why
    with pytest.raises(gpuio.Error):
        gst.safe_open(str(path), framework="numpy")


def test_a_header_length_past_the_file_reads_nothing(tmp_path):
    for length in [2**64 - 1, 10**9, 64]:
        path = tmp_path / "long.safetensors"
        path.write_bytes(struct.pack("<Q", length) + b"{}")
        with pytest.raises(gpuio.Error) as e:
            gst.load_numpy(str(path))
        assert "header of" in e.value.message
    (tmp_path / "tiny").write_bytes(b"\x01\x02")
    with pytest.raises(gpuio.Error):
        gst.load_numpy(str(tmp_path / "tiny"))


def test_frameworks_and_devices_are_checked(checkpoint):
    path, _ = checkpoint
    with pytest.raises(gpuio.Error):
        gst.safe_open(path, framework="jax")
    with pytest.raises(gpuio.Error):
        gst.safe_open(path, framework="numpy", device="cuda:0")


def test_a_sharded_checkpoint_loads_as_one(tmp_path):
    import json

    rng = np.random.default_rng(9)
    shards = {
        "model-00001-of-00002.safetensors": {"a": rng.standard_normal((4, 4)).astype("float32")},
        "model-00002-of-00002.safetensors": {"b": np.arange(6, dtype="int64")},
    }
    weight_map = {}
    for file, tensors in shards.items():
        st_save(tensors, str(tmp_path / file))
        weight_map.update({k: file for k in tensors})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    got = gst.load_numpy(str(index))
    assert list(got) == ["a", "b"]
    for tensors in shards.values():
        for k, v in tensors.items():
            _same(got[k], v)
    weight_map["c"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(gpuio.Error, match="in no shard"):
        gst.load_numpy(str(index))
    index.write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(gpuio.Error, match="shard file names"):
        gst.load_numpy(str(index))


def test_a_dtype_numpy_lacks_is_refused_by_name(tmp_path):
    path = tmp_path / "bf16.safetensors"
    _write(path, '{"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}', bytes(4))
    with pytest.raises(gpuio.Error) as e:
        gst.load_numpy(str(path))
    assert e.value.name == "GPUIO_ERROR_UNSUPPORTED" and "BF16" in e.value.message


def test_progress_reports_every_byte_in_order_and_the_load_is_unchanged(checkpoint, monkeypatch):
    path, tensors = checkpoint
    monkeypatch.setattr(gst, "_PIECE", 1000)  # pieces of 1000 bytes: several reports
    seen = []
    got = gst.load_numpy(path, progress=lambda done, total: seen.append((done, total)))
    total = sum(a.nbytes for a in tensors.values())
    assert len(seen) == -(-total // 1000) and seen[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    for name, a in tensors.items():
        _same(got[name], a)


def test_cuts_are_near_equal_and_at_tensor_boundaries_when_asked():
    assert gst._cuts(10, 3) == [0, 3, 6, 10]
    assert gst._cuts(100, 2, [10, 45, 60, 100]) == [0, 45, 100]
    assert gst._cuts(100, 2, [100]) == [0, 100, 100]  # one tensor: one part holds it
    assert gst._cuts(0, 2, []) == [0, 0, 0]
    assert gst._cuts(100, 4, [30, 31, 100]) == [0, 30, 31, 100, 100]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_tensor_parallel_parts_are_tensor_splits_copied_as_strided_pieces(n):
    # load_split's parts (it needs CUDA devices: the GPU matrix) as the session's strided
    # copies move them: each equal to NumPy's array_split, torch.tensor_split's cut.
    s = gpuio.Session(toml='backend = "host"\n')
    rng = np.random.default_rng(n)
    shapes = [(7, 5, 3), (4, 9), (10,), (3, 0, 2), (1, 6, 4), (2, 3, 5, 7)]
    for shape in shapes:
        for dim in [None, *range(len(shape)), -1]:
            a = rng.integers(0, 1 << 30, shape).astype(np.int32)
            src = s.alloc_device(a.nbytes + 24)
            s.copy(a.tobytes(), src, dst_offset=24)
            parts = gst._part_cuts(shape, 4, dim, n)
            want = [a] * n if dim is None else np.array_split(a, n, axis=dim)
            for (offset, pitch, width, rows, part_shape, strides, nbytes, room), w in zip(
                parts, want
            ):
                assert part_shape == w.shape and nbytes == w.nbytes and room % 16 == 0
                if nbytes:  # an empty tensor's strides are free
                    assert strides == tuple(x // 4 for x in np.empty(w.shape, np.int32).strides)
                dst = s.alloc_device(max(nbytes, 1))
                s._copy_pieces(src, dst, np.array([24 + offset, pitch, 0, width, width, rows], "u8"))
                got = np.empty(nbytes, np.uint8)
                if nbytes:
                    s.copy(dst, got)
                assert got.tobytes() == np.ascontiguousarray(w).tobytes(), (shape, dim)
    # A piece the buffers cannot hold is refused, and so is a malformed list.
    src, dst = s.alloc_device(64), s.alloc_device(64)
    with pytest.raises(gpuio.Error):
        s._copy_pieces(src, dst, np.array([0, 64, 0, 32, 32, 2], "u8"))
    with pytest.raises(gpuio.Error):
        s._copy_pieces(src, dst, np.array([0, 64, 0, 32, 32], "u8"))


def test_a_progress_callback_that_raises_stops_the_load_with_its_error(checkpoint, monkeypatch):
    path, _ = checkpoint
    monkeypatch.setattr(gst, "_PIECE", 1000)
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == 2:
            raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        gst.load_numpy(path, progress=progress)
    assert len(calls) == 2  # not called again after it raised
