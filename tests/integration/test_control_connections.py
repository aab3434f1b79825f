"""Control-channel connections under a small open-file limit: libzmq accepts them on its
own thread and aborts the process (``Too many open files (src/ipc_listener.cpp)``) when
accept fails, so the daemon counts them from the ROUTER's monitor and hangs up the ones
that cost a descriptor for nothing (daemon/gpumemd/control_door.py).

Before it did, each routing-id handover round below left one connection open in the
daemon for good (libzmq cut the old one off from the ROUTER and its reader stalled once
its peer sent again), and a crowd of DEALERs that never sent a word held a descriptor
each: both ended in that abort."""

from __future__ import annotations

import re
import time
from typing import Any

import zmq

from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumemd_testkit import Probe, RawControl, RawSession, envelope

NOFILE = 256  # control budget: 256 - 64 headroom - 96 fd-channel connections = 96
CONTROL_BUDGET = 96
ROUNDS = 3 * NOFILE
SETTLE = 10.0


def ping(control: RawControl, rid: int) -> None:
    reply = control.call(p.MsgType.PING, request_id=rid)
    assert reply["ok"], reply


def answered(control: RawControl, rid: int) -> bool:
    """PING: whether it was answered. Under this attack the daemon reopens its control
    channel now and then, and a request on the wire at that moment gets no reply."""
    control.send_frames(envelope(p.MsgType.PING, None, rid))
    return bool(control.sock.poll(2000, zmq.POLLIN)) and control.recv()["ok"] is True


def handover_round(runtime_dir: Any, routing_id: bytes, rid: int) -> None:
    """A speaks under an id, B takes the id over and leaves, A speaks again (unanswered:
    the ROUTER no longer reads it), and leaves."""
    a = RawControl(runtime_dir, routing_id=routing_id)
    try:
        answered(a, rid)
        with RawControl(runtime_dir, routing_id=routing_id) as b:
            answered(b, rid + 1)
        a.send_frames(envelope(p.MsgType.PING, None, rid + 2))
    finally:
        a.close()


def settled_fds(probe: Probe, most: int, timeout: float = SETTLE) -> int:
    """The daemon's descriptor count once it is at most ``most`` (libzmq closes what a
    peer left on its own thread, a moment later), or the count at the timeout."""
    deadline = time.monotonic() + timeout
    while (n := probe.fds()) > most and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_routing_id_handover_rounds_leave_no_descriptor(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", nofile=NOFILE)
    probe = Probe(daemon.pid)
    with RawControl(runtime_dir) as warm:
        ping(warm, 1)
    baseline = settled_fds(probe, 0, timeout=0.5)
    most = baseline
    for i in range(ROUNDS):
        handover_round(runtime_dir, b"taken-%d" % (i % 7), 10 * i)
        most = max(most, probe.fds())
        assert probe.alive(), f"gpumemd died after {i} handover rounds:\n{daemon.log()[-3000:]}"
    # Bounded while it runs, and back where it was once no session would notice the
    # channel reopen (no session is open).
    assert most < baseline + CONTROL_BUDGET + 16, f"the daemon held {most} descriptors (baseline {baseline})"
    after = settled_fds(probe, baseline + 2)
    assert after <= baseline + 2, f"{after - baseline} descriptors left open after {ROUNDS} handover rounds:\n{daemon.log()[-2000:]}"
    with RawControl(runtime_dir) as late:
        ping(late, 1)


def test_a_session_keeps_working_through_handover_rounds(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """With a session open the daemon reopens the channel only once stalled connections
    crowd the budget; the count stays within it, and the session's DEALER goes on
    (reconnected by libzmq if the channel was reopened under it)."""
    daemon = daemon_factory("host", nofile=NOFILE)
    probe = Probe(daemon.pid)
    with RawSession(runtime_dir, "steady") as steady:
        assert steady.control is not None
        baseline = settled_fds(probe, 0, timeout=0.5)
        most = baseline
        for i in range(ROUNDS):
            handover_round(runtime_dir, b"taken", 10 * i)
            most = max(most, probe.fds())
        assert probe.alive(), daemon.log()[-3000:]
        assert most < baseline + CONTROL_BUDGET + 16, f"the daemon held {most} descriptors (baseline {baseline})"
        assert answered(steady.control, 1) or answered(steady.control, 2), "the session's DEALER got no answer"
        assert steady.commit("kv", 0)["code"] != p.ErrorCode.INTERNAL


def test_a_crowd_of_silent_dealers_is_hung_up(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Three times the open-file limit in DEALERs that connect and never send: the daemon
    hangs up those past its budget as they come (libzmq's DEALERs reconnect, and are hung
    up again), stays within its descriptors, serves the session it has, and takes
    anonymous peers again once the crowd leaves."""
    daemon = daemon_factory("host", nofile=NOFILE)
    probe = Probe(daemon.pid)
    ctx: zmq.Context[Any] = zmq.Context()
    crowd: list[zmq.Socket[Any]] = []
    try:
        with RawSession(runtime_dir, "steady") as steady:
            assert steady.control is not None and steady.call(p.MsgType.PING)["ok"]  # its DEALER is the session's now
            baseline = settled_fds(probe, 0, timeout=0.5)
            most = baseline
            for i in range(3 * NOFILE):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(Endpoints(runtime_dir, 0).zmq_url)
                crowd.append(sock)
                if i % 16 == 0:
                    most = max(most, probe.fds())
                    assert probe.alive(), f"gpumemd died with {i} silent DEALERs:\n{daemon.log()[-3000:]}"
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:  # the crowd reconnecting as it is hung up
                most = max(most, probe.fds())
                time.sleep(0.02)
            assert probe.alive(), f"gpumemd died under the crowd:\n{daemon.log()[-3000:]}"
            assert most < NOFILE - 8, f"the daemon held {most} descriptors under a limit of {NOFILE}"
            assert answered(steady.control, 1) or answered(steady.control, 2), "the session got no answer under the crowd"
            for sock in crowd:
                sock.close(linger=0)
            crowd = []
            with RawControl(runtime_dir) as late:
                assert answered(late, 3) or answered(late, 4), "an anonymous peer got no answer after the crowd left"
            assert steady.call(p.MsgType.PING)["ok"]
    finally:
        for sock in crowd:
            sock.close(linger=0)
        ctx.term()
    log = daemon.log()
    assert "control-channel connection(s) away" in log or "hung up" in log, log[-2000:]


def test_as_many_sessions_as_the_fd_channel_takes_each_with_its_dealer(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """The fd budget counts each session's control connection besides its fd channel: as
    many sessions as the fd channel takes, each speaking through its DEALER, fit the
    open-file limit (a budget that forgot the DEALER let twice as many sessions in as the
    descriptors hold)."""
    daemon = daemon_factory("host", nofile=NOFILE)
    probe = Probe(daemon.pid)
    found = re.search(r"fd channel: up to (\d+) connections", daemon.log())
    assert found is not None, daemon.log()
    sessions: list[RawSession] = []
    try:
        for i in range(int(found.group(1))):
            sessions.append(RawSession(runtime_dir, f"s{i}"))
            assert sessions[-1].call(p.MsgType.PING)["ok"], f"session {i} got no answer"
            assert probe.alive(), f"gpumemd died at session {i}:\n{daemon.log()[-3000:]}"
        for session in sessions:
            assert session.call(p.MsgType.PING)["ok"]
        assert probe.fds() < NOFILE
    finally:
        for session in sessions:
            session.close()


def test_an_impostor_under_a_session_token_leaves_no_descriptor(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A DEALER under a session's token takes its routing id over and leaves; the
    session's own DEALER, cut off, sends again, and the session goes on with a new one.
    Each round used to leave the cut-off connection open for good; now they are freed
    when they fill the budget (the channel reopens), and the session goes on."""
    daemon = daemon_factory("host", nofile=NOFILE)
    probe = Probe(daemon.pid)
    with RawSession(runtime_dir, "steady") as steady:
        assert steady.control is not None and answered(steady.control, 1)
        baseline = settled_fds(probe, 0, timeout=0.5)
        most = baseline
        for i in range(NOFILE):
            with RawControl(runtime_dir, routing_id=steady.token) as impostor:
                answered(impostor, 10 * i)
            steady.control.send_frames(envelope(p.MsgType.PING, None, 10 * i + 1))  # unanswered: cut off
            steady.control.close()
            steady.control = RawControl(runtime_dir, routing_id=steady.token)
            most = max(most, probe.fds())
            assert probe.alive(), f"gpumemd died after {i} rounds:\n{daemon.log()[-3000:]}"
        assert most < baseline + CONTROL_BUDGET + 16, f"the daemon held {most} descriptors (baseline {baseline})"
        assert answered(steady.control, 2) or answered(steady.control, 3), "the session got no answer after the rounds"
    assert "reopened the control channel" in daemon.log(), daemon.log()[-2000:]
