"""The native bump allocator: the slot calls through the native module, and the entry
points torch calls, loaded by name from the module's file as torch loads them (ctypes
stands in for torch here; gpumem itself never binds the file with ctypes).

Addresses are plain numbers here: the allocator never touches memory, so extents need
not be mapped for these tests.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator

import pytest

from gpumem.allocator import MAX_EXTENTS, MAX_SLOTS, Slot, SlotsExhausted, library_path

MiB = 1 << 20
AllocFn = Callable[[int, int], int | None]


@pytest.fixture
def slot() -> Iterator[Slot]:
    s = Slot(device=0, alignment=512)
    yield s
    s.release()


def entry_points(slot: Slot) -> tuple[AllocFn, Callable[[int, int], None]]:
    lib = ctypes.CDLL(library_path())
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


# =========================================================================== Slot.alloc / free, stream binding

STREAM, OTHER_STREAM = 0x7F00_0000_1000, 0x7F00_0000_2000  # cudaStream_t values are opaque pointers


def test_a_bound_slot_serves_only_its_stream(slot: Slot) -> None:
    from gpumem.allocator import FAIL_STREAM

    base = 1 << 30
    slot.set_extents([(base, 4096)])
    slot.bind_stream(STREAM)
    assert slot.alloc(512, stream=OTHER_STREAM) == 0
    s = slot.stats()
    assert (s.calls, s.failures, s.last_failed, s.last_fail_reason) == (1, 1, 512, FAIL_STREAM)
    assert s.cursor_bytes == 0 and s.largest_free == 4096, "a refused request took no space"
    assert slot.alloc(512) == 0, "the default stream is another stream"
    alloc, _ = entry_points(slot)
    assert alloc(512) is None  # what torch gets asking on its current (default) stream
    assert slot.stats().failures == 3 and slot.stats().last_fail_reason == FAIL_STREAM
    assert slot.alloc(512, stream=STREAM) == base
    slot.bind_stream(None)
    assert slot.alloc(512, stream=OTHER_STREAM) == base + 512
    assert slot.alloc(512) == base + 1024
    assert alloc(512) == base + 1536
    assert slot.stats().failures == 3 and slot.stats().cursor_bytes == 2048


def test_binding_the_default_stream_is_not_unbinding(slot: Slot) -> None:
    from gpumem.allocator import FAIL_STREAM

    slot.set_extents([(1 << 30, 4096)])
    slot.bind_stream(0)  # torch's legacy default stream is a null cudaStream_t
    assert slot.alloc(512, stream=STREAM) == 0
    assert slot.stats().last_fail_reason == FAIL_STREAM
    assert slot.alloc(512, stream=0) == 1 << 30


def test_a_slot_handed_out_again_serves_any_stream() -> None:
    bound = Slot(device=0)
    index = bound.index
    bound.bind_stream(STREAM)
    bound.release()
    again = Slot(device=0)  # the lowest free index: the one just released
    try:
        assert again.index == index
        again.set_extents([(1 << 30, 4096)])
        assert again.alloc(512, stream=OTHER_STREAM) == 1 << 30, "the previous owner's binding leaked into a new slot"
    finally:
        again.release()


def test_alloc_is_first_fit_aligned_inside_the_extents_and_free_only_counts() -> None:
    from gpumem.allocator import FAIL_FULL

    a, b = 1 << 32, (1 << 32) + (1 << 20)
    slot = Slot(device=0, alignment=4096)
    try:
        slot.set_extents([(a, 8192), (b, 3 * 4096)])
        # (request, address, largest_free after it)
        steps = [(1, a, 3 * 4096), (4097, b, 4096), (0, a + 4096, 4096), (4096, b + 8192, 0)]
        for nbytes, address, largest in steps:
            got = slot.alloc(nbytes)
            assert got == address, f"alloc({nbytes}) = {got:#x}, first fit gives {address:#x}"
            assert got % 4096 == 0
            assert slot.stats().largest_free == largest
        s = slot.stats()
        assert s.cursor_bytes == s.capacity_bytes == 5 * 4096 and s.failures == 0
        assert slot.alloc(1) == 0 and slot.stats().last_fail_reason == FAIL_FULL
        slot.free(b, 4097)
        slot.free(a, 1)
        s = slot.stats()
        assert (s.frees, s.freed_bytes) == (2, 4098), "frees count what torch reports, not the rounded size"
        assert s.cursor_bytes == 5 * 4096 and slot.alloc(1) == 0, "a bump allocator never hands freed space out again"
    finally:
        slot.release()


def test_cursors_and_largest_free_follow_a_first_fit_model(slot: Slot) -> None:
    import random

    from gpumem.allocator import FAIL_FULL

    rng = random.Random(1234)
    for _ in range(20):
        order = rng.sample(range(1, 9), rng.randrange(1, 7))  # extent order is not address order
        extents = [(i << 24, 512 * rng.randrange(1, 64)) for i in order]
        slot.set_extents(extents)
        cursors = [0] * len(extents)
        failures = slot.stats().failures
        for _ in range(30):
            nbytes = rng.choice([0, 1, 511, 512, 513, 4096, rng.randrange(1, 16384)])
            need = -(-max(nbytes, 1) // 512) * 512
            assert slot.rounded(nbytes) == need
            fit = next((i for i, (_, size) in enumerate(extents) if size - cursors[i] >= need), None)
            got = slot.alloc(nbytes)
            if fit is None:
                failures += 1
                assert got == 0
                assert slot.stats().last_fail_reason == FAIL_FULL and slot.stats().last_failed == nbytes
            else:
                assert got == extents[fit][0] + cursors[fit]
                cursors[fit] += need
            s = slot.stats()
            assert s.cursor_bytes == sum(cursors) and s.failures == failures
            assert s.largest_free == max(size - c for (_, size), c in zip(extents, cursors))
