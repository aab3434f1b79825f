"""A dropped KV pool's wake above its floor (KV_GROW's ``least``, 1.14): answered with
what fits once the floor fits, never held for rows a neighbour keeps; the rest a
waiting grow gets once they come back; refused, naming the holders, when not even the
floor fits by the end of its wait."""

from __future__ import annotations

from collections.abc import Callable

from gpumem_shared import protocol as p

from .harness import CAPACITY, Harness, MiB, Session
from .test_kv_moves import shrink_notices, two_pools
from .test_kv_rounds import commit_reply, done

TOKEN = 4096  # bytes a token of the test pools takes (two_pools: 32768 tokens in 128 MiB)


def _b_asleep_beside(h: Harness, free: int, *, keep_a: bool = False) -> tuple[Session, Session, Session]:
    """kvb asleep (dropped), kva released unless ``keep_a``, and a trainer holding all
    but ``free`` bytes of the device: what it kept after giving the rest back."""
    a, b = two_pools(h)
    if not keep_a:
        h.release(a, "kva")
    reply = h.ok(b, p.KvShrink(pool="kvb", tokens=0, sleep=True)).reply
    assert isinstance(reply, p.KvCommitReply)
    h.unmapped(b, "kvb", [c.id for c in reply.retired])
    trainer = h.connect("trainer")
    h.create(trainer, "train", CAPACITY)
    h.commit(trainer, "train", h.state.arenas.available_bytes() - free)
    return a, b, trainer


def test_a_wake_above_its_floor_takes_what_fits_at_once_and_a_waiting_grow_gets_the_rest(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    _, b, trainer = _b_asleep_beside(h, 32 * MiB)  # nobody to ask: the trainer's arena is no KV pool
    reply = h.ok(b, p.KvGrow(pool="kvb", tokens=32768, wait=30.0, least=4096)).reply
    assert isinstance(reply, p.KvCommitReply)
    assert (reply.pool.tokens, reply.asked_tokens) == (32 * MiB // TOKEN, 32768), "what fits, answered at once"
    assert h.state.arenas.by_name["kvb"].asleep is None, "awake, with part of its rows"
    # Without least the wake waits for all its rows (1.12's wake): that is what failed for drift.
    assert h.state.handle(b, p.KvGrow(pool="kvb", tokens=32768, wait=30.0), 9).reply is None
    h.clock.now += 5
    h.state.tick()
    assert done(h) == {}, "the rest waits for the memory, not for its wait's end"
    h.release(trainer, "train")
    assert commit_reply(done(h)[9]).pool.tokens == 32768, "answered once the trainer let go"


def test_a_wake_whose_floor_does_not_fit_is_refused_at_its_wait_naming_the_holders(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    _, b, _ = _b_asleep_beside(h, 8 * MiB)
    assert h.state.handle(b, p.KvGrow(pool="kvb", tokens=32768, wait=3.0, least=4096), 7).reply is None, "waits for its floor"
    h.clock.now += 1
    h.state.tick()
    assert done(h) == {}
    h.clock.now += 3
    h.state.tick()
    refusal = done(h)[7].reply
    assert isinstance(refusal, p.ProtocolError) and refusal.code is p.ErrorCode.OUT_OF_MEMORY
    assert "only 2048 of the 4096 tokens it needs at least fit" in refusal.message
    assert "the device's memory is held by client 'trainer'" in refusal.message, refusal.message
    assert h.state.arenas.by_name["kvb"].asleep is not None and h.state.kv.pools["kvb"].tokens == 0


def test_a_wake_above_its_floor_waits_for_a_donor_at_most_the_move_deadline(make_harness: Callable[..., Harness]) -> None:
    """A neighbour above its share is asked, as for any wake; one that does not answer
    holds the wake for --move-timeout, not for the wake's whole wait."""
    h = make_harness()
    a, b, _ = _b_asleep_beside(h, 32 * MiB, keep_a=True)
    h.ok(a, p.KvDemand(pool="kva", in_use=0))  # idle: above its share
    assert h.state.handle(b, p.KvGrow(pool="kvb", tokens=32768, wait=30.0, least=4096), 7).reply is None
    assert [(pool, n) for _, pool, n in shrink_notices(h)] and done(h) == {}, "kva asked, and waited for"
    h.clock.now += h.config.move_timeout + 0.1
    h.state.tick()
    reply = commit_reply(done(h)[7])
    assert reply.pool.tokens == 32 * MiB // TOKEN and reply.unanswered == ["engine-a/kva"]


def test_a_floor_must_lie_above_the_rows_held_and_go_with_a_wait(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    _, b, _ = _b_asleep_beside(h, 32 * MiB)
    for bad in (p.KvGrow(pool="kvb", tokens=32768, least=4096), p.KvGrow(pool="kvb", tokens=4096, wait=1.0, least=8192)):
        h.refused(b, bad, p.ErrorCode.INVALID_ARGUMENT)

