"""The graph-pool registry against a real gpumemd (host backend): register / update /
retire through the client library and on the raw wire, what ``gpumemctl graph-pools`` and
``gpumemctl status`` show, and a kill -9 of the owner dropping its pools.

The host backend has no torch pool, so the registry messages are sent as they are
(``session.call(p.RegisterGraphPool(...))``), with extents chosen by the test."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpumem
from conftest import child_env
from gpumem_shared import protocol as p
from gpumem_shared.units import format_size
from gpumemd_testkit import GiB, MiB, RawControl, RawSession, assert_error, read_line, status, wait_status

KiB = 1 << 10


def E(offset: int, size: int) -> p.Extent:
    return p.Extent(offset=offset, size=size)


def wire(extents: list[p.Extent]) -> list[dict[str, int]]:
    return [{"offset": e.offset, "size": e.size} for e in extents]


@pytest.fixture
def host_daemon(daemon_factory: Any) -> Any:
    return daemon_factory("host")


@pytest.fixture
def connect(runtime_dir: Path) -> Iterator[Any]:
    sessions: list[gpumem.Session] = []

    def open_(name: str) -> gpumem.Session:
        sessions.append(gpumem.connect(0, name=name, runtime_dir=runtime_dir, timeout=10.0))
        return sessions[-1]

    yield open_
    for s in sessions:
        s.close()


def ctl(runtime_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(runtime_dir),
    )
    assert result.returncode == 0, result
    assert result.stderr == "", result.stderr
    return result


def table(lines: list[str]) -> list[dict[str, str]]:
    """A gpumemctl table (header line, then rows; columns two spaces apart at least)."""
    header = re.split(r"\s{2,}", lines[0].strip())
    rows = []
    for line in lines[1:]:
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(header), f"{line!r} does not fit {header}"
        rows.append(dict(zip(header, cells)))
    return rows


def section(out: str, title: str, until: str | None) -> list[str]:
    lines = out.splitlines()
    start = lines.index(title) + 1
    end = lines.index(until, start) if until else len(lines)
    return [line for line in lines[start:end] if line.strip()]


# --------------------------------------------------------------------------- round trip


def test_register_update_retire_round_trip(host_daemon, connect, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    owner = connect("graph-owner")
    arena = owner.create_arena("graphs", GiB)
    arena.commit(32 * MiB)

    reply = owner.call(
        p.RegisterGraphPool(
            arena="graphs",
            label="decode-bs8",
            extents=[E(8 * MiB, 4 * MiB), E(0, 4 * MiB)],
            free_runs=[E(1 * MiB, 512 * KiB), E(1 * MiB + 512 * KiB, 512 * KiB), E(8 * MiB, 2 * MiB), E(0, 256 * KiB)],
        )
    )
    assert isinstance(reply, p.GraphPoolReply)
    pool = reply.pool
    assert (pool.id, pool.owner, pool.arena, pool.label, pool.epoch) == (1, "graph-owner", "graphs", "decode-bs8", 1)
    assert pool.extents == [E(0, 4 * MiB), E(8 * MiB, 4 * MiB)]
    assert pool.free_runs == [E(8 * MiB, 2 * MiB), E(1 * MiB, 1 * MiB), E(0, 256 * KiB)]
    assert pool.free_bytes == 3 * MiB + 256 * KiB
    assert status(runtime_dir)["graph_pools"] == [p.to_wire(pool)]
    assert owner.status().extents == [pool]  # the typed status decodes it too

    # not the owner: refused, whoever asks
    stranger = connect("graph-stranger")
    with pytest.raises(gpumem.PermissionDenied, match="graph-owner"):
        stranger.call(p.UpdateGraphPool(pool_id=pool.id, extents=[E(0, 2 * MiB)], free_runs=[], recaptured=True))
    with pytest.raises(gpumem.PermissionDenied, match="graph-owner"):
        stranger.call(p.RegisterGraphPool(arena="graphs", label="mine", extents=[E(16 * MiB, 2 * MiB)], free_runs=[]))
    with pytest.raises(gpumem.PermissionDenied):
        stranger.call(p.RetireGraphPool(pool_id=pool.id))
    # checks the daemon makes
    with pytest.raises(gpumem.AlreadyExists, match=r"graph pool 1 \('decode-bs8'\)"):
        owner.call(p.RegisterGraphPool(arena="graphs", label="prefill", extents=[E(2 * MiB, 4 * MiB)], free_runs=[]))
    with pytest.raises(gpumem.InvalidArgument, match="not committed"):
        owner.call(p.RegisterGraphPool(arena="graphs", label="prefill", extents=[E(32 * MiB, 2 * MiB)], free_runs=[]))
    with pytest.raises(gpumem.InvalidArgument, match="outside"):
        owner.call(p.RegisterGraphPool(arena="graphs", label="prefill", extents=[E(16 * MiB, 2 * MiB)], free_runs=[E(0, 1 * MiB)]))
    with pytest.raises(gpumem.NotFound):
        owner.call(p.UpdateGraphPool(pool_id=77, extents=[E(0, 2 * MiB)], free_runs=[]))
    assert status(runtime_dir)["graph_pools"] == [p.to_wire(pool)]

    # update: a new epoch when the runs change or on a recapture
    out = owner.call(p.UpdateGraphPool(pool_id=pool.id, extents=[E(0, 6 * MiB)], free_runs=[E(4 * MiB, 2 * MiB)])).pool
    assert out.epoch == 2 and out.extents == [E(0, 6 * MiB)] and out.free_runs == [E(4 * MiB, 2 * MiB)]
    out = owner.call(p.UpdateGraphPool(pool_id=pool.id, extents=[E(0, 6 * MiB)], free_runs=[E(4 * MiB, 2 * MiB)])).pool
    assert out.epoch == 2, "nothing changed"
    out = owner.call(p.UpdateGraphPool(pool_id=pool.id, extents=[E(0, 6 * MiB)], free_runs=[], recaptured=True)).pool
    assert out.epoch == 3 and out.free_bytes == 0
    (shown,) = status(runtime_dir)["graph_pools"]
    assert shown["epoch"] == 3 and shown["extents"] == [{"offset": 0, "size": 6 * MiB}] and shown["free_runs"] == []

    # a decommit under the pool is refused, and memory stays as it was
    with pytest.raises(gpumem.InvalidArgument, match=r"graph pool 1 \('decode-bs8'\)"):
        arena.decommit(0)
    assert arena.committed == 32 * MiB and status(runtime_dir)["device"]["accounted_bytes"] == 32 * MiB

    assert isinstance(owner.call(p.RetireGraphPool(pool_id=pool.id)), p.Ack)
    assert status(runtime_dir)["graph_pools"] == []
    with pytest.raises(gpumem.NotFound):
        owner.call(p.RetireGraphPool(pool_id=pool.id))
    assert arena.decommit(0) == 0


def test_registry_messages_on_the_raw_wire(host_daemon, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    with RawSession(runtime_dir, "raw-graphs") as s:
        s.create("graphs", GiB)
        assert s.commit("graphs", 8 * MiB)["ok"]
        body = {"arena": "graphs", "label": "raw", "extents": [{"offset": 0, "size": 4 * MiB}], "free_runs": [{"offset": 2 * MiB, "size": MiB}]}
        reply = s.call(p.MsgType.GRAPH_POOL_REGISTER, body)
        assert reply["ok"], reply
        assert reply["b"]["pool"] == {
            "id": 1,
            "owner": "raw-graphs",
            "arena": "graphs",
            "label": "raw",
            "epoch": 1,
            "extents": [{"offset": 0, "size": 4 * MiB}],
            "free_runs": [{"offset": 2 * MiB, "size": MiB}],
            "free_bytes": MiB,
            "slot": 0,  # deprecated since 1.3: the pool's lease slot has a segment of its own
            "shared": False,
            "escaped_by": "",
            "lease_repairs": 0,
        }
        assert reply["b"]["fd_batches"] == 1, "the lease segment rides with the registration"
        for bad in (
            dict(body, extents=[{"offset": 4 * MiB}]),  # size missing
            dict(body, extents="0+4MiB"),
            dict(body, free_runs=[{"offset": "0", "size": MiB}]),
            {"arena": "graphs", "extents": [], "free_runs": []},  # label missing
        ):
            assert_error(s.call(p.MsgType.GRAPH_POOL_REGISTER, bad), p.ErrorCode.INVALID_ARGUMENT)
        assert_error(s.call(p.MsgType.GRAPH_POOL_UPDATE, {"pool_id": 9, "extents": [], "free_runs": []}), p.ErrorCode.NOT_FOUND)
        reply = s.call(p.MsgType.GRAPH_POOL_UPDATE, {"pool_id": 1, "extents": wire([E(0, 8 * MiB)]), "free_runs": [], "recaptured": True})
        assert reply["ok"] and reply["b"]["pool"]["epoch"] == 2 and reply["b"]["pool"]["extents"] == wire([E(0, 8 * MiB)])
        with RawControl(runtime_dir) as anonymous:
            assert_error(anonymous.call(p.MsgType.GRAPH_POOL_RETIRE, {"pool_id": 1}), p.ErrorCode.NO_SESSION)
        assert [g["id"] for g in status(runtime_dir)["graph_pools"]] == [1]
        assert s.call(p.MsgType.GRAPH_POOL_RETIRE, {"pool_id": 1})["ok"]
        assert status(runtime_dir)["graph_pools"] == []


# --------------------------------------------------------------------------- gpumemctl


def test_ctl_extents_json_and_human_and_status(host_daemon, connect, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    assert json.loads(ctl(runtime_dir, "graph-pools", "--json").stdout) == []
    assert section(ctl(runtime_dir, "graph-pools").stdout, "GRAPH POOLS", None) == ["  (none)"]

    owner = connect("ctl-owner")
    owner.create_arena("graphs", GiB).commit(32 * MiB)
    first = owner.call(
        p.RegisterGraphPool(
            arena="graphs",
            label="decode",
            extents=[E(0, 4 * MiB), E(4 * MiB, 2 * MiB)],
            free_runs=[E(1 * MiB, 512 * KiB), E(5 * MiB, 1 * MiB), E(256 * KiB, 256 * KiB)],
        )
    ).pool
    first = owner.call(p.UpdateGraphPool(pool_id=first.id, extents=first.extents, free_runs=first.free_runs, recaptured=True)).pool
    second = owner.call(p.RegisterGraphPool(arena="graphs", label="prefill", extents=[E(16 * MiB, 8 * MiB)], free_runs=[])).pool
    assert (first.id, first.epoch, second.id) == (1, 2, 2)

    listed = json.loads(ctl(runtime_dir, "graph-pools", "--json").stdout)
    assert listed == [p.to_wire(first), p.to_wire(second)]
    assert listed[0]["free_runs"] == wire([E(5 * MiB, 1 * MiB), E(1 * MiB, 512 * KiB), E(256 * KiB, 256 * KiB)])
    assert listed[0]["free_bytes"] == 1 * MiB + 768 * KiB
    shown = json.loads(ctl(runtime_dir, "status", "--json").stdout)
    assert shown["graph_pools"] == shown["extents"] == listed

    expected = [
        {
            "POOL": "1",
            "OWNER": "ctl-owner",
            "ARENA": "graphs",
            "LABEL": "decode",
            "EPOCH": "2",
            "SHARED": "no",
            "EXTENTS": "2",
            "EXTENT BYTES": "6 MiB",
            "FREE RUNS": "3",
            "FREE": format_size(1 * MiB + 768 * KiB),
            "LARGEST RUN": "1 MiB",
            "REPAIRS": "0",
        },
        {
            "POOL": "2",
            "OWNER": "ctl-owner",
            "ARENA": "graphs",
            "LABEL": "prefill",
            "EPOCH": "1",
            "SHARED": "no",
            "EXTENTS": "1",
            "EXTENT BYTES": "8 MiB",
            "FREE RUNS": "0",
            "FREE": "0 B",
            "LARGEST RUN": "-",
            "REPAIRS": "0",
        },
    ]
    assert expected[0]["FREE"] == "1.75 MiB"
    human = section(ctl(runtime_dir, "graph-pools").stdout, "GRAPH POOLS", None)
    assert table(human[:3]) == expected
    assert human[3:] == [
        "  pool 1 free runs (offset+size): 0x500000+1 MiB, 0x100000+512 KiB, 0x40000+256 KiB",
        "  pool 2 free runs (offset+size): none",
    ]
    assert table(section(ctl(runtime_dir, "status").stdout, "GRAPH POOLS", "LEASES")) == expected

    owner.call(p.RetireGraphPool(pool_id=first.id))
    assert [row["POOL"] for row in table(section(ctl(runtime_dir, "status").stdout, "GRAPH POOLS", "LEASES"))] == ["2"]
    owner.call(p.RetireGraphPool(pool_id=second.id))
    assert section(ctl(runtime_dir, "status").stdout, "GRAPH POOLS", "LEASES") == ["  (none)"]


# --------------------------------------------------------------------------- owner death

OWNER_SCRIPT = """
import sys
import gpumem
from gpumem_shared import protocol as p

MiB = 1 << 20
s = gpumem.connect(0, name="doomed-owner", runtime_dir=sys.argv[1], timeout=10.0)
arena = s.create_arena("doomed-graphs", 1 << 30)
arena.commit(16 * MiB)
arena.share("bystander")
ids = []
for i in range(2):
    reply = s.call(p.RegisterGraphPool(arena="doomed-graphs", label=f"g{i}", extents=[p.Extent(offset=i * 4 * MiB, size=4 * MiB)],
                                       free_runs=[p.Extent(offset=i * 4 * MiB, size=MiB)]))
    ids.append(reply.pool.id)
print("REGISTERED", *ids, flush=True)
sys.stdin.read()
"""


def test_kill_9_of_the_owner_drops_its_pools_within_a_second(host_daemon, connect, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    bystander = connect("bystander")
    mine = bystander.create_arena("kept-graphs", GiB)
    mine.commit(8 * MiB)
    kept = bystander.call(p.RegisterGraphPool(arena="kept-graphs", label="kept", extents=[E(0, 4 * MiB)], free_runs=[E(0, MiB)])).pool

    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, str(runtime_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(runtime_dir),
    )
    try:
        ids = [int(i) for i in read_line(proc, "REGISTERED").split()]
        assert ids == [kept.id + 1, kept.id + 2]
        attached = bystander.attach_arena("doomed-graphs")  # the arena will outlive its owner
        before = status(runtime_dir)
        assert sorted((g["owner"], g["label"]) for g in before["graph_pools"]) == [("bystander", "kept"), ("doomed-owner", "g0"), ("doomed-owner", "g1")]

        killed_at = time.monotonic()
        proc.kill()
        proc.wait(10)
        after = wait_status(
            runtime_dir, lambda s: all(g["owner"] != "doomed-owner" for g in s["graph_pools"]), 1.0, "the dead owner's pools dropped"
        )
        assert time.monotonic() - killed_at < 1.5  # the wait itself is bounded at 1 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    assert after["graph_pools"] == [p.to_wire(kept)]  # the bystander's pool, untouched
    arenas = {a["name"]: a for a in after["arenas"]}
    assert arenas["doomed-graphs"]["owner_alive"] is False and arenas["doomed-graphs"]["attached"] == ["bystander"]
    for pool_id in ids:
        with pytest.raises(gpumem.NotFound):
            bystander.call(p.RetireGraphPool(pool_id=pool_id))
    attached.release()
    assert wait_status(runtime_dir, lambda s: "doomed-graphs" not in {a["name"] for a in s["arenas"]}, 1.0, "arena gone")["graph_pools"] == [
        p.to_wire(kept)
    ]
