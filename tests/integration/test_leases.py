"""Leases on graph pools against a real gpumemd (host backend) and real client processes:
conflicts that name the holder, bounded waits, kill -9 of a holder and of a waiter, a
buggy client scribbling over a pool's lease slot, contention among 2 and 8 processes
with a shared invariant, and what ``gpumemctl`` shows.

The test process owns the arena and registers synthetic shared graph pools in it (the
host backend has no torch pool); the contenders are ``tests/clients.py shell``
processes the arena is shared with, which attach it and open the pools (that is what
brings them the pools' lease segments), so a kill -9 of one of them never takes a pool
with it. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpumem
from conftest import child_env
from gpumem_shared import lease_table
from gpumem_shared.lease_table import LeaseKind
from gpumem_shared import protocol as p
from gpumemd_testkit import MiB, status, wait_status

ARENA = "graphs"
CONTENTION_SECONDS = 10.0  # long enough for rare interleavings (a waiter woken as another takes it) to turn up


@pytest.fixture
def host_daemon(daemon_factory: Any) -> Any:
    return daemon_factory("host")


class Owner:
    """The test process's session: owns the arena and the graph pools in it."""

    def __init__(self, runtime_dir: Path) -> None:
        self.session = gpumem.connect(0, name="pool-owner", runtime_dir=runtime_dir, timeout=10.0)
        self.arena = self.session.create_arena(ARENA, 1 << 30)
        self.arena.commit(64 * MiB)
        self._next = 0

    def register(self, label: str = "decode") -> gpumem.GraphPool:
        extent = p.Extent(offset=self._next, size=4 * MiB)
        self._next += 4 * MiB
        return self.arena.register_graph_pool(label, extents=[extent], free_runs=[], shared=True)

    def slot(self, pool: gpumem.GraphPool) -> Any:
        return pool.segment._slot

    def wait_waiters(self, pool: gpumem.GraphPool, n: int = 1, timeout: float = 10.0) -> None:
        """Until ``n`` processes are counted asleep on the pool's slot."""
        deadline = time.monotonic() + timeout
        while self.slot(pool).waiters < n:
            assert time.monotonic() < deadline, f"no {n} waiter(s) on graph pool {pool.id} within {timeout}s"
            time.sleep(0.005)
        time.sleep(0.02)

    def wait_word(self, pool: gpumem.GraphPool, want: int, timeout: float, what: str) -> float:
        """Until the pool's slot holds ``want``; returns how long that took."""
        start = time.monotonic()
        while pool.segment.peek() != want:
            assert time.monotonic() - start < timeout, f"{what}: graph pool {pool.id}'s word still {pool.segment.peek():#x} after {timeout}s"
            time.sleep(0.002)
        return time.monotonic() - start


@pytest.fixture
def owner(host_daemon: Any, runtime_dir: Path) -> Iterator[Owner]:
    o = Owner(runtime_dir)
    yield o
    o.session.close()


@pytest.fixture
def shell(run_client: Any, host_daemon: Any) -> Any:
    """``shell(name)``: a connected client process."""

    def start(name: str) -> Any:
        c = run_client("shell", name)
        c.expect("CONNECTED", timeout=30)
        return c

    return start


@pytest.fixture
def contender(owner: Owner, shell: Any) -> Any:
    """``contender(name)``: a client process the owner's arena is shared with, attached:
    it opens a pool the first time it leases it."""

    def start(name: str) -> Any:
        owner.arena.share(name)
        c = shell(name)
        ask(c, f"attach {ARENA}")
        return c

    return start


def ask(client: Any, line: str, timeout: float = 30.0) -> str:
    """One command; its result (after OK), or AssertionError with the ERR line."""
    client.send(line)
    return answer(client, timeout)


def answer(client: Any, timeout: float = 30.0) -> str:
    out = client.expect("", timeout=timeout)
    assert out.startswith("OK"), f"{out!r}"
    return out[2:].strip()


def logged(daemon: Any, text: str, timeout: float = 5.0) -> bool:
    """Whether the daemon's log says ``text`` within ``timeout``: it logs a sweep after the
    clear that wakes the waiters, so its log may trail what the clients already see."""
    deadline = time.monotonic() + timeout
    while text not in daemon.log():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def refused(client: Any, line: str, timeout: float = 30.0) -> dict[str, Any]:
    """A command that must fail with a GpuMemError: its class, message and detail."""
    result = json.loads(ask(client, f"errinfo {line}", timeout))
    assert "error" in result, f"{line!r} did not fail: {result}"
    return result  # type: ignore[no-any-return]


# =========================================================================== conflicts


def test_a_conflict_names_the_holder_for_every_pair_of_kinds(owner: Owner, contender: Any) -> None:
    pool = owner.register()
    holder, other = contender("holder-a"), contender("engine-b")
    for held in ("capture", "replay", "borrow"):
        assert ask(holder, f"lease {held} {pool.id} 0 held-by-a-{held}") == held
        for wanted in ("capture", "replay", "borrow"):
            r = refused(other, f"lease {wanted} {pool.id} 0 wanted-{wanted}")
            assert r["error"] == "LeaseConflict", r
            msg = r["message"]
            for part in ("'holder-a'", f"pid {holder.pid}", f"its {held} lease", f"'held-by-a-{held}'", f"graph pool {pool.id}", wanted):
                assert part in msg, f"{part!r} missing from {msg!r}"
            assert r["detail"] == {"holder": "holder-a", "pid": holder.pid, "kind": held, "label": f"held-by-a-{held}"}
        # the holder itself cannot take it twice either
        assert refused(holder, f"lease replay {pool.id} 0 again")["error"] == "LeaseConflict"
        assert ask(holder, f"unlease {pool.id}") == ""
    assert ask(other, f"lease capture {pool.id} 0 free-now") == "capture"
    assert ask(other, f"unlease {pool.id}") == ""


def test_a_bounded_wait_succeeds_when_the_holder_lets_go_in_time_and_fails_when_not(owner: Owner, contender: Any) -> None:
    pool = owner.register()
    a, b = contender("holder-a"), contender("waiter-b")
    assert ask(a, f"lease capture {pool.id} 0 long-capture") == "capture"
    b.send(f"lease replay {pool.id} 10 patient")
    owner.wait_waiters(pool)
    released = time.monotonic()
    assert ask(a, f"unlease {pool.id}") == ""
    assert answer(b, timeout=15) == "replay"
    handoff = time.monotonic() - released
    assert handoff < 1.0, f"the waiter got the lease {handoff:.3f}s after the release"
    # now b holds it and does not let go: a's bounded wait runs out
    start = time.monotonic()
    r = refused(a, f"lease capture {pool.id} 0.4 impatient")
    waited = time.monotonic() - start
    assert r["error"] == "LeaseConflict" and "after waiting 0.4s" in r["message"], r
    assert r["detail"]["holder"] == "waiter-b" and r["detail"]["kind"] == "replay" and r["detail"]["label"] == "patient"
    assert 0.4 <= waited < 5.0, f"a 0.4s wait answered after {waited:.3f}s"
    assert owner.slot(pool).waiters == 0
    assert ask(b, f"unlease {pool.id}") == ""


def test_the_client_library_stale_epoch_double_release_and_sweep(owner: Owner, contender: Any) -> None:
    pool = owner.register()
    s = owner.session
    with s.replay(pool, label="in-process") as lease:
        assert lease.held
        h = pool.segment.holder()
        assert h is not None and (h.kind_name, h.session, h.pid, h.label) == ("replay", s.session_id, os.getpid(), "in-process")
    assert not lease.held and pool.segment.peek() == 0
    with pytest.raises(gpumem.LeaseNotHeld, match="already released"):
        lease.release()
    # A recapture bumps the epoch: the old view is stale, a fresh one works.
    extents = [p.Extent(offset=e.offset, size=e.size) for e in pool.extents]
    fresh = gpumem.GraphPool(owner.arena, s.call(p.UpdateGraphPool(pool_id=pool.id, extents=extents, free_runs=[], recaptured=True)).pool, pool.segment)
    with pytest.raises(gpumem.StaleEpoch, match=f"graph pool {pool.id}"):
        s.capture(pool)
    with pytest.raises(gpumem.StaleEpoch):
        s.borrow(pool, user="x", wait=1.0)
    s.capture(fresh, label="recapture").release()
    # Retiring a pool under a held lease sweeps it: the holder learns at release.
    lease = gpumem.Lease.acquire(s.leasing, fresh, LeaseKind.BORROW, "doomed", 0)
    s.call(p.RetireGraphPool(pool_id=fresh.id))
    with pytest.raises(gpumem.LeaseNotHeld, match="no longer held"):
        lease.release()
    with pytest.raises(gpumem.StaleEpoch):
        s.replay(fresh)
    # A client process's view of a retired pool is stale too, and stays so once another
    # pool is registered: that one has a segment of its own.
    other = owner.register("other")
    c = contender("client-c")
    assert json.loads(ask(c, f"gpview {other.id}"))["id"] == other.id
    s.call(p.RetireGraphPool(pool_id=other.id))
    assert other.segment.epoch() == 0
    assert refused(c, f"lease replay {other.id} 0 x")["error"] == "StaleEpoch"
    reused = owner.register("reused")
    assert reused.segment.address != other.segment.address and other.segment.epoch() == 0
    assert refused(c, f"lease replay {other.id} 2 x")["error"] == "StaleEpoch"
    assert ask(c, f"lease replay {reused.id} 0 new") == "replay"
    assert ask(c, f"unlease {reused.id}") == ""
    assert status(owner.session.endpoints.runtime_dir)["leases"] == []


# =========================================================================== dead holders and waiters


def test_kill_9_of_a_holder_hands_the_lease_to_a_waiter_in_another_process(owner: Owner, contender: Any, host_daemon: Any) -> None:
    pool = owner.register()
    a, b = contender("doomed-holder"), contender("waiter-b")
    assert ask(a, f"lease capture {pool.id} 0 dying") == "capture"
    b.send(f"lease replay {pool.id} 10 waiting")
    owner.wait_waiters(pool)
    killed = time.monotonic()
    a.proc.send_signal(signal.SIGKILL)
    assert answer(b, timeout=15) == "replay"
    took = time.monotonic() - killed
    assert took < 1.0, f"the waiter got the lease {took:.3f}s after the holder's kill -9"
    # The pool moved to a fresh segment (a user lost its right): the daemon's view of it.
    [held] = status(owner.session.endpoints.runtime_dir)["leases"]
    assert (held["pool_id"], held["pid"], held["kind"], held["label"]) == (pool.id, b.pid, "replay", "waiting")
    assert logged(host_daemon, "swept a capture lease"), host_daemon.log()
    assert ask(b, f"unlease {pool.id}") == ""


def test_kill_9_of_the_pool_owner_wakes_its_waiters_with_a_stale_epoch(runtime_dir: Path, shell: Any) -> None:
    o = shell("owner-o")
    ask(o, f"create {ARENA} {1 << 30}")
    ask(o, f"commit {ARENA} {32 * MiB}")
    pool = json.loads(ask(o, f"gpregister {ARENA} decode 0 {4 * MiB} shared"))
    h, w = shell("holder-h"), shell("waiter-w")
    for name, c in (("holder-h", h), ("waiter-w", w)):
        ask(o, f"share {ARENA} {name}")
        ask(c, f"attach {ARENA}")
    assert ask(h, f"lease capture {pool['id']} 0 held") == "capture"
    w.send(f"errinfo lease replay {pool['id']} 10 waiting")
    deadline = time.monotonic() + 10
    while json.loads(ask(h, f"peek {pool['id']}"))["waiters"] < 1:
        assert time.monotonic() < deadline, "the waiter never slept on the slot"
        time.sleep(0.01)
    killed = time.monotonic()
    o.proc.send_signal(signal.SIGKILL)
    r = json.loads(answer(w, timeout=15))
    assert r["error"] == "StaleEpoch", r
    assert time.monotonic() - killed < 1.0
    r = refused(h, f"unlease {pool['id']}")
    assert r["error"] == "LeaseNotHeld", r
    assert status(runtime_dir)["extents"] == [] and status(runtime_dir)["leases"] == []


def test_kill_9_of_a_waiter_leaves_nothing_held(owner: Owner, contender: Any) -> None:
    pool = owner.register()
    a, b, c = contender("holder-a"), contender("doomed-waiter"), contender("next-c")
    assert ask(a, f"lease borrow {pool.id} 0 borrowed") == "borrow"
    b.send(f"lease capture {pool.id} 20 never")
    owner.wait_waiters(pool)
    b.kill()
    wait_status(owner.session.endpoints.runtime_dir, lambda s: "doomed-waiter" not in [c["name"] for c in s["clients"]], 5, "the waiter's session closed")
    # The pool moved to a fresh segment (a user lost its right), the holder's lease with it.
    [held] = status(owner.session.endpoints.runtime_dir)["leases"]
    assert (held["pool_id"], held["pid"], held["kind"]) == (pool.id, a.pid, "borrow"), "a waiter's death does not touch the holder"
    assert ask(a, f"unlease {pool.id}") == ""
    assert status(owner.session.endpoints.runtime_dir)["leases"] == []
    start = time.monotonic()
    assert ask(c, f"lease capture {pool.id} 0 next") == "capture"
    assert ask(c, f"unlease {pool.id}") == ""
    assert ask(a, f"lease replay {pool.id} 1 again") == "replay"
    assert ask(a, f"unlease {pool.id}") == ""
    assert time.monotonic() - start < 5.0
    assert status(owner.session.endpoints.runtime_dir)["leases"] == []
    assert pool.segment.peek() == 0


def _ids(client: Any) -> tuple[int, int]:
    """(session id, pid) of a shell client, from the daemon's status."""
    s = json.loads(ask(client, "status"))
    [entry] = [c for c in s["clients"] if c["pid"] == client.pid]
    return int(entry["session_id"]), client.pid


# What a refusal may take past the taker's own wait, measured here: the command's round
# trip to the client process and the status request that names the releaser, on a loaded
# machine. The refusals used to come 1 s past the wait (2 s for wait=0.5).
ROUND_TRIP_S = 0.3


def test_a_releaser_stopped_mid_record_is_named_and_its_death_frees_the_pool(owner: Owner, contender: Any) -> None:
    """A shared pool's release frees the slot, then records the releaser's event, in one
    native call. A releaser stopped between the two (SIGSTOP, a hung driver call) holds
    takers for their own wait at most (wait=0: not at all), and they are told who; once
    it dies, the daemon clears its mark and the pool is usable again."""
    pool = owner.register()
    a, b = contender("stuck-releaser"), contender("taker-b")
    assert ask(a, f"lease replay {pool.id} 0 first") == "replay"
    assert ask(a, f"unlease {pool.id}") == ""
    session_a, _ = _ids(a)
    assert owner.slot(pool).handoff == lease_table.word_session(session_a)
    a.proc.send_signal(signal.SIGSTOP)
    owner.slot(pool).handoff = lease_table.word_session(session_a) | lease_table.HANDOFF_RECORDING  # a's state when stopped
    for wait in (0, 0.5):
        started = time.monotonic()
        r = refused(b, f"lease borrow {pool.id} {wait} after-a")
        waited = time.monotonic() - started
        assert r["error"] == "LeaseConflict", r
        for part in ("'stuck-releaser'", f"pid {a.pid}", "not recorded the event", f"graph pool {pool.id}", "borrow lease 'after-a'"):
            assert part in r["message"], f"{part!r} missing from {r['message']!r}"
        assert r["detail"] == {"holder": "stuck-releaser", "pid": a.pid}
        assert wait <= waited < wait + ROUND_TRIP_S, f"refused after {waited:.2f}s with wait={wait}"
        assert pool.segment.peek() == 0, "the refused take was given back"
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    assert ask(b, f"lease borrow {pool.id} 10 after-death", timeout=20) == "borrow"
    assert owner.slot(pool).handoff == 0, "the daemon forgot the dead releaser"
    assert ask(b, f"unlease {pool.id}") == ""


def test_a_record_landing_within_the_takers_wait_hands_the_pool_over(owner: Owner, contender: Any) -> None:
    """A releaser stopped mid-record that resumes within a taker's wait: the taker, told
    "still recording" at its first try, keeps waiting and takes the pool."""
    pool = owner.register()
    a, b = contender("slow-releaser"), contender("patient-b")
    assert ask(a, f"lease replay {pool.id} 0 first") == "replay"
    assert ask(a, f"unlease {pool.id}") == ""
    session_a, _ = _ids(a)
    a.proc.send_signal(signal.SIGSTOP)
    owner.slot(pool).handoff = lease_table.word_session(session_a) | lease_table.HANDOFF_RECORDING  # a's state when stopped
    session_b, _ = _ids(b)
    mine = lease_table.encode(LeaseKind.BORROW, session_b, b.pid)
    futex = owner.slot(pool).futex
    b.send(f"lease borrow {pool.id} 20 after-a")
    # b's first try took the slot and gave it back (the release bumps the futex word);
    # its waiting take holds it now, until the record lands or its wait runs out.
    deadline = time.monotonic() + 15
    while not (owner.slot(pool).futex != futex and pool.segment.peek() == mine):
        assert time.monotonic() < deadline, "the taker never held the slot waiting for the record"
        time.sleep(0.002)
    owner.slot(pool).handoff = lease_table.word_session(session_a)  # the record lands
    a.proc.send_signal(signal.SIGCONT)
    assert answer(b, timeout=30) == "borrow"
    assert ask(b, f"unlease {pool.id}") == ""
    assert owner.slot(pool).handoff == lease_table.word_session(session_b), "b's release named b: it had taken the pool"


# =========================================================================== a buggy client


def test_garbage_in_a_slot_is_cleared_within_a_second_and_leases_work_again(owner: Owner, contender: Any, shell: Any, host_daemon: Any) -> None:
    pools = [owner.register(f"p{i}") for i in range(3)]
    buggy, user = contender("buggy"), contender("user-u")
    outsider = shell("outsider")  # connected, but the arena is not shared with it
    garbage = {
        pools[0].id: 0x09 << 56 | 0x000042_00000001,  # a kind that does not exist
        pools[1].id: lease_table.encode(LeaseKind.REPLAY, 0xABCDE, 4242),  # a session that does not exist
        pools[2].id: lease_table.encode(LeaseKind.CAPTURE, *_ids(outsider)),  # a session that may not use the pool
    }
    # While the garbage lasts (a tick may clear it at any time): an impatient acquire is
    # refused, saying what it found.
    ask(user, f"open {pools[0].id}")
    r = refused(user, f"scribble+lease {pools[0].id} {garbage[pools[0].id]:x} capture 0 impatient")
    assert r["error"] == "LeaseConflict" and "impossible value" in r["message"], r
    for pool in pools:
        assert ask(buggy, f"scribble {pool.id} word {garbage[pool.id]:x}") == ""
    for pool in pools:
        took = owner.wait_word(pool, 0, 1.0, "the daemon's tick clears garbage")
        assert took < 1.0
    assert logged(host_daemon, "an unknown kind 9"), host_daemon.log()
    assert logged(host_daemon, f"client 'outsider' (pid {outsider.pid}), which may not use the pool"), host_daemon.log()
    for pool in pools:
        assert ask(user, f"lease capture {pool.id} 0 works-again") == "capture"
        assert ask(user, f"unlease {pool.id}") == ""
    # A patient acquire rides out the garbage: it has the lease within about a tick.
    for pool in pools[:2]:
        assert ask(buggy, f"scribble {pool.id} word {garbage[pool.id]:x}") == ""
        start = time.monotonic()
        assert ask(user, f"lease replay {pool.id} 3 patient") == "replay"
        assert time.monotonic() - start < 1.0
        assert ask(user, f"unlease {pool.id}") == ""
    # Garbage over a held lease: the daemon repairs the slot, the holder learns at release.
    assert ask(user, f"lease borrow {pools[2].id} 0 overwritten") == "borrow"
    assert ask(buggy, f"scribble {pools[2].id} word {0xFF << 56:x}") == ""
    owner.wait_word(pools[2], 0, 1.0, "the daemon's tick clears garbage over a holder")
    assert refused(user, f"unlease {pools[2].id}")["error"] == "LeaseNotHeld"
    s = status(owner.session.endpoints.runtime_dir)
    assert s["leases"] == []
    repairs = {g["id"]: g["lease_repairs"] for g in s["graph_pools"]}
    # One per clear; the first pool's two scribbles in a row may fall within one tick.
    assert repairs[pools[0].id] in (2, 3) and (repairs[pools[1].id], repairs[pools[2].id]) == (2, 2), repairs
    assert ask(buggy, "ping") == "", "the buggy client is not disconnected for it"


# =========================================================================== contention


@pytest.mark.parametrize("processes", [2, 8])
def test_contention_keeps_exclusion_and_everyone_progresses(owner: Owner, contender: Any, runtime_dir: Path, processes: int) -> None:
    pool = owner.register()
    shm = runtime_dir / "counter"
    shm.write_bytes(bytes(4096))
    clients = [contender(f"loop-{i}") for i in range(processes)]
    for i, c in enumerate(clients):
        c.send(f"leaseloop {pool.id} {CONTENTION_SECONDS} {shm} {i}")
    results = [json.loads(answer(c, timeout=CONTENTION_SECONDS + 30)) for c in clients]
    inside, total = struct.unpack_from("qq", shm.read_bytes(), 0)
    counts = [r["count"] for r in results]
    contended = [r["contended"] for r in results]
    print(f"{processes} processes, {CONTENTION_SECONDS}s: counts {counts}, contended {contended}, longest waits {[round(r['longest_wait'], 4) for r in results]}")
    assert sum(r["violations"] for r in results) == 0, results
    assert inside == 0
    assert total == sum(counts), f"lost updates to the shared counter: {total} != {sum(counts)} (exclusion failed)"
    assert all(n > 0 for n in counts), f"a process made no progress: {counts}"
    assert sum(contended) > 0, "the processes never found the lease held: no contention was tested"
    assert sum(r["conflicts"] for r in results) == 0, f"a 5s wait ran out: {results}"
    assert pool.segment.peek() == 0
    assert status(runtime_dir)["leases"] == []


# =========================================================================== gpumemctl


def ctl(runtime_dir: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
    )
    assert result.returncode == 0 and result.stderr == "", result
    return result.stdout


def test_gpumemctl_status_json_shows_a_held_lease(owner: Owner, contender: Any, runtime_dir: Path) -> None:
    pool, idle = owner.register("decode"), owner.register("idle")
    a = contender("borrower-a")
    before = time.time()
    assert ask(a, f"lease borrow {pool.id} 0 EAGLE-probability-borrow") == "borrow"
    after = time.time()
    s = json.loads(ctl(runtime_dir, "status", "--json"))
    [entry] = s["leases"]
    since = entry.pop("since")
    assert entry == {
        "pool_id": pool.id,
        "slot": 0,  # deprecated: each pool's slot is in its own segment
        "kind": "borrow",
        "holder": "borrower-a",
        "pid": a.pid,
        "label": "EAGLE-probability-borrow",
    }
    assert before - 0.01 <= since <= after + 0.01
    assert idle.id not in [e["pool_id"] for e in s["leases"]]
    assert [e["pool_id"] for e in json.loads(ctl(runtime_dir, "leases", "--json"))] == [pool.id]
    text = ctl(runtime_dir, "status")
    assert "borrower-a" in text and "EAGLE-probability-borrow" in text
    assert ask(a, f"unlease {pool.id}") == ""
    assert json.loads(ctl(runtime_dir, "status", "--json"))["leases"] == []


def test_our_own_lease_carried_across_a_move_is_not_taken_for_a_forgery(owner: Owner, contender: Any) -> None:
    """A sharer leaving moves the pool while one thread of ours holds a replay: another
    thread of ours that follows the pool finds our word there and must leave it (it is
    held), then take the pool once the replay is given back where the pool went."""
    pool = owner.register()
    leaving = contender("leaving-l")
    ask(leaving, f"open {pool.id}")
    old = pool.segment
    replaying = owner.session.replay(pool, label="across-the-move")
    ask(leaving, f"release {ARENA}")
    with pytest.raises(gpumem.LeaseConflict) as refused_:
        gpumem.Lease.acquire(owner.session.leasing, pool, LeaseKind.BORROW, "the-other-thread", 0.0)
    assert "'across-the-move'" in str(refused_.value), refused_.value
    assert not pool.segment.same_memory(old), "the refused take followed the pool"
    replaying.release()
    with gpumem.Lease.acquire(owner.session.leasing, pool, LeaseKind.BORROW, "the-other-thread", 0.0):
        assert pool.segment.holder().label == "the-other-thread"  # type: ignore[union-attr]
    assert status(owner.session.endpoints.runtime_dir)["leases"] == []
