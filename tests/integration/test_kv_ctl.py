"""``gpumemctl rounds``, ``gpumemctl kv`` and the ROUNDS / KV sections of ``status``,
human and --json, while a round is open and after it commits or fails: members,
reported or pending, the budget math, and each pool's tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import child_env
from gpumem_shared import protocol as p
from gpumem_shared.units import format_size
from gpumemd_testkit import MiB
from kv_testkit import Engine, cost, ctl, ctl_json, headroom_for, wait_round

KiB = 1 << 10
EXIT_NOT_RUNNING = 3


def _human(runtime_dir, *args: str) -> str:  # type: ignore[no-untyped-def]
    result = ctl(runtime_dir, *args)
    assert result.returncode == 0 and result.stderr == "", result
    return result.stdout


def _has(out: str, *needles: str) -> None:
    for needle in needles:
        assert needle in out, f"{needle!r} missing from:\n{out}"


def _row(out: str, client: str) -> str:
    """The members-table row of ``client``."""
    rows = [line for line in out.splitlines() if line.split()[:1] == [client]]
    assert len(rows) == 1, f"{client}: {rows} in:\n{out}"
    return rows[0]


def _no_deadline(rounds: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    return [{k: v for k, v in r.items() if k != "deadline_in_s"} for r in rounds]


def test_views_of_an_open_then_committed_round(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory(backend, args=["--reserve", "64MiB"] + (["--host-capacity", "2GiB"] if backend == "host" else []))
    rows_a, rows_b = [8 * KiB, 8 * KiB], [16 * KiB] * 3
    a = Engine(run_client, "engine-a", "kv-a", rows_a, max_tokens=1 << 16)
    b = Engine(run_client, "engine-b", "kv-b", rows_b, max_tokens=1 << 16)
    round_id = a.placeholder_and_join(expect=2)
    out = _human(runtime_dir, "rounds")
    _has(out, "0/1 reported  expects 2 pools", "waiting for capture-done from engine-a/kv-a and 1 more expected pool(s) to join")
    assert b.placeholder_and_join() == round_id
    a.report(headroom=16 * MiB, graph_pool=4 * MiB, min_tokens=128, weight=1.0)
    wait_round(runtime_dir, round_id, lambda r: r["members"][0]["reported"], "a reported")

    # open: one reported, one pending, no budget yet; a's minimum is staged (created,
    # zeroed, held by nobody), b's pool holds nothing
    (r,) = ctl_json(runtime_dir, "rounds")
    assert r["id"] == round_id and r["state"] == "open" and r["budget"] == p.to_wire(p.RoundBudget()) and r["dropped"] == []
    assert r["policy"] == "partial" and r["expect"] == 2 and 0 < r["deadline_in_s"] <= 300
    members = [(m["client"], m["pool"], m["reported"]) for m in r["members"]]
    assert members == [("engine-a", "kv-a", True), ("engine-b", "kv-b", False)]
    ma = r["members"][0]
    figures = (ma["headroom_bytes"], ma["graph_pool_bytes"], ma["min_tokens"], ma["weight"], ma["tokens"])
    assert figures == (16 * MiB, 4 * MiB, 128, 1.0, 0)
    kv = ctl_json(runtime_dir, "kv")
    staged = cost(rows_a, 128)  # 128 rows of 8 KiB: one 2 MiB granule a buffer
    assert staged == 4 * MiB
    assert [(k["name"], k["owner"], k["buffers"], k["tokens"], k["committed_bytes"]) for k in kv] == [
        ("kv-a", "engine-a", 2, 0, staged),
        ("kv-b", "engine-b", 3, 0, 0),
    ]
    whole = ctl_json(runtime_dir, "status")
    assert _no_deadline(whole["rounds"]) == _no_deadline([r]) and whole["kv"] == kv
    arenas = {x["name"]: x for x in whole["arenas"]}
    assert (arenas["kv-a"]["committed"], arenas["kv-b"]["committed"]) == (staged, 0)
    placeholders = sum(x["placeholder_bytes"] for x in whole["arenas"])
    assert whole["device"]["accounted_bytes"] == placeholders + staged

    out = _human(runtime_dir, "rounds")
    _has(out, "ROUNDS", f"round {round_id}  open  policy partial  deadline in ", "1/2 reported  expects 2 pools")
    _has(out, "budget: not computed yet; waiting for capture-done from engine-b/kv-b")
    _has(out, "CLIENT", "CAPTURE", "HEADROOM", "GRAPH POOL", "MIN TOKENS", "MAX TOKENS", "WEIGHT", "TOKENS", "BYTES")
    line_a, line_b = _row(out, "engine-a"), _row(out, "engine-b")
    assert line_a.split()[:5] == ["engine-a", "kv-a", "reported", "16", "MiB"], line_a
    assert line_b.split()[:3] == ["engine-b", "kv-b", "PENDING"], line_b
    out = _human(runtime_dir, "kv")
    _has(out, "KV", "NAME", "OWNER", "BUFFERS", "BYTES/TOKEN", "SHRINK REQUEST", "0/65536", "16 KiB", "48 KiB")
    out = _human(runtime_dir, "status")
    _has(out, "CLIENTS", "ARENAS", "ROUNDS", "KV", "waiting for capture-done from engine-b/kv-b", "PENDING", "0/65536")

    # engine-b reports: the round commits, and the views explain the split
    # free memory as status shows it leaves the staged bytes out; the round adds them back
    b.report(headroom=headroom_for(runtime_dir, 256 * MiB, 16 * MiB) + staged, min_tokens=64, weight=3.0)
    res_a, res_b = a.result(), b.result()
    (r,) = ctl_json(runtime_dir, "rounds")
    budget = r["budget"]
    assert r["state"] == "committed" and budget == res_a["budget"] == res_b["budget"]
    assert set(budget) == {"free", "staged", "reserve", "headroom", "graph_pools", "budget", "minimums", "committed"}
    assert budget["reserve"] == 64 * MiB and budget["graph_pools"] == 4 * MiB and budget["staged"] == staged
    if backend == "host":
        assert budget["budget"] == 256 * MiB  # nothing moves on the host between status and commit
    assert budget["budget"] == budget["free"] - budget["reserve"] - budget["headroom"]
    assert budget["minimums"] == cost(rows_a, 128) + cost(rows_b, 64)
    tokens = {m["pool"]: (m["tokens"], m["bytes"]) for m in r["members"]}
    assert tokens == {
        "kv-a": (res_a["tokens"], cost(rows_a, res_a["tokens"])),
        "kv-b": (res_b["tokens"], cost(rows_b, res_b["tokens"])),
    }
    assert budget["committed"] == sum(nbytes for _, nbytes in tokens.values()) <= budget["budget"]
    kv = {k["name"]: k for k in ctl_json(runtime_dir, "kv")}
    assert (kv["kv-a"]["tokens"], kv["kv-a"]["min_tokens"]) == (res_a["tokens"], 128)
    assert kv["kv-b"]["committed_bytes"] == cost(rows_b, res_b["tokens"])

    out = _human(runtime_dir, "rounds")
    _has(
        out,
        f"round {round_id}  committed  policy partial",
        "2/2 reported",
        f"budget: free {format_size(budget['free'])} - reserve 64 MiB - headroom {format_size(budget['headroom'])}"
        f" = {format_size(budget['budget'])}",
        "(graph pools 4 MiB: already in use, not deducted)",
        f"minimums: {format_size(budget['minimums'])} first; the other "
        f"{format_size(budget['budget'] - budget['minimums'])} shared by weight (total weight 4)",
        f"committed: {format_size(budget['committed'])} to the members' pools",
    )
    line_a, line_b = _row(out, "engine-a"), _row(out, "engine-b")
    _has(line_a, "reported", "1 (25%)", str(res_a["tokens"]), format_size(cost(rows_a, res_a["tokens"])))
    _has(line_b, "reported", "3 (75%)", str(res_b["tokens"]), format_size(cost(rows_b, res_b["tokens"])))
    assert "PENDING" not in out and "waiting" not in out
    out = _human(runtime_dir, "kv")
    _has(out, f"{res_a['tokens']}/65536", f"{res_b['tokens']}/65536", format_size(cost(rows_b, res_b["tokens"])))
    out = _human(runtime_dir, "status")
    _has(out, "ROUNDS", "KV", f"round {round_id}  committed", f"{res_b['tokens']}/65536")

    # the target options work as for status: --device and --timeout, and the group's --runtime-dir
    result = ctl(runtime_dir, "rounds", "--json", "--device", "0", "--timeout", "5")
    assert result.returncode == 0 and json.loads(result.stdout)[0]["id"] == round_id, result
    _has(_human(runtime_dir, "kv", "-d", "0"), f"{res_a['tokens']}/65536")
    result = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", "--runtime-dir", str(runtime_dir), "-d", "0", "kv", "--json"],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
    )
    assert result.returncode == 0 and [k["name"] for k in json.loads(result.stdout)] == ["kv-a", "kv-b"], result
    result = ctl(runtime_dir, "rounds", "--device", "5")
    assert result.returncode == EXIT_NOT_RUNNING and "device 5" in result.stderr, result


@pytest.mark.parametrize("policy", ["partial", "fail"])
def test_views_of_a_round_past_its_deadline(daemon_factory, run_client, runtime_dir, policy) -> None:  # type: ignore[no-untyped-def]
    # The deadline must outlast two joins and a report, each a round trip through another
    # process (a loaded machine included), and pass before a's answer is read.
    daemon_factory("host", args=["--round-timeout", "4", "--round-policy", policy])
    a = Engine(run_client, "engine-a", "kv-a", [8 * KiB], max_tokens=1024)
    b = Engine(run_client, "engine-b", "kv-b", [8 * KiB], max_tokens=1024)
    round_id = a.placeholder_and_join()
    assert b.placeholder_and_join() == round_id
    a.report(min_tokens=16)
    r = wait_round(runtime_dir, round_id, lambda r: r["state"] in ("committed", "failed"), "deadline", timeout=15.0)
    out = _human(runtime_dir, "rounds")
    _has(out, f"round {round_id}  {r['state']}  policy {policy}  ")  # ended: its deadline is no longer shown
    assert "deadline passed" not in out and "deadline in" not in out, out
    if policy == "partial":
        assert a.result()["tokens"] == 1024
        _has(out, "dropped: engine-b/kv-b: did not report capture-done by the deadline", "1/1 reported")
        _has(_human(runtime_dir, "kv"), "1024/1024", "0/1024")
    else:
        assert a.answer().startswith("ERR RoundFailed ")
        _has(out, "error: round", "did not report capture-done: engine-b/kv-b", "PENDING")
        _has(out, "budget: not computed (the round failed before it was measured)")
        (j,) = ctl_json(runtime_dir, "rounds")
        assert j["state"] == "failed" and "engine-b/kv-b" in j["error"]


def test_rounds_and_kv_without_a_daemon_exit_3(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    for command in ("rounds", "kv"):
        for extra in ((), ("--json",)):
            started = time.monotonic()
            result = ctl(runtime_dir, command, *extra)
            assert result.returncode == EXIT_NOT_RUNNING, result
            assert time.monotonic() - started < 5.0
            assert result.stdout == "" and result.stderr.startswith("gpumemctl: no gpumemd serves device 0")
