"""gpuio's AI memory tier: KV caches across GPU, host and cold tiers, Engram tables, graph
gathers, quantization and compression, and AI work mapped onto the scheduler's classes.

    import gpuio, gpuio.ai as ai, torch
    s = gpuio.Session()
    pool = ai.KvPool(s, layers=2, entry_bytes=656, max_tokens=4096)
    kv = torch.randn(4096 * 656 // 4, device="cuda")
    pool.store(0, 0, kv)                          # 4096 entries of layer 0, positions 0..4096
    out = torch.empty(2048 * 656, dtype=torch.uint8, device="cuda")
    pool.load(0, list(range(0, 4096, 2)), out)    # a top-k selection, gathered in order

GPU memory is a CUDA tensor or array (PyTorch, CuPy, JAX: borrowed in place, after the GPU's
queued work is done) or a gpuio ``DeviceBuffer``; a loop that passes the same tensor every
step borrows it once with :meth:`gpuio.Session.device_buffer` and passes that (work queued on
the tensor afterwards is then the caller's to finish first: ``torch.cuda.synchronize()``).
Ids, positions and selections are lists of ints or host arrays of 64-bit integers; scores
and queries lists of floats or host float32 arrays. Every call releases the GIL; errors raise
:class:`gpuio.Error`.
"""

import array
import struct

from . import _gpuio, _interop
from ._gpuio import DeviceBuffer, HostBuffer, Resource

_ai = _gpuio.ai

DeviceQuantizedKv = _ai.DeviceQuantizedKv
QuantizedKv = _ai.QuantizedKv
decompress = _ai.decompress
frame_info = _ai.frame_info
work_class = _ai.work_class

__all__ = [
    "AiContext",
    "CsrGraph",
    "DeviceQuantizedKv",
    "EngramTable",
    "KvBatch",
    "KvPool",
    "QuantizedKv",
    "SwapInBatch",
    "SwapInKv",
    "compress",
    "decompress",
    "dequantize",
    "frame_info",
    "graph_gather",
    "graph_scatter",
    "quantize",
    "quantize_device",
    "read_compressed",
    "transfer_compressed",
    "work_class",
]


def _device(session, obj, writable, what):
    if isinstance(obj, DeviceBuffer):
        return obj
    d = _interop.resolve(session, obj, writable)
    if not isinstance(d, DeviceBuffer):
        raise TypeError(f"{what} is GPU memory: a CUDA tensor or array, or a gpuio DeviceBuffer")
    return d


def _host(session, obj, what):
    h = _interop.resolve(session, obj, writable=False)
    if isinstance(h, HostBuffer):
        import numpy  # a gpuio host buffer's bytes, viewed through its array interface

        return memoryview(numpy.asarray(h))
    if not isinstance(h, (bytes, memoryview)):
        raise TypeError(f"{what} is host memory: bytes, an array or a CPU tensor")
    return h


def _f32(values, what):
    """Little-endian float32 bytes of a list of numbers or a host float32 array."""
    if isinstance(values, (list, tuple)):
        try:
            return struct.pack(f"<{len(values)}f", *values)
        except struct.error as e:
            raise ValueError(f"{what} must be numbers: {e}") from None
    if getattr(values, "__cuda_array_interface__", None) is not None:
        raise TypeError(f"{what} must be in host memory")
    view = memoryview(values) if _interop._has_buffer(values) else None
    if view is None and hasattr(values, "__dlpack__"):
        import numpy  # only for CPU DLPack producers without the buffer protocol

        view = memoryview(numpy.from_dlpack(values))
    if view is None or view.format not in ("f", "<f", "=f"):
        raise TypeError(f"{what} must be a list of numbers or a host float32 array")
    if not view.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    return view.tobytes()


def _ids(values):
    """Ids or positions for the Rust half. Bytes and host arrays (``array``, NumPy) go as they
    are: it reads them through the buffer protocol and checks they are 64-bit integers, one
    copy in all. Lists and tensors become little-endian u64 bytes here."""
    t = type(values)
    if t is bytes or t is array.array or (t.__name__ == "ndarray" and t.__module__ == "numpy"):
        return values
    return _interop.indices_bytes(values)


def _floats(raw):
    """float32 values of little-endian bytes, as a memoryview NumPy and PyTorch view."""
    return memoryview(raw).cast("f")


def _open(session, target, write):
    """A resource for ``target``: an opened one, or a path or URI opened now (a remote
    export for update, a file for writing where ``write``)."""
    if isinstance(target, Resource):
        return target
    if not isinstance(target, str):
        raise TypeError("give an opened gpuio Resource, a path or a URI")
    if target.startswith("remoteio://"):
        return session.open(target, update=True)
    return session.open(target, write=write)


class KvPool:
    """One sequence's KV entries: stored from GPU memory into pinned host memory (warm),
    loaded by selection into GPU memory through a hot buffer per layer (hits stay on the
    GPU), evicted by importance to a compressed cold tier (a file or another node's export)
    or dropped. One decode loop drives a pool."""

    __slots__ = ("_s", "_p", "entry_bytes")

    def __init__(self, session, layers, entry_bytes, max_tokens, warm_entries=None,
                 hot_slots=4096, max_selection=2048, gpu=0, placement="memio://cpu/dram"):
        self._s = session
        self._p = _ai.KvPool(session, layers, entry_bytes, max_tokens, warm_entries,
                             hot_slots, max_selection, gpu, placement)
        self.entry_bytes = entry_bytes

    @classmethod
    def deepseek_v32(cls, session, max_tokens, gpu=0):
        """DeepSeek V3.2's shape: 61 layers of 656-byte entries, top-2048 selections."""
        return cls(session, 61, 656, max_tokens, hot_slots=4096, max_selection=2048, gpu=gpu)

    def store(self, layer, first, src, count=None, scores=None, src_offset=0):
        """Stores ``count`` entries of ``layer`` from ``src`` (GPU memory; all of it from
        ``src_offset`` by default) at positions ``first..first + count``, with their
        importance ``scores`` (one per entry) where given."""
        d = _device(self._s, src, False, "a KV store's source")
        if count is None:
            count = (len(d) - src_offset) // self.entry_bytes
        raw = None if scores is None else _f32(scores, "scores")
        return self._p.store(layer, first, count, d, src_offset, raw)

    def load(self, layer, selection, dst, dst_offset=0):
        """Loads ``layer``'s entries at ``selection`` into ``dst`` (GPU memory), entry ``i``
        being position ``selection[i]``; a dict of what it did (selected, hits, misses,
        from_cold, bytes_from_host)."""
        # The common case without a call: a gpuio buffer, an array of ids.
        if type(dst) is not DeviceBuffer:
            dst = _device(self._s, dst, True, "a KV load's destination")
        if type(selection) is not array.array:
            selection = _ids(selection)
        return self._p.load(layer, selection, dst, dst_offset)

    def evict_by_importance(self, required, threshold=0.0):
        """Evicts the least important warm entries (below ``threshold`` first) until
        ``required`` entries of host memory are free."""
        return self._p.evict_by_importance(required, threshold)

    def compact(self, threshold):
        """Evicts every warm entry less important than ``threshold``."""
        return self._p.compact(threshold)

    def attach_cold_tier(self, target, codec="lz4", level=3):
        """Evicted entries go compressed to ``target`` from now on: a file path, a
        ``remoteio://`` export, or an opened Resource."""
        self._p.attach_cold_tier(_open(self._s, target, write=True), codec, level)

    def cold_tier_bytes(self):
        """(bytes stored, bytes before compression) of the cold tier, or None."""
        return self._p.cold_tier_bytes()

    def set_work(self, kind, deadline=None, compute=0.0, best_effort=False):
        """What the pool's loads, stores and evictions are for: ``decode`` unless set, spelled
        as :func:`work_class` takes it. Each call holds a scheduler lease of that class while
        it moves data, so less urgent IO (prefetches, write-backs, a checkpoint) waits for it;
        work that leaves no time for IO is refused."""
        self._p.set_work(_ai.Work(kind, deadline, compute, best_effort))

    def len(self, layer):
        """Positions ``layer`` holds."""
        return self._p.len(layer)

    def warm_free(self):
        """Entries host memory has room for."""
        return self._p.warm_free()

    def hot_entries(self, layer):
        """Entries of ``layer`` with a copy in its hot buffer."""
        return self._p.hot_entries(layer)

    def tier_of(self, layer, pos):
        """``warm``, ``cold``, ``dropped``, or None for a position never stored."""
        return self._p.tier_of(layer, pos)

    def importance(self, layer, pos):
        """Entry ``pos`` of ``layer``'s importance score."""
        return self._p.importance(layer, pos)

    def config(self):
        """The pool's shape, as a dict."""
        return self._p.config()


class KvBatch:
    """A decode step's loads of one layer for a batch of requests in one call: ``loads`` are
    ``(pool, layer, selection, dst)`` or ``(pool, layer, selection, dst, dst_offset)``, each
    pool once; one upload, one kernel, one wait for all of them."""

    __slots__ = ("_s", "_b")

    def __init__(self, session):
        self._s = session
        self._b = _ai.KvBatch()

    def load(self, loads, timed=False):
        """Every request's report, in order; with ``timed``, also the device's seconds."""
        # Rows of gpuio buffers and id arrays go as they are; the rest are converted here.
        loads = loads if type(loads) is list else list(loads)
        got = self._b.load(loads, timed, False)
        if got is None:
            got = self._b.load([self._row(item) for item in loads], timed, True)
        reports, device = got
        return (reports, device) if timed else reports

    def _row(self, item):
        if len(item) == 4:
            pool, layer, selection, dst = item
            off = 0
        else:
            pool, layer, selection, dst, off = item
        if isinstance(pool, KvPool):
            pool = pool._p
        elif not isinstance(pool, _ai.KvPool):  # the Rust half's own pool passes as it is
            raise TypeError("a KV batch's pool is a gpuio.ai.KvPool")
        dst = _device(self._s, dst, True, "a KV load's destination")
        return (pool, layer, _ids(selection), dst, off)


class SwapInKv:
    """One sequence's sparse KV for device-planned loads: entries appended from host memory,
    loaded by a :class:`SwapInBatch` whose selections are already on the GPU."""

    __slots__ = ("_s", "_k")

    def __init__(self, session, layers, entry_bytes, max_tokens, hot_slots=4096,
                 max_selection=2048, gpu=0, placement="memio://cpu/dram"):
        self._s = session
        self._k = _ai.SwapInKv(session, layers, entry_bytes, max_tokens, hot_slots,
                               max_selection, gpu, placement)

    def append(self, layer, entries):
        """Appends whole entries (host memory) to ``layer``; the first new position."""
        return self._k.append(layer, _host(self._s, entries, "entries"))

    def reset(self, layer):
        """Empties ``layer`` (its hot buffer too)."""
        self._k.reset(layer)

    def entry(self, layer, pos):
        """Entry ``pos`` of ``layer``, as bytes."""
        return self._k.entry(layer, pos)

    def len(self, layer):
        """Positions ``layer`` holds."""
        return self._k.len(layer)


class SwapInBatch:
    """One layer's loads for a batch of sequences: ``targets`` are ``(kv, selection, dst)``
    or ``(kv, selection, dst, dst_offset)``, each selection little-endian uint32 positions in
    GPU memory (an int32/uint32 CUDA tensor). Made once; :meth:`load` every step."""

    __slots__ = ("_b",)

    def __init__(self, session, layer, targets):
        rows = []
        for t in targets:
            kv, sel, dst, off = (*t, 0) if len(t) == 3 else t
            if not isinstance(kv, SwapInKv):
                raise TypeError("a swap-in target's sequence is a gpuio.ai.SwapInKv")
            rows.append((kv._k, _device(session, sel, False, "a selection"),
                         _device(session, dst, True, "a swap-in destination"), off))
        self._b = _ai.SwapInBatch(session, layer, rows)

    def load(self, counts, timed=False):
        """Loads the first ``counts[i]`` positions of sequence ``i``'s selection; a list of
        each sequence's report (a dict) or error (a :class:`gpuio.Error`, not raised: the
        others load all the same). With ``timed``, also (exposed, install) device seconds."""
        reports, times = self._b.load(list(counts), timed)
        return (reports, times) if timed else reports

    def set_prefetch(self, ahead):
        """Has every later load also bring the ``ahead[i]`` positions after sequence ``i``'s
        count in its selection (the indexer's next candidates, written after the top-k) into
        its hot buffer, after the load and off its critical path; nothing of them reaches
        ``dst``. 0 for none."""
        self._b.set_prefetch(list(ahead))

    def prefetched(self):
        """Waits for the last load's prefetch; each sequence's report of it (``hits`` already
        in slots, ``misses`` brought in) or error, or ``None`` where it prefetched nothing."""
        return self._b.prefetched()

    def set_work(self, kind, deadline=None, compute=0.0, best_effort=False):
        """What the batch's loads are for: ``decode`` unless set, spelled as
        :func:`work_class` takes it; each load holds a scheduler lease of that class."""
        self._b.set_work(_ai.Work(kind, deadline, compute, best_effort))

    def __len__(self):
        return len(self._b)


_lookup_tables = _ai.EngramTable.lookup_tables


def _table_lookup(lookup):
    """One lookup of :meth:`EngramTable.lookup_tables`, converted for the Rust half."""
    table, ids, dst, *rest = lookup
    if len(rest) > 1:
        raise ValueError("a lookup is (table, ids, dst) or (table, ids, dst, dst_offset)")
    if isinstance(table, EngramTable):
        t, d = table._t, _device(table._s, dst, True, "a lookup's destination")
    elif isinstance(table, _ai.EngramTable) and isinstance(dst, DeviceBuffer):
        t, d = table, dst  # the Rust half's own table, as it reads it too
    else:
        raise TypeError("a lookup's table is a gpuio.ai.EngramTable")
    return (t, _ids(ids), d, rest[0] if rest else 0)


class EngramTable:
    """Rows of conditional memory in pinned host memory (DRAM or CXL) read by id into GPU
    memory: lookups gather the rows (zero-copy or staged, whichever measured faster), a hot
    tier keeps copies of the rows read most on a GPU, :meth:`store` scatters rows back."""

    __slots__ = ("_s", "_t")

    def __init__(self, session, rows, row_bytes, placement="memio://cpu/dram"):
        self._s = session
        self._t = _ai.EngramTable(session, rows, row_bytes, placement)

    def set_work(self, kind, deadline=None, compute=0.0, best_effort=False):
        """What this table's lookups and similarity searches are for: ``decode`` unless set,
        spelled as :func:`work_class` takes it (stores run as ``engram_sync``, prefetches as
        ``prefetch``). Each holds a scheduler lease of its class while it moves data."""
        self._t.set_work(_ai.Work(kind, deadline, compute, best_effort))

    @property
    def rows(self):
        return self._t.rows

    @property
    def row_bytes(self):
        return self._t.row_bytes

    def memory(self):
        """The table's pinned memory (a HostBuffer): load it with ``session.read(path,
        table.memory())``, view it with ``numpy.asarray``."""
        return self._t.memory()

    def lookup(self, ids, dst, dst_offset=0):
        """Reads row ``ids[i]`` into ``dst`` (GPU memory) at ``dst_offset + i * row_bytes``;
        a dict (rows, rows_fetched, path, hot)."""
        if type(dst) is not DeviceBuffer:
            dst = _device(self._s, dst, True, "a lookup's destination")
        if type(ids) is not array.array:
            ids = _ids(ids)
        return self._t.lookup(ids, dst, dst_offset)

    @staticmethod
    def lookup_tables(lookups):
        """Runs every lookup of ``lookups`` together: tuples ``(table, ids, dst)`` or
        ``(table, ids, dst, dst_offset)``, as :meth:`lookup` takes them. Where every table
        keeps hot rows on its destination's GPU they are one gather (one launch and one wait
        for all, where a lookup per table waits once per table). A report per lookup."""
        # Lookups of gpuio buffers and id arrays go as they are; the rest are converted here.
        lookups = lookups if type(lookups) is list else list(lookups)
        got = _lookup_tables(lookups, False)
        if got is None:
            got = _lookup_tables([_table_lookup(lk) for lk in lookups], True)
        return got

    def store(self, ids, src, src_offset=0):
        """Writes source row ``i`` of ``src`` (GPU memory) to table row ``ids[i]``."""
        d = _device(self._s, src, False, "a store's source")
        self._t.store(_ids(ids), d, src_offset)

    def keep_hot(self, ids, gpu=0):
        """Keeps copies of rows ``ids`` in GPU ``gpu``'s memory; what the tier keeps."""
        return self._t.keep_hot(gpu, _ids(ids))

    def drop_hot(self):
        """Lets the kept copies go."""
        self._t.drop_hot()

    def hot_stats(self):
        """What the hot tier keeps (rows, device_bytes, probes), or None."""
        return self._t.hot_stats()

    def prefetch(self, ids, dst, dst_offset=0):
        """:meth:`lookup` on a side thread: a :class:`gpuio.Request` whose ``wait()`` gives
        the lookup's report."""
        from . import Request

        d = _device(self._s, dst, True, "a prefetch's destination")
        return Request(self._t.prefetch(_ids(ids), d, dst_offset))

    def store_async(self, ids, src, src_offset=0):
        """:meth:`store` on a side thread: a :class:`gpuio.Request`."""
        from . import Request

        d = _device(self._s, src, False, "a store's source")
        return Request(self._t.store_async(_ids(ids), d, src_offset))

    def similar(self, query, k, values="f32", gpu=0):
        """The ``k`` rows most similar to ``query`` (largest dot products; rows read as
        ``f32`` or ``fp8`` values), best first: a list of (row, score)."""
        return self._t.similar(_f32(query, "a query"), k, values, gpu)


class CsrGraph:
    """A graph in compressed sparse row form: node ``n``'s neighbours are
    ``neighbors[offsets[n]:offsets[n + 1]]`` (both lists of ints or int64 host arrays)."""

    __slots__ = ("_g",)

    def __init__(self, offsets, neighbors):
        self._g = _ai.CsrGraph(_ids(offsets), _ids(neighbors))

    @property
    def nodes(self):
        return self._g.nodes

    @property
    def edges(self):
        return self._g.edges

    def neighbors(self, n):
        return self._g.neighbors(n)

    def expand(self, seeds, hops=2, fanout=None, seed=0, max_nodes=1 << 20):
        """The subgraph ``hops`` hops from ``seeds`` (``fanout`` neighbours per node per hop,
        all where None): a dict of ``nodes`` (in the order reached), ``hop_starts`` and the
        ``edges`` followed as local (from, to) pairs."""
        return self._g.expand(_ids(seeds), hops, fanout, seed, max_nodes)


def graph_scatter(scores, k):
    """The indices of the ``k`` highest ``scores``, best first (ties to the lower index)."""
    return _ai.graph_scatter(_f32(scores, "scores"), k)


def graph_gather(session, graph, seeds, embeddings, dst, row_bytes, dst_offset=0, hops=2,
                 fanout=None, seed=0, max_nodes=1 << 20):
    """Expands ``seeds`` over ``graph`` and gathers the subgraph's embeddings (node ``n``'s
    row at byte ``n * row_bytes`` of ``embeddings``: a gpuio HostBuffer, or a file path or
    opened Resource) into ``dst`` (GPU memory), local node ``i``'s row at
    ``dst_offset + i * row_bytes``; the subgraph (as :meth:`CsrGraph.expand`)."""
    if not isinstance(embeddings, HostBuffer):
        embeddings = _open(session, embeddings, write=False)
    d = _device(session, dst, True, "a graph gather's destination")
    return _ai.graph_gather(session, graph._g, _ids(seeds), embeddings, row_bytes, d,
                            dst_offset, hops, fanout, seed, max_nodes)


def quantize(values, format, block=32):
    """Quantizes ``values`` (floats, a host float32 array) on the host as ``format``
    (``f16``, ``fp8``, ``int8``, ``int4``) with one scale per ``block`` values."""
    return _ai.quantize(_f32(values, "values"), format, block)


def dequantize(q):
    """The values of a :class:`QuantizedKv`, as float32s (a memoryview NumPy views)."""
    return _floats(q.dequantize())


def quantize_device(src, format, block=32, count=None, src_offset=0, session=None):
    """Quantizes ``count`` float32s of ``src`` (GPU memory; all of it by default) on its GPU;
    the result (a :class:`DeviceQuantizedKv`) matches :func:`quantize` bit for bit. A CUDA
    tensor needs the ``session`` to borrow it through."""
    d = src if isinstance(src, DeviceBuffer) else _device(session, src, False, "values")
    if count is None:
        count = (len(d) - src_offset) // 4
    return _ai.quantize_device(d, count, format, block, src_offset)


def compress(data, codec="lz4", level=3):
    """``data`` (bytes-like) as one checked frame of ``codec`` (``lz4``, or ``zstd`` at
    ``level``)."""
    return _ai.compress(bytes(data), codec, level)


def _end(session, end, write):
    if isinstance(end, str):
        return _open(session, end, write)
    if isinstance(end, (HostBuffer, DeviceBuffer, Resource)):
        return end
    return _device(session, end, write, "a compressed transfer's memory end")


def transfer_compressed(session, src, dst, size=None, codec="lz4", level=3, src_offset=0,
                        dst_offset=0):
    """Compresses ``size`` bytes of ``src`` (host or GPU memory) chunk by chunk and writes
    the frames to ``dst`` (a file path, a ``remoteio://`` export or an opened Resource); a
    dict (raw_bytes, stored_bytes, frames)."""
    s, d = _end(session, src, False), _end(session, dst, True)
    if size is None:
        size = _interop.nbytes(s) - src_offset
    return _ai.transfer_compressed(session, s, d, size, codec, level, src_offset, dst_offset)


def read_compressed(session, src, dst, size, src_offset=0, dst_offset=0):
    """Reads the frames :func:`transfer_compressed` wrote at ``src`` until ``size`` bytes
    have come back into ``dst`` (host or GPU memory); a damaged frame raises."""
    s, d = _end(session, src, False), _end(session, dst, True)
    return _ai.read_compressed(session, s, d, size, src_offset, dst_offset)


class AiContext:
    """The pools of one serving or training process (KV sequences, Engram tables) beside its
    session, and AI work mapped onto the scheduler's classes: inference IO runs in the
    realtime class with a deadline that leaves room for its compute; training, checkpoints,
    Engram write-back and prefetch in theirs, in that order of urgency."""

    __slots__ = ("session", "_sequences", "_engram")

    def __init__(self, session):
        self.session = session
        self._sequences = {}
        self._engram = []

    def open_sequence(self, seq, **shape):
        """Opens sequence ``seq``'s :class:`KvPool` (``shape``: its keyword arguments)."""
        if seq in self._sequences:
            raise _invalid(f"sequence {seq} is open")
        pool = KvPool(self.session, **shape)
        self._sequences[seq] = pool
        return pool

    def sequence(self, seq):
        """Sequence ``seq``'s pool, or None."""
        return self._sequences.get(seq)

    def close_sequence(self, seq):
        """Closes sequence ``seq``, freeing its memory; whether it was open."""
        return self._sequences.pop(seq, None) is not None

    def add_engram_table(self, table):
        """Adds an :class:`EngramTable`; its index."""
        self._engram.append(table)
        return len(self._engram) - 1

    def engram_table(self, i):
        return self._engram[i] if 0 <= i < len(self._engram) else None

    def submit(self, work, src, dst, size=None, src_offset=0, dst_offset=0, deadline=None,
               compute=0.0, best_effort=False):
        """Queues a transfer for ``work`` (``inference``, ``training_forward``,
        ``training_backward``, ``checkpoint``, ``engram_sync``, ``prefetch``) in its
        scheduler class; inference is due ``deadline`` seconds from now, ``compute`` of them
        after its IO. Returns a :class:`gpuio.Request`."""
        priority, due = work_class(work, deadline, compute, best_effort)
        return self.session.copy_async(src, dst, size, src_offset, dst_offset,
                                       priority=priority, deadline=due)


def _invalid(message):
    return _gpuio.Error(message, -3, "GPUIO_ERROR_INVALID_ARG")
