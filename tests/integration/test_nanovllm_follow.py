"""A block manager following its KV pool between two real engines (the engine port's
gpumem.port.blocks over nano-vllm's adapter on a stand-in manager, tests/follow_engine.py):
engine B idles with live blocks at the top of its pool while engine A (this process)
grows into it; B moves its live blocks down (real memory, copied row by row) and gives
back the rest. Killed in the middle of that copy, B costs A nothing but the wait for its
death: A's grow is answered with everything it asked, accounting is exact, the daemon
stays up. B's copy raising in the middle of the move (an engine's bad input): B gives
nothing back, A's grow gets nothing, the books are exact. Under ``--capacity`` the device
is 512 MiB on every backend."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import gpumem
from conftest import ROOT, child_env
from follow_engine import ROW, rows
from gpumemd_testkit import MiB, status, wait_status
from kv_testkit import cost

CHILD = ROOT / "tests" / "follow_engine.py"
ROWS = [ROW, ROW]
LIVE = 8  # B's live blocks, at the top of its pool


def _start(daemon_factory, backend: str, runtime_dir, move_timeout: str, *b_args: str) -> tuple[Any, gpumem.Session, gpumem.KvPool, subprocess.Popen[str]]:  # type: ignore[no-untyped-def]
    """Daemon, engine A (this process, kv-a) and engine B (a process, kv-b), 2048 blocks each."""
    extra = ["--host-capacity", "1GiB"] if backend == "host" else []
    daemon = daemon_factory(backend, args=[*extra, "--capacity", "512MiB", "--reserve", "0", "--kv-chunk-size", "32MiB",
                                           "--move-timeout", move_timeout])
    session = gpumem.connect(0, name="engine-a", runtime_dir=runtime_dir, timeout=30.0)
    pool = session.declare_kv_pool("kv-a", [gpumem.KvBuffer(f"b{i}", ROW) for i in range(2)], max_tokens=4096)
    pool.join_round(expect=2)
    b = subprocess.Popen([sys.executable, str(CHILD), "engine-b", "kv-b", backend, str(LIVE), *b_args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=child_env(runtime_dir))
    assert pool.capture_done(min_tokens=256, timeout=30) == 2048
    assert _line(b, "READY") == "2048"
    return daemon, session, pool, b


def _line(proc: subprocess.Popen[str], word: str, timeout: float = 30.0) -> str:
    """The rest of B's next line that starts with ``word``. A thread reads B's lines: a
    select on the pipe misses lines already read into the text buffer (two printed at
    once, MOVING and FAILED)."""
    if proc.pid not in _lines:
        _lines[proc.pid] = queue.Queue()
        threading.Thread(target=lambda: [_lines[proc.pid].put(line) for line in proc.stdout or ()], daemon=True).start()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = _lines[proc.pid].get(timeout=left)
        except queue.Empty:
            break
        if line.startswith(word):
            return line[len(word):].strip()
    proc.kill()
    raise AssertionError(f"engine B did not print {word} within {timeout}s; stderr:\n{proc.communicate()[1]}")


_lines: dict[int, queue.Queue[str]] = {}  # B's lines, by its pid


def _fill(pool: gpumem.KvPool, backend: str, value: int) -> list[Any]:
    buffers = rows(pool, backend)
    for b in buffers:
        b[: pool.tokens] = value
    return buffers


def _holds(buffers: list[Any], upto: int, value: int) -> bool:
    return all(bool((b[:upto] == value).all()) for b in buffers)


@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_idle_engine_moves_its_live_blocks_down_and_the_bursting_one_gets_the_rest(daemon_factory, backend, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    _, session, pool, b = _start(daemon_factory, backend, runtime_dir, "10")
    try:
        mine = _fill(pool, backend, 7)
        wait_status(runtime_dir, lambda s: {k["name"]: k["in_use"] for k in s["kv"]}.get("kv-b") == 0, 10, "B says it idles")
        grow = pool.send_grow(3072, in_use=2048)
        tokens, blocks, highest, verdict = _line(b, "SHRUNK").split()
        assert verdict == "intact" and int(highest) < LIVE  # moved to the bottom, bytes and all
        assert int(tokens) == int(blocks) and 256 <= int(tokens) < 2048  # the manager holds what the pool holds
        assert grow.wait(20) == 3072 and pool.unanswered == pool.gone == []
        assert _holds(mine, 2048, 7)
        assert b.wait(10) == 0
        s = wait_status(runtime_dir, lambda s: len(s["clients"]) == 1, 10, "B gone")
        assert s["device"]["accounted_bytes"] == cost(ROWS, 3072)
    finally:
        b.kill()
        b.communicate()
        session.close()


@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_engine_killed_while_it_moves_blocks_for_a_shrink_costs_the_grow_nothing_but_its_death(daemon_factory, backend, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon, session, pool, b = _start(daemon_factory, backend, runtime_dir, "60")
    try:
        mine = _fill(pool, backend, 7)
        wait_status(runtime_dir, lambda s: {k["name"]: k["in_use"] for k in s["kv"]}.get("kv-b") == 0, 10, "B says it idles")
        grow = pool.send_grow(3072, in_use=2048)
        _line(b, "MOVING")  # B's copy has begun: a block every 0.2 s
        b.kill()
        killed = time.monotonic()
        assert grow.wait(20) == 3072 and pool.unanswered == []  # everything B held came back
        assert time.monotonic() - killed < 10, "answered by B's death, not by the 60 s move deadline"
        assert pool.gone == ["engine-b/kv-b"], "the reply names the donor that died before it answered"
        s = status(runtime_dir)
        assert [k["name"] for k in s["kv"]] == ["kv-a"] and [c["name"] for c in s["clients"]] == ["engine-a"]
        assert s["device"]["accounted_bytes"] == cost(ROWS, 3072) <= 512 * MiB
        assert re.search(r"session \d+ closed: client 'engine-b' pid", daemon.log())  # the log names the engine that went away
        assert re.search(r"KV pool 'kv-a' grew to 3072 tokens .*gone before answering: engine-b/kv-b", daemon.log())
        # A goes on: its rows held, its new ones are real memory.
        assert _holds(mine, 2048, 7)
        mine = _fill(pool, backend, 9)
        assert _holds(mine, 3072, 9)
    finally:
        b.kill()
        b.communicate()
        session.close()


@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_engine_whose_copy_raises_mid_move_gives_nothing_back_and_the_books_stay_exact(daemon_factory, backend, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """The adapter's copy_blocks raises after one block of a shrink's move: the engine
    sees MoveFailed naming its pool and the move, its pool keeps every row and its blocks
    stay where they were (intact); the daemon answers A's grow at the move deadline with
    nothing, and its books (gpumemctl status) count both pools exactly, then A's alone."""
    daemon, session, pool, b = _start(daemon_factory, backend, runtime_dir, "3", "fail")
    try:
        wait_status(runtime_dir, lambda s: {k["name"]: k["in_use"] for k in s["kv"]}.get("kv-b") == 0, 10, "B says it idles")
        grow = pool.send_grow(3072, in_use=2048)
        failed = _line(b, "FAILED")
        tokens, blocks, highest, verdict, error = failed.split(maxsplit=4)
        assert (tokens, blocks, verdict) == ("2048", "2048", "intact") and int(highest) == 2047
        assert "KV pool 'kv-b': the engine's copy of 8 live blocks" in error and "nothing was given back" in error
        with pytest.raises(gpumem.OutOfMemory):
            grow.wait(20)  # at the move deadline: B gave nothing
        assert pool.tokens == 2048
        s = status(runtime_dir)
        assert {k["name"]: k["tokens"] for k in s["kv"]} == {"kv-a": 2048, "kv-b": 2048}
        assert s["device"]["accounted_bytes"] == 2 * cost(ROWS, 2048)
        b.kill()
        b.communicate()
        s = wait_status(runtime_dir, lambda s: len(s["clients"]) == 1, 10, "B gone")
        assert s["device"]["accounted_bytes"] == cost(ROWS, 2048) and daemon.proc.poll() is None
    finally:
        b.kill()
        b.communicate()
        session.close()
