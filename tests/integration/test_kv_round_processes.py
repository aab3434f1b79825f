"""KV pools and post-capture commit rounds with real client processes, on every backend.

Engines declare a pool, back it with a placeholder, join the device's round and report
capture-done; the round commits once all have reported (or its deadline passed). An engine
that reports while the round still waits for others has its minimum staged: created and
zeroed at once, in its pool's arena but mapped by nobody until the round commits, given
back if the round fails; the budget adds the staged bytes back to the free memory. The
expectations are recomputed from the budget figures the round reports (free, reserve,
headroom, budget, minimums, committed), so they hold on the host backend's fixed
capacity and on a GPU's measured free memory alike.
"""

from __future__ import annotations

import json
import time

import pytest

from gpumem_shared import protocol as p
from gpumemd_testkit import MiB, status, wait_status
from kv_testkit import (
    Engine,
    cost,
    ctl_json,
    expected_split,
    headroom_for,
    prefix_ranges,
    round_by_id,
    snapshot,
    wait_round,
)

KiB = 1 << 10


def _daemon(daemon_factory, backend, *args: str, capacity: str = "2GiB"):  # type: ignore[no-untyped-def]
    extra = ["--host-capacity", capacity] if backend == "host" else []
    return daemon_factory(backend, args=[*extra, *args])


def _staged(engines: list[Engine]) -> int:
    """What staging creates for these engines' minimums."""
    return sum(cost(e.rows, e.min) for e in engines)


def _check_staged(s: dict, staged: dict[str, int]) -> None:  # type: ignore[type-arg]
    """In one status snapshot of an open round: the pools hold exactly their staged
    minimums (no tokens yet), and the device accounts for them besides the placeholders."""
    pools = {k["name"]: k for k in s["kv"]}
    assert {name: (k["tokens"], k["committed_bytes"]) for name, k in pools.items()} == {
        name: (0, staged.get(name, 0)) for name in pools
    }
    arenas = {x["name"]: x for x in s["arenas"]}
    assert {name: arenas[name]["committed"] for name in pools} == {name: staged.get(name, 0) for name in pools}
    placeholders = sum(x["placeholder_bytes"] for x in s["arenas"])
    assert s["device"]["accounted_bytes"] == placeholders + sum(staged.values())


def _check_committed(engines: list[Engine], results: list[dict], runtime_dir, staged: int) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Every engine got what the split of the reported budget gives it, mapped and
    writable, and the daemon's views agree. ``staged``: the bytes staged before the last
    report, added back to the measured free memory."""
    budget = results[0]["budget"]
    round_id = results[0]["round_id"]
    for e, res in zip(engines, results):
        assert res["round_id"] == round_id and res["budget"] == budget, (e.name, res)
    r = round_by_id(runtime_dir, round_id)
    assert r["state"] == "committed" and r["budget"] == budget and r["error"] == ""
    # members in the round's order: the split depends on it only through rounding
    by_pool = {e.pool: (e, res) for e, res in zip(engines, results)}
    ordered = [by_pool[m["pool"]] for m in r["members"]]
    assert len(ordered) == len(engines)

    assert budget["staged"] == staged
    assert budget["headroom"] == sum(e.headroom for e in engines)
    assert budget["graph_pools"] == sum(e.graph_pool for e in engines)
    assert budget["budget"] == budget["free"] - budget["reserve"] - budget["headroom"]
    assert budget["minimums"] == sum(cost(e.rows, e.min) for e in engines)
    want = expected_split([e.spec() for e, _ in ordered], budget["budget"])
    got = [res["tokens"] for _, res in ordered]
    assert got == want, f"split of {budget}: got {got}, expected {want}"

    committed = 0
    total_weight = sum(e.weight for e, _ in ordered if e.max > e.min)
    spare = budget["budget"] - budget["minimums"]
    capped_spend = sum(cost(e.rows, e.max) - cost(e.rows, e.min) for e, res in ordered if res["tokens"] == e.max)
    for (e, res), member in zip(ordered, r["members"]):
        tokens = res["tokens"]
        assert 0 < tokens and e.min <= tokens <= e.max, (e.name, tokens)
        nbytes = cost(e.rows, tokens)
        committed += nbytes
        assert member["client"] == e.name and member["reported"] is True
        assert member["tokens"] == tokens and member["bytes"] == nbytes
        assert (member["min_tokens"], member["max_tokens"], member["weight"]) == (e.min, e.max, e.weight)
        assert (member["headroom_bytes"], member["graph_pool_bytes"]) == (e.headroom, e.graph_pool)
        assert res["committed"] == prefix_ranges(res["buffers"], tokens), (e.name, res)
        if tokens < e.max:
            # uncapped: its weighted share of what the minimums and the capped members
            # left, less at most one row and one granule per buffer of rounding
            share = (spare - capped_spend) * e.weight / sum(x.weight for x, rr in ordered if rr["tokens"] < x.max)
            extra = nbytes - cost(e.rows, e.min)
            assert share - len(e.rows) * (2 * MiB + max(e.rows)) <= extra <= share + 1, (e.name, extra, share)
        assert e.kvcheck() == "MATCH"
    assert total_weight > 0
    assert committed == budget["committed"] <= budget["budget"]

    kv = {k["name"]: k for k in ctl_json(runtime_dir, "kv")}
    for e, res in ordered:
        k = kv[e.pool]
        assert k["owner"] == e.name and k["buffers"] == len(e.rows) and k["bytes_per_token"] == sum(e.rows)
        assert k["tokens"] == res["tokens"] and k["committed_bytes"] == cost(e.rows, res["tokens"])
        assert k["min_tokens"] == e.min and k["shrink_request"] == -1
    rounds = ctl_json(runtime_dir, "rounds")
    assert [x for x in rounds if x["id"] == round_id][0]["members"] == r["members"]
    return r


@pytest.mark.parametrize("n", [1, 2, 4])
def test_round_splits_the_budget_by_minimums_and_weights(daemon_factory, backend, run_client, runtime_dir, n) -> None:  # type: ignore[no-untyped-def]
    _daemon(daemon_factory, backend)
    weights = [1.0, 2.0, 3.0, 0.5]
    engines = []
    for i in range(n):
        rows = [4 * KiB * (1 + i % 3)] * (2 + i % 2)  # K and V (and a third buffer), rows of 4-12 KiB
        engines.append(Engine(run_client, f"engine-{i}", f"kv-{i}", rows, max_tokens=1 << 18))
    round_ids = {e.placeholder_and_join() for e in engines}
    assert len(round_ids) == 1, "every engine joined the same round"
    (round_id,) = round_ids

    for i, e in enumerate(engines[:-1]):
        e.report(headroom=4 * MiB * i, graph_pool=2 * MiB * i, min_tokens=512 * (i + 1), weight=weights[i])
    staged = _staged(engines[:-1])  # those that reported while the last was pending
    if n > 1:
        r = wait_round(runtime_dir, round_id, lambda r: sum(m["reported"] for m in r["members"]) == n - 1, "n-1 reported")
        assert r["state"] == "open" and r["budget"] == p.to_wire(p.RoundBudget()) and r["members"][-1]["reported"] is False
        _check_staged(status(runtime_dir), {e.pool: cost(e.rows, e.min) for e in engines[:-1]})
    # the last one's headroom leaves a budget of about 768 MiB, wherever the test runs
    # (status's free memory leaves the staged minimums out; the round adds them back)
    last = engines[-1]
    others = sum(e.headroom for e in engines[:-1])
    min_last = 512 * n
    # with 4 engines, the last is capped just above its minimum: its unused share goes back
    max_last = min_last + 1000 if n == 4 else 0
    last.report(
        headroom=headroom_for(runtime_dir, 768 * MiB, others) + staged, graph_pool=2 * MiB, min_tokens=min_last,
        max_tokens=max_last, weight=weights[n - 1],
    )
    results = [e.result() for e in engines]
    r = _check_committed(engines, results, runtime_dir, staged)
    assert r["dropped"] == []
    if n == 4:
        assert results[-1]["tokens"] == max_last
    if backend == "host":
        assert results[0]["budget"]["budget"] == 768 * MiB  # nothing moves on the host between status and commit


@pytest.mark.parametrize("policy", ["partial", "fail"])
def test_deadline_with_a_missing_member(daemon_factory, backend, run_client, runtime_dir, policy) -> None:  # type: ignore[no-untyped-def]
    # The deadline must outlast three joins, two reports and a status, each a round trip
    # through another process: on a loaded machine 2 s did not always.
    _daemon(daemon_factory, backend, "--round-timeout", "6", "--round-policy", policy)
    a = Engine(run_client, "engine-a", "kv-a", [64 * KiB, 64 * KiB], max_tokens=4096)  # at most 512 MiB
    b = Engine(run_client, "engine-b", "kv-b", [64 * KiB, 64 * KiB], max_tokens=4096)
    c = Engine(run_client, "engine-c", "kv-c", [32 * KiB], max_tokens=4096)
    round_id = a.placeholder_and_join()
    assert b.placeholder_and_join() == round_id and c.placeholder_and_join() == round_id
    before = status(runtime_dir)["device"]["accounted_bytes"]  # the three pools' placeholders
    a.report(min_tokens=64)
    c.report(min_tokens=32, weight=2.0)
    # b is pending: a's and c's minimums are staged (64 rows of 64 KiB = 4 MiB a buffer,
    # 32 rows of 32 KiB = 1 MiB -> one 2 MiB granule), mapped by nobody
    staged = _staged([a, c])
    assert staged == 10 * MiB
    s = wait_status(
        runtime_dir, lambda s: sum(m["reported"] for m in s["rounds"][0]["members"]) == 2, 5, "a and c reported"
    )
    assert s["rounds"][0]["state"] == "open", "the deadline passed before the view was taken"
    _check_staged(s, {"kv-a": cost(a.rows, 64), "kv-c": cost(c.rows, 32)})
    assert s["device"]["accounted_bytes"] == before + staged
    r = wait_round(runtime_dir, round_id, lambda r: r["state"] not in ("open", "awaiting-shrink"), "round ended", timeout=15.0)
    assert r["deadline_in_s"] <= 0 and r["policy"] == policy
    if policy == "partial":
        assert r["state"] == "committed" and r["error"] == ""
        assert r["dropped"] == ["engine-b/kv-b: did not report capture-done by the deadline"]
        assert [m["pool"] for m in r["members"]] == ["kv-a", "kv-c"]
        results = [a.result(), c.result()]
        _check_committed([a, c], results, runtime_dir, staged)
        s = status(runtime_dir)
        assert s["device"]["accounted_bytes"] == before + results[0]["budget"]["committed"]
        assert {k["name"]: k["tokens"] for k in s["kv"]}["kv-b"] == 0
        # the dropped engine is told when it reports late: no open round holds its pool
        assert b.reply("capturex kv-b 0 0 0 0 1").startswith("ERR NotFound ")
    else:
        assert r["state"] == "failed" and r["dropped"] == []
        assert "engine-b/kv-b" in r["error"] and "did not report capture-done" in r["error"]
        for e in (a, c):
            line = e.answer()
            assert line.startswith("ERR RoundFailed ") and "engine-b/kv-b" in line, line
            assert "deadline" in line
        s = status(runtime_dir)
        assert s["device"]["accounted_bytes"] == before  # nothing committed, the staged minimums given back
        assert all(k["tokens"] == 0 for k in s["kv"]) and all(x["committed"] == 0 for x in s["arenas"])
        # a failed round is over: joining again opens a fresh one
        assert a.placeholder_and_join() == round_id + 1


def test_killed_members_are_dropped_and_the_round_commits_for_the_others(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    _daemon(daemon_factory, backend)
    rows = [16 * KiB, 16 * KiB]
    a, b, c, d = (Engine(run_client, f"engine-{x}", f"kv-{x}", rows, max_tokens=1 << 16) for x in "abcd")
    round_id = a.placeholder_and_join()
    for e in (b, c, d):
        assert e.placeholder_and_join() == round_id
    a.report(min_tokens=256, weight=1.0)
    d.report(min_tokens=256, weight=1.0)
    wait_round(runtime_dir, round_id, lambda r: sum(m["reported"] for m in r["members"]) == 2, "a and d reported")
    # staged: 256 rows of 16 KiB = 4 MiB a buffer, 8 MiB each
    assert cost(rows, 256) == 8 * MiB
    _check_staged(status(runtime_dir), {"kv-a": 8 * MiB, "kv-d": 8 * MiB})

    # a member that reported, then died: dropped, the round waits for the others still;
    # its staged minimum went with its pool
    d.client.kill()
    r = wait_round(runtime_dir, round_id, lambda r: len(r["dropped"]) == 1, "d dropped")
    assert r["state"] == "open" and r["dropped"] == ["engine-d/kv-d: the client went away"]
    assert [m["pool"] for m in r["members"]] == ["kv-a", "kv-b", "kv-c"]
    s = wait_status(runtime_dir, lambda s: len(s["clients"]) == 3, 5.0, "d gone")
    assert sorted(k["name"] for k in s["kv"]) == ["kv-a", "kv-b", "kv-c"]
    _check_staged(s, {"kv-a": 8 * MiB})
    # a budget of 256 MiB: status's free memory leaves a's staged 8 MiB out, the round adds it back
    b.report(headroom=headroom_for(runtime_dir, 256 * MiB, 0) + 8 * MiB, min_tokens=128, weight=3.0)
    wait_round(runtime_dir, round_id, lambda r: sum(m["reported"] for m in r["members"]) == 2, "b reported")
    s = status(runtime_dir)
    _check_staged(s, {"kv-a": 8 * MiB, "kv-b": cost(rows, 128)})  # c still pending
    c_placeholders = {x["name"]: x for x in s["arenas"]}["kv-c"]["placeholder_bytes"]

    # the last one pending dies: the round commits at once for the ones that reported
    c.client.kill()
    results = [a.result(), b.result()]
    r = _check_committed([a, b], results, runtime_dir, _staged([a, b]))
    assert r["dropped"] == ["engine-d/kv-d: the client went away", "engine-c/kv-c: the client went away"]
    s = wait_status(runtime_dir, lambda s: len(s["clients"]) == 2, 5.0, "c and d gone")
    assert sorted(k["name"] for k in s["kv"]) == ["kv-a", "kv-b"]
    if backend == "host":
        # the dead engines' placeholders were given back before the budget was measured
        # (and the staged minimums count as the members' own: free again for the split)
        live = sum(x["placeholder_bytes"] for x in s["arenas"])
        assert results[0]["budget"]["free"] == s["device"]["total_bytes"] - live, results[0]["budget"]
        # b's headroom left 256 MiB; c's placeholders came back since
        assert results[0]["budget"]["budget"] == 256 * MiB + c_placeholders


def test_a_member_that_releases_its_pool_does_not_hold_up_the_round(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    _daemon(daemon_factory, backend)
    a = Engine(run_client, "engine-a", "kv-a", [16 * KiB], max_tokens=1 << 14)
    b = Engine(run_client, "engine-b", "kv-b", [16 * KiB], max_tokens=1 << 14)
    round_id = a.placeholder_and_join()
    assert b.placeholder_and_join() == round_id
    a.report(min_tokens=16)
    wait_round(runtime_dir, round_id, lambda r: r["members"][0]["reported"], "a reported")
    _check_staged(status(runtime_dir), {"kv-a": 2 * MiB})  # 16 rows of 16 KiB: one granule
    b.do("kvrelease kv-b")  # the engine gives up before capture-done
    (res,) = [a.result(timeout=5.0)]
    r = _check_committed([a], [res], runtime_dir, 2 * MiB)
    assert r["dropped"] == ["engine-b/kv-b: the pool was released"]


def test_grow_within_and_beyond_the_device(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    _daemon(daemon_factory, backend, capacity="1GiB")
    total = status(runtime_dir)["device"]["total_bytes"]
    rows = [1 * MiB, 1 * MiB]  # 2 MiB a token: a granule per buffer per token
    max_tokens = total // (2 * MiB) + 64  # the declared bound is beyond the whole device
    e = Engine(run_client, "engine-g", "kv-g", rows, max_tokens=max_tokens)
    assert e.layout["max_tokens"] == max_tokens and e.layout["reserved"] >= max_tokens * 2 * MiB

    assert int(e.do("grow kv-g 16")) == 16
    assert e.kvcheck() == "MATCH"
    assert int(e.do("grow kv-g 40")) == 40  # grows on top of what it holds
    assert e.kvcheck() == "MATCH"
    info = json.loads(e.do("kvinfo kv-g"))
    assert info["committed"] == prefix_ranges(info["buffers"], 40)
    s = status(runtime_dir)
    (k,) = s["kv"]
    assert k["tokens"] == 40 and k["committed_bytes"] == cost(rows, 40) == s["device"]["accounted_bytes"]

    before = snapshot(s)
    err = json.loads(e.do(f"errinfo grow kv-g {max_tokens}"))
    assert err["error"] == "OutOfMemory", err
    requested, available = err["detail"]["requested"], err["detail"]["available"]
    assert requested == cost(rows, max_tokens) - cost(rows, 40) and requested > available
    assert str(requested) in err["message"] and str(available) in err["message"]
    assert snapshot(status(runtime_dir)) == before  # nothing committed
    assert json.loads(e.do("kvinfo kv-g"))["tokens"] == 40
    assert e.kvcheck() == "MATCH"
    # beyond the declared bound, and not growing: refused as invalid, nothing changes
    for bad in (max_tokens + 1, 40, 10):
        assert e.reply(f"grow kv-g {bad}").startswith("ERR InvalidArgument "), bad
    assert snapshot(status(runtime_dir)) == before


def test_a_later_engine_gets_memory_an_earlier_pool_gives_back(daemon_factory, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Host only: the earlier pool must hold nearly the whole device, which on a GPU
    depends on what else runs there. Bulk chunks of 32 MiB give the shrink boundaries."""
    daemon_factory("host", args=["--host-capacity", "1GiB", "--kv-chunk-size", "32MiB", "--round-timeout", "20"])
    rows = [64 * KiB, 64 * KiB]
    a = Engine(run_client, "engine-a", "kv-a", rows, max_tokens=1 << 14)
    b = Engine(run_client, "engine-b", "kv-b", rows, max_tokens=1 << 14)
    first = a.placeholder_and_join()
    # engine-a keeps 256 MiB of headroom for its activations and takes the rest
    a.report(headroom=256 * MiB, min_tokens=256)
    res_a = a.result()
    held = cost(rows, res_a["tokens"])
    assert res_a["budget"]["committed"] == held and held > 512 * MiB
    assert res_a["budget"]["staged"] == 0  # alone in its round: nothing to wait for

    second = b.placeholder_and_join()
    assert second == first + 1
    free_now = status(runtime_dir)["device"]["free_bytes"]
    b_min = 2048  # 256 MiB: more than is free
    assert cost(rows, b_min) > free_now
    b.report(min_tokens=b_min, weight=1.0)
    r = wait_round(runtime_dir, second, lambda r: r["state"] == "awaiting-shrink", "round waits for a shrink")
    assert r["budget"]["minimums"] == cost(rows, b_min) > r["budget"]["budget"]
    assert r["budget"]["staged"] == 0 and {k["name"]: k["committed_bytes"] for k in status(runtime_dir)["kv"]}["kv-b"] == 0

    # engine-a is asked, nothing is taken from it yet
    asks: list[int] = []
    until = time.monotonic() + 5.0
    while not asks and time.monotonic() < until:
        asks = json.loads(a.do("shrinkreq kv-a"))
        time.sleep(0.01)
    assert len(asks) == 1, asks
    (target,) = asks
    assert 256 <= target < res_a["tokens"]
    s = status(runtime_dir)
    ka = {k["name"]: k for k in s["kv"]}["kv-a"]
    assert ka["tokens"] == res_a["tokens"] and ka["shrink_request"] == target and ka["min_tokens"] == 256
    assert a.kvcheck() == "MATCH"
    view = ctl_json(runtime_dir, "rounds")
    assert [x["state"] for x in view if x["id"] == second] == ["awaiting-shrink"]

    kept = int(a.do(f"shrink kv-a {target}"))
    assert target <= kept < res_a["tokens"]
    res_b = b.result()
    assert res_b["round_id"] == second and res_b["tokens"] >= b_min
    assert b.kvcheck() == "MATCH" and a.kvcheck() == "MATCH"
    s = status(runtime_dir)
    pools = {k["name"]: k for k in s["kv"]}
    assert pools["kv-a"]["tokens"] == kept and pools["kv-a"]["shrink_request"] == -1
    assert pools["kv-b"]["tokens"] == res_b["tokens"]
    assert s["device"]["accounted_bytes"] <= s["device"]["total_bytes"]
    r = round_by_id(runtime_dir, second)
    assert r["state"] == "committed" and r["budget"]["committed"] == cost(rows, res_b["tokens"]) <= r["budget"]["budget"]
    assert [k["name"] for k in s["kv"] if k["shrink_request"] >= 0] == []

