"""gpuio.lmcache's connector driven as LMCache's multiprocess server drives a native_plugin L2
adapter (submit, poll the eventfd, drain completions), on ctypes buffers like LMCache's L1:
chunks come back byte for byte from host memory and from spilled files, a damaged chunk is a
miss and never bytes, and nothing is left on disk. With the real LMCache package importable
(the GPU machine), the same through LMCache's own adapter factory; GPUIO_REQUIRE_LMCACHE=1
makes its absence a failure."""

import ctypes
import os
import select

import numpy as np
import pytest

import gpuio
from gpuio.lmcache import GpuioConnector

CHUNK = 64 << 10


def buffers(n, seed=None, size=CHUNK):
    """LMCache-like buffers: ctypes-backed memoryviews of format '<B'."""
    out = []
    for i in range(n):
        raw = (ctypes.c_ubyte * size)()
        if seed is not None:
            data = np.random.default_rng(seed + i).integers(0, 256, size, dtype=np.uint8)
            ctypes.memmove(raw, data.ctypes.data, size)
        out.append(memoryview(raw))
    return out


def finish(conn, fid):
    """Waits for future `fid` as LMCache's demux thread does; its (ok, error, bools)."""
    seen = {}
    while fid not in seen:
        ready, _, _ = select.select([conn.event_fd()], [], [], 10)
        assert ready, "no completion announced within 10 s"
        for done in conn.drain_completions():
            seen[done[0]] = done[1:]
    return seen[fid]


def same(a, b):
    return bytes(a.cast("B")) == bytes(b.cast("B"))


def test_chunks_round_trip_through_host_memory_and_files(tmp_path):
    root = tmp_path / "kv"
    # Room for two chunks in host memory: the rest spill to files, oldest first.
    conn = GpuioConnector(host_gb=2 * CHUNK / (1 << 30), root=str(root), workers=2)
    keys = [f"m@00000000@0@{i:08x}" for i in range(5)]
    src = buffers(5, seed=1)
    ok, err, _ = finish(conn, conn.submit_batch_set(keys, src))
    assert ok and err == ""
    assert len(os.listdir(root)) == 3
    ok, _, hits = finish(conn, conn.submit_batch_exists(keys + ["m@00000000@0@ffffffff"]))
    assert ok and hits == [True] * 5 + [False]
    dst = buffers(5)
    ok, _, loaded = finish(conn, conn.submit_batch_get(keys, dst))
    assert ok and loaded == [True] * 5
    assert all(same(a, b) for a, b in zip(src, dst))
    # Written again: the new bytes win.
    again = buffers(1, seed=99)
    finish(conn, conn.submit_batch_set(keys[:1], again))
    dst = buffers(1)
    assert finish(conn, conn.submit_batch_get(keys[:1], dst))[2] == [True]
    assert same(dst[0], again[0])
    ok, _, deleted = finish(conn, conn.submit_batch_delete([keys[4], "nope"]))
    assert deleted == [True, False]
    conn.close()
    assert os.listdir(root) == []


def test_a_bad_buffer_refuses_its_batch_and_loses_nothing(tmp_path):
    # Room for two chunks in host memory: the third is in a file.
    conn = GpuioConnector(host_gb=2 * CHUNK / (1 << 30), root=str(tmp_path / "kv"), workers=2)
    keys = ["a", "b", "c"]
    src = buffers(3, seed=7)
    assert finish(conn, conn.submit_batch_set(keys, src))[0]
    strided = memoryview(bytearray(2 * CHUNK))[::2]  # no one run of bytes to copy from
    ok, err, _ = finish(conn, conn.submit_batch_set(keys, buffers(1, seed=8) + [strided] * 2))
    assert not ok and "contiguous" in err
    read_only = memoryview(bytes(CHUNK))
    dst = buffers(3)
    ok, err, _ = finish(conn, conn.submit_batch_get(keys, [dst[0], read_only, dst[2]]))
    assert not ok and "read-only" in err
    # Every chunk stored before is still there, host and file alike, with its first bytes.
    assert finish(conn, conn.submit_batch_exists(keys))[2] == [True, True, True]
    ok, _, loaded = finish(conn, conn.submit_batch_get(keys, dst))
    assert ok and loaded == [True, True, True]
    assert all(same(a, b) for a, b in zip(src, dst))
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_checked_copies_run_in_a_forked_child():
    s = gpuio.Session()
    host = s.alloc_host(4 << 20)
    data = np.random.default_rng(9).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    want = gpuio._gpuio.copy_checked(host, [(0, data)], True, 1 << 20)  # the team starts here
    pid = os.fork()
    if pid == 0:  # the child: its copies must not wait on the parent's threads
        import signal

        signal.alarm(20)
        back = bytearray(len(data))
        got = gpuio._gpuio.copy_checked(host, [(0, back)], False, 1 << 20)
        os._exit(0 if got == want and bytes(back) == data else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_damaged_chunk_is_a_miss_never_bytes(tmp_path):
    root = tmp_path / "kv"
    conn = GpuioConnector(host_gb=0, root=str(root))
    src = buffers(2, seed=5)
    finish(conn, conn.submit_batch_set(["a", "b"], src))
    victim = sorted(root.iterdir())[0]
    with open(victim, "r+b") as f:
        f.seek(CHUNK // 2)
        f.write(b"\xff\x00\xff")
    dst = buffers(2)
    ok, _, loaded = finish(conn, conn.submit_batch_get(["a", "b"], dst))
    assert ok and sorted(loaded) == [False, True]
    good = loaded.index(True)
    assert same(dst[good], src[good])
    # The damaged one is forgotten; a chunk of another size is a miss too.
    assert finish(conn, conn.submit_batch_exists(["a", "b"]))[2].count(True) == 1
    small = [memoryview((ctypes.c_ubyte * 16)())]
    assert finish(conn, conn.submit_batch_get(["ab"[good]], small))[2] == [False]
    conn.close()


def test_files_written_and_read_with_o_direct(tmp_path):
    conn = GpuioConnector(host_gb=0, root=str(tmp_path / "kv"), odirect=True)
    src = buffers(3, seed=7)
    assert finish(conn, conn.submit_batch_set(["p", "q", "r"], src))[0]
    dst = buffers(3)
    assert finish(conn, conn.submit_batch_get(["p", "q", "r"], dst))[2] == [True] * 3
    assert all(same(a, b) for a, b in zip(src, dst))
    conn.close()


def test_without_room_a_store_fails_as_a_completion():
    conn = GpuioConnector(host_gb=CHUNK / (1 << 30))
    ok, err, _ = finish(conn, conn.submit_batch_set(["x", "y"], buffers(2, seed=3)))
    assert not ok and "no room" in err
    ok, _, hits = finish(conn, conn.submit_batch_exists(["x", "y"]))
    assert hits == [True, False]  # what fitted is kept
    conn.close()


def test_the_real_lmcache_loads_it_and_moves_chunks_byte_for_byte(tmp_path):
    try:
        import torch
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
        from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
    except ImportError as e:
        if os.environ.get("GPUIO_REQUIRE_LMCACHE") == "1":
            raise
        pytest.skip(f"LMCache is not installed here ({e})")
    cfg = get_l2_adapter_config_class("native_plugin").from_dict({
        "type": "native_plugin",
        "module_path": "gpuio.lmcache",
        "class_name": "GpuioConnector",
        "adapter_params": {"host_gb": 0.001, "root": str(tmp_path / "kv"), "workers": 2},
        "max_capacity_gb": 1,
    })
    adapter = create_l2_adapter(cfg)
    alloc = AdHocMemoryAllocator(device="cpu")

    def chunk():
        return alloc.allocate([torch.Size([2, 4, 256, 128])], [torch.bfloat16],
                              fmt=MemoryFormat.KV_2LTD)

    keys = [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(i), model_name="m", kv_rank=0)
            for i in range(4)]
    src = [chunk() for _ in keys]
    for i, o in enumerate(src):
        o.tensor.copy_(torch.randn(o.tensor.shape, generator=torch.Generator().manual_seed(i))
                       .to(torch.bfloat16))

    def wait(fd):
        p = select.poll()
        p.register(fd, select.POLLIN)
        assert p.poll(10_000)

    task = adapter.submit_store_task(keys, src)
    wait(adapter.get_store_event_fd())
    results = {}
    while task not in results:
        results.update(adapter.pop_completed_store_tasks())
    assert results[task].is_successful()
    missing = ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(99), model_name="m", kv_rank=0)
    task = adapter.submit_lookup_and_lock_task(keys + [missing], {})
    found = None
    while found is None:
        found = adapter.query_lookup_and_lock_result(task)
    assert found.count_leading_ones() == 4
    dst = [chunk() for _ in keys]
    task = adapter.submit_load_task(keys, dst)
    loaded = None
    while loaded is None:
        loaded = adapter.query_load_result(task)
    assert loaded.count_leading_ones() == 4
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(src, dst))
    adapter.submit_unlock(keys)
    adapter.close()


def test_copies_checked_in_pieces_match_the_bytes_and_refuse_bad_ranges():
    s = gpuio.Session()
    host = s.alloc_host(3 << 20)
    copy = gpuio._gpuio.copy_checked
    crc = gpuio._gpuio.crc32c
    data = np.random.default_rng(4).integers(0, 256, (2 << 20) + 7, dtype=np.uint8).tobytes()
    piece = 1 << 19
    want = [crc(data[i : i + piece]) for i in range(0, len(data), piece)]
    assert gpuio._gpuio.crc32c_pieces(data, piece) == want
    assert copy(host, [(100, data)], True, piece) == [want]
    back = bytearray(len(data))
    assert copy(host, [(100, back)], False, piece) == [want]
    assert bytes(back) == data
    # Pieces that are no multiple of the blocks a copy checks as it goes.
    odd = 100_003
    want = [crc(data[i : i + odd]) for i in range(0, len(data), odd)]
    back = bytearray(len(data))
    assert copy(host, [(100, back)], False, odd) == [want]
    assert bytes(back) == data
    # A batch, in and out in its own order: a chunk below a MiB writes through the cache,
    # a larger one around it, an empty one anywhere.
    small, big = data[5:1005], data[: (1 << 20) + 3]
    jobs = [((2 << 20) + 64, small), (7, big), (50, b"")]
    assert copy(host, jobs, True, piece) == [[crc(small)], [crc(big[:piece]), crc(big[piece:piece * 2]), crc(big[piece * 2:])], []]
    outs = [bytearray(len(small)), bytearray(len(big)), bytearray(0)]
    got = copy(host, [(o, b) for (o, _), b in zip(jobs, outs)], False, 1 << 30)
    assert got == [[crc(small)], [crc(big)], []]
    assert [bytes(b) for b in outs] == [small, big, b""]
    assert copy(host, [], True, piece) == []
    with pytest.raises(gpuio.Error):  # past the buffer's end
        copy(host, [((3 << 20) - 10, data)], True, piece)
    with pytest.raises(gpuio.Error):  # two chunks on the same bytes
        copy(host, [(0, small), (999, small)], True, piece)
    view = memoryview(bytearray(100))
    with pytest.raises(gpuio.Error):  # two destinations sharing bytes
        copy(host, [(0, view[:60]), (0, view[50:])], False, piece)
    with pytest.raises(gpuio.Error):
        gpuio._gpuio.crc32c_pieces(data, 0)
    with pytest.raises(gpuio.Error):  # bytes cannot be written
        copy(host, [(0, data)], False, piece)


def test_chunks_of_several_pieces_round_trip_and_a_damaged_piece_is_a_miss(tmp_path):
    big = (9 << 20) + 5  # three pieces, the last short and odd
    root = tmp_path / "kv"
    conn = GpuioConnector(host_gb=big / (1 << 30), root=str(root), workers=3)
    src = buffers(2, seed=11, size=big)
    assert finish(conn, conn.submit_batch_set(["a", "b"], src))[0]
    assert len(os.listdir(root)) == 1  # one in host memory, the other spilled
    dst = buffers(2, size=big)
    assert finish(conn, conn.submit_batch_get(["a", "b"], dst))[2] == [True, True]
    assert all(same(a, b) for a, b in zip(src, dst))
    (spilled,) = root.iterdir()
    with open(spilled, "r+b") as f:
        f.seek(big - 3)  # in the last piece
        f.write(b"\x5a")
    dst = buffers(2, size=big)
    loaded = finish(conn, conn.submit_batch_get(["a", "b"], dst))[2]
    assert sorted(loaded) == [False, True]
    good = loaded.index(True)
    assert same(dst[good], src[good])
    conn.close()
