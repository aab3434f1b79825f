"""The engine-facing API against a real gpumemd on the host backend: elastic arenas (growth
on demand up to a cap, trim, usage figures), paged KV caches as block views, the round's
wait handle (other calls go on while it is pending), and leased replays with and without
a contending borrower.

The test process plays torch's part: it calls an arena's allocator slot as torch's
pluggable allocator would, and replays a stand-in graph. ``test_engine_gpu.py`` runs the
same API with torch on CUDA."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpumem
from gpumem.allocator import FAIL_UNBACKED
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import LeaseKind
from gpumemd_testkit import MiB, do

GiB = 1 << 30


@pytest.fixture
def session(daemon_factory: Any, runtime_dir: Path) -> Iterator[gpumem.Session]:
    daemon_factory("host", args=["--host-capacity", "1GiB"])
    with gpumem.connect(0, name="engine-a", runtime_dir=runtime_dir, timeout=10.0) as s:
        yield s


def _other(runtime_dir: Path, name: str = "engine-b") -> gpumem.Session:
    return gpumem.connect(0, name=name, runtime_dir=runtime_dir, timeout=10.0)


# ---------------------------------------------------------------------- elastic arenas


def test_elastic_arena_grows_on_demand_in_steps_up_to_its_cap(session: gpumem.Session) -> None:
    arena = session.create_arena("model", 8 * GiB).set_elastic(step=8 * MiB, cap=64 * MiB)
    slot = arena.allocator().slot
    assert arena.committed == 0

    first = slot.alloc(3 * MiB)
    assert first == arena.address
    assert arena.committed == 8 * MiB  # one step
    arena.write(0, b"weights")  # real memory now
    second = slot.alloc(14 * MiB)
    assert second == arena.address + 3 * MiB
    assert arena.committed == 24 * MiB  # the request's end (17 MiB) rounded up to a step
    usage = arena.usage()
    assert (usage.committed, usage.peak, usage.in_use, usage.free, usage.cap, usage.grows) == (
        24 * MiB, 17 * MiB, 17 * MiB, 7 * MiB, 64 * MiB, 2,
    )

    # Past the cap: refused without a commit, and the reason is kept for the error.
    assert slot.alloc(60 * MiB) == 0
    assert slot.stats().last_fail_reason == FAIL_UNBACKED
    assert arena.committed == 24 * MiB
    assert "cap of 67108864" in (arena.allocator().grow_error or "")

    # Up to the cap exactly is fine.
    assert slot.alloc(47 * MiB) == arena.address + 17 * MiB
    assert arena.committed == 64 * MiB


def test_elastic_growth_the_device_cannot_back_fails_with_the_daemons_figures(session: gpumem.Session) -> None:
    arena = session.create_arena("model", 8 * GiB).set_elastic(step=64 * MiB)
    slot = arena.allocator().slot
    assert slot.alloc(2 * GiB) == 0  # the host daemon has 1 GiB
    assert arena.committed == 0
    error = arena.allocator().grow_error or ""
    assert "committing" in error and "available" in error, error
    assert slot.alloc(32 * MiB) != 0  # what fits still comes
    assert arena.committed == 64 * MiB


def test_trim_gives_back_whole_chunks_above_the_peak_and_growth_comes_back(session: gpumem.Session) -> None:
    arena = session.create_arena("graphs", GiB).set_elastic(step=4 * MiB)
    slot = arena.allocator().slot
    block = slot.alloc(6 * MiB)
    assert arena.committed == 8 * MiB
    arena.commit(64 * MiB)  # more than the allocator used: an up-front guess
    slot.free(block, 6 * MiB)
    usage = arena.usage()
    assert (usage.peak, usage.in_use, usage.free) == (6 * MiB, 0, 58 * MiB)  # freed space is not reused: the peak stays

    assert arena.trim() == 56 * MiB  # down to the chunk boundary at or above the peak (8 MiB)
    assert arena.committed == 8 * MiB
    assert arena.trim() == 0
    assert session.status().arenas[0].committed == 8 * MiB

    assert slot.alloc(4 * MiB) == arena.address + 6 * MiB  # growth picks up where the peak is
    assert arena.committed == 12 * MiB


def test_usage_of_an_arena_that_is_not_elastic(session: gpumem.Session) -> None:
    arena = session.create_arena("fixed", 256 * MiB)
    arena.commit(16 * MiB)
    slot = arena.allocator().slot
    assert slot.alloc(4 * MiB) == arena.address
    assert slot.alloc(32 * MiB) == 0  # unbacked, and nothing grows it
    usage = arena.usage()
    assert (usage.committed, usage.peak, usage.free, usage.cap, usage.grows) == (16 * MiB, 4 * MiB, 12 * MiB, 256 * MiB, 0)


def test_elastic_settings_are_checked(session: gpumem.Session, run_client: Any) -> None:
    arena = session.create_arena("model", 256 * MiB)
    with pytest.raises(gpumem.InvalidArgument, match="multiple of"):
        arena.set_elastic(step=3 * MiB)
    with pytest.raises(gpumem.InvalidArgument, match="within its reservation"):
        arena.set_elastic(cap=512 * MiB)
    owner = run_client("shell", "engine-b")  # another process: a process maps an arena once
    owner.expect("CONNECTED")
    do(owner, f"create theirs {256 * MiB}")
    do(owner, "share theirs engine-a")
    with pytest.raises(gpumem.InvalidArgument, match="only its owner"):
        session.attach_arena("theirs").set_elastic()


def test_a_released_arena_stops_growing(session: gpumem.Session) -> None:
    arena = session.create_arena("model", GiB).set_elastic(step=4 * MiB)
    slot = arena.allocator().slot
    assert slot.alloc(MiB)
    arena.release()
    assert slot.index == -1  # no torch pool used it: the slot is free for another arena


# ---------------------------------------------------------------------- paged KV


def test_paged_kv_cache_gives_block_views_before_the_round_and_blocks_after(session: gpumem.Session) -> None:
    cache = session.declare_paged_kv("kv", layers=2, block_shape=(16, 2, 8), itemsize=2, max_blocks=256)
    block = 16 * 2 * 8 * 2
    assert (cache.max_blocks, cache.blocks, cache.block_bytes) == (256, 0, 4 * block)
    views = [cache.views(layer) for layer in range(2)]
    assert [len(v) for v in views] == [2, 2]
    assert all(view.nbytes == 256 * block for pair in views for view in pair)
    # The placeholder is under every block: a captured copy may write there already.
    k0 = np.asarray(views[0][0]).view(np.float16).reshape(256, 16, 2, 8)
    k0[255] = 1.0

    blocks = cache.capture_done(max_blocks=100)
    assert blocks == cache.blocks == 100
    k0[:blocks] = np.arange(blocks, dtype=np.float16)[:, None, None, None]
    assert k0[7, 15, 1, 7] == 7.0  # real memory: it holds what was written
    with pytest.raises(gpumem.InvalidArgument, match="layers 0..1"):
        cache.views(2)


def test_combined_paged_kv_cache_has_one_buffer_per_layer(session: gpumem.Session) -> None:
    cache = session.declare_paged_kv("kv", layers=3, block_shape=(8, 64), itemsize=2, combined=True, max_blocks=32)
    assert sorted(cache.pool.buffers) == ["kv0", "kv1", "kv2"]
    assert [len(cache.views(layer)) for layer in range(3)] == [1, 1, 1]
    assert cache.views(0)[0].nbytes == 32 * 2 * 8 * 64 * 2


def test_max_blocks_defaults_to_what_the_device_could_hold(session: gpumem.Session) -> None:
    cache = session.declare_paged_kv("kv", layers=4, block_shape=(256, 8, 128), itemsize=2)
    assert cache.max_blocks == session.device.total_bytes // (2 * 4 * 256 * 8 * 128 * 2)


# ---------------------------------------------------------------------- the round's wait handle


def test_capture_done_without_waiting_lets_the_session_work_while_the_round_gathers(
    session: gpumem.Session, runtime_dir: Path
) -> None:
    a = session.declare_paged_kv("kv-a", layers=1, block_shape=(1024,), itemsize=2, max_blocks=4096, expect=2)
    pending = a.send_capture_done(max_blocks=2048)
    assert not pending.done

    # Engine A goes on starting up: requests that hand out descriptors come back meanwhile.
    model = session.create_arena("model", 256 * MiB)
    model.commit(32 * MiB)
    model.write(0, b"loaded")
    assert model.read(0, 6) == b"loaded"
    with pytest.raises(gpumem.DaemonTimeout, match="CaptureDone"):
        pending.wait(timeout=0.3)  # the round still waits for engine B

    with _other(runtime_dir) as other:
        b = other.declare_paged_kv("kv-b", layers=1, block_shape=(1024,), itemsize=2, max_blocks=4096, expect=2)
        other_pending = b.send_capture_done(max_blocks=1024)
        assert pending.wait() == 2048 and pending.done
        assert pending.wait() == 2048  # answered once, kept
        assert other_pending.wait() == 1024
        assert a.pool.round_id == b.pool.round_id
    view = np.asarray(a.views(0)[0]).view(np.uint16)
    view[: 2048 * 1024] = 7
    assert int(view[2048 * 1024 - 1]) == 7


# ---------------------------------------------------------------------- leased replay


class _Graph:
    """Stands in for a torch.cuda.CUDAGraph: replay() and whatever else an engine reads."""

    def __init__(self, holder: Any) -> None:
        self.holder = holder
        self.replays = 0
        self.seen: list[int] = []

    def replay(self) -> None:
        self.replays += 1
        self.seen.append(self.holder())

    def pool(self) -> tuple[int, int]:
        return (1, 2)


def _shared_pool(session: gpumem.Session) -> tuple[gpumem.Arena, gpumem.GraphPool]:
    arena = session.create_arena("graphs", GiB)
    arena.commit(16 * MiB)
    pool = arena.register_graph_pool(
        "decode", extents=[p.Extent(offset=0, size=8 * MiB)], free_runs=[p.Extent(offset=0, size=8 * MiB)], shared=True
    )
    arena.share("engine-b")
    return arena, pool


def test_leased_graph_replays_under_the_replay_lease(session: gpumem.Session) -> None:
    _, pool = _shared_pool(session)
    graph = _Graph(lambda: pool.segment.holder().kind if pool.segment.holder() else -1)
    leased = gpumem.leased_graphs({8: graph, 16: _Graph(lambda: 0)}, session, pool)
    leased[8].replay()
    leased[8].replay()
    assert graph.replays == 2
    assert graph.seen == [int(LeaseKind.REPLAY)] * 2  # held while replay() ran
    assert pool.segment.holder() is None  # and given back after
    assert leased[8].pool() == (1, 2)  # the rest is the graph's own
    assert isinstance(leased[16], gpumem.LeasedGraph)


def test_leased_replay_waits_for_a_borrower_then_names_it(session: gpumem.Session, run_client: Any) -> None:
    _, pool = _shared_pool(session)
    graph = _Graph(lambda: 0)
    other = run_client("shell", "engine-b")  # another process: a process maps an arena once
    other.expect("CONNECTED")
    do(other, "attach graphs")
    do(other, f"open {pool.id}")
    do(other, f"lease borrow {pool.id} 0 sampler")
    started = time.monotonic()
    with pytest.raises(gpumem.LeaseConflict, match="engine-b") as refused:
        gpumem.LeasedGraph(graph, session, pool, wait=0.2).replay()
    assert time.monotonic() - started >= 0.2
    assert "sampler" in str(refused.value)
    assert graph.replays == 0

    releaser = threading.Timer(0.2, do, (other, f"unlease {pool.id}"))
    releaser.start()
    try:
        started = time.monotonic()
        gpumem.LeasedGraph(graph, session, pool, wait=5.0).replay()
        waited = time.monotonic() - started
    finally:
        releaser.join()
    assert graph.replays == 1
    assert 0.1 <= waited < 5.0


# ---------------------------------------------------------------------- EngineMemory


def test_engine_memory_without_torch_declares_commits_and_borrows(daemon_factory: Any, runtime_dir: Path) -> None:
    daemon_factory("host", args=["--host-capacity", "1GiB"])
    with gpumem.EngineMemory("engine-a", 0, runtime_dir=str(runtime_dir), model_reserve=GiB, graph_reserve=GiB) as mem:
        assert (mem.model.usage().cap, mem.graphs.usage().cap) == (GiB, GiB)
        assert mem.model.allocator().slot.alloc(5 * MiB)  # elastic from the start
        assert mem.model.committed == 256 * MiB
        with pytest.raises(gpumem.InvalidArgument, match="no KV cache"):
            mem.kv_commit()
        kv = mem.kv_cache(layers=2, block_shape=(16, 64), itemsize=2, max_blocks=512)
        with pytest.raises(gpumem.InvalidArgument, match="already"):
            mem.kv_cache(layers=2, block_shape=(16, 64), itemsize=2)
        assert mem.borrowed(lambda x: x + 1, 41) == 42  # no graph pool yet: a plain call
        pending = mem.start_kv_commit(max_blocks=300)
        assert pending.wait() == kv.blocks == 300

        mem.graphs.allocator().slot.alloc(8 * MiB)
        mem.graph_pool = mem.graphs.register_graph_pool(
            "decode", extents=[p.Extent(offset=0, size=32 * MiB)], free_runs=[p.Extent(offset=8 * MiB, size=24 * MiB)]
        )
        seen: list[int] = []

        def step(x: int) -> int:
            seen.append(mem.graph_pool.segment.holder().kind if mem.graph_pool and mem.graph_pool.segment.holder() else -1)
            return x * 2

        assert mem.borrowed(step, 21, need_bytes=MiB) == 42
        assert seen == [int(LeaseKind.BORROW)]  # ran under the borrow lease
        assert mem.borrowed(step, 1, need_bytes=64 * MiB) == 2  # no run holds it: a plain call
        assert seen[-1] == -1
