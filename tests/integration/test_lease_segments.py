"""Who holds a graph pool's lease words, across real processes, on every backend.

A pool's lease slot lives in a segment (a memfd of one page, ``gpumemd-lease-pool-N``)
that gpumemd grants only to the pool's owner and to the clients that open it. These
scenarios look at what each client process really maps (/proc/self/maps) and holds
(/proc/self/fd); at a user naming a client without the right, which gpumemd repairs
within a tick and reports (its log, ``gpumemctl status --json``, ``gpumemctl graph-pools``);
and at a client that lets go of the arena but keeps writing through the mapping it had:
the pool moved to a fresh segment, which the clients left follow."""

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


def client(shell_client: Any, name: str) -> dict[str, Any]:
    """The status entry of client ``name``: its session id and pid."""
    [entry] = [c for c in json.loads(ask(shell_client, "status"))["clients"] if c["name"] == name]
    return entry  # type: ignore[no-any-return]


def test_a_user_naming_a_client_without_the_right_is_repaired_within_a_tick_and_reported(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    o, _, pool = owner_with_pools(run_client, "sharer-s")
    sharer, stranger = shell(run_client, "sharer-s"), shell(run_client, "stranger-x")
    ask(sharer, f"attach {ARENA}")
    ask(sharer, f"open {pool}")
    them = client(stranger, "stranger-x")
    session = lease_table.word_session(them["session_id"])
    scribbled = {"word": lease_table.encode(LeaseKind.BORROW, session, them["pid"]), "handoff": session, "escaped": session}
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
        assert any(f"its lease slot's {field} held" in line and f"client 'stranger-x' (pid {them['pid']}), which may not use the pool" in line for line in log), log
    [shown] = json.loads(ctl(runtime_dir, "status", "--json"))["graph_pools"][1:]
    assert (shown["id"], shown["lease_repairs"]) == (pool, 3)
    extents = ctl(runtime_dir, "extents")
    assert f"pool {pool}: gpumemd repaired its lease slot 3 time(s)" in extents, extents
    header, private_row, shared_row = [line.split() for line in extents.splitlines()[1:4]]
    assert (header[-1], private_row[-1], shared_row[0], shared_row[-1]) == ("REPAIRS", "0", str(pool), "3"), extents


def test_a_sharer_that_let_go_of_the_arena_cannot_wedge_the_owner_through_the_mapping_it_kept(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """It writes the owner's own replay word, a recording mark and an escape mark in the
    owner's name: the pool moved to a fresh segment when it let go, and the owner's
    client follows it there at its next lease."""
    o, _, pool = owner_with_pools(run_client, "sharer-s")
    sharer = shell(run_client, "sharer-s")
    ask(sharer, f"attach {ARENA}")
    ask(sharer, f"open {pool}")
    me = client(o, "owner-o")
    session = lease_table.word_session(me["session_id"])
    ask(sharer, f"release {ARENA}")
    assert segments(sharer) == {"mapped": [pool], "fds": []}, "a hostile client keeps its mapping"
    r = json.loads(ask(sharer, f"errinfo lease replay {pool} 0 after-letting-go"))
    assert r.get("error") == "PermissionDenied" and f"arena '{ARENA}'" in r["message"], r
    forged = {"word": lease_table.encode(LeaseKind.REPLAY, session, me["pid"]), "handoff": session | lease_table.HANDOFF_RECORDING, "escaped": session}
    for field, value in forged.items():
        assert ask(sharer, f"scribble {pool} {field} {value:x}") == ""
    time.sleep(0.5)  # ticks pass: nothing may bring those writes back into play
    assert ask(o, f"lease replay {pool} 0 after-the-sharer-left") == "replay"
    assert ask(o, f"unlease {pool}") == ""
    assert ask(sharer, f"scribble {pool} word {forged['word']:x}") == ""  # and again, later
    assert ask(o, f"lease capture {pool} 0 again") == "capture"
    assert ask(o, f"unlease {pool}") == ""
    assert segments(o) == {"mapped": [pool - 1, pool], "fds": []}, "the owner maps the pool's segment once, the new one"
    assert f"graph pool {pool} ('decode'): moved to a fresh lease segment" in daemon.log()
    assert json.loads(ctl(runtime_dir, "status", "--json"))["graph_pools"][1]["lease_repairs"] == 0


def test_a_lease_held_while_a_sharer_leaves_stays_exclusive_and_is_given_back(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    o, _, pool = owner_with_pools(run_client, "sharer-s", "sharer-t")
    leaving, staying = shell(run_client, "sharer-s"), shell(run_client, "sharer-t")
    for c in (leaving, staying):
        ask(c, f"attach {ARENA}")
        ask(c, f"open {pool}")
    assert ask(o, f"lease replay {pool} 0 across-the-move") == "replay"
    staying.send(f"lease borrow {pool} 30 asleep-across-the-move")
    deadline = time.monotonic() + 10
    while json.loads(ask(o, f"peek {pool}"))["waiters"] < 1:
        assert time.monotonic() < deadline, "the borrower never slept on the slot"
        time.sleep(0.01)
    ask(leaving, f"release {ARENA}")
    [held] = json.loads(ctl(runtime_dir, "status", "--json"))["leases"]
    assert (held["holder"], held["kind"], held["label"]) == ("owner-o", "replay", "across-the-move"), held
    assert ask(o, f"unlease {pool}") == "", "the replay lease was given back where the pool went"
    out = staying.expect("", timeout=30)
    assert out == "OK borrow", f"the borrower asleep across the move: {out!r}"
    assert ask(staying, f"unlease {pool}") == ""
    r = json.loads(ask(staying, f"errinfo lease borrow {pool} 0 again"))
    assert r == {"result": "borrow"}, r
    assert ask(staying, f"unlease {pool}") == ""


def test_a_word_planted_in_the_owners_name_before_leaving_goes_at_the_owners_next_lease(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Written while the sharer still had its right, the owner's word is one a repair must
    keep, and the move carries it over as a held lease; the owner's client, holding none,
    clears it when it follows the pool."""
    o, _, pool = owner_with_pools(run_client, "sharer-s")
    sharer = shell(run_client, "sharer-s")
    ask(sharer, f"attach {ARENA}")
    ask(sharer, f"open {pool}")
    me = client(o, "owner-o")
    planted = lease_table.encode(LeaseKind.REPLAY, lease_table.word_session(me["session_id"]), me["pid"])
    assert ask(sharer, f"scribble {pool} word {planted:x}") == ""
    ask(sharer, f"release {ARENA}")
    assert ask(o, f"lease replay {pool} 0 after-the-plant") == "replay"
    assert ask(o, f"unlease {pool}") == ""


def test_a_garbage_handoff_holds_no_taker_and_is_cleared_once(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A sharer writes the recording mark plus bits no handoff has: no taker waits for a
    record nobody makes, and gpumemd clears the field once (one warning, not one a tick)."""
    o, _, pool = owner_with_pools(run_client, "sharer-s")
    sharer = shell(run_client, "sharer-s")
    ask(sharer, f"attach {ARENA}")
    ask(sharer, f"open {pool}")
    assert ask(sharer, f"scribble {pool} handoff ff000001") == ""
    assert ask(o, f"lease replay {pool} 0 at-once") == "replay", "the owner waited for a recording mark nobody can clear"
    assert ask(o, f"unlease {pool}") == ""
    assert ask(sharer, f"scribble {pool} handoff ff000001") == ""
    deadline = time.monotonic() + 2.0
    while json.loads(ask(o, f"peek {pool}"))["handoff"] == 0xFF000001:
        assert time.monotonic() < deadline, f"graph pool {pool}'s handoff not cleared within a tick"
        time.sleep(0.01)
    assert ask(sharer, f"lease replay {pool} 0 after-the-repair") == "replay"
    assert ask(sharer, f"unlease {pool}") == ""
    time.sleep(0.5)  # a few more ticks: none may warn again
    log = [line for line in daemon.log().splitlines() if f"graph pool {pool} ('decode')" in line and "repaired" in line]
    assert len(log) == 1 and "its lease slot's handoff held 0xff000001, which is no session" in log[0], daemon.log()


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
