"""gpuio.ai on whatever backend the machine has (the host backend in CI): every structure's
data checked byte for byte against what was put in, and bad input refused with
gpuio.Error or a TypeError, nothing changed."""

import array

import numpy as np
import pytest

import gpuio
import gpuio.ai as ai

ENTRY = 64


@pytest.fixture(scope="module")
def s():
    return gpuio.Session()


def device(s, data):
    """``data`` (a NumPy array) in gpuio device memory."""
    d = s.alloc_device(data.nbytes)
    s.copy(data, d)
    return d


def host(s, dev):
    out = np.empty(len(dev), dtype=np.uint8)
    s.copy(dev, out)
    return out


def entries(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, ENTRY), dtype=np.uint8)


def test_kv_pool_loads_selections_through_every_tier(s, tmp_path):
    pool = ai.KvPool(s, layers=2, entry_bytes=ENTRY, max_tokens=256, warm_entries=300,
                     hot_slots=64, max_selection=32)
    assert pool.config()["warm_entries"] == 300
    kv = entries(256, 1)
    scores = np.linspace(0, 1, 256, dtype=np.float32)
    pool.store(1, 0, device(s, kv), scores=scores)
    assert pool.len(1) == 256 and pool.len(0) == 0
    assert pool.importance(1, 255) == pytest.approx(1.0)
    sel = [5, 200, 5, 17, 255]
    out = s.alloc_device(len(sel) * ENTRY)
    r = pool.load(1, sel, out)
    assert r["selected"] == 5 and r["misses"] == 4 and r["hits"] == 0
    assert np.array_equal(host(s, out).reshape(-1, ENTRY), kv[sel])
    again = pool.load(1, np.array(sel, dtype=np.int64), out)
    assert again["hits"] == 5
    assert pool.hot_entries(1) == 4

    pool.attach_cold_tier(str(tmp_path / "cold.bin"), codec="zstd")
    evicted = pool.compact(0.5)
    assert evicted["evicted"] > 100 and evicted["to_cold"] == evicted["evicted"]
    assert pool.tier_of(1, 0) == "cold" and pool.tier_of(1, 255) == "warm"
    assert pool.tier_of(0, 0) is None
    stored, raw = pool.cold_tier_bytes()
    assert raw == evicted["evicted"] * ENTRY and stored > 0
    cold = [0, 3, 100]
    out = s.alloc_device(len(cold) * ENTRY)
    r = pool.load(1, cold, out)
    assert r["from_cold"] == 3
    assert np.array_equal(host(s, out).reshape(-1, ENTRY), kv[cold])


def test_a_kv_batch_loads_every_request_in_one_call(s):
    pools, data = [], []
    for i in range(3):
        pool = ai.KvPool(s, layers=1, entry_bytes=ENTRY, max_tokens=64, hot_slots=16,
                         max_selection=8)
        kv = entries(64, 20 + i)
        pool.store(0, 0, device(s, kv))
        pools.append(pool)
        data.append(kv)
    sels = [[1, 63, 7], np.array([5, 5, 0, 9], dtype=np.int64), [42]]
    outs = [s.alloc_device(8 * ENTRY) for _ in pools]
    batch = ai.KvBatch(s)
    for _ in range(2):
        reports, took = batch.load(
            [(p, 0, sel, out) for p, sel, out in zip(pools, sels, outs)], timed=True)
        assert [r["selected"] for r in reports] == [3, 4, 1] and took >= 0
        for sel, kv, out in zip(sels, data, outs):
            n = len(sel)
            assert np.array_equal(host(s, out)[: n * ENTRY].reshape(n, ENTRY), kv[list(sel)])
    assert reports[0]["hits"] == 3
    with pytest.raises(gpuio.Error):
        batch.load([(pools[0], 0, [1], outs[0]), (pools[0], 0, [2], outs[1])])
    with pytest.raises(gpuio.Error):
        batch.load([(pools[0], 0, [64], outs[0])])
    # Id arrays and gpuio buffers go as they are, with an offset, from any iterable; the
    # rest are converted, or refused with the reason.
    fast = [array.array("q", [2, 3]), np.array([60, 2], dtype=np.uint64), b"".join(
        v.to_bytes(8, "little") for v in (4, 5))]
    reports = batch.load(((p, 0, sel, out, ENTRY) for p, sel, out in zip(pools, fast, outs)))
    assert [r["selected"] for r in reports] == [2, 2, 2]
    for sel, kv, out in zip(([2, 3], [60, 2], [4, 5]), data, outs):
        assert np.array_equal(host(s, out)[ENTRY : 3 * ENTRY].reshape(2, ENTRY), kv[sel])
    with pytest.raises(ValueError):
        batch.load([(pools[0], 0, fast[0])])
    with pytest.raises(TypeError):
        batch.load([(pools[0]._p, 0, fast[0], outs[0]), ("pool", 0, fast[0], outs[1])])
    with pytest.raises(gpuio.Error):
        batch.load([(pools[0], 0, np.array([1, 2], dtype=np.int32), outs[0])])
    with pytest.raises(gpuio.Error):
        batch.load([(pools[0], 0, b"1234567", outs[0])])  # not whole 64-bit ids


def test_ids_changed_during_a_load_give_an_error_never_a_panic(s):
    # A selection is read in place with the GIL released: another thread may rewrite it
    # between the pool's check and its plan.
    import threading
    import time

    pool = ai.KvPool(s, layers=1, entry_bytes=ENTRY, max_tokens=64, hot_slots=16,
                     max_selection=8)
    kv = entries(64, 3)
    pool.store(0, 0, device(s, kv))
    out = s.alloc_device(8 * ENTRY)
    sel = np.arange(8, dtype=np.int64)
    stop = time.monotonic() + 0.3

    def flip():
        while time.monotonic() < stop:
            sel[3] = 1 << 40
            sel[3] = 3

    t = threading.Thread(target=flip)
    t.start()
    while time.monotonic() < stop:
        try:
            pool.load(0, sel, out)
        except gpuio.Error:
            pass  # a position rewritten past the layer, refused
    t.join()
    sel[3] = 3
    assert pool.load(0, sel, out)["selected"] == 8
    assert np.array_equal(host(s, out).reshape(-1, ENTRY), kv[:8])


def test_kv_pool_refuses_bad_input_and_keeps_its_entries(s):
    pool = ai.KvPool(s, layers=1, entry_bytes=ENTRY, max_tokens=16, hot_slots=8, max_selection=8)
    kv = entries(16, 2)
    pool.store(0, 0, device(s, kv))
    out = s.alloc_device(4 * ENTRY)
    with pytest.raises(gpuio.Error) as e:
        pool.load(0, [1, 16], out)  # position 16 was never stored
    assert e.value.name == "GPUIO_ERROR_INVALID_ARG"
    with pytest.raises(gpuio.Error):
        pool.load(3, [1], out)  # no layer 3
    with pytest.raises(gpuio.Error):
        pool.store(0, 20, device(s, kv))  # a gap past the end
    with pytest.raises(TypeError):
        pool.load(0, [1], np.empty(ENTRY, dtype=np.uint8))  # host memory as the destination
    with pytest.raises(ValueError):
        pool.load(0, [-1], out)
    # Host arrays go to Rust as they are: 64-bit integers, none negative.
    with pytest.raises(gpuio.Error) as e:
        pool.load(0, np.array([1, 2], dtype=np.int32), out)
    assert e.value.name == "GPUIO_ERROR_INVALID_ARG"
    with pytest.raises(gpuio.Error):
        pool.load(0, np.array([1, -2], dtype=np.int64), out)
    pool.load(0, [15, 0], out)
    want = bytearray(2 * ENTRY)
    s.copy(out, want, size=2 * ENTRY)
    for same in (array.array("q", [15, 0]), np.array([15, 9, 0, 3], dtype=np.uint64)[::2]):
        s.copy(bytes(2 * ENTRY), out)
        assert pool.load(0, same, out)["selected"] == 2
        got = bytearray(2 * ENTRY)
        s.copy(out, got, size=2 * ENTRY)
        assert got == want
    with pytest.raises(gpuio.Error):
        ai.KvPool(s, layers=0, entry_bytes=ENTRY, max_tokens=16)
    with pytest.raises(gpuio.Error):
        ai.KvPool(s, layers=1, entry_bytes=ENTRY, max_tokens=16, placement="file:///x")
    r = pool.load(0, [15, 0], out)
    assert r["selected"] == 2
    assert np.array_equal(host(s, out)[: 2 * ENTRY].reshape(-1, ENTRY), kv[[15, 0]])


def test_swap_in_batch_loads_device_selections(s):
    kvs = [ai.SwapInKv(s, layers=1, entry_bytes=ENTRY, max_tokens=128, hot_slots=32,
                       max_selection=16) for _ in range(2)]
    data = [entries(128, 10 + i) for i in range(2)]
    for kv, d in zip(kvs, data):
        assert kv.append(0, d) == 0
        assert kv.len(0) == 128
    assert kvs[1].entry(0, 7) == data[1][7].tobytes()
    sels = [np.array([3, 90, 7, 127], dtype=np.uint32), np.array([0, 1, 2], dtype=np.uint32)]
    # A selection buffer holds max_selection positions; a load reads its first counts[i].
    sel_dev = [device(s, np.resize(x, 16)) for x in sels]
    outs = [s.alloc_device(16 * ENTRY) for _ in range(2)]
    batch = ai.SwapInBatch(s, 0, [(kvs[0], sel_dev[0], outs[0]), (kvs[1], sel_dev[1], outs[1], 0)])
    assert len(batch) == 2
    for step in range(2):
        reports = batch.load([4, 3])
        assert [r["selected"] for r in reports] == [4, 3]
        for sel, d, out in zip(sels, data, outs):
            got = host(s, out)[: len(sel) * ENTRY].reshape(-1, ENTRY)
            assert np.array_equal(got, d[sel.astype(np.int64)])
    assert reports[0]["hits"] == 4  # the second step found them in the hot buffer
    # A prefetch of the 2 positions after the count: installed, never delivered.
    assert batch.prefetched() is None
    nxt = np.array([3, 90, 7, 127, 55, 66], dtype=np.uint32)
    s.copy(np.resize(nxt, 16), sel_dev[0])
    s.copy(bytes(16 * ENTRY), outs[0])
    batch.set_prefetch([2, 0])
    reports = batch.load([4, 3])
    got = host(s, outs[0]).reshape(-1, ENTRY)
    assert np.array_equal(got[:4], data[0][[3, 90, 7, 127]]) and not got[4:6].any()
    pre = batch.prefetched()
    assert (pre[0]["selected"], pre[0]["misses"], pre[1]["selected"]) == (2, 2, 0)
    s.copy(np.resize(np.array([55, 66, 3], dtype=np.uint32), 16), sel_dev[0])
    batch.set_prefetch([0, 0])
    assert batch.load([3, 3])[0]["hits"] == 3  # the prefetched positions were in slots
    got = host(s, outs[0]).reshape(-1, ENTRY)
    assert np.array_equal(got[:3], data[0][[55, 66, 3]])
    with pytest.raises(gpuio.Error):
        batch.set_prefetch([17, 0])  # past max_selection
    # A sequence is in one batch per layer at a time.
    with pytest.raises(gpuio.Error):
        ai.SwapInBatch(s, 0, [(kvs[0], sel_dev[0], outs[0])])
    del batch
    bad = device(s, np.array([3, 3] * 8, dtype=np.uint32))  # a position twice
    batch = ai.SwapInBatch(s, 0, [(kvs[0], bad, outs[0]), (kvs[1], sel_dev[1], outs[1])])
    reports = batch.load([2, 3])
    assert isinstance(reports[0], gpuio.Error) and reports[1]["selected"] == 3
    with pytest.raises(gpuio.Error):
        kvs[0].append(0, b"\x00" * (ENTRY - 1))


def test_engram_table_lookup_store_hot_tier_and_prefetch(s):
    rows, row = 1000, 32
    t = ai.EngramTable(s, rows, row)
    assert (t.rows, t.row_bytes) == (rows, row)
    table = np.random.default_rng(3).integers(0, 256, (rows, row), dtype=np.uint8)
    s.copy(table, t.memory())
    ids = [999, 0, 5, 5, 42]
    out = s.alloc_device(len(ids) * row)
    r = t.lookup(ids, out)
    assert r["rows"] == 5 and not r["hot"]
    assert np.array_equal(host(s, out).reshape(-1, row), table[ids])

    new = entries(2, 4)[:, :row].copy()
    t.store([7, 8], device(s, new))
    table[[7, 8]] = new
    assert t.hot_stats() is None
    kept = t.keep_hot([5, 7, 7])
    assert kept["rows"] == 2 and t.hot_stats()["rows"] == 2
    ids = [7, 8, 5, 1]
    out = s.alloc_device(len(ids) * row)
    assert t.lookup(ids, out)["hot"]
    assert np.array_equal(host(s, out).reshape(-1, row), table[ids])
    # A store re-copies the kept rows it writes.
    t.store([7], device(s, table[[1]]))
    table[7] = table[1]
    req = t.prefetch(ids, out)
    assert req.wait()["rows"] == 4 and req.done() and req.status == "completed"
    assert np.array_equal(host(s, out).reshape(-1, row), table[ids])
    w = t.store_async([9], device(s, table[[2]]))
    assert w.wait() is None and not w.cancel()
    table[9] = table[2]
    t.drop_hot()
    assert t.hot_stats() is None
    out = s.alloc_device(row)
    t.lookup([9], out)
    assert np.array_equal(host(s, out), table[9])
    with pytest.raises(gpuio.Error):
        t.lookup([rows], out)


def test_engram_lookups_in_several_tables_run_together(s):
    rng = np.random.default_rng(5)
    row = 64
    tables, contents = [], []
    for rows in (500, 300, 200):
        t = ai.EngramTable(s, rows, row)
        c = rng.integers(0, 256, (rows, row), dtype=np.uint8)
        s.copy(c, t.memory())
        tables.append(t)
        contents.append(c)
    tables[0].keep_hot(list(range(0, 500, 3)))
    tables[1].keep_hot(list(range(0, 300, 2)))
    ids = [rng.integers(0, n, k) for n, k in ((500, 24), (300, 40), (200, 7))]
    out = s.alloc_device((24 + 40) * row)
    other = s.alloc_device(7 * row)
    # Both kept: one gather; with a table that keeps nothing: one by one. Either way the rows.
    for _ in range(12):
        reports = ai.EngramTable.lookup_tables(
            [(tables[0], ids[0], out), (tables[1], ids[1], out, 24 * row)]
        )
        assert [r["rows"] for r in reports] == [24, 40] and all(r["hot"] for r in reports)
        got = host(s, out).reshape(-1, row)
        assert np.array_equal(got[:24], contents[0][ids[0]])
        assert np.array_equal(got[24:], contents[1][ids[1]])
    reports = ai.EngramTable.lookup_tables(
        [(tables[2], ids[2].tolist(), other), (tables[0], ids[0], out)]
    )
    assert [r["hot"] for r in reports] == [False, True]
    assert np.array_equal(host(s, other).reshape(-1, row), contents[2][ids[2]])
    assert ai.EngramTable.lookup_tables([]) == []
    # A bad id is refused before anything moves; so is a malformed lookup.
    with pytest.raises(gpuio.Error):
        ai.EngramTable.lookup_tables([(tables[0], ids[0], out), (tables[2], [200], other)])
    with pytest.raises(ValueError):
        ai.EngramTable.lookup_tables([(tables[0], ids[0], out, 0, 1)])
    # Lookups as any iterable, with ids as bytes, offsets and wrapped tables as the Rust half
    # reads them; and what it cannot read, refused with its type.
    s.copy(np.zeros(7 * row, dtype=np.uint8), other)
    reports = ai.EngramTable.lookup_tables(
        lk for lk in [(tables[2], ids[2].astype("<u8").tobytes(), other, 0)]
    )
    assert reports[0]["rows"] == 7
    assert np.array_equal(host(s, other).reshape(-1, row), contents[2][ids[2]])
    assert ai.EngramTable.lookup_tables(((tables[2], ids[2], other),))[0]["rows"] == 7
    with pytest.raises(TypeError):
        ai.EngramTable.lookup_tables([(object(), ids[0], out)])
    with pytest.raises(TypeError):
        ai.EngramTable.lookup_tables([(tables[0], ids[0], bytearray(24 * row))])


def test_engram_similarity_and_graph_gathers(s, tmp_path):
    t = ai.EngramTable(s, 4, 8)  # rows of two f32 values
    vals = np.array([[1, 0], [0, 1], [0.5, 0.5], [-1, 0]], dtype=np.float32)
    s.copy(vals.view(np.uint8).reshape(-1), t.memory())
    best = t.similar([1.0, 0.2], k=2)
    assert [i for i, _ in best] == [0, 2]
    assert best[0][1] == pytest.approx(1.0)
    with pytest.raises(gpuio.Error):
        t.similar([1.0], k=1)

    # 0 -> 1, 2; 1 -> 3; 2 -> 3, 4; 3 -> 0; 4 -> (none); 5 -> 4.
    g = ai.CsrGraph([0, 2, 3, 5, 6, 6, 7], [1, 2, 3, 3, 4, 0, 4])
    assert (g.nodes, g.edges) == (6, 7) and g.neighbors(2) == [3, 4]
    sub = g.expand([5, 0, 5])
    assert sub["nodes"] == [5, 0, 4, 1, 2, 3] and sub["hop_starts"] == [0, 2, 5, 6]
    with pytest.raises(gpuio.Error):
        ai.CsrGraph([0, 2], [1, 9])
    assert ai.graph_scatter([0.1, 0.9, float("nan"), 0.5], 3) == [1, 3, 0]

    row = 16
    emb = np.random.default_rng(5).integers(0, 256, (6, row), dtype=np.uint8)
    pool = s.alloc_host(emb.nbytes)
    s.copy(emb, pool)
    path = tmp_path / "emb.bin"
    path.write_bytes(emb.tobytes())
    for source in (pool, str(path)):
        out = s.alloc_device(6 * row)
        sub = ai.graph_gather(s, g, [5], source, out, row_bytes=row, hops=1)
        assert sub["nodes"] == [5, 4]
        got = host(s, out)[: 2 * row].reshape(-1, row)
        assert np.array_equal(got, emb[[5, 4]])


def test_quantization_and_frames(s, tmp_path):
    rng = np.random.default_rng(6)
    values = rng.standard_normal(1000).astype(np.float32)
    for fmt in ("f16", "fp8", "int8", "int4"):
        q = ai.quantize(values, fmt, block=32)
        assert len(q) == 1000 and q.format[0] == fmt
        back = np.asarray(ai.dequantize(q))
        assert back.shape == (1000,) and np.max(np.abs(back - values)) < 0.6
        assert q.stored_bytes < values.nbytes
        dq = ai.quantize_device(device(s, values), fmt, block=32)
        assert dq.to_host().data == q.data and dq.to_host().scales == q.scales
        out = s.alloc_device(values.nbytes)
        dq.dequantize_into(out)
        assert host(s, out).tobytes() == np.asarray(back).tobytes()
    with pytest.raises(gpuio.Error):
        ai.quantize([float("inf")], "int8")
    with pytest.raises(gpuio.Error):
        ai.quantize([1.0], "int3")

    data = bytes(range(256)) * 64
    frame = ai.compress(data, "zstd", 5)
    info = ai.frame_info(frame)
    assert info["raw_len"] == len(data) and info["codec"] == "zstd"
    assert ai.decompress(frame, len(data)) == data
    damaged = bytearray(frame)
    damaged[-1] ^= 0xFF
    with pytest.raises(gpuio.Error):
        ai.decompress(bytes(damaged), len(data))

    src = s.alloc_device(len(data))
    s.copy(data, src)
    path = str(tmp_path / "frames.bin")
    r = ai.transfer_compressed(s, src, path, codec="lz4")
    assert r["raw_bytes"] == len(data) and r["stored_bytes"] < len(data)
    back = s.alloc_device(len(data))
    r2 = ai.read_compressed(s, path, back, len(data))
    assert r2["frames"] == r["frames"] and host(s, back).tobytes() == data
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"\xff" * 8)
    with pytest.raises(gpuio.Error):
        ai.read_compressed(s, path, back, len(data))


def test_ai_work_runs_in_its_scheduler_class(s):
    assert ai.work_class("prefetch") == ("background", None)
    assert ai.work_class("checkpoint") == ("checkpoint", None)
    p, due = ai.work_class("inference", deadline=0.010, compute=0.004)
    assert p == "inference_realtime" and due == pytest.approx(0.006, abs=1e-4)
    assert ai.work_class("inference", deadline=1, best_effort=True)[0] == "training_forward"
    with pytest.raises(gpuio.Error):
        ai.work_class("inference", deadline=0.001, compute=0.002)
    with pytest.raises(gpuio.Error):
        ai.work_class("sleep")

    ctx = ai.AiContext(s)
    pool = ctx.open_sequence(7, layers=1, entry_bytes=ENTRY, max_tokens=8, hot_slots=4,
                             max_selection=4)
    assert ctx.sequence(7) is pool
    with pytest.raises(gpuio.Error):
        ctx.open_sequence(7, layers=1, entry_bytes=ENTRY, max_tokens=8)
    src = device(s, entries(4, 8))
    dst = s.alloc_device(4 * ENTRY)
    r = ctx.submit("inference", src, dst, deadline=1.0, compute=0.1)
    assert r.wait() == 4 * ENTRY
    assert host(s, dst).tobytes() == host(s, src).tobytes()
    assert ctx.submit("checkpoint", src, dst).wait() == 4 * ENTRY
    with pytest.raises(gpuio.Error):
        s.copy_async(src, dst, priority="urgent")
    assert s.copy_async(src, dst, priority="background", deadline=0.5).wait() == 4 * ENTRY
    assert ctx.close_sequence(7) and not ctx.close_sequence(7)


def test_ai_io_waits_for_more_urgent_work():
    import time

    # Less urgent work is held back for up to 30 s (the starvation bound) while a lease runs.
    s = gpuio.Session(toml="[scheduler]\nmax_wait_us = 30000000\n")
    t = ai.EngramTable(s, 64, 32)
    table = np.random.default_rng(9).integers(0, 256, (64, 32), dtype=np.uint8)
    s.copy(table, t.memory())
    out = s.alloc_device(64 * 32)
    with s.lease("inference_realtime", deadline=60):
        req = t.prefetch(list(range(63, -1, -1)), out)
        time.sleep(0.3)
        assert not req.done(), "a prefetch ran during a realtime lease"
        one = s.alloc_device(32)
        assert t.lookup([3], one)["rows"] == 1  # the decode's own class is not held back
        assert host(s, one).tobytes() == table[3].tobytes()
    assert req.wait()["rows"] == 64
    assert np.array_equal(host(s, out).reshape(-1, 32), table[::-1])

    lease = s.lease("background")
    lease.release()
    lease.release()
    with pytest.raises(gpuio.Error):
        s.lease("urgent")
    pool = ai.KvPool(s, layers=1, entry_bytes=ENTRY, max_tokens=8, hot_slots=4, max_selection=4)
    pool.set_work("inference", deadline=1.0, compute=0.1)
    pool.set_work("training_backward")
    with pytest.raises(gpuio.Error):
        pool.set_work("inference")  # no deadline
    with pytest.raises(gpuio.Error):
        t.set_work("nap")
    t.set_work("prefetch")
    kv = entries(8, 1)
    pool.store(0, 0, device(s, kv))
    got = s.alloc_device(2 * ENTRY)
    pool.load(0, [7, 0], got)
    assert np.array_equal(host(s, got).reshape(-1, ENTRY), kv[[7, 0]])
