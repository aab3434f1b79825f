"""nano-vllm's block manager following its KV pool (gpumem.port.blocks over
gpumem.integrations.nanovllm.adapter), without a GPU, nano-vllm or a daemon: the block
manager and sequences are stand-ins with nano-vllm's fields, the pool a scripted one."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from gpumem.errors import DaemonTimeout, GpuMemError, OutOfMemory
from gpumem.port.blocks import BlockFollower, MoveFailed, plan, resize, top
from nanovllm_fakes import Engine, Manager, Seq

def test_live_blocks_past_the_bound_move_to_the_lowest_free_ones_and_every_table_follows() -> None:
    m = Manager(10)
    for i in (0, 5, 7, 8):
        m.take(i)
    m.blocks[7].ref_count, m.blocks[7].hash, m.blocks[7].token_ids = 2, 77, [1, 2, 3, 4]  # a shared prefix block
    m.hash_to_block_id[77] = 7
    a, b = Seq(14, [0, 7, 5, 8]), Seq(6, [7, 8])
    moves = plan(m.used_block_ids, m.free_block_ids, 4)
    assert moves == [(8, 1), (7, 2), (5, 3)]  # highest first, to the lowest free
    engine = Engine(m, running=[a, b])
    engine.relocate_blocks(moves)
    assert a.block_table == [0, 2, 3, 1] and b.block_table == [2, 1]
    assert m.used_block_ids == {0, 1, 2, 3} and top(m.used_block_ids) == 4
    assert sorted(m.free_block_ids) == [4, 5, 6, 7, 8, 9] and len(m.free_block_ids) == 6
    assert (m.blocks[2].ref_count, m.blocks[2].hash, m.blocks[2].token_ids) == (2, 77, [1, 2, 3, 4])
    assert (m.blocks[7].ref_count, m.blocks[7].hash) == (0, -1)
    assert m.hash_to_block_id == {77: 2}
    resize(engine, 4)
    assert len(m.blocks) == 4 and not m.free_block_ids


def test_a_pool_full_of_live_blocks_moves_what_fits_and_keeps_the_rest() -> None:
    m = Manager(6)
    for i in (0, 1, 4, 5):
        m.take(i)
    assert plan(m.used_block_ids, m.free_block_ids, 2) == []  # nothing free below the bound
    assert plan(m.used_block_ids, m.free_block_ids, 3) == [(5, 2)]
    Engine(m, running=[Seq(4, [5])]).relocate_blocks(plan(m.used_block_ids, m.free_block_ids, 3))
    assert top(m.used_block_ids) == 5  # block 4 stays: the pool keeps rows up to it


def test_the_manager_grows_at_the_end_and_never_drops_a_block_in_use() -> None:
    m = Manager(4)
    m.take(1)
    m.hash_to_block_id[9] = 3  # a freed block's stale prefix entry
    engine = Engine(m)
    resize(engine, 6)
    assert [b.block_id for b in m.blocks] == list(range(6)) and list(m.free_block_ids) == [0, 2, 3, 4, 5]
    resize(engine, 2)
    assert list(m.free_block_ids) == [0] and m.hash_to_block_id == {}
    with pytest.raises(GpuMemError, match="block 1 is in use"):
        resize(engine, 1)


class Wait:
    def __init__(self, pool: Pool, tokens: int) -> None:
        self.pool, self.tokens = pool, tokens
        self.answer: int | None = None  # set by the test: the tokens the daemon gives

    def wait(self, timeout: float | None = None) -> int:
        self.pool.calls.append(f"wait {timeout is not None and timeout > 0.01}")
        if self.answer is None:
            raise DaemonTimeout("not yet")
        if self.answer < 0:
            raise OutOfMemory("nothing came free")
        self.pool.tokens = self.answer
        return self.answer


class Pool:
    """KvPool as the follower uses it, answering as the test scripts."""

    def __init__(self, tokens: int, max_tokens: int = 1000) -> None:
        self.name, self.tokens, self.max_tokens = "kv", tokens, max_tokens
        self.unanswered: list[str] = []
        self.rows_in_use: Any = None
        self.bounds: list[int] = []
        self.calls: list[str] = []
        self.waits: list[Wait] = []

    def answer_shrinks(self, move_live: Any, down_to: int | None = None) -> int | None:  # KvPool.answer_shrinks, without a daemon
        if not self.bounds:
            return None
        bound = self.bounds.pop()
        bound = bound if down_to is None else min(bound, down_to)
        used = self.rows_in_use()
        if used > bound:
            used = move_live(bound)
        self.tokens = max(bound, used)
        self.calls.append(f"shrink {self.tokens}")
        return self.tokens

    def send_grow(self, tokens: int, *, in_use: int = -1) -> Wait:
        self.calls.append(f"grow {tokens} {in_use}")
        self.waits.append(Wait(self, tokens))
        return self.waits[-1]

    def report_demand(self, in_use: int) -> None:
        self.calls.append(f"demand {in_use}")


def follower(pool: Pool, manager: Manager, seqs: list[Seq], copied: list[tuple[list[int], list[int]]]) -> BlockFollower:
    """A follower over ``manager``, ``seqs`` the sequences holding its blocks (running)."""
    return BlockFollower(pool, Engine(manager, running=seqs, copy=lambda s, d: copied.append((s, d))), watermark=4, step=8, wait_s=0.2)  # type: ignore[arg-type]


def step(f: BlockFollower, waiting: list[Seq], running: list[Seq]) -> None:
    """``before_step`` with the scheduler holding ``waiting`` and ``running``."""
    f.engine.scheduler.waiting, f.engine.scheduler.running = waiting, running  # type: ignore[attr-defined]
    f.before_step()


def test_a_step_that_neither_grows_nor_shrinks_calls_nothing() -> None:
    pool, m = Pool(32), Manager(32)
    running = [Seq(6, [m.take(0), m.take(1)])]
    f = follower(pool, m, running, [])
    step(f, [], running)
    assert pool.calls == ["demand 2"]  # busy: said once
    pool.calls.clear()
    for _ in range(3):
        running[0].tokens += 1
        step(f, [], running)
    assert pool.calls == []


def test_growth_runs_ahead_without_waiting_and_the_manager_takes_the_blocks_when_they_come() -> None:
    pool, m = Pool(16), Manager(16)
    running = [Seq(38, [m.take(i) for i in range(10)])]  # mid-block: needs none next
    f = follower(pool, m, running, [])
    waiting = [Seq(12)]  # 3 blocks: 3 free after them, under the watermark
    step(f, waiting, running)
    assert pool.calls[:2] == ["demand 13", "grow 24 10"]  # 13 wanted + watermark 4, in steps of 8
    assert all(c == "wait False" for c in pool.calls[2:])  # looked, never waited
    step(f, waiting, running)
    assert sum(c.startswith("grow") for c in pool.calls) == 1  # one on its way
    pool.waits[0].answer = 24
    step(f, waiting, running)
    assert len(m.blocks) == 24 and len(m.free_block_ids) == 14 and f.growing is None
    assert list(m.free_block_ids)[-8:] == list(range(16, 24))


def test_a_step_that_cannot_run_waits_for_the_grow() -> None:
    pool, m = Pool(4), Manager(4)
    f = follower(pool, m, [], [])
    big = [Seq(20)]  # 5 blocks, 4 held: nano-vllm would have nothing to schedule
    with pytest.raises(OutOfMemory, match="holds 4 blocks, 4 free"):
        step(f, big, [])  # never answered: bounded by wait_s
    assert "wait True" in pool.calls
    pool.waits[-1].answer = 16
    step(f, big, [])
    assert len(m.blocks) == 16


def test_a_refused_grow_is_asked_again_only_after_a_pause() -> None:
    pool, m = Pool(8), Manager(8)
    running = [Seq(20, [m.take(i) for i in range(5)])]
    f = follower(pool, m, running, [])
    step(f, [], running)
    pool.waits[0].answer = -1  # OutOfMemory
    step(f, [], running)
    step(f, [], running)
    assert sum(c.startswith("grow") for c in pool.calls) == 1 and f.figures.grows_short == 1


def test_a_shrink_moves_live_blocks_down_copies_them_first_and_drops_the_top() -> None:
    pool, m = Pool(16), Manager(16)
    seqs = [Seq(8, [m.take(14), m.take(15)]), Seq(4, [m.take(2)])]
    copied: list[tuple[list[int], list[int]]] = []
    f = follower(pool, m, seqs, copied)
    pool.bounds.append(8)
    f.idle()
    assert copied == [([15, 14], [0, 1])]
    assert seqs[0].block_table == [1, 0] and seqs[1].block_table == [2]
    assert pool.tokens == 8 and len(m.blocks) == 8 and sorted(m.free_block_ids) == list(range(3, 8))
    assert pool.calls == ["demand 0", "shrink 8"] and f.figures.blocks_moved == 2


def test_asked_below_what_is_live_the_live_blocks_are_packed_under_their_count() -> None:
    """Four live blocks, asked down to 2: they go to 0, 1 and 3 and the pool keeps 4 rows
    (moving only into the free blocks below the bound left block 9 where it was: 10 rows)."""
    pool, m = Pool(16), Manager(16)
    seqs = [Seq(16, [m.take(2), m.take(9), m.take(12), m.take(14)])]
    copied: list[tuple[list[int], list[int]]] = []
    f = follower(pool, m, seqs, copied)
    pool.bounds.append(2)
    f.idle()
    assert copied == [([14, 12, 9], [0, 1, 3])] and seqs[0].block_table == [2, 3, 1, 0]
    assert pool.tokens == 4 and top(m.used_block_ids) == 4 and f.figures.blocks_moved == 3


def test_asked_for_a_few_blocks_the_engine_gives_back_down_to_what_it_needs() -> None:
    """The daemon asks for the neighbour's grow in hand (rows from 56 on); the engine
    gives back down to its use and watermark in grow steps (8): the neighbour's next
    grows then find the memory free, without another ask and another step of this one."""
    pool, m = Pool(64), Manager(64)
    seqs = [Seq(12, [m.take(40), m.take(50), m.take(60)])]
    copied: list[tuple[list[int], list[int]]] = []
    f = follower(pool, m, seqs, copied)
    pool.bounds.append(56)
    f.idle()
    assert copied == [([60, 50, 40], [0, 1, 2])] and seqs[0].block_table == [2, 1, 0]
    assert pool.tokens == 8 and len(m.blocks) == 8


def test_demand_is_said_again_once_it_moved_by_a_grow_step_and_not_for_less() -> None:
    pool, m = Pool(64), Manager(64)
    running = [Seq(6, [m.take(0), m.take(1)])]
    f = follower(pool, m, running, [])
    step(f, [], running)
    assert pool.calls == ["demand 2"]
    waiting = [Seq(12), Seq(8)]  # 5 blocks more: under a step (8) from what was said
    step(f, waiting, running)
    assert [c for c in pool.calls if c.startswith("demand")] == ["demand 2"]
    waiting.append(Seq(16))  # 4 more: 11 from 2
    step(f, waiting, running)
    assert [c for c in pool.calls if c.startswith("demand")] == ["demand 2", "demand 11"]
    step(f, [], running)  # the queue went: back by 9
    assert [c for c in pool.calls if c.startswith("demand")] == ["demand 2", "demand 11", "demand 2"]


def test_a_copy_that_raises_mid_move_gives_nothing_back_and_leaves_the_blocks_where_they_were() -> None:
    """The engine's copy fails during a shrink's move (a CUDA error, say): MoveFailed
    names the pool and the move, the pool gives nothing back (no shrink sent), and the
    block manager and tables are as before (tests/integration/test_nanovllm_follow.py:
    the daemon's books afterwards)."""
    pool, m = Pool(16), Manager(16)
    seqs = [Seq(8, [m.take(14), m.take(15)])]

    def copy(src: list[int], dst: list[int]) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    f = BlockFollower(pool, Engine(m, running=seqs, copy=copy), watermark=4, step=8, wait_s=0.2)  # type: ignore[arg-type]
    pool.bounds.append(8)
    with pytest.raises(MoveFailed, match="KV pool 'kv': the engine's copy of 2 live blocks .* nothing was given back") as err:
        f.idle()
    assert isinstance(err.value.__cause__, RuntimeError)
    assert [c for c in pool.calls if c.startswith("shrink")] == [] and pool.tokens == 16
    assert seqs[0].block_table == [14, 15] and m.used_block_ids == {14, 15} and len(m.blocks) == 16
    assert f.figures.blocks_moved == 0 and f.figures.shrinks == 0


class Port:
    """EnginePort as the patched scheduler calls it: a recorder."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.engine = types.SimpleNamespace(scheduler=None)

    def blocks(self) -> int:
        self.calls.append("blocks")
        return 8

    def __getattr__(self, name: str) -> Any:
        return lambda: self.calls.append(name)


def stand_in_nanovllm(monkeypatch: pytest.MonkeyPatch, **leave_out: str) -> types.ModuleType:
    """nano-vllm's modules as far as ``enable`` patches them; ``leave_out``: a seam
    (class name -> method) the stand-in lacks."""

    class Scheduler:
        def __init__(self, config: Any) -> None:
            self.block_manager = Manager(config.num_kvcache_blocks)
            self.waiting: list[Seq] = []
            self.running: list[Seq] = []

        def schedule(self) -> str:
            return "scheduled"

        def postprocess(self, seqs: Any, token_ids: Any) -> str:
            return "postprocessed"

        def preempt(self, seq: Seq) -> None:
            pass

    class ModelRunner:
        def __init__(self, config: Any, rank: int, event: Any) -> None: ...
        def allocate_kv_cache(self) -> None: ...
        def capture_cudagraph(self) -> None: ...
        def run(self, seqs: Any, is_prefill: bool) -> None: ...
        def exit(self) -> None: ...

    for cls in (Scheduler, ModelRunner):
        if cls.__name__ in leave_out:
            delattr(cls, leave_out[cls.__name__])
    engine = types.ModuleType("nanovllm.engine")
    engine.block_manager = types.SimpleNamespace(Block=object)  # type: ignore[attr-defined]
    engine.llm_engine = types.SimpleNamespace(Scheduler=Scheduler, LLMEngine=type("LLMEngine", (), {}))  # type: ignore[attr-defined]
    engine.model_runner = types.SimpleNamespace(ModelRunner=ModelRunner)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nanovllm", types.ModuleType("nanovllm"))
    monkeypatch.setitem(sys.modules, "nanovllm.engine", engine)
    return engine


def test_the_patched_scheduler_calls_the_port_at_every_step_and_counts_preemptions(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpumem.integrations.nanovllm's wiring, over stand-in nano-vllm modules: the
    scheduler takes the round's blocks and has the port follow once built; schedule()
    runs the port's hooks before and after it, postprocess() after the step, a
    preemption is counted, idle() reaches the port."""
    from gpumem.integrations import nanovllm

    engine = stand_in_nanovllm(monkeypatch)
    nanovllm.enable("engine-a", watermark_blocks=2, grow_step_blocks=8)
    port = Port()
    config = types.SimpleNamespace(gpumem_port=port)
    scheduler = engine.llm_engine.Scheduler(config)  # type: ignore[attr-defined]
    assert config.num_kvcache_blocks == 8 and port.engine.scheduler is scheduler
    assert scheduler.schedule() == "scheduled" and scheduler.postprocess([], []) == "postprocessed"
    scheduler.preempt(Seq(4))
    nanovllm.idle(types.SimpleNamespace(model_runner=types.SimpleNamespace(gpumem_port=port)))
    assert port.calls == ["blocks", "follow", "before_step", "scheduled", "after_step", "preempted", "idle"]


def test_an_engine_version_without_a_seam_is_refused_naming_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from gpumem.integrations import nanovllm
    from gpumem.port import SeamMissing

    stand_in_nanovllm(monkeypatch, Scheduler="postprocess")
    monkeypatch.setattr(importlib.metadata, "version", lambda package: {"nano-vllm-fork": "20990101"}[package])
    with pytest.raises(SeamMissing, match=r"nano-vllm-fork 20990101: .*Scheduler has no postprocess, which gpumem's adapter hooks"):
        nanovllm.enable("engine-a")
