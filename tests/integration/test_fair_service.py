"""Fair service on the control channel: peers that flood it over many connections delay
another session by a request per turn, not by their whole backlog (admission.FairQueue).

Counted, not timed: how many of the flood's requests the daemon answers while a
session's ping is out. ZeroMQ alone turns over every connection once per round, so
without the daemon's own turns that is about half a request per flooding connection
per ping. The flood asks for STATUS of a daemon holding many arenas: each answer costs
the daemon far more than a ping's round trip, so what the test process does between
pings lets few of them through.
"""

from __future__ import annotations

import zmq

from gpumem_shared import protocol as p
from gpumemd_testkit import RawControl, RawSession, envelope

CONNECTIONS = 64
DEPTH = 12  # requests each connection sends at once: 768 in all, under the anonymous queue's limit
PINGS = 10
ARENAS = 200


def _answered(flood: list[RawControl]) -> int:
    n = 0
    for c in flood:
        while True:
            try:
                c.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
    return n


def test_a_flood_over_many_connections_delays_a_session_by_a_turn(daemon, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    with RawSession(runtime_dir, "probe") as probe:
        for i in range(ARENAS):
            probe.create(f"a{i}", 2 << 20)
        flood = [RawControl(runtime_dir) for _ in range(CONNECTIONS)]
        try:
            for c in flood:
                for i in range(DEPTH):
                    c.send_frames(envelope(p.MsgType.STATUS, None, i + 1))
            _answered(flood)
            during = []
            for _ in range(PINGS):
                assert probe.call(p.MsgType.PING)["ok"]
                during.append(_answered(flood))
        finally:
            for c in flood:
                c.close()
    assert sum(during) < 10 * PINGS, f"flood requests answered while each ping was out: {during}"
