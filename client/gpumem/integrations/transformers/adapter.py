"""transformers' continuous batching as the port sees it (gpumem.port.adapter.EngineAdapter):
which layouts it can take, where its blocks are, how they move, its prefix events, its
rehearsal. No torch and no transformers at import: the cache is duck-typed
(``transformers.generation.continuous_batching.cache.PagedAttentionCache`` of 5.17: its
``_block_manager``, a ``BlockManager`` whose free blocks are ``_uninit_block_ids``, a
deque, and ``_init_block_ids``, prefix-hashed blocks no request holds, with the
``Block`` records of shareable blocks in ``_id_to_block`` and their hashes in
``_hash_to_id``; and ``group_cache_managers``, each a ``block_table`` of request id to
block ids), so that the unit tests run it on fakes.

Rows 0 and 1 of every K and V buffer are transformers' two trash blocks (it puts them
after its last block; here they come first, so that they lie in the committed rows
whatever the pool holds): block 0 reads as zeros for padding tokens (its row 1 is the
sentinel of sliding-window reads), block 1 takes padding tokens' writes. The block
manager hands out ids ``TRASH .. block_count() - 1``; the layout names the trash blocks
reserved (``KvLayout.reserved_blocks``): always in use, never moved nor given back.

Prefix events come from the block manager (its ``get_free_blocks``: taken; its
``mark_shareable_blocks_as_complete``, which hashes the blocks a step completed once its
outputs reached the host: filled). A standby rehearses through its manager (started,
fed the port's rehearsal prompts, stopped). What it cannot do: build its model on a
primary's weights (the port's default ``building_model`` refuses); its graphs' inputs
live in the model arena, which its standby keeps in host memory while it sleeps (the
port's default ``restore_graph_inputs`` restores nothing).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from gpumem.port import EngineAdapter, KvLayout, StepNeed, Unsupported
from gpumem.port.blocks import copy_rows
from gpumem.port.takeover import REHEARSAL_TOKENS, rehearsal_prompts

HASH_MASK = (1 << 64) - 1
TRASH = 2  # the read-trash block (zeros) and the write-trash block, rows 0 and 1
REHEARSAL_WAIT_S = 60.0  # the standby's rehearsal: a few tokens, first-use costs included
LAYER_TYPES = ("full_attention", "sliding_attention")  # what PagedAttentionCache lays out in one block size


def layer_types(config: Any) -> None:
    """Refuse a model whose layers the paged cache cannot hold in blocks of one shape
    (linear attention, Mamba, chunked attention; latent or uneven K/V heads)."""
    types = getattr(config, "layer_types", None) or ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
    odd = sorted(set(types) - set(LAYER_TYPES)) + [k for k in ("kv_lora_rank", "v_head_dim") if getattr(config, k, None)]
    if odd:
        raise Unsupported(f"{type(config).__name__}: {odd} have no paged KV blocks of one shape in transformers' continuous batching "
                          f"cache ({', '.join(LAYER_TYPES)} layers only): gpumem cannot lay this model's KV cache out")


class Transformers(EngineAdapter):
    """One manager's ``PagedAttentionCache`` for the port: ``cache`` and ``manager`` are
    set where transformers makes them, before the port lays the KV cache out."""

    cache: Any = None
    manager: Any = None
    tensors: list[Any] = []  # block-shaped: block i is row i of each
    count = TRASH
    ceiling = 0  # the layout's rows (KvLayout.max_blocks)

    @property
    def blocks(self) -> Any:
        return self.cache._block_manager

    def kv_layout(self) -> KvLayout:
        c = self.cache
        return KvLayout(layers=len(c.key_cache), block_shape=(c.block_size, c.num_key_value_heads, c.head_dim), itemsize=c.dtype.itemsize, dtype=c.dtype, max_blocks=self.ceiling, reserved_blocks=TRASH)

    def bind_kv(self, layers: list[list[Any]]) -> None:
        """The cache's K and V become the pool's rows, the trash blocks rows 0 and 1."""
        import torch

        c, rows = self.cache, len(layers[0][0])
        c.key_cache, c.value_cache = ([layer[i].view(-1, c.num_key_value_heads, c.head_dim) for layer in layers] for i in (0, 1))
        for t in (*c.key_cache, *c.value_cache):
            torch._dynamo.mark_static_address(t)
        self.tensors = [t for layer in layers for t in layer]
        c.num_blocks, c.num_pages = rows - TRASH, (rows - TRASH) * c.block_size
        c.read_trash_index, c.sentinel_index, c.write_trash_index = 0, 1, c.block_size
        for cm in c.group_cache_managers:
            if hasattr(cm, "sentinel_index"):  # sliding-window groups keep their own copy
                cm.sentinel_index, cm.write_trash_index = 1, c.block_size
        self.reset(rows)  # warm-up takes blocks anywhere: the placeholder is under them

    def committed(self, blocks: int) -> None:
        """The round's blocks are the block manager's; the read trash reads zeros."""
        self.reset(blocks)
        for t in self.tensors:
            t[0].zero_()

    def block_count(self) -> int:
        return self.count

    def free_blocks(self) -> Collection[int]:
        return [*self.blocks._uninit_block_ids, *self.blocks._init_block_ids]

    def used_blocks(self) -> Collection[int]:
        return sorted(set(range(self.count)) - set(self.free_blocks()))

    def resize_blocks(self, blocks: int) -> None:
        manager = self.blocks
        for i in [i for i in manager._init_block_ids if i >= blocks]:  # cached prefix blocks past the end: their entries go
            self._drop_cached(i)
        manager._uninit_block_ids = collections.deque([i for i in manager._uninit_block_ids if i < blocks] + list(range(max(self.count, TRASH), blocks)))
        self.count = manager.num_blocks = blocks

    def _drop_cached(self, block: int) -> None:
        del self.blocks._init_block_ids[block]
        self.blocks._hash_to_id.pop(self.blocks._id_to_block.pop(block).hash, None)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        copy_rows(self.tensors, src, dst)  # after the device's work: an asynchronous batch may still read the rows

    def relocate_blocks(self, moves: Sequence[tuple[int, int]]) -> None:
        manager, to = self.blocks, dict(moves)
        for i in set(to.values()) & set(manager._init_block_ids):  # a cached free block taken: its entry goes
            self._drop_cached(i)
        manager._uninit_block_ids = collections.deque([i for i in manager._uninit_block_ids if i not in to.values()] + list(to))
        records = manager._id_to_block
        for src, dst in moves:
            if src in records:
                record = records[dst] = records.pop(src)
                record.id = dst
                if manager._hash_to_id.get(record.hash) == src:
                    manager._hash_to_id[record.hash] = dst
        for record in records.values():
            record.parent_id = to.get(record.parent_id, record.parent_id)
        for table in (t for cm in self.cache.group_cache_managers for t in cm.block_table.values()):
            table[:] = [to.get(i, i) for i in table]

    def step_need(self) -> StepNeed:
        """Blocks the next step takes: each waiting request's prompt, one more for each
        active request, in every layer group (an over-estimate for sliding groups)."""
        scheduler, groups, size = self.manager.batch_processor.scheduler, len(self.cache.group_cache_managers), self.cache.block_size
        waiting = [-(-len(s.initial_tokens) // size) * groups for s in scheduler.waiting_requests.values()]
        active, free = len(scheduler.active_requests), len(self.free_blocks())
        short = bool(waiting) and waiting[0] > free or active > 0 and free == 0
        return StepNeed(blocks=sum(waiting) + active * groups, short=short, busy=bool(waiting) or active > 0)

    def hook_prefix_events(self, taken: Callable[[int], None], filled: Callable[[int], None]) -> None:
        manager = self.blocks
        get_free, complete = manager.get_free_blocks, manager.mark_shareable_blocks_as_complete

        def get_free_blocks(*args: Any) -> Any:
            ids = get_free(*args)
            for i in ids or ():
                taken(i)
            return ids

        def mark_complete(num_complete_blocks: int, allocated_blocks: list[int], prompt_ids: list[int]) -> None:
            complete(num_complete_blocks, allocated_blocks, prompt_ids)
            for i in allocated_blocks:  # hashed now, the step's outputs on the host: the keeper publishes those with a hash
                filled(i)

        manager.get_free_blocks, manager.mark_shareable_blocks_as_complete = get_free_blocks, mark_complete

    def block_hash(self, block: int) -> int:
        record = self.blocks._id_to_block.get(block)
        missing = record is None or record.hash is None or self.blocks._hash_to_id.get(record.hash) != block
        return -1 if missing else int(record.hash) & HASH_MASK  # Python's hash is signed; the directory's are 64-bit unsigned

    def seed_block(self, block: int, content_hash: int) -> bool:
        from transformers.generation.continuous_batching.cache_manager import Block

        manager, content_hash = self.blocks, content_hash - (1 << 64) if content_hash >> 63 else content_hash
        if block >= self.count or block not in manager._uninit_block_ids or content_hash in manager._hash_to_id:
            return False
        manager._uninit_block_ids.remove(block)
        record = manager._id_to_block[block] = Block(block, None, 0)
        record.hash, record.ref_count, manager._init_block_ids[block], manager._hash_to_id[content_hash] = content_hash, 0, None, block
        return True

    def forget_prefix_cache(self) -> None:
        for i in list(self.blocks._init_block_ids):
            self._drop_cached(i)
            self.blocks._uninit_block_ids.append(i)

    def reset(self, blocks: int) -> None:
        """The block manager as built, over ``blocks`` rows, every block free and unhashed."""
        if any(cm.block_table for cm in self.cache.group_cache_managers):
            raise Unsupported("transformers' cache holds requests: the block manager can be reset only with none")
        manager, self.count = self.blocks, blocks
        manager._uninit_block_ids, manager.num_blocks = collections.deque(range(TRASH, blocks)), blocks
        for table in (manager._init_block_ids, manager._hash_to_id, manager._id_to_block):
            table.clear()

    def rehearse(self) -> None:
        """The rehearsal prompts through the manager's own loop: one alone, then two beside it."""
        config, manager = self.cache.config, self.manager
        prompts, deadline = rehearsal_prompts(self.cache.block_size, config.vocab_size, config.max_position_embeddings), time.monotonic() + REHEARSAL_WAIT_S
        manager.start()
        try:
            for request in (r for batch in (prompts[:1], prompts[1:]) for r in manager.add_requests(inputs=batch, max_new_tokens=REHEARSAL_TOKENS)):
                while (out := manager.get_result(request_id=request, timeout=0.1)) is None or not out.is_finished():
                    if time.monotonic() > deadline or not manager.is_running():
                        raise Unsupported(f"the standby's rehearsal did not end within {REHEARSAL_WAIT_S:g}s (running: {manager.is_running()})")
        finally:
            manager.stop(block=True, timeout=REHEARSAL_WAIT_S, keep_for_next_session=True)  # its cache and graphs kept
            manager.switch_to_cb_friendly_attn(manager.model)  # stop() put the model's own attention back

    def reset_scheduler(self) -> None:
        self.reset(self.count)

    def model(self) -> Any:
        return self.manager.model

