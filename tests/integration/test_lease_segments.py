"""Who holds a graph pool's lease words, across real processes, on every backend.

A pool's lease slot lives in a segment (a memfd of one page, ``gpumemd-lease-pool-N``)
that gpumemd grants only to the pool's owner and to the clients that open it. These
scenarios look at what each client process really maps (/proc/self/maps) and holds
(/proc/self/fd), and at a client that lets go of the arena but keeps scribbling through
the mapping it had: gpumemd repairs the slot within a tick and reports it (its log,
``gpumemctl status --json``, ``gpumemctl extents``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import child_env
from gpumem_shared import lease_table
from gpumem_shared.lease_table import LeaseKind
from gpumemd_testkit import Probe

MiB = 1 << 20
ARENA = "graphs"
NOTHING = {"mapped": [], "fds": []}


def ask(client: Any, line: str, timeout: float = 60.0) -> str:
    client.send(line)
    out = client.expect("", timeout=timeout)
    assert out.startswith("OK"), f"{line!r}: {out!r}"
    return out[2:].strip()


def refused(client: Any, line: str) -> str:
    """The error class of a command that must fail."""
    result = json.loads(ask(client, f"errinfo {line}"))
    assert "error" in result, f"{line!r} did not fail: {result}"
    return str(result["error"])


def segments(client: Any) -> dict[str, list[int]]:
    return json.loads(ask(client, "segments"))  # type: ignore[no-any-return]


def ctl(runtime_dir: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", *args, "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
    )
    assert result.returncode == 0 and result.stderr == "", result
    return result.stdout


def shell(run_client: Any, name: str) -> Any:
    c = run_client("shell", name)
    c.expect("CONNECTED", timeout=60)
    return c


def owner_with_pools(run_client: Any, *sharers: str) -> tuple[Any, int, int]:
    """A client owning an arena shared with ``sharers``, with a private and a shared pool in it."""
    o = shell(run_client, "owner-o")
    ask(o, f"create {ARENA} {1 << 30}")
    ask(o, f"commit {ARENA} {32 * MiB}")
    private = json.loads(ask(o, f"gpregister {ARENA} private 0 {4 * MiB}"))["id"]
    shared = json.loads(ask(o, f"gpregister {ARENA} decode {4 * MiB} {4 * MiB} shared"))["id"]
    for name in sharers:
        ask(o, f"share {ARENA} {name}")
    return o, private, shared


def test_a_client_holds_the_lease_words_of_the_pools_it_may_use_and_no_others(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    o, private, shared = owner_with_pools(run_client, "sharer-s")
    stranger, sharer = shell(run_client, "stranger-x"), shell(run_client, "sharer-s")
    assert segments(o) == {"mapped": [private, shared], "fds": []}, "the owner maps its pools' segments and keeps no descriptor"
    assert segments(stranger) == NOTHING, "a client that owns nothing and opened nothing maps no lease words"
    assert refused(stranger, f"open {shared}") == "PermissionDenied"  # the arena is not shared with it
    assert refused(stranger, f"lease replay {private} 0 x") == "PermissionDenied"
    assert segments(stranger) == NOTHING
    ask(sharer, f"attach {ARENA}")
    assert segments(sharer) == NOTHING, "attaching the arena grants no pool's segment"
    assert refused(sharer, f"open {private}") == "PermissionDenied", "a private pool in a shared arena stays its owner's"
    assert segments(sharer) == NOTHING
    ask(sharer, f"open {shared}")
    assert segments(sharer) == {"mapped": [shared], "fds": []}
    assert ask(sharer, f"lease replay {shared} 0 from-the-sharer") == "replay"
    assert refused(o, f"lease capture {shared} 0 from-the-owner") == "LeaseConflict", "the owner and the sharer share the slot"
    assert ask(sharer, f"unlease {shared}") == ""
    assert ask(o, f"lease capture {shared} 0 from-the-owner") == "capture"
    assert ask(o, f"unlease {shared}") == ""
    assert segments(stranger) == NOTHING and segments(sharer) == {"mapped": [shared], "fds": []}


def test_a_sharer_that_let_go_of_the_arena_and_scribbles_is_repaired_within_a_tick_and_reported(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    o, _, pool = owner_with_pools(run_client, "sharer-s")
    sharer = shell(run_client, "sharer-s")
    ask(sharer, f"attach {ARENA}")
    ask(sharer, f"open {pool}")
    [me] = [c for c in json.loads(ask(sharer, "status"))["clients"] if c["name"] == "sharer-s"]
    ask(sharer, f"release {ARENA}")
    assert segments(sharer) == {"mapped": [pool], "fds": []}, "letting go of the arena leaves the mapping: only the daemon can guard"
    session = lease_table.word_session(me["session_id"])
    scribbled = {"word": lease_table.encode(LeaseKind.BORROW, session, me["pid"]), "handoff": session, "escaped": session}
    for field, value in scribbled.items():
        assert ask(sharer, f"scribble {pool} {field} {value:x}") == ""
    deadline = time.monotonic() + 1.5
    while (slot := json.loads(ask(o, f"peek {pool}")))["word"] or slot["handoff"] or slot["escaped"]:
        assert time.monotonic() < deadline, f"graph pool {pool}'s slot not repaired within a tick: {slot}"
        time.sleep(0.01)
    assert ask(o, f"lease replay {pool} 0 after-the-repair") == "replay"
    assert ask(o, f"unlease {pool}") == ""
    log = [line for line in daemon.log().splitlines() if f"graph pool {pool} ('decode')" in line and "repaired" in line]
    assert len(log) == 3, daemon.log()
    for field in ("lease word", "handoff", "escape mark"):
        assert any(f"its lease slot's {field} held" in line and f"client 'sharer-s' (pid {me['pid']}), which may not use the pool" in line for line in log), log
    [shown] = json.loads(ctl(runtime_dir, "status", "--json"))["graph_pools"][1:]
    assert (shown["id"], shown["lease_repairs"]) == (pool, 3)
    extents = ctl(runtime_dir, "extents")
    assert f"pool {pool}: gpumemd repaired its lease slot 3 time(s)" in extents, extents
    header, private_row, shared_row = [line.split() for line in extents.splitlines()[1:4]]
    assert (header[-1], private_row[-1], shared_row[0], shared_row[-1]) == ("REPAIRS", "0", str(pool), "3"), extents


def test_descriptors_a_caller_does_not_take_are_closed(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """``session.call`` returns the body only: the lease segment a registration or an open
    brings is closed, not left open in the client for each pool."""
    import gpumem
    from gpumem_shared import protocol as p

    daemon_factory("host")
    with gpumem.connect(0, name="raw-caller", runtime_dir=runtime_dir) as s:
        s.create_arena(ARENA, 1 << 30).commit(32 * MiB)
        held = Probe(os.getpid()).descriptors()
        for i in range(4):
            extent = p.Extent(offset=i * 4 * MiB, size=4 * MiB)
            pool = s.call(p.RegisterGraphPool(arena=ARENA, label=f"p{i}", extents=[extent], free_runs=[], shared=True)).pool
            s.call(p.OpenGraphPool(pool_id=pool.id))
        left = Probe(os.getpid()).descriptors() - held
        assert not left, f"descriptors of lease segments left open: {left}"
