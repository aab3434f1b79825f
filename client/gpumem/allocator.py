"""The native bump allocator (csrc/allocator.c in gpumem_shared), through the native module.

A ``Slot`` owns one of the library's allocator entry-point pairs for its life. torch
loads the pair by name from the module's file (``CUDAPluggableAllocator(path, alloc,
free)``); the Python side sets the slot's extents and reads its counters through the
module's functions. No torch here.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from gpumem_shared import _native  # built with the package; see setup.py

# From csrc/allocator.h, through the module.
MAX_SLOTS: Final[int] = _native.GPUMEM_MAX_SLOTS
MAX_EXTENTS: Final[int] = _native.GPUMEM_MAX_EXTENTS
FAIL_NONE: Final[int] = _native.GPUMEM_FAIL_NONE
FAIL_FULL: Final[int] = _native.GPUMEM_FAIL_FULL
FAIL_UNBACKED: Final[int] = _native.GPUMEM_FAIL_UNBACKED
FAIL_DEVICE: Final[int] = _native.GPUMEM_FAIL_DEVICE
FAIL_STREAM: Final[int] = _native.GPUMEM_FAIL_STREAM


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
    last_fail_reason: int  # FAIL_* above
    n_extents: int
    device: int


def library_path() -> str:
    """The built module's file, which torch loads the entry points from."""
    path = _native.__file__
    assert path is not None
    return path


class SlotsExhausted(RuntimeError):
    pass


class Slot:
    """One independent bump allocator: up to 64 extents, first fit, fixed alignment."""

    def __init__(self, device: int, alignment: int = 512) -> None:
        index = _native.slot_acquire(device, alignment)
        if index == -2:
            raise ValueError(f"alignment {alignment} is not a power of two")
        if index < 0:
            raise SlotsExhausted(f"all {MAX_SLOTS} allocator slots of this process are in use")
        self.index = index
        self.device = device
        self.alignment = alignment

    @property
    def alloc_symbol(self) -> str:
        return f"gpumem_alloc_{self.index:02x}"

    @property
    def free_symbol(self) -> str:
        return f"gpumem_free_{self.index:02x}"

    def set_extents(self, extents: list[tuple[int, int]]) -> None:
        """Replace the extents (address, size) and reset the cursors and byte counters."""
        rc = _native.slot_set_extents(self.index, extents)
        if rc == -3:
            raise ValueError(f"extents must be {self.alignment}-byte aligned, non-empty and disjoint: {extents}")
        if rc != 0:
            raise RuntimeError(f"allocator slot {self.index} refused its extents (code {rc})")

    def set_backing(self, ranges: list[tuple[int, int]] | None) -> None:
        """Serve requests only inside these mapped (address, size) ranges; None turns
        the check off. Threads inside ``virtual_only()`` are exempt."""
        if _native.slot_set_backing(self.index, ranges) != 0:
            raise RuntimeError(f"allocator slot {self.index} refused its backing ranges")

    def bind_stream(self, stream: int | None) -> None:
        """Serve only requests made on ``stream`` (None: any stream)."""
        if _native.slot_bind_stream(self.index, stream) != 0:
            raise RuntimeError(f"allocator slot {self.index} is not in use")

    def alloc(self, nbytes: int, stream: int = 0) -> int:
        """An address for ``nbytes`` (0 when nothing fits: ``stats()`` says why), as torch
        would get it."""
        return _native.slot_alloc(self.index, nbytes, self.device, stream)

    def free(self, address: int, nbytes: int, stream: int = 0) -> None:
        _native.slot_free(self.index, address, nbytes, self.device, stream)

    def stats(self) -> SlotStats:
        counters = _native.slot_stats(self.index)
        if counters is None:
            raise RuntimeError(f"allocator slot {self.index} is not in use")
        return SlotStats(**counters)

    def counters(self) -> tuple[int, int, int]:
        """(failures, cursor_bytes, freed_bytes): the part of ``stats()`` a borrow scope
        reads at every entry, in one call and a tuple."""
        counters = _native.slot_counters(self.index)
        if counters is None:
            raise RuntimeError(f"allocator slot {self.index} is not in use")
        return counters

    def rounded(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` takes from an extent, alignment included."""
        return _native.slot_rounded(self.index, nbytes)

    def release(self) -> None:
        if self.index >= 0:
            _native.slot_release(self.index)
            self.index = -1


class virtual_only:
    """Within this block, the calling thread's requests may land on unbacked space
    (virtual-only tensors that nothing touches until their memory is committed)."""

    def __enter__(self) -> None:
        self._before = _native.thread_virtual(1)

    def __exit__(self, *exc: object) -> None:
        _native.thread_virtual(self._before)
