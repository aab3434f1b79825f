"""The durable record without sockets or a service manager: the two memfds keep the
newest whole write, and a state written out comes back whole in a new DaemonState from
the descriptors a store would pass (the fd-store protocol itself: tests/integration/
test_restart.py)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.driver.host import HostDriver
from gpumemd.durable import RECORD_NAMES, Durable, RecordFile
from gpumemd.image import StateImage, chunk_name, decode, encode, lease_name
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


def _stored_then_restarted(
    make_harness: Callable[..., Harness], tamper: Callable[[FakeStore, dict[str, list[int]]], None]
) -> tuple[Harness, Harness, Durable]:
    """A state with an arena of committed chunks in a store, ``tamper``ed with, and the state a restart rebuilds of it."""
    h = make_harness()
    store = FakeStore()
    first = Durable(store)  # type: ignore[arg-type]
    first.start(h.state, {})
    owner = h.connect("owner")
    h.create(owner, "a", 256 * MiB)
    h.commit(owner, "a", 40 * MiB)
    first.persist(h.state)
    h.state.arenas.close()
    first.close()
    passed = store.passed()
    tamper(store, passed)
    clock, wall = Clock(h.clock.now), Clock(h.wall_clock.now)
    again = Harness(DaemonState(HostDriver(index=0, capacity=CAPACITY), h.config, clock, wall), clock, wall)
    second = Durable(store)  # type: ignore[arg-type]
    second.start(again.state, passed)
    return h, again, second


def _finish(again: Harness, durable: Durable) -> None:
    again.state.drop_all()
    durable.close()
    assert isinstance(durable.notifier, FakeStore)
    durable.notifier.drop()


def _rewrite(store: FakeStore, change: Callable[[StateImage], None]) -> None:
    """A record written as a daemon writes one (its checksum right), holding what ``change`` made of the newest."""
    record = RecordFile([store.held[name] for name in RECORD_NAMES])
    payload = record.read()
    assert payload is not None
    image = decode(payload)
    change(image)
    record.write(encode(image))


def _open_files(part: str) -> list[str]:
    """What this process's descriptors that name ``part`` are."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            continue
        if part in link:
            found.append(link)
    return found


def _forged(size: int) -> int:
    fd = os.memfd_create("forged-chunk", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


@pytest.mark.parametrize("where", ["instead", "first of two"])
def test_a_chunk_put_in_the_store_by_another_is_not_adopted(make_harness: Callable[..., Harness], where: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    forged: list[int] = []

    def tamper(store: FakeStore, passed: dict[str, list[int]]) -> None:
        forged.append(_forged(os.fstat(passed[chunk_name(1)][0]).st_size))
        if where == "instead":
            os.close(passed[chunk_name(1)].pop())
        passed[chunk_name(1)].insert(0, forged[0])

    h, again, durable = _stored_then_restarted(make_harness, tamper)
    try:
        held = {c.id: c for a in again.state.arenas.by_name.values() for c in a.chunks}
        if where == "instead":
            assert 1 not in held, "a forged chunk was adopted"
        else:
            assert 1 in held and "forged" not in os.readlink(f"/proc/self/fd/{again.state.driver.chunk_fd(held[1].handle)}")
        assert "named 'chunk-1' that are not the one the daemon stored" in caplog.text
        (problem,) = again.state.status().daemon.restore_problems
        assert "named 'chunk-1' that are not the one the daemon stored" in problem
        assert not _open_files("forged-chunk"), "the forged descriptor was left open"
    finally:
        _finish(again, durable)


def test_duplicate_record_names_are_not_read(make_harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture) -> None:
    def tamper(store: FakeStore, passed: dict[str, list[int]]) -> None:
        passed["record-0"].append(os.dup(passed["record-0"][0]))

    h, again, durable = _stored_then_restarted(make_harness, tamper)
    try:
        assert "2 descriptors named 'record-0'; none is read, all closed" in caplog.text
        assert again.state.session_desk.generation == 0 and not again.state.sessions
        store = durable.notifier
        assert isinstance(store, FakeStore)
        assert [os.fstat(store.held[name]).st_ino for name in RECORD_NAMES] == [os.fstat(fd).st_ino for fd in durable.record.fds], (
            "the store still holds the records that were refused, not the daemon's new ones"
        )
    finally:
        _finish(again, durable)


def test_a_record_with_counters_no_daemon_issues_is_refused_and_the_daemon_serves(
    make_harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    def tamper(store: FakeStore, passed: dict[str, list[int]]) -> None:
        _rewrite(store, lambda image: image.sessions.update(next_session=2**64 - 1))

    h, again, durable = _stored_then_restarted(make_harness, tamper)
    try:
        again.connect("next")  # the HELLO after such a restart
        durable.persist(again.state)
        again.connect("after")
        durable.persist(again.state)
        assert "durable record refused: sessions.next_session = 18446744073709551615" in caplog.text
    finally:
        _finish(again, durable)


def test_a_corrupt_newest_record_is_rebuilt_from_the_one_before_and_says_what_is_lost(
    make_harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    newest: list[int] = []

    def tamper(store: FakeStore, passed: dict[str, list[int]]) -> None:
        record = RecordFile([store.held[name] for name in RECORD_NAMES])
        record.read()
        newest.append(record.sequence)
        os.pwrite(record.fds[record.sequence % 2], b"\xff", 40)  # one byte of its payload

    h, again, durable = _stored_then_restarted(make_harness, tamper)
    try:
        lost = newest[0]
        assert f"write {lost}, the newest, is corrupt; the state is rebuilt from write {lost - 1}" in caplog.text
        assert f"acknowledged in write {lost} is lost" in caplog.text
        assert again.state.status().daemon.restore_problems == [
            f"durable record write {lost}, the newest, is corrupt: what it acknowledged is lost"
        ], "gpumemctl status does not show what the start lost"
        assert again.state.session_desk.generation == 1
        assert durable.record.sequence > lost, "a write after it must not be read as older than the corrupt one"
        assert RecordFile(list(durable.record.fds)).read() is not None
    finally:
        _finish(again, durable)


@pytest.mark.parametrize("slot", ["the corrupt one", "the whole one"])
def test_a_write_number_no_daemon_reaches_does_not_stop_the_next_write(slot: str) -> None:
    record = RecordFile.create()
    try:
        record.write(b"first")
        record.write(b"second")
        newest = record.fds[record.sequence % 2]
        huge = (2**64 - 1).to_bytes(8, "little")
        if slot == "the corrupt one":
            os.pwrite(newest, huge, 8)
            os.pwrite(newest, b"X", 32)
        else:  # a header whose checksum holds, but no daemon writes that many
            os.pwrite(newest, huge, 8)
        again = RecordFile(list(record.fds))
        assert again.read() == b"first"
        again.write(b"third")
        assert RecordFile(list(record.fds)).read() == b"third"
    finally:
        record.close()


def test_what_a_start_adopted_is_named_by_identity_in_the_next_record(make_harness: Callable[..., Harness]) -> None:
    h, again, durable = _stored_then_restarted(make_harness, lambda store, passed: None)
    try:
        committed = again.state.arenas.by_name["a"].committed
        record = RecordFile([durable.notifier.held[name] for name in RECORD_NAMES])  # type: ignore[attr-defined]
        payload = record.read()
        assert payload is not None
        stored = decode(payload).stored or {}
        chunk = again.state.arenas.by_name["a"].chunks[0]
        st = os.fstat(again.state.driver.chunk_fd(chunk.handle))
        assert tuple(stored[chunk_name(chunk.id)]) == (st.st_dev, st.st_ino), "a second restart would refuse the chunk"
        assert committed == 40 * MiB and not again.state.restore_problems
    finally:
        _finish(again, durable)
