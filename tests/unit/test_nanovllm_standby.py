"""A nano-vllm standby's settling and take-over (gpumem.port.takeover over
gpumem.integrations.nanovllm.adapter), without nano-vllm, torch or a daemon: the engine
is nano-vllm's scheduler and block manager in miniature (allocate with its chained hashes
and hit check, may_append, deallocate; a step appends a token per sequence), the engine
memory a recorder."""

from __future__ import annotations

import collections
import types
from typing import Any

import pytest

from gpumem.errors import InvalidArgument
from gpumem.integrations.nanovllm import NanoVllm, Settings
from gpumem.port import KvLayout
from gpumem.port import takeover as standby
from gpumem.prefix_directory import Scan
from nanovllm_miniature import BS, Block, Manager, Seq, UpstreamManager

class Engine:
    """nano-vllm's LLMEngine in miniature: waiting sequences are prefilled first (all of
    them), else the running ones decode; each step gives each of its sequences a token.
    ``steps``: (kind, the prompt tokens each prefilled sequence found cached, or the
    decode batch's size)."""

    def __init__(self, manager: Manager, log: list[Any] | None = None) -> None:
        self.scheduler = types.SimpleNamespace(block_manager=manager, waiting=collections.deque(), running=[])
        config = types.SimpleNamespace(hf_config=types.SimpleNamespace(vocab_size=1000), max_model_len=64, max_num_batched_tokens=64)
        self.model_runner = types.SimpleNamespace(config=config)
        self.steps: list[tuple[str, Any]] = []
        self.log = [] if log is None else log

    def add_request(self, prompt: list[int], params: int) -> None:
        self.scheduler.waiting.append(Seq(prompt, params))

    def is_finished(self) -> bool:
        return not self.scheduler.waiting and not self.scheduler.running

    def step(self) -> None:
        sch, m = self.scheduler, self.scheduler.block_manager
        self.log.append("step")
        if sch.waiting:
            seqs = list(sch.waiting)
            sch.waiting.clear()
            for seq in seqs:
                m.allocate(seq)
            sch.running.extend(seqs)
            self.steps.append(("prefill", [seq.num_cached_tokens for seq in seqs]))
        else:
            seqs = list(sch.running)
            for seq in seqs:
                m.may_append(seq)
            self.steps.append(("decode", len(seqs)))
        for seq in seqs:
            seq.tokens.append(7)
            if len(seq) - seq.prompt_len == seq.max_tokens:
                m.deallocate(seq)
                sch.running.remove(seq)


def fresh(m: Manager, blocks: int) -> bool:
    """Whether ``m`` is a block manager as built: every block free, unhashed, in order."""
    return (len(m.blocks) == blocks and m.hash_to_block_id == {} and not m.used_block_ids and list(m.free_block_ids) == list(range(blocks))
            and all((b.ref_count, b.hash, b.token_ids) == (0, -1, []) for b in m.blocks))


class Adapter(NanoVllm):
    """nano-vllm's adapter over the miniature ``llm``; ``synchronize`` and
    ``restore_graph_inputs`` (torch's) logged, or refused when ``sync`` is false."""

    def __init__(self, llm: Engine, log: list[Any] | None = None, *, sync: bool = True) -> None:
        super().__init__(None, Block, lambda n: n)
        self.llm, self.scheduler, self.runner = llm, llm.scheduler, llm.model_runner
        self.log = llm.log if log is None else log
        self.sync = sync

    def synchronize(self) -> None:
        if not self.sync:
            raise AssertionError("nothing sleeps here: no synchronisation")
        self.log.append("sync")

    def restore_graph_inputs(self) -> None:
        self.log.append("restore inputs")


LAYOUT = KvLayout(2, (BS, 1, 1), 2, None)


SETTINGS = Settings("sb", standby=("g", "secret"), share_weights=True, follow=False)


@pytest.mark.parametrize("manager", [Manager, UpstreamManager], ids=["fork", "upstream"])
def test_the_rehearsal_runs_the_serving_path_and_leaves_the_block_manager_as_built(manager: type[Manager]) -> None:
    llm = Engine(manager(16))
    standby.settle(Adapter(llm, sync=False), Memory([], 16, {}), Settings("sb", standby=("g", "secret"), standby_sleeps=False), Reservation([]))  # type: ignore[arg-type]
    # a plain prefill, a prefill of two prompts hitting its full block, decodes of three then one
    assert llm.steps == [("prefill", [0]), ("prefill", [BS, BS]), ("decode", 3), ("decode", 1)]
    assert llm.is_finished() and fresh(llm.scheduler.block_manager, 16)


def test_no_rehearsal_block_is_a_prefix_hit_after_the_take_over() -> None:
    """Upstream nano-vllm keeps a freed block's hash: without the reset, the rehearsal's
    prompt would hit a block whose adopted rows hold the primary's tokens."""
    log: list[Any] = []
    llm = Engine(UpstreamManager(16), log)
    mem, reservation, adapter = Memory(log, blocks=16, trusted={}), Reservation(log), Adapter(llm)
    standby.settle(adapter, mem, SETTINGS, reservation)  # type: ignore[arg-type]
    standby.take_over(adapter, mem, SETTINGS, LAYOUT, reservation, wait=1.0)  # type: ignore[arg-type]
    assert mem.kv is not None
    again = Seq(standby.rehearsal_prompts(BS, 1000, 64)[0], 1)
    llm.scheduler.block_manager.allocate(again)
    assert again.num_cached_tokens == 0


def test_the_rehearsals_prompts_fit_the_engine() -> None:
    first, *sharing = standby.rehearsal_prompts(256, 32768, 1024)
    assert len(first) == 257 and [len(p) for p in sharing] == [513, 514]  # a full block of their own: a prefill of some length
    assert all(p[:256] == first[:256] and p[256] != first[256] for p in sharing)
    assert [len(p) for p in standby.rehearsal_prompts(256, 32768, 512)[1:]] == [257, 258]  # short of room: a token or two
    llm = Engine(Manager(16))
    llm.model_runner.config.max_num_batched_tokens = 2 * BS
    with pytest.raises(InvalidArgument, match="past max_num_batched_tokens"):
        Adapter(llm).rehearse()


def test_a_reset_refuses_a_scheduler_holding_sequences() -> None:
    llm = Engine(Manager(8))
    llm.add_request([1, 2, 3, 4, 5], 2)
    with pytest.raises(InvalidArgument, match="1 sequences"):
        Adapter(llm).reset_scheduler()
    with pytest.raises(InvalidArgument, match="rehearses before it serves"):
        Adapter(llm).rehearse()


class Directory:
    def __init__(self, log: list[Any], trusted: dict[int, int]) -> None:
        self.log, self.trusted = log, trusted

    def scan(self, blocks: int) -> Scan:
        self.log.append("scan")
        return Scan(blocks=dict(self.trusted), corrupt=1)

    def publish(self, block: int, content_hash: int) -> None:
        self.log.append(("publish", block))

    def invalidate(self, block: int) -> None:
        self.log.append(("invalidate", block))


class Memory:
    """EngineMemory as a standby's settling and take-over use it."""

    def __init__(self, log: list[Any], blocks: int, trusted: dict[int, int]) -> None:
        self.log, self.blocks, self.trusted = log, blocks, trusted
        self.kv: Any = None
        self.prefix: Any = None
        self.asleep: list[str] = []

    def sleep(self, *tags: str, drop: tuple[str, ...] = ()) -> None:
        self.log.append(("sleep", tags, tuple(drop)))
        self.asleep = list(tags)

    def adopt_kv(self, group: str, secret: str, *, wait: float, reservation: Any, **layout: Any) -> None:
        self.log.append(("adopt", group, secret))
        self.kv = types.SimpleNamespace(blocks=self.blocks)
        self.prefix = Directory(self.log, self.trusted)

    def wake(self, *, wait: float) -> None:
        assert self.kv is not None, "woke before the adoption"
        self.log.append("wake")
        self.asleep = []


class Reservation:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def park(self) -> None:
        self.log.append("park")


def standby_engine(log: list[Any], *, blocks: int = 12, trusted: dict[int, int] | None = None) -> tuple[Adapter, Memory, Reservation]:
    return Adapter(Engine(Manager(8), log)), Memory(log, blocks, trusted or {}), Reservation(log)


@pytest.mark.parametrize("share_weights", [True, False], ids=["shared-weights", "own-weights"])
def test_a_standby_sleeps_after_its_rehearsal_and_wakes_after_the_adoption_before_it_seeds(share_weights: bool) -> None:
    log: list[Any] = []
    adapter, mem, reservation = standby_engine(log, trusted={111: 2, 222: 5})
    s = Settings("sb", standby=("g", "secret"), share_weights=share_weights, follow=False)
    standby.settle(adapter, mem, s, reservation)  # type: ignore[arg-type]
    # the device's work done before memory goes; the model arena dropped only when it holds no weights
    assert log[-6:] == ["step"] * 3 + ["sync", ("sleep", ("weights", "graphs"), ("weights",) if share_weights else ()), "park"]
    log.clear()
    promoted = standby.take_over(adapter, mem, s, LAYOUT, reservation, wait=1.0)  # type: ignore[arg-type]
    took = promoted.took
    assert log == [("adopt", "g", "secret"), "wake", "restore inputs", "scan"]
    assert (took.seeded, took.trusted, took.corrupt) == (2, 2, 1) and promoted.follower is None
    assert took.adopted_at <= took.woke_at <= took.seeded_at
    m = adapter.scheduler.block_manager
    assert len(m.blocks) == 12 and m.hash_to_block_id == {111: 2, 222: 5}  # sized to the adopted pool, seeded


def test_a_standby_that_did_not_sleep_wakes_nothing() -> None:
    log: list[Any] = []
    adapter, mem, reservation = standby_engine(log)
    adapter.sync = False
    s = Settings("sb", standby=("g", "secret"), standby_rehearses=False, standby_sleeps=False, follow=False)
    standby.settle(adapter, mem, s, reservation)  # type: ignore[arg-type]
    assert log == []
    took = standby.take_over(adapter, mem, s, LAYOUT, reservation, wait=1.0).took  # type: ignore[arg-type]
    assert log == [("adopt", "g", "secret"), "scan"] and took.woke_at == took.adopted_at


def test_only_a_standby_takes_over() -> None:
    adapter, mem, reservation = standby_engine([])
    with pytest.raises(InvalidArgument, match="no standby"):
        standby.take_over(adapter, mem, Settings("primary"), LAYOUT, reservation, wait=1.0)  # type: ignore[arg-type]
