"""Runtime KV moves between two real engine processes: memory goes to the pool that
bursts and back when the other one does, several times over; a neighbour that never
answers costs the grow the move deadline only and is named; one killed mid-shrink gives
everything back at once. Under ``--capacity`` the device is 512 MiB on every backend."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import gpumem
from gpumemd_testkit import MiB, status, wait_status
from kv_testkit import Engine, cost

KiB = 1 << 10
ROWS = [64 * KiB, 64 * KiB]  # 128 KiB a token: a 32 MiB chunk per buffer holds 512 tokens
CAP = 512 * MiB


def _engines(daemon_factory, backend, run_client, runtime_dir, move_timeout: str) -> tuple[Engine, Engine]:  # type: ignore[no-untyped-def]
    """engine-a/kv-a and engine-b/kv-b sized by one round: 256 MiB (2048 tokens) each."""
    extra = ["--host-capacity", "1GiB"] if backend == "host" else []
    daemon_factory(backend, args=[*extra, "--capacity", "512MiB", "--reserve", "0", "--kv-chunk-size", "32MiB", "--move-timeout", move_timeout])
    a = Engine(run_client, "engine-a", "kv-a", ROWS, max_tokens=4096)
    b = Engine(run_client, "engine-b", "kv-b", ROWS, max_tokens=4096)
    a.do("join kv-a")
    b.do("join kv-b")
    a.report(min_tokens=256)
    b.report(min_tokens=256)
    assert (a.result()["tokens"], b.result()["tokens"]) == (2048, 2048)
    assert status(runtime_dir)["device"]["accounted_bytes"] == CAP
    return a, b


def _pools(runtime_dir) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {k["name"]: k["tokens"] for k in status(runtime_dir)["kv"]}


def test_memory_moves_to_the_engine_that_bursts_and_back(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    a, b = _engines(daemon_factory, backend, run_client, runtime_dir, "10")
    for _ in range(3):
        for taker, giver in ((a, b), (b, a)):
            # The giver idles; the taker wants 384 MiB of the 512. The giver holds more
            # than its share (its 32 MiB minimum) and is asked for what the taker lacks.
            giver.do(f"demand {giver.pool} 0")
            taker.client.send(f"kvgrow {taker.pool} 3072")
            kept = json.loads(giver.do(f"answershrink {giver.pool} 10"))
            # Whole chunks go, so the giver may give a little more than asked; never
            # below its minimum, and the taker's 384 MiB fit beside what it keeps.
            assert 256 <= kept <= 1024 and cost(ROWS, 3072) + cost(ROWS, kept) <= CAP, kept
            line = taker.answer()
            assert line.startswith("OK "), line
            got = json.loads(line[3:])
            if got["tokens"] < 3072:
                # What was free came at once (the giver kept less than asked the round
                # before: whole chunks), the giver asked for the rest: the next grow finds it.
                assert got["unanswered"] == [f"{giver.name}/{giver.pool}"], got
                got = json.loads(taker.do(f"kvgrow {taker.pool} 3072"))
            assert got == {"tokens": 3072, "unanswered": []}
            assert _pools(runtime_dir) == {taker.pool: 3072, giver.pool: kept}
            assert status(runtime_dir)["device"]["accounted_bytes"] == cost(ROWS, 3072) + cost(ROWS, kept)
            assert taker.kvcheck() == "MATCH" and giver.kvcheck() == "MATCH"
            # The giver gets busy again later: its demand is what it holds.
            giver.do(f"demand {giver.pool} {kept}")
    kv = {k["name"]: k for k in status(runtime_dir)["kv"]}
    assert kv["kv-a"]["share_bytes"] + kv["kv-b"]["share_bytes"] <= CAP


def test_a_neighbour_that_never_answers_costs_the_move_deadline_and_is_named(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    a, b = _engines(daemon_factory, backend, run_client, runtime_dir, "1")
    b.do("demand kv-b 0")
    started = time.monotonic()
    line = a.reply("kvgrow kv-a 3072", timeout=10)
    waited = time.monotonic() - started
    assert line.startswith("ERR OutOfMemory ") and "engine-b/kv-b" in line, line
    assert 1.0 <= waited < 5.0, waited
    assert _pools(runtime_dir) == {"kv-a": 2048, "kv-b": 2048}
    assert status(runtime_dir)["device"]["accounted_bytes"] == CAP
    assert a.kvcheck() == "MATCH" and b.kvcheck() == "MATCH"


def test_a_neighbour_killed_mid_shrink_gives_everything_back_at_once(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    a, b = _engines(daemon_factory, backend, run_client, runtime_dir, "60")
    b.do("demand kv-b 0")
    a.client.send("kvgrow kv-a 3072")
    asked = []
    until = time.monotonic() + 10
    while not asked and time.monotonic() < until:
        asked = json.loads(b.do("shrinkreq kv-b"))
    # At a chunk edge: 64 MiB a buffer stay, or 48 where b's minimum was staged as a chunk
    # of its own (b reported first), then 32 MiB chunks.
    assert len(asked) == 1 and asked[0] in (768, 1024), asked
    started = time.monotonic()
    b.client.kill()
    line = a.answer(timeout=20)
    assert time.monotonic() - started < 30, "answered by the deadline, not by the death"
    assert json.loads(line[3:]) == {"tokens": 3072, "unanswered": []}, line
    s = wait_status(runtime_dir, lambda s: len(s["clients"]) == 1, 5.0, "b gone")
    assert [k["name"] for k in s["kv"]] == ["kv-a"]
    assert s["device"]["accounted_bytes"] == cost(ROWS, 3072)
    assert a.kvcheck() == "MATCH"


@contextlib.contextmanager
def _in_process_pair(daemon_factory, runtime_dir) -> Iterator[tuple[gpumem.KvPool, gpumem.KvPool]]:  # type: ignore[no-untyped-def]
    """Two sessions of this process, a KV pool each, through a round of 2048 rows each
    under a 512 MiB capacity (4096 rows in all) with a 10 s move deadline."""
    daemon_factory("host", args=["--host-capacity", "1GiB", "--capacity", "512MiB", "--kv-chunk-size", "32MiB", "--move-timeout", "10"])
    buffers = [gpumem.KvBuffer(f"b{i}", row) for i, row in enumerate(ROWS)]
    with gpumem.connect(0, name="engine-a", runtime_dir=runtime_dir, timeout=20.0) as sa, \
            gpumem.connect(0, name="engine-b", runtime_dir=runtime_dir, timeout=20.0) as sb:
        pa, pb = sa.declare_kv_pool("kv-a", buffers, max_tokens=4096), sb.declare_kv_pool("kv-b", buffers, max_tokens=4096)
        pa.join_round()
        pb.join_round()
        waits = [pa.send_capture_done(min_tokens=256), pb.send_capture_done(min_tokens=256)]
        assert [w.wait() for w in waits] == [2048, 2048]
        yield pa, pb


def test_the_client_grows_ahead_and_answers_a_shrink_by_moving_live_rows_first(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """In-process, two sessions: a grows ahead of need without waiting; b's live rows sit
    past the bound asked, so its move_live hook runs first, and b gives back the rest."""
    with _in_process_pair(daemon_factory, runtime_dir) as (pa, pb):

        live = {"top": 1300}  # b's highest live row, in a block past any bound the daemon asks
        moved: list[int] = []

        def move_live(bound: int) -> int:
            moved.append(bound)
            live["top"] = 100  # the engine copied its live blocks below the bound
            return live["top"]

        pb.rows_in_use = lambda: live["top"]
        pb.report_demand(100)
        assert pa.grow_ahead(1000, watermark=256, step=1024) is None  # 1048 rows free: no need yet
        wait = pa.grow_ahead(1900, watermark=256, step=1024)
        assert wait is not None and pa.grow_ahead(1950, watermark=256, step=1024) is None  # one on its way
        kept = None
        until = time.monotonic() + 10
        while kept is None and time.monotonic() < until:
            kept = pb.answer_shrinks(move_live)  # at b's step boundaries: a notice arrives within the wait
            time.sleep(0.01)
        assert kept is not None and moved == [kept] and 256 <= kept < 1300
        assert wait.wait() == 3072 and pa.tokens == 3072 and pa.unanswered == []
        assert pb.tokens == kept
        s = status(runtime_dir)
        assert s["device"]["accounted_bytes"] == cost(ROWS, 3072) + cost(ROWS, kept)
        assert {k["name"]: k["in_use"] for k in s["kv"]} == {"kv-a": 1900, "kv-b": 100}  # the grow carried a's use


def test_a_sleeping_pool_holds_no_share_is_asked_nothing_and_wakes_by_a_grow_like_any(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    a, b = _engines(daemon_factory, backend, run_client, runtime_dir, "10")
    b.do("demand kv-b 2048")  # busy up to its sleep: its demand was all it holds
    assert json.loads(b.do("kvsleep kv-b drop")) == {"tokens": 0}
    s = status(runtime_dir)
    kv = {k["name"]: k for k in s["kv"]}
    assert (kv["kv-b"]["tokens"], kv["kv-b"]["demand_tokens"], kv["kv-b"]["share_bytes"]) == (0, 0, 0)
    assert [(x["arena"], x["asleep"], x["committed_bytes"]) for x in s["sleepers"]] == [("kv-b", True, cost(ROWS, 2048))]
    # The freed memory is free: a takes the whole device at once, and the sleeper is asked nothing.
    assert json.loads(a.do("kvgrow kv-a 4096")) == {"tokens": 4096, "unanswered": []}
    assert json.loads(b.do("shrinkreq kv-b")) == []
    # b's wake is a grow like any: a holds more than its half of the two demands, and gives it back.
    b.client.send("kvwake kv-b 20")
    assert json.loads(a.do("answershrink kv-a 10")) == 2048
    line = b.answer()
    assert line.startswith("OK ") and json.loads(line[3:]) == {"tokens": 2048}, line
    s = status(runtime_dir)
    assert [x["asleep"] for x in s["sleepers"]] == [] and _pools(runtime_dir) == {"kv-a": 2048, "kv-b": 2048}
    assert s["device"]["accounted_bytes"] == CAP


def test_a_neighbour_whose_asked_rows_are_all_live_answers_and_the_grow_does_not_wait_the_deadline(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """b's every row is live and cannot move: its answer gives nothing back, and a's grow
    is answered then (refused: nothing came free), not at the 10 s move deadline. While
    b's own grow is unanswered, b leaves its notices for later."""
    with _in_process_pair(daemon_factory, runtime_dir) as (pa, pb):
        pb.rows_in_use = lambda: 2048  # full of live blocks
        pb.report_demand(100)  # it says less: it is asked
        started = time.monotonic()
        wait = pa.send_grow(3072)
        kept = None
        while kept is None and time.monotonic() < started + 5:
            kept = pb.answer_shrinks(lambda bound: 2048)  # nothing moved
            time.sleep(0.01)
        assert kept == 2048 and pb.tokens == 2048
        try:
            wait.wait(5)
            raise AssertionError("a's grow got rows nobody gave back")
        except gpumem.OutOfMemory as exc:
            assert "10s" in str(exc) or "nothing came free" in str(exc)
        assert time.monotonic() - started < 5, "the grow waited for the deadline"
        # a asks again; b sends a grow of its own before it looks at its notices: until
        # that grow's answer is in, b leaves the notice (the answer may bring chunks).
        pb.rows_in_use = lambda: 1000
        pb.report_demand(1000)  # its use changed: its earlier answer no longer stands
        wait = pa.send_grow(3072)
        wait_status(runtime_dir, lambda st: {k["name"]: k["shrink_request"] for k in st["kv"]}["kv-b"] >= 0, 5, "b asked to give back")
        grow_b = pb.send_grow(2560)
        assert pb.answer_shrinks(lambda bound: 1000) is None
        try:
            grow_b.wait(5)
            raise AssertionError("b's grow got rows while its own neighbour waited for b")
        except gpumem.OutOfMemory:
            pass  # a's grow waits: a is not asked
        kept = pb.answer_shrinks(lambda bound: 1000)
        assert kept is not None and 1000 <= kept < 2048
        assert wait.wait(5) > 2048 and pa.unanswered == []
