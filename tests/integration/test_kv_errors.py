"""Bad KV input through the client library, in a real client process: every refusal is
the typed error, the engine's session carries on, and the daemon's accounting, pools
and rounds are exactly as before."""

from __future__ import annotations

import json

from gpumemd_testkit import MiB, status
from kv_testkit import Engine, cost, round_by_id, snapshot, wait_round

KiB = 1 << 10


def _refused(engine: Engine, runtime_dir, command: str, error: str) -> str:  # type: ignore[no-untyped-def]
    before = snapshot(status(runtime_dir))
    line = engine.reply(command)
    assert line.startswith(f"ERR {error} "), f"{command!r} answered {line!r}, expected {error}"
    assert snapshot(status(runtime_dir)) == before, f"{command!r} changed the daemon's state"
    return line


def test_inconsistent_descriptors_are_refused(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    e = Engine(run_client, "engine-a", "kv-a", [4 * KiB, 4 * KiB], max_tokens=1024)
    bad = {
        "the same name twice": ('[["k",4096,0],["k",4096,0]]', 1024, 0),
        "no buffer": ("[]", 1024, 0),
        "a zero row": ('[["k",0,0]]', 1024, 0),
        "a negative row": ('[["k",-4096,0]]', 1024, 0),
        "alignment not a power of two": ('[["k",4096,48]]', 1024, 0),
        "alignment above the granularity": (f'[["k",{8 * MiB},{4 * MiB}]]', 16, 0),
        "rows breaking their alignment": ('[["k",100,64]]', 1024, 0),
        "both bounds": ('[["k",4096,0]]', 1024, 64 * MiB),
        "no bound": ('[["k",4096,0]]', 0, 0),
        "a negative bound": ('[["k",4096,0]]', -1, 0),
        "reserve_bytes too small for a token": ('[["k",4096,0]]', 0, 1024),
        "a window beyond the daemon's limit": ('[["k",4096,0]]', 1 << 40, 0),
    }
    for what, (spec, max_tokens, reserve) in bad.items():
        line = _refused(e, runtime_dir, f"kvdeclarex kv-bad {max_tokens} {reserve} {spec}", "InvalidArgument")
        assert "kv-bad" in line or "KV" in line, (what, line)
    _refused(e, runtime_dir, 'kvdeclarex bad/name 1024 0 [["k",4096,0]]', "InvalidArgument")
    _refused(e, runtime_dir, 'kvdeclarex kv-a 1024 0 [["k",4096,0]]', "AlreadyExists")
    # the session still works, and a good declaration by reserve_bytes lays out aligned regions
    layout = json.loads(e.do(f'kvdeclarex kv-r 0 {64 * MiB} [["k",6144,2048],["v",6144,2048]]'))
    assert layout["max_tokens"] > 0 and layout["reserved"] <= 64 * MiB
    offsets = sorted(off for off, _row, _region in layout["buffers"].values())
    assert offsets[0] == 0 and all(off % (2 * MiB) == 0 for off in offsets)
    s = status(runtime_dir)
    assert sorted(k["name"] for k in s["kv"]) == ["kv-a", "kv-r"] and s["device"]["accounted_bytes"] == 0


def test_bad_round_requests_are_refused_and_change_nothing(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    rows = [8 * KiB, 8 * KiB]
    a = Engine(run_client, "engine-a", "kv-a", rows, max_tokens=4096)
    b = Engine(run_client, "engine-b", "kv-b", rows, max_tokens=4096)
    do_placeholder = a.do("kvplaceholder kv-a")
    assert int(do_placeholder) > 0

    # capture-done for a pool in no round
    line = _refused(a, runtime_dir, "capturex kv-a 0 0 0 0 1", "NotFound")
    assert "join" in line
    round_id = int(a.do("join kv-a").split()[0])
    assert b.placeholder_and_join() == round_id
    _refused(a, runtime_dir, "join kv-a", "AlreadyExists")

    # figures that make no sense: min > max, max beyond the declared bound, negative
    # headroom or graph-pool bytes, a weight that is not positive
    nonsense = ("0 0 200 100 1", "0 0 0 5000 1", "0 0 5000 0 1", f"{-MiB} 0 0 0 1", f"0 {-MiB} 0 0 1", "0 0 0 0 0", "0 0 0 0 -1")
    for figures in nonsense:
        line = _refused(a, runtime_dir, f"capturex kv-a {figures}", "InvalidArgument")
        assert "kv-a" in line or "weight" in line, line
    assert [m["reported"] for m in round_by_id(runtime_dir, round_id)["members"]] == [False, False]

    # capture-done twice in one round: an engine whose wait ran out reports again
    line = a.reply("capturex kv-a 0 0 16 0 1 0.3")
    assert line.startswith("ERR DaemonTimeout "), line
    wait_round(runtime_dir, round_id, lambda r: r["members"][0]["reported"], "a reported")
    line = _refused(a, runtime_dir, "capturex kv-a 0 0 16 0 1", "InvalidArgument")
    assert "already reported" in line

    # shrink or grow outside what the pool holds and may hold
    _refused(b, runtime_dir, "shrink kv-b 0", "InvalidArgument")
    _refused(b, runtime_dir, "grow kv-b 5000", "InvalidArgument")

    # the round still commits for both
    b.report(min_tokens=32)
    r = wait_round(runtime_dir, round_id, lambda r: r["state"] == "committed", "committed")
    assert [m["tokens"] > 0 for m in r["members"]] == [True, True]
    res_b = b.result()
    assert res_b["tokens"] >= 32 and b.kvcheck() == "MATCH"

    # capture-done again after the round committed: no open round holds the pool;
    # joining again with a committed pool is refused too (it grows instead)
    _refused(b, runtime_dir, "capturex kv-b 0 0 0 0 1", "NotFound")
    line = _refused(b, runtime_dir, "join kv-b", "InvalidArgument")
    assert "grow" in line
    _refused(b, runtime_dir, f"shrink kv-b {res_b['tokens']}", "InvalidArgument")
    assert json.loads(b.do("kvinfo kv-b"))["tokens"] == res_b["tokens"]
    s = status(runtime_dir)
    assert {k["name"]: k["committed_bytes"] for k in s["kv"]}["kv-b"] == cost(rows, res_b["tokens"])
