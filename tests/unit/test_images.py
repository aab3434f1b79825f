"""Each book's part of the durable record, round-tripped over every dataclass field: a
state whose records all hold something other than their defaults is written out and
rebuilt in a new DaemonState from what the store passes, and every field of every record
of the book is compared, enumerated with dataclasses.fields(). A field someone leaves
out of an image (or a new field nobody taught the test to set) fails here, where the
status projections that test_durable compares would not show it."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.driver.host import HostDriver
from gpumemd.durable import Durable
from gpumemd.records import GroupRecord
from gpumemd.records import (
    Answer,
    ArenaRecord,
    ChunkRecord,
    GrantRecord,
    GraphPoolRecord,
    KvBufferLayout,
    KvPoolRecord,
    MemberRecord,
    RoundRecord,
    SessionRecord,
    SleepRecord,
)
from gpumemd.sleepers import HostBufferRecord
from gpumemd.state import DaemonState

from .harness import CAPACITY, Clock, Harness, MiB
from .store_kit import FakeStore

# Fields the record does not keep as they are, each with the reason; the test checks
# what each becomes instead (``test_what_is_not_kept_as_is_comes_back_as_it_should``).
NOT_KEPT: dict[tuple[type, str], str] = {
    (ChunkRecord, "handle"): "the driver's handle dies with the process: the chunk is adopted again from its stored fd",
    (SessionRecord, "waiting"): "every rebuilt session waits for its client to resume",
    (SessionRecord, "resending"): "what the client sends again comes with its RESUME, after the restart",
    (GraphPoolRecord, "segment"): "a mapping of this process: the segment is mapped again from its stored memfd",
    (GraphPoolRecord, "segment_fd"): "a descriptor of this process: the store passes the segment's memfd anew",
    (RoundRecord, "created"): "monotonic clocks do not survive a restart: kept as seconds since",
    (RoundRecord, "deadline"): "monotonic clocks do not survive a restart: kept as seconds left",
    (HostBufferRecord, "fd"): "a descriptor of this process: the store passes the buffer's memfd anew",
    (GroupRecord, "deadline"): "monotonic clocks do not survive a restart: kept as seconds left",
}

# Every record class the durable record holds; the walk must reach each one.
KEPT_CLASSES = {
    SessionRecord, Answer, ArenaRecord, ChunkRecord, GrantRecord, GraphPoolRecord, KvPoolRecord, KvBufferLayout, MemberRecord, RoundRecord,
    HostBufferRecord, SleepRecord, GroupRecord,
}

BOOKS: dict[str, Callable[[DaemonState], list[Any]]] = {
    "sessions": lambda s: sorted(s.sessions.values(), key=lambda x: x.id),
    "arenas": lambda s: sorted(s.arenas.by_name.values(), key=lambda a: a.name) + sorted(s.arenas.retiring.values(), key=lambda c: c.id),
    "graph_pools": lambda s: sorted(s.graph_pools.by_id.values(), key=lambda g: g.id),
    "kv": lambda s: sorted(s.kv.pools.values(), key=lambda k: k.name) + list(s.kv.rounds),
    "sleepers": lambda s: sorted(s.sleepers.buffers.values(), key=lambda b: b.id),
    "retained": lambda s: sorted(s.retained.groups.values(), key=lambda g: g.name),
}


@dataclasses.dataclass
class Restart:
    before: DaemonState
    after: DaemonState


def populated(h: Harness) -> None:
    """Every field of some record of each kind away from its default."""
    st = h.state
    owner, peer = h.connect("owner"), h.connect("peer")
    h.create(owner, "a", 256 * MiB)
    h.commit(owner, "a", 40 * MiB)
    h.ok(owner, p.PlaceholderArena(name="a", slot_bytes=4 * MiB))
    h.ok(owner, p.ShareArena(name="a", client="peer", gid=1000))
    h.attach(peer, "a")
    h.create(owner, "b", 256 * MiB)
    h.commit(owner, "b", 16 * MiB)
    h.ok(owner, p.ShareArena(name="b", client="peer"))
    h.attach(peer, "b")
    h.decommit(owner, "b", 0)  # the peer still maps them: retiring
    pool_id = h.ok(owner, p.RegisterGraphPool(arena="a", label="g", extents=[p.Extent(offset=0, size=8 * MiB)],
                                              free_runs=[p.Extent(offset=0, size=2 * MiB)], shared=True)).reply.pool.id
    h.ok(peer, p.OpenGraphPool(pool_id=pool_id))
    h.ok(owner, p.PublishLeaseEvent(pool_id=pool_id, handle=b"\x01" * 64))
    h.ok(peer, p.ReportEscape(pool_id=pool_id, escaped=True))
    h.ok(owner, p.UpdateGraphPool(pool_id=pool_id, extents=[p.Extent(offset=0, size=8 * MiB)], free_runs=[]))
    for name in ("kv", "kv2"):
        h.ok(owner, p.KvDeclare(name=name, buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    h.create(owner, "c", 256 * MiB)
    h.commit(owner, "c", 8 * MiB)
    h.ok(owner, p.SleepBuffer(arena="c", nbytes=8 * MiB))
    asleep = h.ok(owner, p.SleepArena(name="c", kept_bytes=8 * MiB)).reply
    h.ok(owner, p.ChunksUnmapped(name="c", chunk_ids=[c.id for c in asleep.retired]))
    h.ok(owner, p.RoundJoin(pool="kv", expect=2))
    h.state.handle(owner, p.CaptureDone(pool="kv", headroom_bytes=MiB, graph_pool_bytes=MiB, min_tokens=512, max_tokens=2048, weight=2.0), 77)
    # What no request here sets, or sets only in a state a restart rarely meets.
    arena = st.arenas.by_name["a"]
    arena.owner_alive, arena.released = False, True
    owner.tenant_key = b"\x07" * 32  # a tenant token's digest: test_memory_caps_tokens.py presents real ones
    arena.chunks[0].fresh = False
    arena.grants[0].uid_implied = True
    arena.grants[0].read_only = True
    arena.readers.add(peer.id)
    st.graph_pools.by_id[pool_id].lease_repairs = 3
    st.graph_pools.by_id[pool_id].segment_moves = 2  # its segment is stored as lease-<id>.2
    kv = st.kv.pools["kv"]
    kv.tokens, kv.min_tokens, kv.shrink_request = 1024, 256, 512
    kv.top_tokens, kv.weight, kv.in_use = 1536, 3.0, 700
    round_ = st.kv.rounds[-1]
    round_.state, round_.dropped, round_.error = p.RoundState.AWAITING_SHRINK, ["x/y: gone"], "an error"
    round_.budget = p.RoundBudget(free=1, staged=2, reserve=3, headroom=4, graph_pools=5, budget=6, minimums=7, committed=8)
    member = round_.members[0]
    member.tokens, member.bytes = 100, 200
    h.ok(owner, p.RetainGroup(group="grp"))
    h.ok(owner, p.Retain(group="grp", name="kv2"))
    group = st.retained.groups[owner.uid, "grp"]
    group.previous, group.previous_pid, group.previous_since = "the one before", 77, 1.5
    group.deadline, group.adopting = h.clock.now + 30, True
    group.previous_ended, group.writers = h.clock.now - 2, [("client 'sharer' (pid 78, session 9)", 78, 1.25, h.clock.now - 1)]
    buffer = st.sleepers.buffers["c"]
    owner.remember(5, b"a reply", arena.chunks[:2], [(pool_id, st.graph_pools.by_id[pool_id].segment_fd)], [(buffer.id, buffer.fd)])


@pytest.fixture
def restart(make_harness: Callable[..., Harness]) -> Iterator[Restart]:
    h = make_harness()
    store = FakeStore()
    first = Durable(store)  # type: ignore[arg-type]
    first.start(h.state, {})
    populated(h)
    first.persist(h.state)
    h.state.arenas.close()  # the slice goes, as with the daemon's death; the next state takes it
    clock, wall = Clock(h.clock.now), Clock(h.wall_clock.now)
    again = DaemonState(HostDriver(index=0, capacity=CAPACITY), h.config, clock, wall)
    second = Durable(store)  # type: ignore[arg-type]
    second.start(again, store.passed())
    yield Restart(h.state, again)
    again.drop_all()
    first.close()
    second.close()
    store.drop()


def walk(value: Any, seen: dict[tuple[type, str], bool]) -> None:
    """Notes, per record field, whether some record holds other than its default."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            got = getattr(value, field.name)
            if field.default is not dataclasses.MISSING:
                default: Any = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                default = dataclasses.MISSING
            seen[(type(value), field.name)] = seen.get((type(value), field.name), False) or got != default
            walk(got, seen)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            walk(item, seen)
    elif isinstance(value, dict):
        for item in value.values():
            walk(item, seen)


def same(before: Any, after: Any, where: str) -> None:
    if dataclasses.is_dataclass(before) and not isinstance(before, type):
        assert type(after) is type(before), f"{where}: a {type(before).__name__} came back as {type(after).__name__}"
        for field in dataclasses.fields(before):
            if (type(before), field.name) not in NOT_KEPT:
                same(getattr(before, field.name), getattr(after, field.name), f"{where}.{field.name}")
    elif isinstance(before, (list, tuple)):
        assert len(after) == len(before), f"{where}: {len(before)} items, {len(after)} after the restart"
        for i, (b, a) in enumerate(zip(before, after)):
            same(b, a, f"{where}[{i}]")
    elif isinstance(before, dict):
        assert after.keys() == before.keys(), f"{where}: keys {sorted(before)} became {sorted(after)}"
        for key in before:
            same(before[key], after[key], f"{where}[{key!r}]")
    else:
        assert after == before, f"{where}: {before!r} came back as {after!r}"


@pytest.mark.parametrize("book", sorted(BOOKS))
def test_every_field_of_the_book_comes_back(restart: Restart, book: str) -> None:
    records = BOOKS[book]
    before, after = records(restart.before), records(restart.after)
    assert before, f"the {book} book holds nothing to compare"
    same(before, after, book)


def test_every_kept_field_was_away_from_its_default(restart: Restart) -> None:
    """Else a field left out of an image would come back as its default unnoticed."""
    seen: dict[tuple[type, str], bool] = {}
    for records in BOOKS.values():
        walk(records(restart.before), seen)
    assert {cls for cls, _ in seen} == KEPT_CLASSES
    left = sorted(f"{cls.__name__}.{name}" for (cls, name), moved in seen.items() if not moved and (cls, name) not in NOT_KEPT)
    assert not left, f"set these in populated(): {left}"


def test_what_is_not_kept_as_is_comes_back_as_it_should(restart: Restart) -> None:
    before, after = restart.before, restart.after
    assert all(s.waiting and not s.resending for s in after.sessions.values())
    assert all(c.handle is not None for a in after.arenas.by_name.values() for c in a.chunks + a.placeholders)
    assert all(c.handle is None for c in after.arenas.retiring.values())
    for pool_id, pool in after.graph_pools.by_id.items():
        old = before.graph_pools.by_id[pool_id]
        assert os.fstat(pool.segment_fd).st_ino == os.fstat(old.segment_fd).st_ino, "not the stored segment"
        assert pool.segment.escaped() == old.segment.escaped() != 0, "not the stored segment's slot"
    for arena, buffer in after.sleepers.buffers.items():
        assert os.fstat(buffer.fd).st_ino == os.fstat(before.sleepers.buffers[arena].fd).st_ino, "not the stored buffer"
    now_before, now_after = before.clock(), after.clock()
    for old_round, new_round in zip(before.kv.rounds, after.kv.rounds):
        assert now_after - new_round.created == pytest.approx(now_before - old_round.created)
        assert new_round.deadline - now_after == pytest.approx(old_round.deadline - now_before)
    for name, group in after.retained.groups.items():
        old_deadline = before.retained.groups[name].deadline
        assert group.deadline is not None and old_deadline is not None
        assert group.deadline - now_after == pytest.approx(old_deadline - now_before)
