"""The graph-pool registry: the client's snapshot -> (extents, free runs) reduction, and
DaemonState's REGISTER / UPDATE / RETIRE with every check, plus the lifecycle links
(owner leaving, arena destroyed or released, decommit under a pool, KV arenas)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest

from gpumem.graph_pools import GraphPool, extents_and_runs
from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode
from gpumemd.records import SessionRecord as Session

from .harness import BULK, G, GiB, Harness, MiB

BASE = 0x7F00_0000_0000
KiB = 1 << 10


def E(offset: int, size: int) -> p.Extent:
    return p.Extent(offset=offset, size=size)


def pairs(extents: list[p.Extent]) -> list[tuple[int, int]]:
    return [(e.offset, e.size) for e in extents]


def block(address: int, size: int, state: str) -> dict[str, Any]:
    return {"address": address, "size": size, "state": state}


def segment(address: int, *blocks: tuple[int, str]) -> dict[str, Any]:
    """A segment at ``address`` made of back-to-back blocks (size, state)."""
    out, at = [], address
    for size, state in blocks:
        out.append(block(at, size, state))
        at += size
    return {"address": address, "total_size": at - address, "blocks": out}


# =========================================================================== extents_and_runs


def test_adjacent_inactive_blocks_coalesce_into_one_run() -> None:
    seg = segment(BASE + 2 * MiB, (512 * KiB, "inactive"), (256 * KiB, "inactive"), (256 * KiB, "inactive"), (1 * MiB, "active_allocated"))
    extents, runs = extents_and_runs([seg], BASE)
    assert pairs(extents) == [(2 * MiB, 2 * MiB)]
    assert pairs(runs) == [(2 * MiB, 1 * MiB)]


@pytest.mark.parametrize("live", ["active_allocated", "active_pending_free", "active_awaiting_free"])
def test_a_live_block_splits_runs(live: str) -> None:
    seg = segment(
        BASE,
        (256 * KiB, "inactive"),
        (128 * KiB, live),
        (512 * KiB, "inactive"),
        (128 * KiB, "inactive"),
        (64 * KiB, live),
        (64 * KiB, "inactive"),
    )
    extents, runs = extents_and_runs([seg], BASE)
    assert pairs(extents) == [(0, 1152 * KiB)]
    # largest first, offsets from the base
    assert pairs(runs) == [(384 * KiB, 640 * KiB), (0, 256 * KiB), (1088 * KiB, 64 * KiB)]


def test_runs_are_sorted_largest_first_across_segments_ties_by_offset() -> None:
    a = segment(BASE + 8 * MiB, (1 * MiB, "inactive"), (1 * MiB, "active_allocated"))
    b = segment(BASE + 2 * MiB, (2 * MiB, "active_allocated"), (3 * MiB, "inactive"), (1 * MiB, "inactive"))
    c = segment(BASE + 16 * MiB, (1 * MiB, "active_allocated"), (1 * MiB, "inactive"))
    extents, runs = extents_and_runs([c, a, b], BASE)  # segments in any order
    assert pairs(extents) == [(2 * MiB, 6 * MiB), (8 * MiB, 2 * MiB), (16 * MiB, 2 * MiB)]
    assert pairs(runs) == [(4 * MiB, 4 * MiB), (8 * MiB, 1 * MiB), (17 * MiB, 1 * MiB)]


def test_blocks_in_any_order_and_runs_never_cross_segments() -> None:
    # Two segments back to back, each with an inactive tail / head: two runs, not one.
    a = segment(BASE, (1 * MiB, "active_allocated"), (1 * MiB, "inactive"))
    b = segment(BASE + 2 * MiB, (1 * MiB, "inactive"), (1 * MiB, "active_allocated"))
    a["blocks"].reverse()
    b["blocks"].reverse()
    extents, runs = extents_and_runs([a, b], BASE)
    assert pairs(extents) == [(0, 2 * MiB), (2 * MiB, 2 * MiB)]
    assert pairs(runs) == [(1 * MiB, 1 * MiB), (2 * MiB, 1 * MiB)]


def test_non_adjacent_inactive_blocks_stay_separate_runs() -> None:
    seg = {
        "address": BASE,
        "total_size": 4 * MiB,
        "blocks": [block(BASE, 1 * MiB, "inactive"), block(BASE + 2 * MiB, 1 * MiB, "inactive")],
    }
    assert pairs(extents_and_runs([seg], BASE)[1]) == [(0, 1 * MiB), (2 * MiB, 1 * MiB)]


def test_fully_live_fully_free_and_empty_snapshots() -> None:
    live = segment(BASE, (1 * MiB, "active_allocated"), (1 * MiB, "active_pending_free"))
    free = segment(BASE + 4 * MiB, (1 * MiB, "inactive"), (3 * MiB, "inactive"))
    extents, runs = extents_and_runs([live, free], BASE)
    assert pairs(extents) == [(0, 2 * MiB), (4 * MiB, 4 * MiB)]
    assert pairs(runs) == [(4 * MiB, 4 * MiB)]
    assert extents_and_runs([], BASE) == ([], [])
    assert extents_and_runs([live], BASE) == ([E(0, 2 * MiB)], [])


def test_random_snapshots_runs_are_exactly_the_maximal_inactive_stretches() -> None:
    rng = random.Random(20240611)
    states = ["inactive", "inactive", "active_allocated", "active_pending_free"]
    for _ in range(300):
        segments, at = [], BASE + rng.randrange(0, 64) * G
        for _ in range(rng.randrange(1, 5)):
            blocks = [(rng.choice([512, 4 * KiB, 64 * KiB, 1 * MiB]), rng.choice(states)) for _ in range(rng.randrange(1, 12))]
            seg = segment(at, *blocks)
            rng.shuffle(seg["blocks"])
            segments.append(seg)
            at += seg["total_size"] + rng.choice([0, 0, G])  # sometimes back to back
        rng.shuffle(segments)
        extents, runs = extents_and_runs(segments, BASE)

        assert pairs(extents) == sorted((s["address"] - BASE, s["total_size"]) for s in segments)
        assert [r.size for r in runs] == sorted((r.size for r in runs), reverse=True)
        for i in range(len(runs) - 1):
            if runs[i].size == runs[i + 1].size:
                assert runs[i].offset < runs[i + 1].offset
        free_bytes: set[int] = set()
        for seg in segments:
            for b in seg["blocks"]:
                if b["state"] == "inactive":
                    free_bytes.update(range(b["address"] - BASE, b["address"] - BASE + b["size"], 512))
        covered: set[int] = set()
        for r in runs:
            assert r.size > 0
            # inside one segment
            assert any(s["address"] - BASE <= r.offset and r.offset + r.size <= s["address"] - BASE + s["total_size"] for s in segments)
            # never over a live block (segments that still hold live ones included)
            for seg in segments:
                for b in seg["blocks"]:
                    if b["state"] != "inactive":
                        lo = b["address"] - BASE
                        assert not (r.offset < lo + b["size"] and lo < r.offset + r.size), (r, b)
            span = set(range(r.offset, r.offset + r.size, 512))
            assert not span & covered, "runs overlap"
            covered |= span
        assert covered == free_bytes  # every inactive byte, once
        # maximal: no two runs of one segment touch
        ends = {r.offset + r.size for r in runs}
        for r in runs:
            if r.offset in ends:
                seg_of = [s for s in segments if s["address"] - BASE <= r.offset < s["address"] - BASE + s["total_size"]]
                assert seg_of and seg_of[0]["address"] - BASE == r.offset, f"run {r} should have coalesced with the one before"


# =========================================================================== registry: helpers

ARENA_COMMIT = 2 * BULK  # two bulk chunks: [0, 16 MiB) and [16 MiB, 32 MiB)


def owner_arena(h: Harness, name: str = "graphs", commit: int = ARENA_COMMIT, owner: str = "engine-a") -> Session:
    s = h.connect(owner)
    h.create(s, name, GiB)
    if commit:
        h.commit(s, name, commit)
    return s


def register(
    h: Harness, s: Session, extents: list[p.Extent], runs: list[p.Extent] | None = None, label: str = "decode", arena: str = "graphs"
) -> p.GraphPoolStatus:
    reply = h.ok(s, p.RegisterGraphPool(arena=arena, label=label, extents=extents, free_runs=runs or [])).reply
    assert isinstance(reply, p.GraphPoolReply)
    return reply.pool


def refused_register(
    h: Harness, s: Session | None, code: ErrorCode, extents: list[p.Extent], runs: list[p.Extent] | None = None,
    label: str = "decode", arena: str = "graphs",
) -> p.ProtocolError:
    before = [g.status() for g in h.state.graph_pools.by_id.values()]
    error = h.refused(s, p.RegisterGraphPool(arena=arena, label=label, extents=extents, free_runs=runs or []), code)
    assert [g.status() for g in h.state.graph_pools.by_id.values()] == before, "a refused registration changed the registry"
    return error


def update(h: Harness, s: Session, pool_id: int, extents: list[p.Extent], runs: list[p.Extent], recaptured: bool = False) -> p.GraphPoolStatus:
    return h.ok(s, p.UpdateGraphPool(pool_id=pool_id, extents=extents, free_runs=runs, recaptured=recaptured)).reply.pool


def registry(h: Harness) -> dict[int, p.GraphPoolStatus]:
    return {g.id: g for g in h.state.status().extents}


# =========================================================================== register


def test_register_normalizes_and_shows_in_status(h: Harness) -> None:
    a = owner_arena(h)
    accounted = h.state.arenas.accounted_bytes()
    pool = register(
        h,
        a,
        extents=[E(8 * MiB, 4 * MiB), E(0, 4 * MiB), E(4 * MiB, 2 * MiB)],  # adjacent extents are fine
        runs=[E(1 * MiB, 512 * KiB), E(9 * MiB, 1 * MiB), E(1 * MiB + 512 * KiB, 512 * KiB), E(4 * MiB, 1 * MiB), E(0, 256 * KiB)],
        label="decode-bs8",
    )
    assert pool.id == 1 and pool.owner == "engine-a" and pool.arena == "graphs" and pool.label == "decode-bs8"
    assert pool.epoch == 1
    assert pairs(pool.extents) == [(0, 4 * MiB), (4 * MiB, 2 * MiB), (8 * MiB, 4 * MiB)]  # by offset
    # [1M, 1.5M) + [1.5M, 2M) coalesced; largest first, ties by offset
    assert pairs(pool.free_runs) == [(1 * MiB, 1 * MiB), (4 * MiB, 1 * MiB), (9 * MiB, 1 * MiB), (0, 256 * KiB)]
    assert pool.free_bytes == 3 * MiB + 256 * KiB
    assert h.state.status().extents == [pool]
    assert h.state.arenas.accounted_bytes() == accounted  # the registry commits nothing

    second = register(h, a, [E(16 * MiB, 2 * MiB)], label="prefill")
    assert second.id == 2 and second.free_runs == [] and second.free_bytes == 0
    assert [g.id for g in h.state.status().extents] == [1, 2]


def test_an_extent_may_span_chunks_of_the_arena(h: Harness) -> None:
    a = owner_arena(h)
    assert [c.offset for c in h.state.arenas.by_name["graphs"].chunks] == [0, BULK]
    pool = register(h, a, [E(BULK - 2 * MiB, 4 * MiB)], [E(BULK - 1 * MiB, 2 * MiB)])
    assert pairs(pool.extents) == [(BULK - 2 * MiB, 4 * MiB)]
    # up to the very end of what is committed
    assert register(h, a, [E(ARENA_COMMIT - 2 * MiB, 2 * MiB)], label="tail").id == 2


def test_only_the_owner_registers(h: Harness) -> None:
    a = owner_arena(h)
    h.share(a, "graphs", "engine-b")
    b, stranger = h.connect("engine-b"), h.connect("stranger")
    h.attach(b, "graphs")
    for who in (b, stranger):
        error = refused_register(h, who, ErrorCode.PERMISSION_DENIED, [E(0, 2 * MiB)])
        assert f"client 'engine-a' (pid {a.pid})" in error.message
    refused_register(h, None, ErrorCode.NO_SESSION, [E(0, 2 * MiB)])
    refused_register(h, a, ErrorCode.NOT_FOUND, [E(0, 2 * MiB)], arena="nope")
    assert h.state.graph_pools.by_id == {}
    # refusals consumed no id
    assert register(h, a, [E(0, 2 * MiB)]).id == 1


def test_label_must_be_1_to_256_characters(h: Harness) -> None:
    a = owner_arena(h)
    refused_register(h, a, ErrorCode.INVALID_ARGUMENT, [E(0, 2 * MiB)], label="")
    refused_register(h, a, ErrorCode.INVALID_ARGUMENT, [E(0, 2 * MiB)], label="x" * 257)
    assert register(h, a, [E(0, 2 * MiB)], label="x" * 256).label == "x" * 256


def test_extents_must_lie_in_committed_memory_of_that_arena(h: Harness) -> None:
    a = owner_arena(h)  # 32 MiB committed of 1 GiB
    other = h.connect("engine-other")
    h.create(other, "big", GiB)
    h.commit(other, "big", 4 * BULK)  # 64 MiB committed there: no help for 'graphs'
    bad = [
        [E(ARENA_COMMIT - 2 * MiB, 4 * MiB)],  # runs past the committed end
        [E(ARENA_COMMIT, 2 * MiB)],  # reserved, not committed
        [E(40 * MiB, 2 * MiB)],  # committed in 'big', not here
        [E(2 * GiB, 2 * MiB)],  # beyond the reservation
        [E(0, 2 * MiB), E(48 * MiB, 2 * MiB)],  # one good, one bad
    ]
    for extents in bad:
        error = refused_register(h, a, ErrorCode.INVALID_ARGUMENT, extents)
        assert "not committed memory of arena 'graphs'" in error.message, error.message
    for extents in ([], [E(-2 * MiB, 2 * MiB)], [E(0, 0)], [E(4 * MiB, -1)]):
        refused_register(h, a, ErrorCode.INVALID_ARGUMENT, extents)
    # an arena with nothing committed holds no pool
    empty = h.connect("engine-empty")
    h.create(empty, "empty", GiB)
    refused_register(h, empty, ErrorCode.INVALID_ARGUMENT, [E(0, 2 * MiB)], arena="empty")
    assert h.state.graph_pools.by_id == {}


def test_extents_must_not_overlap_each_other(h: Harness) -> None:
    a = owner_arena(h)
    error = refused_register(h, a, ErrorCode.INVALID_ARGUMENT, [E(0, 4 * MiB), E(2 * MiB, 4 * MiB)])
    assert "overlap" in error.message
    refused_register(h, a, ErrorCode.INVALID_ARGUMENT, [E(4 * MiB, 2 * MiB), E(4 * MiB, 2 * MiB)])


def test_extents_must_not_overlap_another_pool_of_the_arena(h: Harness) -> None:
    a = owner_arena(h)
    first = register(h, a, [E(4 * MiB, 4 * MiB)], label="decode")
    for extents in ([E(6 * MiB, 4 * MiB)], [E(0, 5 * MiB)], [E(5 * MiB, 1 * MiB)], [E(0, 1 * MiB), E(7 * MiB, 2 * MiB)]):
        error = refused_register(h, a, ErrorCode.ALREADY_EXISTS, extents, label="prefill")
        assert f"graph pool {first.id} ('decode')" in error.message, error.message
    # touching is not overlapping
    assert register(h, a, [E(0, 4 * MiB), E(8 * MiB, 2 * MiB)], label="prefill").id == 2
    # the same offsets in another arena belong to nobody
    b = owner_arena(h, name="other-graphs", owner="engine-b")
    assert register(h, b, [E(4 * MiB, 4 * MiB)], arena="other-graphs").arena == "other-graphs"
    assert sorted(registry(h)) == [1, 2, 3]


def test_free_runs_must_lie_inside_the_extents_and_not_overlap(h: Harness) -> None:
    a = owner_arena(h)
    extents = [E(0, 4 * MiB), E(8 * MiB, 4 * MiB)]
    for runs in (
        [E(4 * MiB, 1 * MiB)],  # in the gap between the extents
        [E(3 * MiB, 2 * MiB)],  # half out
        [E(12 * MiB, 1 * MiB)],  # past the last extent
        [E(20 * MiB, 1 * MiB)],  # committed, but no part of the pool
        [E(1 * MiB, 0)],  # empty
        [E(2 * MiB, -1 * MiB)],  # negative
    ):
        error = refused_register(h, a, ErrorCode.INVALID_ARGUMENT, extents, runs)
        assert "outside the pool's extents" in error.message, (runs, error.message)
    for runs in ([E(0, 2 * MiB), E(1 * MiB, 2 * MiB)], [E(8 * MiB, 1 * MiB), E(8 * MiB, 1 * MiB)]):
        error = refused_register(h, a, ErrorCode.INVALID_ARGUMENT, extents, runs)
        assert "overlap" in error.message
    assert h.state.graph_pools.by_id == {}


def test_thousands_of_extents_and_runs_are_checked_in_near_linear_time(h: Harness) -> None:
    """A request may carry as many extents and runs as the protocol allows. Checked pairwise
    they held the daemon's only thread for a second at this count, and for seconds at the
    20,000 a frame has room for (found by the protocol fuzzer); each is now a bisection. The
    same count again, in another pool of the arena, meets the first pool's extents
    everywhere."""
    a = owner_arena(h)
    n = p.MAX_POOL_EXTENTS
    extents = [E(i * 4096, 2048) for i in range(n)]  # 16 MiB of the 32 committed, none adjacent
    runs = [E(i * 4096 + 512, 1024) for i in range(n)]
    started = time.process_time()
    first = register(h, a, extents, runs, label="many")
    refused_register(h, a, ErrorCode.ALREADY_EXISTS, [E(i * 4096 + 1024, 2048) for i in range(n)], label="overlapping")
    for _ in range(4):
        h.ok(a, p.UpdateGraphPool(pool_id=first.id, extents=extents[::-1], free_runs=runs[::-1]))
    took = time.process_time() - started
    assert len(first.extents) == len(first.free_runs) == n
    assert took < 0.5, f"six requests of {n} extents took {took:.2f}s of CPU"


def test_runs_across_adjacent_extents_coalesce_and_the_reply_round_trips(h: Harness) -> None:
    """Two segments back to back: a run ending at the first's end and one starting at the
    second's are coalesced into one; what the daemon replies must be acceptable again."""
    a = owner_arena(h)
    pool = register(h, a, [E(0, 4 * MiB), E(4 * MiB, 4 * MiB)], [E(3 * MiB, 1 * MiB), E(4 * MiB, 2 * MiB)])
    assert pairs(pool.free_runs) == [(3 * MiB, 3 * MiB)]
    again = update(h, a, pool.id, pool.extents, pool.free_runs)
    assert pairs(again.free_runs) == [(3 * MiB, 3 * MiB)] and again.epoch == 1
    # and sent as one run in the first place
    second = register(h, a, [E(8 * MiB, 2 * MiB), E(10 * MiB, 2 * MiB)], [E(9 * MiB, 2 * MiB)], label="b")
    assert pairs(second.free_runs) == [(9 * MiB, 2 * MiB)]


# =========================================================================== update / retire


def test_update_replaces_extents_and_runs_and_a_change_or_recapture_bumps_the_epoch(h: Harness) -> None:
    a = owner_arena(h)
    pool = register(h, a, [E(0, 4 * MiB)], [E(0, 1 * MiB)])
    assert update(h, a, pool.id, [E(0, 4 * MiB)], [E(0, 1 * MiB)]).epoch == 1, "nothing changed: same epoch"
    out = update(h, a, pool.id, [E(2 * MiB, 6 * MiB)], [E(4 * MiB, 512 * KiB), E(6 * MiB, 2 * MiB)])
    assert out.id == pool.id and out.epoch == 2 and out.label == "decode", "new runs: a borrower's old view is stale"
    assert pairs(out.extents) == [(2 * MiB, 6 * MiB)]
    assert pairs(out.free_runs) == [(6 * MiB, 2 * MiB), (4 * MiB, 512 * KiB)]
    assert out.free_bytes == 2 * MiB + 512 * KiB
    assert registry(h) == {pool.id: out}

    out = update(h, a, pool.id, [E(2 * MiB, 6 * MiB)], [], recaptured=True)
    assert out.epoch == 3 and out.free_runs == [] and out.free_bytes == 0
    assert update(h, a, pool.id, [E(2 * MiB, 6 * MiB)], [], recaptured=True).epoch == 4, "a recapture bumps it anyway"
    assert update(h, a, pool.id, [E(2 * MiB, 6 * MiB)], [E(2 * MiB, 2 * MiB)]).epoch == 5
    assert registry(h)[pool.id].epoch == 5 and pairs(registry(h)[pool.id].free_runs) == [(2 * MiB, 2 * MiB)]


def test_update_is_checked_like_register_and_a_refusal_changes_nothing(h: Harness) -> None:
    a = owner_arena(h)
    mine = register(h, a, [E(0, 4 * MiB)], [E(0, 1 * MiB)], label="decode")
    theirs = register(h, a, [E(8 * MiB, 4 * MiB)], label="prefill")
    before = registry(h)
    cases = [
        ([E(6 * MiB, 4 * MiB)], [], ErrorCode.ALREADY_EXISTS, f"graph pool {theirs.id} ('prefill')"),
        ([E(ARENA_COMMIT, 2 * MiB)], [], ErrorCode.INVALID_ARGUMENT, "not committed"),
        ([E(0, 4 * MiB)], [E(4 * MiB, 1 * MiB)], ErrorCode.INVALID_ARGUMENT, "outside"),
        ([], [], ErrorCode.INVALID_ARGUMENT, "at least one extent"),
    ]
    for extents, runs, code, needle in cases:
        error = h.refused(a, p.UpdateGraphPool(pool_id=mine.id, extents=extents, free_runs=runs, recaptured=True), code)
        assert needle in error.message, error.message
    assert registry(h) == before  # epoch not bumped, nothing replaced
    # overlapping its own previous extents is fine
    assert pairs(update(h, a, mine.id, [E(2 * MiB, 4 * MiB)], []).extents) == [(2 * MiB, 4 * MiB)]


def test_update_and_retire_are_for_the_owner_and_a_known_pool(h: Harness) -> None:
    a = owner_arena(h)
    h.share(a, "graphs", "engine-b")
    b = h.connect("engine-b")
    h.attach(b, "graphs")
    pool = register(h, a, [E(0, 4 * MiB)])
    before = registry(h)
    for who in (b, h.connect("stranger")):
        error = h.refused(who, p.UpdateGraphPool(pool_id=pool.id, extents=[E(0, 2 * MiB)], free_runs=[], recaptured=True), ErrorCode.PERMISSION_DENIED)
        assert "client 'engine-a'" in error.message and "'decode'" in error.message
        h.refused(who, p.RetireGraphPool(pool_id=pool.id), ErrorCode.PERMISSION_DENIED)
    h.refused(None, p.RetireGraphPool(pool_id=pool.id), ErrorCode.NO_SESSION)
    assert registry(h) == before
    for unknown in (0, 2, 999, -1):
        h.refused(a, p.UpdateGraphPool(pool_id=unknown, extents=[E(0, 2 * MiB)], free_runs=[]), ErrorCode.NOT_FOUND)
        h.refused(a, p.RetireGraphPool(pool_id=unknown), ErrorCode.NOT_FOUND)

    assert isinstance(h.ok(a, p.RetireGraphPool(pool_id=pool.id)).reply, p.Ack)
    assert h.state.status().extents == []
    h.refused(a, p.RetireGraphPool(pool_id=pool.id), ErrorCode.NOT_FOUND)
    h.refused(a, p.UpdateGraphPool(pool_id=pool.id, extents=[E(0, 2 * MiB)], free_runs=[]), ErrorCode.NOT_FOUND)


def test_retire_frees_the_extents_for_another_pool_and_leaves_the_others(h: Harness) -> None:
    a = owner_arena(h)
    first = register(h, a, [E(0, 4 * MiB)], label="one")
    second = register(h, a, [E(4 * MiB, 4 * MiB)], label="two")
    refused_register(h, a, ErrorCode.ALREADY_EXISTS, [E(2 * MiB, 2 * MiB)], label="three")
    h.ok(a, p.RetireGraphPool(pool_id=first.id))
    assert list(registry(h)) == [second.id] and registry(h)[second.id] == second
    third = register(h, a, [E(2 * MiB, 2 * MiB)], label="three")
    assert third.id == 3  # ids are not reused


# =========================================================================== lifecycle


def test_the_owner_leaving_drops_its_pools_only(h: Harness) -> None:
    a = owner_arena(h)
    b = owner_arena(h, name="b-graphs", owner="engine-b")
    h.share(a, "graphs", "engine-b")
    h.attach(b, "graphs")  # 'graphs' outlives its owner: b is attached
    register(h, a, [E(0, 4 * MiB)], label="a1")
    register(h, a, [E(4 * MiB, 4 * MiB)], label="a2")
    kept = register(h, b, [E(0, 4 * MiB)], label="b1", arena="b-graphs")
    h.state.close_session(a.id)
    assert "graphs" in h.state.arenas.by_name  # the arena lives on, its pools do not
    assert registry(h) == {kept.id: kept}
    h.refused(b, p.RetireGraphPool(pool_id=1), ErrorCode.NOT_FOUND)
    h.state.close_session(b.id)
    assert h.state.graph_pools.by_id == {} and h.state.status().extents == []


def test_destroying_the_arena_drops_its_pools(h: Harness) -> None:
    a = owner_arena(h)
    h.create(a, "second", GiB)
    h.commit(a, "second", BULK)
    register(h, a, [E(0, 4 * MiB)], label="in-graphs")
    kept = register(h, a, [E(0, 4 * MiB)], label="in-second", arena="second")
    h.release(a, "graphs")
    assert "graphs" not in h.state.arenas.by_name
    assert registry(h) == {kept.id: kept}
    h.refused(a, p.UpdateGraphPool(pool_id=1, extents=[E(0, 2 * MiB)], free_runs=[]), ErrorCode.NOT_FOUND)
    # a new arena of the same name starts with an empty registry
    h.create(a, "graphs", GiB)
    h.commit(a, "graphs", BULK)
    assert register(h, a, [E(0, 4 * MiB)], label="again").id == 3
    assert sorted(g.label for g in h.state.status().extents) == ["again", "in-second"]


def test_dropping_every_arena_at_exit_empties_the_registry(h: Harness) -> None:
    a = owner_arena(h)
    register(h, a, [E(0, 4 * MiB)])
    h.state.drop_all()
    assert h.state.arenas.by_name == {} and h.state.graph_pools.by_id == {} and h.state.status().extents == []


def test_the_owner_releasing_a_shared_arena_drops_its_pools(h: Harness) -> None:
    """The arena lives on for its sharers, but its memory is retired: a pool there would
    describe memory that is gone."""
    a = owner_arena(h)
    h.share(a, "graphs", "engine-b")
    b = h.connect("engine-b")
    h.attach(b, "graphs")
    pool = register(h, a, [E(0, 4 * MiB)])
    h.release(a, "graphs")
    assert "graphs" in h.state.arenas.by_name and h.state.arenas.by_name["graphs"].chunks == []
    assert h.state.status().extents == []
    h.refused(a, p.RetireGraphPool(pool_id=pool.id), ErrorCode.NOT_FOUND)
    h.release(b, "graphs")


def test_decommit_under_a_registered_pool_is_refused_until_it_retires(h: Harness) -> None:
    a = owner_arena(h)  # chunks [0, 16M) and [16M, 32M)
    pool = register(h, a, [E(20 * MiB, 2 * MiB)], label="decode")
    chunks = [c.id for c in h.state.arenas.by_name["graphs"].chunks]
    for to in (BULK, 8 * MiB, 0):
        error = h.refused(a, p.DecommitArena(name="graphs", to_nbytes=to), ErrorCode.INVALID_ARGUMENT)
        assert f"graph pool {pool.id} ('decode')" in error.message, error.message
    assert [c.id for c in h.state.arenas.by_name["graphs"].chunks] == chunks
    assert h.state.arenas.by_name["graphs"].committed == ARENA_COMMIT and h.state.arenas.retiring == {}
    # a decommit that keeps the pool's chunk (chunks go whole) retires nothing and is allowed
    assert h.decommit(a, "graphs", 20 * MiB).reply.arena.committed == ARENA_COMMIT
    # growing is fine
    h.commit(a, "graphs", 3 * BULK)
    h.ok(a, p.RetireGraphPool(pool_id=pool.id))
    out = h.decommit(a, "graphs", BULK)
    assert out.reply.arena.committed == BULK


def test_decommit_beyond_every_pool_is_allowed(h: Harness) -> None:
    a = owner_arena(h)
    pool = register(h, a, [E(BULK - 2 * MiB, 2 * MiB)])  # ends exactly at the first chunk's end
    assert h.decommit(a, "graphs", BULK).reply.arena.committed == BULK
    # a decommit to inside the first chunk keeps that chunk whole: still allowed
    assert h.decommit(a, "graphs", 4 * MiB).reply.arena.committed == BULK
    assert registry(h) == {pool.id: pool}
    h.refused(a, p.DecommitArena(name="graphs", to_nbytes=0), ErrorCode.INVALID_ARGUMENT)


def test_a_kv_pool_arena_holds_no_graph_pool(h: Harness) -> None:
    """KV memory comes and goes through rounds, grow and shrink (no decommit check there):
    a graph pool in it could lose its memory under it."""
    a = h.connect("engine-a")
    h.ok(a, p.KvDeclare(name="kv", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=8192))
    h.ok(a, p.KvGrow(pool="kv", tokens=8192))
    assert h.state.arenas.by_name["kv"].committed == 32 * MiB
    error = refused_register(h, a, ErrorCode.INVALID_ARGUMENT, [E(0, 4 * MiB)], arena="kv")
    assert "KV pool" in error.message


def test_stopping_refuses_new_registrations(h: Harness) -> None:
    a = owner_arena(h)
    pool = register(h, a, [E(0, 4 * MiB)])
    h.state.begin_stop()
    refused_register(h, a, ErrorCode.SHUTTING_DOWN, [E(4 * MiB, 2 * MiB)])
    assert registry(h) == {pool.id: pool}


# =========================================================================== the client's GraphPool


class _FakeTorchPool:
    def __init__(self) -> None:
        self.snapshot: list[dict[str, Any]] = []

    def segments(self) -> list[dict[str, Any]]:
        return self.snapshot


class _FakeChannel:
    """core.channel.call: the reply and the descriptors the daemon grants with it, as
    the fd channel passes them (copies: the daemon keeps its own)."""

    def __init__(self, h: Harness, s: Session) -> None:
        self._h, self._s = h, s

    def call(self, message: Any) -> tuple[Any, dict[int, int]]:
        outcome = self._h.ok(self._s, message)
        return outcome.reply, {pool_id: os.dup(fd) for pool_id, fd in outcome.grants}


class _FakeArena:
    """What GraphPool uses of gpumem.Arena: name, address, torch_pool(), and of the
    session's core: call, channel, backend, borrow_pools."""

    def __init__(self, h: Harness, s: Session, name: str) -> None:
        self.name = name
        self.address = h.state.arenas.by_name[name].address
        self.pool = _FakeTorchPool()
        self.core = self
        self.channel = _FakeChannel(h, s)
        self.backend = "host"
        self.is_owner = True
        self.borrow_pools: dict[int, Any] = {}
        self._h, self._s = h, s

    def torch_pool(self) -> _FakeTorchPool:
        return self.pool

    def call(self, message: Any) -> Any:
        return self._h.ok(self._s, message).reply


def test_client_graph_pool_registers_refreshes_and_retires_from_snapshots(h: Harness) -> None:
    a = owner_arena(h)
    arena = _FakeArena(h, a, "graphs")
    base = arena.address
    arena.pool.snapshot = [
        segment(base + 2 * MiB, (1 * MiB, "active_allocated"), (1 * MiB, "inactive")),
        segment(base, (512 * KiB, "inactive"), (512 * KiB, "inactive"), (1 * MiB, "active_allocated")),
    ]
    pool = GraphPool.register(arena, "decode")  # type: ignore[arg-type]
    assert (pool.id, pool.label, pool.epoch, pool.free_bytes) == (1, "decode", 1, 2 * MiB)
    assert pairs(pool.extents) == [(0, 2 * MiB), (2 * MiB, 2 * MiB)]
    assert pairs(pool.free_runs) == [(0, 1 * MiB), (3 * MiB, 1 * MiB)]
    assert registry(h)[1].free_runs == pool.free_runs

    arena.pool.snapshot[1]["blocks"][0]["state"] = "active_allocated"
    pool.refresh()
    assert pool.epoch == 2 and pairs(pool.free_runs) == [(3 * MiB, 1 * MiB), (512 * KiB, 512 * KiB)]
    pool.refresh()
    assert pool.epoch == 2, "the same runs: the same epoch"
    arena.pool.snapshot.append(segment(base + 8 * MiB, (2 * MiB, "inactive")))
    pool.refresh(recaptured=True)
    assert pool.epoch == 3 and pairs(pool.extents)[-1] == (8 * MiB, 2 * MiB)
    assert pairs(pool.free_runs) == [(8 * MiB, 2 * MiB), (3 * MiB, 1 * MiB), (512 * KiB, 512 * KiB)]
    assert registry(h)[1].epoch == 3 and registry(h)[1].free_bytes == pool.free_bytes == 2 * MiB + 1 * MiB + 512 * KiB
    assert "epoch 3" in repr(pool)
    pool.retire()
    assert h.state.graph_pools.by_id == {}
