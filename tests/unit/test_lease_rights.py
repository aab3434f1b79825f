"""Who may reach a graph pool's lease slot, and what the daemon does about the rest.

A pool's slot lives in a segment the daemon grants only to the pool's owner and to the
sessions that open it. A session that loses its right (it lets go of the arena, or ends)
keeps its mapping: the pool moves to a fresh segment that mapping does not reach, and
the users left follow it. Whatever a user writes naming a session without the right, the
daemon repairs on its next tick, logs and counts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from gpumem_shared import lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import LeaseFlag, LeaseKind, LeaseSegment, LeaseStatus
from gpumem_shared.driver.host import HostDriver
from gpumem_shared.protocol import ErrorCode
from gpumemd.durable import Durable
from gpumemd.image import lease_name
from gpumemd.records import SessionRecord as Session
from gpumemd.state import DaemonState

from .harness import CAPACITY, Clock, GiB, Harness, MiB
from .test_durable import FakeStore
from .test_lease_handoff import opens, owner, register, sharer
from .lease_kit import Pool, follow, give_back, granted, repairs

ARENA = "graphs"


def ws(s: Session) -> int:
    return lease_table.word_session(s.id)


def reaches(h: Harness, s: Session, pool: Pool) -> LeaseSegment:
    """The segment ``s``'s client maps when it reaches for the pool now (it opens it again
    once it finds its own mapping's segment retired)."""
    return granted(h.ok(s, p.OpenGraphPool(pool_id=pool.id)))


def test_a_sharer_that_let_go_of_the_arena_cannot_wedge_the_owner_through_its_old_mapping(h: Harness) -> None:
    """The report's attack: the former sharer writes the owner's own replay word (which a
    repair cannot tell from the owner's) through the mapping it kept."""
    s = owner(h)
    b = sharer(h, s, "draft-b")
    pool = register(h, s, 0, "decode", True)
    kept = reaches(h, b, pool)  # b's own mapping
    h.ok(b, p.ReleaseArena(name=ARENA))
    mine = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    kept._slot.word = mine
    kept._slot.handoff = ws(s) | lease_table.HANDOFF_RECORDING
    kept._slot.escaped = ws(s)
    kept.set_epoch(pool.epoch)  # and makes the owner's old view pass again
    h.state.tick()
    now = reaches(h, s, pool)
    assert (now.peek(), now.handoff(), now.escaped()) == (0, 0, 0), "b's writes reached the pool's slot"
    assert now.try_acquire(mine, pool.epoch, b"owner") == LeaseStatus.OK
    assert give_back(Pool(pool.view, now), mine) == LeaseStatus.OK
    kept._slot.word = mine  # again, after the owner's lease: still nothing
    h.state.tick()
    assert now.peek() == 0 and now.try_acquire(mine, pool.epoch, b"owner") == LeaseStatus.OK
    assert repairs(h, pool) == 0, "nothing reached the pool's slot to repair"
    h.refused(b, p.OpenGraphPool(pool_id=pool.id), ErrorCode.PERMISSION_DENIED)


def test_the_owners_old_mapping_is_retired_at_the_move(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    h.state.close_session(b.id)  # b's process may live on, its mapping with it
    assert pool.segment.epoch() == 0 and pool.segment.peek() == 0
    assert pool.segment.try_acquire(w, pool.epoch, b"x") == LeaseStatus.STALE, "the owner's client follows on this"
    pool.segment._slot.word = lease_table.encode(LeaseKind.CAPTURE, s.id, s.pid)  # b writes a holder there
    started = time.monotonic()
    assert pool.segment.acquire(w, pool.epoch, 5.0)[0] == LeaseStatus.STALE, "a word b wrote kept the owner waiting"
    assert time.monotonic() - started < 2.5
    follow(h, s, pool)
    assert pool.segment.try_acquire(w, pool.epoch, b"x") == LeaseStatus.OK


def test_a_lease_held_at_the_move_is_carried_over_and_given_back_where_it_went(h: Harness) -> None:
    s = owner(h)
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)
    opens(h, c, pool)
    held = lease_table.encode(LeaseKind.BORROW, c.id, c.pid)
    assert pool.segment.acquire(held, pool.epoch, 0, b"c-borrows") == (LeaseStatus.OK, 0)
    h.ok(b, p.ReleaseArena(name=ARENA))
    old = follow(h, s, pool)
    assert pool.segment.peek() == held and pool.segment.holder().label == "c-borrows"  # type: ignore[union-attr]
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert pool.segment.acquire(w, pool.epoch, 0)[0] == LeaseStatus.HELD, "the owner would replay over c's borrow"
    # c's client gives it back on the segment it took it on: not held there (the move
    # emptied it), and retired: it gives it back in the pool's segment, recorded.
    assert old.release(held) == LeaseStatus.NOT_HOLDER and old.epoch() == 0
    assert give_back(pool, held) == LeaseStatus.OK
    assert pool.segment.acquire(w, pool.epoch, 0) == (LeaseStatus.OK_ORDER, 0)
    assert pool.segment.await_record() == (LeaseStatus.OK, ws(c))


@pytest.mark.parametrize("forged", ["the leaver's", "a user's with another pid", "no kind", "a stranger's"])
def test_only_a_word_a_user_could_hold_moves_along(h: Harness, forged: str) -> None:
    s = owner(h)
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    stranger = h.connect("stranger")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)
    opens(h, c, pool)
    word = {
        "the leaver's": lease_table.encode(LeaseKind.REPLAY, b.id, b.pid),
        "a user's with another pid": lease_table.encode(LeaseKind.REPLAY, s.id, s.pid + 1),
        "no kind": lease_table.encode(0, c.id, c.pid),
        "a stranger's": lease_table.encode(LeaseKind.REPLAY, stranger.id, stranger.pid),
    }[forged]
    pool.segment._slot.word = word  # written by b just before it lets go
    h.ok(b, p.ReleaseArena(name=ARENA))
    follow(h, s, pool)
    assert pool.segment.peek() == 0


def test_a_move_carries_the_last_releaser_as_recorded(h: Harness) -> None:
    s = owner(h)
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)
    opens(h, c, pool)
    pool.segment._slot.handoff = ws(c) | lease_table.HANDOFF_RECORDING  # c freed the slot, its record in flight
    landing = threading.Timer(0.002, lambda: setattr(pool.segment._slot, "handoff", ws(c)))
    landing.start()
    h.ok(b, p.ReleaseArena(name=ARENA))
    landing.join(5)
    follow(h, s, pool)
    assert pool.segment.handoff() == ws(c), "the next holder must order after c's event"
    h.ok(c, p.ReleaseArena(name=ARENA))
    follow(h, s, pool)
    assert pool.segment.handoff() == 0, "c's event is no longer anyone's to wait on"


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


def test_a_restart_after_a_move_rebuilds_the_pool_on_the_segment_its_users_follow(make_harness: Callable[..., Harness]) -> None:
    """The store keeps descriptors by name: had the moved pool kept its segment's name, a
    restart would bring back the retired segment, the one the former user still maps."""
    h = make_harness()
    store = FakeStore()
    first = Durable(store)  # type: ignore[arg-type]
    first.start(h.state, {})
    s = owner(h)
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "decode", True)
    kept = reaches(h, b, pool)
    first.persist(h.state)
    h.ok(b, p.ReleaseArena(name=ARENA))
    first.persist(h.state)
    followed = reaches(h, s, pool)
    h.state.arenas.close()  # the daemon dies; the next one rebuilds from the store

    clock, wall = Clock(h.clock.now), Clock(h.wall_clock.now)
    again = Harness(DaemonState(HostDriver(index=0, capacity=CAPACITY), h.config, clock, wall), clock, wall)
    second = Durable(store)  # type: ignore[arg-type]
    second.start(again.state, store.passed())
    rebuilt = again.state.graph_pools.by_id[pool.id].segment
    assert rebuilt.same_memory(followed) and not rebuilt.same_memory(kept)
    kept._slot.word = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)  # b's old mapping reaches nothing still
    again.state.tick()
    assert rebuilt.peek() == 0 and rebuilt.epoch() == pool.epoch
    assert lease_name(pool.id) not in store.held and lease_name(pool.id, 1) in store.held, "the retired segment stays stored"
    for segment in (kept, followed):
        segment.close()
    again.state.drop_all()
    first.close()
    second.close()
    store.drop()
