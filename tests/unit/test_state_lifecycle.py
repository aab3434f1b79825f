"""DaemonState around the requests: session-less callers, shutdown, and the status report."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from gpumem_shared import __version__
from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode

from .harness import CAPACITY, G, GiB, Harness, MiB

SESSION_REQUESTS = [
    p.CreateArena(name="kv", reserve_bytes=GiB),
    p.AttachArena(name="kv"),
    p.ShareArena(name="kv", client="engine-b"),
    p.CommitArena(name="kv", nbytes=G),
    p.DecommitArena(name="kv", to_nbytes=0),
    p.SyncArena(name="kv"),
    p.ReleaseArena(name="kv"),
    p.ChunksUnmapped(name="kv", chunk_ids=[1]),
    p.PlaceholderArena(name="kv", slot_bytes=G),
]


@pytest.mark.parametrize("message", SESSION_REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_need_a_session(h: Harness, message: object) -> None:
    a = h.connect("engine-a")
    h.create(a, "kv")
    h.commit(a, "kv", G)
    h.share(a, "kv", "engine-b")
    before = p.to_wire(h.state.status().arenas)
    error = h.refused(None, message, ErrorCode.NO_SESSION)
    assert "HELLO" in error.message
    assert p.to_wire(h.state.status().arenas) == before


def test_ping_and_status_need_no_session(h: Harness) -> None:
    assert h.ok(None, p.Ping()).reply == p.Ack()
    assert isinstance(h.ok(None, p.Status()).reply, p.StatusReply)


def test_hello_is_not_a_request_for_handle(h: Harness) -> None:
    h.refused(None, p.Hello(name="engine-a"), ErrorCode.UNKNOWN_MESSAGE)
    h.refused(None, p.Notice(kind="x"), ErrorCode.UNKNOWN_MESSAGE)
    assert h.state.sessions == {}


# --------------------------------------------------------------------------- shutdown


def test_begin_stop_tells_every_session(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    notices = h.state.begin_stop()
    assert sorted(sid for sid, _ in notices) == [a.id, b.id]
    assert {n.kind for _, n in notices} == {"stopping"}


def test_stopping_refuses_new_work_but_lets_clients_clean_up(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv")
    chunk_ids = [c.id for c in h.commit(a, "kv", 8 * MiB).handout]
    h.share(a, "kv", "engine-b")
    h.attach(b, "kv")
    h.create(a, "other")
    h.state.begin_stop()

    for session, message in [
        (a, p.CreateArena(name="kv2", reserve_bytes=GiB)),
        (a, p.CommitArena(name="kv", nbytes=16 * MiB)),
        (a, p.DecommitArena(name="kv", to_nbytes=0)),
        (a, p.ShareArena(name="kv", client="engine-c")),
        (b, p.AttachArena(name="other")),
        (b, p.SyncArena(name="kv")),
    ]:
        error = h.refused(session, message, ErrorCode.SHUTTING_DOWN)
        assert "stays valid" in error.message
    with pytest.raises(p.ProtocolError) as info:
        h.state.open_session(p.Hello(name="late"), pid=1, uid=0, gid=0)
    assert info.value.code is ErrorCode.SHUTTING_DOWN
    assert sorted(h.state.arenas.by_name) == ["kv", "other"] and h.state.arenas.by_name["kv"].committed == 8 * MiB
    assert len(h.state.sessions) == 2

    assert h.ok(None, p.Ping()).reply == p.Ack()
    status = h.ok(a, p.Status()).reply
    assert status.daemon.state == "stopping"
    assert status.device.accounted_bytes == 8 * MiB

    # clients may still unmap and let go
    h.unmapped(b, "kv", chunk_ids)
    h.release(b, "kv")
    h.release(a, "kv")
    assert sorted(h.state.arenas.by_name) == ["other"] and h.state.arenas.accounted_bytes() == 0


def test_drop_all_releases_the_daemons_references(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv")
    h.commit(a, "kv", 8 * MiB)
    h.share(a, "kv", "engine-b")
    h.attach(b, "kv")
    h.decommit(a, "kv", 0)
    h.state.begin_stop()
    h.state.drop_all()
    assert h.state.arenas.by_name == {} and h.state.arenas.retiring == {} and h.state.arenas.accounted_bytes() == 0
    # the fixture checks that every memfd and window is gone


# --------------------------------------------------------------------------- status


def test_status_of_an_idle_daemon(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(reserve_bytes=16 * MiB, runtime_dir="/run/gpumemd-test", sleep_host_limit=64 * MiB)
    h.clock.now += 12.3456
    status = h.state.status()
    assert p.to_wire(status.daemon) == {
        "version": __version__,
        "protocol": "%d.%d" % p.PROTOCOL_VERSION,
        "pid": os.getpid(),
        "backend": "host",
        "uptime_s": 12.346,
        "runtime_dir": "/run/gpumemd-test",
        "state": "serving",
        "generation": 0,
        "waiting": 0,
        "waiting_objects": 0,
        "grace_left_s": 0.0,
        "restore_problems": [],
        "sleep_host_bytes": 0,
        "sleep_host_limit": 64 * MiB,
        "lease_ordering": "ipc-events",
        "lease_lanes": 0,
        "lease_lanes_in_use": 0,
    }
    device = status.device
    assert (device.index, device.total_bytes, device.free_bytes, device.granularity) == (0, CAPACITY, CAPACITY, G)
    assert (device.accounted_bytes, device.reserve_bytes) == (0, 16 * MiB)
    assert device.uuid == h.state.device.uuid and device.name == h.state.driver.device_name()
    assert (status.clients, status.arenas, status.extents, status.leases) == ([], [], [], [])


def test_status_describes_clients_and_arenas(h: Harness) -> None:
    h.wall_clock.now = 1_700_000_500.0
    a = h.connect("engine-a")
    h.wall_clock.now = 1_700_000_600.0
    b = h.connect("engine-b")
    c = h.connect("engine-c")
    view = h.create(a, "kv", 4 * GiB)
    h.create(b, "scratch", GiB)
    ids = [ch.id for ch in h.commit(a, "kv", 22 * MiB).handout]  # 16 + 4 + 2
    h.commit(b, "scratch", 4 * MiB)
    for name in ("engine-c", "tool-1", "engine-b", "bench", "zz-top"):
        h.share(a, "kv", name)
    h.attach(c, "kv")
    h.decommit(a, "kv", 16 * MiB)  # 6 MiB retiring, held by engine-a and engine-c

    status = h.state.status()
    assert status.device.accounted_bytes == 26 * MiB
    assert status.device.free_bytes == CAPACITY - 26 * MiB
    clients = {cl.name: cl for cl in status.clients}
    assert (clients["engine-a"].session_id, clients["engine-a"].pid, clients["engine-a"].since) == (a.id, a.pid, 1_700_000_500.0)
    assert clients["engine-b"].since == 1_700_000_600.0
    assert {name: cl.arenas for name, cl in clients.items()} == {
        "engine-a": ["kv"],
        "engine-b": ["scratch"],
        "engine-c": ["kv"],
    }
    arenas = {ar.name: ar for ar in status.arenas}
    assert p.to_wire(arenas["kv"]) == {
        "name": "kv",
        "owner": "engine-a",
        "owner_pid": a.pid,
        "owner_alive": True,
        "address": view.address,
        "reserved": 4 * GiB,
        "committed": 16 * MiB,
        "chunks": 1,
        "shared_with": ["bench", "engine-b", "engine-c", "tool-1", "zz-top"],
        "attached": ["engine-a", "engine-c"],
        "retiring_bytes": 6 * MiB,
        "placeholder_bytes": 0,
        "grants": [
            {"id": i, "client": name, "uid": 1000, "gid": -1, "uid_implied": True, "read_only": False}
            for i, name in enumerate(("engine-c", "tool-1", "engine-b", "bench", "zz-top"), 1)
        ],
        "owner_uid": 1000,
    }
    scratch = arenas["scratch"]
    assert (scratch.committed, scratch.retiring_bytes, scratch.attached) == (4 * MiB, 0, ["engine-b"])

    h.unmapped(a, "kv", ids[1:])
    h.unmapped(c, "kv", ids[1:])
    assert {ar.name: ar.retiring_bytes for ar in h.state.status().arenas} == {"kv": 0, "scratch": 0}
    assert h.state.status().device.accounted_bytes == 20 * MiB


def test_status_survives_the_wire(h: Harness) -> None:
    a = h.connect("engine-a")
    h.create(a, "kv")
    h.commit(a, "kv", 6 * MiB)
    status = h.state.status()
    reply = p.decode_reply(p.encode_reply(5, status))
    assert p.from_wire(p.StatusReply, reply.body) == status
