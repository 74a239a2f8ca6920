"""The binding on whatever backend the machine has (the host backend in CI): NumPy, bytes-like
objects and gpuio buffers through files, host and device memory; bad input refused with a
clear exception and nothing written."""

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

import gpuio

MiB = 1 << 20


@pytest.fixture(scope="module")
def s():
    return gpuio.Session()


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, 4 * MiB, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


def test_import_loads_neither_torch_nor_numpy():
    code = "import gpuio, sys; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


FORKED = r"""
import array, os, signal, sys
import numpy as np
import gpuio, gpuio.ai as ai

path = sys.argv[1]
want = np.fromfile(path, dtype=np.uint8)
s = gpuio.Session()
f = s.open(path)
buf = np.empty(want.size, dtype=np.uint8)
s.read(f, buf)
pool = ai.KvPool(s, layers=1, entry_bytes=64, max_tokens=16)
pool.store(0, 0, s.alloc_device(16 * 64))
table = ai.EngramTable(s, 16, 64)
held, rows, row = s.alloc_host(64), s.alloc_device(128), s.alloc_device(64)
pending = table.prefetch([1, 2], rows)
pending.wait()
started = table.prefetch([3, 4], rows)  # running, or done, at the fork
cache = s.page_cache(page_size=4096, capacity=1 << 20)
arr = cache.array(path, dtype=np.uint32)
arr.prefetch(0, 2048)
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # a call that waits on the parent's threads ends here, as a failure
    refused = []
    for name, call in (("read", lambda: s.read(f, buf)),
                       ("read_async", lambda: s.read_async(f, held).wait()),
                       ("kv load", lambda: pool.load(0, [1, 2], rows)),
                       ("lookup", lambda: table.lookup([3], row)),
                       ("prefetch", lambda: started.wait()),
                       ("array", lambda: arr.prefetch(4096, 1024)),
                       ("size", lambda: f.size())):
        try:
            call()
        except gpuio.Error as e:
            if "fork" in str(e):
                refused.append(name)
    mine = gpuio.Session(toml='backend = "host"\n')
    got = np.empty(want.size, dtype=np.uint8)
    mine.read(mine.open(path), got)
    print(refused, np.array_equal(got, want), flush=True)
    os._exit(0 if len(refused) == 7 and np.array_equal(got, want) else 1)
_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
pid = os.fork()
if pid == 0:
    signal.alarm(30)
    sys.exit(0)  # a plain exit: the parent's session and structures are let go, not joined
_, status = os.waitpid(pid, 0)
buf[:] = 0
s.read(f, buf)
print(code, os.waitstatus_to_exitcode(status), np.array_equal(buf, want))
"""


def test_a_forked_child_is_refused_its_parents_session(data_file):
    # The session's threads stay in the parent: the child's calls on it raise instead of
    # waiting for them forever, a session the child opens works, and a child that exits
    # normally lets the parent's session go without waiting. The parent's goes on.
    out = subprocess.run([sys.executable, "-c", FORKED, data_file[0]], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["0", "0", "True"], out.stdout + out.stderr
    assert "panicked" not in out.stderr, out.stderr


def test_info_lists_devices():
    info = gpuio.info()
    assert info["version"] == gpuio.__version__
    assert info["devices"] and info["devices"][0]["total_memory"] > 0


def test_reads_into_every_host_kind(s, data_file):
    path, data = data_file
    f = s.open(path)
    assert f.size() == data.nbytes
    as_f32 = np.zeros(data.nbytes // 4, dtype=np.float32)
    assert s.read(f, as_f32) == data.nbytes
    assert as_f32.tobytes() == data.tobytes()
    buf = bytearray(MiB)
    assert s.read(path, buf, offset=MiB) == MiB
    assert buf == data[MiB : 2 * MiB].tobytes()
    view = memoryview(bytearray(4096))
    s.read(f, view[1024:], offset=10)
    assert view[1024:].tobytes() == data[10 : 10 + 3072].tobytes()
    host = s.alloc_host(2 * MiB)
    assert s.read(f, host) == 2 * MiB
    assert np.array_equal(np.asarray(host), data[: 2 * MiB])


def test_writes_from_every_host_kind(s, tmp_path, data_file):
    _, data = data_file
    for i, src in enumerate([data, data.tobytes(), bytearray(data.tobytes()), memoryview(data)]):
        out = tmp_path / f"out{i}.bin"
        assert s.write(str(out), src) == data.nbytes
        assert out.read_bytes() == data.tobytes()
    w = s.open(str(tmp_path / "at.bin"), write=True)
    s.write(w, b"tail", offset=100)
    assert (tmp_path / "at.bin").read_bytes() == bytes(100) + b"tail"


def test_host_memory_gpuio_does_not_own_is_read_and_written_in_place(s, tmp_path):
    import tracemalloc

    size = 40 * MiB + 3  # many pieces on the IO threads, and an odd end
    data = np.random.default_rng(11).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "big.bin"
    path.write_bytes(data.tobytes())
    f = s.open(str(path))
    dst = np.zeros(size, dtype=np.uint8)
    tracemalloc.start()
    try:
        assert s.read(f, dst) == size
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB, f"{peak} bytes of Python objects for an in-place read"
    assert np.array_equal(dst, data)
    # A 2-D float array, and a window of a bytearray at an odd offset.
    grid = np.zeros((4, MiB // 4), dtype=np.float32)
    assert s.read(f, grid, offset=MiB + 1) == 4 * MiB
    assert grid.tobytes() == data[MiB + 1 : 5 * MiB + 1].tobytes()
    window = bytearray(3 * MiB)
    s.read(f, memoryview(window)[7 : 7 + 2 * MiB], offset=size - 2 * MiB)
    assert window[7 : 7 + 2 * MiB] == data[-2 * MiB :].tobytes()
    assert window[:7] == bytes(7) and window[7 + 2 * MiB :] == bytes(MiB - 7)
    # Written back from a read-only array.
    src = data.copy()
    src.flags.writeable = False
    out = s.open(str(tmp_path / "out.bin"), write=True)
    assert s.write(out, src) == size
    assert (tmp_path / "out.bin").read_bytes() == data.tobytes()
    # Durable: on stable storage when it returns, the same bytes.
    assert s.write(str(tmp_path / "durable.bin"), grid, durable=True) == 4 * MiB
    assert (tmp_path / "durable.bin").read_bytes() == grid.tobytes()
    # Refused with nothing acknowledged: a read-only or strided destination, a read past
    # the end.
    with pytest.raises(ValueError, match="read-only"):
        s.read(f, src)
    with pytest.raises(ValueError, match="contiguous"):
        s.read(f, np.zeros((4, MiB), dtype=np.uint8)[:, ::2])
    with pytest.raises(gpuio.Error) as e:
        s.read(f, np.zeros(size + 1, dtype=np.uint8))
    assert e.value.name == "GPUIO_ERROR_INVALID_ARG" and "file ends" in e.value.message


def test_host_device_round_trip(s, data_file):
    _, data = data_file
    dev = s.alloc_device(data.nbytes)
    assert s.copy(data, dev) == data.nbytes
    back = np.empty_like(data)
    assert s.copy(dev, back) == data.nbytes
    assert np.array_equal(back, data)
    pinned = s.alloc_host(data.nbytes)
    s.copy(dev, pinned, size=MiB, src_offset=MiB)
    assert np.array_equal(np.asarray(pinned)[:MiB], data[MiB : 2 * MiB])


def test_bad_input_is_refused_and_nothing_is_written(s, data_file):
    path, data = data_file
    before = np.full(MiB, 9, dtype=np.uint8)

    strided = np.full(2 * MiB, 9, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        s.read(path, strided)
    assert (strided == 9).all()

    read_only = before.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        s.read(path, read_only)
    with pytest.raises(ValueError, match="read-only"):
        s.read(path, b"\0" * 16)
    assert (read_only == 9).all()

    small = before.copy()
    with pytest.raises(gpuio.Error) as e:
        s.read(path, small, size=2 * MiB)
    assert e.value.code == -3 and e.value.name == "GPUIO_ERROR_INVALID_ARG"
    assert (small == 9).all()

    past_end = before.copy()
    with pytest.raises(gpuio.Error):
        s.read(path, past_end, offset=data.nbytes - 100)

    with pytest.raises(TypeError, match="cannot move data of a object"):
        s.read(path, object())
    with pytest.raises(gpuio.Error) as e:
        s.read(path + ".missing", before.copy())
    assert e.value.name == "GPUIO_ERROR_NOT_FOUND"
    with pytest.raises(gpuio.Error) as e:
        s.open("nosuchscheme://x")
    assert e.value.code == -3


def test_dlpack_producers_without_the_buffer_protocol(s, data_file):
    path, data = data_file

    class CpuTensor:  # what a CPU torch tensor offers: DLPack, no buffer protocol
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    out = np.zeros(MiB, dtype=np.uint8)
    assert s.read(path, CpuTensor(out)) == MiB
    assert np.array_equal(out, data[:MiB])


def test_async_requests_poll_wait_and_await(s, data_file):
    path, data = data_file
    f = s.open(path)
    host = s.alloc_host(MiB)
    r = s.read_async(f, host, offset=MiB)
    assert r.wait() == MiB and r.done() and r.status == "completed"
    assert r.wait() == MiB  # the result stays
    assert np.array_equal(np.asarray(host), data[MiB : 2 * MiB])

    async def both():
        a, b = s.alloc_host(MiB), s.alloc_host(MiB)
        n = await asyncio.gather(s.read_async(f, a), s.read_async(f, b, offset=2 * MiB))
        return n, np.asarray(a).copy(), np.asarray(b).copy()

    n, a, b = asyncio.run(both())
    assert n == [MiB, MiB]
    assert np.array_equal(a, data[:MiB]) and np.array_equal(b, data[2 * MiB : 3 * MiB])

    with pytest.raises(TypeError, match="asynchronous"):
        s.read_async(f, np.zeros(16, dtype=np.uint8))
    bad = s.read_async(f, s.alloc_host(MiB), offset=data.nbytes)
    with pytest.raises(gpuio.Error):
        bad.wait()
    assert bad.status == "error"


def test_batch_reads_many_ranges(s, data_file):
    path, data = data_file
    f = s.open(path)
    host = s.alloc_host(4 * MiB)
    dev = s.alloc_device(4 * MiB)
    ops = [(f, host, MiB, i * MiB, i * MiB) for i in range(4)]
    report = s.batch(ops)
    assert report["requests"] == 4 and report["bytes"] == 4 * MiB
    assert np.array_equal(np.asarray(host), data)
    s.batch([(host, dev, 4 * MiB)])
    back = np.empty_like(data)
    s.copy(dev, back)
    assert np.array_equal(back, data)


def test_gather_rows_into_device_memory(s):
    rows, row = 1000, 256
    pool = s.alloc_host(rows * row)
    table = np.random.default_rng(3).integers(0, 256, (rows, row), dtype=np.uint8)
    np.asarray(pool)[:] = table.reshape(-1)
    idx = np.array([5, 999, 0, 5, 123], dtype=np.int64)
    out = s.alloc_device(len(idx) * row)
    report = s.gather(pool, idx, out)
    assert report["rows"] == len(idx)
    back = np.empty(len(idx) * row, dtype=np.uint8)
    s.copy(out, back)
    assert np.array_equal(back.reshape(len(idx), row), table[idx])
    assert s.gather(pool, [1, 2], out, row_bytes=row)["rows"] == 2

    with pytest.raises(TypeError, match="64-bit"):
        s.gather(pool, idx.astype(np.float64), out)
    with pytest.raises(TypeError, match="HostBuffer"):
        s.gather(bytearray(16), idx, out)
    with pytest.raises(gpuio.Error) as e:
        s.gather(pool, [rows], out, row_bytes=row)
    assert e.value.code == -3


def test_configuration_text_and_environment(tmp_path):
    s = gpuio.Session(toml="[scheduler]\npolicy = \"fifo\"\n")
    assert s.alloc_host(16, pinned=False).nbytes == 16
    with pytest.raises(gpuio.Error) as e:
        gpuio.Session(toml="[scheduler]\npolicy = 3\n")
    assert e.value.code == -3
    with pytest.raises(gpuio.Error):
        gpuio.Session(config=str(tmp_path / "missing.toml"))
    with pytest.raises(gpuio.Error):
        gpuio.Session(config="a", toml="b")
    env = dict(os.environ, GPUIO_SCHED_POLICY="nonsense")
    code = "import gpuio\ntry:\n    gpuio.Session()\nexcept gpuio.Error as e:\n    print(e.code)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "-3", out.stderr


def test_overlapping_and_oversized_requests_are_safe(s):
    buf = s.alloc_host(4 * MiB)
    view = np.asarray(buf)
    view[:] = np.random.default_rng(5).integers(0, 256, 4 * MiB, dtype=np.uint8)
    expect = view.copy()
    expect[MiB:] = expect[: 3 * MiB].copy()  # memmove semantics
    assert s.copy_async(buf, buf, size=3 * MiB, dst_offset=MiB).wait() == 3 * MiB
    assert np.array_equal(view, expect)
    with pytest.raises(gpuio.Error) as e:
        s.copy_async(buf, s.alloc_host(MiB), size=1 << 62).wait()
    assert e.value.code == -3
    with pytest.raises(gpuio.Error):
        s.batch([(buf, s.alloc_host(MiB), 1 << 62)])


def test_negative_sizes_and_offsets_are_invalid_arguments(s, data_file):
    path, _ = data_file
    f = s.open(path)
    host = s.alloc_host(MiB)
    for call in (
        lambda: s.read(f, host, offset=-1),
        lambda: s.read(f, bytearray(16), size=-1),
        lambda: s.read_async(f, host, offset=-4096),
        lambda: s.copy(host, s.alloc_host(MiB), src_offset=-1),
        lambda: s.batch([(f, host, -1)]),
    ):
        with pytest.raises(gpuio.Error) as e:
            call()
        assert e.value.code == -3


def test_host_copies_uris_and_batches_that_write(s, tmp_path, data_file):
    path, data = data_file
    a, b = bytearray(data[:4096].tobytes()), bytearray(4096)
    assert s.copy(a, b) == 4096 and a == b
    with pytest.raises(gpuio.Error, match="onto itself"):
        s.copy(path, path)
    assert os.path.getsize(path) == data.nbytes  # not truncated
    host = s.alloc_host(2 * MiB)
    s.read(path, host)
    out = str(tmp_path / "batched.bin")
    report = s.batch([(host, out, MiB, 0, 0), (host, out, MiB, MiB, MiB)])
    assert report["bytes"] == 2 * MiB
    with open(out, "rb") as fh:
        assert fh.read() == data[: 2 * MiB].tobytes()
    with pytest.raises(gpuio.Error, match="both read and written"):
        s.batch([(out, host, MiB), (host, out, MiB)])


def test_gpuio_buffers_export_dlpack(s):
    buf = s.alloc_host(4096)
    view = np.from_dlpack(buf)  # shares the memory
    view[:] = 7
    back = bytearray(4096)
    s.copy(buf, back)
    assert back == bytes([7]) * 4096
    assert buf.__dlpack_device__() == (1, 0)
    dev = s.alloc_device(4096)
    if gpuio.info()["devices"][0]["backend"] != "Cuda":
        with pytest.raises(BufferError):
            dev.__dlpack__()


def test_device_dlpack_capsules_release_their_buffer_consumed_or_not():
    import ctypes
    import gc

    from gpuio import _interop

    class Buffer:  # what export_device reads of a DeviceBuffer
        nbytes, address, gpu = 4096, 0x10000, 0

    for _ in range(100):
        _interop.export_device(Buffer())  # never consumed: its destructor releases it
    gc.collect()
    assert not _interop._exported
    capsule = _interop.export_device(Buffer())
    managed = ctypes.cast(
        _interop._capsule_pointer(capsule, b"dltensor"), ctypes.POINTER(_interop._DLManagedTensor)
    )
    assert managed.contents.dl_tensor.shape[0] == 4096
    rename = ctypes.pythonapi.PyCapsule_SetName
    rename.argtypes = [ctypes.py_object, ctypes.c_char_p]
    rename(capsule, b"used_dltensor")  # what a consumer does, then it calls the deleter
    managed.contents.deleter(managed)
    del capsule
    gc.collect()
    assert not _interop._exported


def test_on_demand_arrays_from_python(s, data_file):
    path, data = data_file
    cache = s.page_cache(page_size=4096, capacity=MiB)
    assert cache.page_size == 4096 and cache.frames == 256
    arr = cache.array(path, dtype=np.uint32)
    assert len(arr) == data.nbytes // 4 and arr.nbytes == data.nbytes
    if gpuio.info()["devices"][0]["backend"] == "Cuda":
        d = arr.descriptor  # struct gpuio_array_desc: the cache's page size, the source's bytes
        assert len(d) == 160
        assert int.from_bytes(d[104:112], "little") == 4096
        assert int.from_bytes(d[136:144], "little") == data.nbytes
    else:  # no kernels run there: refused with the reason, never a descriptor to nothing
        with pytest.raises(gpuio.Error, match="host backend") as e:
            arr.descriptor
        assert e.value.name == "GPUIO_ERROR_UNSUPPORTED"
    assert arr.miss_path.startswith(("in place", "through the ring ("))
    arr.prefetch(1024, 2048)  # elements 1024..3072: pages 1 and 2
    st = arr.stats()
    assert st["misses"] == 2 and st["bytes_in"] == 8192 and st["failures"] == 0, st
    assert st["miss_p50_ns"] is not None
    arr.check()
    arr.synchronize()
    with pytest.raises(gpuio.Error) as e:
        arr.prefetch(len(arr), 1)
    assert e.value.name == "GPUIO_ERROR_INVALID_ARG"
    arr.close()
    arr.close()
    with pytest.raises(gpuio.Error, match="closed"):
        arr.stats()


def test_arrays_over_host_memory_read_in_place_until_pages_are_admitted(s, data_file):
    path, data = data_file
    host = s.alloc_host(2 * MiB)
    assert s.read(path, host) == 2 * MiB
    cache = s.page_cache(page_size=4096, capacity=MiB, admit_after=3)
    arr = cache.array(host, dtype=np.uint32)
    if gpuio.info()["devices"][0]["backend"] != "Cuda":  # the host backend's device reads it
        assert arr.miss_path.startswith("in place, from the host memory"), arr.miss_path
        assert "first 3 touches" in arr.miss_path, arr.miss_path
    arr.prefetch(0, 2048)  # a prefetch caches its pages whatever their touches
    st = arr.stats()
    assert st["misses"] == 2 and st["direct_reads"] == 0 and st["direct_bytes"] == 0, st
    arr.close()
    every = s.page_cache(page_size=4096, capacity=MiB, admit_after=0).array(host, dtype=np.uint32)
    assert "touches" not in every.miss_path, every.miss_path
    every.close()
    with pytest.raises(OverflowError):
        s.page_cache(admit_after=-1)


def test_resident_views_hold_arrays_until_released(s, data_file):
    import gc

    path, data = data_file
    cache = s.page_cache(page_size=4096, capacity=MiB)
    whole = cache.array(path, dtype=np.uint32)
    with pytest.raises(gpuio.Error) as e:  # 1024 pages for 256 frames
        whole.resident()
    assert e.value.name == "GPUIO_ERROR_INVALID_ARG"
    arr = cache.array(path, dtype=np.uint32, length=MiB // 8)  # 128 pages
    view = arr.resident()
    assert arr.stats()["misses"] == 128  # every page brought in to be held
    if gpuio.info()["devices"][0]["backend"] == "Cuda":
        d = view.descriptor  # struct gpuio_resident_desc: the array's bytes, its page shift
        assert len(d) == 40
        assert int.from_bytes(d[16:24], "little") == MiB // 2
        assert int.from_bytes(d[32:36], "little") == 12
    else:
        with pytest.raises(gpuio.Error, match="host backend"):
            view.descriptor
    # Held pages count against the frames: 129 more pages do not fit beside them.
    other = cache.array(path, dtype=np.uint32, offset=MiB, length=129 * 1024)
    with pytest.raises(gpuio.Error):
        other.resident()
    view.release()
    view.release()
    with pytest.raises(gpuio.Error, match="released"):
        view.descriptor
    with other.resident():  # fits now; let go at the end of the block
        pass
    # A view the garbage collector takes keeps its hold (a descriptor taken from it may still
    # be in a kernel's hands) until the array closes.
    arr.resident()
    gc.collect()
    with pytest.raises(gpuio.Error):
        other.resident()
    kept = arr.resident()
    arr.close()  # lets both holds go
    with pytest.raises(gpuio.Error, match="released"):
        kept.descriptor
    kept.release()
    with other.resident():
        pass
    with pytest.raises(gpuio.Error, match="closed"):
        arr.resident()
    rw = cache.array(path, dtype=np.uint32, length=1024, writable=True)
    with pytest.raises(gpuio.Error) as e:
        rw.resident()
    assert e.value.name == "GPUIO_ERROR_INVALID_ARG"


def test_on_demand_arrays_refuse_bad_sources(s, data_file, tmp_path):
    path, _ = data_file
    cache = s.page_cache(capacity=MiB)
    host = s.alloc_host(4096)
    with pytest.raises(gpuio.Error) as e:  # memory is length-checked when the array is made
        cache.array(host, dtype=np.uint8, length=8192)
    assert e.value.name == "GPUIO_ERROR_INVALID_ARG"
    with pytest.raises(gpuio.Error, match="whole number"):
        cache._array(host, 4095, 4)
    with pytest.raises(gpuio.Error, match="resource or gpuio memory"):
        cache._array(b"abcd", 4)
    with pytest.raises(gpuio.Error) as e:  # read-write in place: the file must exist
        cache.array(str(tmp_path / "absent.bin"), writable=True)
    assert e.value.name == "GPUIO_ERROR_NOT_FOUND"
    assert os.path.getsize(path) == 4 * MiB  # a writable array opens without truncating
    arr = cache.array(path, dtype="uint64", writable=True)
    assert len(arr) == MiB // 2 and os.path.getsize(path) == 4 * MiB
    arr.close()
    assert len(cache.array(host, dtype=np.float32)) == 1024
