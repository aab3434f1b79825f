"""ctypes bindings of the native bump allocator (csrc/allocator.c in gpumem_shared), in one place.

A ``Slot`` owns one of the library's 256 allocator entry-point pairs for its life.
torch loads the pair by name (``CUDAPluggableAllocator(path, alloc, free)``); the
Python side sets the slot's extents and reads its counters. No torch here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading

MAX_SLOTS = 256
MAX_EXTENTS = 64
MAX_BACKING = 512

FAIL_NONE, FAIL_FULL, FAIL_UNBACKED, FAIL_DEVICE, FAIL_STREAM = 0, 1, 2, 3, 4

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


class _Stats(ctypes.Structure):
    _fields_ = [
        ("calls", ctypes.c_uint64),
        ("failures", ctypes.c_uint64),
        ("frees", ctypes.c_uint64),
        ("cursor_bytes", ctypes.c_uint64),
        ("freed_bytes", ctypes.c_uint64),
        ("capacity_bytes", ctypes.c_uint64),
        ("largest_free", ctypes.c_uint64),
        ("last_failed", ctypes.c_uint64),
        ("last_fail_reason", ctypes.c_int64),
        ("n_extents", ctypes.c_int64),
        ("device", ctypes.c_int64),
    ]


@dataclasses.dataclass(frozen=True)
class SlotStats:
    calls: int
    failures: int
    frees: int
    cursor_bytes: int  # handed out since the extents were set
    freed_bytes: int  # given back by torch since the extents were set
    capacity_bytes: int
    largest_free: int  # the largest request that still fits (after rounding)
    last_failed: int  # size of the last request that failed
    last_fail_reason: int  # FAIL_* below
    n_extents: int
    device: int


def library_path() -> str:
    from gpumem_shared import _native  # built with the package; see setup.py

    path = _native.__file__
    assert path is not None
    return path


def library() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL(library_path())
            lib.gpumem_slot_acquire.argtypes = [ctypes.c_int, ctypes.c_size_t]
            lib.gpumem_slot_acquire.restype = ctypes.c_int
            lib.gpumem_slot_release.argtypes = [ctypes.c_int]
            lib.gpumem_slot_release.restype = None
            lib.gpumem_slot_set_extents.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.c_size_t,
            ]
            lib.gpumem_slot_set_extents.restype = ctypes.c_int
            lib.gpumem_slot_stats.argtypes = [ctypes.c_int, ctypes.POINTER(_Stats)]
            lib.gpumem_slot_stats.restype = ctypes.c_int
            lib.gpumem_slot_rounded.argtypes = [ctypes.c_int, ctypes.c_size_t]
            lib.gpumem_slot_rounded.restype = ctypes.c_size_t
            lib.gpumem_slot_set_backing.argtypes = [
                ctypes.c_int,
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.c_size_t,
            ]
            lib.gpumem_slot_set_backing.restype = ctypes.c_int
            lib.gpumem_slot_bind_stream.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
            lib.gpumem_slot_bind_stream.restype = ctypes.c_int
            lib.gpumem_slot_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64]
            lib.gpumem_slot_alloc.restype = ctypes.c_uint64
            lib.gpumem_slot_free.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64]
            lib.gpumem_slot_free.restype = None
            lib.gpumem_thread_virtual.argtypes = [ctypes.c_int]
            lib.gpumem_thread_virtual.restype = ctypes.c_int
            _lib = lib
        return _lib


class SlotsExhausted(RuntimeError):
    pass


class Slot:
    """One independent bump allocator: up to 64 extents, first fit, fixed alignment."""

    def __init__(self, device: int, alignment: int = 512) -> None:
        lib = library()
        index = lib.gpumem_slot_acquire(device, alignment)
        if index == -2:
            raise ValueError(f"alignment {alignment} is not a power of two")
        if index < 0:
            raise SlotsExhausted(f"all {MAX_SLOTS} allocator slots of this process are in use")
        self.index = index
        self.device = device
        self.alignment = alignment
        self._lib = lib

    @property
    def alloc_symbol(self) -> str:
        return f"gpumem_alloc_{self.index:02x}"

    @property
    def free_symbol(self) -> str:
        return f"gpumem_free_{self.index:02x}"

    def set_extents(self, extents: list[tuple[int, int]]) -> None:
        """Replace the extents (address, size) and reset the cursors and byte counters."""
        n = len(extents)
        if n > MAX_EXTENTS:
            raise ValueError(f"{n} extents; a slot holds at most {MAX_EXTENTS}")
        bases = (ctypes.c_uint64 * max(n, 1))(*[a for a, _ in extents])
        sizes = (ctypes.c_uint64 * max(n, 1))(*[s for _, s in extents])
        rc = self._lib.gpumem_slot_set_extents(self.index, bases, sizes, n)
        if rc == -3:
            raise ValueError(f"extents must be {self.alignment}-byte aligned, non-empty and disjoint: {extents}")
        if rc != 0:
            raise RuntimeError(f"allocator slot {self.index} refused its extents (code {rc})")

    def set_backing(self, ranges: list[tuple[int, int]] | None) -> None:
        """Serve requests only inside these mapped (address, size) ranges; None turns
        the check off. Threads inside ``virtual_only()`` are exempt."""
        n = len(ranges or [])
        if n > MAX_BACKING:
            raise ValueError(f"{n} backing ranges; a slot tracks at most {MAX_BACKING}")
        bases = (ctypes.c_uint64 * max(n, 1))(*[a for a, _ in ranges or []])
        sizes = (ctypes.c_uint64 * max(n, 1))(*[s for _, s in ranges or []])
        if self._lib.gpumem_slot_set_backing(self.index, int(ranges is not None), bases, sizes, n) != 0:
            raise RuntimeError(f"allocator slot {self.index} refused its backing ranges")

    def bind_stream(self, stream: int | None) -> None:
        """Serve only requests made on ``stream`` (None: any stream)."""
        if self._lib.gpumem_slot_bind_stream(self.index, int(stream is not None), stream or 0) != 0:
            raise RuntimeError(f"allocator slot {self.index} is not in use")

    def alloc(self, nbytes: int, stream: int = 0) -> int:
        """An address for ``nbytes`` (0 when nothing fits: ``stats()`` says why), as torch
        would get it."""
        return int(self._lib.gpumem_slot_alloc(self.index, nbytes, self.device, stream) or 0)

    def free(self, address: int, nbytes: int, stream: int = 0) -> None:
        self._lib.gpumem_slot_free(self.index, address, nbytes, self.device, stream)

    def stats(self) -> SlotStats:
        raw = _Stats()
        if self._lib.gpumem_slot_stats(self.index, ctypes.byref(raw)) != 0:
            raise RuntimeError(f"allocator slot {self.index} is not in use")
        return SlotStats(**{name: int(getattr(raw, name)) for name, _ in _Stats._fields_})

    def rounded(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` takes from an extent, alignment included."""
        return int(self._lib.gpumem_slot_rounded(self.index, nbytes))

    def release(self) -> None:
        if self.index >= 0:
            self._lib.gpumem_slot_release(self.index)
            self.index = -1


class virtual_only:
    """Within this block, the calling thread's requests may land on unbacked space
    (virtual-only tensors that nothing touches until their memory is committed)."""

    def __enter__(self) -> None:
        self._before = library().gpumem_thread_virtual(1)

    def __exit__(self, *exc: object) -> None:
        library().gpumem_thread_virtual(self._before)
