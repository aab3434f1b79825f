"""A nano-vllm standby's settling and take-over (gpumem.integrations.nanovllm_standby),
without nano-vllm, torch or a daemon: the engine is nano-vllm's scheduler and block
manager in miniature (allocate with its chained hashes and hit check, may_append,
deallocate; a step appends a token per sequence), the engine memory a recorder."""

from __future__ import annotations

import collections
import types
from typing import Any

import pytest

from gpumem.errors import InvalidArgument
from gpumem.integrations import nanovllm_standby as standby
from gpumem.integrations.nanovllm import Settings
from gpumem.prefix_directory import Scan
from nanovllm_miniature import BS, Block, Manager, Seq, UpstreamManager

class Engine:
    """nano-vllm's LLMEngine in miniature: waiting sequences are prefilled first (all of
    them), else the running ones decode; each step gives each of its sequences a token.
    ``steps``: (kind, the prompt tokens each prefilled sequence found cached, or the
    decode batch's size)."""

    def __init__(self, manager: Manager, log: list[Any] | None = None) -> None:
        self.scheduler = types.SimpleNamespace(block_manager=manager, waiting=collections.deque(), running=[], gpumem=None, gpumem_prefix=None)
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


def no_sync() -> None:
    raise AssertionError("nothing sleeps here: no synchronisation")


SETTINGS = Settings("sb", standby=("g", "secret"), share_weights=True, follow=False)


@pytest.mark.parametrize("manager", [Manager, UpstreamManager], ids=["fork", "upstream"])
def test_the_rehearsal_runs_the_serving_path_and_leaves_the_block_manager_as_built(manager: type[Manager]) -> None:
    llm = Engine(manager(16))
    standby.settle(llm, Settings("sb", standby=("g", "secret"), standby_sleeps=False), params=lambda n: n, synchronize=no_sync)
    # a plain prefill, a prefill of two prompts hitting its full block, decodes of three then one
    assert llm.steps == [("prefill", [0]), ("prefill", [BS, BS]), ("decode", 3), ("decode", 1)]
    assert llm.is_finished() and fresh(llm.scheduler.block_manager, 16)


def test_no_rehearsal_block_is_a_prefix_hit_after_the_take_over() -> None:
    """Upstream nano-vllm keeps a freed block's hash: without the reset, the rehearsal's
    prompt would hit a block whose adopted rows hold the primary's tokens."""
    log: list[Any] = []
    llm = Engine(UpstreamManager(16), log)
    llm.model_runner._gpumem = mem = Memory(log, blocks=16, trusted={})
    llm.model_runner.config.gpumem_layout, llm.model_runner.config.gpumem_reservation = {}, Reservation(log)
    standby.settle(llm, SETTINGS, params=lambda n: n, synchronize=lambda: log.append("sync"))
    standby.take_over(llm, SETTINGS, wait=1.0, new_block=Block, restore_inputs=lambda: None)
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
        standby.rehearse(llm, lambda n: n)


def test_a_reset_refuses_a_scheduler_holding_sequences() -> None:
    llm = Engine(Manager(8))
    llm.add_request([1, 2, 3, 4, 5], 2)
    with pytest.raises(InvalidArgument, match="1 sequences"):
        standby.reset(llm.scheduler)
    with pytest.raises(InvalidArgument, match="rehearses before it serves"):
        standby.rehearse(llm, lambda n: n)


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


def standby_engine(log: list[Any], *, blocks: int = 12, trusted: dict[int, int] | None = None) -> Engine:
    llm = Engine(Manager(8), log)
    runner = llm.model_runner
    runner._gpumem = Memory(log, blocks, trusted or {})
    runner.config.gpumem_layout, runner.config.gpumem_reservation = {"layers": 2}, Reservation(log)
    return llm


@pytest.mark.parametrize("share_weights", [True, False], ids=["shared-weights", "own-weights"])
def test_a_standby_sleeps_after_its_rehearsal_and_wakes_after_the_adoption_before_it_seeds(share_weights: bool) -> None:
    log: list[Any] = []
    llm = standby_engine(log, trusted={111: 2, 222: 5})
    s = Settings("sb", standby=("g", "secret"), share_weights=share_weights, follow=False)
    standby.settle(llm, s, params=lambda n: n, synchronize=lambda: log.append("sync"))
    # the device's work done before memory goes; the model arena dropped only when it holds no weights
    assert log[-6:] == ["step"] * 3 + ["sync", ("sleep", ("weights", "graphs"), ("weights",) if share_weights else ()), "park"]
    log.clear()
    took = standby.take_over(llm, s, wait=1.0, new_block=Block, restore_inputs=lambda: log.append("restore inputs"))
    assert log == [("adopt", "g", "secret"), "wake", "restore inputs", "scan"]
    assert (took.seeded, took.trusted, took.corrupt) == (2, 2, 1)
    assert took.adopted_at <= took.woke_at <= took.seeded_at
    m = llm.scheduler.block_manager
    assert len(m.blocks) == 12 and m.hash_to_block_id == {111: 2, 222: 5}  # sized to the adopted pool, seeded


def test_a_standby_that_did_not_sleep_wakes_nothing() -> None:
    log: list[Any] = []
    llm = standby_engine(log)
    s = Settings("sb", standby=("g", "secret"), standby_rehearses=False, standby_sleeps=False, follow=False)
    standby.settle(llm, s, params=lambda n: n, synchronize=no_sync)
    assert log == []
    took = standby.take_over(llm, s, wait=1.0, new_block=Block, restore_inputs=lambda: log.append("restore inputs"))
    assert log == [("adopt", "g", "secret"), "scan"] and took.woke_at == took.adopted_at


def test_only_a_standby_takes_over() -> None:
    with pytest.raises(InvalidArgument, match="no standby"):
        standby.take_over(standby_engine([]), Settings("primary"), wait=1.0, new_block=Block, restore_inputs=lambda: None)
