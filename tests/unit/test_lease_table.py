"""Lease slots: the native compare-and-swap / futex calls through ``LeaseSegment`` in this
process (threads stand in for other processes: the native calls drop the GIL), and the
daemon's side in ``DaemonState``: a segment per pool granted with it, epochs, the sweeps
(a session that ended, impossible words on a tick), retire, ``status().leases``.

Every wait is bounded; a thread that must not outlive its test is joined with a timeout."""

from __future__ import annotations

import os
import threading
import time
import types
from typing import Any

import pytest

import gpumem
from gpumem.leases import Lease
from gpumem_shared import _native, lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import KIND_NAMES, LeaseKind, LeaseSegment, LeaseStatus
from gpumemd.config import TenantLimits

from .harness import Harness, MiB, open_fds
from .lease_kit import ARENA, EPOCH, Pool, Waiter, follow, fresh_segment, give_back, granted, owner, register, repairs, take, user, wait_until_sleeping, word

KINDS = list(LeaseKind)


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


def test_a_segment_is_a_sealed_memfd_of_one_page_named_after_its_pool() -> None:
    seg, fd = LeaseSegment.create(42)
    try:
        assert os.fstat(fd).st_size == lease_table.SEGMENT_BYTES == 4096
        assert os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{lease_table.SEGMENT_NAME}42 (deleted)"
        with pytest.raises(PermissionError):
            os.ftruncate(fd, lease_table.SEGMENT_BYTES * 2)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 64)
        assert (seg.peek(), seg.epoch(), seg.flags(), seg.handoff(), seg.escaped()) == (0, 0, 0, 0, 0)
        other = LeaseSegment(fd)  # a second mapping (a client) sees the same memory
        assert other.address != seg.address
        assert seg.acquire(word(), 0, 0) == (LeaseStatus.OK, 0)
        assert other.peek() == word() and other.holder() is not None
        other.close()
        assert other.epoch() == 0 and other.holder() is None, "a closed mapping reads zeros"
        with pytest.raises(ValueError, match="is not 0"):
            other.peek()  # a native call on it is refused, not a fault
        assert seg.peek() == word(), "closing one mapping leaves the segment alone"
    finally:
        seg.close()
        os.close(fd)
    wrong = os.memfd_create("not-a-segment")
    try:
        os.ftruncate(wrong, 64 * 1024)
        with pytest.raises(ValueError, match="lease segment"):
            LeaseSegment(wrong)
    finally:
        os.close(wrong)


def mappings_of(pool_id: int) -> int:
    """This process's mappings of graph pool ``pool_id``'s lease segment."""
    name = f"/memfd:{lease_table.SEGMENT_NAME}{pool_id} (deleted)"
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip("\n").endswith(name))


def test_a_mapping_holds_no_descriptor_and_close_unmaps() -> None:
    """A client maps a segment per pool it uses: a mapping must not keep a descriptor open."""
    seg, fd = LeaseSegment.create(7)
    before = len(os.listdir("/proc/self/fd"))
    client = LeaseSegment(fd)
    assert len(os.listdir("/proc/self/fd")) == before, "mapping a segment kept a descriptor"
    os.close(fd)
    assert mappings_of(7) == 2
    client.close()
    assert mappings_of(7) == 1
    del seg  # dropped without close(): unmapped all the same
    assert mappings_of(7) == 0


# =========================================================================== exclusion


@pytest.mark.parametrize("first", KINDS, ids=KIND_NAMES.get)
@pytest.mark.parametrize("second", KINDS, ids=KIND_NAMES.get)
def test_every_kind_excludes_every_kind(table: LeaseSegment, first: int, second: int) -> None:
    """All 9 pairs conflict: leases are exclusive, whoever asks, through both entry points."""
    held = word(first, session=1, pid=1001)
    assert table.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    for other in (word(second, session=2, pid=1002), word(second, session=1, pid=1001)):  # another session; the same one
        assert table.acquire(other, EPOCH, 0) == (LeaseStatus.HELD, held)
        assert table.acquire(other, 0, 0) == (LeaseStatus.HELD, held)  # no epoch check: still held
        assert table.try_acquire(other, EPOCH, b"x") == LeaseStatus.HELD
        assert table.peek() == held
    assert table.release(held) == LeaseStatus.OK
    assert table.acquire(word(second, session=2, pid=1002), EPOCH, 0) == (LeaseStatus.OK, 0)


def test_acquire_release_and_segments_are_independent(table: LeaseSegment) -> None:
    a, b = word(LeaseKind.CAPTURE, 1, 11), word(LeaseKind.BORROW, 2, 22)
    other = fresh_segment(2)
    other.set_epoch(EPOCH)
    assert table.acquire(a, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert other.acquire(b, EPOCH, 0) == (LeaseStatus.OK, 0)  # another pool's segment is another lease
    assert (table.peek(), other.peek()) == (a, b)
    assert table.release(a) == LeaseStatus.OK
    assert table.peek() == 0 and table.holder() is None
    assert other.peek() == b
    futex = table._slot.futex
    assert table.acquire(b, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert table.release(b) == LeaseStatus.OK
    assert table._slot.futex == futex + 1, "every release bumps the futex word"


def test_double_release_and_releasing_another_holders_word_are_not_holder(table: LeaseSegment) -> None:
    mine, theirs = word(LeaseKind.REPLAY, 1, 11), word(LeaseKind.REPLAY, 2, 22)
    assert table.acquire(theirs, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert table.release(mine) == LeaseStatus.NOT_HOLDER
    assert table.release(word(LeaseKind.CAPTURE, 2, 22)) == LeaseStatus.NOT_HOLDER  # their session and pid, another kind
    assert table.peek() == theirs, "a refused release leaves the holder alone"
    assert table.release(theirs) == LeaseStatus.OK
    assert table.release(theirs) == LeaseStatus.NOT_HOLDER
    assert table.release(mine) == LeaseStatus.NOT_HOLDER  # of a free slot
    assert table.peek() == 0


def test_try_acquire_takes_a_free_slot_and_records_the_label(table: LeaseSegment) -> None:
    assert table.try_acquire(word(), EPOCH, b"decode step") == LeaseStatus.OK
    h = table.holder()
    assert h is not None and h.label == "decode step"
    assert fresh_segment(2).try_acquire(word(), EPOCH, b"x") == LeaseStatus.STALE  # epoch 0: not registered, or retired
    assert table.release(word()) == LeaseStatus.OK


# =========================================================================== epochs and corrupt words


def test_stale_epoch(table: LeaseSegment) -> None:
    table.set_epoch(lease_table.lease_epoch(1, 2))  # recaptured
    assert table.epoch() == lease_table.lease_epoch(1, 2)
    assert table.acquire(word(), EPOCH, 0) == (LeaseStatus.STALE, 0)
    assert table.acquire(word(), EPOCH, 0.05)[0] == LeaseStatus.STALE  # a wait does not help
    assert table.acquire(word(), lease_table.lease_epoch(2, 1), 0)[0] == LeaseStatus.STALE  # another pool's view
    assert table.peek() == 0
    assert table.acquire(word(), lease_table.lease_epoch(1, 2), 0) == (LeaseStatus.OK, 0)
    assert table.release(word()) == LeaseStatus.OK


def test_epoch_zero_is_a_retired_slot(table: LeaseSegment) -> None:
    table.set_epoch(0)
    for expected in (EPOCH, 1, 0xFFFFFFFF):
        assert table.acquire(word(), expected, 0)[0] == LeaseStatus.STALE
    assert table.acquire(word(), 0, 0) == (LeaseStatus.OK, 0), "expected epoch 0 skips the check"
    assert table.release(word()) == LeaseStatus.OK


@pytest.mark.parametrize("bad", [9 << 56 | 5 << 32 | 77, 0xFF << 56, 0x1234, 4 << 56 | 1], ids=["kind9", "kind255", "kind0", "kind4"])
def test_an_invalid_kind_is_corrupt(table: LeaseSegment, bad: int) -> None:
    table._slot.word = bad  # a buggy client's write
    assert table.acquire(word(), EPOCH, 0) == (LeaseStatus.CORRUPT, bad)
    start = time.monotonic()
    assert table.acquire(word(), EPOCH, 2.0) == (LeaseStatus.CORRUPT, bad), "corrupt is answered at once, not waited on"
    assert time.monotonic() - start < 0.5
    assert table.try_acquire(word(), EPOCH, b"x") == LeaseStatus.HELD
    assert table.release(word()) == LeaseStatus.NOT_HOLDER
    assert table.release(bad) == LeaseStatus.OK  # a release is a compare-and-swap on the exact word, whatever it is
    table._slot.word = bad
    assert table.clear(word()) == LeaseStatus.NOT_HOLDER  # ... the daemon's clear is exact
    assert table.clear(bad) == LeaseStatus.OK
    assert table.acquire(word(), EPOCH, 0) == (LeaseStatus.OK, 0)
    assert table.release(word()) == LeaseStatus.OK


# =========================================================================== waiting


def test_a_bounded_wait_returns_after_its_timeout_not_before(table: LeaseSegment) -> None:
    held = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    for timeout in (0.05, 0.25):
        start = time.monotonic()
        assert table.acquire(word(LeaseKind.REPLAY, 2, 22), EPOCH, timeout) == (LeaseStatus.HELD, held)
        elapsed = time.monotonic() - start
        assert timeout - 0.002 <= elapsed < timeout + 1.0, f"waited {elapsed:.3f}s for a {timeout}s timeout"
    assert table._slot.waiters == 0, "a waiter that timed out is no longer counted"
    start = time.monotonic()
    assert table.acquire(word(LeaseKind.REPLAY, 2, 22), EPOCH, 0) == (LeaseStatus.HELD, held)
    assert time.monotonic() - start < 0.05, "timeout 0 tries once"
    assert table.release(held) == LeaseStatus.OK


def test_a_release_wakes_a_sleeping_waiter_well_before_its_timeout(table: LeaseSegment) -> None:
    held, mine = word(LeaseKind.CAPTURE, 1, 11), word(LeaseKind.REPLAY, 2, 22)
    assert table.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(table, mine, EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(table)
    released = time.monotonic()
    assert table.release(held) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.OK  # (the word it found is only meaningful with HELD / CORRUPT)
    assert time.monotonic() - released < 1.0 and waiter.elapsed < 5.0, f"woken after {waiter.elapsed:.3f}s of a 10s wait"
    assert table.peek() == mine and table._slot.waiters == 0
    assert table.release(mine) == LeaseStatus.OK


def test_a_short_hold_is_handed_over_while_the_waiter_spins_and_the_label_comes_with_it(table: LeaseSegment) -> None:
    held, mine = word(LeaseKind.CAPTURE, 1, 11), word(LeaseKind.REPLAY, 2, 22)
    assert table.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    releaser = threading.Timer(0.002, table.release, (held,))
    releaser.start()
    assert table.acquire(mine, EPOCH, 5.0, b"draft replay")[0] == LeaseStatus.OK
    releaser.join()
    holder = table.holder()
    assert holder is not None and holder.label == "draft replay", "the waiting acquire records the label it was given"
    assert table._slot.waiters == 0
    assert table.release(mine) == LeaseStatus.OK


def test_one_release_hands_the_lease_to_exactly_one_of_several_waiters(table: LeaseSegment) -> None:
    held = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiters = [Waiter(table, word(LeaseKind.REPLAY, 10 + i, 100 + i), EPOCH, 0.6) for i in range(4)]
    for w in waiters:
        w.start()
    wait_until_sleeping(table, waiters=4)
    assert table.release(held) == LeaseStatus.OK
    results = [w.finish() for w in waiters]
    winners = [w for w, r in zip(waiters, results) if r[0] == LeaseStatus.OK]
    assert len(winners) == 1, results
    assert table.peek() == winners[0].args[1]
    assert all(r == (LeaseStatus.HELD, winners[0].args[1]) for r in results if r[0] != LeaseStatus.OK), "the losers saw the winner and timed out"
    assert table.release(winners[0].args[1]) == LeaseStatus.OK


def test_clear_wakes_waiters(table: LeaseSegment) -> None:
    dead = word(LeaseKind.CAPTURE, 3, 33)  # a holder that died: only the daemon's clear frees it
    assert table.acquire(dead, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(table, word(LeaseKind.REPLAY, 2, 22), EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(table)
    assert table.clear(dead) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.OK
    assert waiter.elapsed < 5.0
    assert table.release(word(LeaseKind.REPLAY, 2, 22)) == LeaseStatus.OK


def test_a_retired_slot_wakes_its_waiters_with_stale(table: LeaseSegment) -> None:
    held = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(table, word(LeaseKind.REPLAY, 2, 22), EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(table)
    table.set_epoch(0)  # what the daemon's retire does: epoch first, then the clear
    assert table.clear(held) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.STALE
    assert waiter.elapsed < 5.0 and table.peek() == 0


def test_a_garbage_word_ends_a_sleeping_wait_only_when_cleared(table: LeaseSegment) -> None:
    held = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(table, word(LeaseKind.REPLAY, 2, 22), EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(table)
    table._slot.word = 7 << 56  # scribbled over the holder: no futex bump
    time.sleep(0.05)
    assert waiter.is_alive()
    assert table.clear(7 << 56) == LeaseStatus.OK  # the daemon's tick
    assert waiter.finish()[0] == LeaseStatus.OK
    assert table.release(held) == LeaseStatus.NOT_HOLDER  # the overwritten holder lost it
    assert table.release(word(LeaseKind.REPLAY, 2, 22)) == LeaseStatus.OK


# =========================================================================== holder


def test_holder_fields(table: LeaseSegment) -> None:
    assert table.holder() is None
    before = time.time_ns()
    assert table.acquire(word(LeaseKind.BORROW, 0xABCDE, 4321), EPOCH, 0) == (LeaseStatus.OK, 0)
    after = time.time_ns()
    table.set_label("EAGLE probability borrow")
    h = table.holder()
    assert h is not None
    assert (h.kind, h.kind_name, h.session, h.pid, h.label) == (LeaseKind.BORROW, "borrow", 0xABCDE, 4321, "EAGLE probability borrow")
    assert before <= h.since_ns <= after, "since is CLOCK_REALTIME at the acquire"
    table.set_label("x" * 80)
    assert table.holder().label == "x" * lease_table.LABEL_BYTES  # type: ignore[union-attr]
    table.set_label("short")
    assert table.holder().label == "short", "a shorter label is terminated"  # type: ignore[union-attr]
    assert table.release(word(LeaseKind.BORROW, 0xABCDE, 4321)) == LeaseStatus.OK
    assert table.holder() is None
    table._slot.word = 9 << 56 | 3 << 32 | 5
    assert table.holder().kind_name == "invalid kind 9"  # type: ignore[union-attr]
    table._slot.word = 0


# =========================================================================== the daemon's side

def inode(fd: int) -> int:
    return os.fstat(fd).st_ino


def test_registration_grants_the_owner_a_segment_of_the_pools_own(h: Harness) -> None:
    s = owner(h)
    first = h.ok(s, p.RegisterGraphPool(arena=ARENA, label="one", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[]))
    second = h.ok(s, p.RegisterGraphPool(arena=ARENA, label="two", extents=[p.Extent(offset=4 * MiB, size=4 * MiB)], free_runs=[]))
    records = h.state.graph_pools.by_id
    for outcome in (first, second):
        pool = outcome.reply.pool
        assert outcome.reply.fd_batches == 1 and outcome.grants == [(pool.id, records[pool.id].segment_fd)]
        assert outcome.handout == [] and pool.slot == 0
    assert inode(first.grants[0][1]) != inode(second.grants[0][1]), "two pools share no lease words"
    one, two = Pool(first.reply.pool, granted(first)), Pool(second.reply.pool, granted(second))
    assert one.segment.epoch() == lease_table.lease_epoch(one.id, 1) and two.segment.epoch() == lease_table.lease_epoch(two.id, 1)
    extents = [p.Extent(offset=0, size=4 * MiB)]
    outcome = h.ok(s, p.UpdateGraphPool(pool_id=one.id, extents=extents, free_runs=[], recaptured=False))
    assert outcome.grants == [] and outcome.reply.fd_batches == 0, "an update grants nothing"
    assert one.segment.epoch() == lease_table.lease_epoch(one.id, 1), "an update that is not a recapture keeps the epoch"
    updated = h.ok(s, p.UpdateGraphPool(pool_id=one.id, extents=extents, free_runs=[], recaptured=True)).reply.pool
    assert updated.epoch == 2 and one.segment.epoch() == lease_table.lease_epoch(one.id, 2)
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert one.segment.acquire(w, lease_table.lease_epoch(one.id, 1), 0)[0] == LeaseStatus.STALE, "the old view is stale"
    assert one.segment.acquire(w, lease_table.lease_epoch(one.id, 2), 0) == (LeaseStatus.OK, 0)
    assert two.segment.peek() == 0, "the other pool's lease is another segment"
    assert give_back(one, w) == LeaseStatus.OK


def test_a_recapture_under_a_held_lease_keeps_the_holder(h: Harness) -> None:
    s = owner(h)
    pool = register(h, s, 0, "one")
    w = take(pool, s, LeaseKind.CAPTURE)
    h.ok(s, p.UpdateGraphPool(pool_id=pool.id, extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[], recaptured=True))
    assert pool.segment.peek() == w
    assert give_back(pool, w) == LeaseStatus.OK


def test_close_session_sweeps_exactly_that_sessions_leases(h: Harness) -> None:
    s = owner(h)
    p1, p2, p3, p4 = (register(h, s, i * 4 * MiB, f"p{i}") for i in range(4))
    b, c = user(h, s, "b", p1, p2, p3, p4), user(h, s, "c", p1, p2, p3, p4)
    wb1, wb3 = take(p1, b, LeaseKind.CAPTURE), take(p3, b, LeaseKind.BORROW)
    wc2 = take(p2, c, LeaseKind.REPLAY)
    futex = p1.segment._slot.futex
    h.state.close_session(b.id)
    assert p1.segment.peek() == 0 and p3.segment.peek() == 0
    assert p1.segment._slot.futex == futex + 1, "the sweep wakes waiters"
    assert p1.segment.release(wb1) == LeaseStatus.NOT_HOLDER and p3.segment.release(wb3) == LeaseStatus.NOT_HOLDER
    assert set(h.state.graph_pools.by_id) == {p1.id, p2.id, p3.id, p4.id}, "b owned no pool: all stay"
    # b's process may live on with its mappings: each pool moved to a segment b never got,
    # c's lease carried over.
    old = {q.id: follow(h, s, q) for q in (p1, p2, p3, p4)}
    assert [o.peek() for o in old.values()] == [0, 0, 0, 0]
    assert [q.segment.peek() for q in (p1, p2, p3, p4)] == [0, wc2, 0, 0]
    assert p1.segment.epoch() == p1.epoch and p1.segment._slot.futex == futex + 1, "the release count moves along"
    h.state.close_session(c.id)
    assert [q.segment.peek() for q in (p1, p2, p3, p4)] == [0, 0, 0, 0]
    assert all(repairs(h, q) == 0 for q in (p1, p2, p3, p4)), "a session's end is no repair"


def test_the_owner_leaving_sweeps_its_leases_and_retires_its_pools(h: Harness) -> None:
    s = owner(h)
    mine = register(h, s, 0, "mine")
    other = user(h, s, "other", mine)
    held_by_other = take(mine, other, LeaseKind.REPLAY)
    h.state.close_session(s.id)
    assert mine.id not in h.state.graph_pools.by_id
    assert mine.segment.epoch() == 0 and mine.segment.peek() == 0, "the pool went, and its holder was swept"
    assert mine.segment.release(held_by_other) == LeaseStatus.NOT_HOLDER


def test_tick_clears_impossible_words_and_words_of_sessions_that_may_not_use_the_pool(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    s = owner(h)
    pools = [register(h, s, i * 4 * MiB, f"p{i}") for i in range(6)]
    b = user(h, s, "b", *pools)
    stranger = h.connect("stranger")  # live, but it never opened any of them
    valid = {pools[0].id: take(pools[0], b, LeaseKind.CAPTURE), pools[1].id: take(pools[1], s, LeaseKind.BORROW)}
    garbage = {
        pools[2].id: 9 << 56 | b.id << 32 | b.pid,  # a kind that does not exist
        pools[3].id: b.id << 32 | b.pid,  # kind 0
        pools[4].id: lease_table.encode(LeaseKind.REPLAY, 999, 4242),  # a session that does not exist
        pools[5].id: lease_table.encode(LeaseKind.REPLAY, stranger.id, stranger.pid),  # a session without the right
    }
    for pool in pools[2:]:
        pool.segment._slot.word = garbage[pool.id]
    with caplog.at_level("WARNING", logger="gpumemd.graph_pools"):
        h.state.tick()
    assert {q.id: q.segment.peek() for q in pools if q.segment.peek()} == valid
    assert {q.id: repairs(h, q) for q in pools} == {q.id: int(q.id in garbage) for q in pools}
    assert "an unknown kind 9" in caplog.text and "session 999, which does not exist" in caplog.text
    assert f"client 'stranger' (pid {stranger.pid}), which may not use the pool" in caplog.text
    h.state.tick()  # idempotent
    assert {q.id: q.segment.peek() for q in pools if q.segment.peek()} == valid
    assert {q.id: repairs(h, q) for q in pools} == {q.id: int(q.id in garbage) for q in pools}
    assert give_back(pools[0], valid[pools[0].id]) == LeaseStatus.OK
    assert give_back(pools[1], valid[pools[1].id]) == LeaseStatus.OK


def test_sweeps_compare_session_ids_as_the_word_holds_them(h: Harness) -> None:
    """The word has 24 bits for the session id. A daemon that has opened 2**24 sessions
    must neither sweep a live session's lease on a tick nor miss a dead one's at close."""
    s = owner(h)
    pool, other = register(h, s, 0, "p"), register(h, s, 4 * MiB, "q")
    h.state.session_desk.next_session = (1 << 24) + 5  # as if 16.7 million sessions came and went
    live, dying = user(h, s, "live", pool, other), user(h, s, "dying", pool, other)
    assert live.id > 0xFFFFFF and dying.id > 0xFFFFFF
    w = take(pool, live, LeaseKind.REPLAY, label="held")
    take(other, dying, LeaseKind.CAPTURE)
    h.state.tick()
    assert pool.segment.peek() == w, "a tick swept a live session's lease"
    assert [(e.holder, e.label) for e in h.state.status().leases if e.pool_id == pool.id] == [("live", "held")]
    h.state.close_session(dying.id)
    assert other.segment.peek() == 0, "the session's close left its lease held"
    follow(h, s, pool)
    assert pool.segment.peek() == w, "the move dropped a live session's lease"
    assert give_back(pool, w) == LeaseStatus.OK
    # An id whose low 24 bits a live session already has is skipped: the words stay unambiguous.
    h.state.session_desk.next_session = (2 << 24) + live.id % (1 << 24)
    assert h.connect("next").id == (2 << 24) + live.id % (1 << 24) + 1


def test_retire_clears_the_holder_sets_epoch_zero_and_never_hands_its_segment_to_another_pool(h: Harness) -> None:
    s = owner(h)
    first, second = register(h, s, 0, "first"), register(h, s, 4 * MiB, "second")
    b = user(h, s, "b", first, second)
    held = take(first, b, LeaseKind.CAPTURE)
    first_inode = inode(h.state.graph_pools.by_id[first.id].segment_fd)
    waiter = Waiter(first.segment, lease_table.encode(LeaseKind.REPLAY, s.id, s.pid), first.epoch, 10.0)
    waiter.start()
    wait_until_sleeping(first.segment)
    daemon_fds = open_fds()
    h.ok(s, p.RetireGraphPool(pool_id=first.id))
    assert waiter.finish()[0] == LeaseStatus.STALE, "a waiter on a retired pool wakes to a stale epoch"
    assert open_fds() == daemon_fds - 1, "the daemon let go of the retired pool's segment"
    assert first.segment.epoch() == 0 and first.segment.peek() == 0
    assert first.segment.release(held) == LeaseStatus.NOT_HOLDER
    third_outcome = h.ok(s, p.RegisterGraphPool(arena=ARENA, label="third", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[]))
    third = Pool(third_outcome.reply.pool, granted(third_outcome))
    assert inode(third_outcome.grants[0][1]) != first_inode, "a new pool gets a new segment"
    assert first.segment.epoch() == 0 and first.segment.acquire(held, lease_table.lease_epoch(first.id, 1), 0)[0] == LeaseStatus.STALE
    assert third.segment.epoch() == third.epoch and third.segment.peek() == 0
    assert second.segment.peek() == 0 and second.segment.epoch() == second.epoch
    w = take(third, s, LeaseKind.REPLAY)
    assert first.segment.peek() == 0, "the old segment's holders see nothing of the new pool"
    assert give_back(third, w) == LeaseStatus.OK


def test_releasing_the_arena_drops_its_pools_and_their_segments(h: Harness) -> None:
    s = owner(h)
    pool = register(h, s, 0, "p")
    take(pool, s, LeaseKind.REPLAY)
    h.release(s, ARENA)
    assert pool.segment.peek() == 0 and pool.segment.epoch() == 0
    assert h.state.status().leases == [] and h.state.graph_pools.by_id == {}


def test_the_pool_limit_refuses_a_registration_and_retiring_frees_room(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpumemd.graph_pools.MAX_POOLS", 2)  # to keep the test small
    h.state.tenants.limits = TenantLimits(graph_pool_share=1.0)  # the daemon's limit, not a tenant's share (test_tenants)
    s = owner(h)
    a, _ = register(h, s, 0, "a"), register(h, s, 4 * MiB, "b")
    m = p.RegisterGraphPool(arena=ARENA, label="c", extents=[p.Extent(offset=8 * MiB, size=4 * MiB)], free_runs=[])
    assert "2 graph pools" in h.refused(s, m, p.ErrorCode.OUT_OF_MEMORY).message
    h.ok(s, p.RetireGraphPool(pool_id=a.id))
    assert register(h, s, 8 * MiB, "c").id not in (a.id,)


def test_status_lists_held_leases(h: Harness) -> None:
    s = owner(h)
    p1, p2, p3 = (register(h, s, i * 4 * MiB, f"p{i}") for i in range(3))
    b = user(h, s, "worker-b", p1, p2, p3)
    assert h.state.status().leases == []
    before = time.time()
    take(p1, b, LeaseKind.BORROW, label="EAGLE borrow")
    take(p3, s, LeaseKind.CAPTURE, label="cudagraph capture")
    after = time.time()
    out = {lease.pool_id: lease for lease in h.state.status().leases}
    assert set(out) == {p1.id, p3.id}, "a free pool has no entry"
    e = out[p1.id]
    assert (e.slot, e.kind, e.holder, e.pid, e.label) == (0, "borrow", "worker-b", b.pid, "EAGLE borrow")
    assert before - 0.001 <= e.since <= after + 0.001
    e = out[p3.id]
    assert (e.slot, e.kind, e.holder, e.pid, e.label) == (0, "capture", "engine", s.pid, "cudagraph capture")
    # A holder whose session the daemon does not know (yet to be repaired) is named by number.
    p2.segment._slot.word = lease_table.encode(LeaseKind.REPLAY, 77, 4242)
    e = {lease.pool_id: lease for lease in h.state.status().leases}[p2.id]
    assert (e.holder, e.pid, e.kind) == ("session 77", 4242, "replay")
    assert p.from_wire(p.StatusReply, p.to_wire(h.state.status())).leases == h.state.status().leases
    h.state.tick()
    assert {lease.pool_id for lease in h.state.status().leases} == {p1.id, p3.id}


# =========================================================================== the client's conflict message


class _FakeSession:
    """What Lease._conflict reads of SessionLeases: the daemon's status (its leases)."""

    def __init__(self, entries: list[p.LeaseStatus]) -> None:
        self._entries = entries
        self.status_calls = 0

    def status(self) -> Any:
        self.status_calls += 1
        return types.SimpleNamespace(leases=self._entries)


def _entry(kind: str, holder: str, pid: int, label: str) -> p.LeaseStatus:
    return p.LeaseStatus(pool_id=1, slot=0, kind=kind, holder=holder, pid=pid, label=label, since=time.time())


def test_the_conflict_names_the_holder_that_was_found(table: LeaseSegment) -> None:
    pool = types.SimpleNamespace(id=1, segment=table, epoch=1)
    found = word(LeaseKind.CAPTURE, 1, 11)
    assert table.acquire(found, EPOCH, 0) == (LeaseStatus.OK, 0)
    table.set_label("cudagraph capture")
    session = _FakeSession([_entry("capture", "engine-a", 11, "cudagraph capture")])
    error = Lease._conflict(session, pool, LeaseKind.REPLAY, "decode", found, 0.5, False)  # type: ignore[arg-type]
    assert session.status_calls == 1, "one status request names the holder"
    assert error.detail == {"holder": "engine-a", "pid": 11, "kind": "capture", "label": "cudagraph capture"}
    assert "replay lease 'decode' on graph pool 1 refused after waiting 0.5s: client 'engine-a' (pid 11)" in error.message
    assert "capture lease 'cudagraph capture' since " in error.message and "since ?" not in error.message
    assert table.release(found) == LeaseStatus.OK


def test_a_lease_that_changed_hands_before_the_message_is_not_misattributed(table: LeaseSegment) -> None:
    """The acquire saw A's word; by the time the message is written, C holds the slot.
    The message describes A (what refused the acquire), not A's pid with C's name and label."""
    pool = types.SimpleNamespace(id=1, segment=table, epoch=1)
    found = word(LeaseKind.REPLAY, 1, 11)
    now = word(LeaseKind.BORROW, 3, 33)
    assert table.acquire(now, EPOCH, 0) == (LeaseStatus.OK, 0)
    table.set_label("c-label")
    session = _FakeSession([_entry("borrow", "client-c", 33, "c-label")])
    error = Lease._conflict(session, pool, LeaseKind.CAPTURE, "cap", found, 0, False)  # type: ignore[arg-type]
    assert error.detail == {"holder": "session 1", "pid": 11, "kind": "replay", "label": ""}
    assert "client-c" not in error.message and "c-label" not in error.message and "since ?" in error.message
    corrupt = Lease._conflict(session, pool, LeaseKind.CAPTURE, "cap", 9 << 56, 0, True)  # type: ignore[arg-type]
    assert "impossible value (0x900000000000000)" in corrupt.message
    assert table.release(now) == LeaseStatus.OK


def _leasing() -> Any:
    """What Lease.acquire reads of SessionLeases on its uncontended path."""
    return types.SimpleNamespace(words={LeaseKind.REPLAY: word()}, escapes={}, try_acquire=_native.lease_try, try_release=_native.lease_release)


@pytest.mark.parametrize("pool_id,epoch", [(1, 1), (0x1_0001, 7), (3, 0x1_0000), (0x1_0000, 0x1_0000)])
def test_the_fast_path_checks_the_same_epoch_the_daemon_writes(table: LeaseSegment, pool_id: int, epoch: int) -> None:
    """Lease.acquire inlines lease_table.lease_epoch on its hot path: both must agree, wraps and
    the "never 0" rule included."""
    session = _leasing()
    table.set_epoch(lease_table.lease_epoch(pool_id, epoch))
    lease = Lease.acquire(session, types.SimpleNamespace(id=pool_id, segment=table, epoch=epoch, shared=False), LeaseKind.REPLAY, "x", 0)
    assert table.peek() == word()
    lease.release()
    with pytest.raises(gpumem.StaleEpoch):
        Lease.acquire(session, types.SimpleNamespace(id=pool_id, segment=table, epoch=epoch + 2, shared=False), LeaseKind.REPLAY, "x", 0)


def test_a_lease_needs_a_pool_this_session_maps() -> None:
    """A pool's view from the daemon's status carries no segment: no lease on it."""
    view = p.GraphPoolStatus(id=1, owner="a", arena="x", label="l", epoch=1, extents=[], free_runs=[], free_bytes=0)
    with pytest.raises(gpumem.InvalidArgument, match="registered or opened"):
        Lease.acquire(_leasing(), view, LeaseKind.REPLAY, "x", 0)


def test_a_held_lease_keeps_its_segment_mapped() -> None:
    """A pool object may go while its lease is held (``with session.replay(open_pool())``):
    the release must still find the slot mapped."""
    seg = fresh_segment(5)
    seg.set_epoch(lease_table.lease_epoch(5, 1))
    lease = Lease.acquire(_leasing(), types.SimpleNamespace(id=5, segment=seg, epoch=1, shared=False), LeaseKind.REPLAY, "x", 0)
    del seg
    assert mappings_of(5) == 1
    lease.release()
    del lease
    assert mappings_of(5) == 0
