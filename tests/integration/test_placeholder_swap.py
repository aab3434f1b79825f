"""The swap from placeholder to real memory hides its unmapping behind the daemon's work:
a commit, and a KV round's wait, unmap the placeholder where the request will map real
chunks while the request is with the daemon, not after its answer. A request that fails
puts the placeholder back, so capture on it goes on working. On every backend, in this
process (the calls are watched where they happen)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import gpumem
from gpumemd_testkit import MiB

GiB = 1 << 30
SLOT = 64 * MiB
MARK = b"placeholder scratch"


@pytest.fixture
def session(daemon: Any, runtime_dir: Path) -> Iterator[gpumem.Session]:
    with gpumem.connect(0, name="engine-a", runtime_dir=runtime_dir, timeout=30.0) as s:
        yield s


def watch(session: gpumem.Session, begin: str, end: str) -> list[bool]:
    """Every placeholder unmap from now on, as whether a request was with the daemon then:
    from the channel's ``begin`` call (sending it) until its ``end`` call returns (the
    answer taken). A commit is one ``call``; a round's report is ``start``, then ``finish``."""
    waiting = [False]
    unmaps: list[bool] = []
    channel = session.channel
    sending: Callable[..., Any] = getattr(channel, begin)
    unmap = session.driver.unmap_many

    def sent(*args: Any, **kw: Any) -> Any:
        waiting[0] = True
        return sending(*args, **kw)

    setattr(channel, begin, sent)
    answer: Callable[..., Any] = getattr(channel, end)

    def answered(*args: Any, **kw: Any) -> Any:
        try:
            return answer(*args, **kw)
        finally:
            waiting[0] = False

    def noted(address: int, ranges: list[tuple[int, int]]) -> None:
        unmaps.append(waiting[0])
        unmap(address, ranges)

    setattr(channel, end, answered)
    session.driver.unmap_many = noted  # type: ignore[method-assign]
    return unmaps


def placeholder_intact(arena: gpumem.Arena, size: int) -> None:
    """Placeholder over all of ``[0, size)`` again, one chunk aliased over every slot."""
    assert arena.backed_ranges() == [(0, size)] and arena.committed_ranges() == []
    assert arena.placeholder_bytes == size
    # written at offset 0 before: every slot aliases the same chunk
    assert arena.core.driver.read(arena.address + size - SLOT, len(MARK)) == MARK


def mark(arena: gpumem.Arena) -> None:
    arena.core.driver.write(arena.address, MARK)


def test_commit_unmaps_the_placeholder_while_the_daemon_works(session: gpumem.Session) -> None:
    arena = session.create_arena("model", 4 * GiB)
    arena.placeholder(0, 2 * GiB, SLOT)
    unmaps = watch(session, "call", "call")
    arena.commit(GiB)
    assert unmaps == [True]  # one batch, before the answer
    assert arena.committed_ranges() == [(0, GiB)] and arena.backed_ranges() == [(0, 2 * GiB)]
    arena.write(GiB - 4096, b"real")
    assert arena.read(GiB - 4096, 4) == b"real"


def test_a_commit_that_fails_puts_the_placeholder_back(session: gpumem.Session) -> None:
    total = session.status().device.total_bytes
    window = (total // GiB + 2) * GiB
    arena = session.create_arena("model", window)
    arena.placeholder(0, 4 * GiB, SLOT)
    mark(arena)
    unmaps = watch(session, "call", "call")
    with pytest.raises(gpumem.OutOfMemory):
        arena.commit(window)  # more than the device holds
    assert unmaps == [True]
    placeholder_intact(arena, 4 * GiB)
    assert session.status().device.accounted_bytes == SLOT + 2 * MiB  # the placeholder's chunks only


def kv_pool(session: gpumem.Session) -> gpumem.KvPool:
    pool = session.declare_kv_pool("kv", [gpumem.KvBuffer("k", 64 * 1024), gpumem.KvBuffer("v", 64 * 1024)], max_tokens=16384)
    pool.placeholder(SLOT)
    mark(pool.arena)
    pool.join_round()
    return pool


def test_a_round_unmaps_the_minimum_rows_while_it_finishes(session: gpumem.Session) -> None:
    pool = kv_pool(session)
    size = pool.arena.reserved
    unmaps = watch(session, "start", "finish")
    tokens = pool.capture_done(min_tokens=4096, max_tokens=8192)
    assert tokens == 8192
    # the minimum's slots went while the round finished; the rest of the rows it
    # committed after its answer
    assert unmaps == [True, False]
    rows = 8192 * 64 * 1024
    assert pool.arena.committed_ranges() == [(0, rows), (16384 * 64 * 1024, 16384 * 64 * 1024 + rows)]
    assert pool.arena.backed_ranges() == [(0, size)]


def test_a_failed_round_puts_the_placeholder_back(session: gpumem.Session) -> None:
    pool = kv_pool(session)
    size = pool.arena.reserved
    total = session.status().device.total_bytes
    with pytest.raises(gpumem.RoundFailed):  # the headroom leaves no room for the minimum
        pool.capture_done(headroom_bytes=total, min_tokens=4096)
    placeholder_intact(pool.arena, size)
