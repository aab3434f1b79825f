"""gpumem.integrations.transformers without torch: the seams checked against the installed
transformers, the layouts it refuses, and the block methods over fakes shaped like
transformers 5.17's ``BlockManager`` and cache allocators."""

from __future__ import annotations

import collections
import sys
import types
from typing import Any

import pytest

from gpumem.integrations import transformers as gtf
from gpumem.integrations.transformers import seams
from gpumem.integrations.transformers.adapter import TRASH, Transformers, layer_types
from gpumem.port.blocks import plan
from gpumem.port import SeamMissing, Unsupported


class Block:
    def __init__(self, id_: int, parent_id: int | None, hash_: int | None = None) -> None:
        self.id, self.parent_id, self.hash = id_, parent_id, hash_


def fake_cache(blocks: int, tables: dict[str, list[int]], cached: dict[int, int] | None = None, sharable: bool = True) -> Any:
    """A cache of ``blocks`` rows: requests holding ``tables``, ``cached`` free prefix blocks (id: hash)."""
    cached = cached or {}
    held = {i for t in tables.values() for i in t}
    manager = types.SimpleNamespace(
        num_blocks=blocks,
        _uninit_block_ids=collections.deque(i for i in range(TRASH, blocks) if i not in held and i not in cached),
        _init_block_ids=dict.fromkeys(cached), _hash_to_id={h: i for i, h in cached.items()}, _id_to_block={},
    )
    for table in tables.values():
        for n, i in enumerate(table):
            manager._id_to_block[i] = Block(i, table[n - 1] if n else None, hash_=1000 + i if sharable else None)
            manager._hash_to_id[1000 + i] = i
    for i, h in cached.items():
        manager._id_to_block[i] = Block(i, None, h)
    cm = types.SimpleNamespace(block_table={rid: list(t) for rid, t in tables.items()})
    return types.SimpleNamespace(_block_manager=manager, group_cache_managers=[cm], block_size=4)


def adapter(cache: Any, requests: list[Any] | None = None) -> Transformers:
    blocks = Transformers()
    blocks.cache = cache
    scheduler = types.SimpleNamespace(waiting_requests={i: r for i, r in enumerate(requests or []) if not r.allocated_blocks},
                                      active_requests={i: r for i, r in enumerate(requests or []) if r.allocated_blocks})
    blocks.manager = types.SimpleNamespace(batch_processor=types.SimpleNamespace(scheduler=scheduler))
    blocks.count = cache._block_manager.num_blocks
    return blocks


def test_seams_missing_name_transformers_version_and_what_moved() -> None:
    api = types.SimpleNamespace(ContinuousBatchingManager=type("M", (), {}), PagedAttentionCache=object)
    runner = types.SimpleNamespace(get_cuda_pools=lambda: None)
    cache = types.SimpleNamespace(PagedAttentionMemoryHandler=object, group_layers_by_attn_type=lambda c: None)
    with pytest.raises(SeamMissing, match=r"transformers .*has no warmup, _create_batch_processor.*written for transformers 5\.17"):
        seams(api, runner, cache)
    with pytest.raises(SeamMissing, match="get_cuda_pools"):
        seams(api, types.SimpleNamespace(), cache)


def test_unsupported_attention_types_and_latent_kv_are_refused() -> None:
    hybrid = types.SimpleNamespace(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2)
    with pytest.raises(Unsupported, match=r"\['linear_attention'\] have no paged KV blocks"):
        layer_types(hybrid)
    with pytest.raises(Unsupported, match="kv_lora_rank"):
        layer_types(types.SimpleNamespace(num_hidden_layers=2, sliding_window=None, kv_lora_rank=512))
    layer_types(types.SimpleNamespace(num_hidden_layers=2, sliding_window=64))


@pytest.mark.parametrize("option", [{"standby": ("g", "s"), "share_weights": True}, {"retain": "g", "weights_to": "b"}])
def test_what_transformers_cannot_do_is_refused(option: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("transformers.generation.continuous_batching")
    for name in ("transformers", "transformers.generation", "transformers.generation.continuous_batching"):
        monkeypatch.setitem(sys.modules, name, fake)
    for sub in ("cache", "continuous_api", "model_runner"):
        setattr(fake, sub, types.SimpleNamespace())
    with pytest.raises(Unsupported, match="cannot share it"):
        gtf.enable("e", **option)
    with pytest.raises(SeamMissing, match="ContinuousBatchingManager"):
        gtf.enable("e")


def test_resize_grows_free_blocks_and_drops_cached_ones_past_the_end() -> None:
    cache = fake_cache(8, {"r": [2, 3]}, cached={6: 77})
    blocks = adapter(cache)
    blocks.resize_blocks(12)
    assert sorted(blocks.free_blocks()) == [4, 5, 6, 7, 8, 9, 10, 11] and blocks.block_count() == 12
    blocks.resize_blocks(6)
    manager = cache._block_manager
    assert sorted(blocks.free_blocks()) == [4, 5] and 77 not in manager._hash_to_id and 6 not in manager._id_to_block
    assert sorted(blocks.used_blocks()) == [0, 1, 2, 3]  # the trash blocks count as used: never moved nor given back


def test_relocate_moves_block_tables_records_hashes_and_parents() -> None:
    cache = fake_cache(10, {"a": [2, 8, 9], "b": [3]})
    blocks = adapter(cache)
    blocks.relocate_blocks([(9, 4), (8, 5)])
    manager = cache._block_manager
    assert cache.group_cache_managers[0].block_table == {"a": [2, 5, 4], "b": [3]}
    assert manager._id_to_block[4].id == 4 and manager._id_to_block[4].parent_id == 5
    assert manager._hash_to_id[1009] == 4 and 9 not in manager._id_to_block
    assert sorted(blocks.used_blocks()) == [0, 1, 2, 3, 4, 5] and {8, 9} <= set(manager._uninit_block_ids)
    high = adapter(fake_cache(8, {"a": [7]}))
    assert plan(high.used_blocks(), high.free_blocks(), 3) == [(7, 2)]  # the port packs past the trash, never into it


def test_forget_prefix_cache_and_reset() -> None:
    cache = fake_cache(8, {}, cached={4: 44, 5: 55})
    blocks = adapter(cache)
    blocks.forget_prefix_cache()
    manager = cache._block_manager
    assert not manager._init_block_ids and not manager._hash_to_id and sorted(blocks.free_blocks()) == list(range(TRASH, 8))
    blocks.reset(5)
    assert list(manager._uninit_block_ids) == [2, 3, 4] and manager.num_blocks == 5
    with pytest.raises(Unsupported, match="holds requests"):
        adapter(fake_cache(8, {"r": [2]})).reset(8)


def test_step_need_counts_prompts_and_active_requests() -> None:
    cache = fake_cache(6, {"r": [2, 3]})
    waiting = types.SimpleNamespace(allocated_blocks=0, initial_tokens=list(range(9)))  # 3 blocks of 4
    active = types.SimpleNamespace(allocated_blocks=2, initial_tokens=[1])
    need = adapter(cache, [waiting, active]).step_need()
    assert need.blocks == 4 and need.busy and need.short  # 2 free: the prompt does not fit
    assert not adapter(cache, []).step_need().busy


def test_prefix_events_hashes_and_seeding() -> None:
    cache = fake_cache(8, {"a": [2]})
    manager = cache._block_manager
    manager.get_free_blocks = lambda n, *a: [manager._uninit_block_ids.popleft() for _ in range(n)]
    manager.mark_shareable_blocks_as_complete = lambda n, blocks, ids: None
    blocks, taken, filled = adapter(cache), [], []
    blocks.hook_prefix_events(taken.append, filled.append)
    assert manager.get_free_blocks(2) == [3, 4] and taken == [3, 4]
    manager.mark_shareable_blocks_as_complete(1, [2], [])
    assert filled == [2] and blocks.block_hash(2) == 1002 and blocks.block_hash(5) == -1
    manager._id_to_block[2].hash = -5  # Python's hash is signed: the directory holds it unsigned, the seed signed again
    manager._hash_to_id[-5] = 2
    assert blocks.block_hash(2) == (1 << 64) - 5


def test_seeded_blocks_take_the_signed_hash_back(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("transformers.generation.continuous_batching.cache_manager")
    module.Block = lambda id_, parent, group: Block(id_, parent)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    cache = fake_cache(8, {"a": [2]})
    blocks = adapter(cache)
    assert blocks.seed_block(5, (1 << 64) - 5) and not blocks.seed_block(5, 7) and not blocks.seed_block(2, 9)
    manager = cache._block_manager
    assert manager._hash_to_id[-5] == 5 and 5 in manager._init_block_ids and 5 not in manager._uninit_block_ids
    assert blocks.block_hash(5) == (1 << 64) - 5 and 5 in blocks.free_blocks()



def test_the_first_serve_marks_the_cache_served_before_the_start_up_end_runs() -> None:
    """A standby's built() settles, and its rehearsal runs the manager's loop, which serves
    a cache not yet served: marked after built(), the loop ran the start-up's end again."""
    seen: list[object] = []
    port = types.SimpleNamespace(serving=None, adapter=types.SimpleNamespace(cache="cache", committed=print))
    port.built = lambda make_blocks: seen.append(port.serving)
    gtf.Port.serve(port)  # type: ignore[arg-type]
    assert seen == ["cache"] and port.serving == "cache"
