"""torch CUDA tensors through the binding (the GPU machine): round trips through files and host
pools, borrowed in place through the CUDA array interface and DLPack. Skipped where torch or
CUDA is missing, unless GPUIO_REQUIRE_CUDA=1 makes that a failure."""

import asyncio
import os

import numpy as np
import pytest

import gpuio

REQUIRE = os.environ.get("GPUIO_REQUIRE_CUDA") == "1"
try:
    import torch
except ImportError:
    if REQUIRE:
        raise
    pytest.skip("torch is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    if REQUIRE:
        raise RuntimeError("GPUIO_REQUIRE_CUDA=1 but torch sees no CUDA device")
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

MiB = 1 << 20


@pytest.fixture(scope="module")
def s():
    session = gpuio.Session()
    assert gpuio.info()["devices"][0]["backend"] == "Cuda"
    return session


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(11).integers(0, 256, 16 * MiB, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


def cpu(t):
    return t.cpu().numpy().view(np.uint8).reshape(-1)


def test_cpu_tensors_are_read_and_written_in_place(s, data_file, tmp_path):
    path, data = data_file
    t = torch.empty(data.nbytes // 4, dtype=torch.float32)
    address = t.data_ptr()
    assert s.read(path, t) == data.nbytes
    assert t.data_ptr() == address
    assert np.array_equal(t.numpy().view(np.uint8), data)
    out = tmp_path / "cpu.bin"
    assert s.write(str(out), t[: MiB // 4]) == MiB
    assert out.read_bytes() == data[:MiB].tobytes()
    # Host tensor to CUDA tensor and back, the host side in place.
    dev = torch.empty(data.nbytes, dtype=torch.uint8, device="cuda")
    s.copy(t, dev)
    back = torch.zeros(data.nbytes // 4, dtype=torch.float32)
    s.copy(dev, back)
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))  # bytes: NaNs differ


def test_file_to_tensor_and_back(s, data_file, tmp_path):
    path, data = data_file
    t = torch.empty(data.nbytes // 2, dtype=torch.float16, device="cuda")
    assert s.read(path, t) == data.nbytes
    assert np.array_equal(cpu(t), data)
    # The tensor is usable at once on torch's stream.
    assert torch.equal((t.view(torch.uint8).to(torch.int32) + 1 - 1).to(torch.uint8), t.view(torch.uint8))
    out = tmp_path / "out.bin"
    assert s.write(str(out), t) == data.nbytes
    assert out.read_bytes() == data.tobytes()
    part = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    s.read(s.open(path), part, offset=3 * MiB)
    assert np.array_equal(cpu(part), data[3 * MiB : 4 * MiB])


def test_work_queued_by_torch_is_done_before_gpuio_reads_the_tensor(s, tmp_path):
    t = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(20):
            t.add_(1)  # queued, not yet run, when gpuio is called
    out = tmp_path / "queued.bin"
    s.write(str(out), t)
    assert set(out.read_bytes()[: 1 << 16]) == {20}


def test_host_pools_and_device_copies(s, data_file):
    _, data = data_file
    pool = s.alloc_host(data.nbytes)
    assert pool.pinned
    host = torch.from_numpy(np.asarray(pool))  # the pinned pool as a CPU tensor, no copy
    host.copy_(torch.from_numpy(data))
    t = torch.empty(data.nbytes, dtype=torch.uint8, device="cuda")
    assert s.copy(pool, t) == data.nbytes
    assert np.array_equal(cpu(t), data)
    dev = s.alloc_device(data.nbytes)
    view = torch.as_tensor(dev, device="cuda")  # gpuio's memory seen by torch (CUDA array interface)
    s.copy(t, dev)
    assert torch.equal(view, t)
    shared = torch.from_dlpack(dev)  # ... and through DLPack
    assert shared.device.type == "cuda" and torch.equal(shared, t)
    shared[:4096] = 0  # queued on torch's stream: gpuio waits for it before it reads
    back = np.zeros_like(data)
    s.copy(dev, back)
    assert not back[:4096].any() and np.array_equal(back[4096:], data[4096:])


def test_gather_into_a_tensor_matches_index_select(s):
    rows, row = 4096, 512
    pool = s.alloc_host(rows * row)
    table = torch.from_numpy(np.asarray(pool)).view(rows, row)
    table.copy_(torch.randint(0, 256, (rows, row), dtype=torch.uint8))
    idx = torch.randint(0, rows, (1000,), dtype=torch.int64)
    out = torch.empty(1000, row, dtype=torch.uint8, device="cuda")
    assert s.gather(pool, idx, out)["rows"] == 1000
    assert torch.equal(out.cpu(), table.index_select(0, idx))


def test_dlpack_only_producers_are_borrowed_in_place(s, data_file):
    path, data = data_file

    class DlpackOnly:  # JAX-like: DLPack, no CUDA array interface
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__(stream=stream)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    t = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    s.read(path, DlpackOnly(t))
    assert np.array_equal(cpu(t), data[:MiB])


def test_bad_tensors_are_refused_and_nothing_is_written(s, data_file):
    path, _ = data_file
    base = torch.zeros(2 * MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="contiguous"):
        s.read(path, base[::2])
    assert int(base.sum()) == 0
    with pytest.raises(gpuio.Error) as e:
        s.read(path, base, size=64 * MiB)
    assert e.value.code == -3
    assert int(base.sum()) == 0
    with pytest.raises(ValueError, match="empty"):
        s.read(path, torch.empty(0, dtype=torch.uint8, device="cuda"))


def test_a_queued_request_keeps_its_tensor_alive(s, tmp_path):
    import weakref

    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(256 * MiB))
    t = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    alive = weakref.ref(t)
    s.read_async(str(path), t)  # the request's handle is dropped at once
    del t
    assert alive() is not None, "the tensor was freed while a transfer could still write it"


def test_async_reads_into_tensors(s, data_file):
    path, data = data_file
    f = s.open(path)
    a = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(MiB, dtype=torch.uint8, device="cuda")

    async def both():
        return await asyncio.gather(s.read_async(f, a), s.read_async(f, b, offset=MiB))

    assert asyncio.run(both()) == [MiB, MiB]
    assert np.array_equal(cpu(a), data[:MiB]) and np.array_equal(cpu(b), data[MiB : 2 * MiB])
    r = s.read_async(f, a, offset=5 * MiB)
    assert r.wait() == MiB and r.done()
    assert np.array_equal(cpu(a), data[5 * MiB : 6 * MiB])


def test_safetensors_loads_equal_safetensors_own_on_the_gpu(s, tmp_path):
    from safetensors.torch import load_file as st_load, save_file as st_save

    from gpuio import safetensors as gst

    g = torch.Generator().manual_seed(5)
    tensors = {
        "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "f8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "f16": torch.randn(5, 3, generator=g).to(torch.float16),
        "i64": torch.arange(-7, 7),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "rows": torch.randn(300, 64, generator=g),
    }
    path = str(tmp_path / "m.safetensors")
    st_save(tensors, path, metadata={"format": "pt"})
    theirs = st_load(path, device="cuda:0")
    for direct in (False, True):  # buffered, and O_DIRECT
        ours = gst.load_file(path, device="cuda:0", session=s, direct=direct)
        assert list(ours) == sorted(theirs)
        for name, t in theirs.items():
            assert ours[name].device == t.device and ours[name].dtype == t.dtype
            assert ours[name].shape == t.shape
            as_bytes = [x.reshape(-1).view(torch.uint8) for x in (ours[name], t)]  # scalars
            assert torch.equal(*as_bytes), (name, direct)
        with gst.safe_open(path, framework="pt", device="cuda:0", session=s,
                           direct=direct) as f:
            assert f.metadata() == {"format": "pt"}
            assert torch.equal(f.get_tensor("bf16").cpu(), tensors["bf16"])
            assert torch.equal(f.get_slice("rows")[100:164].cpu(), tensors["rows"][100:164])


def test_safetensors_offset_unsuited_to_the_element_size_on_the_gpu(s, tmp_path):
    import struct

    from gpuio import safetensors as gst

    # `a` is large enough that its read is still running when the views are made: `b`, a
    # copy of its bytes, must wait for them.
    n = (64 << 20) + 3
    a = torch.randint(0, 256, (n,), dtype=torch.uint8)
    b = torch.arange(4, dtype=torch.float32)
    header = (
        b'{"a":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]},' % (n, n)
        + b'"b":{"dtype":"F32","shape":[4],"data_offsets":[%d,%d]}}' % (n, n + 16)
    )
    path = tmp_path / "odd.safetensors"
    data = a.numpy().tobytes() + b.numpy().tobytes()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    got = gst.load_file(str(path), device="cuda:0", session=s)
    assert torch.equal(got["a"].cpu(), a) and torch.equal(got["b"].cpu(), b)


def test_safetensors_onto_every_gpu_replicated_and_split(s, tmp_path):
    """Every visible GPU (one on a one-GPU machine: the same paths, N = 1): replicated loads
    equal safetensors' own; split parts equal torch.tensor_split of them, put back together
    they are the tensor; progress reaches the total."""
    from safetensors.torch import load_file as st_load, save_file as st_save

    from gpuio import safetensors as gst

    g = torch.Generator().manual_seed(8)
    tensors = {
        "emb": torch.randn(1001, 64, generator=g).to(torch.bfloat16),
        "w0": torch.randn(96, 130, generator=g),
        "w1": torch.randn(7, 33, 5, generator=g).to(torch.float16),
        "bias": torch.arange(10, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "tiny": torch.ones(1, 3, dtype=torch.int16),  # a part with no rows on device 1
    }
    path = str(tmp_path / "m.safetensors")
    st_save(tensors, path)
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    theirs = st_load(path)
    seen = []
    copies = gst.load_replicated(path, devices, session=s, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1][0] == seen[-1][1] == sum(t.nbytes for t in tensors.values())
    for dev, got in zip(devices, copies):
        for name, t in theirs.items():
            assert got[name].device == torch.device(dev) and torch.equal(got[name].cpu(), t), name
    dims = {"emb": 0, "w0": 1, "w1": 2, "empty": 1, "tiny": 0}  # bias, scalar: whole
    current = torch.cuda.current_device()
    parts = gst.load_split(path, devices, dims, session=s)
    assert torch.cuda.current_device() == current  # the caller's device, after every GPU
    for name, t in theirs.items():
        want = [t] * len(devices) if name not in dims else t.tensor_split(len(devices), dims[name])
        for dev, got, w in zip(devices, parts, want):
            assert got[name].device == torch.device(dev) and torch.equal(got[name].cpu(), w), name
    with pytest.raises(gpuio.Error, match="no dim 3"):
        gst.load_split(path, devices, {"w0": 3}, session=s)
    with pytest.raises(gpuio.Error, match="lacks, e.g. 'w9'"):
        gst.load_split(path, devices, {"w9": 0}, session=s)
    with pytest.raises(gpuio.Error, match="different CUDA device"):
        gst.load_replicated(path, devices + devices[:1], session=s)


def test_ai_tier_on_torch_tensors(s):
    import gpuio.ai as ai

    entry, tokens = 656, 1024
    g = torch.Generator(device="cuda").manual_seed(3)
    kv = torch.randint(0, 256, (tokens, entry), dtype=torch.uint8, device="cuda", generator=g)
    pool = ai.KvPool(s, layers=2, entry_bytes=entry, max_tokens=tokens, hot_slots=256,
                     max_selection=128)
    pool.store(1, 0, kv)
    sel = torch.randperm(tokens, generator=torch.Generator().manual_seed(4))[:128]
    out = torch.empty((128, entry), dtype=torch.uint8, device="cuda")
    assert pool.load(1, sel.numpy(), out)["misses"] == 128
    assert torch.equal(out, kv[sel.cuda()])
    assert pool.load(1, sel.numpy(), out)["hits"] == 128
    assert torch.equal(out, kv[sel.cuda()])

    seq = ai.SwapInKv(s, layers=1, entry_bytes=entry, max_tokens=tokens, hot_slots=256,
                      max_selection=128)
    seq.append(0, kv.cpu().numpy())
    picks = torch.zeros(128, dtype=torch.int32, device="cuda")
    picks[:100] = sel[:100].to(torch.int32).cuda()
    dst = torch.empty((128, entry), dtype=torch.uint8, device="cuda")
    batch = ai.SwapInBatch(s, 0, [(seq, picks, dst)])
    for _ in range(2):
        (report,), (exposed, install) = batch.load([100], timed=True)
        assert report["selected"] == 100 and exposed > 0
        assert torch.equal(dst[:100], kv[sel[:100].cuda()])

    rows, row = 4096, 128
    t = ai.EngramTable(s, rows, row)
    table = np.random.default_rng(5).integers(0, 256, (rows, row), dtype=np.uint8)
    s.copy(table, t.memory())
    ids = np.random.default_rng(6).integers(0, rows, 512)
    got = torch.empty((512, row), dtype=torch.uint8, device="cuda")
    t.lookup(ids, got)
    assert np.array_equal(got.cpu().numpy(), table[ids])
    t.keep_hot(ids[:64])
    got.zero_()
    assert t.lookup(ids, got)["hot"]
    assert np.array_equal(got.cpu().numpy(), table[ids])
    got.zero_()
    assert t.prefetch(ids, got).wait()["rows"] == 512
    assert np.array_equal(got.cpu().numpy(), table[ids])
    f32 = np.random.default_rng(7).standard_normal((rows, 4)).astype(np.float32)
    q = ai.EngramTable(s, rows, 16)
    s.copy(f32, q.memory())
    query = np.array([0.5, -1.0, 2.0, 0.25], dtype=np.float32)
    best = q.similar(query, k=5)
    assert best[0][0] == int(np.argmax(f32 @ query))
    assert best[0][1] == pytest.approx(float(np.max(f32 @ query)), rel=1e-5)

    values = torch.randn(4096, device="cuda")
    for fmt in ("f16", "fp8", "int8", "int4"):
        dq = ai.quantize_device(values, fmt, block=64, session=s)
        hq = ai.quantize(values.cpu().numpy(), fmt, block=64)
        assert dq.to_host().data == hq.data and dq.to_host().scales == hq.scales
        back = torch.empty_like(values)
        dq.dequantize_into(s.device_buffer(back))
        assert torch.equal(back.cpu(), torch.frombuffer(bytearray(hq.dequantize()), dtype=torch.float32))


CONTEXTS = r"""
import ctypes, sys
import numpy as np
import gpuio

cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0


def active():
    count = ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    out = []
    for i in range(count.value):
        dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
        assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) == 0
        out.append(bool(on.value))
    return out


s = gpuio.Session()
assert not any(active()), "a session makes no context before a GPU is used"
data = np.arange(1 << 20, dtype=np.uint8)
path = sys.argv[1]
data.tofile(path)
first = s.alloc_device(data.nbytes, gpu=0)
s.read(s.open(path), first)
assert active() == [True] + [False] * (len(active()) - 1), active()
second = s.alloc_device(data.nbytes, gpu=1)
s.copy(first, second)
back = np.empty_like(data)
s.copy(second, back)
assert (back == data).all()
assert active()[:2] == [True, True], active()
print("ok")
"""


def test_calls_on_another_gpu_leave_the_callers_device(s, data_file):
    """gpuio binds the context of the GPU it works on to the calling thread; torch keys its
    current device on that context, so each call puts the caller's back: a read into GPU 1,
    a copy from it, an allocation, a gather and freeing gpuio's objects there leave
    ``"cuda"`` meaning GPU 0."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path, data = data_file
    torch.cuda.set_device(0)
    on1 = torch.empty(len(data), dtype=torch.uint8, device="cuda:1")
    s.read(s.open(path), on1)
    assert torch.cuda.current_device() == 0
    back = np.empty_like(data)
    s.copy(on1, back)
    assert (back == data).all() and torch.cuda.current_device() == 0
    buf = s.alloc_device(MiB, gpu=1)
    s.copy(on1[:MiB], buf)
    assert torch.cuda.current_device() == 0
    pool = s.alloc_host(64 * 16)
    np.asarray(pool)[:] = data[: 64 * 16]
    out = torch.empty(3, 64, dtype=torch.uint8, device="cuda:1")
    s.gather(pool, [5, 0, 9], out)
    want = torch.from_numpy(data[: 64 * 16].reshape(16, 64)[[5, 0, 9]])
    assert torch.equal(out.cpu(), want) and torch.cuda.current_device() == 0
    # Freeing gpuio's memory and streams on GPU 1 (garbage collection, on any thread).
    cache = s.page_cache(gpu=1, capacity=16 * MiB)
    del buf, cache
    import gc

    gc.collect()
    assert torch.cuda.current_device() == 0
    assert torch.empty(1, device="cuda").device.index == 0


def test_closing_a_session_that_used_another_gpu_leaves_the_callers_device(data_file):
    """A session's teardown unloads its kernels and releases each GPU's context, GPU 1's
    last here, and each binds its context to the thread to do so; the caller's is current
    again afterwards."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import gc

    path, data = data_file
    torch.cuda.set_device(0)
    on0 = torch.empty(len(data), dtype=torch.uint8, device="cuda:0")
    on1 = torch.empty(len(data), dtype=torch.uint8, device="cuda:1")
    own = gpuio.Session()
    own.read(own.open(path), on0)
    own.read(own.open(path), on1)
    pool = own.alloc_host(64 * 16)
    out = torch.empty(2, 64, dtype=torch.uint8, device="cuda:1")
    own.gather(pool, [1, 0], out)  # loads a kernel module on GPU 1
    assert torch.cuda.current_device() == 0
    del own, pool
    gc.collect()
    assert torch.cuda.current_device() == 0
    assert torch.empty(1, device="cuda").device.index == 0
    assert torch.equal(on1.cpu(), torch.from_numpy(data))


def test_a_session_makes_contexts_only_on_the_gpus_it_uses(tmp_path):
    """A fresh process's session on a machine of several GPUs makes no CUDA context until a
    GPU is used, then only that GPU's (another's costs ~0.15 s and memory on that GPU);
    peer copies work once the second has one."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", CONTEXTS, str(tmp_path / "d.bin")],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
