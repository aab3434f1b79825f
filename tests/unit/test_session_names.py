"""Who may take a client name a session holds: nobody while it is connected; a session
kept across a restart (waiting for its client to resume) goes to a process of its uid
once its own process is provably gone (exited, a zombie, its pid reused), and what it
held is released as a dead client's. Real processes stand for the clients."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gpumem_shared import protocol as p
from gpumemd.records import SessionRecord as Session

from .harness import BULK, GiB, Harness


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def exited_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def kept(h: Harness, name: str, pid: int, uid: int = 1000, since: float | None = None) -> Session:
    """A session as a restart rebuilds it, holding an arena with a chunk: waiting for
    its client, ``pid``, whose HELLO came at ``since`` (a minute ago by default)."""
    session = h.connect(name, uid=uid, gid=uid)
    h.create(session, "held", GiB)
    h.commit(session, "held", BULK)
    session.pid, session.waiting = pid, True
    session.since = time.time() - 60 if since is None else since
    h.state.session_desk.grace_deadline = h.clock.now + h.config.restart_grace
    return session


def hello(h: Harness, name: str, uid: int = 1000) -> Session:
    session, _ = h.state.open_session(p.Hello(name=name), pid=os.getpid(), uid=uid, gid=uid)
    return session


def refused(h: Harness, name: str, uid: int = 1000) -> str:
    with pytest.raises(p.ProtocolError) as info:
        hello(h, name, uid)
    assert info.value.code == p.ErrorCode.ALREADY_EXISTS
    return info.value.message


def test_a_kept_session_whose_process_exited_hands_its_name_over(h: Harness) -> None:
    old = kept(h, "engine", exited_pid())
    new = hello(h, "engine")
    assert list(h.state.sessions) == [new.id] and new.id != old.id and not new.waiting
    assert h.state.arenas.by_name == {} and h.state.arenas.accounted_bytes() == 0, "released as a dead client's"
    assert h.state.session_desk.grace_deadline is None, "nobody waits any more"


def test_a_zombie_is_gone(h: Harness) -> None:
    proc = subprocess.Popen(["true"])
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        kept(h, "engine", proc.pid, since=time.time() + 60)  # started before its HELLO: only its state says it is gone
        assert hello(h, "engine").name == "engine"
    finally:
        proc.wait()


def test_a_pid_reused_by_a_process_started_after_the_hello_is_gone(h: Harness, sleeper: subprocess.Popen[bytes]) -> None:
    kept(h, "engine", sleeper.pid, since=time.time() - 3600)
    assert hello(h, "engine").name == "engine"


def test_a_kept_session_whose_process_runs_keeps_its_name(h: Harness, sleeper: subprocess.Popen[bytes]) -> None:
    old = kept(h, "engine", sleeper.pid, since=time.time() + 60)  # its process started before its HELLO
    message = refused(h, "engine")
    assert f"pid {sleeper.pid} still runs" in message and "waiting up to 30s" in message, message
    assert "live" not in message, "a session waiting for its client is not live"
    assert list(h.state.sessions) == [old.id] and "held" in h.state.arenas.by_name


def test_another_uid_never_takes_a_name_over(h: Harness) -> None:
    old = kept(h, "engine", exited_pid(), uid=1000)
    message = refused(h, "engine", uid=1001)
    assert "only a process of uid 1000 may take it over" in message, message
    assert list(h.state.sessions) == [old.id] and h.state.arenas.accounted_bytes() == BULK


def test_a_connected_session_keeps_its_name_whatever_its_pid_says(h: Harness) -> None:
    """Its fd channel's EOF says when it is gone: until then it is live."""
    old = kept(h, "engine", exited_pid())
    old.waiting = False
    assert "held by a live session" in refused(h, "engine")
    assert list(h.state.sessions) == [old.id]
