"""Leases on shared graph pools: the IPC-event handoff (RECORD, release_recorded,
OK_ORDER), escape marks, and the daemon's side of both: the slot's flags, opening another
client's pool, publishing and looking up IPC event handles, and what a session's end,
a pool's drop and a tick do to the fields that name sessions.

Threads stand in for other processes (the native calls drop the GIL); every wait is
bounded."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
from gpumem_shared import lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import KIND_NAMES, LeaseFlag, LeaseKind, LeaseStatus, LeaseTable
from gpumem_shared.protocol import ErrorCode
from gpumemd.records import SessionRecord as Session

from .harness import BULK, GiB, Harness, MiB
from .test_lease_table import Waiter, wait_until_sleeping

SLOT = 9
EPOCH = lease_table.lease_epoch(3, 1)
ARENA = "graphs"
# An IPC event handle is opaque to the daemon; the driver's are 64 bytes.
HANDLE = bytes(range(64))


@pytest.fixture
def table() -> Iterator[LeaseTable]:
    t, fd = LeaseTable.create()
    t.set_epoch(SLOT, EPOCH)
    yield t
    t.close()
    os.close(fd)


@pytest.fixture
def shared(table: LeaseTable) -> LeaseTable:
    """The table with SLOT flagged as a shared pool's, as the daemon registers one."""
    table.set_flags(SLOT, LeaseFlag.SHARED)
    return table


def word(kind: int = LeaseKind.REPLAY, session: int = 1, pid: int = 1001) -> int:
    return lease_table.encode(kind, session, pid)


def word_session(session_id: int) -> int:
    """A session id as lease words, handoff and escaped carry it (24 bits)."""
    return lease_table.decode(lease_table.encode(0, session_id, 0))[1]


Take = Callable[[LeaseTable, int], int]

# The three ways a client takes a free slot; each must report the handoff the same way.
TAKES: dict[str, Take] = {
    "try": lambda t, w: t.try_acquire(SLOT, w, EPOCH, b"taker"),
    "acquire": lambda t, w: t.acquire(SLOT, w, EPOCH, 0)[0],
    "acquire-wait": lambda t, w: t.acquire(SLOT, w, EPOCH, 1.0)[0],
}


def handed_over(t: LeaseTable, held: int) -> None:
    """``held`` gives the slot back the way a shared pool's holder must."""
    assert t.release(SLOT, held) == LeaseStatus.RECORD
    assert t.release_recorded(SLOT, held) == LeaseStatus.OK


# =========================================================================== the handoff


def test_a_shared_release_frees_nothing_until_the_event_is_recorded(shared: LeaseTable) -> None:
    held = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    futex = shared._slots[SLOT].futex
    assert shared.release(SLOT, held) == LeaseStatus.RECORD
    # Freed here, a taker from another process could run on the pool before the
    # releaser's GPU work is done.
    assert shared.peek(SLOT) == held and shared.handoff(SLOT) == 0
    assert shared._slots[SLOT].futex == futex, "nothing was released: nobody is woken"
    assert shared.try_acquire(SLOT, word(LeaseKind.REPLAY, session=2), EPOCH, b"x") == LeaseStatus.HELD
    assert shared.release_recorded(SLOT, held) == LeaseStatus.OK
    assert shared.peek(SLOT) == 0 and shared.handoff(SLOT) == 1
    assert shared._slots[SLOT].futex == futex + 1


@pytest.mark.parametrize("take", TAKES.values(), ids=TAKES.keys())
def test_a_taker_of_another_session_orders_after_the_recorded_release(shared: LeaseTable, take: Take) -> None:
    first = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(SLOT, first, EPOCH, 0) == (LeaseStatus.OK, 0), "no release recorded yet: nothing to order after"
    handed_over(shared, first)
    other = word(LeaseKind.REPLAY, session=2, pid=2002)
    assert take(shared, other) == LeaseStatus.OK_ORDER
    assert shared.peek(SLOT) == other, "OK_ORDER is a taken lease"
    handed_over(shared, other)
    assert shared.handoff(SLOT) == 2
    assert take(shared, word(LeaseKind.BORROW, session=1)) == LeaseStatus.OK_ORDER, "the first releaser now orders after the second"
    assert shared.release_recorded(SLOT, word(LeaseKind.BORROW, session=1)) == LeaseStatus.OK


@pytest.mark.parametrize("take", TAKES.values(), ids=TAKES.keys())
@pytest.mark.parametrize("kind", list(LeaseKind), ids=KIND_NAMES.get)
def test_a_taker_of_the_same_session_needs_no_ordering(shared: LeaseTable, take: Take, kind: int) -> None:
    """Within one process stream order suffices: another pid or kind of the same session
    takes with plain OK."""
    first = word(LeaseKind.REPLAY, session=1, pid=1001)
    assert shared.acquire(SLOT, first, EPOCH, 0) == (LeaseStatus.OK, 0)
    handed_over(shared, first)
    again = word(kind, session=1, pid=1002)
    assert take(shared, again) == LeaseStatus.OK
    assert shared.peek(SLOT) == again


def test_a_sleeping_waiter_wakes_on_the_recorded_release_only(shared: LeaseTable) -> None:
    held, mine = word(LeaseKind.CAPTURE, session=1), word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(shared, SLOT, mine, EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(shared, SLOT)
    assert shared.release(SLOT, held) == LeaseStatus.RECORD
    time.sleep(0.05)
    assert waiter.is_alive(), "a release that freed nothing woke the waiter"
    assert shared.release_recorded(SLOT, held) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.OK_ORDER
    assert waiter.elapsed < 5.0 and shared.peek(SLOT) == mine


def test_without_the_flag_release_frees_at_once_and_leaves_handoff_alone(shared: LeaseTable) -> None:
    first = word(LeaseKind.REPLAY, session=1)
    assert shared.acquire(SLOT, first, EPOCH, 0) == (LeaseStatus.OK, 0)
    handed_over(shared, first)
    shared.set_flags(SLOT, 0)  # the pool is private now: handoff 1 is a leftover
    other = word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(SLOT, other, EPOCH, 0) == (LeaseStatus.OK, 0), "a private pool never asks for ordering"
    assert shared.release(SLOT, other) == LeaseStatus.OK
    assert shared.peek(SLOT) == 0 and shared.handoff(SLOT) == 1


def test_releasing_a_word_that_does_not_hold_the_slot_is_not_holder(shared: LeaseTable) -> None:
    held, stranger = word(LeaseKind.REPLAY, session=1), word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(SLOT, held, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert shared.release(SLOT, stranger) == LeaseStatus.NOT_HOLDER
    assert shared.release_recorded(SLOT, stranger) == LeaseStatus.NOT_HOLDER
    assert shared.release_recorded(SLOT, word(LeaseKind.CAPTURE, session=1)) == LeaseStatus.NOT_HOLDER  # the holder's session, another kind
    assert shared.peek(SLOT) == held
    assert shared.handoff(SLOT) == 0, "a refused release named itself as the one to order after"
    handed_over(shared, held)
    assert shared.release(SLOT, held) == LeaseStatus.NOT_HOLDER
    assert shared.release_recorded(SLOT, stranger) == LeaseStatus.NOT_HOLDER  # of a free slot
    assert shared.handoff(SLOT) == 1


def test_clear_frees_a_shared_slot_and_keeps_the_handoff(shared: LeaseTable) -> None:
    first = word(LeaseKind.REPLAY, session=1)
    assert shared.acquire(SLOT, first, EPOCH, 0) == (LeaseStatus.OK, 0)
    handed_over(shared, first)
    other = word(LeaseKind.BORROW, session=2, pid=2002)
    assert shared.acquire(SLOT, other, EPOCH, 0) == (LeaseStatus.OK_ORDER, 0)
    assert shared.clear(SLOT, first) == LeaseStatus.NOT_HOLDER
    assert shared.clear(SLOT, other) == LeaseStatus.OK
    # Session 2 recorded nothing: the next taker must still order after session 1.
    assert shared.peek(SLOT) == 0 and shared.handoff(SLOT) == 1
    assert shared.acquire(SLOT, word(LeaseKind.REPLAY, session=3), EPOCH, 0) == (LeaseStatus.OK_ORDER, 0)


# =========================================================================== escape marks


@pytest.mark.parametrize("kind", [LeaseKind.REPLAY, LeaseKind.CAPTURE], ids=KIND_NAMES.get)
def test_an_escape_mark_refuses_replay_and_capture_at_once(table: LeaseTable, kind: int) -> None:
    table.set_escaped(SLOT, 5)
    assert table.escaped(SLOT) == 5
    for session in (5, 6):  # the marker's own replay would overwrite its tensors too
        mine = word(kind, session=session)
        assert table.try_acquire(SLOT, mine, EPOCH, b"x") == LeaseStatus.ESCAPED
        assert table.acquire(SLOT, mine, EPOCH, 0) == (LeaseStatus.ESCAPED, 0)
        start = time.monotonic()
        assert table.acquire(SLOT, mine, EPOCH, 2.0) == (LeaseStatus.ESCAPED, 0)
        assert time.monotonic() - start < 0.5, "a mark only its owner clears is answered, not waited on"
    assert table.peek(SLOT) == 0


@pytest.mark.parametrize("take", TAKES.values(), ids=TAKES.keys())
def test_borrowers_still_take_an_escaped_slot(table: LeaseTable, take: Take) -> None:
    table.set_escaped(SLOT, 5)
    borrower = word(LeaseKind.BORROW, session=6)
    assert take(table, borrower) == LeaseStatus.OK
    assert table.peek(SLOT) == borrower
    assert table.release(SLOT, borrower) == LeaseStatus.OK


def test_the_escape_mark_keeps_24_bits_and_clears_to_nobody(table: LeaseTable) -> None:
    table.set_escaped(SLOT, (1 << 24) + 6)
    assert table.escaped(SLOT) == 6
    assert table.try_acquire(SLOT, word(LeaseKind.REPLAY, session=6), EPOCH, b"x") == LeaseStatus.ESCAPED
    table.set_escaped(SLOT, 0)
    assert table.try_acquire(SLOT, word(LeaseKind.REPLAY, session=6), EPOCH, b"x") == LeaseStatus.OK
    assert table.release(SLOT, word(LeaseKind.REPLAY, session=6)) == LeaseStatus.OK


def test_forget_handoff_clears_only_the_session_it_names(shared: LeaseTable) -> None:
    first = word(LeaseKind.REPLAY, session=1)
    assert shared.acquire(SLOT, first, EPOCH, 0) == (LeaseStatus.OK, 0)
    handed_over(shared, first)
    shared.forget_handoff(SLOT, 3)
    assert shared.handoff(SLOT) == 1
    shared.forget_handoff(SLOT, 1)
    assert shared.handoff(SLOT) == 0
    assert shared.acquire(SLOT, word(LeaseKind.REPLAY, session=5), EPOCH, 0) == (LeaseStatus.OK, 0), "no order once forgotten"


# =========================================================================== the daemon: flags and drops


def owner(h: Harness, name: str = "engine", arena: str = ARENA) -> Session:
    s = h.connect(name)
    h.create(s, arena, GiB)
    h.commit(s, arena, 2 * BULK)
    return s


def register(h: Harness, s: Session, offset: int, label: str, shared: bool, arena: str = ARENA) -> p.GraphPoolStatus:
    m = p.RegisterGraphPool(arena=arena, label=label, extents=[p.Extent(offset=offset, size=4 * MiB)], free_runs=[], shared=shared)
    return h.ok(s, m).reply.pool


def sharer(h: Harness, s: Session, name: str) -> Session:
    """A client that ``s`` shares its arena with, attached."""
    h.share(s, ARENA, name)
    other = h.connect(name)
    h.attach(other, ARENA)
    return other


def hand_over(h: Harness, pool: p.GraphPoolStatus, s: Session) -> None:
    """``s`` takes the pool's lease and gives it back with its event recorded, as its client would."""
    t = h.state.graph_pools.table
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert t.acquire(pool.slot, w, lease_table.lease_epoch(pool.id, pool.epoch), 0)[0] in (LeaseStatus.OK, LeaseStatus.OK_ORDER)
    assert t.release(pool.slot, w) == LeaseStatus.RECORD
    assert t.release_recorded(pool.slot, w) == LeaseStatus.OK


def fields(h: Harness, pool: p.GraphPoolStatus) -> tuple[int, int, int]:
    t = h.state.graph_pools.table
    return t.flags(pool.slot), t.handoff(pool.slot), t.escaped(pool.slot)


def test_registration_writes_the_shared_flag_and_status_shows_it(h: Harness) -> None:
    s = owner(h)
    shared, private = register(h, s, 0, "shared", True), register(h, s, 4 * MiB, "private", False)
    assert (shared.shared, private.shared) == (True, False)
    t = h.state.graph_pools.table
    assert (t.flags(shared.slot), t.flags(private.slot)) == (LeaseFlag.SHARED, 0)
    assert {g.label: g.shared for g in h.state.status().extents} == {"shared": True, "private": False}
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert t.acquire(shared.slot, w, lease_table.lease_epoch(shared.id, 1), 0) == (LeaseStatus.OK, 0)
    assert t.release(shared.slot, w) == LeaseStatus.RECORD
    assert t.acquire(private.slot, w, lease_table.lease_epoch(private.id, 1), 0) == (LeaseStatus.OK, 0)
    assert t.release(private.slot, w) == LeaseStatus.OK, "a private pool's lease is released without an event"


def test_status_names_the_client_whose_escape_mark_blocks_replays(h: Harness) -> None:
    s = owner(h)
    h.state._next_session = (1 << 24) + 5  # the mark holds 24 bits of the id
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "p", True)
    t = h.state.graph_pools.table

    def escaped_by() -> str:
        return {g.id: g.escaped_by for g in h.state.status().extents}[pool.id]

    assert escaped_by() == ""
    h.ok(b, p.ReportEscape(pool_id=pool.id, escaped=True))
    assert escaped_by() == "client 'b'" and t.escaped(pool.slot) == word_session(b.id)
    h.ok(s, p.ReportEscape(pool_id=pool.id, escaped=True))  # the owner's own borrows escape too
    assert escaped_by() == "client 'engine', client 'b'"
    h.ok(b, p.ReportEscape(pool_id=pool.id, escaped=False))
    assert escaped_by() == "client 'engine'" and t.escaped(pool.slot) == word_session(s.id), "the other escaper still blocks"
    h.ok(s, p.ReportEscape(pool_id=pool.id, escaped=False))
    assert escaped_by() == "" and t.escaped(pool.slot) == 0


def test_new_free_runs_move_the_slot_epoch_and_keep_the_handoff(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "p", True)
    hand_over(h, pool, b)
    runs = [p.Extent(offset=0, size=1 * MiB)]
    moved = h.ok(s, p.UpdateGraphPool(pool_id=pool.id, extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=runs)).reply.pool
    assert moved.epoch == 2 and moved.shared
    t = h.state.graph_pools.table
    assert t.epoch(pool.slot) == lease_table.lease_epoch(pool.id, 2)
    # b's GPU work may still be running on the pool whatever its runs are now.
    assert fields(h, pool) == (LeaseFlag.SHARED, word_session(b.id), 0)
    w = lease_table.encode(LeaseKind.BORROW, s.id, s.pid)
    assert t.acquire(pool.slot, w, lease_table.lease_epoch(pool.id, 1), 0)[0] == LeaseStatus.STALE, "a borrower's view of the old runs"
    assert t.acquire(pool.slot, w, lease_table.lease_epoch(pool.id, 2), 0) == (LeaseStatus.OK_ORDER, 0)


def drop_pool(h: Harness, s: Session, pool: p.GraphPoolStatus, how: str) -> None:
    if how == "retire":
        h.ok(s, p.RetireGraphPool(pool_id=pool.id))
    elif how == "arena released":
        h.release(s, ARENA)
    else:
        h.state.close_session(s.id)


@pytest.mark.parametrize("how", ["retire", "arena released", "owner left"])
def test_dropping_a_pool_resets_its_slot_for_the_next_pool(h: Harness, how: str) -> None:
    s = owner(h)
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    elsewhere = owner(h, "elsewhere", arena="spare")
    pool = register(h, s, 0, "p", True)
    hand_over(h, pool, b)
    h.ok(c, p.ReportEscape(pool_id=pool.id, escaped=True))
    assert fields(h, pool) == (LeaseFlag.SHARED, word_session(b.id), word_session(c.id))
    drop_pool(h, s, pool, how)
    assert pool.id not in h.state.graph_pools.by_id
    assert fields(h, pool) == (0, 0, 0) and h.state.graph_pools.table.epoch(pool.slot) == 0
    # Leftovers would make the slot's next pool refuse replays, or order them after a
    # client that never used it.
    again = register(h, elsewhere, 0, "again", True, arena="spare")
    assert again.slot == pool.slot
    w = lease_table.encode(LeaseKind.REPLAY, elsewhere.id, elsewhere.pid)
    assert h.state.graph_pools.table.acquire(again.slot, w, lease_table.lease_epoch(again.id, 1), 0) == (LeaseStatus.OK, 0)


# =========================================================================== the daemon: opening another client's pool


def test_open_by_id_and_by_owner_and_label(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    register(h, s, 0, "prefill", True)
    pool = register(h, s, 4 * MiB, "decode", True)
    assert h.ok(b, p.OpenGraphPool(pool_id=pool.id)).reply.pool == pool
    assert h.ok(b, p.OpenGraphPool(owner="engine", label="decode")).reply.pool == pool
    h.refused(b, p.OpenGraphPool(pool_id=pool.id + 100), ErrorCode.NOT_FOUND)
    h.refused(b, p.OpenGraphPool(owner="engine", label="nope"), ErrorCode.NOT_FOUND)
    h.refused(b, p.OpenGraphPool(owner="b", label="decode"), ErrorCode.NOT_FOUND)
    h.ok(s, p.RetireGraphPool(pool_id=pool.id))
    h.refused(b, p.OpenGraphPool(pool_id=pool.id), ErrorCode.NOT_FOUND)
    h.refused(b, p.OpenGraphPool(owner="engine", label="decode"), ErrorCode.NOT_FOUND)


def test_open_refuses_a_private_pool_and_a_client_that_has_not_attached(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    private, shared = register(h, s, 0, "private", False), register(h, s, 4 * MiB, "shared", True)
    error = h.refused(b, p.OpenGraphPool(pool_id=private.id), ErrorCode.PERMISSION_DENIED)
    assert "shared=True" in error.message
    h.refused(b, p.OpenGraphPool(owner="engine", label="private"), ErrorCode.PERMISSION_DENIED)
    c = h.connect("c")
    h.refused(c, p.OpenGraphPool(pool_id=shared.id), ErrorCode.PERMISSION_DENIED)  # not even shared with it
    h.share(s, ARENA, "c")
    error = h.refused(c, p.OpenGraphPool(pool_id=shared.id), ErrorCode.PERMISSION_DENIED)  # shared, not attached
    assert "attach" in error.message
    h.attach(c, ARENA)
    assert h.ok(c, p.OpenGraphPool(pool_id=shared.id)).reply.pool == shared
    # Its owner opens its own pool, private or not.
    assert h.ok(s, p.OpenGraphPool(pool_id=private.id)).reply.pool == private
    assert h.ok(s, p.OpenGraphPool(owner="engine", label="private")).reply.pool == private


# =========================================================================== the daemon: IPC event handles


def lookup(h: Harness, s: Session, pool: p.GraphPoolStatus, of: Session) -> bytes:
    return h.ok(s, p.LookupLeaseEvent(pool_id=pool.id, session=word_session(of.id))).reply.handle


def test_publish_is_for_shared_pools_and_handles_of_1_to_256_bytes(h: Harness) -> None:
    s = owner(h)
    private, shared = register(h, s, 0, "private", False), register(h, s, 4 * MiB, "shared", True)
    h.refused(s, p.PublishLeaseEvent(pool_id=private.id, handle=HANDLE), ErrorCode.INVALID_ARGUMENT)
    h.refused(s, p.PublishLeaseEvent(pool_id=shared.id, handle=b""), ErrorCode.INVALID_ARGUMENT)
    h.refused(s, p.PublishLeaseEvent(pool_id=shared.id, handle=bytes(257)), ErrorCode.INVALID_ARGUMENT)
    h.refused(s, p.PublishLeaseEvent(pool_id=shared.id + 100, handle=HANDLE), ErrorCode.NOT_FOUND)
    h.refused(s, p.LookupLeaseEvent(pool_id=shared.id, session=word_session(s.id)), ErrorCode.NOT_FOUND)
    h.refused(s, p.LookupLeaseEvent(pool_id=private.id, session=word_session(s.id)), ErrorCode.NOT_FOUND)
    for handle in (b"\x01", bytes(256)):  # both bounds
        h.ok(s, p.PublishLeaseEvent(pool_id=shared.id, handle=handle))
        assert lookup(h, s, shared, s) == handle, "a new handle replaces the session's old one"


def test_publish_and_lookup_need_the_arena_attached(h: Harness) -> None:
    s = owner(h)
    pool = register(h, s, 0, "shared", True)
    private = register(h, s, 4 * MiB, "private", False)
    h.ok(s, p.PublishLeaseEvent(pool_id=pool.id, handle=HANDLE))
    h.share(s, ARENA, "b")
    b = h.connect("b")
    h.refused(b, p.PublishLeaseEvent(pool_id=pool.id, handle=HANDLE), ErrorCode.PERMISSION_DENIED)
    h.refused(b, p.PublishLeaseEvent(pool_id=private.id, handle=HANDLE), ErrorCode.PERMISSION_DENIED)  # before "not shared"
    h.refused(b, p.LookupLeaseEvent(pool_id=pool.id, session=word_session(s.id)), ErrorCode.PERMISSION_DENIED)
    h.attach(b, ARENA)
    h.refused(b, p.LookupLeaseEvent(pool_id=pool.id, session=word_session(b.id)), ErrorCode.NOT_FOUND)
    h.ok(b, p.PublishLeaseEvent(pool_id=pool.id, handle=HANDLE))
    assert lookup(h, s, pool, b) == HANDLE


def test_lookup_finds_each_sessions_handle_by_its_word_session_until_it_closes(h: Harness) -> None:
    s = owner(h)
    # Ids beyond 24 bits: a lookup names the session as the slot's handoff does.
    h.state._next_session = (1 << 24) + 5
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    assert b.id > 0xFFFFFF and word_session(b.id) != b.id
    pool, other = register(h, s, 0, "shared", True), register(h, s, 4 * MiB, "other", True)
    h.ok(b, p.PublishLeaseEvent(pool_id=pool.id, handle=b"b" * 64))
    h.ok(c, p.PublishLeaseEvent(pool_id=pool.id, handle=b"c" * 64))
    h.ok(b, p.PublishLeaseEvent(pool_id=other.id, handle=b"B" * 64))
    hand_over(h, pool, b)
    # What a taker does on OK_ORDER: look up the handle of the session the slot names.
    assert h.ok(c, p.LookupLeaseEvent(pool_id=pool.id, session=h.state.graph_pools.table.handoff(pool.slot))).reply.handle == b"b" * 64
    assert (lookup(h, c, pool, c), lookup(h, c, other, b)) == (b"c" * 64, b"B" * 64)
    h.refused(c, p.LookupLeaseEvent(pool_id=other.id, session=word_session(c.id)), ErrorCode.NOT_FOUND)
    h.state.close_session(b.id)
    for gone in (pool, other):
        h.refused(c, p.LookupLeaseEvent(pool_id=gone.id, session=word_session(b.id)), ErrorCode.NOT_FOUND)
    assert lookup(h, s, pool, c) == b"c" * 64, "another session's handle outlives b"


# =========================================================================== the daemon: session ends and ticks


def test_close_session_forgets_the_fields_naming_it(h: Harness) -> None:
    s = owner(h)
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    one, two = register(h, s, 0, "one", True), register(h, s, 4 * MiB, "two", True)
    t = h.state.graph_pools.table
    hand_over(h, one, b)
    h.ok(c, p.ReportEscape(pool_id=one.id, escaped=True))
    hand_over(h, two, c)
    h.ok(b, p.ReportEscape(pool_id=two.id, escaped=True))
    h.state.close_session(b.id)
    assert fields(h, one) == (LeaseFlag.SHARED, 0, word_session(c.id))
    assert fields(h, two) == (LeaseFlag.SHARED, word_session(c.id), 0)
    # b's event died with it: nobody is told to wait on it, and its mark guards nothing.
    borrow, replay = lease_table.encode(LeaseKind.BORROW, s.id, s.pid), lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert t.acquire(one.slot, borrow, lease_table.lease_epoch(one.id, 1), 0) == (LeaseStatus.OK, 0)
    assert t.clear(one.slot, borrow) == LeaseStatus.OK
    assert t.acquire(two.slot, replay, lease_table.lease_epoch(two.id, 1), 0) == (LeaseStatus.OK_ORDER, 0)  # after c, which lives
    assert t.release_recorded(two.slot, replay) == LeaseStatus.OK
    h.state.close_session(c.id)
    assert fields(h, one) == (LeaseFlag.SHARED, 0, 0)
    assert fields(h, two) == (LeaseFlag.SHARED, word_session(s.id), 0)
    assert t.acquire(one.slot, replay, lease_table.lease_epoch(one.id, 1), 0) == (LeaseStatus.OK, 0)


def test_tick_repairs_flags_and_fields_naming_no_session(h: Harness) -> None:
    s = owner(h)
    h.state._next_session = (1 << 24) + 5  # live sessions are compared as the fields hold them
    b = sharer(h, s, "b")
    shared, private = register(h, s, 0, "shared", True), register(h, s, 4 * MiB, "private", False)
    t = h.state.graph_pools.table
    dead = word_session(b.id) + 1  # no session has it
    # What a buggy client may scribble: the daemon's flags, sessions that never were.
    t.set_flags(shared.slot, 0)
    t.set_flags(private.slot, LeaseFlag.SHARED | 0x80)
    h.ok(b, p.ReportEscape(pool_id=shared.id, escaped=True))
    slots = t._slots
    slots[shared.slot].handoff = dead
    slots[private.slot].handoff, slots[private.slot].escaped = word_session(b.id), word_session(b.id)
    h.state.tick()
    assert fields(h, shared) == (LeaseFlag.SHARED, 0, word_session(b.id)), "a reported escape stays"
    assert fields(h, private) == (0, word_session(b.id), 0), "a live session's handoff stays; an unreported mark goes"
    slots[shared.slot].escaped = 0  # a client erasing a mark the daemon holds
    h.state.tick()
    assert fields(h, shared) == (LeaseFlag.SHARED, 0, word_session(b.id)), "the daemon's set of escapers is the truth"
    h.state.tick()  # idempotent
    assert fields(h, private) == (0, word_session(b.id), 0)


def test_a_session_never_gets_the_lease_session_that_means_nobody(h: Harness) -> None:
    # 0 in a slot's handoff or escape field means nobody: a session whose id wraps to 0
    # in 24 bits would get neither ordering nor escape marks.
    h.state._next_session = 1 << 24
    s = h.connect("wraps")
    assert word_session(s.id) != 0


def test_open_by_owner_and_label_refuses_an_ambiguous_match(h: Harness) -> None:
    s = owner(h)
    h.ok(s, p.CreateArena(name="twin", reserve_bytes=GiB))  # one owner, one label, two arenas
    h.ok(s, p.CommitArena(name="twin", nbytes=8 * MiB))
    register(h, s, 0, "decode", True)
    h.ok(s, p.RegisterGraphPool(arena="twin", label="decode", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[], shared=True))
    h.refused(s, p.OpenGraphPool(owner=s.name, label="decode"), ErrorCode.INVALID_ARGUMENT)


def test_a_sharer_letting_go_of_the_arena_takes_its_escape_and_event_along(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "p", True)
    stranger = h.connect("stranger")
    h.refused(stranger, p.ReportEscape(pool_id=pool.id, escaped=True), ErrorCode.PERMISSION_DENIED)
    h.refused(b, p.ReportEscape(pool_id=pool.id + 100, escaped=True), ErrorCode.NOT_FOUND)
    h.ok(b, p.PublishLeaseEvent(pool_id=pool.id, handle=HANDLE))
    hand_over(h, pool, b)
    h.ok(b, p.ReportEscape(pool_id=pool.id, escaped=True))
    assert fields(h, pool) == (LeaseFlag.SHARED, word_session(b.id), word_session(b.id))
    h.ok(b, p.ReleaseArena(name=ARENA))
    # It can no longer report its tensors gone (its mapping is), so the mark goes with it.
    assert fields(h, pool) == (LeaseFlag.SHARED, 0, 0)
    h.refused(s, p.LookupLeaseEvent(pool_id=pool.id, session=word_session(b.id)), ErrorCode.NOT_FOUND)
