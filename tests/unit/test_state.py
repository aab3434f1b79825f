"""DaemonState, one owner at a time: sessions, arena creation, window planning, commit,
decommit and the accounting behind them, on the real host driver."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError
from gpumem_shared.driver.host import HostDriver
from gpumem_shared.protocol import ErrorCode
from gpumemd.config import StateConfig, TenantLimits
from gpumemd.records import ChunkRecord, Outcome, SessionRecord as Session

from .harness import BULK, CAPACITY, DescriptorFreeDriver, G, GiB, Harness, MiB, is_reserved, mapped_ranges, open_fds, planned, the_slice, windows

VALID_NAMES = ["a", "kv", "engine-a", "Qwen2.5:7b@gpu0+draft_1", "x" * 128]
INVALID_NAMES = ["", "-kv", ".hidden", "_x", "kv cache", "kv/0", "x" * 129, "kv\n", "\nkv", "kv\x00", "ké"]


# --------------------------------------------------------------------------- sessions


def test_open_session_registers_the_client_and_describes_the_device(h: Harness) -> None:
    h.wall_clock.now = 1_700_000_123.5
    session, reply = h.state.open_session(p.Hello(name="engine-a", client_version="9.9"), pid=321, uid=1001, gid=1002)
    assert h.state.sessions == {session.id: session}
    assert (session.name, session.pid, session.uid, session.gid, session.since) == ("engine-a", 321, 1001, 1002, 1_700_000_123.5)
    assert reply.session_id == session.id and reply.token == session.token and len(reply.token) == 16
    assert reply.protocol == list(p.PROTOCOL_VERSION)
    assert reply.backend == "host" and reply.daemon_pid == os.getpid()
    assert reply.device.total_bytes == CAPACITY
    assert reply.device.granularity == G
    assert reply.device.uuid.startswith("HOST-")


def test_sessions_get_distinct_ids_and_tokens(h: Harness) -> None:
    a, b, c = h.connect("engine-a"), h.connect("engine-a2"), h.connect("engine-b")
    assert len({a.id, b.id, c.id}) == 3
    assert len({a.token, b.token, c.token}) == 3
    h.state.close_session(b.id)
    d = h.connect("engine-c")
    assert d.id not in {a.id, b.id, c.id}, "a closed session's id is never reused"


def test_hello_with_a_name_a_live_session_holds_is_refused_naming_the_holder(h: Harness) -> None:
    b = h.connect("engine-b")
    with pytest.raises(p.ProtocolError) as info:
        h.state.open_session(p.Hello(name="engine-b"), pid=7777, uid=2000, gid=2000)
    assert info.value.code is ErrorCode.ALREADY_EXISTS
    assert f"session {b.id}, pid {b.pid}, uid 1000" in info.value.message
    assert info.value.detail == {"holder_pid": b.pid, "holder_session": b.id}
    assert list(h.state.sessions.values()) == [b]
    h.state.close_session(b.id)
    assert h.connect("engine-b", uid=2000).name == "engine-b", "a name is free again once its session ended"


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_open_session_refuses_invalid_client_names(h: Harness, name: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        h.state.open_session(p.Hello(name=name), pid=1, uid=0, gid=0)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert h.state.sessions == {}


def test_close_session_of_unknown_id_is_harmless(h: Harness) -> None:
    s = h.connect("engine-a")
    h.create(s, "kv")
    assert h.state.close_session(s.id + 100) == []
    assert list(h.state.sessions) == [s.id] and list(h.state.arenas.by_name) == ["kv"]
    h.state.close_session(s.id)
    assert h.state.close_session(s.id) == []  # twice: EOF seen after an explicit close


# --------------------------------------------------------------------------- create


def test_create_reserves_a_window_and_no_memory(h: Harness) -> None:
    s = h.connect("engine-a")
    fds = open_fds()
    view = h.create(s, "kv", 64 * GiB)
    assert view == p.ArenaView(
        name="kv", owner="engine-a", address=h.config.va_base, reserved=64 * GiB, committed=0, granularity=G
    )
    assert is_reserved(view.address, 64 * GiB), "the window lies in the slice the daemon reserved"
    assert windows(h) == [the_slice(h)], "nothing is reserved per arena"
    arena = h.state.arenas.by_name["kv"]
    assert (arena.owner_id, arena.attached, arena.chunks) == (s.id, {s.id}, [])
    assert h.state.arenas.accounted_bytes() == 0
    assert open_fds() == fds


@pytest.mark.parametrize("name", VALID_NAMES)
def test_create_accepts_valid_names(h: Harness, name: str) -> None:
    assert h.create(h.connect("engine-a"), name).name == name


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_create_refuses_invalid_names(h: Harness, name: str) -> None:
    error = h.refused(h.connect("engine-a"), p.CreateArena(name=name, reserve_bytes=GiB), ErrorCode.INVALID_ARGUMENT)
    assert "arena name" in error.message
    assert h.state.arenas.by_name == {}
    assert windows(h) == [the_slice(h)] and planned(h) == []


def test_create_refuses_zero_and_negative_reservations(h: Harness) -> None:
    s = h.connect("engine-a")
    for bad in (0, -G):
        error = h.refused(s, p.CreateArena(name="kv", reserve_bytes=bad), ErrorCode.INVALID_ARGUMENT)
        assert error.detail == {"reserve_bytes": bad}
    assert h.state.arenas.by_name == {}


def test_create_refuses_unaligned_reservation_and_suggests_neighbours(h: Harness) -> None:
    error = h.refused(h.connect("engine-a"), p.CreateArena(name="kv", reserve_bytes=3 * MiB), ErrorCode.INVALID_ARGUMENT)
    assert error.detail == {"reserve_bytes": 3 * MiB, "granularity": G}
    assert f"{2 * MiB} or {4 * MiB}" in error.message
    assert h.state.arenas.by_name == {}


def test_create_refuses_reservation_above_the_limit(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(max_reserve=4 * GiB)
    s = h.connect("engine-a")
    error = h.refused(s, p.CreateArena(name="kv", reserve_bytes=4 * GiB + G), ErrorCode.INVALID_ARGUMENT)
    assert error.detail == {"requested": 4 * GiB + G, "limit": 4 * GiB}
    assert h.state.arenas.by_name == {}
    assert h.create(s, "kv", 4 * GiB).reserved == 4 * GiB  # the limit itself is allowed


def test_duplicate_arena_name_is_already_exists_naming_the_owner(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    first = h.create(a, "kv", GiB)
    for who in (b, a):
        error = h.refused(who, p.CreateArena(name="kv", reserve_bytes=2 * GiB), ErrorCode.ALREADY_EXISTS)
        assert f"client 'engine-a' (pid {a.pid})" in error.message
    arena = h.state.arenas.by_name["kv"]
    assert (arena.owner_id, arena.reserved, arena.address) == (a.id, GiB, first.address)
    assert len(planned(h)) == 1 and windows(h) == [the_slice(h)], "the refused request planned and reserved nothing"


# --------------------------------------------------------------------------- window planning


def assert_guarded(ranges: list[tuple[int, int]]) -> None:
    ranges = sorted(ranges)
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert start >= end + GiB, f"windows too close: {end:#x} .. {start:#x}"


def test_the_daemon_reserves_its_slice_once_and_gives_it_back_at_exit(h: Harness) -> None:
    assert windows(h) == [the_slice(h)]
    s = h.connect("engine-a")
    views = [h.create(s, f"a{i}", size) for i, size in enumerate([GiB, 64 * GiB, 2 * MiB])]
    h.commit(s, "a0", 8 * MiB)
    h.release(s, "a1")
    assert windows(h) == [the_slice(h)], "an arena reserves, maps or frees nothing of its own in the daemon"
    assert all(h.config.va_base <= v.address and v.address + v.reserved <= h.config.va_limit for v in views)
    h.state.drop_all()
    assert windows(h) == []
    h.state.drop_all()  # twice: the server's exit after a test's own


def test_a_slice_taken_at_start_is_refused_in_one_line(make_harness: Callable[..., Harness]) -> None:
    from gpumemd.window_plan import SliceUnavailable
    from gpumemd.state import DaemonState

    config = StateConfig(index=0, va_base=StateConfig.va_base, va_limit=StateConfig.va_base + 64 * GiB)
    squatter = HostDriver(index=0)
    taken = config.va_base + 40 * GiB
    assert squatter.reserve(G, taken) == taken
    fds = open_fds()
    huge = [(start, end) for start, end in mapped_ranges(0, 1 << 47) if end - start >= 64 * GiB]
    try:
        with pytest.raises(SliceUnavailable) as info:
            DaemonState(HostDriver(index=0, capacity=CAPACITY), config)
        message = str(info.value)
        assert "\n" not in message
        assert f"device 0's address slice [{config.va_base:#x}, {config.va_limit:#x}) (64 GiB)" in message
        assert "at its planned address: the driver placed it at 0x" in message
        assert mapped_ranges(config.va_base, config.va_limit) == [(taken, taken + G)]
        assert [(a, b) for a, b in mapped_ranges(0, 1 << 47) if b - a >= 64 * GiB] == huge, "the misplaced slice was kept"
        assert open_fds() == fds
    finally:
        squatter.free_reservation(taken, G)


def test_windows_never_overlap_and_keep_a_guard_between(h: Harness) -> None:
    s = h.connect("engine-a")
    sizes = [GiB, 4 * MiB, 3 * GiB, 2 * MiB, 10 * GiB + 6 * MiB]
    views = [h.create(s, f"a{i}", size) for i, size in enumerate(sizes)]
    assert min(v.address for v in views) == h.config.va_base
    assert_guarded([(v.address, v.address + v.reserved) for v in views])  # as clients see them
    assert_guarded(planned(h))  # as the daemon planned them, placeholder scratch included
    for v in views:
        assert v.address % GiB == 0
        assert is_reserved(v.address, v.reserved)


def test_a_hole_is_used_only_with_a_guard_before_the_next_window(h: Harness) -> None:
    s = h.connect("engine-a")
    h.create(s, "a", GiB)
    b = h.create(s, "b", GiB)
    h.release(s, "a")
    c = h.create(s, "c", 2 * GiB)  # as large as the hole a left, guard included
    assert c.address != h.config.va_base, "placed flush against b"
    assert_guarded([(v.address, v.address + v.reserved) for v in (b, c)])
    assert_guarded(planned(h))


def test_freed_window_is_reused(h: Harness) -> None:
    s = h.connect("engine-a")
    first, second = h.create(s, "a", GiB), h.create(s, "b", GiB)
    h.release(s, "a")
    assert [start for start, _ in planned(h)] == [second.address], "release let go of the window"
    assert h.create(s, "c", GiB).address == first.address


def test_planning_range_exhausted_is_out_of_memory(make_harness: Callable[..., Harness]) -> None:
    # The whole plan to one tenant: the plan's own limit, not a tenant's share (test_tenants).
    h = make_harness(va_limit=StateConfig.va_base + 16 * GiB, tenants=TenantLimits(address_share=1.0))
    s = h.connect("engine-a")
    created = []
    for i in range(16):
        try:
            created.append(h.create(s, f"a{i}", GiB))
        except p.ProtocolError as exc:
            assert exc.code is ErrorCode.OUT_OF_MEMORY
            assert exc.detail["requested"] >= GiB
            assert "plan range" in exc.message
            break
    else:
        pytest.fail("16 GiB of plan range held 16 arenas of 1 GiB and their guards")
    assert len(created) >= 2
    assert sorted(h.state.arenas.by_name) == sorted(v.name for v in created)
    assert len(planned(h)) == len(created) and windows(h) == [the_slice(h)], "the refused request planned nothing"
    assert max(end for _, end in planned(h)) <= h.config.va_limit
    h.release(s, created[0].name)
    assert h.create(s, "again", GiB).address == created[0].address == h.config.va_base


# --------------------------------------------------------------------------- commit


def chunk_layout(outcome_or_views: Any) -> list[tuple[int, int]]:
    """(offset, size) of the chunks a reply hands out, or of a list of ChunkViews."""
    views = outcome_or_views.reply.chunks if isinstance(outcome_or_views, Outcome) else outcome_or_views
    return [(c.offset, c.size) for c in views]


def test_commit_creates_memfd_chunks_in_a_bulk_and_ladder_plan(h: Harness) -> None:
    s = h.connect("engine-a")
    view = h.create(s, "kv", GiB)
    fds = open_fds()
    out = h.commit(s, "kv", 2 * BULK + 6 * MiB)
    assert chunk_layout(out) == [(0, BULK), (BULK, BULK), (2 * BULK, 4 * MiB), (2 * BULK + 4 * MiB, 2 * MiB)]
    assert out.reply.arena.committed == 2 * BULK + 6 * MiB
    assert out.reply.retired == [] and out.reply.fd_batches == 1
    assert out.notices == []
    assert [c.id for c in out.handout] == [c.id for c in out.reply.chunks]
    for chunk in out.handout:
        assert chunk.address == view.address + chunk.offset
        assert chunk.holders == {s.id}
        assert os.fstat(chunk.handle).st_size == chunk.size
        assert os.readlink(f"/proc/self/fd/{chunk.handle}").startswith("/memfd:gpumemd-chunk")
    assert open_fds() == fds + 4
    assert h.state.arenas.accounted_bytes() == 2 * BULK + 6 * MiB
    assert h.state.arenas.free_bytes() == CAPACITY - (2 * BULK + 6 * MiB)


def test_large_handouts_are_split_into_fd_batches(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(capacity=GiB, bulk_chunk=G)  # one chunk per granule
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv")
    out = h.commit(a, "kv", (p.MAX_FDS_PER_MESSAGE + 1) * G)
    assert len(out.handout) == p.MAX_FDS_PER_MESSAGE + 1
    assert out.reply.fd_batches == 2
    h.share(a, "kv", "engine-b")
    assert h.attach(b, "kv").reply.fd_batches == 2
    assert h.commit(a, "kv", (p.MAX_FDS_PER_MESSAGE + 2) * G).reply.fd_batches == 1


def test_commit_grows_from_the_committed_end(h: Harness) -> None:
    s = h.connect("engine-a")
    h.create(s, "kv")
    first = h.commit(s, "kv", 6 * MiB)
    second = h.commit(s, "kv", 24 * MiB)
    assert chunk_layout(second) == [(6 * MiB, BULK), (6 * MiB + BULK, 2 * MiB)]
    assert {c.id for c in second.handout}.isdisjoint(c.id for c in first.handout)
    assert h.state.arenas.by_name["kv"].committed == 24 * MiB
    assert h.state.arenas.accounted_bytes() == 24 * MiB


def test_commit_to_the_committed_size_is_a_no_op(h: Harness) -> None:
    s, sharer = h.connect("engine-a"), h.connect("engine-b")
    h.create(s, "kv")
    h.commit(s, "kv", 8 * MiB)
    h.share(s, "kv", "engine-b")
    h.attach(sharer, "kv")
    fds, chunks = open_fds(), list(h.state.arenas.by_name["kv"].chunks)
    again = h.commit(s, "kv", 8 * MiB)
    assert again.handout == [] and again.reply.chunks == [] and again.reply.fd_batches == 0
    assert again.notices == [], "nothing grew: the sharer is not told"
    assert again.reply.arena.committed == 8 * MiB
    assert h.state.arenas.by_name["kv"].chunks == chunks
    assert open_fds() == fds and h.state.arenas.accounted_bytes() == 8 * MiB


@pytest.mark.parametrize(
    ("nbytes", "detail"),
    [
        (0, {"nbytes": 0}),
        (-G, {"nbytes": -G}),
        (G + 4096, {"nbytes": G + 4096, "granularity": G}),
        (GiB + G, {"requested": GiB + G, "reserved": GiB}),
    ],
    ids=["zero", "negative", "unaligned", "beyond-reservation"],
)
def test_commit_refuses_bad_sizes(h: Harness, nbytes: int, detail: dict) -> None:
    s = h.connect("engine-a")
    h.create(s, "kv", GiB)
    h.commit(s, "kv", 4 * MiB)
    error = h.refused(s, p.CommitArena(name="kv", nbytes=nbytes), ErrorCode.INVALID_ARGUMENT)
    assert error.detail == detail
    assert h.state.arenas.by_name["kv"].committed == 4 * MiB


def test_commit_never_shrinks(h: Harness) -> None:
    s = h.connect("engine-a")
    h.create(s, "kv")
    h.commit(s, "kv", 8 * MiB)
    error = h.refused(s, p.CommitArena(name="kv", nbytes=4 * MiB), ErrorCode.INVALID_ARGUMENT)
    assert error.detail == {"requested": 4 * MiB, "committed": 8 * MiB}
    assert "decommit" in error.message
    assert h.state.arenas.by_name["kv"].committed == 8 * MiB


def test_commit_beyond_free_memory_commits_nothing(h: Harness) -> None:
    s = h.connect("engine-a")
    h.create(s, "kv", GiB)
    h.commit(s, "kv", 100 * MiB)
    fds, chunks = open_fds(), list(h.state.arenas.by_name["kv"].chunks)
    error = h.refused(s, p.CommitArena(name="kv", nbytes=300 * MiB), ErrorCode.OUT_OF_MEMORY)
    assert error.detail == {"requested": 200 * MiB, "available": CAPACITY - 100 * MiB}
    assert h.state.arenas.by_name["kv"].chunks == chunks
    assert h.state.arenas.accounted_bytes() == 100 * MiB
    assert open_fds() == fds
    # exactly what is left still fits
    h.commit(s, "kv", CAPACITY)
    assert h.state.arenas.free_bytes() == 0 and h.state.arenas.available_bytes() == 0


def test_reserve_is_kept_free(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(reserve_bytes=32 * MiB)
    s = h.connect("engine-a")
    h.create(s, "kv", GiB)
    assert h.state.arenas.available_bytes() == CAPACITY - 32 * MiB
    error = h.refused(s, p.CommitArena(name="kv", nbytes=CAPACITY - 30 * MiB), ErrorCode.OUT_OF_MEMORY)
    assert error.detail == {"requested": CAPACITY - 30 * MiB, "available": CAPACITY - 32 * MiB}
    assert f"the {32 * MiB}-byte reserve" in error.message
    h.commit(s, "kv", CAPACITY - 32 * MiB)
    assert h.state.arenas.free_bytes() == 32 * MiB and h.state.arenas.available_bytes() == 0


def test_commit_is_shared_across_arenas_against_one_capacity(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv-a", GiB)
    h.create(b, "kv-b", GiB)
    h.commit(a, "kv-a", 200 * MiB)
    error = h.refused(b, p.CommitArena(name="kv-b", nbytes=64 * MiB), ErrorCode.OUT_OF_MEMORY)
    assert error.detail["available"] == 56 * MiB
    h.commit(b, "kv-b", 56 * MiB)
    assert h.state.arenas.accounted_bytes() == CAPACITY


class FailingDriver(HostDriver):
    """The real host driver, except that creating chunks fails as told."""

    def __init__(self, out_of_memory: bool) -> None:
        super().__init__(index=0, capacity=CAPACITY)
        self.out_of_memory = out_of_memory
        self.fail = False

    def create_chunks(self, placements: list[tuple[int, int]]) -> list[int]:
        if self.fail:
            raise DriverError("injected failure", out_of_memory=self.out_of_memory)
        return super().create_chunks(placements)


@pytest.mark.parametrize(("out_of_memory", "code"), [(True, ErrorCode.OUT_OF_MEMORY), (False, ErrorCode.DRIVER_ERROR)])
def test_driver_failure_during_commit_commits_nothing(
    make_harness: Callable[..., Harness], out_of_memory: bool, code: ErrorCode
) -> None:
    driver = FailingDriver(out_of_memory)
    h = make_harness(driver=driver)
    s = h.connect("engine-a")
    h.create(s, "kv")
    h.commit(s, "kv", 4 * MiB)
    driver.fail = True
    error = h.refused(s, p.CommitArena(name="kv", nbytes=40 * MiB), code)
    assert error.detail == {"requested": 36 * MiB, "available": CAPACITY - 4 * MiB}
    assert "injected failure" in error.message
    assert h.state.arenas.by_name["kv"].committed == 4 * MiB and h.state.arenas.accounted_bytes() == 4 * MiB
    driver.fail = False
    assert h.commit(s, "kv", 40 * MiB).reply.arena.committed == 40 * MiB


# --------------------------------------------------------------------------- decommit


def committed_38(h: Harness) -> tuple[Session, list[int]]:
    """An arena 'kv' of chunks [0,16) [16,32) [32,36) [36,38) MiB; returns (session, ids)."""
    s = h.connect("engine-a")
    h.create(s, "kv")
    out = h.commit(s, "kv", 2 * BULK + 6 * MiB)
    return s, [c.id for c in out.handout]


@pytest.mark.parametrize(
    ("to", "kept"),
    [(38 * MiB, 38), (34 * MiB, 36), (32 * MiB, 32), (18 * MiB, 32), (16 * MiB, 16), (2 * MiB, 16), (0, 0)],
)
def test_decommit_keeps_the_smallest_chunk_boundary_at_or_above_the_target(h: Harness, to: int, kept: int) -> None:
    s, _ = committed_38(h)
    out = h.decommit(s, "kv", to)
    assert out.reply.arena.committed == kept * MiB
    assert h.state.arenas.by_name["kv"].committed == kept * MiB
    assert sum(c.size for c in out.reply.retired) == (38 - kept) * MiB
    assert out.handout == [] and out.reply.chunks == [] and out.reply.fd_batches == 0


def test_decommitted_chunks_stay_accounted_until_unmapped(h: Harness) -> None:
    s, ids = committed_38(h)
    fds = open_fds()
    out = h.decommit(s, "kv", 18 * MiB)
    assert [c.id for c in out.reply.retired] == ids[2:]
    assert chunk_layout(out.reply.retired) == [(32 * MiB, 4 * MiB), (36 * MiB, 2 * MiB)]
    assert out.notices == [], "the owner learns from the reply, not from a notice"
    assert open_fds() == fds - 2, "the daemon closed its memfds at once"
    assert h.state.arenas.accounted_bytes() == 38 * MiB, "the client still maps them"
    assert sorted(h.state.arenas.retiring) == ids[2:]
    assert h.state.status().arenas[0].retiring_bytes == 6 * MiB
    # until reported, every sync lists them again
    assert [c.id for c in h.sync(s, "kv").reply.retired] == ids[2:]
    h.unmapped(s, "kv", ids[2:])
    assert h.state.arenas.accounted_bytes() == 32 * MiB
    assert h.state.arenas.retiring == {}
    assert h.sync(s, "kv").reply.retired == []
    assert open_fds() == fds - 2


def test_retiring_bytes_count_against_free_memory(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(capacity=64 * MiB)
    s = h.connect("engine-a")
    h.create(s, "kv")
    ids = [c.id for c in h.commit(s, "kv", 48 * MiB).handout]
    h.decommit(s, "kv", 0)
    error = h.refused(s, p.CommitArena(name="kv", nbytes=32 * MiB), ErrorCode.OUT_OF_MEMORY)
    assert error.detail == {"requested": 32 * MiB, "available": 16 * MiB}
    h.unmapped(s, "kv", ids)
    regrown = h.commit(s, "kv", 32 * MiB)
    assert chunk_layout(regrown) == [(0, 16 * MiB), (16 * MiB, 16 * MiB)]
    assert {c.id for c in regrown.handout}.isdisjoint(ids), "chunk ids are never reused"


def test_decommit_to_the_committed_size_retires_nothing(h: Harness) -> None:
    s, _ = committed_38(h)
    fds = open_fds()
    out = h.decommit(s, "kv", 38 * MiB)
    assert out.reply.retired == [] and h.state.arenas.retiring == {}
    assert open_fds() == fds


@pytest.mark.parametrize(
    ("to", "detail"),
    [
        (-G, {"to_nbytes": -G}),
        (MiB, {"to_nbytes": MiB, "granularity": G}),
        (40 * MiB, {"requested": 40 * MiB, "committed": 38 * MiB}),
    ],
    ids=["negative", "unaligned", "above-committed"],
)
def test_decommit_refuses_bad_targets(h: Harness, to: int, detail: dict) -> None:
    s, _ = committed_38(h)
    error = h.refused(s, p.DecommitArena(name="kv", to_nbytes=to), ErrorCode.INVALID_ARGUMENT)
    assert error.detail == detail
    assert h.state.arenas.by_name["kv"].committed == 38 * MiB and h.state.arenas.retiring == {}


def test_chunks_unmapped_is_all_or_nothing(h: Harness) -> None:
    s, ids = committed_38(h)
    h.decommit(s, "kv", 0)
    error = h.refused(s, p.ChunksUnmapped(name="kv", chunk_ids=[ids[0], 999]), ErrorCode.NOT_FOUND)
    assert "chunk 999" in error.message
    assert sorted(h.state.arenas.retiring) == ids and h.state.arenas.accounted_bytes() == 38 * MiB
    h.unmapped(s, "kv", ids)
    assert h.state.arenas.accounted_bytes() == 0
    # reporting the same chunks again is refused: the session no longer maps them
    h.refused(s, p.ChunksUnmapped(name="kv", chunk_ids=ids[:1]), ErrorCode.NOT_FOUND)


def test_unmapping_a_live_chunk_makes_sync_hand_it_out_again(h: Harness) -> None:
    s, ids = committed_38(h)
    h.unmapped(s, "kv", ids[:1])
    assert h.state.arenas.accounted_bytes() == 38 * MiB, "live chunks are the arena's, whoever maps them"
    again = h.sync(s, "kv")
    assert [c.id for c in again.handout] == ids[:1]


def test_decommit_of_a_chunk_nobody_maps_frees_it_at_once(h: Harness) -> None:
    s, ids = committed_38(h)
    h.unmapped(s, "kv", ids[3:])  # the owner unmapped the last chunk [36, 38) MiB itself
    out = h.decommit(s, "kv", 32 * MiB)
    assert [c.id for c in out.reply.retired] == [ids[2]], "only what the owner still maps is to unmap"
    assert sorted(h.state.arenas.retiring) == [ids[2]]
    assert h.state.arenas.accounted_bytes() == 36 * MiB


def test_each_device_plans_in_its_own_address_slice() -> None:
    """A process may map arenas of several daemons (a rank reading a peer GPU's chunks):
    their windows must never overlap, so each device's range is its own."""
    from gpumem_shared.address_plan import VA_PLAN_SLICES, plan_range

    ranges = [plan_range(i) for i in range(VA_PLAN_SLICES)]
    assert ranges[0] == (StateConfig.va_base, StateConfig.va_limit)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:], strict=False))
    assert ranges[-1][1] <= 0x6000_0000_0000, "the top 32 TiB stay for the kernel's top-down mmap area"
    assert all(end - start >= StateConfig.max_reserve for start, end in ranges)


def test_decommit_of_thousands_of_chunks_costs_linear_time(make_harness: Callable[..., Harness]) -> None:
    """The chunks a decommit takes out were removed by a list membership test per chunk:
    quadratic, and seconds of the daemon's one thread for an arena committed in many small
    steps."""
    n = 32_768
    h = make_harness(capacity=1 << 40, driver=DescriptorFreeDriver(index=0, capacity=1 << 40))
    s = h.connect("engine-a")
    h.create(s, "kv", n * G)
    arena = h.state.arenas.by_name["kv"]
    arena.chunks = [ChunkRecord(id=i + 1, arena="kv", offset=i * G, size=G, address=arena.address + i * G, handle=-1) for i in range(n)]
    started = time.process_time()
    reply = h.decommit(s, "kv", G).reply
    took = time.process_time() - started
    assert isinstance(reply, p.MapReply) and reply.arena.committed == G
    assert took < 1.0, f"a decommit of {n} chunks took {took:.1f}s of CPU"
