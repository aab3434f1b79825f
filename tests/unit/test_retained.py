"""Retained memory on the state alone: what a holder's abnormal end keeps (orphaned,
accounted, with a deadline), who may adopt it (the group's uid with its secret, once
fenced, one adopter), what an adopter's death mid-adoption and the deadline do, and a
restart in between. The fence is a stand-in here (the sessions' pids are made up);
fencing.py's own checks run in the integration tier with real processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.driver.host import HostDriver
from gpumemd.durable import Durable
from gpumemd.records import SessionRecord as Session
from gpumemd.state import DaemonState

from .harness import CAPACITY, Clock, Harness, MiB
from .store_kit import FakeStore
from .test_kv_rounds import capture, commit_reply, declare, done, join

GRACE = 60.0


class Fence:
    """The pids whose process still runs; every other one is fenced."""

    def __init__(self) -> None:
        self.running: set[int] = set()

    def __call__(self, pid: int, since: float) -> str:
        return f"pid {pid} still runs" if pid in self.running else ""


@pytest.fixture
def fence() -> Fence:
    return Fence()


@pytest.fixture
def h(make_harness: Callable[..., Harness], fence: Fence) -> Harness:
    harness = make_harness(retain_grace=GRACE)
    harness.state.retained.writers.fence = fence
    return harness


def group(h: Harness, s: Session, name: str = "g") -> str:
    reply = h.ok(s, p.RetainGroup(group=name)).reply
    assert isinstance(reply, p.RetainGroupReply) and len(reply.secret) == 64
    return reply.secret


def retain(h: Harness, s: Session, name: str, group_name: str = "g") -> None:
    h.ok(s, p.Retain(group=group_name, name=name))


def adopt(h: Harness, s: Session, secret: str, group_name: str = "g") -> tuple[p.AdoptReply, list[int]]:
    outcome = h.ok(s, p.Adopt(group=group_name, secret=secret))
    assert isinstance(outcome.reply, p.AdoptReply)
    return outcome.reply, [c.id for c in outcome.handout]


def retained(h: Harness) -> dict[str, p.RetainedStatus]:
    return {r.group: r for r in h.state.status().retained}


def die(h: Harness, s: Session) -> None:
    """kill -9: the fd channel's EOF, nothing released before it."""
    h.state.close_session(s.id)


def primary_with_arena(h: Harness, nbytes: int = 8 * MiB) -> tuple[Session, str, p.ArenaView]:
    s = h.connect("primary")
    view = h.create(s, "weights-kv", 64 * MiB)
    h.commit(s, "weights-kv", nbytes)
    secret = group(h, s)
    retain(h, s, "weights-kv")
    return s, secret, view


def test_a_retained_arena_outlives_its_owners_death_orphaned_and_accounted(h: Harness) -> None:
    s, _, _ = primary_with_arena(h)
    plain = h.create(s, "scratch", 64 * MiB)
    assert plain.name == "scratch"
    h.commit(s, "scratch", 4 * MiB)
    die(h, s)
    assert set(h.state.arenas.by_name) == {"weights-kv"}  # the unretained arena was reclaimed as before
    assert h.state.arenas.accounted_bytes() == 8 * MiB
    g = retained(h)["g"]
    assert (g.state, g.objects, g.committed_bytes, g.previous, g.previous_pid) == (p.RetainState.ORPHANED, ["weights-kv"], 8 * MiB, "primary", s.pid)
    assert g.deadline_in_s == GRACE and g.fenced and g.holder == ""
    assert not h.state.status().arenas[0].owner_alive


def test_adoption_hands_every_chunk_at_the_same_addresses_and_ownership_moves(h: Harness) -> None:
    s, secret, view = primary_with_arena(h)
    chunks = [c.id for c in h.state.arenas.by_name["weights-kv"].chunks]
    die(h, s)
    standby = h.connect("standby")
    reply, handed = adopt(h, standby, secret)
    (obj,) = reply.objects
    assert obj.arena.address == view.address and obj.arena.committed == 8 * MiB and obj.kv is None
    assert handed == chunks == [c.id for c in obj.chunks]
    assert reply.fd_batches == 1 and reply.previous == f"client 'primary' (pid {s.pid})"
    arena = h.state.arenas.by_name["weights-kv"]
    assert (arena.owner_id, arena.owner_name, arena.owner_alive) == (standby.id, "standby", True)
    assert retained(h)["g"].state is p.RetainState.ADOPTING
    h.ok(standby, p.AdoptDone(group="g"))
    g = retained(h)["g"]
    assert (g.state, g.holder, g.deadline_in_s) == (p.RetainState.HELD, "standby", -1.0)
    # The adopter owns it: it commits, and its own death orphans the group afresh.
    h.commit(standby, "weights-kv", 16 * MiB)
    h.clock.now += 500
    die(h, standby)
    g = retained(h)["g"]
    assert (g.state, g.previous, g.deadline_in_s, g.committed_bytes) == (p.RetainState.ORPHANED, "standby", GRACE, 16 * MiB)


def test_an_ordinary_release_and_close_keep_nothing(h: Harness) -> None:
    s, _, _ = primary_with_arena(h)
    h.release(s, "weights-kv")
    die(h, s)
    assert h.state.arenas.by_name == {} and h.state.arenas.accounted_bytes() == 0
    assert retained(h) == {}


def test_a_wrong_secret_or_another_uid_gets_nothing(h: Harness) -> None:
    s, secret, _ = primary_with_arena(h)
    die(h, s)
    thief = h.connect("thief", uid=2000, gid=2000)
    refused = h.refused(thief, p.Adopt(group="g", secret=secret), p.ErrorCode.PERMISSION_DENIED)  # stolen: right secret, other uid
    assert "uid 1000" in refused.message and secret not in refused.message
    guess = h.connect("guess")
    wrong = "0" * 64
    refused = h.refused(guess, p.Adopt(group="g", secret=wrong), p.ErrorCode.PERMISSION_DENIED)
    assert "wrong secret" in refused.message
    # Nor by attaching: a grant the dead owner made admits nobody to an orphan.
    assert retained(h)["g"].state is p.RetainState.ORPHANED
    assert h.state.arenas.by_name["weights-kv"].attached == set()
    assert all(not c.holders for c in h.state.arenas.by_name["weights-kv"].chunks)


def test_a_grant_of_the_dead_owner_does_not_open_an_orphan(h: Harness) -> None:
    s, _, _ = primary_with_arena(h)
    h.share(s, "weights-kv", "reader")
    die(h, s)
    reader = h.connect("reader")
    h.refused(reader, p.AttachArena(name="weights-kv"), p.ErrorCode.PERMISSION_DENIED)
    assert all(not c.holders for c in h.state.arenas.by_name["weights-kv"].chunks)


def test_two_adopters_one_wins_the_other_is_told_who(h: Harness) -> None:
    s, secret, _ = primary_with_arena(h)
    first, second = h.connect("first"), h.connect("second")
    held = h.refused(first, p.Adopt(group="g", secret=secret), p.ErrorCode.GROUP_HELD)  # the primary lives
    assert held.detail["holder"] == "primary"
    die(h, s)
    adopt(h, first, secret)
    lost = h.refused(second, p.Adopt(group="g", secret=secret), p.ErrorCode.GROUP_HELD)
    assert (lost.detail["holder"], lost.detail["holder_pid"]) == ("first", first.pid)
    assert "first" in lost.message
    assert all(c.holders == {first.id} for c in h.state.arenas.by_name["weights-kv"].chunks)


def test_an_adopter_that_dies_before_confirming_gives_it_back_with_the_same_deadline(h: Harness, fence: Fence) -> None:
    s, secret, _ = primary_with_arena(h)
    die(h, s)
    h.clock.now += 20
    adopter = h.connect("adopter")
    adopt(h, adopter, secret)
    h.clock.now += 10
    fence.running.add(adopter.pid)  # its process lingers: its writes are not over yet
    die(h, adopter)
    g = retained(h)["g"]
    assert (g.state, g.previous, g.deadline_in_s, g.fenced) == (p.RetainState.ORPHANED, "adopter", GRACE - 30, False)
    assert h.state.arenas.accounted_bytes() == 8 * MiB
    late = h.connect("late")
    h.refused(late, p.Adopt(group="g", secret=secret), p.ErrorCode.NOT_FENCED)
    fence.running.clear()
    adopt(h, late, secret)


def test_the_deadline_releases_an_orphan(h: Harness) -> None:
    s, secret, _ = primary_with_arena(h)
    die(h, s)
    h.clock.now += GRACE - 1
    h.state.tick()
    assert h.state.arenas.accounted_bytes() == 8 * MiB
    h.clock.now += 1
    h.state.tick()
    assert h.state.arenas.by_name == {} and h.state.arenas.accounted_bytes() == 0 and retained(h) == {}
    late = h.connect("late")
    h.refused(late, p.Adopt(group="g", secret=secret), p.ErrorCode.NOT_FOUND)


def test_adoption_waits_for_the_fence(h: Harness, fence: Fence) -> None:
    s, secret, _ = primary_with_arena(h)
    fence.running.add(s.pid)
    die(h, s)
    standby = h.connect("standby")
    refused = h.refused(standby, p.Adopt(group="g", secret=secret), p.ErrorCode.NOT_FENCED)
    assert refused.detail["pid"] == s.pid and not retained(h)["g"].fenced
    assert all(not c.holders for c in h.state.arenas.by_name["weights-kv"].chunks)  # nothing handed out
    fence.running.clear()
    adopt(h, standby, secret)


def test_only_the_holder_marks_and_only_what_it_owns(h: Harness) -> None:
    s, _, _ = primary_with_arena(h)
    other = h.connect("other")
    h.create(other, "theirs", 64 * MiB)
    h.refused(other, p.Retain(group="g", name="theirs"), p.ErrorCode.PERMISSION_DENIED)  # not its group
    h.refused(s, p.Retain(group="g", name="theirs"), p.ErrorCode.PERMISSION_DENIED)  # not its arena
    h.refused(other, p.RetainGroup(group="g"), p.ErrorCode.GROUP_HELD)
    stranger = h.connect("stranger", uid=2000, gid=2000)
    h.ok(stranger, p.RetainGroup(group="g"))  # its own: group names are each uid's
    h.ok(s, p.Retain(group="g", name="weights-kv", retained=False))
    die(h, s)
    assert h.state.arenas.by_name.keys() == {"theirs"} and [(r.group, r.uid) for r in h.state.status().retained] == [("g", 2000)]


def test_a_retained_kv_pool_keeps_its_rows_and_its_adopter_grows_it(h: Harness) -> None:
    s = h.connect("primary")
    declare(h, s, "kv", max_tokens=65536)
    join(h, s, "kv")
    capture(h, s, "kv", 1, min_tokens=1024, max_tokens=8192)
    assert commit_reply(done(h)[1]).pool.tokens == 8192
    secret = group(h, s)
    retain(h, s, "kv")
    die(h, s)
    assert h.state.kv.pools["kv"].tokens == 8192 and h.state.arenas.accounted_bytes() == 32 * MiB
    standby = h.connect("standby")
    reply, _ = adopt(h, standby, secret)
    (obj,) = reply.objects
    assert obj.kv is not None and obj.kv.tokens == 8192 and obj.kv.name == "kv"
    grown = h.ok(standby, p.KvGrow(pool="kv", tokens=12288)).reply
    assert isinstance(grown, p.KvCommitReply) and grown.pool.tokens == 12288


Restarted = Callable[..., Harness]


@pytest.fixture
def restart(fence: Fence) -> Iterator[Restarted]:
    """``restart(h)``: the state a restart rebuilds from ``h``'s durable record;
    ``gone``: how it tells a kept session's process is gone (the daemon's is /proc's)."""
    made: list[tuple[Harness, Durable]] = []
    store = FakeStore()

    def run(h: Harness, gone: Callable[[int, float], bool] | None = None) -> Harness:
        first = Durable(store)  # type: ignore[arg-type]
        first.start(h.state, {})
        first.persist(h.state)
        h.state.drop_all()
        first.close()
        clock, wall = Clock(h.clock.now + 5), Clock(h.wall_clock.now + 5)
        again = Harness(DaemonState(HostDriver(index=0, capacity=CAPACITY), h.config, clock, wall, fence, gone), clock, wall)
        second = Durable(store)  # type: ignore[arg-type]
        second.start(again.state, store.passed())
        made.append((again, second))
        return again

    yield run
    for h, durable in reversed(made):
        h.state.drop_all()
        durable.close()
    store.drop()


def test_an_orphan_survives_a_restart_and_is_adopted_after_it(h: Harness, restart: Restarted) -> None:
    s, secret, view = primary_with_arena(h)
    die(h, s)
    h.clock.now += 10
    again = restart(h)
    g = retained(again)["g"]
    assert (g.state, g.objects, g.deadline_in_s, g.committed_bytes) == (p.RetainState.ORPHANED, ["weights-kv"], GRACE - 10, 8 * MiB)
    assert again.state.arenas.tenants.owner_uid(again.state.arenas.by_name["weights-kv"]) == s.uid  # counted against its uid
    standby = again.connect("standby")
    again.refused(standby, p.Adopt(group="g", secret="f" * 64), p.ErrorCode.PERMISSION_DENIED)
    reply, handed = adopt(again, standby, secret)
    assert reply.objects[0].arena.address == view.address and len(handed) == 1


def test_a_holder_that_died_while_the_daemon_was_down_is_orphaned_by_the_restart_at_once(
    h: Harness, fence: Fence, restart: Restarted
) -> None:
    """gpumemd killed during a failover before it saw the primary's end: its session comes
    back waiting to resume, and without a look at its process a standby would wait out the
    whole grace period for the group."""
    s, secret, view = primary_with_arena(h)
    bystander = h.connect("bystander")
    fence.running = {s.pid, bystander.pid}
    fence.running.discard(s.pid)  # killed -9 while the daemon was down: no EOF was ever seen
    again = restart(h, lambda pid, since: pid not in fence.running)
    g = retained(again)["g"]
    assert (g.state, g.previous, g.previous_pid, g.deadline_in_s) == (p.RetainState.ORPHANED, "primary", s.pid, GRACE)
    assert s.id not in again.state.sessions and again.state.sessions[bystander.id].waiting
    reply, _ = adopt(again, again.connect("standby"), secret)
    assert reply.objects[0].arena.address == view.address
    fence.running.clear()  # the bystander dies before it resumed: released at the next tick, not the grace's end
    again.state.tick()
    assert bystander.id not in again.state.sessions and again.state.session_desk.grace_deadline is None


def test_a_kept_holder_that_dies_after_the_restart_is_seen_by_the_next_adopt(h: Harness, fence: Fence, restart: Restarted) -> None:
    """gpumemd back while the primary still exits (on CUDA its context's teardown takes a
    third of a second): the session waits to resume. Once the process is gone, the
    standby's next ADOPT finds the group orphaned, not the tick after (up to 200 ms)."""
    s, secret, view = primary_with_arena(h)
    fence.running = {s.pid}
    again = restart(h, lambda pid, since: pid not in fence.running)
    assert again.state.sessions[s.id].waiting
    standby = again.connect("standby")
    again.refused(standby, p.Adopt(group="g", secret=secret), p.ErrorCode.GROUP_HELD)
    fence.running.clear()  # gone now; no tick has run since
    reply, _ = adopt(again, standby, secret)
    assert reply.objects[0].arena.address == view.address and s.id not in again.state.sessions


@pytest.mark.parametrize("last", ["releases", "dies"])
def test_an_orphans_last_sharer_leaving_does_not_release_it(h: Harness, last: str) -> None:
    s, secret, _ = primary_with_arena(h)
    h.share(s, "weights-kv", "reader")
    h.share(s, "weights-kv", "dying-reader")
    reader, dying = h.connect("reader"), h.connect("dying-reader")
    h.attach(reader, "weights-kv")
    h.attach(dying, "weights-kv")
    die(h, s)
    if last == "releases":
        die(h, dying)
        h.release(reader, "weights-kv")
    else:
        h.release(reader, "weights-kv")
        die(h, dying)
    # Nobody is attached, and the group still waits.
    assert h.state.arenas.accounted_bytes() == 8 * MiB and retained(h)["g"].state is p.RetainState.ORPHANED
    reply, handed = adopt(h, h.connect("standby"), secret)
    assert reply.objects[0].arena.committed == 8 * MiB and handed


def waits_to_adopt(h: Harness, s: Session, secret: str, request_id: int, wait: float = 30.0) -> None:
    """ADOPT with a ``wait``: deferred, answered as a completion later."""
    outcome = h.state.handle(s, p.Adopt(group="g", secret=secret, wait=wait), request_id)
    assert outcome.reply is None and outcome.handout == []
    assert h.state.take_completions() == []


def test_an_adopt_that_waits_is_answered_when_the_holder_dies(h: Harness, fence: Fence) -> None:
    """One ADOPT, deferred while the holder lives, answered at its death (no client
    polling); one not fenced yet at the next look (the tick, or the loop's fence poll)."""
    s, secret, view = primary_with_arena(h)
    standby = h.connect("standby")
    waits_to_adopt(h, standby, secret, 9)
    die(h, s)
    (c,) = h.state.take_completions()
    assert c.request_id == 9 and c.session_id == standby.id and isinstance(c.reply, p.AdoptReply)
    assert [o.arena.address for o in c.reply.objects] == [view.address] and sum(x.size for x in c.handout) == 8 * MiB
    assert h.state.tally.served[p.Adopt] == 1 and retained(h)["g"].state is p.RetainState.ADOPTING
    # Its holder's process lingers after its session's end: answered once the fence passes.
    h.ok(standby, p.AdoptDone(group="g"))
    fence.running.add(standby.pid)
    die(h, standby)
    late = h.connect("late")
    waits_to_adopt(h, late, secret, 10)
    assert h.state.retained.fencing()
    h.state.tick()
    assert h.state.take_completions() == []
    fence.running.clear()
    h.state.tick()
    (c,) = h.state.take_completions()
    assert c.request_id == 10 and isinstance(c.reply, p.AdoptReply) and not h.state.retained.fencing()


def test_a_waiting_adopter_is_told_at_once_when_another_adopter_comes_first(h: Harness, fence: Fence) -> None:
    """The answer the client's loop gave before: once another adopter holds the group,
    waiting longer would not change it (seen orphaned, then held by the winner)."""
    s, secret, _ = primary_with_arena(h)
    fence.running.add(s.pid)
    die(h, s)
    loser, winner = h.connect("loser"), h.connect("winner")
    waits_to_adopt(h, loser, secret, 11)  # not fenced yet
    fence.running.clear()
    adopt(h, winner, secret)  # before the loop looked again
    h.state.tick()
    (c,) = h.state.take_completions()
    assert isinstance(c.reply, p.ProtocolError) and c.reply.code is p.ErrorCode.GROUP_HELD and c.reply.detail["holder"] == "winner"
    # An adoption not confirmed yet is refused at once too, never waited for.
    h.refused(h.connect("third"), p.Adopt(group="g", secret=secret, wait=30.0), p.ErrorCode.GROUP_HELD)


def test_an_adopt_waits_no_longer_than_its_wait_and_a_wrong_secret_waits_not_at_all(h: Harness) -> None:
    s, secret, _ = primary_with_arena(h)
    standby = h.connect("standby")
    h.refused(standby, p.Adopt(group="g", secret="00" * 32, wait=30.0), p.ErrorCode.PERMISSION_DENIED)
    for bad in (-1.0, float("nan"), float("inf"), p.MAX_WAIT_S + 1):
        h.refused(standby, p.Adopt(group="g", secret=secret, wait=bad), p.ErrorCode.INVALID_ARGUMENT)
    waits_to_adopt(h, standby, secret, 12, wait=5.0)
    h.refused(standby, p.Adopt(group="g", secret=secret, wait=5.0), p.ErrorCode.ALREADY_EXISTS)  # one wait at a time
    h.clock.now += 4.9
    h.state.tick()
    assert h.state.take_completions() == []
    h.clock.now += 0.1
    h.state.tick()
    (c,) = h.state.take_completions()
    assert c.request_id == 12 and isinstance(c.reply, p.ProtocolError) and c.reply.code is p.ErrorCode.GROUP_HELD
    assert c.reply.detail["holder"] == "primary" and h.state.retained.adopts == []


def test_an_orphaned_kv_pool_is_asked_nothing_and_its_adopter_is_asked_again(h: Harness) -> None:
    """Nobody can answer for an orphan: the one donor rule skips a pool whose owner is gone,
    so a neighbour's grow is refused at once instead of waiting out --move-timeout for it
    (before, it was asked, and named unanswered at the deadline). Adopted, it is a donor again."""
    from .test_kv_moves import shrink_notices, two_pools

    a, b = two_pools(h)  # 128 MiB each, the device full
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))  # idle: all but its minimum above its share
    secret = group(h, b)
    retain(h, b, "kvb")
    die(h, b)
    h.ok(a, p.KvDemand(pool="kva", in_use=32768))
    refused = h.refused(a, p.KvGrow(pool="kva", tokens=49152), p.ErrorCode.OUT_OF_MEMORY)
    assert refused.detail["available"] == 0 and shrink_notices(h) == [] and h.state.kv.grows == []
    standby = h.connect("standby")
    adopt(h, standby, secret)
    assert h.state.kv.pools["kvb"].owner_id == standby.id
    assert h.state.handle(a, p.KvGrow(pool="kva", tokens=49152), 5).reply is None  # deferred: the adopter is asked
    assert [sid for sid, _, _ in shrink_notices(h)] == [standby.id]


def test_retain_group_names_are_each_uids_own(h: Harness) -> None:
    """Another uid cannot squat a group name (it was one namespace for every user, taken
    for free): each uid opens, holds and adopts its own group of a name; a session of the
    other uid is still refused the one that is not its own, secret or not."""
    s, secret, _ = primary_with_arena(h)
    other = h.connect("other", uid=2000, gid=2000)
    h.create(other, "theirs", 64 * MiB)
    h.commit(other, "theirs", 4 * MiB)
    theirs = group(h, other)  # the same name, uid 2000's own
    assert theirs != secret
    retain(h, other, "theirs")
    assert {(r.group, r.uid) for r in h.state.status().retained} == {("g", 1000), ("g", 2000)}
    die(h, s)
    die(h, other)
    adopt(h, h.connect("standby"), secret)  # uid 1000's group, whatever uid 2000 named its own
    thief = h.connect("thief", uid=3000, gid=3000)
    h.refused(thief, p.Adopt(group="g", secret=theirs), p.ErrorCode.PERMISSION_DENIED)
    reply, _ = adopt(h, h.connect("standby-2000", uid=2000, gid=2000), theirs)
    assert [o.arena.name for o in reply.objects] == ["theirs"]


def test_an_empty_or_partial_secret_adopts_nothing(h: Harness) -> None:
    """The whole secret, compared as a whole: no prefix of it (the empty one above all)
    passes for it."""
    s, secret, _ = primary_with_arena(h)
    die(h, s)
    guess = h.connect("guess")
    for wrong in ("", secret[:1], secret[:32], secret[:-1], secret + "0"):
        refused = h.refused(guess, p.Adopt(group="g", secret=wrong), p.ErrorCode.PERMISSION_DENIED)
        assert "wrong secret" in refused.message
        h.refused(guess, p.RetainReserve(group="g", secret=wrong), p.ErrorCode.PERMISSION_DENIED)
    assert retained(h)["g"].state is p.RetainState.ORPHANED
    adopt(h, guess, secret)


def test_a_group_being_adopted_does_not_expire_at_its_deadline(h: Harness) -> None:
    """An adopter that has not confirmed yet holds the group: the orphan's deadline
    releases nothing under it (its own death gives the deadline back)."""
    s, secret, _ = primary_with_arena(h)
    die(h, s)
    adopter = h.connect("adopter")
    adopt(h, adopter, secret)
    h.clock.now += GRACE + 1
    h.state.tick()
    g = retained(h)["g"]
    assert g.state is p.RetainState.ADOPTING and g.committed_bytes == 8 * MiB
    assert h.state.arenas.by_name["weights-kv"].owner_id == adopter.id
    h.ok(adopter, p.AdoptDone(group="g"))
    assert retained(h)["g"].state is p.RetainState.HELD


def test_a_commit_round_does_not_ask_an_orphaned_pool_to_shrink(h: Harness) -> None:
    """Nobody can answer for an orphan: a new engine's round whose minimum does not fit
    beside an orphaned retained pool fails at once, not at its deadline after asking the
    dead owner; adopted, the pool is asked like any."""
    from .test_kv_rounds import fill_with, round_status

    a = h.connect("engine-a")
    fill_with(h, a, "kva")  # the whole device
    secret = group(h, a)
    retain(h, a, "kva")
    die(h, a)
    b = h.connect("engine-b")
    declare(h, b, "kvb")
    join(h, b, "kvb")
    capture(h, b, "kvb", 5, min_tokens=8192)
    (c,) = done(h).values()
    assert isinstance(c.reply, p.ProtocolError) and round_status(h, 2).state == "failed"
    assert h.state.take_notices() == [] and h.state.kv.pools["kva"].shrink_request is None
    standby = h.connect("standby")
    adopt(h, standby, secret)
    join(h, b, "kvb")
    capture(h, b, "kvb", 6, min_tokens=8192)
    assert [(sid, n.arena) for sid, n in h.state.take_notices() if n.kind is p.NoticeKind.KV_SHRINK] == [(standby.id, "kva")]


def test_an_adoption_waits_for_every_other_mapping_and_the_dead_owners_grants_die(h: Harness, fence: Fence) -> None:
    """The fence covers every writer, not the holder's pid alone: a sharer the dead owner
    admitted (its uid's or another's) keeps the adoption NOT_FENCED while it maps the
    memory (told to let go when the owner died), and one that ended is fenced as the
    holder is; the reply names them. The dead owner's grants die with the adoption: a
    fresh session of the uid it shared with attaches nothing afterwards."""
    s, secret, _ = primary_with_arena(h)
    token = h.share(s, "weights-kv", uid=2000)
    h.share(s, "weights-kv", "mate")
    other, mate = h.connect("other", uid=2000, gid=2000), h.connect("mate")
    h.attach(other, "1000/weights-kv", token)
    h.attach(mate, "weights-kv")
    told = {sid for sid, n in h.state.close_session(s.id) if n.kind is p.NoticeKind.ARENA_RETIRED and "release it" in n.message}
    assert told == {other.id, mate.id}
    standby = h.connect("standby")
    refused = h.refused(standby, p.Adopt(group="g", secret=secret), p.ErrorCode.NOT_FENCED)
    assert refused.detail["sharers"] == 2 and "client 'other'" in refused.message and "client 'mate'" in refused.message
    h.release(mate, "weights-kv")
    refused = h.refused(standby, p.Adopt(group="g", secret=secret), p.ErrorCode.NOT_FENCED)
    assert refused.detail == {"group": "g", "pid": other.pid, "sharers": 1}
    fence.running.add(other.pid)  # it died, its process lingers
    die(h, other)
    refused = h.refused(standby, p.Adopt(group="g", secret=secret), p.ErrorCode.NOT_FENCED)
    assert refused.detail["pid"] == other.pid and "client 'other'" in refused.message
    fence.running.clear()
    reply, _ = adopt(h, standby, secret)
    assert reply.waited_for == [f"client 'primary' (pid {s.pid})", f"client 'other' (pid {other.pid}, session {other.id})"]
    arena = h.state.arenas.by_name["weights-kv"]
    assert arena.attached == {standby.id} and arena.grants == []
    h.ok(standby, p.AdoptDone(group="g"))
    late = h.connect("late", uid=2000, gid=2000)
    h.refused(late, p.AttachArena(name="1000/weights-kv", token=token), p.ErrorCode.PERMISSION_DENIED)
    (view,) = [a for a in h.state.status().arenas if a.name == "weights-kv"]
    assert view.attached == ["standby"] and view.grants == []


@pytest.mark.parametrize("kind", ["host", "cuda"])
def test_a_holder_the_daemon_sees_as_pid_0_is_fenced_by_its_sessions_end(h: Harness, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Outside gpumemd's pid namespace (the shipped DaemonSet) every client is pid 0: no
    /proc entry can say it died, and its fd channel's hang-up is the proof. On the host
    backend at once (the address space is gone before the descriptors close); on CUDA
    HIDDEN_SETTLE_S later (the context outlives the descriptors by milliseconds)."""
    from gpumemd.retain_fence import HIDDEN_SETTLE_S

    monkeypatch.setattr(h.state.arenas.driver, "kind", kind)
    s = h.connect("primary", pid=0)
    h.create(s, "weights-kv", 64 * MiB)
    h.commit(s, "weights-kv", 8 * MiB)
    secret = group(h, s)
    retain(h, s, "weights-kv")
    die(h, s)
    assert retained(h)["g"].fenced is (kind == "host")  # status says what ADOPT would
    standby = h.connect("standby", pid=0)
    if kind == "cuda":
        refused = h.refused(standby, p.Adopt(group="g", secret=secret), p.ErrorCode.NOT_FENCED)
        assert "another pid namespace" in refused.message
        h.clock.now += HIDDEN_SETTLE_S
    reply, _ = adopt(h, standby, secret)
    assert reply.waited_for == ["client 'primary' (pid 0)"]


def test_a_process_that_still_maps_the_memory_keeps_the_adoption_waiting(h: Harness) -> None:
    """On the host backend a forked child of the dead holder keeps its mappings with no
    session and every descriptor closed: /proc/PID/maps is what shows it, and ADOPT is
    NOT_FENCED naming its pid until it exits. (The stand-in child here maps the chunk's
    memfd and closes the descriptor, as such a child would.)"""
    import subprocess
    import sys

    s, secret, _ = primary_with_arena(h)
    chunk = h.state.arenas.by_name["weights-kv"].chunks[0]
    fd = h.state.arenas.driver.chunk_fd(chunk.handle)
    child = subprocess.Popen(
        [sys.executable, "-c", f"import mmap, os, sys\nm = mmap.mmap({fd}, {chunk.size})\nos.close({fd})\nprint('mapped', flush=True)\nsys.stdin.read()"],
        pass_fds=[fd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "mapped\n"
        die(h, s)
        standby = h.connect("standby")
        refused = h.refused(standby, p.Adopt(group="g", secret=secret), p.ErrorCode.NOT_FENCED)
        assert refused.detail["pid"] == child.pid and "/proc/PID/maps" in refused.message
    finally:
        child.communicate("", timeout=30)
    h.clock.now += 1  # past the scan it found the child by
    adopt(h, standby, secret)
