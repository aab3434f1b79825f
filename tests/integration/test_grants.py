"""Grants across real processes, on every backend: a client name belongs to one live
session; a share by name alone admits that name under the owner's uid only, so a
process of another uid that takes the name gets nothing (no descriptor reaches it,
nothing is mapped in it) until it gives the grant's token; revoking refuses new
attaches only; status shows grants, never their tokens.

The other user is real as far as the daemon can tell: tests/clients.py --as drops the
client process to another uid before it connects, and the daemon reads it from
SO_PEERCRED. It keeps gid 0 (the sockets are 0660, group root when no --socket-group
is given), as a member of the daemon's socket group would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gpumem
from conftest import child_env
from gpumemd_testkit import GiB, MiB, do, reply, status, wait_status

OTHER_UID = 4242  # no account needed: the kernel reports whatever uid a process runs as
COMMIT = 64 * MiB + 6 * MiB  # bulk chunks and a tail ladder
PATTERN = 171

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")


def ctl(runtime_dir: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
    )
    assert out.returncode == 0, out
    return out.stdout


def refused(client: Any, command: str, error: str, *why: str) -> str:
    line = reply(client, command)
    assert line.startswith(f"ERR {error} "), f"{command!r} answered {line!r}"
    for part in why:
        assert part in line, line
    return line


@needs_root
def test_an_impostor_of_another_uid_gets_nothing_until_it_gives_the_token(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    os.chmod(runtime_dir, 0o750)  # the other uid reaches the sockets through group root
    owner_uid = os.getuid()
    owner = run_client("shell", "engine-a")
    owner.expect("CONNECTED")
    address = int(do(owner, f"create kv {4 * GiB}"))
    do(owner, f"commit kv {COMMIT}")
    do(owner, f"fill kv 0 {COMMIT} {PATTERN}")
    token = do(owner, "share kv engine-b")
    assert len(token) == 64 and int(token, 16) >= 0

    # engine-b of the owner's uid is admitted by its name; the probe below sees the
    # descriptors a successful attach brings, so seeing none later means none came.
    real = run_client("shell", "engine-b")
    real.expect("CONNECTED")
    attached = json.loads(do(real, "rawattach kv"))
    assert attached["chunks"] >= 3 and attached["fd_batches"] == 1
    assert json.loads(do(real, "fdqueue")) == {"messages": 1, "fds": attached["chunks"], "kinds": ["FdBatch"]}

    # While it lives, its name is its own: a second session under it is refused.
    second = run_client("shell", "engine-b", "--as", f"{OTHER_UID}:0")
    line = second.expect("ERR")
    assert line.startswith("AlreadyExists ") and f"pid {real.pid}" in line, line
    assert [c["pid"] for c in status(runtime_dir)["clients"] if c["name"] == "engine-b"] == [real.pid]
    real.send("exit")
    real.finish()
    wait_status(runtime_dir, lambda st: all(c["name"] != "engine-b" for c in st["clients"]), 5.0, "engine-b's session closed")

    # Once it is gone, a process of another uid may take the name, and nothing more.
    impostor = run_client("shell", "engine-b", "--as", f"{OTHER_UID}:0")
    impostor.expect("CONNECTED")
    (me,) = [c for c in status(runtime_dir)["clients"] if c["name"] == "engine-b"]
    assert (me["pid"], me["uid"], me["gid"]) == (impostor.pid, OTHER_UID, 0)
    kv = f"{owner_uid}/kv"  # names are per uid: another uid's arena is named with its owner
    before = json.loads(do(impostor, f"probe {address} {COMMIT}"))
    assert before["mapped"] is False
    why = (f"client 'engine-b' (uid {OTHER_UID}, gid 0)", f"admits uid {owner_uid} only", "'engine-a'")
    refused(impostor, f"rawattach {kv}", "PermissionDenied", *why)
    assert json.loads(do(impostor, "fdqueue")) == {"messages": 0, "fds": 0, "kinds": []}, "a refused attach hands out no fd"
    refused(impostor, f"attach {kv}", "PermissionDenied", *why)
    refused(impostor, "attach kv", "NotFound", f"'{kv}'")  # a bare name is its own uid's
    refused(impostor, f"attach {kv} {'0' * 64}", "PermissionDenied", "matches none of its grants")
    assert json.loads(do(impostor, f"probe {address} {COMMIT}")) == before, "a refused attach maps nothing"
    s = status(runtime_dir)
    assert s["arenas"][0]["attached"] == ["engine-a"]
    assert [c["arenas"] for c in s["clients"] if c["name"] == "engine-b"] == [[]]

    # The token, handed over out of band, admits it.
    assert int(do(impostor, f"attach {kv} {token}")) == address
    assert do(impostor, f"check {kv} 0 {COMMIT} {PATTERN}") == "MATCH"
    assert json.loads(do(impostor, f"probe {address} {COMMIT}"))["mapped"] is True
    do(impostor, f"write {kv} 4096 0badf00d")
    assert do(owner, "read kv 4096 4") == "0badf00d"

    # Status shows the grant, never its token: not the daemon's reply, gpumemctl, or its log.
    (arena,) = status(runtime_dir)["arenas"]
    assert arena["grants"] == [{"id": 1, "client": "engine-b", "uid": owner_uid, "gid": -1, "uid_implied": True, "read_only": False}]
    assert sorted(arena["attached"]) == ["engine-a", "engine-b"]
    shown = ctl(runtime_dir, "status") + ctl(runtime_dir, "arenas") + ctl(runtime_dir, "status", "--json")
    assert f"engine-b uid {owner_uid}" in shown and "GRANTS" in shown
    assert token not in shown and token not in daemon.log()

    # Revoked: what is attached stays attached and mapped; a new attach is refused.
    do(owner, f"unshare kv {token}")
    assert do(impostor, f"read {kv} 4096 4") == "0badf00d"
    do(owner, f"commit kv {COMMIT + 8 * MiB}")
    assert int(do(impostor, f"sync {kv}")) == COMMIT + 8 * MiB, "an attached sharer keeps its place"
    do(impostor, f"release {kv}")
    refused(impostor, f"attach {kv} {token}", "PermissionDenied", "matches none of its grants")
    assert json.loads(do(impostor, f"probe {address} {COMMIT}"))["mapped"] is False
    assert status(runtime_dir)["arenas"][0]["grants"] == []

    # A grant that names the other uid admits that user's engine without a token.
    do(owner, f"share kv - uid={OTHER_UID}")
    assert int(do(impostor, f"attach {kv}")) == address
    assert do(impostor, f"read {kv} 4096 4") == "0badf00d"
    assert do(impostor, f"check {kv} {MiB} {COMMIT - MiB} {PATTERN}") == "MATCH"
    assert token not in daemon.log()
    for client in (impostor, owner):
        client.send("exit")
        client.finish()


@needs_root
def test_a_name_squatted_by_another_uid_is_still_the_victims_own(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Names are per uid: another user's 'kv', even shared with the victim's uid as bait,
    neither keeps the victim's engine from creating its 'kv' nor stands in for it."""
    os.chmod(runtime_dir, 0o750)
    owner_uid = os.getuid()
    squatter = run_client("shell", "squatter", "--as", f"{OTHER_UID}:0")
    squatter.expect("CONNECTED")
    bait = int(do(squatter, f"create kv {4 * GiB}"))
    do(squatter, f"commit kv {COMMIT}")
    do(squatter, f"fill kv 0 {COMMIT} 90")
    do(squatter, f"share kv - uid={owner_uid}")

    # The victim's second process asks for its engine's 'kv' before the engine made it.
    sibling = run_client("shell", "engine-b")
    sibling.expect("CONNECTED")
    refused(sibling, "attach kv", "NotFound", f"'{OTHER_UID}/kv'")

    engine = run_client("shell", "engine-a")
    engine.expect("CONNECTED")
    address = int(do(engine, f"create kv {4 * GiB}"))
    assert address != bait
    do(engine, f"commit kv {COMMIT}")
    do(engine, f"fill kv 0 {COMMIT} {PATTERN}")
    do(engine, "share kv engine-b")
    assert int(do(sibling, "attach kv")) == address
    assert do(sibling, f"check kv 0 {COMMIT} {PATTERN}") == "MATCH"
    assert do(squatter, f"check kv 0 {COMMIT} 90") == "MATCH", "the squatter's memory is its own"

    # Status and gpumemctl name each 'kv' with its owner.
    arenas = {a["name"]: (a["owner"], a["owner_uid"]) for a in status(runtime_dir)["arenas"]}
    assert arenas == {"kv": ("squatter", OTHER_UID), f"{owner_uid}/kv": ("engine-a", owner_uid)}
    rows = [line.split() for line in ctl(runtime_dir, "arenas").splitlines()]
    owners = [r[:2] for r in rows if r and r[0].endswith("/kv") and not r[1].isdigit()]  # the grants' rows follow, by number
    assert owners == [[f"{OTHER_UID}/kv", "squatter"], [f"{owner_uid}/kv", "engine-a"]], rows
    for client in (sibling, engine, squatter):
        client.send("exit")
        client.finish()


def test_the_library_refuses_a_negative_id_rather_than_widen_the_grant(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """-1 means "any" on the wire: ``share(uid=-1)`` must not become a grant for anyone."""
    daemon_factory("host")
    with gpumem.connect(0, name="owner", runtime_dir=runtime_dir) as s:
        arena = s.create_arena("kv", GiB)
        for ids in ({"uid": -1}, {"gid": -1}, {"uid": 5, "gid": -3}):
            with pytest.raises(gpumem.InvalidArgument, match="not a valid id"):
                arena.share("engine-b", **ids)
        assert status(runtime_dir)["arenas"][0]["grants"] == []
        token = arena.share(uid=5)
        arena.unshare(token)
        with pytest.raises(gpumem.NotFound, match="no grant on arena 'kv' has this token"):
            arena.unshare(token)
