"""The transformers adapter over transformers' own paged cache (5.17's PagedAttentionCache,
BlockManager and allocators, on the CPU; skipped where torch or transformers is missing):
the trash blocks moved to rows 0 and 1, and live blocks moved by the port's plan keep
what the cache reads for their request and what its prefix cache matches."""

from __future__ import annotations

from typing import Any

import pytest

from gpumem.integrations.transformers import seams
from gpumem.integrations.transformers.adapter import TRASH, Transformers
from gpumem.port.blocks import plan

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZE = 4  # tokens a block


def real_cache(rows: int, sliding: bool = False) -> tuple[Any, Transformers]:
    from transformers import ContinuousBatchingConfig, MistralConfig, Qwen3Config
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8}
    config = MistralConfig(sliding_window=8, **common) if sliding else Qwen3Config(**common)
    cb = ContinuousBatchingConfig(num_blocks=1, max_batch_tokens=16, block_size=SIZE, max_memory_percent=0.5)
    cache = PagedAttentionCache(config, cb, "cpu", DistributedHelper(None, 60.0), {}, torch.float32)
    adapter = Transformers()
    adapter.cache = cache
    adapter.synchronize = lambda: None  # type: ignore[method-assign]  # no device here
    adapter.bind_kv([[torch.zeros(rows, SIZE, 2, 8) for _ in "kv"] for _ in cache.key_cache])
    return cache, adapter


def test_the_installed_transformers_has_every_seam() -> None:
    from transformers.generation.continuous_batching import cache, continuous_api, model_runner

    seams(continuous_api, model_runner, cache)


@pytest.mark.parametrize("sliding", [False, True])
def test_trash_blocks_lie_in_rows_0_and_1(sliding: bool) -> None:
    cache, adapter = real_cache(10, sliding)
    assert (cache.read_trash_index, cache.write_trash_index, cache.num_blocks) == (0, SIZE, 10 - TRASH)
    assert all(getattr(cm, "sentinel_index", 1) == 1 for cm in cache.group_cache_managers)
    assert cache.allocate_blocks(2, "a", 0) is not None
    tables = [cm.block_table["a"] for cm in cache.group_cache_managers]
    assert all(i >= TRASH for t in tables for i in t) and sorted(adapter.used_blocks())[:TRASH] == [0, 1]


def test_moved_live_blocks_are_read_and_matched_where_they_went() -> None:
    cache, adapter = real_cache(12)
    prompt = list(range(10, 10 + 2 * SIZE))
    assert cache.allocate_blocks(1, "filler", 0) and cache.allocate_blocks(2, "a", 0)  # a's blocks: 3 and 4
    reads: list[list[int]] = [[]]
    writes: list[list[int]] = [[]]
    cache.extend_read_and_write_indices("a", 0, len(prompt), reads, writes)
    keys = torch.arange(len(prompt) * 16, dtype=torch.float32).view(len(prompt), 2, 8)
    cache.key_cache[0].index_copy_(0, torch.tensor(writes[0]), keys)
    manager = cache._block_manager
    manager.mark_shareable_blocks_as_complete(2, cache.group_cache_managers[0].block_table["a"], prompt)
    cache.free_blocks("filler")  # block 2 comes free under a's
    adapter.resize_blocks(12)
    moves = plan(adapter.used_blocks(), adapter.free_blocks(), 4)
    assert moves == [(4, 2)]
    adapter.copy_blocks([s for s, _ in moves], [d for _, d in moves])
    adapter.relocate_blocks(moves)
    assert cache.group_cache_managers[0].block_table["a"] == [3, 2] and sorted(adapter.used_blocks()) == [0, 1, 2, 3]
    reads, writes = [[]], [[]]
    cache.extend_read_and_write_indices("a", len(prompt) - 1, 1, reads, writes)
    assert torch.equal(cache.key_cache[0][torch.tensor(reads[0][: len(prompt)])], keys)
    cache.free_blocks("a")
    adapter.resize_blocks(4)  # the pool keeps 4 rows: the moved block's row 4 is gone
    assert cache.search_prefix_match("b", prompt) == 2 * SIZE
    assert cache.group_cache_managers[0].block_table["b"] == [3, 2]
    assert adapter.block_hash(2) != -1 and adapter.block_hash(4) == -1
