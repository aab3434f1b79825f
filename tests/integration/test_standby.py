"""A standby's reservation of a retained group's windows, with real processes on every
backend: before the primary dies the standby backs the primary's windows with its own
placeholder (no byte of the primary's reaches it) and builds a tensor there (on CUDA
also captures a graph reading it); after kill -9 it adopts into the reservation, and
the tensor built before (the graph captured before) reads the adopted contents at the
same addresses."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import test_retain as kit
from gpumemd_testkit import GiB, MiB, do, reply, status, wait_status

spawn = kit.spawn  # the fixture, shared with test_retain


def test_adoption_swaps_the_reserved_placeholder_for_the_adopted_chunks(daemon: Any, spawn: kit.Spawn, runtime_dir: Path) -> None:
    eng, secret, addresses = kit.primary(spawn)
    before = status(runtime_dir)["device"]["accounted_bytes"]
    standby = spawn("standby")
    assert json.loads(do(standby, f"reserve g {secret}")) == addresses  # the primary's windows, as the daemon planned them
    do(standby, f"rview kv g kv 0 {MiB}")
    do(standby, f"rview w g weights 0 {MiB}")
    # Scratch of the standby's own under both: what it writes there stays there.
    assert 90 not in json.loads(do(standby, "vread kv"))
    do(standby, "vfill kv 7")
    assert json.loads(do(standby, "vread kv")) == [7]
    assert do(eng, f"check kv 0 {MiB} 90") == "MATCH"
    own = status(runtime_dir)["device"]["accounted_bytes"] - before
    assert 0 < own <= 64 * MiB + 2 * MiB  # the placeholder's slot and granule, nothing of the group's

    eng.kill()
    kit.orphaned(runtime_dir)
    got = json.loads(do(standby, f"adopt g {secret} 5 reserved"))
    assert got["kv"] == {"kv": [addresses["kv"], 4096]}
    assert json.loads(do(standby, "vread kv")) == [90]  # the tensor built before now reads the adopted rows
    assert json.loads(do(standby, "vread w")) == [171]
    assert do(standby, "kvcheck kv") == "MATCH"
    backed = json.loads(do(standby, "backed kv"))
    assert backed["committed"] == [[0, 16 * MiB], [64 * MiB, 80 * MiB]]  # each buffer's 4096 committed rows: the adopted chunks
    assert backed["backed"] == [[0, 128 * MiB]]  # the uncommitted rows backed again, by the pool's own placeholder now
    assert int(do(standby, "grow kv 8192")) == 8192  # and commit swaps it out as for any pool
    s = status(runtime_dir)
    assert [a["name"] for a in s["arenas"]] == ["weights", "kv"]  # the reservation's scratch arena went
    do(standby, "close")
    after = wait_status(runtime_dir, lambda s: not s["arenas"], 5.0, "everything released")
    assert after["device"]["accounted_bytes"] == 0 and after["retained"] == []


def mapped_protection(pid: int, address: int) -> str:
    """The host's protection of ``address`` in process ``pid`` ("---p": reserved only)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return perms
    return ""


def test_a_parked_reservation_maps_nothing_and_adopts_as_before(daemon: Any, spawn: kit.Spawn, runtime_dir: Path) -> None:
    """A standby that built its tensors (on CUDA captured its graph) parks: the placeholder
    leaves its windows before the primary dies, so the adoption has none to unmap, and
    the tensor built before reads the adopted rows as an unparked one does."""
    eng, secret, addresses = kit.primary(spawn)
    standby = spawn("standby")
    do(standby, f"reserve g {secret}")
    do(standby, f"rview kv g kv 0 {MiB}")
    if daemon.backend == "host":
        assert mapped_protection(standby.pid, addresses["kv"]).startswith("rw"), "the placeholder is mapped there"
    do(standby, "park g")
    if daemon.backend == "host":
        assert mapped_protection(standby.pid, addresses["kv"]).startswith("---"), "parked: reserved, nothing mapped"
    assert "is parked" in reply(standby, f"rview late g kv 0 {MiB}")  # no new view over a parked window
    eng.kill()
    kit.orphaned(runtime_dir)
    got = json.loads(do(standby, f"adopt g {secret} 5 reserved"))
    assert got["kv"] == {"kv": [addresses["kv"], 4096]}
    assert json.loads(do(standby, "vread kv")) == [90]
    backed = json.loads(do(standby, "backed kv"))
    assert backed["committed"] == [[0, 16 * MiB], [64 * MiB, 80 * MiB]]
    assert backed["backed"] == [[0, 128 * MiB]]  # the uncommitted rows backed by the pool's own placeholder, parked or not
    assert [a["name"] for a in status(runtime_dir)["arenas"]] == ["weights", "kv"]


def test_a_reservation_needs_the_secret_and_the_uid(daemon: Any, spawn: kit.Spawn, runtime_dir: Path) -> None:
    eng, secret, _ = kit.primary(spawn)
    standby = spawn("standby")
    assert reply(standby, f"reserve g {'0' * 64}").startswith("ERR PermissionDenied")
    assert reply(standby, f"reserve nope {secret}").startswith("ERR NotFound")
    assert [a["name"] for a in status(runtime_dir)["arenas"]] == ["weights", "kv"]  # nothing made for a refusal


@kit.needs_root
def test_a_stolen_secret_reserves_nothing_under_another_uid(daemon: Any, spawn: kit.Spawn, runtime_dir: Path) -> None:
    _, secret, _ = kit.primary(spawn)
    os.chmod(runtime_dir, 0o750)  # the other uid reaches the sockets through group root
    thief = spawn("thief", "--as", f"{kit.OTHER_UID}:0")
    stolen = reply(thief, f"reserve g {secret}")
    assert stolen.startswith("ERR PermissionDenied") and f"uid {os.geteuid()}" in stolen


def test_a_reservation_closed_or_its_session_ended_leaves_the_group_alone(daemon: Any, spawn: kit.Spawn, runtime_dir: Path) -> None:
    eng, secret, addresses = kit.primary(spawn)
    before = status(runtime_dir)["device"]["accounted_bytes"]
    first = spawn("standby-a")
    do(first, f"reserve g {secret}")
    assert reply(first, f"reserve g {secret}").startswith("ERR InvalidArgument")  # once per session
    do(first, "unreserve g")
    assert status(runtime_dir)["device"]["accounted_bytes"] == before
    second = spawn("standby-b")
    do(second, f"reserve g {secret}")
    second.kill()
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == before, 5.0, "the dead standby's scratch released")
    assert do(eng, f"check kv 0 {MiB} 90") == "MATCH"
    g = kit.group_of(status(runtime_dir))
    assert g is not None and (g["state"], g["holder"]) == ("held", "primary")
    # A standby whose reservation was closed adopts as any adopter, at the same addresses.
    eng.kill()
    kit.orphaned(runtime_dir)
    got = json.loads(do(first, f"adopt g {secret} 5"))
    assert got["kv"] == {"kv": [addresses["kv"], 4096]}
    assert do(first, f"check kv 0 {MiB} 90") == "MATCH"


@pytest.mark.parametrize("parked", [False, True], ids=["covered", "parked"])
def test_a_window_planned_again_over_a_reservation_is_refused_in_the_standby(
    daemon: Any, spawn: kit.Spawn, runtime_dir: Path, parked: bool
) -> None:
    eng, secret, addresses = kit.primary(spawn)
    standby = spawn("standby")
    do(standby, f"reserve g {secret}")
    if parked:  # nothing mapped there now, and the window is still the reservation's
        do(standby, "park g")
    do(eng, "close")  # an ordinary end: the group and its windows go, the planner may hand them out again
    wait_status(runtime_dir, lambda s: len(s["arenas"]) == 1, 5.0, "the primary's arenas released")  # the scratch left
    again = reply(standby, f"create mine {GiB}")
    assert again.startswith("ERR VaCollision") and "retain group 'g'" in again, again
    do(standby, "unreserve g")
    assert int(do(standby, f"create mine {GiB}")) == addresses["weights"]


def test_an_adoption_goes_through_the_sessions_reservation_without_being_told(daemon: Any, spawn: kit.Spawn, runtime_dir: Path) -> None:
    eng, secret, addresses = kit.primary(spawn)
    standby = spawn("standby")
    do(standby, f"reserve g {secret}")
    do(standby, f"rview kv g kv 0 {MiB}")
    eng.kill()
    kit.orphaned(runtime_dir)
    got = json.loads(do(standby, f"adopt g {secret} 5"))  # no reservation named: the session's own is used
    assert got["kv"] == {"kv": [addresses["kv"], 4096]}
    assert json.loads(do(standby, "vread kv")) == [90]
    assert [a["name"] for a in status(runtime_dir)["arenas"]] == ["weights", "kv"]
