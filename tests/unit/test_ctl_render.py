"""What gpumemctl prints, from status replies built by hand: the status page, each list
view and a frame of top, read line by line. No daemon; times are shown in UTC here."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpumem.ctl_render import render_arenas, render_graph_pools, render_kv, render_leases, render_rounds, render_status, render_top
from gpumem_shared import protocol as p

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
NOW = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Clock times render in the local zone: pin it, so the expected text is literal."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def daemon(**fields: Any) -> p.DaemonStatus:
    base: dict[str, Any] = dict(
        version="0.1.0", protocol="1.5", pid=4242, backend=p.Backend.HOST, uptime_s=3725.0, runtime_dir="/run/gpumemd", state="serving"
    )
    return p.DaemonStatus(**{**base, **fields})


def reply(**fields: Any) -> p.StatusReply:
    device = p.DeviceStatus(
        index=0, uuid="HOST-0001", name="testbox", total_bytes=80 * GiB, free_bytes=60 * GiB, granularity=2 * MiB,
        accounted_bytes=20 * GiB, reserve_bytes=1 * GiB,
    )
    base: dict[str, Any] = dict(daemon=daemon(), device=device, clients=[], arenas=[], extents=[], leases=[])
    return p.StatusReply(**{**base, **fields})


def client(session_id: int, name: str, arenas: list[str], **fields: Any) -> p.ClientStatus:
    return p.ClientStatus(session_id=session_id, name=name, pid=1000 + session_id, uid=1000, gid=1000, since=NOW, arenas=arenas, **fields)


def arena(name: str, owner: str, committed: int, **fields: Any) -> p.ArenaStatus:
    base: dict[str, Any] = dict(
        owner_pid=1, owner_alive=True, address=0x7F00_0000_0000, reserved=1 * GiB, chunks=1, shared_with=[], attached=[owner], retiring_bytes=0
    )
    return p.ArenaStatus(name=name, owner=owner, committed=committed, **{**base, **fields})


def member(client: str, reported: bool = True, **fields: Any) -> p.RoundMemberStatus:
    base: dict[str, Any] = dict(
        pool="kv", headroom_bytes=1 * GiB, graph_pool_bytes=256 * MiB, min_tokens=1024, max_tokens=65536, weight=1.0, tokens=0, bytes=0
    )
    return p.RoundMemberStatus(client=client, reported=reported, **{**base, **fields})


def round_(id: int, state: p.RoundState, members: list[p.RoundMemberStatus], **fields: Any) -> p.RoundStatus:
    base: dict[str, Any] = dict(expect=0, policy=p.RoundPolicy.PARTIAL, deadline_in_s=30.0, dropped=[], budget=p.RoundBudget(), error="")
    return p.RoundStatus(id=id, state=state, members=members, **{**base, **fields})


def kv_pool(name: str, owner: str, **fields: Any) -> p.KvPoolStatus:
    base: dict[str, Any] = dict(
        buffers=2, bytes_per_token=256 * KiB, max_tokens=65536, tokens=4096, committed_bytes=1 * GiB, min_tokens=1024, shrink_request=-1,
        weight=1.0, demand_tokens=4096, share_bytes=1 * GiB, in_use=-1,
    )
    return p.KvPoolStatus(name=name, owner=owner, **{**base, **fields})


def graph_pool(id: int, **fields: Any) -> p.GraphPoolStatus:
    base: dict[str, Any] = dict(owner="engine-a", arena="kv", label="decode", epoch=1, extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[], free_bytes=0)
    return p.GraphPoolStatus(id=id, **{**base, **fields})


def lease(pool_id: int, since: float, **fields: Any) -> p.LeaseStatus:
    base: dict[str, Any] = dict(slot=0, kind="replay", holder="engine-b", pid=1002, label="")
    return p.LeaseStatus(pool_id=pool_id, since=since, **{**base, **fields})


def rows(lines: list[str]) -> list[list[str]]:
    """A table's rows (its header dropped), split on runs of two spaces or more."""
    return [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]


# ---------------------------------------------------------------------------- status


def test_an_idle_daemon_prints_every_section_empty() -> None:
    assert render_status(reply()).splitlines() == [
        "gpumemd 0.1.0 (protocol 1.5)  pid 4242  backend host  serving, up 1h2m5s",
        "  runtime dir /run/gpumemd",
        "device 0: testbox  HOST-0001",
        "  total 80 GiB  free 60 GiB  gpumemd holds 20 GiB  reserve 1 GiB  granularity 2 MiB",
        "", "CLIENTS", "  (none)",
        "", "ARENAS", "  (none)",
        "", "GRAPH POOLS", "  (none)",
        "", "LEASES", "  (none)",
        "", "ROUNDS", "  (none)",
        "", "KV", "  (none)",
    ]


@pytest.mark.parametrize(("seconds", "shown"), [(0.9, "0m0s"), (59, "0m59s"), (3600, "1h0m0s"), (90061, "1d1h1m"), (3 * 86400, "3d0h0m")])
def test_uptime_reads_in_days_hours_minutes(seconds: float, shown: str) -> None:
    assert render_status(reply(daemon=daemon(uptime_s=seconds))).splitlines()[0].endswith(f"serving, up {shown}")


def test_a_restarted_daemon_names_what_waits_for_its_clients() -> None:
    restarted = reply(
        daemon=daemon(generation=2, waiting=1, waiting_objects=3, grace_left_s=95.0),
        clients=[client(1, "engine-a", ["kv"]), client(2, "engine-b", [], waiting=True)],
    )
    lines = render_status(restarted).splitlines()
    assert lines[2] == (
        "  restarted 2 time(s) with its state kept; 1 client(s) holding 3 arena(s) and graph pool(s) not resumed yet, released in 1m35s"
    )
    table = lines[lines.index("CLIENTS") + 1 : lines.index("ARENAS") - 1]
    assert rows(table) == [
        ["1", "engine-a", "1001", "1000", "2023-11-14 22:13:20", "kv"],
        ["2", "engine-b (waiting)", "1002", "1000", "2023-11-14 22:13:20", "-"],
    ]
    # All resumed: the count stays, the release time goes.
    resumed = render_status(reply(daemon=daemon(generation=2))).splitlines()[2]
    assert resumed == "  restarted 2 time(s) with its state kept; 0 client(s) holding 0 arena(s) and graph pool(s) not resumed yet"
    assert "restarted" not in render_status(reply())


def test_the_lease_ordering_shows_under_the_daemon_with_memops_lanes_in_use() -> None:
    memops = render_status(reply(daemon=daemon(lease_ordering="memops", lease_lanes=256, lease_lanes_in_use=3))).splitlines()
    assert memops[2] == "  lease ordering memops: 3 of 256 lanes in use"
    assert render_status(reply(daemon=daemon(lease_ordering="ipc-events"))).splitlines()[2] == "  lease ordering ipc-events"
    assert "lease ordering" not in render_status(reply()), "a daemon before 1.11 says nothing of it"


def test_clients_show_their_capped_tenant_once_a_policy_names_one() -> None:
    clients = [client(1, "engine-a", ["kv"], tenant="token team-a"), client(2, "engine-b", []), client(3, "ctl", [])]
    lines = render_status(reply(clients=clients)).splitlines()
    table = lines[lines.index("CLIENTS") + 1 : lines.index("ARENAS") - 1]
    assert table[0].split() == ["ID", "NAME", "PID", "UID", "SINCE", "ARENAS", "TENANT"]
    assert [r[-1] for r in rows(table)] == ["token team-a", "-", "-"]
    assert "TENANT" not in render_status(reply(clients=[client(2, "engine-b", [])]))


def test_the_status_page_holds_every_list_view() -> None:
    full = reply(
        clients=[client(1, "engine-a", ["kv"])],
        arenas=[arena("kv", "engine-a", 64 * MiB)],
        graph_pools=[graph_pool(7)],
        leases=[lease(7, NOW)],
        rounds=[round_(1, p.RoundState.OPEN, [member("engine-a")])],
        kv=[kv_pool("kv", "engine-a")],
    )
    text = render_status(full)
    for title, lines in [("ARENAS", render_arenas(full)), ("GRAPH POOLS", render_graph_pools(full)), ("LEASES", render_leases(full)),
                         ("ROUNDS", render_rounds(full)), ("KV", render_kv(full))]:
        assert "\n".join(["", title, *lines, ""]) in text + "\n"


# ---------------------------------------------------------------------------- arenas


def test_arenas_show_grants_by_what_they_admit_never_a_token() -> None:
    kv = arena(
        "kv", "engine-a", 64 * MiB, chunks=2, attached=["engine-a", "engine-b"],
        grants=[
            p.GrantStatus(id=1, client="engine-b", uid=1000, uid_implied=True),  # share kv engine-b
            p.GrantStatus(id=2),  # a token alone
            p.GrantStatus(id=3, uid=1001, gid=50),
        ],
    )
    gone = arena("scratch", "engine-c", 0, owner_alive=False, address=0x7F01_0000_0000, attached=[], retiring_bytes=4 * MiB)
    lines = render_arenas(reply(arenas=[kv, gone]))
    split = lines.index("")
    assert lines[0].split() == ["NAME", "OWNER", "RESERVED", "COMMITTED", "CHUNKS", "ADDRESS", "GRANTS", "ATTACHED", "RETIRING"]
    assert rows(lines[:split]) == [
        ["kv", "engine-a", "1 GiB", "64 MiB", "2", "0x7f0000000000", "engine-b uid 1000, token, uid 1001 gid 50", "engine-a,engine-b", "-"],
        ["scratch", "engine-c (gone)", "1 GiB", "0 B", "1", "0x7f0100000000", "-", "-", "4 MiB"],
    ]
    assert lines[split + 1].startswith("  GRANTS: a session matching CLIENT, UID and GID may attach")
    assert rows(lines[split + 2 :]) == [
        ["kv", "1", "engine-b", "1000 (owner's)", "any", "engine-b, any uid"],
        ["kv", "2", "any", "any", "any", "anyone"],
        ["kv", "3", "any", "1001", "50", "no one more"],
    ]


def test_a_name_two_uids_hold_is_shown_with_each_owners_uid() -> None:
    """Names are per uid: the bare 'kv' is uid 2000's, uid 1000's came second (its key is
    '1000/kv'); both are shown as what another uid attaches them by. A name one uid
    holds stays bare."""
    squat = arena("kv", "squatter", 0, owner_uid=2000)
    own = arena("1000/kv", "engine", 0, owner_uid=1000, grants=[p.GrantStatus(id=1, client="sibling", uid=1000, uid_implied=True)])
    alone = arena("scratch", "engine", 0, owner_uid=1000)
    lines = render_arenas(reply(arenas=[squat, own, alone]))
    split = lines.index("")
    assert [r[:2] for r in rows(lines[:split])] == [["2000/kv", "squatter"], ["1000/kv", "engine"], ["scratch", "engine"]]
    assert rows(lines[split + 2 :])[0][:2] == ["1000/kv", "1"]
    # A KV pool is an arena: its name is shown the same way, and so is a graph pool's arena.
    both = reply(arenas=[squat, own], kv=[kv_pool("kv", "squatter"), kv_pool("1000/kv", "engine")], graph_pools=[graph_pool(3, arena="kv")])
    assert [r[0] for r in rows(render_kv(both))] == ["2000/kv", "1000/kv"]
    assert rows(render_graph_pools(both))[0][2] == "2000/kv"


def test_arenas_without_grants_print_no_grant_table() -> None:
    lines = render_arenas(reply(arenas=[arena("kv", "engine-a", 2 * MiB)]))
    assert len(lines) == 2 and "GRANTS:" not in "\n".join(lines)
    assert render_arenas(reply()) == ["  (none)"]


# ---------------------------------------------------------------------------- extents and leases


def test_extents_show_free_runs_escapes_and_repairs() -> None:
    busy = graph_pool(
        7, epoch=3, shared=True, escaped_by="engine-b", lease_repairs=2,
        extents=[p.Extent(offset=0, size=4 * MiB), p.Extent(offset=8 * MiB, size=2 * MiB)],
        free_runs=[p.Extent(offset=0x100000, size=1 * MiB), p.Extent(offset=0x300000, size=512 * KiB)], free_bytes=1536 * KiB,
    )
    quiet = graph_pool(8, label="prefill", arena="draft")
    s = reply(graph_pools=[busy, quiet])
    lines = render_graph_pools(s)
    assert rows(lines[:3]) == [
        ["7", "engine-a", "kv", "decode", "3", "yes", "2", "6 MiB", "2", "1.50 MiB", "1 MiB", "2"],
        ["8", "engine-a", "draft", "prefill", "1", "no", "1", "4 MiB", "0", "0 B", "-", "0"],
    ]
    assert lines[3] == "  pool 7: replay and capture refused: engine-b holds borrowed tensors past their scope"
    assert lines[4].startswith("  pool 7: gpumemd repaired its lease slot 2 time(s): a client wrote there what no client may")
    assert len(lines) == 5, "pool 8 has nothing to warn about; the runs only show in `gpumemctl graph-pools`"
    assert render_graph_pools(s, runs=True)[5:] == [
        "  pool 7 free runs (offset+size): 0x100000+1 MiB, 0x300000+512 KiB",
        "  pool 8 free runs (offset+size): none",
    ]


def test_leases_show_holder_and_the_time_taken_to_the_millisecond() -> None:
    lines = render_leases(reply(leases=[lease(7, NOW + 0.25), lease(8, NOW + 61, kind="capture", holder="engine-a", pid=1001, label="recapture")]))
    assert rows(lines) == [
        ["7", "replay", "engine-b", "1002", "-", "22:13:20.250"],
        ["8", "capture", "engine-a", "1001", "recapture", "22:14:21.000"],
    ]


# ---------------------------------------------------------------------------- rounds and KV


def test_an_open_round_says_whom_it_waits_for() -> None:
    r = round_(5, p.RoundState.OPEN, [member("engine-a"), member("engine-b", reported=False)], expect=3)
    lines = render_rounds(reply(rounds=[r]))
    assert lines[:2] == [
        "  round 5  open  policy partial  deadline in 0m30s  1/2 reported  expects 3 pools",
        "    budget: not computed yet; waiting for capture-done from engine-b/kv and 1 more expected pool(s) to join",
    ]
    assert lines[2].split() == ["CLIENT", "POOL", "CAPTURE", "HEADROOM", "GRAPH", "POOL", "MIN", "TOKENS", "MAX", "TOKENS", "WEIGHT", "TOKENS", "BYTES"]
    assert rows(lines[2:]) == [
        ["engine-a", "kv", "reported", "1 GiB", "256 MiB", "1024", "65536", "1 (100%)", "-", "-"],
        ["engine-b", "kv", "PENDING", "-", "-", "-", "-", "-", "-", "-"],
    ]


def test_a_committed_round_shows_its_budget_step_by_step() -> None:
    budget = p.RoundBudget(free=60 * GiB, reserve=1 * GiB, headroom=3 * GiB, graph_pools=512 * MiB, budget=56 * GiB, minimums=8 * GiB, committed=50 * GiB)
    members = [member("engine-a", tokens=4096, bytes=10 * GiB), member("engine-b", weight=3.0, tokens=8192, bytes=40 * GiB)]
    lines = render_rounds(reply(rounds=[round_(2, p.RoundState.COMMITTED, members, budget=budget, deadline_in_s=-5.0)]))
    assert lines[:4] == [
        "  round 2  committed  policy partial  2/2 reported",
        "    budget: free 60 GiB - reserve 1 GiB - headroom 3 GiB = 56 GiB  (graph pools 512 MiB: already in use, not deducted)",
        "    minimums: 8 GiB first; the other 48 GiB shared by weight (total weight 4), each capped at its max tokens",
        "    committed: 50 GiB to the members' pools; 6 GiB of the budget unused (max-token caps, granularity rounding)",
    ]
    assert [(row[7], row[8], row[9]) for row in rows(lines[4:])] == [("1 (25%)", "4096", "10 GiB"), ("3 (75%)", "8192", "40 GiB")]


def test_an_ended_round_shows_no_deadline() -> None:
    """A committed round went on showing "deadline in 4m52s" after its clients were gone."""
    members = [member("engine-a", tokens=4096, bytes=1 * GiB)]
    for state in (p.RoundState.COMMITTED, p.RoundState.FAILED):
        (line, *_) = render_rounds(reply(rounds=[round_(3, state, members, deadline_in_s=292.0)]))
        assert line == f"  round 3  {state}  policy partial  1/1 reported", line
    (line, *_) = render_rounds(reply(rounds=[round_(3, p.RoundState.AWAITING_SHRINK, members, deadline_in_s=-2.0)]))
    assert "  deadline passed 0m2s ago  " in line, line


def test_a_failed_round_says_what_was_short_and_whom_it_dropped() -> None:
    short = p.RoundBudget(free=10 * GiB, reserve=1 * GiB, headroom=1 * GiB, budget=8 * GiB, minimums=12 * GiB)
    failed = round_(3, p.RoundState.FAILED, [member("engine-a")], budget=short, dropped=["engine-c/kv"], error="the minimums exceed the budget")
    lines = render_rounds(reply(rounds=[failed]))
    assert lines[1:3] == ["    budget: free 10 GiB - reserve 1 GiB - headroom 1 GiB = 8 GiB", "    minimums: 12 GiB needed first; short by 4 GiB"]
    assert lines[-2:] == ["    dropped: engine-c/kv", "    error: the minimums exceed the budget"]
    unmeasured = render_rounds(reply(rounds=[round_(4, p.RoundState.FAILED, [], error="deadline passed")]))
    assert unmeasured == [
        "  round 4  failed  policy partial  0/0 reported",
        "    budget: not computed (the round failed before it was measured)",
        "    (no members)",
        "    error: deadline passed",
    ]


def test_a_round_waiting_on_shrinks_names_the_pools_asked() -> None:
    budget = p.RoundBudget(free=4 * GiB, budget=4 * GiB, minimums=1 * GiB)
    r = round_(6, p.RoundState.AWAITING_SHRINK, [member("engine-a"), member("engine-b")], budget=budget)
    pools = [kv_pool("kv", "engine-a", shrink_request=2048), kv_pool("draft", "engine-b")]
    assert render_rounds(reply(rounds=[r], kv=pools))[3] == "    waiting for shrink confirmations: kv (engine-a) to 2048 tokens"


def test_a_round_trying_again_marks_its_figures_as_the_last_attempts() -> None:
    budget = p.RoundBudget(free=4 * GiB, budget=4 * GiB, minimums=1 * GiB)
    r = round_(7, p.RoundState.OPEN, [member("engine-a"), member("engine-b", reported=False)], budget=budget)
    assert render_rounds(reply(rounds=[r]))[1] == (
        "    waiting for capture-done from engine-b/kv; the figures below are from the last attempt and are computed again then"
    )


def test_kv_pools_line_up_under_their_headers() -> None:
    pools = [
        kv_pool("kv", "engine-a"),
        kv_pool("draft", "engine-b", buffers=1, bytes_per_token=64 * KiB, max_tokens=8192, tokens=8192, committed_bytes=512 * MiB,
                min_tokens=0, shrink_request=2048, weight=0.5, demand_tokens=0, share_bytes=128 * MiB, in_use=0),
    ]
    assert render_kv(reply(kv=pools)) == [
        "  NAME   OWNER     BUFFERS  BYTES/TOKEN  TOKENS      COMMITTED  MIN TOKENS  IN USE  DEMAND  WEIGHT  SHARE    SHRINK REQUEST",
        "  kv     engine-a  2        256 KiB      4096/65536  1 GiB      1024        -       4096    1       1 GiB    -",
        "  draft  engine-b  1        64 KiB       8192/8192   512 MiB    0           0       0       0.5     128 MiB  to 2048 tokens",
    ]


# ---------------------------------------------------------------------------- top


def top_reply(kv_committed: int, scratch_committed: int, **fields: Any) -> p.StatusReply:
    base: dict[str, Any] = dict(
        clients=[client(1, "engine-b", ["kv", "scratch"]), client(2, "engine-a", ["kv"]), client(3, "idle", [])],
        arenas=[
            arena("scratch", "engine-b", scratch_committed, chunks=3),
            arena("kv", "engine-a", kv_committed, chunks=2, attached=["engine-a", "engine-b"]),
        ],
    )
    return reply(**{**base, **fields})


def test_a_top_frame_puts_the_busiest_first_with_what_moved() -> None:
    before = top_reply(32 * MiB, 10 * MiB)
    now = top_reply(
        64 * MiB, 6 * MiB,
        graph_pools=[graph_pool(7)],
        leases=[lease(7, NOW - 75), lease(9, NOW - 0.25, kind="borrow")],
        rounds=[round_(1, p.RoundState.COMMITTED, [member("engine-a")]), round_(2, p.RoundState.FAILED, []),
                round_(3, p.RoundState.COMMITTED, [member("engine-a")], budget=p.RoundBudget(budget=8 * GiB, committed=6 * GiB)),
                round_(4, p.RoundState.OPEN, [member("engine-a"), member("engine-b", reported=False)], error="")],
    )
    lines = render_top(now, before, NOW)
    assert lines[:3] == [
        "gpumemd 0.1.0  device 0: testbox  host  serving, up 1h2m5s  22:13:20",
        "memory  total 80 GiB  free 60 GiB  held by gpumemd 20 GiB (25%)  reserve 1 GiB",
        "3 clients  2 arenas  1 graph pools  2 leases held  1 KV rounds active",
    ]
    section = lines.index("CLIENTS")
    assert lines[section + 1 : section + 5] == [
        "  CLIENT    PID   SESSION  COMMITTED  CHANGE   ARENAS",
        "  engine-a  1002  2        64 MiB     +32 MiB  kv",
        "  engine-b  1001  1        6 MiB      -4 MiB   kv,scratch",
        "  idle      1003  3        0 B                 -",
    ]
    section = lines.index("ARENAS")
    assert rows(lines[section + 1 : section + 4]) == [
        ["kv", "engine-a", "64 MiB", "1 GiB", "6%", "2", "engine-a,engine-b", "-"],
        ["scratch", "engine-b", "6 MiB", "1 GiB", "1%", "3", "engine-b", "-"],
    ]
    section = lines.index("LEASES")
    assert rows(lines[section + 1 : section + 4]) == [  # the longest held first; pool 9 is not registered
        ["decode (7)", "kv", "replay", "engine-b", "1002", "-", "1m15s"],
        ["9", "-", "borrow", "engine-b", "1002", "-", "250ms"],
    ]
    assert lines[lines.index("ROUNDS") + 1 :] == [  # the last three, the active one last
        "  round 2  failed  0/0 reported",
        "  round 3  committed  1/1 reported  budget 8 GiB  committed 6 GiB",
        "  round 4  open  1/2 reported  waiting for engine-b/kv",
    ]


def test_the_first_top_frame_shows_no_change() -> None:
    lines = render_top(top_reply(64 * MiB, 6 * MiB), None, NOW)
    section = lines.index("CLIENTS")
    assert lines[section + 1 : section + 5] == [
        "  CLIENT    PID   SESSION  COMMITTED  CHANGE  ARENAS",
        "  engine-a  1002  2        64 MiB             kv",
        "  engine-b  1001  1        6 MiB              kv,scratch",
        "  idle      1003  3        0 B                -",
    ]
    assert lines[lines.index("ROUNDS") + 1 :] == ["  (none)"]


def test_what_a_start_could_not_rebuild_is_shown() -> None:
    problems = ["durable record write 9, the newest, is corrupt: what it acknowledged is lost"]
    lines = render_status(reply(daemon=daemon(generation=1, restore_problems=problems))).splitlines()
    assert lines[3] == "  NOT REBUILT at its start: durable record write 9, the newest, is corrupt: what it acknowledged is lost"


def test_a_top_frame_shows_each_kv_pools_minimum_share_demand_and_use() -> None:
    pools = [
        kv_pool("kv", "engine-a", in_use=3000, demand_tokens=3000),
        kv_pool("draft", "engine-b", committed_bytes=2 * GiB, tokens=8192, min_tokens=0, shrink_request=2048, weight=0.5, demand_tokens=0,
                share_bytes=256 * MiB, in_use=0),
    ]
    lines = render_top(top_reply(64 * MiB, 6 * MiB, kv=pools), None, NOW)
    section = lines.index("KV POOLS")
    assert rows(lines[section + 1 : section + 4]) == [
        ["draft", "engine-b", "0", "8192", "2 GiB", "0", "0", "0.5", "256 MiB", "to 2048"],
        ["kv", "engine-a", "1024", "4096", "1 GiB", "3000", "3000", "1", "1 GiB", "-"],
    ]
    assert "KV POOLS" not in render_top(top_reply(64 * MiB, 6 * MiB), None, NOW)


def test_sleepers_show_what_they_hand_back_and_keep_and_clients_their_host_memory() -> None:
    asleep = p.SleeperStatus(
        arena="engine-model", owner="engine-a", asleep=True, committed_bytes=16 * GiB, kept_bytes=16 * GiB, host_bytes=16 * GiB, since=NOW
    )
    awake = p.SleeperStatus(arena="engine-graphs", owner="engine-a", asleep=False, committed_bytes=0, kept_bytes=0, host_bytes=2 * GiB, since=0.0)
    s = reply(
        daemon=daemon(sleep_host_bytes=18 * GiB, sleep_host_limit=64 * GiB),
        clients=[client(1, "engine-a", ["engine-model"], host_bytes=18 * GiB), client(2, "trainer", [])],
        sleepers=[asleep, awake],
    )
    text = render_status(s).splitlines()
    assert "  sleepers' host buffers 18 GiB of 64 GiB (--sleep-host-limit)" in text
    clients = text.index("CLIENTS")
    assert text[clients + 1].split() == ["ID", "NAME", "PID", "UID", "SINCE", "ARENAS", "HOST"]
    assert rows(text[clients + 1 : clients + 4]) == [
        ["1", "engine-a", "1001", "1000", "2023-11-14 22:13:20", "engine-model", "18 GiB"],
        ["2", "trainer", "1002", "1000", "2023-11-14 22:13:20", "-", "0 B"],
    ]
    sleepers = text.index("SLEEPERS")
    assert rows(text[sleepers + 1 : sleepers + 4]) == [
        ["engine-model", "engine-a", "asleep", "16 GiB", "16 GiB", "16 GiB", "2023-11-14 22:13:20"],
        ["engine-graphs", "engine-a", "awake", "-", "-", "2 GiB", "-"],
    ]
    idle = render_status(reply(clients=[client(1, "engine-a", [])])).splitlines()  # nothing slept: no new column, no section
    assert "SLEEPERS" not in idle and not any("sleepers'" in line for line in idle)
    assert idle[idle.index("CLIENTS") + 1].split() == ["ID", "NAME", "PID", "UID", "SINCE", "ARENAS"]
