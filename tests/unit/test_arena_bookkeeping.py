"""The client arena's map of its window, driven by replies built here and carried out
with the real host driver: which chunk is mapped where (by id, not by offset), the
placeholder cover around them, what is reported back, and that a window lies in the
daemon's address slice. Every check reads the
process's real mappings (/proc/self/maps) before touching the bytes, so a wrong unmap
fails an assertion instead of faulting the test process."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumem.address_slices import AddressSlice
from gpumem.arena import Arena
from gpumem.core import SessionCore
from gpumem.errors import InvalidArgument, MappingError, SessionClosed, VaCollision
from gpumem_shared import protocol as p
from gpumem_shared.driver.host import HostDriver
from gpumem_shared.paths import Endpoints

MiB = 1 << 20
G = 2 * MiB
WINDOW = 64 * MiB
SLOT = 16 * MiB


class FakeChannel:
    """The session's channel, with the daemon's side played by the test: requests are
    recorded; a placeholder request is answered with the chunks the test prepared."""

    def __init__(self) -> None:
        self.name = "bookkeeper"
        self.timeout = 1.0
        self.endpoints = Endpoints(Path("/nonexistent"), 0)
        device = p.DeviceInfo(index=0, uuid="HOST-test", name="test", total_bytes=WINDOW, granularity=G)
        self.hello = p.HelloReply(
            protocol=[1, 0], daemon_version="test", daemon_pid=0, session_id=1, token=b"t", backend="host", device=device
        )
        self.closed = False
        self.holdings: Any = list
        self.sent: list[p.RequestMessage] = []
        self.placeholder_chunks: list[p.ChunkView] = []
        self.placeholder_fds: dict[int, int] = {}

    def call(self, message: p.RequestMessage, timeout: float | None = None) -> Any:
        self.sent.append(message)
        if isinstance(message, p.PlaceholderArena):
            reply = p.PlaceholderReply(arena=view(0), chunks=self.placeholder_chunks, fd_batches=1)
            return reply, {cid: os.dup(fd) for cid, fd in self.placeholder_fds.items()}
        if isinstance(message, p.CreateArena):
            return p.ArenaReply(arena=view(0)), {}
        return p.Ack(), {}

    def unmapped_reports(self) -> list[list[int]]:
        return [m.chunk_ids for m in self.sent if isinstance(m, p.ChunksUnmapped)]


class BookkeepingCore(SessionCore):
    """A real session core over the fake channel; the test's window stands in for the
    daemon's slice."""

    def address_slice(self) -> AddressSlice:
        if self._slice is None:
            self._slice = AddressSlice(BASE, WINDOW, "the test's daemon", self.driver)
        return self._slice


def view(committed: int) -> p.ArenaView:
    return p.ArenaView(name="kv", owner="owner", address=BASE, reserved=WINDOW, committed=committed, granularity=G)


BASE = 0  # set by the fixture: where this test's window is reserved
TEST_HINT = 0x6800_0000_0000  # above every device's address slice; anywhere else would do too


class Chunks:
    """memfd chunks, each filled with its own byte, as the daemon would create them."""

    def __init__(self, driver: HostDriver) -> None:
        self.driver = driver
        self.fds: dict[int, int] = {}

    def make(self, chunk_id: int, offset: int, size: int) -> p.ChunkView:
        (fd,) = self.driver.create_chunks([(0, size)])
        os.pwrite(fd, bytes([chunk_id]) * size, 0)
        self.fds[chunk_id] = fd
        return p.ChunkView(id=chunk_id, offset=offset, size=size)

    def handed(self, chunks: list[p.ChunkView]) -> dict[int, int]:
        return {c.id: os.dup(self.fds[c.id]) for c in chunks}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@pytest.fixture
def setup() -> Iterator[tuple[Arena, FakeChannel, Chunks]]:
    global BASE
    driver = HostDriver(index=0)
    BASE = driver.reserve(WINDOW, TEST_HINT)
    daemon = FakeChannel()
    core = BookkeepingCore(daemon, driver, None)  # type: ignore[arg-type]
    chunks = Chunks(driver)
    arena = Arena.create(core, "kv", WINDOW)
    try:
        yield arena, daemon, chunks
    finally:
        if arena.name in core.arenas:  # not released by the test
            arena.release()
        driver.free_reservation(BASE, WINDOW)
        chunks.close()


def apply(arena: Arena, chunks: Chunks, committed: int, new: list[p.ChunkView], retired: list[p.ChunkView]) -> None:
    reply = p.MapReply(arena=view(committed), chunks=new, retired=retired, fd_batches=1 if new else 0)
    arena.apply(reply, chunks.handed(new))


def mappings(start: int, end: int) -> list[tuple[int, int, str]]:
    """(offset, end offset, kind) of this process's mappings over the window's
    [start, end), neighbours of one kind merged: "chunk" for chunks' memfds, "none"
    for reserved-only space."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) - BASE for x in fields[0].split("-"))
            if lo < end and start < hi:
                kind = "chunk" if "gpumemd-chunk" in line else ("none" if fields[1].startswith("---") else fields[1])
                if out and out[-1][1] == max(lo, start) and out[-1][2] == kind:
                    out[-1] = (out[-1][0], min(hi, end), kind)
                else:
                    out.append((max(lo, start), min(hi, end), kind))
    return out


def byte_at(offset: int) -> int:
    import ctypes

    return ctypes.string_at(BASE + offset, 1)[0]


def test_a_new_chunk_at_a_retired_chunks_offset_stays_mapped(setup: tuple[Arena, FakeChannel, Chunks]) -> None:
    arena, daemon, chunks = setup
    first = chunks.make(1, 0, 4 * MiB)
    apply(arena, chunks, 4 * MiB, [first], [])
    assert byte_at(0) == 1
    # One reply (a sharer's sync): chunk 1 retired, chunks 2 and 3 handed out over its offsets.
    second, third = chunks.make(2, 0, 2 * MiB), chunks.make(3, 2 * MiB, 4 * MiB)
    apply(arena, chunks, 6 * MiB, [second, third], [first])
    assert mappings(0, 6 * MiB) == [(0, 6 * MiB, "chunk")], "a new chunk was unmapped with the retired one"
    assert (byte_at(0), byte_at(2 * MiB - 1), byte_at(2 * MiB), byte_at(6 * MiB - 1)) == (2, 2, 3, 3)
    assert arena.committed_ranges() == [(0, 6 * MiB)] and arena.mapped_bytes == 6 * MiB
    assert daemon.unmapped_reports() == [[1]]
    # The new chunks retire by their own ids, whatever sat at their offsets before.
    apply(arena, chunks, 0, [], [second, third])
    assert mappings(0, 6 * MiB) == [(0, 6 * MiB, "none")]
    assert arena.committed_ranges() == [] and arena.backed_ranges() == []
    assert daemon.unmapped_reports() == [[1], [2, 3]]


def test_placeholder_cover_follows_chunks_retired_and_handed_out_together(setup: tuple[Arena, FakeChannel, Chunks]) -> None:
    arena, daemon, chunks = setup
    slot, granule = chunks.make(100, 0, SLOT), chunks.make(101, 0, G)
    daemon.placeholder_chunks = [slot, granule]
    daemon.placeholder_fds = {100: chunks.fds[100], 101: chunks.fds[101]}
    arena.placeholder(0, WINDOW, SLOT)
    assert arena.placeholder_bytes == WINDOW and mappings(0, WINDOW) == [(0, WINDOW, "chunk")]
    first = chunks.make(1, 0, 20 * MiB)
    apply(arena, chunks, 20 * MiB, [first], [])
    assert arena.committed_ranges() == [(0, 20 * MiB)] and arena.placeholder_bytes == WINDOW - 20 * MiB
    # Retired and new in one reply: the new chunk is shorter, placeholder fills the rest.
    second = chunks.make(2, 0, 6 * MiB)
    apply(arena, chunks, 6 * MiB, [second], [first])
    assert arena.committed_ranges() == [(0, 6 * MiB)]
    assert arena.backed_ranges() == [(0, WINDOW)] and arena.placeholder_bytes == WINDOW - 6 * MiB
    assert mappings(0, WINDOW) == [(0, WINDOW, "chunk")], "part of the cover was left unmapped"
    assert (byte_at(0), byte_at(6 * MiB - 1)) == (2, 2)
    assert byte_at(6 * MiB) == 101 and byte_at(32 * MiB) == 100, "placeholder granules and slots re-aliased"
    apply(arena, chunks, 0, [], [second])
    assert arena.committed_ranges() == [] and arena.placeholder_bytes == WINDOW
    assert mappings(0, WINDOW) == [(0, WINDOW, "chunk")] and byte_at(0) == 101
    assert daemon.unmapped_reports() == [[1], [2]]


def test_chunks_over_committed_memory_still_mapped_are_refused(setup: tuple[Arena, FakeChannel, Chunks]) -> None:
    arena, daemon, chunks = setup
    first = chunks.make(1, 0, 4 * MiB)
    apply(arena, chunks, 4 * MiB, [first], [])
    stray = chunks.make(2, 2 * MiB, 4 * MiB)
    with pytest.raises(MappingError, match="over committed memory this process still maps"):
        apply(arena, chunks, 6 * MiB, [stray], [])
    assert mappings(0, 6 * MiB) == [(0, 4 * MiB, "chunk"), (4 * MiB, 6 * MiB, "none")]
    assert byte_at(2 * MiB) == 1, "the mapped chunk was replaced"
    assert arena.committed_ranges() == [(0, 4 * MiB)]
    assert daemon.unmapped_reports() == [[2]], "the refused chunk is not held here: the daemon must hear so"


def test_an_answer_mapped_after_a_release_maps_nothing(setup: tuple[Arena, FakeChannel, Chunks]) -> None:
    """A grow's or a round's answer that the engine's thread applies after close()
    released the arena on another: mapped, it would outlive the arena in the slice."""
    arena, daemon, chunks = setup
    slot, granule = chunks.make(100, 0, SLOT), chunks.make(101, 0, G)
    daemon.placeholder_chunks = [slot, granule]
    daemon.placeholder_fds = {100: chunks.fds[100], 101: chunks.fds[101]}
    arena.placeholder(0, WINDOW, SLOT)
    late = chunks.make(1, 0, 4 * MiB)
    reply = p.MapReply(arena=view(4 * MiB), chunks=[late], retired=[], fd_batches=1)
    handed = chunks.handed([late])
    open_fds = len(os.listdir("/proc/self/fd"))
    arena.release()
    assert mappings(0, WINDOW) == [(0, WINDOW, "none")]
    with pytest.raises(SessionClosed, match="released by this process while the daemon answered"):
        arena.apply(reply, handed)
    assert mappings(0, WINDOW) == [(0, WINDOW, "none")], "the late answer was mapped into the released arena"
    arena.restore_placeholder()  # the interrupted call's own clean-up, after close()
    assert mappings(0, WINDOW) == [(0, WINDOW, "none")]
    assert len(os.listdir("/proc/self/fd")) == open_fds - 3, "the placeholder's two and the answer's descriptor are closed"


def test_a_release_waits_for_a_mapping_in_progress_within_the_timeout(setup: tuple[Arena, FakeChannel, Chunks]) -> None:
    """close() releases the arenas while an interrupted call may still map (its placeholder
    put back): the release waits its turn, bounded by the session's timeout, and the
    error of a wait that runs out names the thread that holds the arena."""
    arena, daemon, chunks = setup
    slot, granule = chunks.make(100, 0, SLOT), chunks.make(101, 0, G)
    daemon.placeholder_chunks = [slot, granule]
    daemon.placeholder_fds = {100: chunks.fds[100], 101: chunks.fds[101]}
    arena.placeholder(0, WINDOW, SLOT)
    arena.vacate([(0, SLOT)])
    driver = arena.core.driver
    inside, go_on = threading.Event(), threading.Event()
    map_aliased = driver.map_aliased

    def stuck(address: int, fd: int, size: int, offsets: list[int]) -> None:
        inside.set()
        go_on.wait(30)
        map_aliased(address, fd, size, offsets)

    driver.map_aliased = stuck  # type: ignore[method-assign]
    restorer = threading.Thread(target=arena.restore_placeholder, name="interrupted-call")
    restorer.start()
    try:
        assert inside.wait(10)
        with pytest.raises(MappingError, match=r"thread 'interrupted-call' of this process kept changing its mappings for more than 1s"):
            arena.release()
        assert not any(isinstance(m, p.ReleaseArena) for m in daemon.sent) and arena.placeholder_bytes == WINDOW - SLOT
    finally:
        go_on.set()
        restorer.join(10)
    assert arena.placeholder_bytes == WINDOW
    arena.release()
    assert mappings(0, WINDOW) == [(0, WINDOW, "none")]


def test_a_window_outside_the_daemons_slice_is_refused(setup: tuple[Arena, FakeChannel, Chunks]) -> None:
    arena, _, _ = setup
    arena.reserve_window()  # the test's window is the whole slice
    beyond = p.ArenaView(name="stray", owner="owner", address=BASE + WINDOW - G, reserved=2 * G, committed=0, granularity=G)
    with pytest.raises(MappingError, match=r"outside the address slice of its daemon") as info:
        Arena(arena.core, beyond, owner=False).reserve_window()
    assert f"[{BASE + WINDOW - G:#x}, {BASE + WINDOW + G:#x})" in str(info.value)


class FakeBorrowPool:
    """What a release asks of a borrow pool on the arena: its bytes alive, and close."""

    def __init__(self, pool_id: int, live: int) -> None:
        self.pool_id, self.arena, self.label, self.escaped_scope = pool_id, "kv", "decode", "sampler"
        self.live = live
        self.closed = False

    def live_bytes(self) -> int:
        return self.live

    def close(self) -> None:
        self.closed = True


def test_a_release_leaves_the_cores_registries_and_closes_the_arenas_borrow_pools(setup: tuple[Arena, FakeChannel, Chunks]) -> None:
    arena, daemon, chunks = setup
    core = arena.core
    assert dict(core.arenas) == {"kv": arena}, "a created arena is registered"
    borrowed = FakeBorrowPool(7, live=4096)
    core.add_borrow_pool(borrowed)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"4096 bytes of tensors borrowed from graph pool 7 \('decode', scope 'sampler'\)"):
        arena.release()
    assert dict(core.arenas) == {"kv": arena} and dict(core.borrow_pools) == {7: borrowed} and not borrowed.closed
    assert not any(isinstance(m, p.ReleaseArena) for m in daemon.sent), "a refused release told the daemon nothing"
    borrowed.live = 0
    arena.release()
    assert dict(core.arenas) == {} and dict(core.borrow_pools) == {} and borrowed.closed
    assert [m.name for m in daemon.sent if isinstance(m, p.ReleaseArena)] == ["kv"]


def test_the_cores_registries_are_read_only(setup: tuple[Arena, FakeChannel, Chunks]) -> None:
    arena, _, _ = setup
    with pytest.raises(TypeError):
        arena.core.arenas["other"] = arena  # type: ignore[index]


class FakeStandby:
    """What the core keeps of a standby (gpumem.standby's Reservation): its close."""

    def close(self) -> None:
        raise AssertionError("only the session's close closes a standby")


def test_a_standbys_windows_are_claims_in_the_slice_and_the_core_keeps_the_standby_until_dropped(
    setup: tuple[Arena, FakeChannel, Chunks],
) -> None:
    arena, _, _ = setup
    core = arena.core
    standby = FakeStandby()
    claim = core.claim_standby("g", standby, {"theirs": (BASE + WINDOW - 2 * G, BASE + WINDOW)})
    assert core.standby("g") is standby and core.standby("other") is None
    late = p.ArenaView(name="late", owner="owner", address=BASE + WINDOW - G, reserved=G, committed=0, granularity=G)
    with pytest.raises(VaCollision, match=r"over the window of 'theirs' that this process reserved for retain group 'g'"):
        Arena(core, late, owner=True).reserve_window()
    core.drop_standby(claim)
    assert core.standby("g") is None and core.address_slice().standbys == {}
    Arena(core, late, owner=True).reserve_window()
    core.drop_arena("late")
