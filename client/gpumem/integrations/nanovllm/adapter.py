"""nano-vllm's answers to the engine port (``gpumem.port.adapter.EngineAdapter``): its KV
layout, its ``BlockManager``'s fields (``blocks``, ``free_block_ids``, ``used_block_ids``,
``hash_to_block_id``; a sequence's ``block_table`` and ``num_blocks``), its prefix cache's
chained hashes, its scheduler. No torch or nano-vllm at import: the engine's objects are
reached through their fields (nano-vllm's names), which lets the tests drive it over
stand-ins (tests/nanovllm_fakes.py, tests/nanovllm_miniature.py)."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, cast

from gpumem.errors import InvalidArgument
from gpumem.port.adapter import EngineAdapter, KvLayout, StepNeed
from gpumem.port.blocks import copy_rows
from gpumem.port.takeover import REHEARSAL_TOKENS, rehearsal_prompts


class NanoVllm(EngineAdapter):
    """One nano-vllm engine: its ``ModelRunner`` (``runner``), then its ``Scheduler``
    (``scheduler``), then its ``LLMEngine`` (``llm``), each set once built;
    ``runner_module``: ``nanovllm.engine.model_runner``, where the model class is named;
    ``new_block``: nano-vllm's ``Block``; ``params(n)``: sampling parameters for ``n``
    tokens, the end of sequence ignored (a standby's rehearsal)."""

    def __init__(self, runner_module: Any, new_block: Callable[[int], Any], params: Callable[[int], Any]) -> None:
        self.runner_module = runner_module
        self.new_block = new_block
        self.params = params
        self.runner: Any = None
        self.scheduler: Any = None
        self.llm: Any = None
        self.caches: list[Any] = []  # every layer's K and V
        self._unverified: set[int] = set()  # seeded blocks whose token ids no prompt gave yet

    @property
    def manager(self) -> Any:
        return self.scheduler.block_manager

    def kv_layout(self) -> KvLayout:
        hf, runner = self.runner.config.hf_config, self.runner
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return KvLayout(hf.num_hidden_layers, (runner.block_size, hf.num_key_value_heads, head_dim), runner.dtype.itemsize, runner.dtype)

    def bind_kv(self, layers: list[list[Any]]) -> None:
        caches = iter(layers)
        for module in self.runner.model.modules():
            if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
                module.k_cache, module.v_cache = next(caches)
        self.caches = [t for layer in layers for t in layer]

    # ------------------------------------------------------------------ blocks

    def block_count(self) -> int:
        return len(self.manager.blocks)

    def used_blocks(self) -> Collection[int]:
        return cast("Collection[int]", self.manager.used_block_ids)

    def free_blocks(self) -> Collection[int]:
        return cast("Collection[int]", self.manager.free_block_ids)

    def resize_blocks(self, blocks: int) -> None:
        m, have = self.manager, len(self.manager.blocks)
        if blocks >= have:
            m.blocks.extend(self.new_block(i) for i in range(have, blocks))
            m.free_block_ids.extend(range(have, blocks))
            return
        del m.blocks[blocks:]
        m.free_block_ids = collections.deque(i for i in m.free_block_ids if i < blocks)
        m.hash_to_block_id = {h: i for h, i in m.hash_to_block_id.items() if i < blocks}  # a freed block's entry goes

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        copy_rows(self.caches, src, dst)

    def relocate_blocks(self, moves: Sequence[tuple[int, int]]) -> None:
        m, to = self.manager, dict(moves)
        for src, dst in moves:
            a, b = m.blocks[src], m.blocks[dst]
            b.ref_count, b.hash, b.token_ids = a.ref_count, a.hash, a.token_ids
            a.ref_count, a.hash, a.token_ids = 0, -1, []
        m.used_block_ids = {to.get(i, i) for i in m.used_block_ids}
        taken = set(to.values())
        m.free_block_ids = collections.deque([i for i in m.free_block_ids if i not in taken] + list(to))
        m.hash_to_block_id = {h: to.get(i, i) for h, i in m.hash_to_block_id.items()}
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            seq.block_table[:] = [to.get(i, i) for i in seq.block_table]

    def step_need(self) -> StepNeed:
        """The waiting sequences' blocks and one for each running sequence about to start
        a block (``may_append``); short when nothing running and the first waiting one does
        not fit (nothing to schedule), or a running one would be preempted."""
        waiting, running, size = self.scheduler.waiting, self.scheduler.running, self.manager.block_size
        free = len(self.manager.free_block_ids)
        need = sum(seq.num_blocks for seq in waiting) + sum(1 for seq in running if len(seq) % size in (0, 1))
        short = sum(1 for seq in running if len(seq) % size == 1) > free if running else bool(waiting) and waiting[0].num_blocks > free
        return StepNeed(need, short, bool(waiting or running))

    # ------------------------------------------------------------------ prefix cache

    def hook_prefix_events(self, taken: Callable[[int], None], filled: Callable[[int], None]) -> None:
        """``_allocate_block`` is where the scheduler takes a block for new rows (a hit on
        a used block only counts it again); ``may_append`` hashes a decode block at its
        last slot; wrapped on the instance."""
        m = self.manager
        take, allocate, may_append = m._allocate_block, m.allocate, m.may_append

        def _allocate_block(block_id: int) -> Any:
            taken(block_id)
            self._unverified.discard(block_id)
            return take(block_id)

        def allocate_(seq: Any) -> None:
            if self._unverified:
                self._vouch(seq)
            allocate(seq)

        def may_append_(seq: Any) -> None:
            may_append(seq)
            if len(seq) % m.block_size == 0:
                filled(seq.block_table[-1])

        m._allocate_block, m.allocate, m.may_append = _allocate_block, allocate_, may_append_

    def block_hash(self, block: int) -> int:
        return int(self.manager.blocks[block].hash)

    def seed_block(self, block: int, content_hash: int) -> bool:
        """A free cached block (nano-vllm's hit path takes a free block with a matching
        hash); its token ids come from the first prompt that hits it (``_vouch``)."""
        m = self.manager
        if block >= len(m.blocks) or m.blocks[block].ref_count or content_hash in m.hash_to_block_id:
            return False
        m.blocks[block].hash, m.blocks[block].token_ids = content_hash, []
        m.hash_to_block_id[content_hash] = block
        self._unverified.add(block)
        return True

    def _vouch(self, seq: Any) -> None:
        """Give the seeded blocks this prompt hits its token ids, so that nano-vllm's hit
        check (the block's tokens equal the prompt's) passes: the directory keeps hashes,
        not tokens, and the 64-bit chained hash vouches for them."""
        m, h = self.manager, -1
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            if len(tokens) != m.block_size:
                return
            h = m.compute_hash(tokens, h)
            block = m.hash_to_block_id.get(h, -1)
            if block == -1:
                return
            if block in self._unverified:
                m.blocks[block].token_ids = list(tokens)
                self._unverified.discard(block)

    def forget_prefix_cache(self) -> None:
        m = self.manager
        m.hash_to_block_id.clear()
        for block in m.blocks:
            block.hash, block.token_ids = -1, []
        self._unverified.clear()

    # ------------------------------------------------------------------ standby

    def rehearse(self) -> None:
        """The first prompt's prefill alone (its full block hashed), then the two sharing
        it (a prefill with a block table: both hit the first's block), then decodes."""
        llm, config = self.llm, self.runner.config
        if not llm.is_finished():
            raise InvalidArgument("the standby has requests of its own: it rehearses before it serves, never between")
        first, *sharing = rehearsal_prompts(self.manager.block_size, config.hf_config.vocab_size, config.max_model_len)
        if len(sharing[-1]) > config.max_num_batched_tokens:
            raise InvalidArgument(
                f"the standby's rehearsal prefills {len(sharing[-1])} tokens at once, past max_num_batched_tokens "
                f"({config.max_num_batched_tokens}): raise it, or enable(..., standby_rehearses=False)"
            )
        llm.add_request(first, self.params(REHEARSAL_TOKENS))
        llm.step()
        for prompt in sharing:
            llm.add_request(prompt, self.params(REHEARSAL_TOKENS - 1))
        while not llm.is_finished():
            llm.step()

    def reset_scheduler(self) -> None:
        s = self.scheduler
        if s.waiting or s.running:
            raise InvalidArgument(f"the scheduler holds {len(s.waiting) + len(s.running)} sequences: a reset would leak their blocks")
        s.block_manager = type(s.block_manager)(len(s.block_manager.blocks), s.block_manager.block_size)

    def restore_graph_inputs(self) -> None:
        import torch

        with torch.inference_mode():  # made in it (capture_cudagraph): written only in it
            for buffer in getattr(self.runner, "graph_vars", {}).values():
                buffer.zero_()

    # ------------------------------------------------------------------ shared weights

    def model(self) -> Any:
        return self.runner.model

    @contextlib.contextmanager
    def building_model(self, build: Callable[[Callable[[], Any]], Any]) -> Iterator[None]:
        """``ModelRunner.__init__`` builds ``Qwen3ForCausalLM(hf_config)`` and calls
        ``load_model``, both names of ``runner_module``: rerouted while it runs."""
        module = self.runner_module
        cls, load = module.Qwen3ForCausalLM, module.load_model
        module.Qwen3ForCausalLM = lambda hf_config: build(lambda: cls(hf_config))
        module.load_model = lambda model, path: None
        try:
            yield
        finally:
            module.Qwen3ForCausalLM, module.load_model = cls, load
