"""An engine that works through daemon restarts (tests/integration/test_restart_loop.py,
bench/restart.py): commits and decommits, a share, a KV round, replay leases and
borrows, checking its bytes all along. Any failed call ends it with status 1: an engine
must never see a restart beyond a delayed call.

    python tests/restart_engine.py ROLE RUNTIME_DIR STOP_FILE

ROLE ``a`` owns arena "a" (shared with engine-b) and the shared graph pool "g" in it;
``b`` attaches the arena, opens the pool and borrows its free runs. Both declare a KV
pool and size it in one round. It prints READY once set up, then DONE and a JSON line
(iterations, the slowest call in seconds) when STOP_FILE appears.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpumem
from gpumem_shared import protocol as p

MiB = 1 << 20
BASE = 32 * MiB
PATTERN = b"engine-a's bytes, kept across every restart"
TIMEOUT = 60.0  # a call may wait this long for a restarted daemon


class Timed:
    """Every call the engine makes, timed: the slowest is what a restart cost it."""

    def __init__(self) -> None:
        self.slowest = 0.0
        self.calls = 0

    def __call__(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        started = time.monotonic()
        result = fn(*args, **kw)
        self.slowest = max(self.slowest, time.monotonic() - started)
        self.calls += 1
        return result


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def kv_pool(session: gpumem.Session, call: Timed, name: str) -> gpumem.KvPool:
    pool = call(session.declare_kv_pool, name, [gpumem.KvBuffer("k", 4096), gpumem.KvBuffer("v", 4096)], max_tokens=4096)
    call(pool.placeholder)
    call(pool.join_round, expect=2)
    call(pool.capture_done, headroom_bytes=0, min_tokens=512, max_tokens=2048)
    check(pool.tokens >= 512, f"KV pool {name} holds {pool.tokens} tokens")
    return pool


def kv_check(pool: gpumem.KvPool, stamp: bytes) -> None:
    for buffer in pool.buffers.values():
        last = buffer.offset + pool.tokens * buffer.row_bytes - len(stamp)
        pool.arena.write(last, stamp)
        check(pool.arena.read(last, len(stamp)) == stamp, f"KV buffer {buffer.name} lost its bytes")


def engine_a(runtime_dir: Path, stop: Path, call: Timed) -> int:
    session = gpumem.connect(0, "engine-a", runtime_dir=runtime_dir, timeout=TIMEOUT)
    arena = call(session.create_arena, "a", 256 * MiB)
    call(arena.commit, BASE)
    arena.write(0, PATTERN)
    call(arena.share, "engine-b")
    pool = call(
        arena.register_graph_pool, "g", shared=True, extents=[p.Extent(offset=0, size=16 * MiB)],
        free_runs=[p.Extent(offset=8 * MiB, size=8 * MiB)],
    )
    kv = kv_pool(session, call, "kv-a")
    print("READY", flush=True)
    i = 0
    while not stop.exists():
        i += 1
        target = BASE + (i % 4) * 8 * MiB
        if target > arena.committed:
            call(arena.commit, target)
            stamp = f"commit {i}".encode()
            arena.write(target - 4096, stamp)
            check(arena.read(target - 4096, len(stamp)) == stamp, f"commit {i}: the new chunk lost its bytes")
        else:
            call(arena.decommit, target)
        check(arena.read(0, len(PATTERN)) == PATTERN, f"iteration {i}: the arena lost its first bytes")
        lease = call(session.replay, pool, wait=TIMEOUT)
        call(lease.release)
        kv_check(kv, f"a{i}".encode())
        if i % 8 == 0:
            call(session.ping)
    session.close()
    return i


def borrow_once(session: gpumem.Session, call: Timed, pool: gpumem.GraphPool, i: int) -> None:
    with call(session.borrow, pool, user="engine-b", wait=TIMEOUT) as borrow:
        view = borrow.allocate(MiB)
        stamp = f"borrow {i}".encode()
        session.driver.write(view.address, stamp)
        check(session.driver.read(view.address, len(stamp)) == stamp, f"borrow {i}: the borrowed run lost its bytes")
        del view


def engine_b(runtime_dir: Path, stop: Path, call: Timed) -> int:
    session = gpumem.connect(0, "engine-b", runtime_dir=runtime_dir, timeout=TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while True:  # engine-a shares its arena once it made it
        try:
            arena = call(session.attach_arena, "a")
            pool = call(session.open_graph_pool, owner="engine-a", label="g")
            break
        except (gpumem.NotFound, gpumem.PermissionDenied):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    kv = kv_pool(session, call, "kv-b")
    # The first borrow on CUDA imports torch and builds the borrow's machinery (seconds,
    # longer under the test's stop/continue): part of setting up, not of a restart.
    borrow_once(session, call, pool, 0)
    print("READY", flush=True)
    i = 0
    while not stop.exists():
        i += 1
        call(arena.sync)
        check(arena.read(0, len(PATTERN)) == PATTERN, f"iteration {i}: the shared arena lost engine-a's bytes")
        borrow_once(session, call, pool, i)
        kv_check(kv, f"b{i}".encode())
    session.close()
    return i


def main() -> int:
    faulthandler.enable()  # a crash says where, on the stderr the loop shows
    role, runtime_dir, stop = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    call = Timed()
    iterations = (engine_a if role == "a" else engine_b)(runtime_dir, stop, call)
    print("DONE", json.dumps({"role": role, "iterations": iterations, "calls": call.calls, "slowest_s": round(call.slowest, 3), "pid": os.getpid()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
