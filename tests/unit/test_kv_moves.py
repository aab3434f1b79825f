"""Runtime KV moves in DaemonState: the daemon's capacity cap, and grows that do not fit
answered from what other pools give back (fair share, minimums, idle first, deadlines,
liars and the dead), on the real host driver with a fake clock."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode

from gpumemd.metrics import Metrics
from gpumemd.records import SessionRecord as Session

from .harness import Harness, MiB
from .test_metrics import histogram, number
from .test_kv_rounds import capture, commit_reply, declare, done, join

# --------------------------------------------------------------------------- the capacity cap


def test_capacity_caps_what_a_round_measures_and_every_commit(make_harness: Callable[..., Harness]) -> None:
    # The host device has 256 MiB; the daemon may commit 64 MiB. 16 MiB go to a plain arena,
    # so the round measures 48 MiB free: 48 MiB / 4 KiB rows = 12288 tokens.
    h = make_harness(capacity_bytes=64 * MiB)
    a, other = h.connect("engine-a"), h.connect("other")
    h.create(other, "plain", 64 * MiB)
    h.commit(other, "plain", 16 * MiB)
    declare(h, a, "kv", rows=(4096,), max_tokens=65536)
    join(h, a, "kv")
    capture(h, a, "kv", 1)
    reply = commit_reply(done(h)[1])
    assert (reply.budget.free, reply.budget.committed, reply.pool.tokens) == (48 * MiB, 48 * MiB, 12288)
    assert h.state.arenas.accounted_bytes() == 64 * MiB
    assert h.state.status().device.free_bytes == 0
    refused = h.refused(other, p.CommitArena(name="plain", nbytes=18 * MiB), ErrorCode.OUT_OF_MEMORY)
    assert refused.detail["available"] == 0


# --------------------------------------------------------------------------- runtime moves
# Rows of 4 KiB: 256 tokens a MiB, a 16 MiB chunk holds 4096. The device has 256 MiB.


def two_pools(h: Harness, min_b: int = 1024) -> tuple[Session, Session]:
    """engine-a/kva and engine-b/kvb, one round, equal weights: with the default minimums
    128 MiB (32768 tokens) each, the device full."""
    a, b = h.connect("engine-a"), h.connect("engine-b")
    declare(h, a, "kva")
    declare(h, b, "kvb")
    join(h, a, "kva")
    join(h, b, "kvb")
    capture(h, a, "kva", 1, min_tokens=1024)
    capture(h, b, "kvb", 2, min_tokens=min_b)
    tokens = {rid: commit_reply(c).pool.tokens for rid, c in done(h).items()}
    # Minimums first, the rest split evenly: 110 MiB each above b's 32 MiB minimum.
    assert tokens == {1024: {1: 32768, 2: 32768}, 8192: {1: 29184, 2: 36352}}.get(min_b, tokens)
    assert h.state.arenas.available_bytes() == 0
    return a, b


def grow_waits(h: Harness, s: Session, pool: str, tokens: int, request_id: int) -> None:
    outcome = h.state.handle(s, p.KvGrow(pool=pool, tokens=tokens), request_id)
    assert outcome.reply is None and outcome.handout == []


def shrink_notices(h: Harness) -> list[tuple[int, str, int]]:
    return [(sid, n.arena, n.tokens) for sid, n in h.state.take_notices() if n.kind is p.NoticeKind.KV_SHRINK]


def give_back(h: Harness, s: Session, pool: str, tokens: int) -> None:
    """The owner confirms the shrink and unmaps what it retires."""
    reply = h.ok(s, p.KvShrink(pool=pool, tokens=tokens)).reply
    assert isinstance(reply, p.KvCommitReply) and reply.pool.tokens == tokens
    h.unmapped(s, pool, [c.id for c in reply.retired])


def test_a_grow_that_does_not_fit_is_answered_once_the_idle_neighbour_gives_back(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    # a wants 192 MiB. b is idle: its share is its 4 MiB minimum, so it holds 124 MiB
    # above it; 64 MiB are asked: a shrink to 16384 tokens.
    grow_waits(h, a, "kva", 49152, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 16384)]
    h.clock.now += 1.0
    h.state.tick()
    assert done(h) == {}, "answered before the memory is free and before the deadline"
    reply = h.ok(b, p.KvShrink(pool="kvb", tokens=16384)).reply
    assert done(h) == {}, "the retired chunks are still mapped in b"
    h.unmapped(b, "kvb", [c.id for c in reply.retired])
    got = commit_reply(done(h)[7])
    assert (got.pool.tokens, got.asked_tokens, got.unanswered) == (49152, 49152, [])
    assert sum(c.size for c in got.chunks) == 64 * MiB
    assert h.state.arenas.accounted_bytes() == 256 * MiB
    t = h.state.tally
    assert (t.kv_grows_deferred, t.kv_shrinks_asked, t.kv_shrinks_confirmed, t.kv_grows_satisfied, t.kv_moved_bytes) == (1, 1, 1, 1, 64 * MiB)
    assert t.kv_move_seconds.count == 1 and t.kv_move_seconds.sum == 1.0
    status = {k.name: k for k in h.state.status().kv}
    assert (status["kvb"].in_use, status["kvb"].demand_tokens, status["kvb"].share_bytes) == (0, 1024, 4 * MiB)
    snap = Metrics(h.state).snapshot
    assert number(snap, "gpumemd_kv_moves_total", kind="shrink_confirmed") == 1
    assert number(snap, "gpumemd_kv_moved_bytes_total") == 64 * MiB
    assert sum(histogram(snap, "gpumemd_kv_move_seconds").counts) == 1


def test_a_busy_neighbour_at_its_share_is_not_asked_and_the_grow_is_refused_at_once(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=32768))
    refused = h.refused(a, p.KvGrow(pool="kva", tokens=49152), ErrorCode.OUT_OF_MEMORY)
    assert refused.detail == {"requested": 64 * MiB, "available": 0}
    assert shrink_notices(h) == [] and h.state.tally.kv_grows_refused == 1


def test_a_neighbour_gives_back_down_to_its_weighted_share_and_the_grow_gets_part(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    a, b = two_pools(h)
    # b uses 64 MiB, under its half; a wants everything (256 MiB). Shares: b 64 MiB (its
    # demand), a the other 192. So b gives back 64 MiB, and a gets 192 MiB of its 256,
    # answered once b confirmed: no pool left to wait for.
    h.ok(b, p.KvDemand(pool="kvb", in_use=16384))
    grow_waits(h, a, "kva", 65536, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 16384)]
    give_back(h, b, "kvb", 16384)
    got = commit_reply(done(h)[7])
    assert (got.pool.tokens, got.asked_tokens, got.unanswered) == (49152, 65536, [])
    assert h.state.tally.kv_grows_partial == 1 and h.state.arenas.accounted_bytes() == 256 * MiB


def test_no_pool_is_pushed_below_its_minimum(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    a, b = two_pools(h, min_b=8192)  # 32 MiB
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 65536, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 8192)]
    give_back(h, b, "kvb", 8192)
    got = commit_reply(done(h)[7])
    assert (got.pool.tokens, got.asked_tokens) == (57344, 65536)
    assert {k.name: k.tokens for k in h.state.status().kv} == {"kva": 57344, "kvb": 8192}


def test_a_pool_at_its_floor_is_not_asked_whatever_its_weight(make_harness: Callable[..., Harness]) -> None:
    """The fair split's path: b holds just its minimum (64 MiB) at a tenth of a's weight.
    Its weighted part of the device is 23 MiB, but no share is below a floor: b is above
    nothing, so the grow is refused at once, and nobody is asked."""
    h = make_harness()
    a, b = h.connect("engine-a"), h.connect("engine-b")
    declare(h, a, "kva")
    declare(h, b, "kvb")
    join(h, a, "kva")
    join(h, b, "kvb")
    capture(h, a, "kva", 1, min_tokens=1024)
    capture(h, b, "kvb", 2, min_tokens=16384, max_tokens=16384, weight=0.1)
    tokens = {rid: commit_reply(c).pool.tokens for rid, c in done(h).items()}
    assert tokens == {1: 49152, 2: 16384} and h.state.arenas.available_bytes() == 0
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    refused = h.refused(a, p.KvGrow(pool="kva", tokens=65536), ErrorCode.OUT_OF_MEMORY)
    assert refused.detail == {"requested": 64 * MiB, "available": 0}
    assert shrink_notices(h) == [] and h.state.tally.kv_grows_deferred == 0


def test_a_floor_inside_a_chunk_is_never_crossed_by_a_shrink_request(make_harness: Callable[..., Harness]) -> None:
    """The shrink request's path: b's floor, 5000 rows, lies inside its second 16 MiB
    chunk, and a shrink frees whole chunks only. Asked for all it holds above the floor,
    b is asked down to 5000 rows (freeing the chunks past 8192), never to 4096."""
    h = make_harness()
    a, b = two_pools(h, min_b=5000)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 65536, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 5000)]
    reply = h.ok(b, p.KvShrink(pool="kvb", tokens=5000)).reply
    assert isinstance(reply, p.KvCommitReply) and reply.pool.tokens == 8192, "whole chunks: it keeps two"
    h.unmapped(b, "kvb", [c.id for c in reply.retired])
    got = commit_reply(done(h)[7])  # the one pool asked answered: what came free is a's
    assert (got.pool.tokens, got.asked_tokens) == (57344, 65536)
    assert {k.name: k.tokens for k in h.state.status().kv} == {"kva": 57344, "kvb": 8192}


def test_a_pool_that_never_answers_is_named_at_the_deadline_and_costs_the_wait_only(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(move_timeout=2.0)
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 49152, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 16384)]
    h.clock.now += 1.99
    h.state.tick()
    assert done(h) == {}
    h.clock.now += 0.01
    h.state.dirty = False
    h.state.tick()
    assert h.state.dirty, "a tick that may answer a grow marks the record for saving"
    error = done(h)[7].reply
    assert isinstance(error, p.ProtocolError) and error.code is ErrorCode.OUT_OF_MEMORY
    assert "engine-b/kvb" in error.message and "2s" in error.message
    assert h.state.arenas.accounted_bytes() == 256 * MiB and h.state.tally.kv_grows_refused == 1
    assert {k.name: k.tokens for k in h.state.status().kv} == {"kva": 32768, "kvb": 32768}
    # The next grow is decided afresh.
    grow_waits(h, a, "kva", 49152, 8)


def test_a_liar_above_its_share_is_asked_whatever_it_claims(make_harness: Callable[..., Harness]) -> None:
    # b alone takes the device; a's round then asks b for a's 16 MiB minimum. b holds 240
    # MiB and claims to use all of it: with equal weights its share is still half of the
    # 256, so a's grow to 128 MiB (its share) asks b for 112 MiB: a shrink to 32768.
    h = make_harness()
    a, b = h.connect("engine-a"), h.connect("engine-b")
    declare(h, b, "kvb")
    join(h, b, "kvb")
    capture(h, b, "kvb", 1)
    assert commit_reply(done(h)[1]).pool.tokens == 65536
    declare(h, a, "kva")
    join(h, a, "kva")
    capture(h, a, "kva", 2, min_tokens=4096)
    [(_, _, bound)] = shrink_notices(h)
    give_back(h, b, "kvb", bound)
    assert commit_reply(done(h)[2]).pool.tokens == 4096
    h.ok(b, p.KvDemand(pool="kvb", in_use=61440))
    grow_waits(h, a, "kva", 32768, 3)
    assert shrink_notices(h) == [(b.id, "kvb", 32768)]
    give_back(h, b, "kvb", 32768)
    assert commit_reply(done(h)[3]).pool.tokens == 32768


def test_a_donor_that_dies_mid_shrink_frees_its_memory_and_the_grow_is_answered(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 49152, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 16384)]
    h.ok(b, p.KvShrink(pool="kvb", tokens=16384))  # confirmed, then killed before it unmapped
    h.state.close_session(b.id)
    got = commit_reply(done(h)[7])
    assert (got.pool.tokens, got.unanswered, got.gone) == (49152, [], [])  # it answered before it went


def test_a_donor_that_dies_before_it_answers_is_named_gone_in_the_reply_and_the_log(make_harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture) -> None:
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 49152, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 16384)]
    with caplog.at_level(logging.INFO, logger="gpumemd.kv_pools"):
        h.state.close_session(b.id)  # killed while it moved its blocks: its memory is reclaimed
    got = commit_reply(done(h)[7])
    assert (got.pool.tokens, got.unanswered, got.gone) == (49152, [], ["engine-b/kvb"])
    assert "gone before answering: engine-b/kvb" in caplog.text
    assert "kvb" not in h.state.arenas.by_name and h.state.arenas.accounted_bytes() == 192 * MiB


def test_a_taker_that_dies_while_waiting_leaves_nothing_behind(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 49152, 7)
    h.state.close_session(a.id)
    assert h.state.kv.grows == []
    give_back(h, b, "kvb", 16384)
    h.clock.now += 10
    h.state.tick()
    assert done(h) == {} and h.state.arenas.accounted_bytes() == 64 * MiB


def test_demand_reports_are_bounded_by_what_the_pool_holds_and_only_its_owner_may_send_them(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=10**12))
    assert h.state.kv.pools["kvb"].in_use == 32768
    h.refused(a, p.KvDemand(pool="kvb", in_use=0), ErrorCode.PERMISSION_DENIED)
    assert h.state.kv.pools["kvb"].in_use == 32768


def test_idle_pools_are_asked_first(make_harness: Callable[..., Harness]) -> None:
    # Three pools of 84 MiB (21504 tokens) each, 4 MiB free. b uses just its minimum, c
    # nothing: both hold 80 MiB above their shares, and a's grow by 20 MiB needs 16 of
    # it. The idle one gives (by name alone, b would).
    h = make_harness()
    a, b, c = h.connect("engine-a"), h.connect("engine-b"), h.connect("engine-c")
    for s, name in ((a, "kva"), (b, "kvb"), (c, "kvc")):
        declare(h, s, name)
        join(h, s, name)
    for i, (s, name) in enumerate(((a, "kva"), (b, "kvb"), (c, "kvc"))):
        capture(h, s, name, i, min_tokens=1024)
    assert {commit_reply(x).pool.tokens for x in done(h).values()} == {21504}
    h.ok(b, p.KvDemand(pool="kvb", in_use=1024))
    h.ok(c, p.KvDemand(pool="kvc", in_use=0))
    grow_waits(h, a, "kva", 26624, 7)
    [(sid, arena, bound)] = shrink_notices(h)
    assert (sid, arena) == (c.id, "kvc")
    give_back(h, c, "kvc", bound)
    assert commit_reply(done(h)[7]).pool.tokens == 26624


def test_a_donor_that_releases_its_pool_instead_of_shrinking_answers_the_grow_at_once(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 49152, 7)
    h.ok(b, p.ReleaseArena(name="kvb"))
    got = commit_reply(done(h)[7])
    assert (got.pool.tokens, got.unanswered, got.gone) == (49152, [], ["engine-b/kvb"])
    assert h.state.arenas.accounted_bytes() == 192 * MiB


def test_a_donor_whose_asked_rows_are_all_live_answers_with_its_tokens_and_the_grow_goes_on_at_once(make_harness: Callable[..., Harness]) -> None:
    """A shrink that gives back nothing (the engine could not move its live blocks below
    the bound) is still an answer: the grow is answered then with what is free, not at
    the move deadline (on the H200 such grows waited the whole 2 s)."""
    h = make_harness(move_timeout=2.0)
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 49152, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 16384)]
    reply = h.ok(b, p.KvShrink(pool="kvb", tokens=32768)).reply  # every row asked for is live
    assert isinstance(reply, p.KvCommitReply) and reply.pool.tokens == 32768 and reply.retired == []
    error = done(h)[7].reply  # now, the clock has not moved
    assert isinstance(error, p.ProtocolError) and error.code is ErrorCode.OUT_OF_MEMORY
    assert "none" in error.message  # nobody left unanswered
    assert h.state.kv.pools["kvb"].shrink_request is None and h.state.arenas.accounted_bytes() == 256 * MiB
    # Asked nothing, a shrink to the tokens held is what it always was: refused.
    h.refused(b, p.KvShrink(pool="kvb", tokens=32768), ErrorCode.INVALID_ARGUMENT)
    # Its answer stands while it holds the same and says nothing new: a's next grow is
    # refused at once, not sent to b (whose step it would wait for) for nothing.
    h.refused(a, p.KvGrow(pool="kva", tokens=49152), ErrorCode.OUT_OF_MEMORY)
    assert shrink_notices(h) == []
    h.ok(b, p.KvDemand(pool="kvb", in_use=1024))  # its requests ended: it is asked again
    grow_waits(h, a, "kva", 49152, 8)
    assert [sid for sid, _, _ in shrink_notices(h)] == [b.id]


def test_a_pool_whose_own_grow_waits_is_not_asked_to_give_back(make_harness: Callable[..., Harness]) -> None:
    """Its engine has not seen the rows its grow will bring: asked now, it would give back
    rows it never mapped (the host bench's engine then mapped chunks the daemon had retired)."""
    h = make_harness()
    a, b = two_pools(h)
    h.ok(a, p.KvDemand(pool="kva", in_use=0))
    grow_waits(h, b, "kvb", 49152, 7)
    [(_, _, bound)] = shrink_notices(h)
    give_back(h, a, "kva", bound)
    assert commit_reply(done(h)[7]).pool.tokens == 49152
    grow_waits(h, b, "kvb", 60000, 8)  # b wants more, a is asked again and has not answered yet
    assert [sid for sid, _, _ in shrink_notices(h)] == [a.id]
    # a bursts: with equal weights b holds 64 MiB above its share, but b waits for its own grow.
    refused = h.refused(a, p.KvGrow(pool="kva", tokens=40000), ErrorCode.OUT_OF_MEMORY)
    assert refused.detail["requested"] > refused.detail["available"] and shrink_notices(h) == []


def test_a_grow_whose_pool_is_released_while_it_waits_is_answered_not_found(make_harness: Callable[..., Harness]) -> None:
    """Its owner released the pool (another thread of the engine) while the grow waited
    for b's shrink: the grow is answered at once, naming the release, not dropped with
    no answer for its client to wait out."""
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 49152, 7)
    h.release(a, "kva")
    error = done(h)[7].reply
    assert isinstance(error, p.ProtocolError) and error.code is p.ErrorCode.NOT_FOUND
    assert "'kva' was released while it waited to grow" in error.message
    assert h.state.kv.grows == []


def test_a_rounds_split_weighs_each_tenant_alike(make_harness: Callable[..., Harness]) -> None:
    """A weight is the engine's word: it divides its own tenant's part of a round, not
    another tenant's. Before, a weight of 1e6 took all but b's minimum."""
    h = make_harness()
    a, b = h.connect("engine-a"), h.connect("engine-b", uid=2000, gid=2000)
    for s, name in ((a, "kva"), (b, "kvb")):
        declare(h, s, name)
        join(h, s, name)
    capture(h, a, "kva", 1, min_tokens=1024, weight=1e6)
    capture(h, b, "kvb", 2, min_tokens=1024)
    assert {rid: commit_reply(c).pool.tokens for rid, c in done(h).items()} == {1: 32768, 2: 32768}


def hostile_then_neighbour(h: Harness, **hostile: float) -> tuple[Session, Session]:
    """engine-a (uid 1000) reports what ``hostile`` says and takes the 256 MiB device in
    its own round (busy: it wants all it holds); engine-b (uid 2000) then commits its
    4 MiB minimum in a round of its own, which a gives back for."""
    a, b = h.connect("engine-a"), h.connect("engine-b", uid=2000, gid=2000)
    declare(h, a, "kva")
    join(h, a, "kva")
    capture(h, a, "kva", 1, **{"min_tokens": 1024, **hostile})
    assert commit_reply(done(h)[1]).pool.tokens == 65536
    h.ok(a, p.KvDemand(pool="kva", in_use=65536))
    declare(h, b, "kvb")
    join(h, b, "kvb")
    capture(h, b, "kvb", 2, min_tokens=1024)
    ((_, _, tokens),) = shrink_notices(h)
    give_back(h, a, "kva", tokens)
    assert commit_reply(done(h)[2]).pool.tokens < 16384  # its minimum, and the rest of the chunk a gave
    h.ok(a, p.KvDemand(pool="kva", in_use=tokens))
    return a, b


@pytest.mark.parametrize("hostile", [{"weight": 1e6}, {"min_tokens": 60000}], ids=["weight", "min_tokens"])
def test_an_engines_weight_and_minimum_do_not_outweigh_another_tenant(make_harness: Callable[..., Harness], hostile: dict[str, float]) -> None:
    """Weights and minimums are the engine's word: across tenants they are bounded (a
    pool's weight divides its tenant's, a tenant's minimums guard at most its even part),
    so b's grow to 64 MiB, well within its fair half, asks a back for what it needs.
    Before, a weight of 1e6 (or a minimum of 234 MiB) left a nothing to give and b's grow
    was refused at once."""
    h = make_harness()
    a, b = hostile_then_neighbour(h, **hostile)
    grow_waits(h, b, "kvb", 16384, 7)
    ((sid, pool, tokens),) = shrink_notices(h)
    assert (sid, pool) == (a.id, "kva")
    give_back(h, a, "kva", tokens)
    assert commit_reply(done(h)[7]).pool.tokens == 16384  # all b asked for: a was asked enough


def test_memory_a_donor_confirmed_but_kept_mapped_counts_against_it_and_is_named(make_harness: Callable[..., Harness]) -> None:
    """b confirms its shrink and never reports the unmap: it keeps the memory mapped and
    writable. Past --move-timeout that memory is b's as far as the move policy goes: held
    by it, so b, at its fair share by its live rows alone, is asked to give those back for
    the next grow; and a grow it starves names it. Before, the policy saw b at its share,
    the next grow was refused at once, and the errors named nobody."""
    h = make_harness()
    a, b = two_pools(h)
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))
    grow_waits(h, a, "kva", 49152, 7)
    assert shrink_notices(h) == [(b.id, "kvb", 16384)]
    h.ok(b, p.KvShrink(pool="kvb", tokens=16384))  # confirmed; the unmap never comes
    h.clock.now += h.config.move_timeout
    h.state.tick()
    error = done(h)[7].reply
    assert isinstance(error, p.ProtocolError) and error.code is p.ErrorCode.OUT_OF_MEMORY
    assert f"engine-b/kvb {64 * MiB} bytes" in error.message and "never unmapped" in error.message
    assert h.state.kv.kept_mapped() == {"kvb": 64 * MiB}
    h.ok(b, p.KvDemand(pool="kvb", in_use=16384))  # busy now: its live rows are its fair share
    grow_waits(h, a, "kva", 49152, 8)
    ((sid, pool, tokens),) = shrink_notices(h)
    assert (sid, pool) == (b.id, "kvb") and tokens < 16384  # what it kept counts against it
