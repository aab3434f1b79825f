"""Helpers the lease tests share: segments as the daemon makes them, words, a waiting
thread, and the daemon's side of a graph pool as a client holds it."""

from __future__ import annotations

import os
import threading
import time

from gpumem_shared import lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import LeaseKind, LeaseSegment, LeaseStatus
from gpumemd.records import Outcome, SessionRecord as Session

from .harness import BULK, GiB, Harness, MiB

EPOCH = lease_table.lease_epoch(1, 1)


def fresh_segment(pool_id: int = 1) -> LeaseSegment:
    """A segment as the daemon creates one (its memfd closed: the mapping keeps it)."""
    seg, fd = LeaseSegment.create(pool_id)
    os.close(fd)
    return seg


def word(kind: int = LeaseKind.REPLAY, session: int = 1, pid: int = 1001) -> int:
    return lease_table.encode(kind, session, pid)


class Waiter(threading.Thread):
    """``table.acquire`` in a thread; ``result`` and ``elapsed`` once it returns."""

    def __init__(self, table: LeaseSegment, mine: int, epoch: int, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.args = (table, mine, epoch, timeout_s)
        self.result: tuple[int, int] | None = None
        self.elapsed = -1.0
        self.started_at = 0.0

    def run(self) -> None:
        table, mine, epoch, timeout_s = self.args
        self.started_at = time.monotonic()
        self.result = table.acquire(mine, epoch, timeout_s)
        self.elapsed = time.monotonic() - self.started_at

    def finish(self, timeout: float = 10.0) -> tuple[int, int]:
        self.join(timeout)
        assert not self.is_alive(), f"the waiter did not return within {timeout}s"
        assert self.result is not None
        return self.result


def wait_until_sleeping(table: LeaseSegment, waiters: int = 1, timeout: float = 5.0) -> None:
    """Until ``waiters`` threads are counted on the slot's futex (they are about to sleep)."""
    deadline = time.monotonic() + timeout
    while table._slot.waiters < waiters:
        assert time.monotonic() < deadline, f"no {waiters} waiter(s) on the slot within {timeout}s"
        time.sleep(0.001)
    time.sleep(0.02)  # from counted to asleep in the kernel: a few instructions


ARENA = "graphs"


class Pool:
    """A graph pool as a client holds it: the daemon's view of it, and the client's own
    mapping of its lease segment (which outlives the daemon's when the pool goes)."""

    def __init__(self, view: p.GraphPoolStatus, segment: LeaseSegment) -> None:
        self.view = view
        self.segment = segment
        self.id = view.id

    @property
    def epoch(self) -> int:
        return lease_table.lease_epoch(self.id, self.view.epoch)


def granted(outcome: Outcome) -> LeaseSegment:
    """What a client does with the segment a reply grants: it maps it."""
    [(_, fd)] = outcome.grants
    assert outcome.reply.fd_batches == 1  # type: ignore[union-attr]
    return LeaseSegment(fd)


def owner(h: Harness, name: str = "engine") -> Session:
    s = h.connect(name)
    h.create(s, ARENA, GiB)
    h.commit(s, ARENA, 2 * BULK)
    return s


def register(h: Harness, s: Session, offset: int, label: str, shared: bool = True) -> Pool:
    m = p.RegisterGraphPool(arena=ARENA, label=label, extents=[p.Extent(offset=offset, size=4 * MiB)], free_runs=[], shared=shared)
    outcome = h.ok(s, m)
    return Pool(outcome.reply.pool, granted(outcome))


def user(h: Harness, s: Session, name: str, *pools: Pool) -> Session:
    """A client ``s`` shares its arena with, attached, that opened ``pools``."""
    h.share(s, ARENA, name)
    other = h.connect(name)
    h.attach(other, ARENA)
    for pool in pools:
        granted(h.ok(other, p.OpenGraphPool(pool_id=pool.id))).close()  # the same segment as the pool's
    return other


def take(pool: Pool, s: Session, kind: int = LeaseKind.REPLAY, label: str = "") -> int:
    """``s`` takes the pool's lease as its client would; returns the word."""
    w = lease_table.encode(kind, s.id, s.pid)
    assert pool.segment.acquire(w, pool.epoch, 0) == (LeaseStatus.OK, 0)
    pool.segment.set_label(label)
    return w


def give_back(pool: Pool, w: int) -> int:
    """Release as a client does: on a shared pool, once its event is recorded."""
    status = pool.segment.release(w)
    return pool.segment.release_recorded(w) if status == LeaseStatus.RECORD else status


def follow(h: Harness, s: Session, pool: Pool) -> LeaseSegment:
    """What ``s``'s client does once it finds the pool's segment retired: it opens the
    pool again and maps the segment it moved to. Returns the old mapping."""
    old, pool.segment = pool.segment, granted(h.ok(s, p.OpenGraphPool(pool_id=pool.id)))
    assert old.epoch() == 0 and not old.same_memory(pool.segment), "the pool did not move"
    return old


def repairs(h: Harness, pool: Pool) -> int:
    return {g.id: g.lease_repairs for g in h.state.status().graph_pools}[pool.id]
