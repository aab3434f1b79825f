"""The lease table: the native compare-and-swap / futex calls through ``LeaseTable`` in
this process (threads stand in for other processes: the native calls drop the GIL), and
the daemon's side in ``DaemonState``: slot and epoch assignment, the sweeps (a session
that ended, impossible words on a tick), retire freeing the slot, ``status().leases``.

Every wait is bounded; a thread that must not outlive its test is joined with a timeout."""

from __future__ import annotations

import os
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

import gpumem
from gpumem.leases import Lease
from gpumem_shared import lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import KIND_NAMES, LeaseKind, LeaseStatus, LeaseTable
from gpumemd.records import SessionRecord as Session

from .harness import BULK, GiB, Harness, MiB

KINDS = list(LeaseKind)
SLOT = 7
EPOCH = lease_table.lease_epoch(1, 1)


@pytest.fixture
def table() -> Iterator[LeaseTable]:
    t, fd = LeaseTable.create()
    t.set_epoch(SLOT, EPOCH)
    yield t
    t.close()
    os.close(fd)


def word(kind: int = LeaseKind.REPLAY, session: int = 1, pid: int = 1001) -> int:
    return lease_table.encode(kind, session, pid)


class Waiter(threading.Thread):
    """``table.acquire`` in a thread; ``result`` and ``elapsed`` once it returns."""

    def __init__(self, table: LeaseTable, slot: int, mine: int, epoch: int, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.args = (table, slot, mine, epoch, timeout_s)
        self.result: tuple[int, int] | None = None
        self.elapsed = -1.0
        self.started_at = 0.0

    def run(self) -> None:
        table, slot, mine, epoch, timeout_s = self.args
        self.started_at = time.monotonic()
        self.result = table.acquire(slot, mine, epoch, timeout_s)
        self.elapsed = time.monotonic() - self.started_at

    def finish(self, timeout: float = 10.0) -> tuple[int, int]:
        self.join(timeout)
        assert not self.is_alive(), f"the waiter did not return within {timeout}s"
        assert self.result is not None
        return self.result


def wait_until_sleeping(table: LeaseTable, slot: int, waiters: int = 1, timeout: float = 5.0) -> None:
    """Until ``waiters`` threads are counted on the slot's futex (they are about to sleep)."""
    deadline = time.monotonic() + timeout
    while table._slots[slot].waiters < waiters:
        assert time.monotonic() < deadline, f"no {waiters} waiter(s) on slot {slot} within {timeout}s"
        time.sleep(0.001)
    time.sleep(0.02)  # from counted to asleep in the kernel: a few instructions


# =========================================================================== encoding


def test_encode_decode_round_trip_and_field_widths() -> None:
    w = lease_table.encode(LeaseKind.BORROW, 0x123456, 0xFEDCBA98)
    assert lease_table.decode(w) == (LeaseKind.BORROW, 0x123456, 0xFEDCBA98)
    assert w >> 56 == LeaseKind.BORROW
    assert lease_table.decode(lease_table.encode(LeaseKind.CAPTURE, 1 << 24 | 5, 7)) == (LeaseKind.CAPTURE, 5, 7), "the session field is 24 bits"
    assert all(lease_table.encode(k, 0, 0) != 0 for k in KINDS), "a held word is never the free value"


def test_lease_epoch_is_never_zero_and_names_the_pool() -> None:
    assert lease_table.lease_epoch(1, 1) != lease_table.lease_epoch(2, 1)
    assert lease_table.lease_epoch(1, 1) != lease_table.lease_epoch(1, 2)
    assert lease_table.lease_epoch(0x10000, 0x10000) == 1  # both fields wrap to 0: still not "no check"
    assert all(lease_table.lease_epoch(i, e) != 0 for i in range(0, 70000, 997) for e in range(0, 70000, 1009))


def test_the_table_is_a_sealed_memfd_of_fixed_size() -> None:
    t, fd = LeaseTable.create()
    try:
        assert os.fstat(fd).st_size == lease_table.TABLE_BYTES == lease_table.SLOTS * 64
        with pytest.raises(PermissionError):
            os.ftruncate(fd, lease_table.TABLE_BYTES * 2)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 64)
        assert t.words() == [0] * lease_table.SLOTS
        other = LeaseTable(fd)  # a second mapping (a client) sees the same memory
        try:
            assert t.acquire(3, word(), 0, 0) == (LeaseStatus.OK, 0)
            assert other.peek(3) == word() and other.holder(3) is not None
        finally:
            other.close()
    finally:
        t.close()
        os.close(fd)
    wrong = os.memfd_create("not-a-table")
    try:
        os.ftruncate(wrong, 4096)
        with pytest.raises(ValueError, match="lease table"):
            LeaseTable(wrong)
    finally:
        os.close(wrong)


# =========================================================================== exclusion


@pytest.mark.parametrize("first", KINDS, ids=KIND_NAMES.get)
@pytest.mark.parametrize("second", KINDS, ids=KIND_NAMES.get)
def test_every_kind_excludes_every_kind(table: LeaseTable, first: int, second: int) -> None:
    """All 9 pairs conflict: leases are exclusive, whoever asks, through both entry points."""
    held = word(first, session=1, pid=1001)
    assert table.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    for other in (word(second, session=2, pid=1002), word(second, session=1, pid=1001)):  # another session; the same one
        assert table.acquire(SLOT, other, EPOCH, 0) == (LeaseStatus.HELD, held)
        assert table.acquire(SLOT, other, 0, 0) == (LeaseStatus.HELD, held)  # no epoch check: still held
        assert table.try_acquire(SLOT, other, EPOCH, b"x") == LeaseStatus.HELD
        assert table.peek(SLOT) == held
    assert table.release(SLOT, held) == LeaseStatus.OK
    assert table.acquire(SLOT, word(second, session=2, pid=1002), EPOCH, 0) == (LeaseStatus.OK, 0)


def test_acquire_release_and_slots_are_independent(table: LeaseTable) -> None:
    a, b = word(LeaseKind.CAPTURE, 1, 11), word(LeaseKind.BORROW, 2, 22)
    table.set_epoch(SLOT + 1, EPOCH)
    assert table.acquire(SLOT, a, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert table.acquire(SLOT + 1, b, EPOCH, 0) == (LeaseStatus.OK, 0)  # a neighbouring slot is another lease
    assert (table.peek(SLOT), table.peek(SLOT + 1)) == (a, b)
    assert table.release(SLOT, a) == LeaseStatus.OK
    assert table.peek(SLOT) == 0 and table.holder(SLOT) is None
    assert table.peek(SLOT + 1) == b
    futex = table._slots[SLOT].futex
    assert table.acquire(SLOT, b, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert table.release(SLOT, b) == LeaseStatus.OK
    assert table._slots[SLOT].futex == futex + 1, "every release bumps the futex word"


def test_double_release_and_releasing_another_holders_word_are_not_holder(table: LeaseTable) -> None:
    mine, theirs = word(LeaseKind.REPLAY, 1, 11), word(LeaseKind.REPLAY, 2, 22)
    assert table.acquire(SLOT, theirs, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert table.release(SLOT, mine) == LeaseStatus.NOT_HOLDER
    assert table.release(SLOT, word(LeaseKind.CAPTURE, 2, 22)) == LeaseStatus.NOT_HOLDER  # their session and pid, another kind
    assert table.peek(SLOT) == theirs, "a refused release leaves the holder alone"
    assert table.release(SLOT, theirs) == LeaseStatus.OK
    assert table.release(SLOT, theirs) == LeaseStatus.NOT_HOLDER
    assert table.release(SLOT, mine) == LeaseStatus.NOT_HOLDER  # of a free slot
    assert table.peek(SLOT) == 0


def test_try_acquire_takes_a_free_slot_and_records_the_label(table: LeaseTable) -> None:
    assert table.try_acquire(SLOT, word(), EPOCH, b"decode step") == LeaseStatus.OK
    h = table.holder(SLOT)
    assert h is not None and h.label == "decode step"
    assert table.try_acquire(SLOT + 1, word(), EPOCH, b"x") == LeaseStatus.STALE  # slot epoch 0
    assert table.release(SLOT, word()) == LeaseStatus.OK


# =========================================================================== epochs and corrupt words


def test_stale_epoch(table: LeaseTable) -> None:
    table.set_epoch(SLOT, lease_table.lease_epoch(1, 2))  # recaptured
    assert table.epoch(SLOT) == lease_table.lease_epoch(1, 2)
    assert table.acquire(SLOT, word(), EPOCH, 0) == (LeaseStatus.STALE, 0)
    assert table.acquire(SLOT, word(), EPOCH, 0.05)[0] == LeaseStatus.STALE  # a wait does not help
    assert table.acquire(SLOT, word(), lease_table.lease_epoch(2, 1), 0)[0] == LeaseStatus.STALE  # another pool in this slot
    assert table.peek(SLOT) == 0
    assert table.acquire(SLOT, word(), lease_table.lease_epoch(1, 2), 0) == (LeaseStatus.OK, 0)
    assert table.release(SLOT, word()) == LeaseStatus.OK


def test_epoch_zero_is_a_retired_slot(table: LeaseTable) -> None:
    table.set_epoch(SLOT, 0)
    for expected in (EPOCH, 1, 0xFFFFFFFF):
        assert table.acquire(SLOT, word(), expected, 0)[0] == LeaseStatus.STALE
    assert table.acquire(SLOT, word(), 0, 0) == (LeaseStatus.OK, 0), "expected epoch 0 skips the check"
    assert table.release(SLOT, word()) == LeaseStatus.OK


@pytest.mark.parametrize("bad", [9 << 56 | 5 << 32 | 77, 0xFF << 56, 0x1234, 4 << 56 | 1], ids=["kind9", "kind255", "kind0", "kind4"])
def test_an_invalid_kind_is_corrupt(table: LeaseTable, bad: int) -> None:
    table._slots[SLOT].word = bad  # a buggy client's write
    assert table.acquire(SLOT, word(), EPOCH, 0) == (LeaseStatus.CORRUPT, bad)
    start = time.monotonic()
    assert table.acquire(SLOT, word(), EPOCH, 2.0) == (LeaseStatus.CORRUPT, bad), "corrupt is answered at once, not waited on"
    assert time.monotonic() - start < 0.5
    assert table.try_acquire(SLOT, word(), EPOCH, b"x") == LeaseStatus.HELD
    assert table.release(SLOT, word()) == LeaseStatus.NOT_HOLDER
    assert table.release(SLOT, bad) == LeaseStatus.OK  # a release is a compare-and-swap on the exact word, whatever it is
    table._slots[SLOT].word = bad
    assert table.clear(SLOT, word()) == LeaseStatus.NOT_HOLDER  # ... the daemon's clear is exact
    assert table.clear(SLOT, bad) == LeaseStatus.OK
    assert table.acquire(SLOT, word(), EPOCH, 0) == (LeaseStatus.OK, 0)
    assert table.release(SLOT, word()) == LeaseStatus.OK


# =========================================================================== waiting


def test_a_bounded_wait_returns_after_its_timeout_not_before(table: LeaseTable) -> None:
    held = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    for timeout in (0.05, 0.25):
        start = time.monotonic()
        assert table.acquire(SLOT, word(LeaseKind.REPLAY, 2, 22), EPOCH, timeout) == (LeaseStatus.HELD, held)
        elapsed = time.monotonic() - start
        assert timeout - 0.002 <= elapsed < timeout + 1.0, f"waited {elapsed:.3f}s for a {timeout}s timeout"
    assert table._slots[SLOT].waiters == 0, "a waiter that timed out is no longer counted"
    start = time.monotonic()
    assert table.acquire(SLOT, word(LeaseKind.REPLAY, 2, 22), EPOCH, 0) == (LeaseStatus.HELD, held)
    assert time.monotonic() - start < 0.05, "timeout 0 tries once"
    assert table.release(SLOT, held) == LeaseStatus.OK


def test_a_release_wakes_a_sleeping_waiter_well_before_its_timeout(table: LeaseTable) -> None:
    held, mine = word(LeaseKind.CAPTURE, 1, 11), word(LeaseKind.REPLAY, 2, 22)
    assert table.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(table, SLOT, mine, EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(table, SLOT)
    released = time.monotonic()
    assert table.release(SLOT, held) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.OK  # (the word it found is only meaningful with HELD / CORRUPT)
    assert time.monotonic() - released < 1.0 and waiter.elapsed < 5.0, f"woken after {waiter.elapsed:.3f}s of a 10s wait"
    assert table.peek(SLOT) == mine and table._slots[SLOT].waiters == 0
    assert table.release(SLOT, mine) == LeaseStatus.OK


def test_one_release_hands_the_lease_to_exactly_one_of_several_waiters(table: LeaseTable) -> None:
    held = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiters = [Waiter(table, SLOT, word(LeaseKind.REPLAY, 10 + i, 100 + i), EPOCH, 0.6) for i in range(4)]
    for w in waiters:
        w.start()
    wait_until_sleeping(table, SLOT, waiters=4)
    assert table.release(SLOT, held) == LeaseStatus.OK
    results = [w.finish() for w in waiters]
    winners = [w for w, r in zip(waiters, results) if r[0] == LeaseStatus.OK]
    assert len(winners) == 1, results
    assert table.peek(SLOT) == winners[0].args[2]
    assert all(r == (LeaseStatus.HELD, winners[0].args[2]) for r in results if r[0] != LeaseStatus.OK), "the losers saw the winner and timed out"
    assert table.release(SLOT, winners[0].args[2]) == LeaseStatus.OK


def test_clear_wakes_waiters(table: LeaseTable) -> None:
    dead = word(LeaseKind.CAPTURE, 3, 33)  # a holder that died: only the daemon's clear frees it
    assert table.acquire(SLOT, dead, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(table, SLOT, word(LeaseKind.REPLAY, 2, 22), EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(table, SLOT)
    assert table.clear(SLOT, dead) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.OK
    assert waiter.elapsed < 5.0
    assert table.release(SLOT, word(LeaseKind.REPLAY, 2, 22)) == LeaseStatus.OK


def test_a_retired_slot_wakes_its_waiters_with_stale(table: LeaseTable) -> None:
    held = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(table, SLOT, word(LeaseKind.REPLAY, 2, 22), EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(table, SLOT)
    table.set_epoch(SLOT, 0)  # what the daemon's retire does: epoch first, then the clear
    assert table.clear(SLOT, held) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.STALE
    assert waiter.elapsed < 5.0 and table.peek(SLOT) == 0


def test_a_garbage_word_ends_a_sleeping_wait_only_when_cleared(table: LeaseTable) -> None:
    held = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(table, SLOT, word(LeaseKind.REPLAY, 2, 22), EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(table, SLOT)
    table._slots[SLOT].word = 7 << 56  # scribbled over the holder: no futex bump
    time.sleep(0.05)
    assert waiter.is_alive()
    assert table.clear(SLOT, 7 << 56) == LeaseStatus.OK  # the daemon's tick
    assert waiter.finish()[0] == LeaseStatus.OK
    assert table.release(SLOT, held) == LeaseStatus.NOT_HOLDER  # the overwritten holder lost it
    assert table.release(SLOT, word(LeaseKind.REPLAY, 2, 22)) == LeaseStatus.OK


# =========================================================================== holder


def test_holder_fields(table: LeaseTable) -> None:
    assert table.holder(SLOT) is None
    before = time.time_ns()
    assert table.acquire(SLOT, word(LeaseKind.BORROW, 0xABCDE, 4321), EPOCH, 0) == (LeaseStatus.OK, 0)
    after = time.time_ns()
    table.set_label(SLOT, "EAGLE probability borrow")
    h = table.holder(SLOT)
    assert h is not None
    assert (h.kind, h.kind_name, h.session, h.pid, h.label) == (LeaseKind.BORROW, "borrow", 0xABCDE, 4321, "EAGLE probability borrow")
    assert before <= h.since_ns <= after, "since is CLOCK_REALTIME at the acquire"
    table.set_label(SLOT, "x" * 80)
    assert table.holder(SLOT).label == "x" * lease_table.LABEL_BYTES  # type: ignore[union-attr]
    table.set_label(SLOT, "short")
    assert table.holder(SLOT).label == "short", "a shorter label is terminated"  # type: ignore[union-attr]
    assert table.release(SLOT, word(LeaseKind.BORROW, 0xABCDE, 4321)) == LeaseStatus.OK
    assert table.holder(SLOT) is None
    table._slots[SLOT].word = 9 << 56 | 3 << 32 | 5
    assert table.holder(SLOT).kind_name == "invalid kind 9"  # type: ignore[union-attr]
    table._slots[SLOT].word = 0


# =========================================================================== the daemon's side

ARENA = "graphs"


def owner(h: Harness, name: str = "engine") -> Session:
    s = h.connect(name)
    h.create(s, ARENA, GiB)
    h.commit(s, ARENA, 2 * BULK)
    return s


def register(h: Harness, s: Session, offset: int, label: str) -> p.GraphPoolStatus:
    m = p.RegisterGraphPool(arena=ARENA, label=label, extents=[p.Extent(offset=offset, size=4 * MiB)], free_runs=[])
    return h.ok(s, m).reply.pool


def take(h: Harness, pool: p.GraphPoolStatus, s: Session, kind: int = LeaseKind.REPLAY, label: str = "") -> int:
    """``s`` takes the pool's lease as its client would; returns the word."""
    w = lease_table.encode(kind, s.id, s.pid)
    assert h.state.graph_pools.table.acquire(pool.slot, w, lease_table.lease_epoch(pool.id, pool.epoch), 0) == (LeaseStatus.OK, 0)
    h.state.graph_pools.table.set_label(pool.slot, label)
    return w


def test_registration_assigns_slots_and_writes_epochs_recapture_rewrites(h: Harness) -> None:
    s = owner(h)
    one, two = register(h, s, 0, "one"), register(h, s, 4 * MiB, "two")
    assert (one.slot, two.slot) == (1, 2), "slot 0 stays unused"
    t = h.state.graph_pools.table
    assert t.epoch(one.slot) == lease_table.lease_epoch(one.id, 1) and t.epoch(two.slot) == lease_table.lease_epoch(two.id, 1)
    extents = [p.Extent(offset=0, size=4 * MiB)]
    h.ok(s, p.UpdateGraphPool(pool_id=one.id, extents=extents, free_runs=[], recaptured=False))
    assert t.epoch(one.slot) == lease_table.lease_epoch(one.id, 1), "an update that is not a recapture keeps the epoch"
    updated = h.ok(s, p.UpdateGraphPool(pool_id=one.id, extents=extents, free_runs=[], recaptured=True)).reply.pool
    assert updated.epoch == 2 and t.epoch(one.slot) == lease_table.lease_epoch(one.id, 2)
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert t.acquire(one.slot, w, lease_table.lease_epoch(one.id, 1), 0)[0] == LeaseStatus.STALE, "the old view is stale"
    assert t.acquire(one.slot, w, lease_table.lease_epoch(one.id, 2), 0) == (LeaseStatus.OK, 0)
    assert t.release(one.slot, w) == LeaseStatus.OK


def test_a_recapture_under_a_held_lease_keeps_the_holder(h: Harness) -> None:
    s = owner(h)
    pool = register(h, s, 0, "one")
    w = take(h, pool, s, LeaseKind.CAPTURE)
    h.ok(s, p.UpdateGraphPool(pool_id=pool.id, extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[], recaptured=True))
    assert h.state.graph_pools.table.peek(pool.slot) == w
    assert h.state.graph_pools.table.release(pool.slot, w) == LeaseStatus.OK


def test_close_session_sweeps_exactly_that_sessions_slots(h: Harness) -> None:
    s = owner(h)
    p1, p2, p3, p4 = (register(h, s, i * 4 * MiB, f"p{i}") for i in range(4))
    b, c = h.connect("b"), h.connect("c")
    wb1, wb3 = take(h, p1, b, LeaseKind.CAPTURE), take(h, p3, b, LeaseKind.BORROW)
    wc2 = take(h, p2, c, LeaseKind.REPLAY)
    t = h.state.graph_pools.table
    futex = t._slots[p1.slot].futex
    h.state.close_session(b.id)
    assert t.peek(p1.slot) == 0 and t.peek(p3.slot) == 0
    assert t.peek(p2.slot) == wc2 and t.peek(p4.slot) == 0
    assert t._slots[p1.slot].futex == futex + 1, "the sweep wakes waiters"
    assert t.release(p1.slot, wb1) == LeaseStatus.NOT_HOLDER and t.release(p3.slot, wb3) == LeaseStatus.NOT_HOLDER
    assert set(h.state.graph_pools.by_id) == {p1.id, p2.id, p3.id, p4.id}, "b owned no pool: all stay"
    assert t.epoch(p1.slot) == lease_table.lease_epoch(p1.id, 1)
    h.state.close_session(c.id)
    assert t.words() == [0] * lease_table.SLOTS


def test_the_owner_leaving_sweeps_its_leases_and_retires_its_pools(h: Harness) -> None:
    s = owner(h)
    mine = register(h, s, 0, "mine")
    other = h.connect("other")
    held_by_other = take(h, mine, other, LeaseKind.REPLAY)
    h.state.close_session(s.id)
    t = h.state.graph_pools.table
    assert mine.id not in h.state.graph_pools.by_id
    assert t.epoch(mine.slot) == 0 and t.peek(mine.slot) == 0, "the pool went, and its holder was swept"
    assert t.release(mine.slot, held_by_other) == LeaseStatus.NOT_HOLDER


def test_tick_clears_impossible_words_and_leaves_valid_ones(h: Harness) -> None:
    s = owner(h)
    pools = [register(h, s, i * 4 * MiB, f"p{i}") for i in range(5)]
    b = h.connect("b")
    t = h.state.graph_pools.table
    valid = {pools[0].slot: take(h, pools[0], b, LeaseKind.CAPTURE), pools[1].slot: take(h, pools[1], s, LeaseKind.BORROW)}
    bad_kind = 9 << 56 | b.id << 32 | b.pid
    kind_zero = b.id << 32 | b.pid
    unknown_session = lease_table.encode(LeaseKind.REPLAY, 999, 4242)
    t._slots[pools[2].slot].word = bad_kind
    t._slots[pools[3].slot].word = kind_zero
    t._slots[pools[4].slot].word = unknown_session
    unowned = 700
    t._slots[unowned].word = lease_table.encode(LeaseKind.REPLAY, b.id, b.pid)  # a real session, but no pool has this slot
    t._slots[0].word = lease_table.encode(LeaseKind.REPLAY, b.id, b.pid)  # slot 0 is never handed out
    t._slots[lease_table.SLOTS - 1].word = 0xFFFF_FFFF_FFFF_FFFF
    h.state.tick()
    assert {i: w for i, w in enumerate(t.words()) if w} == valid
    h.state.tick()  # idempotent
    assert {i: w for i, w in enumerate(t.words()) if w} == valid
    for slot, w in valid.items():
        assert t.release(slot, w) == LeaseStatus.OK


def test_sweeps_compare_session_ids_as_the_word_holds_them(h: Harness) -> None:
    """The word has 24 bits for the session id. A daemon that has opened 2**24 sessions
    must neither sweep a live session's lease on a tick nor miss a dead one's at close."""
    s = owner(h)
    pool, other = register(h, s, 0, "p"), register(h, s, 4 * MiB, "q")
    h.state._next_session = (1 << 24) + 5  # as if 16.7 million sessions came and went
    live, dying = h.connect("live"), h.connect("dying")
    assert live.id > 0xFFFFFF and dying.id > 0xFFFFFF
    t = h.state.graph_pools.table
    w = take(h, pool, live, LeaseKind.REPLAY, label="held")
    take(h, other, dying, LeaseKind.CAPTURE)
    h.state.tick()
    assert t.peek(pool.slot) == w, "a tick swept a live session's lease"
    assert [(e.holder, e.label) for e in h.state.status().leases if e.pool_id == pool.id] == [("live", "held")]
    h.state.close_session(dying.id)
    assert t.peek(other.slot) == 0, "the session's close left its lease held"
    assert t.release(pool.slot, w) == LeaseStatus.OK
    # An id whose low 24 bits a live session already has is skipped: the words stay unambiguous.
    h.state._next_session = (2 << 24) + live.id % (1 << 24)
    assert h.connect("next").id == (2 << 24) + live.id % (1 << 24) + 1


def test_retire_clears_the_holder_sets_epoch_zero_and_frees_the_slot_for_reuse(h: Harness) -> None:
    s = owner(h)
    first, second = register(h, s, 0, "first"), register(h, s, 4 * MiB, "second")
    b = h.connect("b")
    held = take(h, first, b, LeaseKind.CAPTURE)
    t = h.state.graph_pools.table
    waiter = Waiter(t, first.slot, lease_table.encode(LeaseKind.REPLAY, s.id, s.pid), lease_table.lease_epoch(first.id, first.epoch), 10.0)
    waiter.start()
    wait_until_sleeping(t, first.slot)
    h.ok(s, p.RetireGraphPool(pool_id=first.id))
    assert waiter.finish()[0] == LeaseStatus.STALE, "a waiter on a retired pool wakes to a stale epoch"
    assert t.epoch(first.slot) == 0 and t.peek(first.slot) == 0
    assert t.release(first.slot, held) == LeaseStatus.NOT_HOLDER
    assert t.acquire(first.slot, held, lease_table.lease_epoch(first.id, 1), 0)[0] == LeaseStatus.STALE
    third = register(h, s, 0, "third")
    assert third.slot == first.slot, "the freed slot is handed out again"
    assert third.id != first.id and t.epoch(third.slot) == lease_table.lease_epoch(third.id, 1)
    assert t.acquire(third.slot, held, lease_table.lease_epoch(first.id, 1), 0)[0] == LeaseStatus.STALE, "the old pool's view stays stale"
    assert t.peek(second.slot) == 0 and t.epoch(second.slot) == lease_table.lease_epoch(second.id, 1)
    w = take(h, third, b, LeaseKind.REPLAY)
    assert t.release(third.slot, w) == LeaseStatus.OK


def test_releasing_the_arena_drops_its_pools_and_their_slots(h: Harness) -> None:
    s = owner(h)
    pool = register(h, s, 0, "p")
    take(h, pool, s, LeaseKind.REPLAY)
    h.release(s, ARENA)
    t = h.state.graph_pools.table
    assert t.peek(pool.slot) == 0 and t.epoch(pool.slot) == 0
    assert h.state.status().leases == []


def test_all_slots_in_use_refuses_a_registration_and_retiring_frees_one(h: Harness) -> None:
    s = owner(h)
    h.state.graph_pools._free_slots = h.state.graph_pools._free_slots[-2:]  # only two left, to keep the test small
    a, b = register(h, s, 0, "a"), register(h, s, 4 * MiB, "b")
    m = p.RegisterGraphPool(arena=ARENA, label="c", extents=[p.Extent(offset=8 * MiB, size=4 * MiB)], free_runs=[])
    h.refused(s, m, p.ErrorCode.OUT_OF_MEMORY)
    h.ok(s, p.RetireGraphPool(pool_id=a.id))
    assert register(h, s, 8 * MiB, "c").slot == a.slot
    assert b.slot != a.slot


def test_status_lists_held_leases(h: Harness) -> None:
    s = owner(h)
    p1, p2, p3 = (register(h, s, i * 4 * MiB, f"p{i}") for i in range(3))
    b = h.connect("worker-b")
    assert h.state.status().leases == []
    before = time.time()
    take(h, p1, b, LeaseKind.BORROW, label="EAGLE borrow")
    take(h, p3, s, LeaseKind.CAPTURE, label="cudagraph capture")
    after = time.time()
    out = {lease.pool_id: lease for lease in h.state.status().leases}
    assert set(out) == {p1.id, p3.id}, "a free pool has no entry"
    e = out[p1.id]
    assert (e.slot, e.kind, e.holder, e.pid, e.label) == (p1.slot, "borrow", "worker-b", b.pid, "EAGLE borrow")
    assert before - 0.001 <= e.since <= after + 0.001
    e = out[p3.id]
    assert (e.slot, e.kind, e.holder, e.pid, e.label) == (p3.slot, "capture", "engine", s.pid, "cudagraph capture")
    # A holder whose session the daemon does not know (yet to be swept) is named by number.
    h.state.graph_pools.table._slots[p2.slot].word = lease_table.encode(LeaseKind.REPLAY, 77, 4242)
    e = {lease.pool_id: lease for lease in h.state.status().leases}[p2.id]
    assert (e.holder, e.pid, e.kind) == ("session 77", 4242, "replay")
    assert p.from_wire(p.StatusReply, p.to_wire(h.state.status())).leases == h.state.status().leases
    h.state.tick()
    assert {lease.pool_id for lease in h.state.status().leases} == {p1.id, p3.id}


# =========================================================================== the client's conflict message


class _FakeSession:
    """What Lease._conflict reads of SessionLeases: the table, and the daemon's status (its leases)."""

    def __init__(self, table: LeaseTable, entries: list[p.LeaseStatus]) -> None:
        self.table = table
        self._entries = entries
        self.status_calls = 0

    def status(self) -> Any:
        self.status_calls += 1
        return types.SimpleNamespace(leases=self._entries)


def _entry(kind: str, holder: str, pid: int, label: str) -> p.LeaseStatus:
    return p.LeaseStatus(pool_id=1, slot=SLOT, kind=kind, holder=holder, pid=pid, label=label, since=time.time())


def test_the_conflict_names_the_holder_that_was_found(table: LeaseTable) -> None:
    pool = types.SimpleNamespace(id=1, slot=SLOT, epoch=1)
    found = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(SLOT, found, EPOCH, 0) == (LeaseStatus.OK, 0)
    table.set_label(SLOT, "cudagraph capture")
    session = _FakeSession(table, [_entry("capture", "engine-a", 11, "cudagraph capture")])
    error = Lease._conflict(session, pool, LeaseKind.REPLAY, "decode", found, 0.5, False)  # type: ignore[arg-type]
    assert session.status_calls == 1, "one status request names the holder"
    assert error.detail == {"holder": "engine-a", "pid": 11, "kind": "capture", "label": "cudagraph capture"}
    assert "replay lease 'decode' on graph pool 1 refused after waiting 0.5s: client 'engine-a' (pid 11)" in error.message
    assert "capture lease 'cudagraph capture' since " in error.message and "since ?" not in error.message
    assert table.release(SLOT, found) == LeaseStatus.OK


def test_a_lease_that_changed_hands_before_the_message_is_not_misattributed(table: LeaseTable) -> None:
    """The acquire saw A's word; by the time the message is written, C holds the slot.
    The message describes A (what refused the acquire), not A's pid with C's name and label."""
    pool = types.SimpleNamespace(id=1, slot=SLOT, epoch=1)
    found = word(LeaseKind.REPLAY, 1, 11)
    now = word(LeaseKind.BORROW, 3, 33)
    assert table.acquire(SLOT, now, EPOCH, 0) == (LeaseStatus.OK, 0)
    table.set_label(SLOT, "c-label")
    session = _FakeSession(table, [_entry("borrow", "client-c", 33, "c-label")])
    error = Lease._conflict(session, pool, LeaseKind.CAPTURE, "cap", found, 0, False)  # type: ignore[arg-type]
    assert error.detail == {"holder": "session 1", "pid": 11, "kind": "replay", "label": ""}
    assert "client-c" not in error.message and "c-label" not in error.message and "since ?" in error.message
    corrupt = Lease._conflict(session, pool, LeaseKind.CAPTURE, "cap", 9 << 56, 0, True)  # type: ignore[arg-type]
    assert "impossible value (0x900000000000000)" in corrupt.message
    assert table.release(SLOT, now) == LeaseStatus.OK


@pytest.mark.parametrize("pool_id,epoch", [(1, 1), (0x1_0001, 7), (3, 0x1_0000), (0x1_0000, 0x1_0000)])
def test_the_fast_path_checks_the_same_epoch_the_daemon_writes(table: LeaseTable, pool_id: int, epoch: int) -> None:
    """Lease.acquire inlines lease_table.lease_epoch on its hot path: both must agree, wraps and
    the "never 0" rule included."""
    session = types.SimpleNamespace(
        table=table, words={LeaseKind.REPLAY: word()}, escapes={}, address=table.address, try_acquire=table._try, try_release=table._release
    )
    table.set_epoch(SLOT, lease_table.lease_epoch(pool_id, epoch))
    lease = Lease.acquire(session, types.SimpleNamespace(id=pool_id, slot=SLOT, epoch=epoch), LeaseKind.REPLAY, "x", 0)  # type: ignore[arg-type]
    assert table.peek(SLOT) == word()
    lease.release()
    with pytest.raises(gpumem.StaleEpoch):
        Lease.acquire(session, types.SimpleNamespace(id=pool_id, slot=SLOT, epoch=epoch + 2), LeaseKind.REPLAY, "x", 0)  # type: ignore[arg-type]
