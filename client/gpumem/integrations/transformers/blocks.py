"""transformers' paged cache as the port sees it (gpumem.port.adapter.EngineAdapter's
block and layout methods): which layouts it can take, where its blocks are, how they move.
No torch and no transformers at import: the cache is duck-typed
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
manager hands out ids ``TRASH .. block_count() - 1``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from gpumem.port import StepNeed, Unsupported

TRASH = 2  # the read-trash block (zeros) and the write-trash block, rows 0 and 1
LAYER_TYPES = ("full_attention", "sliding_attention")  # what PagedAttentionCache lays out in one block size


def layer_types(config: Any) -> list[str]:
    """The model's attention types, as transformers groups them; refuses a model whose
    layers the paged cache cannot hold in blocks of one shape (linear attention, Mamba,
    MLA with its own value width, chunked attention...)."""
    types: list[str] = list(getattr(config, "layer_types", None) or [])
    if not types:
        sliding = getattr(config, "sliding_window", None) is not None
        types = ["sliding_attention" if sliding else "full_attention"] * int(config.num_hidden_layers)
    odd = sorted(set(types) - set(LAYER_TYPES))
    if odd:
        raise Unsupported(
            f"{type(config).__name__}: layers of type {odd} have no paged KV blocks in transformers' continuous batching "
            f"cache, which lays out {', '.join(LAYER_TYPES)} only; gpumem cannot lay this model's KV cache out"
        )
    for key in ("kv_lora_rank", "v_head_dim"):
        if getattr(config, key, None):
            raise Unsupported(f"{type(config).__name__}: {key} set (latent or uneven K/V heads); one K and V block shape per layer is all gpumem lays out")
    return types


class TransformersBlocks:
    """One ``PagedAttentionCache``'s blocks, for the port. ``copy_rows(src, dst)`` copies
    rows (blocks) in every K and V tensor, device to device, complete on return."""

    def __init__(self, cache: Any, copy_rows: Callable[[list[int], list[int]], None], requests: Callable[[], Iterable[Any]]) -> None:
        self.cache = cache
        self.copy_rows = copy_rows
        self.requests = requests  # the scheduler's waiting and active RequestStates
        self.count = TRASH

    @property
    def manager(self) -> Any:
        return self.cache._block_manager

    def block_count(self) -> int:
        return self.count

    def free_blocks(self) -> Collection[int]:
        return [*self.manager._uninit_block_ids, *self.manager._init_block_ids]

    def used_blocks(self) -> Collection[int]:
        free = set(self.free_blocks())
        return [i for i in range(TRASH, self.count) if i not in free]

    def resize_blocks(self, blocks: int) -> None:
        manager = self.manager
        if blocks >= self.count:
            manager._uninit_block_ids.extend(range(max(self.count, TRASH), blocks))
        else:
            for i in list(manager._init_block_ids):
                if i >= blocks:  # a cached prefix block past the end: its entry goes with it
                    self._drop_cached(i)
            manager._uninit_block_ids = collections.deque(i for i in manager._uninit_block_ids if i < blocks)
        self.count = manager.num_blocks = blocks

    def _drop_cached(self, block: int) -> None:
        manager = self.manager
        del manager._init_block_ids[block]
        record = manager._id_to_block.pop(block)
        manager._hash_to_id.pop(record.hash, None)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.copy_rows(src, dst)

    def relocate_blocks(self, moves: Sequence[tuple[int, int]]) -> None:
        manager, to = self.manager, dict(moves)
        taken = set(to.values())
        manager._uninit_block_ids = collections.deque([i for i in manager._uninit_block_ids if i not in taken] + list(to))
        for i in taken & set(manager._init_block_ids):  # the planner takes free blocks; a cached one loses its entry
            self._drop_cached(i)
        records = manager._id_to_block
        for src, dst in moves:
            if src in records:
                record = records[dst] = records.pop(src)
                record.id = dst
                if record.hash is not None and manager._hash_to_id.get(record.hash) == src:
                    manager._hash_to_id[record.hash] = dst
        for record in records.values():
            record.parent_id = to.get(record.parent_id, record.parent_id)
        for cm in self.cache.group_cache_managers:
            for table in cm.block_table.values():
                table[:] = [to.get(i, i) for i in table]

    def step_need(self) -> StepNeed:
        """Blocks the next step takes: each waiting request's prompt, one more for each
        active request, in every layer group (an over-estimate for sliding groups: they
        stop growing at the window)."""
        cache, size = self.cache, self.cache.block_size
        states = list(self.requests())
        waiting = [s for s in states if not s.allocated_blocks]
        blocks = sum(-(-len(s.initial_tokens) // size) for s in waiting) + len(states) - len(waiting)
        blocks *= len(cache.group_cache_managers)
        free = len(self.free_blocks())
        first = -(-len(waiting[0].initial_tokens) // size) * len(cache.group_cache_managers) if waiting else 0
        return StepNeed(blocks=blocks, short=first > free or (len(waiting) < len(states) and free == 0), busy=bool(states))

    def forget_prefix_cache(self) -> None:
        """Every free block uncached (the KV cache's contents were dropped)."""
        for i in list(self.manager._init_block_ids):
            self._drop_cached(i)
            self.manager._uninit_block_ids.append(i)

    def reset(self, blocks: int) -> None:
        """The block manager as built, over ``blocks`` committed rows (after the round:
        warm-up's requests are gone, its blocks are free and unhashed)."""
        manager = self.manager
        if any(cm.block_table for cm in self.cache.group_cache_managers):
            raise Unsupported("transformers' cache holds requests: the block manager can be reset only with none")
        manager._uninit_block_ids = collections.deque(range(TRASH, blocks))
        manager._init_block_ids.clear()
        manager._hash_to_id.clear()
        manager._id_to_block.clear()
        self.count = manager.num_blocks = blocks
