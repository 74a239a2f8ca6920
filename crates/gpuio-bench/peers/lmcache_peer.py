"""LMCache's own KV-chunk stores against gpuio's connector (gpuio.lmcache.GpuioConnector), on
the same chunks, through the interfaces LMCache itself drives them by:

- gpuio, pinned: the connector as LMCache's `native_plugin` L2 adapter, every chunk in its
  pinned host tier;
- gpuio, file: the same with no host tier, every chunk in a file (warm: in the page cache);
- LMCache fs: its filesystem L2 adapter (`fs`), the local-disk store of its multiprocess
  mode, files warm in the page cache;
- LMCache CPU: its `LocalCPUBackend`, the CPU tier of its engine, which keeps the chunk
  objects it is handed; a retrieve is its `get_blocking` plus the copy into the caller's
  buffer that a load needs (the L2 stores copy into the buffer they are given).

Each store writes every chunk once (timed as one batch); each retrieve reads every chunk
back into other buffers, as one batch and one chunk at a time (per-chunk latency), and every
chunk read is compared with what was stored. Before each retrieve the buffers are cleared and
a GiB is read elsewhere, so that no side finds its buffers in the CPU's caches. L2
adapters are waited on as LMCache's controllers wait: on their event fds. Prints one JSON line: per store its store and
retrieve bytes/s, p50 latency per chunk, and its problems (a store refused, a chunk not found
or not loaded, a chunk that differs), none where all is well.

argv: scratch directory, chunks, timed repetitions.
"""

import json
import os
import select
import shutil
import sys
import time

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat

root, chunks, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# One chunk: 256 tokens of K and V of a Llama-3-8B-sized model in bf16 (32 layers, 8 KV heads
# of 128), 32 MiB, in LMCache's KV_2LTD layout.
SHAPE = torch.Size([2, 32, 256, 1024])
alloc = AdHocMemoryAllocator(device="cpu")


def chunk():
    return alloc.allocate([SHAPE], [torch.bfloat16], fmt=MemoryFormat.KV_2LTD)


def keys(n, salt):
    return [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(salt * 1_000_003 + i),
                      model_name="bench", kv_rank=0) for i in range(n)]


src = [chunk() for _ in range(chunks)]
for i, o in enumerate(src):
    o.tensor.view(torch.int16).copy_(
        torch.randint(-32768, 32767, SHAPE, dtype=torch.int16,
                      generator=torch.Generator().manual_seed(i)))
dst = [chunk() for _ in range(chunks)]
CHUNK_BYTES = src[0].tensor.numel() * src[0].tensor.element_size()
TOTAL = CHUNK_BYTES * chunks


def differing():
    # Bit for bit: random bits as bf16 hold NaNs, which no float comparison calls equal.
    bits = lambda o: o.tensor.view(torch.int16)
    return [i for i, (a, b) in enumerate(zip(src, dst)) if not torch.equal(bits(a), bits(b))]


# Read after the destinations are cleared, so that neither side's timed copy finds them, or
# its sources, in the CPU's caches (the H200's host has 300 MiB of L3). Read, not written: a
# fill this large streams past the caches and evicts nothing. Left dirty in the cache, the
# cleared destinations took gpuio's streaming stores at 34-37 GB/s instead of 49-51, and
# torch's copy at the same 32-33 GB/s either way.
SCRATCH = torch.ones(1 << 30, dtype=torch.uint8)


def clear():
    for o in dst:
        o.tensor.zero_()
    if int(SCRATCH.sum()) != SCRATCH.numel():  # the read itself is the point
        raise RuntimeError("the eviction buffer changed")


def wait(fd, query):
    """A result as LMCache's storage controllers wait for one: poll the adapter's event fd
    (consuming each signal), query after each; no spinning that would hold the GIL from the
    adapter's threads."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        r = query()
        if r is not None:
            return r
        if poller.poll(1000):
            try:
                os.eventfd_read(fd)
            except BlockingIOError:
                pass


class L2:
    """An L2 adapter driven as LMCache's multiprocess server drives it."""

    def __init__(self, config):
        cfg = get_l2_adapter_config_class(config["type"]).from_dict(config)
        self.adapter = create_l2_adapter(cfg)

    def store(self, ks, objs):
        a = self.adapter
        task = a.submit_store_task(ks, objs)
        done = {}

        def query():
            done.update(a.pop_completed_store_tasks())
            return done.get(task)

        return wait(a.get_store_event_fd(), query).is_successful()

    def lock(self, ks):
        a = self.adapter
        task = a.submit_lookup_and_lock_task(ks, {})
        result = wait(a.get_lookup_and_lock_event_fd(),
                      lambda: a.query_lookup_and_lock_result(task))
        return result.count_leading_ones()

    def load(self, ks, objs):
        a = self.adapter
        task = a.submit_load_task(ks, objs)
        return wait(a.get_load_event_fd(), lambda: a.query_load_result(task)).count_leading_ones()

    def unlock(self, ks):
        self.adapter.submit_unlock(ks)

    def close(self):
        self.adapter.close()


class CpuBackend:
    """LMCache's engine CPU tier: it keeps the objects it is handed."""

    def __init__(self):
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        size_gb = 2 * TOTAL / (1 << 30) + 1
        config = LMCacheEngineConfig.from_defaults(local_cpu=True, max_local_cpu_size=size_gb)
        self.backend = LocalCPUBackend(config, memory_allocator=alloc)
        self.key = lambda k: CacheEngineKey("bench", 1, 0, int.from_bytes(k.chunk_hash, "little"),
                                            torch.bfloat16)

    def store(self, ks, objs):
        self.backend.batched_submit_put_task([self.key(k) for k in ks], objs)
        return True

    def lock(self, ks):
        return sum(self.backend.contains(self.key(k)) for k in ks)

    def load(self, ks, objs):
        n = 0
        for k, o in zip(ks, objs):
            got = self.backend.get_blocking(self.key(k))
            if got is None:
                break
            o.tensor.copy_(got.tensor)
            got.ref_count_down()
            n += 1
        return n

    def unlock(self, ks):
        pass  # `contains` without `pin` locks nothing

    def close(self):
        self.backend.close()


def measure(name, make):
    result = {"name": name}
    try:
        store = make()
    except Exception as e:  # a store LMCache cannot build here is reported, not faked
        result["absent"] = f"{type(e).__name__}: {e}"
        return result
    stored, loaded, single, problems = [], [], [], []

    def check(what, got, want):
        if got != want:
            problems.append(f"round {rep}: {what} {got}, not {want}")

    for rep in range(reps + 1):
        ks = keys(chunks, rep)
        t = time.perf_counter()
        check("stored", store.store(ks, src), True)
        stored.append(time.perf_counter() - t)
        check("found", store.lock(ks), chunks)
        clear()
        t = time.perf_counter()
        check("loaded", store.load(ks, dst), chunks)
        loaded.append(time.perf_counter() - t)
        check("chunks differing after a batch", differing(), [])
        clear()
        for i, k in enumerate(ks):
            t = time.perf_counter()
            check(f"chunk {i} loaded", store.load([k], [dst[i]]), 1)
            single.append(time.perf_counter() - t)
        check("chunks differing after single loads", differing(), [])
        store.unlock(ks)
    store.close()
    # The first round warms up (files created, page cache filled); the rest are timed.
    best = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2]
    single = sorted(single[chunks:])
    result.update(store_bps=TOTAL / best(stored), retrieve_bps=TOTAL / best(loaded),
                  chunk_p50_us=single[len(single) // 2] * 1e6, problems=problems[:8])
    return result


def gpuio_store(host_gb, sub):
    path = os.path.join(root, sub)
    shutil.rmtree(path, ignore_errors=True)
    return L2({"type": "native_plugin", "module_path": "gpuio.lmcache",
               "class_name": "GpuioConnector",
               "adapter_params": {"host_gb": host_gb, "root": path, "workers": 8},
               "max_capacity_gb": 64})


def fs_store():
    path = os.path.join(root, "lmcache-fs")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return L2({"type": "fs", "base_path": path})


pinned_gb = (reps + 1) * TOTAL / (1 << 30) + 1
out = {
    "chunk_bytes": CHUNK_BYTES,
    "chunks": chunks,
    "stores": [
        measure("gpuio pinned", lambda: gpuio_store(pinned_gb, "gpuio-pinned")),
        measure("gpuio file", lambda: gpuio_store(0, "gpuio-file")),
        measure("LMCache fs", fs_store),
        measure("LMCache CPU", CpuBackend),
    ],
}
shutil.rmtree(root, ignore_errors=True)
print(json.dumps(out))
