"""RESUME after a restart, on the state alone: only the process that opened a session
(its uid and gid, and its pid where the daemon saw one both times: a client outside its
pid namespace is pid 0 to it) with the credential HELLO issued gets it back, a session
that was never given a credential cannot be resumed with an empty one, and the grace
period ends only once every kept session has come back."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.driver.host import HostDriver
from gpumemd.durable import Durable
from gpumemd.records import SessionRecord
from gpumemd.state import DaemonState

from .harness import CAPACITY, Clock, Harness
from .test_pid_namespaces import gone_pid
from .store_kit import FakeStore

Restarted = Callable[[list[str]], tuple[Harness, list[SessionRecord]]]


@pytest.fixture
def restarted(make_harness: Callable[..., Harness]) -> Iterator[Restarted]:
    """``restarted(names)``: sessions opened under those names in a daemon with a store,
    and the state a restart rebuilds, every session waiting for its client."""
    made: list[tuple[Harness, Durable]] = []
    store = FakeStore()

    def make(names: list[str]) -> tuple[Harness, list[SessionRecord]]:
        h = make_harness()
        first = Durable(store)  # type: ignore[arg-type]
        first.start(h.state, {})
        before = [h.connect(name) for name in names]
        first.persist(h.state)
        h.state.arenas.close()
        clock, wall = Clock(h.clock.now), Clock(h.wall_clock.now)
        again = Harness(DaemonState(HostDriver(index=0, capacity=CAPACITY), h.config, clock, wall), clock, wall)
        second = Durable(store)  # type: ignore[arg-type]
        second.start(again.state, store.passed())
        made.extend([(h, first), (again, second)])
        return again, before

    yield make
    for h, durable in reversed(made):
        h.state.drop_all()
        durable.close()
    store.drop()


def resume(session: SessionRecord, credential: bytes | None = None) -> p.Resume:
    return p.Resume(session_id=session.id, credential=session.credential if credential is None else credential)


def test_a_resume_from_the_same_pid_under_another_uid_is_refused(restarted: Restarted) -> None:
    h, (s,) = restarted(["eng"])
    with pytest.raises(p.ProtocolError) as refused:
        h.state.resume(resume(s), s.pid, s.uid + 1, s.gid)  # the pid reused by another user's process
    assert refused.value.code == p.ErrorCode.PERMISSION_DENIED
    assert h.state.sessions[s.id].waiting
    session, reply = h.state.resume(resume(s), s.pid, s.uid, s.gid)
    assert reply.session_id == s.id and not session.waiting


def test_a_session_without_a_credential_cannot_be_resumed_with_any(restarted: Restarted) -> None:
    """An empty credential is refused when decoded (test_protocol); one of the right
    length, all zeros, finds no credential to match: the session was never resumable."""
    h, (s,) = restarted(["eng"])
    kept = h.state.sessions[s.id]
    kept.credential = b""  # as a session opened before the daemon had a store is kept
    with pytest.raises(p.ProtocolError) as refused:
        h.state.resume(resume(s, bytes(p.RESUME_CREDENTIAL_BYTES)), s.pid, s.uid, s.gid)
    assert refused.value.code == p.ErrorCode.SESSION_LOST
    assert kept.waiting


def test_the_grace_period_runs_on_while_another_session_waits(restarted: Restarted) -> None:
    h, (back, late) = restarted(["back", "late"])
    deadline = h.state.session_desk.grace_deadline
    assert deadline is not None
    h.state.resume(resume(back), back.pid, back.uid, back.gid)
    assert h.state.session_desk.grace_deadline == deadline, "one resume ended the grace period of a session still waiting"
    h.clock.now = deadline
    h.state.tick()
    assert sorted(h.state.sessions) == [back.id], "the session that never came back is still kept"
    assert h.state.session_desk.grace_deadline is None


def test_the_grace_period_runs_on_when_a_successor_takes_a_dead_clients_name(restarted: Restarted) -> None:
    h, (dead, late) = restarted(["dead", "late"])
    deadline = h.state.session_desk.grace_deadline
    h.state.sessions[dead.id].pid = 1 << 23  # beyond any pid_max: provably gone
    h.state.open_session(p.Hello(name="dead"), pid=9999, uid=dead.uid, gid=dead.gid)
    assert dead.id not in h.state.sessions
    assert h.state.session_desk.grace_deadline == deadline, "taking over one name ended the grace period of a session still waiting"


@pytest.mark.parametrize("differs", ["uid", "gid", "pid seen both times"])
def test_a_resume_from_another_identity_is_refused(restarted: Restarted, differs: str) -> None:
    h, (s,) = restarted(["eng"])
    pid, uid, gid = s.pid, s.uid, s.gid
    if differs == "uid":
        uid += 1
    elif differs == "gid":
        gid += 1
    else:
        pid += 1
    with pytest.raises(p.ProtocolError) as refused:
        h.state.resume(resume(s), pid, uid, gid)
    assert refused.value.code == p.ErrorCode.PERMISSION_DENIED
    assert h.state.sessions[s.id].waiting


@pytest.mark.parametrize("at_hello, at_resume", [(0, 0), (0, 4242), (4242, 0)])
def test_a_client_the_daemon_saw_as_pid_0_once_resumes_by_its_credential_uid_and_gid(
    restarted: Restarted, at_hello: int, at_resume: int
) -> None:
    h, (s,) = restarted(["eng"])
    h.state.sessions[s.id].pid = at_hello
    session, reply = h.state.resume(resume(s), at_resume, s.uid, s.gid)
    assert reply.session_id == s.id and not session.waiting


def test_a_kept_session_of_a_client_outside_the_namespace_keeps_its_name(restarted: Restarted) -> None:
    """gpumemd saw it as pid 0, and it says it is pid N: no pid of it is one /proc can
    answer for (N, in the daemon's namespace, is another process or none). Its name waits
    for its RESUME or the grace period's end, and the refusal says why."""
    h, (kept,) = restarted(["eng"])
    record = h.state.sessions[kept.id]
    record.pid, record.own_pid = 0, gone_pid()  # its own pid names nobody here: read as gone, it would lose its name
    with pytest.raises(p.ProtocolError) as refused:
        h.state.open_session(p.Hello(name="eng", pid=7), pid=0, uid=kept.uid, gid=kept.gid)
    assert refused.value.code == p.ErrorCode.ALREADY_EXISTS
    assert "outside gpumemd's pid namespace" in str(refused.value), refused.value
    assert h.state.sessions[kept.id].waiting


def test_the_session_desk_returns_the_sessions_to_close_and_closes_none(restarted: Restarted) -> None:
    """sessions.py decides and state.py closes: what a session's end means for the books
    is decided in one place, the dispatcher."""
    h, (gone, late) = restarted(["gone", "late"])
    desk = h.state.session_desk
    h.state.sessions[gone.id].pid = 1 << 23  # beyond any pid_max: provably gone
    desk.gone = lambda pid, since: pid == 1 << 23
    assert desk.release_gone() == [gone.id]
    assert desk.grace_deadline is not None, "another session still waits"
    h.clock.now = desk.grace_deadline
    assert sorted(desk.tick()) == sorted([gone.id, late.id])
    assert sorted(h.state.sessions) == sorted([gone.id, late.id]), "the desk closed nothing itself"
    assert desk.grace_deadline is None
