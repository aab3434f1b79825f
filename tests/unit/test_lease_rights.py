"""Who may reach a graph pool's lease slot, and what the daemon does about the rest.

A pool's slot lives in a segment the daemon grants only to the pool's owner and to the
sessions that open it. A session that loses its right (it lets go of the arena) keeps
its mapping: whatever it writes there afterwards, and whatever any user writes naming a
session without the right, the daemon repairs on its next tick, logs and counts."""

from __future__ import annotations

import logging

import pytest

from gpumem_shared import lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import LeaseFlag, LeaseKind, LeaseStatus
from gpumem_shared.protocol import ErrorCode
from gpumemd.records import SessionRecord as Session

from .harness import GiB, Harness, MiB
from .test_lease_handoff import opens, owner, register, sharer
from .test_lease_table import give_back, repairs

ARENA = "graphs"


def ws(s: Session) -> int:
    return lease_table.word_session(s.id)


def test_a_sharer_that_let_go_of_the_arena_and_scribbles_is_repaired_within_a_tick_and_reported(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    s = owner(h)
    b = sharer(h, s, "draft-b")
    pool = register(h, s, 0, "decode", True)
    opens(h, b, pool)
    h.ok(b, p.ReleaseArena(name=ARENA))
    # b still maps the segment (a hostile client keeps its mapping) and writes itself in.
    mine = lease_table.encode(LeaseKind.BORROW, b.id, b.pid)
    pool.segment._slot.word = mine
    pool.segment._slot.handoff = ws(b)
    pool.segment._slot.escaped = ws(b)
    assert pool.segment.acquire(lease_table.encode(LeaseKind.REPLAY, s.id, s.pid), pool.epoch, 0) == (LeaseStatus.HELD, mine)
    with caplog.at_level(logging.WARNING, logger="gpumemd.graph_pools"):
        h.state.tick()
    assert (pool.segment.peek(), pool.segment.handoff(), pool.segment.escaped()) == (0, 0, 0)
    assert repairs(h, pool) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    for field, line in zip(("escape mark", "handoff", "lease word"), lines):
        assert f"graph pool {pool.id} ('decode')" in line and f"its lease slot's {field} held" in line, line
        assert f"session {ws(b)}, client 'draft-b' (pid {b.pid}), which may not use the pool" in line, line
    # The owner takes its pool again at once: nothing b wrote holds it off.
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert pool.segment.acquire(w, pool.epoch, 0)[0] in (LeaseStatus.OK, LeaseStatus.OK_ORDER)
    assert give_back(pool, w) == LeaseStatus.OK
    h.state.tick()
    assert repairs(h, pool) == 3, "nothing more to repair"
    shown = p.to_wire(h.state.status())["graph_pools"]
    assert [g["lease_repairs"] for g in shown] == [3]


def test_a_user_cannot_name_a_session_without_the_right_to_the_pool(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    s = owner(h)
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)  # c attached the arena but never opened the pool
    stranger = h.connect("stranger")
    for victim in (c, stranger):
        pool.segment._slot.word = lease_table.encode(LeaseKind.CAPTURE, victim.id, victim.pid)  # b forges a holder
        pool.segment._slot.handoff = ws(victim)  # and a releaser to wait on
        with caplog.at_level(logging.WARNING, logger="gpumemd.graph_pools"):
            h.state.tick()
        assert (pool.segment.peek(), pool.segment.handoff()) == (0, 0)
        assert f"client '{h.state.sessions[victim.id].name}' (pid {victim.pid}), which may not use the pool" in caplog.text
    assert repairs(h, pool) == 4
    # A user naming another user is indistinguishable from the real thing: it stays.
    forged = lease_table.encode(LeaseKind.REPLAY, s.id, 4242)
    pool.segment._slot.word = forged
    h.state.tick()
    assert pool.segment.peek() == forged and repairs(h, pool) == 4


def test_the_daemons_fields_are_restored_and_counted(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)
    stale = lease_table.lease_epoch(pool.id, 7)
    pool.segment.set_epoch(stale)  # a user making its stale view pass again, or everyone's fail
    pool.segment.set_flags(0)  # skipping the IPC event at release
    h.state.tick()
    assert pool.segment.epoch() == pool.epoch and pool.segment.flags() == LeaseFlag.SHARED
    assert repairs(h, pool) == 2


def test_a_private_pool_in_a_shared_arena_is_granted_to_its_owner_only(h: Harness) -> None:
    s = owner(h)
    h.share(s, ARENA, "b")
    b = h.connect("b")
    attached = h.attach(b, ARENA)
    assert attached.grants == []
    registered = h.ok(s, p.RegisterGraphPool(arena=ARENA, label="private", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[]))
    [(pool_id, fd)] = registered.grants  # the owner's, with its reply
    assert h.sync(b, ARENA).grants == []
    for message in (p.OpenGraphPool(pool_id=pool_id), p.OpenGraphPool(owner="engine", label="private")):
        h.refused(b, message, ErrorCode.PERMISSION_DENIED)
    for message in (
        p.PublishLeaseEvent(pool_id=pool_id, handle=b"x"),
        p.LookupLeaseEvent(pool_id=pool_id, session=ws(s)),
        p.ReportEscape(pool_id=pool_id, escaped=True),
    ):
        h.refused(b, message, ErrorCode.PERMISSION_DENIED)
    assert h.state.graph_pools.by_id[pool_id].users == {s.id}
    # A word of b's in the private pool (only its owner could have written it) goes.
    record = h.state.graph_pools.by_id[pool_id]
    record.segment._slot.word = lease_table.encode(LeaseKind.REPLAY, b.id, b.pid)
    h.state.tick()
    assert record.segment.peek() == 0 and record.lease_repairs == 1


def test_every_open_grants_the_segment_and_a_second_arena_needs_its_own_open(h: Harness) -> None:
    s = owner(h)
    h.ok(s, p.CreateArena(name="other", reserve_bytes=GiB))
    h.ok(s, p.CommitArena(name="other", nbytes=8 * MiB))
    b = sharer(h, s, "b")
    h.share(s, "other", "b")
    h.attach(b, "other")
    here = register(h, s, 0, "here", True)
    there = h.ok(s, p.RegisterGraphPool(arena="other", label="there", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[], shared=True))
    there_id = there.reply.pool.id
    first, again = h.ok(b, p.OpenGraphPool(pool_id=here.id)), h.ok(b, p.OpenGraphPool(pool_id=here.id))
    assert [g for g, _ in first.grants] == [g for g, _ in again.grants] == [here.id], "each open grants the pool's segment, and only it"
    assert h.state.graph_pools.by_id[there_id].users == {s.id}, "opening one pool grants no other"
    h.ok(b, p.ReleaseArena(name="other"))
    h.refused(b, p.OpenGraphPool(pool_id=there_id), ErrorCode.PERMISSION_DENIED)
    assert h.state.graph_pools.by_id[here.id].users == {s.id, b.id}, "letting go of one arena leaves the other's pools"
