"""The durable record without sockets or a service manager: the two memfds keep the
newest whole write, and a state written out comes back whole in a new DaemonState from
the descriptors a store would pass (the fd-store protocol itself: tests/integration/
test_restart.py)."""

from __future__ import annotations

import os
from collections.abc import Callable

from gpumem_shared import protocol as p
from gpumem_shared.driver.host import HostDriver
from gpumemd.durable import Durable, RecordFile
from gpumemd.image import chunk_name, lease_name
from gpumemd.state import DaemonState

from .harness import CAPACITY, Clock, Harness, MiB
from .store_kit import FakeStore


def test_the_record_keeps_the_newest_whole_write() -> None:
    record = RecordFile.create()
    try:
        record.write(b"first")
        record.write(b"second")
        assert RecordFile(list(record.fds)).read() == b"second"
        newest = record.fds[record.sequence % 2]
        os.pwrite(newest, b"X", 32)  # a write cut short: the payload is not what the header vouches for
        assert RecordFile(list(record.fds)).read() == b"first"
        os.pwrite(newest, (1 << 62).to_bytes(8, "little"), 16)  # a length beyond the file: no huge read
        assert RecordFile(list(record.fds)).read() == b"first"
        os.ftruncate(record.fds[(record.sequence + 1) % 2], 10)
        assert RecordFile(list(record.fds)).read() is None
    finally:
        record.close()


def test_a_state_comes_back_whole_and_is_released_after_the_grace_period(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    store = FakeStore()
    first = Durable(store)  # type: ignore[arg-type]
    first.start(h.state, {})
    owner, peer = h.connect("owner"), h.connect("peer")
    h.create(owner, "a", 256 * MiB)
    h.commit(owner, "a", 40 * MiB)
    h.share(owner, "a", "peer")
    h.attach(peer, "a")
    pool = h.ok(owner, p.RegisterGraphPool(arena="a", label="g", extents=[p.Extent(offset=0, size=8 * MiB)], free_runs=[], shared=True))
    pool_id = pool.reply.pool.id
    h.ok(owner, p.KvDeclare(name="kv", buffers=[p.KvBuffer(name="k", row_bytes=4096)], max_tokens=4096))
    first.persist(h.state)
    before = h.state.status()
    assert chunk_name(1) in store.held and lease_name(pool_id) in store.held and "record-1" in store.held
    h.state.arenas.close()  # the slice goes, as with the daemon's death; the next state takes it

    clock, wall = Clock(h.clock.now), Clock(h.wall_clock.now)
    again = Harness(DaemonState(HostDriver(index=0, capacity=CAPACITY), h.config, clock, wall), clock, wall)
    second = Durable(store)  # type: ignore[arg-type]
    second.start(again.state, store.passed())
    after = again.state.status()
    assert (after.daemon.generation, after.daemon.waiting, after.daemon.waiting_objects) == (1, 2, 3)
    assert [c.waiting for c in after.clients] == [True, True]
    assert (after.arenas, after.graph_pools, after.kv, after.device.accounted_bytes) == (
        before.arenas, before.graph_pools, before.kv, before.device.accounted_bytes,
    )
    assert [(c.session_id, c.name, c.pid) for c in after.clients] == [(c.session_id, c.name, c.pid) for c in before.clients]
    # Nobody came back: released like dead clients', and the store lets go of it all.
    again.clock.now += again.config.restart_grace
    again.state.tick()
    assert again.state.sessions == {} and again.state.arenas.accounted_bytes() == 0
    second.persist(again.state)
    assert sorted(store.held) == ["record-0", "record-1"]
    again.state.drop_all()
    first.close()
    second.close()
    store.drop()
