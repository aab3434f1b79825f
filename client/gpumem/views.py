"""Raw byte views of arena memory for any framework: DLPack and the array interfaces.

``RawView(address, nbytes, device)`` is a 1-D uint8 array of ``nbytes`` at ``address``.
On the CUDA backend it offers ``__cuda_array_interface__`` (CuPy, Numba, torch) and
``__dlpack__`` with a CUDA device; on the host backend ``__array_interface__`` (NumPy)
and ``__dlpack__`` with a CPU device. No framework is imported here; consumers such as
``torch.from_dlpack(view)``, ``cupy.from_dlpack(view)`` or ``jax.dlpack.from_dlpack``
build their own tensor over the same bytes. The view keeps its arena object alive, but
the bytes stay valid only while the arena is mapped (until ``release``).
"""

from __future__ import annotations

import ctypes
from typing import Any

# DLPack ABI (dlpack.h, version 0.8 layout; the unversioned capsule "dltensor" that
# every consumer accepts).
KDL_CPU = 1
KDL_CUDA = 2
KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# Exported tensors not yet released by their consumer, keyed by the managed tensor's
# address: the ctypes objects must outlive the C pointers handed out.
_LIVE: dict[int, tuple[Any, ...]] = {}


def _release(address: int) -> None:
    _LIVE.pop(address, None)


@_Deleter
def _dl_deleter(managed: Any) -> None:
    _release(ctypes.addressof(managed.contents))


@_CapsuleDestructor
def _capsule_destructor(capsule: int) -> None:
    # A capsule still named "dltensor" was never consumed: free it ourselves. A consumer
    # renames it "used_dltensor" and calls the deleter when done. The capsule is being
    # destroyed, so it is only ever touched as a raw pointer here.
    if _PyCapsule_IsValid(capsule, b"dltensor"):
        pointer = _PyCapsule_GetPointer(capsule, b"dltensor")
        if pointer:
            _release(pointer)


class RawView:
    """``nbytes`` bytes at ``address`` on ``device`` ("cuda" with an ordinal, or "cpu")."""

    def __init__(self, address: int, nbytes: int, device_type: str, device_id: int = 0, owner: object = None) -> None:
        if nbytes < 0:
            raise ValueError(f"a view needs a non-negative size, not {nbytes}")
        self.address = address
        self.nbytes = nbytes
        self.device_type = device_type
        self.device_id = device_id
        self._owner = owner  # keeps the arena (and so its mapping's owner) referenced

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.device_type != "cuda":
            raise AttributeError("__cuda_array_interface__ is only offered for CUDA memory")
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "version": 3, "strides": None}

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self.device_type != "cpu":
            raise AttributeError("__array_interface__ is only offered for host memory")
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "version": 3}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device_id) if self.device_type == "cuda" else (KDL_CPU, 0)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None) -> Any:
        # The bytes are already in place and no work is pending on them from our side,
        # so there is no stream to synchronise with: ``stream`` is accepted and ignored.
        if copy:
            raise BufferError("gpumem views export memory in place; copy=True is not supported")
        shape = (ctypes.c_int64 * 1)(self.nbytes)
        managed = _DLManagedTensor()
        managed.dl_tensor.data = self.address
        device_type, device_id = self.__dlpack_device__()
        managed.dl_tensor.device = _DLDevice(device_type, device_id)
        managed.dl_tensor.ndim = 1
        managed.dl_tensor.dtype = _DLDataType(KDL_UINT, 8, 1)
        managed.dl_tensor.shape = shape
        managed.dl_tensor.strides = None
        managed.dl_tensor.byte_offset = 0
        managed.manager_ctx = None
        managed.deleter = _dl_deleter
        pointer = ctypes.addressof(managed)
        _LIVE[pointer] = (managed, shape, self)
        return _PyCapsule_New(pointer, b"dltensor", _capsule_destructor)

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"<gpumem.RawView {self.nbytes} bytes at {self.address:#x} on {self.device_type}:{self.device_id}>"
