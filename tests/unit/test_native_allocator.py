"""The native bump allocator through ctypes, calling the same entry points torch calls.

Addresses are plain numbers here: the allocator never touches memory, so extents need
not be mapped for these tests.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator

import pytest

from gpumem.allocator import MAX_EXTENTS, MAX_SLOTS, Slot, SlotsExhausted, library

MiB = 1 << 20
AllocFn = Callable[[int, int], int | None]


@pytest.fixture
def slot() -> Iterator[Slot]:
    s = Slot(device=0, alignment=512)
    yield s
    s.release()


def entry_points(slot: Slot) -> tuple[AllocFn, Callable[[int, int], None]]:
    lib = library()
    alloc = getattr(lib, slot.alloc_symbol)
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, slot.free_symbol)
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return (lambda size, device=0: alloc(size, device, None)), (lambda ptr, size: free(ptr, size, 0, None))


def test_first_fit_across_extents_and_alignment(slot: Slot) -> None:
    slot.set_extents([(0x10000, 1024), (0x20000, 4096)])
    alloc, _ = entry_points(slot)
    assert alloc(100) == 0x10000  # rounded up to 512
    assert alloc(512) == 0x10200
    assert alloc(1) == 0x20000  # first extent is full: next one
    assert alloc(1000) == 0x20200
    assert alloc(4096) is None  # fits nowhere
    s = slot.stats()
    assert s.cursor_bytes == 512 + 512 + 512 + 1024
    assert s.calls == 5 and s.failures == 1 and s.last_failed == 4096
    assert s.largest_free == 4096 - 1536
    assert slot.rounded(1) == 512 and slot.rounded(513) == 1024


def test_earlier_extent_is_reused_when_a_small_request_fits(slot: Slot) -> None:
    slot.set_extents([(0x10000, 1024), (0x20000, 8192)])
    alloc, _ = entry_points(slot)
    assert alloc(2048) == 0x20000  # does not fit the first extent
    assert alloc(512) == 0x10000  # first fit goes back to the first one


def test_exhaustion_returns_null_and_counts(slot: Slot) -> None:
    slot.set_extents([(1 << 30, 2 * MiB)])
    alloc, _ = entry_points(slot)
    assert alloc(2 * MiB) == 1 << 30
    assert alloc(1) is None
    assert slot.stats().failures == 1 and slot.stats().largest_free == 0


def test_wrong_device_is_refused(slot: Slot) -> None:
    slot.set_extents([(1 << 30, 2 * MiB)])
    alloc, _ = entry_points(slot)
    assert alloc(512, 1) is None
    assert alloc(512, 0) == 1 << 30


def test_frees_are_counted_not_reused(slot: Slot) -> None:
    slot.set_extents([(1 << 30, 4096)])
    alloc, free = entry_points(slot)
    p = alloc(1024)
    assert p is not None
    free(p, 1024)
    assert alloc(1024) == (1 << 30) + 1024  # a bump allocator never hands p out again
    s = slot.stats()
    assert s.frees == 1 and s.freed_bytes == 1024


def test_set_extents_resets_cursors_and_byte_counters(slot: Slot) -> None:
    slot.set_extents([(1 << 30, 4096)])
    alloc, free = entry_points(slot)
    p = alloc(4096)
    free(p, 4096)
    slot.set_extents([(1 << 31, 8192), (1 << 32, 512)])
    s = slot.stats()
    assert (s.cursor_bytes, s.freed_bytes, s.capacity_bytes, s.n_extents) == (0, 0, 8192 + 512, 2)
    assert s.calls == 1  # calls survive a reset
    assert alloc(4096) == 1 << 31


def test_extent_validation(slot: Slot) -> None:
    with pytest.raises(ValueError, match="aligned"):
        slot.set_extents([(0x10001, 4096)])
    with pytest.raises(ValueError, match="disjoint"):
        slot.set_extents([(0x10000, 4096), (0x10200, 4096)])
    with pytest.raises(ValueError, match="at most 64"):
        slot.set_extents([(i << 20, 512) for i in range(MAX_EXTENTS + 1)])
    slot.set_extents([(i << 20, 512) for i in range(MAX_EXTENTS)])
    assert slot.stats().n_extents == MAX_EXTENTS


def test_slots_are_independent_and_limited() -> None:
    slots = []
    try:
        with pytest.raises(SlotsExhausted):
            for _ in range(MAX_SLOTS + 1):
                slots.append(Slot(device=0))
        assert len({s.alloc_symbol for s in slots}) == len(slots)
        a, b = slots[0], slots[1]
        a.set_extents([(1 << 30, 4096)])
        b.set_extents([(1 << 31, 4096)])
        alloc_a, _ = entry_points(a)
        alloc_b, _ = entry_points(b)
        assert alloc_a(512) == 1 << 30
        assert alloc_b(512) == 1 << 31
        assert a.stats().cursor_bytes == 512 and b.stats().cursor_bytes == 512
    finally:
        for s in slots:
            s.release()
    again = Slot(device=0)  # released slots are handed out again
    again.release()


def test_concurrent_threads_never_share_an_address(slot: Slot) -> None:
    per_thread, threads = 2000, 8
    slot.set_extents([(1 << 30, per_thread * threads * 512 // 2), (1 << 32, per_thread * threads * 512 // 2)])
    alloc, _ = entry_points(slot)
    results: list[list[int | None]] = [[] for _ in range(threads)]

    def worker(out: list[int | None]) -> None:
        for _ in range(per_thread):
            out.append(alloc(300))

    pool = [threading.Thread(target=worker, args=(results[i],)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    got = [p for r in results for p in r]
    assert None not in got
    assert len(set(got)) == per_thread * threads  # every address handed out exactly once
    assert slot.stats().cursor_bytes == per_thread * threads * 512
    assert alloc(1) is None  # and the extents are exactly full


def test_backing_check_refuses_unmapped_space_unless_virtual(slot: Slot) -> None:
    from gpumem.allocator import FAIL_UNBACKED, virtual_only

    base = 1 << 30
    slot.set_extents([(base, 16 * MiB)])
    slot.set_backing([(base, 4 * MiB)])
    alloc, _ = entry_points(slot)
    assert alloc(4 * MiB) == base
    assert alloc(512) is None  # the next bytes are not backed
    assert slot.stats().last_fail_reason == FAIL_UNBACKED
    with virtual_only():
        with virtual_only():
            pass
        assert alloc(8 * MiB) == base + 4 * MiB  # still virtual after a nested scope
    assert alloc(512) is None
    results: list[int | None] = []
    with virtual_only():  # per thread: another thread stays checked
        t = threading.Thread(target=lambda: results.append(alloc(512)))
        t.start()
        t.join()
    assert results == [None]
    slot.set_backing([(base, 16 * MiB)])
    assert alloc(512) == base + 12 * MiB
    slot.set_backing(None)
    assert alloc(4 * MiB - 512) == base + 12 * MiB + 512
