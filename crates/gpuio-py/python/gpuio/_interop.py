"""How Python objects become the ends of a gpuio transfer.

gpuio's own buffers and opened resources pass through. CUDA memory (anything with
``__cuda_array_interface__``, or ``__dlpack__`` on a CUDA device: PyTorch, CuPy, JAX, Numba) is
borrowed in place, checked with the driver. Other host memory (NumPy arrays, ``bytearray``,
``memoryview``, CPU tensors through DLPack) becomes a C-contiguous byte ``memoryview``, which
the session reads or writes in place for one blocking call (or copies through, to and from
other host memory). NumPy is imported only when a CPU DLPack producer needs it.
"""

import ctypes

from . import _gpuio

NATIVE = (_gpuio.HostBuffer, _gpuio.DeviceBuffer, _gpuio.Resource)

# DLPack device types (dlpack.h).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    # The first member of the DLManagedTensor a "dltensor" capsule points to.
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensorVersioned(ctypes.Structure):
    # What a "dltensor_versioned" capsule points to (DLPack 1.0): flags say read-only.
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_DL_FLAG_READ_ONLY = 1

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _contiguous(shape, strides, itemsize):
    """Whether element strides (in bytes) describe a C-contiguous array."""
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim > 1 and stride != expect:
            return False
        expect *= dim
    return True


def _product(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _borrow(session, owner, address, nbytes, gpu):
    if nbytes == 0:
        raise ValueError("an empty CUDA array has no bytes to move")
    return session._borrow_device(gpu, address, nbytes, owner)


def _from_cuda_array_interface(session, obj, cai, writable):
    address, read_only = cai["data"]
    if writable and read_only:
        raise ValueError("this CUDA array is read-only")
    itemsize = int(cai["typestr"][2:])
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is not None and not _contiguous(shape, strides, itemsize):
        raise ValueError("gpuio moves contiguous memory: call .contiguous() first")
    # The owner's GPU where the object says (torch's device.index, CuPy's device.id): else
    # the session asks each GPU in turn, which makes a context on each one it asks.
    device = getattr(obj, "device", None)
    gpu = getattr(device, "index", None)
    if gpu is None:
        gpu = getattr(device, "id", None)
    return _borrow(session, obj, address, _product(shape) * itemsize,
                   gpu if isinstance(gpu, int) else None)


def _from_dlpack(session, obj, writable):
    # Stream 1 (the legacy default stream): the producer orders its pending work before it;
    # borrowing then waits for the whole device, so that work is done. DLPack 1.0 capsules
    # say whether the memory is read-only; a producer that predates them is taken as writable.
    try:
        capsule = obj.__dlpack__(stream=1, max_version=(1, 0))
    except TypeError:
        capsule = obj.__dlpack__(stream=1)
    name = _capsule_name(capsule)
    if name == b"dltensor_versioned":
        m = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, name))
        if m.major != 1:
            raise BufferError(f"DLPack {m.major}.{m.minor} is newer than gpuio reads (1.x)")
        if writable and m.flags & _DL_FLAG_READ_ONLY:
            raise ValueError("this CUDA array is read-only")
        t = m.dl_tensor
    else:
        t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    shape = [t.shape[i] for i in range(t.ndim)]
    itemsize = t.dtype.bits * t.dtype.lanes // 8
    if t.strides and not _contiguous(shape, [t.strides[i] * itemsize for i in range(t.ndim)], itemsize):
        raise ValueError("gpuio moves contiguous memory: call .contiguous() first")
    address = (t.data or 0) + t.byte_offset
    # The capsule keeps the producer's memory alive; it is never consumed, so its own
    # destructor gives the memory back when the borrowed buffer lets go of it.
    return _borrow(session, (obj, capsule), address, _product(shape) * itemsize, t.device.device_id)


def _host_view(view, writable):
    if not view.c_contiguous:
        raise ValueError("gpuio moves contiguous memory: pass a C-contiguous array")
    if writable and view.readonly:
        raise ValueError("this buffer is read-only")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def resolve(session, obj, writable):
    """The transfer end for ``obj``: gpuio memory or a resource, ``bytes`` (read-only), or a
    byte ``memoryview`` of other host memory. Raises TypeError for objects that hold no
    memory, ValueError for memory gpuio cannot use (read-only where written, strided)."""
    if isinstance(obj, NATIVE):
        return obj
    if isinstance(obj, bytes):
        if writable:
            raise ValueError("bytes are read-only: pass a bytearray, an array or a tensor")
        return obj
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cuda_array_interface(session, obj, cai, writable)
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        device_type, _ = obj.__dlpack_device__()
        if device_type == _DL_CUDA:
            return _from_dlpack(session, obj, writable)
        if device_type in (_DL_CPU, _DL_CUDA_HOST) and not _has_buffer(obj):
            import numpy  # only for CPU DLPack producers without the buffer protocol

            return _host_view(memoryview(numpy.from_dlpack(obj)), writable)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"gpuio cannot move data of a {type(obj).__name__}: pass a tensor, an array, "
            "bytes, a bytearray, a memoryview, or gpuio memory"
        ) from None
    return _host_view(view, writable)


def _has_buffer(obj):
    try:
        memoryview(obj)
        return True
    except TypeError:
        return False


def nbytes(end):
    """The size in bytes of a resolved transfer end."""
    if isinstance(end, _gpuio.Resource):
        return end.size()
    if isinstance(end, memoryview):
        return end.nbytes
    return len(end)


def indices_bytes(indices):
    """A gather's row indices as little-endian u64 bytes (a list of ints, or a host array or
    tensor of 64-bit integers). Arrays with the buffer protocol take the fast path: one view,
    checked, copied out (the AI tier's per-call cost rests on it)."""
    if isinstance(indices, (list, tuple, range)):
        import struct

        try:
            return struct.pack(f"<{len(indices)}Q", *indices)
        except struct.error as e:
            raise ValueError(f"indices must be integers from 0 to 2**64-1: {e}") from None
    try:
        view = memoryview(indices)
    except TypeError:
        if getattr(indices, "__cuda_array_interface__", None) is not None:
            raise TypeError("indices must be in host memory") from None
        if not hasattr(indices, "__dlpack__"):
            raise TypeError(
                "indices must be a list of ints or a host array of 64-bit integers"
            ) from None
        import numpy  # only for CPU DLPack producers without the buffer protocol

        view = memoryview(numpy.from_dlpack(indices))
    if view.itemsize != 8 or view.format[-1:] not in ("q", "Q", "l", "L"):
        raise TypeError(f"indices must be 64-bit integers, not format {view.format!r}")
    if not view.c_contiguous:
        raise ValueError("indices must be contiguous")
    return view.tobytes()


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]
# A capsule's destructor gets the dying capsule as a raw pointer: taking it as a Python object
# would touch its reference count while it is being freed.
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_raw_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

# Exported tensors, alive until their consumer (or the unconsumed capsule) lets go: each
# keeps its gpuio buffer, so the memory outlives every view of it.
_exported = {}


@_DELETER
def _release(managed):
    _exported.pop(ctypes.addressof(managed.contents), None)


@_CAPSULE_DESTRUCTOR
def _capsule_gone(capsule):
    # Renamed "used_dltensor" by a consumer, which calls the deleter itself.
    if _raw_is_valid(capsule, b"dltensor"):
        managed = _raw_pointer(capsule, b"dltensor")
        _release(ctypes.cast(managed, ctypes.POINTER(_DLManagedTensor)))


def export_device(buf):
    """A DLPack capsule ("dltensor", one dimension of bytes on the buffer's CUDA device) for
    a gpuio DeviceBuffer. gpuio's calls return with their work done, so there is nothing for
    the consumer's stream to wait for."""
    shape = (ctypes.c_int64 * 1)(buf.nbytes)
    managed = _DLManagedTensor()
    t = managed.dl_tensor
    t.data = buf.address
    t.device = _DLDevice(_DL_CUDA, buf.gpu)
    t.ndim = 1
    t.dtype = _DLDataType(1, 8, 1)  # kDLUInt, 8 bits, 1 lane
    t.shape = shape
    t.strides = None
    t.byte_offset = 0
    managed.deleter = _release
    _exported[ctypes.addressof(managed)] = (managed, shape, buf)
    return _capsule_new(ctypes.addressof(managed), b"dltensor", _capsule_gone)
