"""A restart without losing anything, through a stand-in for systemd's fd store
(fdstore_kit.py): the state comes back, clients resume by themselves, and whatever a
store or a client gets wrong is a log line and a typed error, never another client's
objects, never a leak."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import gpumem
from conftest import child_env
from fdstore_kit import Restartable
from gpumem_shared import protocol as p
from gpumemd_testkit import (
    MiB, RawControl, RawSession, assert_error, decode, do, envelope, fd_connect, fd_recv, os_close_all, reply, status, wait_status,
)

Service = Callable[..., Restartable]

# A KV round here commits within seconds, on a loaded machine too. One that a failed test
# leaves open must not hold a session past the test (its close at teardown waits for a
# call in progress): a wait in the test gives up after ROUND_WAIT_S, and the daemon ends
# the round at ROUND_TIMEOUT_S (its default deadline is 300 s).
ROUND_TIMEOUT_S = 30
ROUND_WAIT_S = 20.0


@pytest.fixture
def service(runtime_dir: Path) -> Iterator[Service]:
    made: list[Restartable] = []

    def make(backend: str = "host", args: tuple[str, ...] = ()) -> Restartable:
        r = Restartable(runtime_dir, backend, ["--round-timeout", str(ROUND_TIMEOUT_S), *args], child_env(runtime_dir))
        made.append(r)
        return r.start()

    yield make
    for r in made:
        r.close()


Connect = Callable[..., gpumem.Session]


@pytest.fixture
def connect(service: Service, runtime_dir: Path) -> Iterator[Connect]:
    """Sessions of this process, closed at the end whatever happened: an arena left mapped
    would keep the device's address slice reserved here, and the next test's daemon of
    the same device could not be used from this process."""
    opened: list[gpumem.Session] = []

    def make(name: str, timeout: float = 20.0) -> gpumem.Session:
        opened.append(gpumem.connect(0, name, runtime_dir=runtime_dir, timeout=timeout))
        return opened[-1]

    yield make
    for session in opened:
        session.channel.timeout = 1.0  # the daemon may be gone for good by now
        session.close()


def resume_frame(session_id: int, credential: bytes, holdings: list[dict[str, Any]] | None = None, pending: list[int] | None = None) -> bytes:
    body = {"session_id": session_id, "credential": credential, "holdings": holdings or [], "client_version": "raw", "pending": pending or []}
    return envelope(p.MsgType.RESUME, body, 1)


def raw_resume(
    runtime_dir: Path, session_id: int, credential: bytes, holdings: list[dict[str, Any]] | None = None, pending: list[int] | None = None
) -> tuple[Any, dict[str, Any], int]:
    """(the fd-channel socket, the reply, descriptors that came with it)."""
    sock = fd_connect(runtime_dir)
    sock.send(resume_frame(session_id, credential, holdings, pending))
    payload, fds = fd_recv(sock)
    os_close_all(fds)
    return sock, decode(payload), len(fds)


def drop_dealer(session: RawSession) -> None:
    """Close a raw session's DEALER before its daemon restarts, as the client library does
    before it resumes: ZeroMQ would connect it to the new daemon by itself, and the
    ROUTER hands the session's routing id to whichever DEALER connects last."""
    assert session.control is not None
    session.control.close()
    session.control = None


def client(s: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in s["clients"] if c["name"] == name]
    return found


def same_state(s: dict[str, Any]) -> dict[str, Any]:
    """What a restart must keep, as status shows it."""
    clients = [{k: v for k, v in c.items() if k != "waiting"} for c in s["clients"]]
    return {
        "accounted": s["device"]["accounted_bytes"], "clients": clients, "arenas": s["arenas"], "graph_pools": s["graph_pools"],
        "kv": s["kv"], "leases": s["leases"],
    }


def test_an_empty_store_is_a_fresh_start(service: Service, runtime_dir: Path) -> None:
    r = service()
    s = status(runtime_dir)
    assert (s["daemon"]["generation"], s["daemon"]["waiting"]) == (0, 0)
    assert sorted(r.manager.names()) == ["record-0", "record-1"]
    with RawSession(runtime_dir, "eng") as session:
        assert len(session.hello["credential"]) == 32 and session.hello["generation"] == 0
        assert session.commit("a", 8 * MiB)["ok"] is False  # no arena yet: as ever
        session.create("a", 64 * MiB)
        assert session.commit("a", 8 * MiB)["ok"]
        assert sorted(r.manager.names()) == ["chunk-1", "record-0", "record-1"]
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0, 5, "memory back")
    assert r.manager.settled_names(["record-0", "record-1"]) == ["record-0", "record-1"]


def test_kill_9_keeps_arenas_shares_pools_leases_and_kv_pools(service: Service, connect: Connect, run_client: Any, runtime_dir: Path) -> None:
    r = service()
    owner = connect("owner")
    peer = run_client("shell", "peer")  # another process: a process maps an arena once
    peer.expect("CONNECTED")
    arena = owner.create_arena("a", 256 * MiB)
    arena.commit(24 * MiB)
    arena.write(0, b"owner's bytes")
    arena.share("peer")
    do(peer, "attach a")
    graph = arena.register_graph_pool("g", extents=[p.Extent(offset=0, size=16 * MiB)], free_runs=[p.Extent(offset=8 * MiB, size=8 * MiB)], shared=True)
    do(peer, f"open {graph.id}")
    kv = owner.declare_kv_pool("kv", [gpumem.KvBuffer("k", 4096), gpumem.KvBuffer("v", 4096)], max_tokens=8192)
    kv.placeholder()
    kv.join_round(expect=1)
    tokens = kv.capture_done(headroom_bytes=0, min_tokens=1024, max_tokens=4096)
    lease = owner.replay(graph)  # held across the restart
    before = status(runtime_dir)

    r.restart()
    waiting = status(runtime_dir)  # the sessions' watchers may have resumed them already
    assert waiting["daemon"]["generation"] == 1 and same_state(waiting) == same_state(before)

    assert reply(peer, f"lease replay {graph.id} 0 replay").startswith("ERR LeaseConflict")  # the replay lease is still the owner's
    do(peer, "sync a")
    assert bytes.fromhex(do(peer, "read a 0 13")) == b"owner's bytes" and arena.read(0, 13) == b"owner's bytes"
    owner.ping()
    after = status(runtime_dir)
    assert after["daemon"]["waiting"] == 0 and same_state(after) == same_state(before)
    lease.release()
    do(peer, f"lease replay {graph.id} 0 replay")
    do(peer, f"unlease {graph.id}")
    assert kv.tokens == tokens
    assert [(c["name"], c["session_id"]) for c in after["clients"]] == [("owner", owner.session_id), ("peer", client(before, "peer")["session_id"])]
    assert owner.session_id == client(before, "owner")["session_id"]

    arena.commit(64 * MiB)  # new work after the restart
    assert int(do(peer, "sync a")) == 64 * MiB
    do(peer, "close")
    owner.close()
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0 and not s["clients"], 5, "memory back after both left")
    assert r.manager.settled_names(["record-0", "record-1"]) == ["record-0", "record-1"]


def test_a_call_made_while_the_daemon_is_away_waits_for_it(service: Service, connect: Connect, runtime_dir: Path) -> None:
    r = service()
    session = connect("eng")
    arena = session.create_arena("a", 64 * MiB)
    arena.commit(8 * MiB)
    r.kill()
    later = threading.Timer(1.0, r.start)
    later.start()
    started = time.monotonic()
    arena.commit(16 * MiB)  # sent to nobody; answered by the next daemon
    later.join()
    assert 1.0 <= time.monotonic() - started < 15
    assert arena.mapped_bytes == 16 * MiB
    s = status(runtime_dir)
    assert s["arenas"][0]["committed"] == 16 * MiB and s["daemon"]["waiting"] == 0
    session.close()


def test_a_session_resumes_without_a_call(service: Service, connect: Connect, runtime_dir: Path) -> None:
    """An engine that only replays (leases through the shared table) makes no call: its
    session's watcher resumes it once the new daemon runs, well inside the grace period,
    and a lease it held stays held."""
    r = service()
    session = connect("eng")
    arena = session.create_arena("a", 64 * MiB)
    arena.commit(16 * MiB)
    graph = arena.register_graph_pool("g", extents=[p.Extent(offset=0, size=16 * MiB)])
    lease = session.replay(graph)
    r.restart()
    s = wait_status(runtime_dir, lambda s: s["daemon"]["waiting"] == 0, 5, "the session resumed by itself")
    assert s["daemon"]["generation"] == 1 and [x["holder"] for x in s["leases"]] == ["eng"]
    lease.release()
    session.replay(graph).release()


def test_a_crash_between_the_store_and_the_record_loses_and_leaks_nothing(service: Service, connect: Connect, runtime_dir: Path) -> None:
    """The daemon dies after a commit's new chunks went to the store and before the record
    names them: the client's commit is carried out again by the next daemon, which gives
    the stored chunks no record names back (closed, and removed from the store)."""
    r = service()
    session = connect("eng")
    arena = session.create_arena("a", 64 * MiB)
    arena.commit(2 * MiB)
    arena.write(0, b"kept")
    r.manager.hold_barriers()
    failed: list[BaseException] = []

    def commit() -> None:
        try:
            arena.commit(8 * MiB)
        except BaseException as exc:  # the assertion below says which
            failed.append(exc)

    worker = threading.Thread(target=commit, daemon=True)
    worker.start()
    assert r.manager.barrier_held.wait(10), "the daemon sent no BARRIER=1 for the commit's chunks"
    r.kill()
    r.manager.release_barriers()
    r.start()
    worker.join(30)
    assert not worker.is_alive() and not failed, failed
    assert arena.mapped_bytes == 8 * MiB and arena.read(0, 4) == b"kept"
    arena.write(8 * MiB - 4, b"new!")
    assert arena.read(8 * MiB - 4, 4) == b"new!"
    assert "is named by no record; closed" in r.log()
    s = status(runtime_dir)
    assert s["device"]["accounted_bytes"] == 8 * MiB
    # The crashed commit's chunks left the store; the commit carried out again may reuse
    # their ids, so count: one stored descriptor per live chunk, no name twice.
    stored = [n for n in r.manager.names() if n.startswith("chunk-")]
    assert len(stored) == len(set(stored)) == s["arenas"][0]["chunks"], (stored, s["arenas"][0])
    session.close()
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0 and not s["arenas"], 10, "memory back at 0")
    assert r.manager.settled_names(["record-0", "record-1"]) == ["record-0", "record-1"]


def test_a_call_times_out_naming_the_daemon_when_it_does_not_come_back(service: Service, connect: Connect, runtime_dir: Path) -> None:
    r = service()
    session = connect("eng")
    session.create_arena("a", 64 * MiB)
    r.kill()
    with pytest.raises(gpumem.DaemonTimeout, match="went away .* no daemon took session 1 back within 0.5s; check 'systemctl status gpumemd@0'"):
        session.ping(timeout=0.5)
    r.start()
    session.ping()  # the next call resumes
    session.close()


def test_a_clean_stop_keeps_the_state_too(service: Service, connect: Connect, runtime_dir: Path) -> None:
    r = service()
    session = connect("eng")
    arena = session.create_arena("a", 64 * MiB)
    arena.commit(8 * MiB)
    assert r.stop() == 0
    r.start()
    arena.commit(10 * MiB)
    assert status(runtime_dir)["daemon"]["generation"] == 1
    session.close()


def test_a_restart_during_a_restart(service: Service, runtime_dir: Path) -> None:
    r = service()
    with RawSession(runtime_dir, "eng") as session:
        session.create("a", 64 * MiB)
        session.commit("a", 8 * MiB)
        r.restart()
        r.restart()  # before the client came back
        s = status(runtime_dir)
        assert (s["daemon"]["generation"], s["daemon"]["waiting"], s["device"]["accounted_bytes"]) == (2, 1, 8 * MiB)
        sock, reply, _ = raw_resume(runtime_dir, session.session_id, session.hello["credential"], [{"arena": "a", "chunks": [1]}])
        sock.close()
        assert reply["ok"], reply


_STEAL = """
import socket, sys
sys.path[:0] = sys.argv[3:]
from gpumemd_testkit import decode, envelope
from gpumem_shared import protocol as p
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect(sys.argv[1])
sock.send(envelope(p.MsgType.RESUME, {"session_id": 1, "credential": bytes.fromhex(sys.argv[2]), "holdings": []}, 1))
payload, fds, _, _ = socket.recv_fds(sock, 65536, 253)
reply = decode(payload)
print(reply["code"], len(fds), reply["msg"])
"""


def test_a_wrong_or_stolen_credential_gets_nothing(service: Service, runtime_dir: Path) -> None:
    r = service()
    with RawSession(runtime_dir, "eng") as session:
        session.create("a", 64 * MiB)
        session.commit("a", 8 * MiB)
        credential = session.hello["credential"]
        r.restart()
        sock, reply, fds = raw_resume(runtime_dir, session.session_id, bytes(32))
        sock.close()
        assert_error(reply, p.ErrorCode.PERMISSION_DENIED)
        assert "wrong resume credential" in reply["msg"] and fds == 0
        # The right credential from another process: SO_PEERCRED shows another pid.
        here = str(Path(__file__).parent)
        stolen = subprocess.run(
            [sys.executable, "-c", _STEAL, str(runtime_dir / "gpu0.fd"), credential.hex(), here, str(Path(here).parent)],
            capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
        )
        code, fds_, message = stolen.stdout.split(" ", 2)
        assert (int(code), int(fds_)) == (p.ErrorCode.PERMISSION_DENIED, 0), stolen.stdout + stolen.stderr
        assert f"session 1 belongs to pid {os.getpid()}" in message
        assert status(runtime_dir)["daemon"]["waiting"] == 1  # still the rightful client's
        assert "refused: its credential came from pid" in r.log()
        sock, reply, _ = raw_resume(runtime_dir, session.session_id, credential, [{"arena": "a", "chunks": [1]}])
        assert reply["ok"] and reply["b"]["session_id"] == session.session_id and reply["b"]["token"] == session.token
        again, second, _ = raw_resume(runtime_dir, session.session_id, credential)  # two claims on one session
        assert_error(second, p.ErrorCode.ALREADY_EXISTS)
        again.close()
        sock.close()


def test_after_the_grace_period_the_session_is_lost_and_its_memory_released(service: Service, run_client: Any, runtime_dir: Path) -> None:
    """A client frozen through the restart and the grace period (SIGSTOP) does not come
    back in time: its session is released like a dead client's; once it runs again its
    mapping still holds its bytes, and its calls say the session is lost."""
    r = service(args=("--restart-grace", "0.5"))
    eng = run_client("shell", "eng")
    eng.expect("CONNECTED")
    do(eng, f"create a {64 * MiB}")
    do(eng, f"commit a {8 * MiB}")
    do(eng, "write a 0 6b657074")
    os.kill(eng.pid, signal.SIGSTOP)
    try:
        r.restart()
        s = wait_status(runtime_dir, lambda s: not s["clients"], 10, "the waiting session released")
    finally:
        os.kill(eng.pid, signal.SIGCONT)
    assert s["arenas"] == [] and s["device"]["accounted_bytes"] == 0
    assert "did not resume within the 0.5s grace period" in r.log()
    # Released like a dead client's, but the mapping is this process's: the bytes stay.
    assert do(eng, "read a 0 4") == "6b657074"
    assert reply(eng, f"commit a {16 * MiB}").startswith("ERR SessionLost")
    assert "did not come back within the 0.5s grace period" in reply(eng, "ping")


def test_a_resent_request_is_answered_again_with_its_descriptors(service: Service, runtime_dir: Path) -> None:
    """A crash after the record, before the reply: the client sends again under the same
    id and gets the reply the record kept, with the chunks anew, not a second commit."""
    r = service()
    with RawSession(runtime_dir, "eng") as session:
        session.create("a", 64 * MiB)
        frame = envelope(p.MsgType.ARENA_COMMIT, {"name": "a", "nbytes": 24 * MiB}, 4242)
        assert session.control is not None
        first = session.control.raw(frame)
        assert first["ok"] and first["b"]["fd_batches"] == 1
        payload, fds = fd_recv(session.fd_sock)
        os_close_all(fds)
        ids = decode(payload)["b"]["chunk_ids"]
        drop_dealer(session)
        r.restart()
        sock, reply, _ = raw_resume(runtime_dir, session.session_id, session.hello["credential"], [], [4242])  # mapped nothing
        assert reply["ok"]
        with RawControl(runtime_dir, routing_id=session.token) as control:
            again = control.raw(frame)
            assert again == first
            payload, fds = fd_recv(sock)
            os_close_all(fds)
            assert decode(payload)["b"]["chunk_ids"] == ids and len(fds) == len(ids)
            s = status(runtime_dir)
            assert s["arenas"][0]["committed"] == 24 * MiB and s["device"]["accounted_bytes"] == 24 * MiB
            # A later request is carried out as ever; the same id once more is not a resend.
            assert control.call(p.MsgType.ARENA_COMMIT, {"name": "a", "nbytes": 24 * MiB}, 4243)["ok"]
        sock.close()



def test_every_answer_a_crash_can_leave_unread_is_answered_again(service: Service, runtime_dir: Path) -> None:
    """A call's reply, then the reply to the session's deferred round report, both sent
    just before a crash and neither read: after the resume each request, sent again under
    its id, gets its own answer from the record, descriptors included; not a second
    commit for the first because the second came after it."""
    r = service()
    with RawSession(runtime_dir, "first") as first, RawSession(runtime_dir, "second") as second:
        for session in (first, second):
            declared = session.call(p.MsgType.KV_DECLARE, {"name": f"kv-{session.session_id}", "buffers": [{"name": "k", "row_bytes": 4096}], "max_tokens": 4096})
            assert declared["ok"], declared
            assert session.call(p.MsgType.ROUND_JOIN, {"pool": f"kv-{session.session_id}", "expect": 2})["ok"]
        first.create("a", 64 * MiB)
        assert first.control is not None
        report = envelope(p.MsgType.CAPTURE_DONE, {"pool": f"kv-{first.session_id}", "min_tokens": 256, "max_tokens": 1024}, 500)
        first.control.send_frames(report)  # deferred: answered when the round commits
        commit = envelope(p.MsgType.ARENA_COMMIT, {"name": "a", "nbytes": 24 * MiB}, 501)
        answered = first.control.raw(commit)
        assert answered["ok"] and answered["b"]["fd_batches"] == 1
        assert second.call(p.MsgType.CAPTURE_DONE, {"pool": f"kv-{second.session_id}", "min_tokens": 256, "max_tokens": 1024})["ok"]
        round_answer = first.control.recv()
        assert round_answer["ok"] and round_answer["id"] == 500 and round_answer["b"]["fd_batches"] >= 1
        drop_dealer(first)
        r.restart()  # the sockets of first are gone: as if neither answer had been read
        sock, reply, _ = raw_resume(runtime_dir, first.session_id, first.hello["credential"], [], [500, 501])
        assert reply["ok"], reply
        with RawControl(runtime_dir, routing_id=first.token) as control:
            assert control.raw(commit) == answered
            payload, fds = fd_recv(sock)
            os_close_all(fds)
            assert decode(payload)["b"]["request_id"] == 501 and len(fds) == 2
            assert control.raw(report) == round_answer
            for _ in range(round_answer["b"]["fd_batches"]):
                payload, fds = fd_recv(sock)
                os_close_all(fds)
                assert decode(payload)["b"]["request_id"] == 500 and fds
        s = status(runtime_dir)
        mine = {a["name"]: a["committed"] for a in s["arenas"] if a["owner"] == "first"}
        assert mine["a"] == 24 * MiB and mine[f"kv-{first.session_id}"] > 0
        sock.close()

def _tamper(r: Restartable, how: str) -> None:
    m = r.manager
    with m._lock:
        store = dict((name, fd) for name, fd in m.store)
        if how == "corrupt":
            for name in ("record-0", "record-1"):
                os.pwrite(store[name], b"\xff" * 64, 8)
        elif how == "truncated":
            newest = max(("record-0", "record-1"), key=lambda n: int.from_bytes(os.pread(store[n], 8, 8), "little"))
            os.ftruncate(store[newest], 20)
        elif how in ("missing-chunk", "no-record"):
            gone = ["chunk-1"] if how == "missing-chunk" else ["record-0", "record-1"]
            for name in gone:
                os.close(store[name])
            m.store = [(n, fd) for n, fd in m.store if n not in gone]
        elif how == "wrong-kind":
            rd, wr = os.pipe()
            os.close(wr)
            os.close(store["chunk-1"])
            m.store = [(n, rd if n == "chunk-1" else fd) for n, fd in m.store]
        elif how == "extra":
            rd, wr = os.pipe()
            os.close(wr)
            m.store.append(("stranger", rd))


@pytest.mark.parametrize(
    ("how", "logged", "rebuilt"),
    [
        ("corrupt", "is truncated or corrupt", False),
        ("truncated", "is truncated", True),
        ("missing-chunk", "chunk(s) [1] missing from the fd store", True),
        ("wrong-kind", "1 descriptor(s) named 'chunk-1' that are not the one the daemon stored", True),
        ("extra", "'stranger' is named by no record; closed", True),
        ("no-record", "the durable record is missing", False),
    ],
)
def test_a_bad_store_is_logged_and_leaks_nothing(service: Service, runtime_dir: Path, how: str, logged: str, rebuilt: bool) -> None:
    # The status below must come inside the grace period, which releases the session and
    # its arena when it ends: 1 s was not always enough on a loaded machine.
    r = service(args=("--restart-grace", "3"))
    with RawSession(runtime_dir, "eng") as session:
        session.create("a", 64 * MiB)
        assert session.commit("a", 8 * MiB)["ok"]
        r.kill()
        _tamper(r, how)
        r.start()
        assert logged in r.log()
        s = status(runtime_dir)
        assert s["daemon"]["generation"] == (1 if rebuilt else 0)
        assert [c["name"] for c in s["clients"]] == (["eng"] if rebuilt else [])
        if how in ("extra", "truncated"):
            assert [a["name"] for a in s["arenas"]] == ["a"]
        if how == "truncated":  # the older record: the arena, not yet the commit; the chunk closed
            assert s["arenas"][0]["committed"] == 0 and "'chunk-1' is named by no record" in r.log()
        wait_status(runtime_dir, lambda s: not s["clients"] and s["device"]["accounted_bytes"] == 0, 15, "everything released")
        assert r.manager.settled_names(["record-0", "record-1"]) == ["record-0", "record-1"]
        if rebuilt:
            sock, reply, _ = raw_resume(runtime_dir, session.session_id, session.hello["credential"])
            sock.close()
            assert_error(reply, p.ErrorCode.SESSION_LOST)


@pytest.mark.parametrize("second_reports", ["after its resume", "while it waits"])
def test_a_crash_during_a_kv_round(service: Service, connect: Connect, runtime_dir: Path, second_reports: str) -> None:
    """The first member reported and waits for its deferred reply when the daemon dies:
    the round comes back, the second member reports, and the first gets its tokens."""
    r = service()
    sessions = [connect(name) for name in ("first", "second")]
    pools = [s.declare_kv_pool(f"kv-{s.name}", [gpumem.KvBuffer("k", 4096), gpumem.KvBuffer("v", 4096)], max_tokens=4096) for s in sessions]
    for pool in pools:
        pool.placeholder()
        pool.join_round(expect=2)
    got: dict[str, Any] = {}

    def first_reports() -> None:
        try:
            got["tokens"] = pools[0].capture_done(headroom_bytes=0, min_tokens=256, max_tokens=1024, timeout=ROUND_WAIT_S)
        except BaseException as exc:  # the assertion below says which
            got["error"] = exc

    # A daemon thread, its wait bounded: a test that fails leaves no call holding the
    # session (its close at teardown would wait for it) and no thread the exit waits for.
    waiter = threading.Thread(target=first_reports, daemon=True)
    waiter.start()
    wait_status(runtime_dir, lambda s: any(m["reported"] for m in s["rounds"][0]["members"]), 10, "the first report")
    r.restart()
    if second_reports == "after its resume":
        # The first's own resume, by name: the second's watcher resumes it too, at a moment
        # of its own, so "one still waiting" may never be there to see.
        wait_status(runtime_dir, lambda s: not client(s, "first")["waiting"], 10, "the first member resumed")
    tokens = pools[1].capture_done(headroom_bytes=0, min_tokens=256, max_tokens=1024, timeout=ROUND_WAIT_S)
    waiter.join(ROUND_WAIT_S)
    assert not waiter.is_alive() and "error" not in got, got
    assert tokens >= 256 and got["tokens"] >= 256 and pools[0].tokens == got["tokens"]
    for pool in pools:
        for buffer in pool.buffers.values():
            last = buffer.offset + pool.tokens * buffer.row_bytes - 8
            pool.arena.write(last, b"K" * 8)
            assert pool.arena.read(last, 8) == b"K" * 8
    s = status(runtime_dir)
    assert s["rounds"][0]["state"] == "committed" and s["daemon"]["waiting"] == 0
    for session in sessions:
        session.close()
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0, 10, "memory back")



def test_a_crash_during_a_lease_handoff(service: Service, run_client: Any, runtime_dir: Path, backend: str) -> None:
    """The peer waits for the owner's replay lease when the daemon dies, and the owner
    gives it back while no daemon runs: the handoff goes through the shared table alone
    (their IPC events were exchanged before), the restarted daemon shows the peer as the
    holder, and the lease goes on changing hands after the restart. A holder that dies
    later still has its lease taken back. Two processes: on CUDA one process cannot map
    an arena twice."""
    r = service(backend)
    owner, peer = run_client("shell", "owner"), run_client("shell", "peer")
    for c in (owner, peer):
        c.expect("CONNECTED")
    do(owner, f"create a {64 * MiB}")
    do(owner, f"commit a {16 * MiB}")
    do(owner, "share a peer")
    pool = json.loads(do(owner, f"gpregister a g 0 {16 * MiB} shared"))["id"]
    do(peer, "attach a")
    do(peer, f"open {pool}")
    # One handoff each way first: the first release of each side publishes its event
    # through the daemon, the first acquire after a peer looks that event up.
    for _ in range(2):
        for c, label in ((owner, "owner-warm"), (peer, "peer-warm")):
            do(c, f"lease replay {pool} 5 {label}")
            do(c, f"unlease {pool}")
    do(owner, f"lease replay {pool} 5 owner-turn")
    peer.send(f"lease replay {pool} 20 peer-turn")
    deadline = time.monotonic() + 10
    while json.loads(do(owner, f"peek {pool}"))["waiters"] < 1:  # until the peer sleeps on the lease word
        assert time.monotonic() < deadline, "the peer never waited for the owner's lease"
        time.sleep(0.01)
    r.kill()
    do(owner, f"unlease {pool}")  # no daemon anywhere: the table hands it over
    assert peer.expect("OK") == "replay"
    r.start()
    # Neither calls the daemon from here on: their watchers resume them.
    s = wait_status(runtime_dir, lambda s: s["daemon"]["waiting"] == 0, 5, "both sessions resumed")
    assert s["daemon"]["generation"] == 1
    assert [(x["kind"], x["holder"], x["label"]) for x in s["leases"]] == [("replay", "peer", "peer-turn")]
    assert reply(owner, f"lease replay {pool} 0 owner-again").startswith("ERR LeaseConflict")
    do(peer, f"unlease {pool}")
    do(owner, f"lease replay {pool} 5 owner-again")  # and back, after the restart
    assert [x["holder"] for x in status(runtime_dir)["leases"]] == ["owner"]
    do(owner, f"unlease {pool}")
    do(peer, f"lease replay {pool} 5 peer-dies")
    peer.kill()
    wait_status(runtime_dir, lambda s: not s["leases"] and [c["name"] for c in s["clients"]] == ["owner"], 10, "the dead peer's lease taken back")
    do(owner, f"lease replay {pool} 0 owner-last")
    do(owner, f"unlease {pool}")
    do(owner, "close")
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0 and not s["clients"], 10, "memory back")


def two_in_a_round(connect: Connect) -> tuple[gpumem.Session, gpumem.Session, list[gpumem.KvPool]]:
    """Sessions "first" and "second", each with a KV pool on placeholder in one round."""
    first, second = connect("first"), connect("second")
    pools = [s.declare_kv_pool(f"kv-{s.name}", [gpumem.KvBuffer("k", 4096)], max_tokens=4096) for s in (first, second)]
    for pool in pools:
        pool.placeholder()
        pool.join_round(expect=2)
    return first, second, pools


@pytest.mark.parametrize("read", ["taken by a later call", "left in the sockets"])
def test_a_round_answer_that_came_before_the_crash_is_kept(service: Service, connect: Connect, runtime_dir: Path, read: str) -> None:
    """A report sent with send_capture_done, and the round commits: its answer and descriptors reach
    the engine (a later call takes them in, or they wait in the sockets) before the daemon
    dies. The resume keeps them: the wait after the restart gets its rows."""
    r = service()
    first, second, pools = two_in_a_round(connect)
    waiting = pools[0].send_capture_done(headroom_bytes=0, min_tokens=256, max_tokens=1024)
    pools[1].capture_done(headroom_bytes=0, min_tokens=256, max_tokens=1024)
    if read == "taken by a later call":
        first.ping()
    r.restart()
    first.ping()  # resumes
    tokens = waiting.wait(20)
    assert tokens >= 256 and pools[0].arena.mapped_bytes >= tokens * 4096
    buffer = pools[0].buffers["k"]
    last = buffer.offset + tokens * buffer.row_bytes - 8
    pools[0].arena.write(last, b"K" * 8)
    assert pools[0].arena.read(last, 8) == b"K" * 8
    for session in (first, second):
        session.close()
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0 and not s["clients"], 10, "memory back")

def test_gpumemctl_status_shows_the_generation_and_who_waits(service: Service, runtime_dir: Path) -> None:
    r = service()
    with RawSession(runtime_dir, "eng") as session:
        session.create("a", 64 * MiB)
        r.restart()
        run = [sys.executable, "-m", "gpumem.ctl", "status", "--runtime-dir", str(runtime_dir)]
        human = subprocess.run(run, capture_output=True, text=True, timeout=60, env=child_env(runtime_dir))
        assert human.returncode == 0, human
        assert "restarted 1 time(s) with its state kept; 1 client(s) holding 1 arena(s) and graph pool(s) not resumed yet, released in" in human.stdout
        assert "eng (waiting)" in human.stdout
        as_json = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60, env=child_env(runtime_dir))
        daemon = json.loads(as_json.stdout)["daemon"]
        assert (daemon["generation"], daemon["waiting"], daemon["waiting_objects"]) == (1, 1, 1) and 0 < daemon["grace_left_s"] <= 30


@pytest.mark.parametrize("meanwhile", ["nothing", "other calls", "the round ends"])
def test_a_round_report_that_does_not_block_survives_a_restart(service: Service, connect: Connect, runtime_dir: Path, meanwhile: str) -> None:
    """A report sent with send_capture_done is out, unanswered, when the daemon dies; the
    engine's other calls go on after the restart, and the wait still gets its tokens."""
    r = service()
    first, second, pools = two_in_a_round(connect)
    waiting = pools[0].send_capture_done(headroom_bytes=0, min_tokens=256, max_tokens=1024)
    wait_status(runtime_dir, lambda s: any(m["reported"] for m in s["rounds"][0]["members"]), 10, "the first report")
    r.restart()
    if meanwhile == "other calls":
        first.ping()
        first.create_arena("more", 64 * MiB).commit(4 * MiB)
    if meanwhile == "the round ends":  # while the first is still away: its reply waits in the record
        pools[1].capture_done(headroom_bytes=0, min_tokens=256, max_tokens=1024)
        first.ping()
        first.create_arena("more", 64 * MiB).commit(4 * MiB)
    else:
        pools[1].capture_done(headroom_bytes=0, min_tokens=256, max_tokens=1024)
    tokens = waiting.wait(20)
    assert tokens >= 256 and pools[0].tokens == tokens
    buffer = pools[0].buffers["k"]
    last = buffer.offset + tokens * buffer.row_bytes - 8
    pools[0].arena.write(last, b"K" * 8)
    assert pools[0].arena.read(last, 8) == b"K" * 8


def test_a_client_that_died_while_the_daemon_was_down_leaves_its_name_to_its_successor(
    service: Service, run_client: Any, connect: Connect, runtime_dir: Path
) -> None:
    """A session kept across the restart whose process is gone is released at the rebuild
    (not after the grace period), what it held as a dead client's: its supervisor's
    restarted engine gets the name at once."""
    r = service()
    eng = run_client("shell", "engine")
    eng.expect("CONNECTED")
    do(eng, f"create a {64 * MiB}")
    do(eng, f"commit a {8 * MiB}")
    r.kill()
    eng.proc.kill()
    eng.proc.wait()
    r.start()
    s = status(runtime_dir)
    assert s["clients"] == [] and s["arenas"] == [] and s["daemon"]["waiting"] == 0
    successor = connect("engine")
    s = status(runtime_dir)
    assert [(c["name"], c["pid"], c["waiting"]) for c in s["clients"]] == [("engine", os.getpid(), False)]
    assert s["arenas"] == [] and s["device"]["accounted_bytes"] == 0 and s["daemon"]["waiting"] == 0
    assert f"pid {eng.pid}" in r.log() and "is gone" in r.log()
    successor.create_arena("a", 64 * MiB).commit(8 * MiB)  # the name's objects are the successor's now


def test_a_name_waiting_for_a_live_client_is_refused_as_waiting_not_live(service: Service, runtime_dir: Path) -> None:
    """A kept session whose process still runs (it has not resumed yet) keeps its name;
    the refusal says it waits for its client, and for how long at most."""
    r = service()
    with RawSession(runtime_dir, "engine"):
        r.restart()
        with pytest.raises(gpumem.AlreadyExists) as info:
            gpumem.connect(0, "engine", runtime_dir=runtime_dir, timeout=10)
        message = str(info.value)
        assert "waiting" in message and "resume" in message and "live" not in message, message
        assert f"pid {os.getpid()} still runs" in message, message
        assert [(c["name"], c["waiting"]) for c in status(runtime_dir)["clients"]] == [("engine", True)]


def test_a_name_is_free_again_the_moment_a_resumable_session_closes(service: Service, runtime_dir: Path) -> None:
    """close() returns once the daemon dropped the session, also where a watcher thread
    (a session the daemon keeps across restarts) is looking at the fd channel."""
    service()
    for _ in range(20):
        with gpumem.connect(0, name="again", runtime_dir=runtime_dir, timeout=10) as s:
            s.ping()
        assert status(runtime_dir)["clients"] == []


def _daemon_files(pid: int, part: str) -> list[str]:
    """The daemon's open descriptors whose file names ``part`` (from /proc, not its log)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if part in link:
            found.append(link)
    return found


def _memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name)
    os.ftruncate(fd, size)
    return fd


@pytest.mark.parametrize("how", ["a name no record has", "a chunk's name, before the chunk"])
def test_a_descriptor_put_in_the_store_by_another_is_closed_in_the_daemon(service: Service, runtime_dir: Path, how: str) -> None:
    r = service()
    with RawSession(runtime_dir, "eng") as session:
        session.create("a", 64 * MiB)
        assert session.commit("a", 8 * MiB)["ok"]
        r.kill()
        m = r.manager
        with m._lock:
            size = os.fstat(dict(m.store)["chunk-1"]).st_size
            name = "stranger" if how == "a name no record has" else "chunk-1"
            m.store.insert(0, (name, _memfd("planted-by-another", size)))
        r.start()
        assert not _daemon_files(r.pid, "planted-by-another"), "the daemon keeps a descriptor it logged as closed"
        s = status(runtime_dir)
        assert s["daemon"]["generation"] == 1 and s["arenas"][0]["committed"] == 8 * MiB
        if how == "a name no record has":
            assert "'stranger' is named by no record; closed" in r.log()
        else:
            assert "1 descriptor(s) named 'chunk-1' that are not the one the daemon stored" in r.log()
            assert _daemon_files(r.pid, "gpumemd-chunk"), "the daemon's own chunk was not adopted"
        sock, reply, fds = raw_resume(runtime_dir, session.session_id, session.hello["credential"], [{"arena": "a", "chunks": [1]}])
        assert reply["ok"]
        sock.close()


def test_a_restart_logs_its_startup_phases(service: Service, connect: Connect, runtime_dir: Path) -> None:
    """One line at READY says where the start's time went (bench/restart.py and the lead's
    failover runs read it): every phase in order, in ms, and what the store gave back."""
    r = service()
    session = connect("eng")
    arena = session.create_arena("a", 64 * MiB)
    arena.commit(24 * MiB)
    chunks = sorted(n for n in r.manager.names() if n.startswith("chunk-"))
    r.restart()
    status(runtime_dir)  # answered once the loop runs: the line, written before it, is in the log
    lines = [line.partition("startup phases: ")[2] for line in r.log().splitlines() if "startup phases: " in line]
    assert len(lines) == 2, r.log()  # one per start
    figures, _, note = lines[1].partition(" (")
    phases = [(name, float(ms)) for name, ms in re.findall(r"(\w+) ([\d.]+) ms", figures)]
    assert [name for name, _ in phases] == ["interpreter", "imports", "server_imports", "driver", "state", "sockets", "restore", "ready", "total"]
    # Each figure is rounded to 0.1 ms on its own: the phases' sum may part from the total by 0.05 ms a figure.
    assert phases[-1][1] == pytest.approx(sum(ms for _, ms in phases[:-1]), abs=0.05 * len(phases) + 1e-9) and phases[-1][1] > 0
    assert re.fullmatch(rf"driver start [\d.]+ ms on its thread; {len(chunks) + 2} stored fds passed; 1 sessions, 1 arenas, "
                        rf"{len(chunks)} chunks restored\)", note), note
    session.ping()
