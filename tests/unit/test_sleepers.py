"""The sleeper book on the real host driver, no sockets: an arena asleep hands its chunks
to the device (another session commits them), refuses commits and attaches, wakes at
its size or names who holds the memory; host buffers are sealed, counted against the
limit, and go with their arena; a restart keeps a sleeper and its buffer."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable

import pytest

from gpumem_shared import protocol as p
from gpumemd.config import TenantLimits
from gpumemd.metrics import Metrics
from gpumemd.records import SessionRecord as Session
from gpumemd.sleepers import host_buffer_name

from .harness import CAPACITY, Harness, MiB
from .store_kit import stored
from .test_metrics import number


def _buffer(h: Harness, s: object, arena: str, nbytes: int) -> tuple[int, int]:
    """SLEEP_BUFFER: (buffer id, the daemon's fd the reply grants; not the caller's to close)."""
    out = h.ok(s, p.SleepBuffer(arena=arena, nbytes=nbytes))
    assert isinstance(out.reply, p.HostBufferReply) and out.reply.fd_batches == 1
    assert out.grants == []  # a lease segment's grant is a graph pool's: the buffer's is apart
    ((buffer_id, fd),) = out.host_buffers
    assert buffer_id == out.reply.buffer.id and out.reply.buffer.size >= nbytes
    return buffer_id, fd


def _asleep(h: Harness, s: object, arena: str, kept: int = 0) -> list[int]:
    """ARENA_SLEEP, and the retired chunks reported unmapped as a client does."""
    out = h.ok(s, p.SleepArena(name=arena, kept_bytes=kept))
    assert isinstance(out.reply, p.MapReply) and out.reply.chunks == []
    retired = [c.id for c in out.reply.retired]
    h.unmapped(s, arena, retired)  # type: ignore[arg-type]
    return retired


def test_sleep_frees_the_device_for_others_and_wake_commits_the_same_offsets(h: Harness) -> None:
    engine, trainer = h.connect("engine"), h.connect("trainer")
    h.create(engine, "weights", 512 * MiB)
    before = h.commit(engine, "weights", 100 * MiB).reply.chunks
    retired = _asleep(h, engine, "weights")
    assert sorted(retired) == sorted(c.id for c in before)
    assert h.state.arenas.accounted_bytes() == 0  # every byte is the device's again
    h.create(trainer, "scratch", 512 * MiB)
    h.commit(trainer, "scratch", CAPACITY)  # all of it, the sleeper's included
    # The wake cannot have it: the figures, and who holds it.
    refusal = h.refused(engine, p.WakeArena(name="weights"), p.ErrorCode.OUT_OF_MEMORY)
    assert "client 'trainer'" in refusal.message and refusal.detail["requested"] == 100 * MiB
    h.release(trainer, "scratch")
    woken = h.ok(engine, p.WakeArena(name="weights")).reply
    assert woken.arena.committed == 100 * MiB
    assert sorted((c.offset, c.size) for c in woken.chunks) == sorted((c.offset, c.size) for c in before)
    assert all(c.fresh for c in h.state.arenas.by_name["weights"].chunks)  # zeroed before their first fd leaves
    h.refused(engine, p.WakeArena(name="weights"), p.ErrorCode.INVALID_ARGUMENT)  # awake already


def test_an_arena_asleep_refuses_commit_decommit_and_attach(h: Harness) -> None:
    engine, other = h.connect("engine"), h.connect("other")
    h.create(engine, "weights", 512 * MiB)
    h.commit(engine, "weights", 64 * MiB)
    h.share(engine, "weights", "other")
    _asleep(h, engine, "weights")
    for message in (p.CommitArena(name="weights", nbytes=32 * MiB), p.DecommitArena(name="weights", to_nbytes=0)):
        refusal = h.refused(engine, message, p.ErrorCode.ARENA_ASLEEP)
        assert refusal.detail == {"arena": "weights", "committed": 64 * MiB}
    h.refused(other, p.AttachArena(name="weights"), p.ErrorCode.ARENA_ASLEEP)
    h.refused(engine, p.SleepArena(name="weights"), p.ErrorCode.ARENA_ASLEEP)
    h.refused(other, p.WakeArena(name="weights"), p.ErrorCode.PERMISSION_DENIED)  # the owner's alone


def test_an_arena_attached_by_another_session_does_not_sleep(h: Harness) -> None:
    engine, reader = h.connect("engine"), h.connect("reader")
    h.create(engine, "weights", 512 * MiB)
    h.commit(engine, "weights", 64 * MiB)
    h.share(engine, "weights", "reader")
    h.attach(reader, "weights")
    refusal = h.refused(engine, p.SleepArena(name="weights"), p.ErrorCode.INVALID_ARGUMENT)
    assert "reader" in refusal.message
    assert h.state.arenas.by_name["weights"].committed == 64 * MiB  # nothing was taken from the reader


def test_sleep_goes_under_graph_pools_which_stay_registered(h: Harness) -> None:
    engine = h.connect("engine")
    h.create(engine, "graphs", 512 * MiB)
    h.commit(engine, "graphs", 64 * MiB)
    pool = h.ok(engine, p.RegisterGraphPool(arena="graphs", label="decode", extents=[p.Extent(offset=0, size=32 * MiB)], free_runs=[]))
    h.refused(engine, p.DecommitArena(name="graphs", to_nbytes=0), p.ErrorCode.INVALID_ARGUMENT)  # a decommit may not
    _asleep(h, engine, "graphs")
    assert list(h.state.graph_pools.by_id) == [pool.reply.pool.id]
    h.ok(engine, p.WakeArena(name="graphs"))
    assert h.state.graph_pools.by_id[pool.reply.pool.id].epoch == pool.reply.pool.epoch  # as it was


def test_host_buffers_are_sealed_counted_and_limited(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(sleep_host_limit=24 * MiB, tenants=TenantLimits(sleep_host_share=1.0))  # one uid: all of it its share
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "wa", 512 * MiB)
    h.create(b, "wb", 512 * MiB)
    _, fd = _buffer(h, a, "wa", 16 * MiB)
    # Sealed: the holder of a descriptor cannot grow it past what is counted.
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 64 * MiB)
    assert os.fstat(fd).st_size == 16 * MiB
    again, _ = _buffer(h, a, "wa", 8 * MiB)  # large enough: the same one again
    assert again == h.state.sleepers.buffers["wa"].id
    refusal = h.refused(b, p.SleepBuffer(arena="wb", nbytes=10 * MiB), p.ErrorCode.HOST_LIMIT)
    assert refusal.detail == {"limit": 24 * MiB, "used": 16 * MiB, "requested": 10 * MiB}
    assert "client 'engine-a'" in refusal.message and "--sleep-host-limit" in refusal.message
    _buffer(h, b, "wb", 8 * MiB)
    status = h.state.status()
    assert {c.name: c.host_bytes for c in status.clients} == {"engine-a": 16 * MiB, "engine-b": 8 * MiB}
    assert (status.daemon.sleep_host_bytes, status.daemon.sleep_host_limit) == (24 * MiB, 24 * MiB)
    h.refused(b, p.SleepBuffer(arena="wa", nbytes=2 * MiB), p.ErrorCode.PERMISSION_DENIED)  # not its arena
    h.ok(a, p.FreeSleepBuffer(arena="wa"))
    assert h.state.sleepers.host_bytes() == 8 * MiB
    # Growing replaces the buffer: only the difference needs room.
    _buffer(h, b, "wb", 24 * MiB)
    assert h.state.sleepers.host_bytes() == 24 * MiB


def test_one_uid_holds_at_most_its_share_of_the_host_limit(make_harness: Callable[..., Harness]) -> None:
    """A sparse buffer costs its uid nothing, so a share bounds what one uid's buffers
    take (--tenant-sleep-host-share, half by default): another tenant's sleep still finds
    room. Before, one uid held the whole limit and every other sleep was refused."""
    h = make_harness(sleep_host_limit=24 * MiB)
    a1, a2, b = h.connect("a1"), h.connect("a2"), h.connect("b", uid=2000, gid=2000)
    for s, name in ((a1, "wa1"), (a2, "wa2"), (b, "wb")):
        h.create(s, name, 512 * MiB)
    _buffer(h, a1, "wa1", 8 * MiB)
    refusal = h.refused(a2, p.SleepBuffer(arena="wa2", nbytes=6 * MiB), p.ErrorCode.HOST_LIMIT)  # one uid, two sessions
    assert refusal.detail == {"limit": 12 * MiB, "used": 8 * MiB, "requested": 6 * MiB, "uid": 1000}
    assert "--tenant-sleep-host-share" in refusal.message
    _buffer(h, a2, "wa2", 4 * MiB)
    _buffer(h, b, "wb", 12 * MiB)  # the other tenant's half is there
    assert h.state.sleepers.host_bytes_of(1000) == h.state.sleepers.host_bytes_of(2000) == 12 * MiB


def test_kept_bytes_must_fit_the_buffer_and_the_arena(h: Harness) -> None:
    engine = h.connect("engine")
    h.create(engine, "weights", 512 * MiB)
    h.commit(engine, "weights", 16 * MiB)
    h.refused(engine, p.SleepArena(name="weights", kept_bytes=4 * MiB), p.ErrorCode.INVALID_ARGUMENT)  # no buffer
    _buffer(h, engine, "weights", 32 * MiB)
    h.refused(engine, p.SleepArena(name="weights", kept_bytes=32 * MiB), p.ErrorCode.INVALID_ARGUMENT)  # beyond the arena
    _asleep(h, engine, "weights", kept=16 * MiB)
    (sleeper,) = h.state.status().sleepers
    assert (sleeper.arena, sleeper.owner, sleeper.asleep, sleeper.committed_bytes, sleeper.kept_bytes, sleeper.host_bytes) == (
        "weights", "engine", True, 16 * MiB, 16 * MiB, 32 * MiB,
    )
    h.refused(engine, p.FreeSleepBuffer(arena="weights"), p.ErrorCode.ARENA_ASLEEP)  # its contents are in there


def test_a_sleeper_that_dies_leaves_nothing_behind(h: Harness) -> None:
    engine, trainer = h.connect("engine"), h.connect("trainer")
    h.create(engine, "weights", 512 * MiB)
    h.commit(engine, "weights", 64 * MiB)
    _buffer(h, engine, "weights", 64 * MiB)
    _asleep(h, engine, "weights", kept=64 * MiB)
    h.create(trainer, "scratch", 512 * MiB)
    h.commit(trainer, "scratch", 128 * MiB)
    h.state.close_session(engine.id)
    assert h.state.sleepers.host_bytes() == 0 and not h.state.sleepers.asleep and not h.state.sleepers.buffers
    assert h.state.arenas.accounted_bytes() == 128 * MiB  # the trainer's, untouched
    assert h.state.arenas.by_name["scratch"].committed == 128 * MiB
    # the fixture checks every descriptor (the buffer's memfd) was closed


def test_a_restart_keeps_the_sleeper_and_its_buffer(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    with stored(h) as daemon:
        engine = h.connect("engine")
        h.create(engine, "weights", 512 * MiB)
        h.commit(engine, "weights", 8 * MiB)
        buffer_id, fd = _buffer(h, engine, "weights", 8 * MiB)
        with mmap.mmap(fd, 8 * MiB) as m:
            m[:5] = b"hello"
        _asleep(h, engine, "weights", kept=8 * MiB)
        passed = daemon.stop()
        assert host_buffer_name(buffer_id) in daemon.store.held

        again = daemon.restart(passed)
        assert again.state.restore_problems == []
        (sleeper,) = again.state.status().sleepers
        assert (sleeper.asleep, sleeper.committed_bytes, sleeper.kept_bytes, sleeper.host_bytes) == (True, 8 * MiB, 8 * MiB, 8 * MiB)
        kept = again.state.sleepers.buffers["weights"]
        assert os.pread(kept.fd, 5, 0) == b"hello"  # the contents outlived the daemon
        session = again.state.sessions[engine.id]
        session.waiting = False  # as its RESUME does
        assert again.ok(session, p.WakeArena(name="weights")).reply.arena.committed == 8 * MiB


def test_a_stored_buffer_that_is_not_the_one_stored_is_not_adopted(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    with stored(h) as daemon:
        engine = h.connect("engine")
        h.create(engine, "weights", 512 * MiB)
        buffer_id, _ = _buffer(h, engine, "weights", 8 * MiB)
        passed = daemon.stop()
        name = host_buffer_name(buffer_id)
        os.close(passed[name][0])
        impostor = os.memfd_create("impostor")
        os.ftruncate(impostor, 2 * MiB)
        passed[name] = [impostor]
        again = daemon.restart(passed)
        assert "weights" not in again.state.sleepers.buffers
        problems = again.state.restore_problems
        assert any(f"named {name!r} that are not the one" in x for x in problems) and any("missing from the fd store" in x for x in problems)
        with pytest.raises(OSError) as closed:
            os.fstat(impostor)  # not adopted: closed
        assert closed.value.errno == errno.EBADF


def test_a_wake_that_does_not_fit_asks_kv_pools_above_their_share_to_give_back(h: Harness) -> None:
    from .test_kv_moves import give_back, shrink_notices
    from .test_kv_rounds import capture, commit_reply, declare, done, join

    sleeper, server = h.connect("sleeper"), h.connect("server")
    h.create(sleeper, "weights", 512 * MiB)
    h.commit(sleeper, "weights", 64 * MiB)
    _asleep(h, sleeper, "weights")
    # Meanwhile a serving engine's KV pool takes the whole device (4 KiB rows: 256 a MiB).
    declare(h, server, "kv")
    join(h, server, "kv")
    capture(h, server, "kv", 1, min_tokens=1024)
    assert commit_reply(done(h)[1]).pool.tokens == 65536 and h.state.arenas.available_bytes() == 0
    h.ok(server, p.KvDemand(pool="kv", in_use=0))  # idle
    refusal = h.refused(sleeper, p.WakeArena(name="weights"), p.ErrorCode.OUT_OF_MEMORY)
    assert "KV pools kv were asked to give back" in refusal.message and "client 'server'" in refusal.message
    (ask,) = shrink_notices(h)
    assert ask[:2] == (server.id, "kv") and ask[2] <= 65536 - 64 * 256
    h.refused(sleeper, p.WakeArena(name="weights"), p.ErrorCode.OUT_OF_MEMORY)
    assert shrink_notices(h) == []  # asked once, not at every retry
    give_back(h, server, "kv", ask[2])
    assert h.ok(sleeper, p.WakeArena(name="weights")).reply.arena.committed == 64 * MiB


def test_a_kv_pool_asleep_is_shown_asleep_asked_nothing_and_woken_by_its_grow(h: Harness) -> None:
    from .test_kv_moves import give_back, grow_waits, shrink_notices, two_pools
    from .test_kv_rounds import commit_reply, done

    a, b = two_pools(h)  # 128 MiB each, the device full
    h.ok(b, p.KvDemand(pool="kvb", in_use=30000))  # busy before its sleep
    _buffer(h, b, "kvb", 8 * MiB)
    h.refused(b, p.KvShrink(pool="kvb", tokens=1, sleep=True), p.ErrorCode.INVALID_ARGUMENT)
    h.refused(b, p.KvShrink(pool="kvb", tokens=0, sleep=True, kept_bytes=129 * MiB), p.ErrorCode.INVALID_ARGUMENT)
    reply = h.ok(b, p.KvShrink(pool="kvb", tokens=0, sleep=True, kept_bytes=8 * MiB)).reply
    assert isinstance(reply, p.KvCommitReply) and reply.pool.tokens == 0
    h.unmapped(b, "kvb", [c.id for c in reply.retired])
    (x,) = h.state.status().sleepers
    assert (x.arena, x.owner, x.asleep, x.committed_bytes, x.kept_bytes, x.host_bytes) == ("kvb", "engine-b", True, 128 * MiB, 8 * MiB, 8 * MiB)
    assert x.since > 0
    kv = {k.name: k for k in h.state.status().kv}
    assert (kv["kvb"].demand_tokens, kv["kvb"].share_bytes) == (0, 0), "a sleeping pool wants nothing, whatever it used before"
    assert number(Metrics(h.state).snapshot, "gpumemd_arenas_asleep") == 1
    h.refused(b, p.FreeSleepBuffer(arena="kvb"), p.ErrorCode.ARENA_ASLEEP)  # its contents are there
    h.refused(b, p.RoundJoin(pool="kvb"), p.ErrorCode.ARENA_ASLEEP)  # a round would wake it behind its back
    # a takes the whole device: the memory is free, and the sleeper is asked nothing.
    grown = h.ok(a, p.KvGrow(pool="kva", tokens=65536)).reply
    assert isinstance(grown, p.KvCommitReply) and grown.pool.tokens == 65536
    assert shrink_notices(h) == []
    assert {k.name: k.share_bytes for k in h.state.status().kv} == {"kva": 256 * MiB, "kvb": 0}
    # b's wake is a grow like any: a holds more than its share of the two demands, and is asked.
    grow_waits(h, b, "kvb", 32768, 9)
    assert {k.name: k.demand_tokens for k in h.state.status().kv}["kvb"] == 32768
    assert shrink_notices(h) == [(a.id, "kva", 32768)]
    give_back(h, a, "kva", 32768)
    assert commit_reply(done(h)[9]).pool.tokens == 32768
    (x,) = h.state.status().sleepers
    assert (x.arena, x.asleep, x.host_bytes) == ("kvb", False, 8 * MiB)  # awake, its buffer kept for the next sleep
    assert number(Metrics(h.state).snapshot, "gpumemd_arenas_asleep") == 0
    h.ok(b, p.FreeSleepBuffer(arena="kvb"))


def test_a_kv_pool_asleep_stays_asleep_across_a_restart_and_wakes_by_its_grow(make_harness: Callable[..., Harness]) -> None:
    from .test_kv_moves import two_pools

    h = make_harness()
    with stored(h) as daemon:
        _, b = two_pools(h)
        reply = h.ok(b, p.KvShrink(pool="kvb", tokens=0, sleep=True)).reply
        assert isinstance(reply, p.KvCommitReply)
        h.unmapped(b, "kvb", [c.id for c in reply.retired])

        again = daemon.restart(daemon.stop())
        assert [(x.arena, x.asleep, x.committed_bytes) for x in again.state.status().sleepers] == [("kvb", True, 128 * MiB)]
        session = again.state.sessions[b.id]
        session.waiting = False  # as its RESUME does
        grown = again.ok(session, p.KvGrow(pool="kvb", tokens=32768)).reply
        assert isinstance(grown, p.KvCommitReply) and grown.pool.tokens == 32768
        assert again.state.status().sleepers == [] and again.state.sleepers.asleep == {}


def _asleep_beside_two_pools(h: Harness) -> tuple[Session, Session, Session]:
    """The sleeper's 64 MiB arena asleep, then engine-a's and engine-b's KV pools filling
    the device (128 MiB each), engine-a's idle: a wake must ask a pool to give back."""
    from .test_kv_moves import two_pools

    sleeper = h.connect("sleeper")
    h.create(sleeper, "weights", 512 * MiB)
    h.commit(sleeper, "weights", 64 * MiB)
    _asleep(h, sleeper, "weights")
    a, b = two_pools(h)
    h.ok(a, p.KvDemand(pool="kva", in_use=0))
    return sleeper, a, b


def test_a_wake_chooses_donors_by_the_grows_rule(make_harness: Callable[..., Harness]) -> None:
    """One donor rule (KvBook.ask_back): a wake asks no pool whose own grow waits (it would
    give back rows its engine never mapped), nor one that just kept its asked rows live
    (asking again is futile and costs its engine a step), as a grow asks neither. Before,
    a wake had its own copy of the rule, and asked both."""
    from .test_kv_moves import grow_waits, shrink_notices
    from .test_kv_rounds import done

    h = make_harness()
    sleeper, a, b = _asleep_beside_two_pools(h)
    grow_waits(h, b, "kvb", 49152, 7)  # b's grow waits for a
    assert [sid for sid, _, _ in shrink_notices(h)] == [a.id]
    h.refused(sleeper, p.WakeArena(name="weights"), p.ErrorCode.OUT_OF_MEMORY)
    assert b.id not in [sid for sid, _, _ in shrink_notices(h)], "b's own grow waits: it is not asked"
    # a's rows are all live: it answers keeping them, and b's grow is answered at once.
    h.ok(a, p.KvDemand(pool="kva", in_use=32768))
    h.ok(a, p.KvShrink(pool="kva", tokens=32768))
    assert isinstance(done(h)[7].reply, p.ProtocolError)
    refusal = h.refused(sleeper, p.WakeArena(name="weights"), p.ErrorCode.OUT_OF_MEMORY)
    notices = shrink_notices(h)
    assert a.id not in [sid for sid, _, _ in notices], "a kept its rows live a moment ago: asking again is futile"
    assert h.state.tally.kv_shrinks_asked == 1 + len(notices)  # every ask counted once, in one place
    assert "client 'engine-a'" in refusal.message


def _asleep_under_a_trainer(h: Harness) -> tuple[Session, Session]:
    """The engine's 64 MiB arena asleep, then the trainer's arena taking the whole device:
    a wake does not fit until the trainer lets go."""
    engine, trainer = h.connect("engine"), h.connect("trainer")
    h.create(engine, "weights", 512 * MiB)
    h.commit(engine, "weights", 64 * MiB)
    _asleep(h, engine, "weights")
    h.create(trainer, "train", CAPACITY)
    h.commit(trainer, "train", CAPACITY)
    return engine, trainer


def test_a_wake_that_does_not_fit_is_answered_once_another_session_frees_the_memory(h: Harness) -> None:
    """ARENA_WAKE with a ``wait`` is deferred like a KV grow: one request, answered when
    the trainer releases what it holds (no client polling), at the same offsets."""
    engine, trainer = _asleep_under_a_trainer(h)
    outcome = h.state.handle(engine, p.WakeArena(name="weights", wait=30.0), 7)
    assert outcome.reply is None and h.state.take_completions() == []
    h.refused(engine, p.WakeArena(name="weights", wait=30.0), p.ErrorCode.ALREADY_EXISTS)  # one wake waits at a time
    h.refused(engine, p.CommitArena(name="weights", nbytes=2 * MiB), p.ErrorCode.ARENA_ASLEEP)  # still asleep meanwhile
    h.release(trainer, "train")
    (c,) = h.state.take_completions()
    assert c.request_id == 7 and c.session_id == engine.id and isinstance(c.reply, p.MapReply)
    assert c.reply.arena.committed == 64 * MiB and [(x.offset, x.size) for x in c.handout] == [(x.offset, x.size) for x in c.reply.chunks]
    assert sum(x.size for x in c.handout) == 64 * MiB and c.handout[0].offset == 0
    assert h.state.tally.served[p.WakeArena] == 1 and h.state.sleepers.wakes == []
    assert [x.asleep for x in h.state.status().sleepers] == []


def test_a_waiting_wake_is_refused_at_its_wait_naming_the_holders_and_answered_if_its_arena_goes(h: Harness) -> None:
    engine, trainer = _asleep_under_a_trainer(h)
    for bad in (-1.0, float("nan"), p.MAX_WAIT_S * 2):
        h.refused(engine, p.WakeArena(name="weights", wait=bad), p.ErrorCode.INVALID_ARGUMENT)
    assert h.state.handle(engine, p.WakeArena(name="weights", wait=2.0), 8).reply is None
    h.clock.now += 1.9
    h.state.tick()
    assert h.state.take_completions() == []
    h.clock.now += 0.1
    h.state.tick()
    (c,) = h.state.take_completions()
    assert isinstance(c.reply, p.ProtocolError) and c.reply.code is p.ErrorCode.OUT_OF_MEMORY
    assert "client 'trainer'" in c.reply.message and "waited 2s" in c.reply.message
    assert h.state.handle(engine, p.WakeArena(name="weights", wait=30.0), 9).reply is None
    h.release(engine, "weights")
    (c,) = h.state.take_completions()
    assert isinstance(c.reply, p.ProtocolError) and c.reply.code is p.ErrorCode.NOT_FOUND and h.state.sleepers.wakes == []


def test_a_kv_pools_wake_is_one_grow_that_waits_for_all_its_rows(make_harness: Callable[..., Harness]) -> None:
    """A KV pool wakes as a plain arena does: one request, answered when all its rows fit
    (KV_GROW's ``wait``); a donor that gives back only part is asked again once it can
    give more, instead of the grow being answered with part and the client growing again."""
    from .test_kv_moves import give_back, shrink_notices, two_pools
    from .test_kv_rounds import commit_reply, done

    h = make_harness()
    a, b = two_pools(h)  # 128 MiB each, the device full
    reply = h.ok(b, p.KvShrink(pool="kvb", tokens=0, sleep=True)).reply
    h.unmapped(b, "kvb", [c.id for c in reply.retired])
    h.ok(a, p.KvDemand(pool="kva", in_use=0))
    assert commit_reply_of(h.ok(a, p.KvGrow(pool="kva", tokens=65536)).reply).pool.tokens == 65536  # the whole device
    assert h.state.handle(b, p.KvGrow(pool="kvb", tokens=32768, wait=30.0), 9).reply is None
    assert shrink_notices(h) == [(a.id, "kva", 32768)]
    h.ok(a, p.KvDemand(pool="kva", in_use=40000))
    give_back(h, a, "kva", 49152)  # its rows past 40000 are live up to 49152: it gives back half of what was asked
    assert done(h) == {}, "a wake waits for all its rows, not for what the first answer freed"
    h.clock.now += 1
    h.state.tick()
    assert done(h) == {} and shrink_notices(h) == []  # a kept its rows live a moment ago: not asked again
    h.ok(a, p.KvDemand(pool="kva", in_use=20000))  # its burst ended
    h.state.tick()
    assert shrink_notices(h) == [(a.id, "kva", 32768)]
    give_back(h, a, "kva", 32768)
    assert commit_reply(done(h)[9]).pool.tokens == 32768
    assert h.state.tally.served[p.KvGrow] == 2 and h.state.arenas.by_name["kvb"].asleep is None  # woken


def commit_reply_of(reply: object) -> p.KvCommitReply:
    assert isinstance(reply, p.KvCommitReply), reply
    return reply


def test_a_waiting_wake_asks_again_once_its_donors_answered_short(make_harness: Callable[..., Harness]) -> None:
    """A donor that keeps its rows live answers with nothing; the wake, still short, asks
    the pools that can give now (as a grow that waits for all its rows does) instead of
    waiting out its wait."""
    from .test_kv_moves import give_back, shrink_notices

    h = make_harness()
    sleeper, a, b = _asleep_beside_two_pools(h)
    assert h.state.handle(sleeper, p.WakeArena(name="weights", wait=30.0), 5).reply is None
    assert [(sid, pool) for sid, pool, _ in shrink_notices(h)] == [(a.id, "kva")]
    h.ok(a, p.KvDemand(pool="kva", in_use=32768))
    h.ok(a, p.KvShrink(pool="kva", tokens=32768))  # every row asked for is live: nothing given
    [(sid, pool, bound)] = shrink_notices(h)
    assert (sid, pool) == (b.id, "kvb") and h.state.take_completions() == []
    give_back(h, b, "kvb", bound)
    (c,) = h.state.take_completions()
    assert c.request_id == 5 and isinstance(c.reply, p.MapReply) and c.reply.arena.committed == 64 * MiB
