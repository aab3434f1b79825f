"""Memops lease ordering (``gpumemd --lease-ordering memops``) against a real gpumemd on
the host backend: the grant of a lane and the sequence chunk with a shared pool, a taker
whose wait is satisfied by the value its releaser (another process) wrote, and a
releaser that died with a value published and never written, whose lane the daemon's
sweep tops off so the taker is not held past it.

The test process owns the arena and the pool and takes the leases after the releasers
(``tests/clients.py shell`` processes the arena is shared with). On the host backend a
write lands at once and a wait is a bounded poll of the word: these tests check the
protocol of values; the last test, on every backend, has GPU work in flight on CUDA."""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpumem
from gpumem.errors import LeaseConflict
from gpumem_shared import lease_order, lease_table
from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError
from gpumemd_testkit import MiB

from test_leases import ARENA, ask

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def memops_daemon(daemon_factory: Any) -> Any:
    return daemon_factory("host", args=["--lease-ordering", "memops"])


class Owner:
    def __init__(self, runtime_dir: Path) -> None:
        self.session = gpumem.connect(0, name="pool-owner", runtime_dir=runtime_dir, timeout=10.0)
        self.arena = self.session.create_arena(ARENA, 1 << 30)
        self.arena.commit(16 * MiB)

    def register(self) -> gpumem.GraphPool:
        return self.arena.register_graph_pool("decode", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[], shared=True)

    def word(self, lane: int) -> int:
        leasing = self.session.leasing
        return ctypes.c_uint64.from_address(leasing.lanes_address + lane * lease_order.WORD_BYTES).value


@pytest.fixture
def owner(memops_daemon: Any, runtime_dir: Path) -> Iterator[Owner]:
    o = Owner(runtime_dir)
    yield o
    o.session.close()


@pytest.fixture
def releaser(owner: Owner, run_client: Any) -> Any:
    def start(name: str) -> Any:
        owner.arena.share(name)
        c = run_client("shell", name)
        c.expect("CONNECTED", timeout=30)
        ask(c, f"attach {ARENA}")
        return c

    return start


def test_a_shared_pool_grants_a_lane_per_user_and_the_chunk(owner: Owner, releaser: Any) -> None:
    pool = owner.register()
    leasing = owner.session.leasing
    mine = leasing.lanes[pool.id]
    assert leasing.lanes_address and leasing.lanes_count > 1
    private = owner.arena.register_graph_pool("private", extents=[p.Extent(offset=4 * MiB, size=4 * MiB)], free_runs=[])
    assert private.id not in leasing.lanes, "a private pool orders nothing"
    a = releaser("releaser-a")
    assert ask(a, f"lease replay {pool.id} 0 first") == "replay"
    assert ask(a, f"unlease {pool.id}") == ""
    lane, value = pool.segment.order()
    assert lane != mine.index, "each user of the pool writes its own lane"
    assert value & lease_order.SEQ_MASK == 1


def test_the_taker_waits_for_the_value_its_releaser_wrote(owner: Owner, releaser: Any) -> None:
    pool = owner.register()
    a = releaser("releaser-a")
    for n in (1, 2):
        assert ask(a, f"lease replay {pool.id} 0 turn-{n}") == "replay"
        assert ask(a, f"unlease {pool.id}") == ""
        lane, value = pool.segment.order()
        assert value & lease_order.SEQ_MASK == n
        assert owner.word(lane) == value, "the releaser's stream wrote its value"
        before = owner.session.leasing.handoff_waits
        with owner.session.replay(pool, wait=5.0):
            assert owner.session.leasing.handoff_waits == before + 1
    # Our own releases publish our lane: the releaser, taking after us, waits on it.
    lane, value = pool.segment.order()
    assert lane == owner.session.leasing.lanes[pool.id].index and owner.word(lane) == value


def test_a_take_while_the_releasers_write_is_in_flight_waits_for_it_within_its_bound(owner: Owner, releaser: Any) -> None:
    """A release frees the slot before it queues its write (the waiter wakes meanwhile),
    marked until the write is queued: a taker finding the mark waits for it within its
    ``wait``, and one that runs out names the releaser and what it has not done."""
    pool = owner.register()
    a = releaser("stuck-releaser")
    assert ask(a, f"lease replay {pool.id} 0 turn") == "replay"
    assert ask(a, f"unlease {pool.id}") == ""
    done = pool.segment.handoff()
    pool.segment._slot.handoff = done | lease_table.HANDOFF_RECORDING  # a's state between freeing and queuing its write
    with pytest.raises(LeaseConflict, match="has not queued the stream write") as refused:
        owner.session.replay(pool, wait=0)
    assert "'stuck-releaser'" in str(refused.value) and pool.segment.peek() == 0, "refused at once, the take given back"
    queued = threading.Timer(0.1, setattr, (pool.segment._slot, "handoff", done))
    queued.start()
    try:
        before = owner.session.leasing.handoff_waits
        with owner.session.replay(pool, wait=10.0):
            assert owner.session.leasing.handoff_waits == before + 1, "ordered after the write, once queued"
    finally:
        queued.cancel()


def test_a_releaser_that_died_before_its_write_holds_the_taker_only_until_the_sweep(
    owner: Owner, releaser: Any, memops_daemon: Any
) -> None:
    """A releaser whose stream never wrote the value it published (it died with the write
    queued: written here as its next release would publish it): the taker's stream waits
    for the lane, and the daemon, sweeping the dead session, tops the lane off."""
    pool = owner.register()
    a = releaser("dies-before-its-write")
    assert ask(a, f"lease replay {pool.id} 0 last-turn") == "replay"
    assert ask(a, f"unlease {pool.id}") == ""
    lane, value = pool.segment.order()
    pool.segment.publish_order(lane, value + 1)  # published, never written
    with pytest.raises(DriverError, match="never wrote it"):
        owner.session.replay(pool, wait=0.2)
    assert pool.segment.peek() == 0, "the refused take was given back"
    killer = threading.Timer(0.3, a.proc.send_signal, (signal.SIGKILL,))
    killer.start()
    started = time.monotonic()
    try:
        with owner.session.replay(pool, wait=20.0):
            waited = time.monotonic() - started
    finally:
        killer.cancel()
    assert waited < 10.0, f"the taker waited {waited:.1f}s"
    assert lease_order.reached(owner.word(lane), value + 1)
    assert owner.word(lane) & lease_order.SEQ_MASK == lease_order.SEQ_MASK, "the daemon wrote the swept value"


def test_memops_is_refused_under_systemds_fd_store(runtime_dir: Path) -> None:
    """Its sequence chunk is not in the durable record: a restart would leave clients
    writing a chunk the new daemon never reads. Refused at start, saying what to do."""
    from conftest import child_env
    from fdstore_kit import Restartable

    daemon = Restartable(runtime_dir, "host", ["--lease-ordering", "memops"], child_env(runtime_dir))
    try:
        daemon.start(wait=False)
        proc = daemon.manager.proc
        assert proc is not None and proc.wait(60) != 0
        log = daemon.manager.log()
        assert "--lease-ordering memops does not survive a restart yet" in log and "ipc-events" in log, log
    finally:
        daemon.manager.close()


def test_a_handoff_ordered_by_memops_never_shows_the_releasers_unfinished_writes(backend: str, daemon_factory: Any, runtime_dir: Path) -> None:
    """The borrow scenario of a cross-process handoff (tests/borrow_scenarios.py): the
    releaser queues a fill behind ~200 ms of GPU work and releases without synchronizing;
    the taker, from another process, reads the region after acquiring and must see the
    fill. Under memops the order is the releaser's stream write and the taker's stream
    wait (each counted in handoff_waits, as the scenario asserts); on the host backend
    work is synchronous, so there it checks the protocol runs end to end."""
    from test_borrow import run_scenario

    daemon = daemon_factory(backend, args=["--lease-ordering", "memops"])
    run_scenario(runtime_dir, daemon, ["handoff_orders_gpu_work"], 300)
