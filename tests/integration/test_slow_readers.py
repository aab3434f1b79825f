"""Sessions that never read their replies (issue 37 B15): the daemon holds what waits for
a connection's peer only up to server.REPLY_QUEUE replies, then drops the session with a
logged reason, so 30 of them asking for STATUS without end grow its memory by a bounded
amount instead of ~28 MiB/s.

Each non-reader is a session's DEALER whose receive queue holds one message: its I/O
thread stops reading, the kernel's socket buffers fill, and the replies wait in the
daemon, as behind a peer that never reads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq

from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumemd_testkit import Probe, RawSession, envelope, status

MiB = 1 << 20
READERS = 30
ARENAS = 100  # a STATUS reply of about 20 KiB
ROUNDS = 3
# Requests per session per round: under the 64 a session may have waiting. The probe
# (the same uid: a turn among theirs) then pings as many times at once, and its last
# ping is served once every session's burst was.
BURST = 60


def non_reader(runtime_dir: Path, token: bytes) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.ROUTING_ID, token)
    sock.connect(Endpoints(runtime_dir, 0).zmq_url)
    return sock


def test_sessions_that_never_read_their_replies_are_dropped_and_the_daemon_stays_small(daemon: Any, runtime_dir: Path) -> None:
    probe = Probe(daemon.pid)
    with RawSession(runtime_dir, "probe") as owner:
        for i in range(ARENAS):
            owner.create(f"a{i}", 2 * MiB)
        assert owner.control is not None
        owner.control.send_frames(envelope(p.MsgType.STATUS))
        assert owner.control.sock.poll(5000)
        size = len(owner.control.sock.recv())
        sessions = [RawSession(runtime_dir, f"slow{i}") for i in range(READERS)]
        socks = []
        try:
            for s in sessions:
                assert s.control is not None
                s.control.close()  # its own DEALER would read; the non-reader takes the session's routing id
                s.control = None
                socks.append(non_reader(runtime_dir, s.token))
            assert owner.call(p.MsgType.PING)["ok"]
            before = probe.rss()
            stat = envelope(p.MsgType.STATUS)
            for _ in range(ROUNDS):
                for sock in socks:
                    for _ in range(BURST):
                        try:
                            sock.send(stat, zmq.NOBLOCK)
                        except zmq.Again:
                            break
                for i in range(BURST):
                    owner.control.send_frames(envelope(p.MsgType.PING, None, i + 1))
                for _ in range(BURST):
                    assert owner.control.recv(30)["ok"]
            deadline = time.monotonic() + 30
            while len(status(runtime_dir)["clients"]) > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            grown = probe.rss() - before
        finally:
            for sock in socks:
                sock.close(0)
            for s in sessions:
                s.close()
    log = daemon.log()
    assert log.count("it does not read its replies") == READERS, log[-3000:]
    assert grown < 64 * MiB, f"the daemon's RSS grew {grown / MiB:.0f} MiB ({READERS} sessions asking for {size} B replies)"
