"""The transformers adapter over transformers' own paged cache (5.17's PagedAttentionCache,
BlockManager and allocators, on the CPU; skipped where torch or transformers is missing):
the trash blocks moved to rows 0 and 1, and live blocks moved by the port's plan keep
what the cache reads for their request and what its prefix cache matches."""

from __future__ import annotations

from typing import Any

import pytest

from gpumem.integrations.transformers import Port, seams
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


class FakePort:
    """The port without a daemon: the KV pool's rows are CPU tensors, the round commits
    ``COMMITTED`` of them (``built``); the step hooks are counted."""

    COMMITTED = 9
    serve = Port.serve

    def __init__(self, settings: Any, ceiling: int, model: Any) -> None:
        import contextlib
        import types

        self.adapter, self.settings, self.ceiling, self.model = Transformers(), settings, ceiling, model
        self.adapter.synchronize = lambda: None  # type: ignore[method-assign]
        self.layout: Any = None
        self.serving: Any = None
        self.keeper = None
        self.mem = types.SimpleNamespace(running=contextlib.nullcontext, asleep=[], kv=None)
        self.hooks: dict[str, int] = {}

    def size(self, cache_mod: Any, config: Any, cb: Any, dtype: Any) -> tuple[int, int]:
        return cb.max_batch_tokens, self.ceiling

    def lay_out_kv(self) -> None:
        import types

        self.layout = layout = self.adapter.kv_layout()
        rows = [[torch.full((layout.max_blocks, *layout.block_shape), float("nan")) for _ in "kv"] for _ in range(layout.layers)]
        self.mem.kv = types.SimpleNamespace(blocks=self.COMMITTED, tensors=lambda dtype: rows)
        self.adapter.bind_kv(rows)  # NaN everywhere: a read of a row no block holds (the trash's aside) poisons the tokens

    def built(self, make_blocks: Any) -> None:
        make_blocks(self.COMMITTED)
        self.follow()

    def may_step(self) -> bool:
        return True

    def step(self, busy: bool) -> Any:
        import contextlib

        @contextlib.contextmanager
        def step() -> Any:
            self.before_step() if busy else self.idle()
            yield
            self.after_step()

        return step()

    def __getattr__(self, name: str) -> Any:  # follow, before_step, idle, scheduled, after_step
        def hook(*args: Any) -> None:
            self.hooks[name] = self.hooks.get(name, 0) + 1

        return hook


@pytest.mark.parametrize("sliding", [False, True])
def test_generate_batch_on_the_patched_manager_generates_what_plain_transformers_does(sliding: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' own generate_batch on the CPU, plain and through enable()'s manager,
    cache and block manager (the KV pool faked with NaN rows): the same greedy tokens, the
    round's blocks only, the step hooks called from the generation thread."""
    from transformers import ContinuousBatchingConfig, GenerationConfig, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.generation.continuous_batching import continuous_api, model_runner

    from gpumem.integrations import transformers as gtf

    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "attn_implementation": "sdpa"}
    torch.manual_seed(0)
    model = (MistralForCausalLM(MistralConfig(sliding_window=8, **common)) if sliding else Qwen3ForCausalLM(Qwen3Config(**common))).eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=-1)
    prompts = [[(7 * i + j) % 120 + 3 for j in range(5 + 3 * i)] for i in range(4)]

    def generate() -> list[list[int]]:
        cb = ContinuousBatchingConfig(num_blocks=7, max_batch_tokens=32, block_size=SIZE, use_cuda_graph=False, use_async_batching=False)
        out = model.generate_batch(prompts, continuous_batching_config=cb, max_new_tokens=12)
        return [r.generated_tokens for r in out.values()]

    plain = generate()
    for owner, name in [(continuous_api, "ContinuousBatchingManager"), (continuous_api, "PagedAttentionCache"), (model_runner, "get_cuda_pools")]:
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(continuous_api, "_gpumem_patched", False, raising=False)
    monkeypatch.setattr(gtf, "Port", FakePort)
    monkeypatch.setattr(gtf, "_enabled", [])
    gtf.enable("e", max_blocks=12)
    on = generate()
    port = gtf.port()
    assert on == plain
    assert port.adapter.block_count() == FakePort.COMMITTED and port.serving is port.adapter.cache
    assert port.hooks.get("scheduled", 0) >= 12 and port.hooks.get("after_step", 0) >= 12 and "follow" in port.hooks


H100 = 85_017_493_504  # the H100's total bytes, as cuMemGetInfo gives it


def _sized(expect: int, retain: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, Any, Any]:
    """Port.size for the kit's Qwen3 (bench/transformers_kit.py) on an H100's total, the
    model arena at 0.4 GB: (batch tokens, rows, handler, config)."""
    import types

    from transformers import ContinuousBatchingConfig, Qwen3Config
    from transformers.generation.continuous_batching import cache as cache_mod
    from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config

    from gpumem.port import Settings

    config = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
    cb = resolve_continuous_batching_config(config, ContinuousBatchingConfig(max_batch_tokens=2048), None, False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (H100 // 2, H100))
    monkeypatch.setattr(cache_mod.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 0)
    port = Port.__new__(Port)
    port.adapter, port.settings = types.SimpleNamespace(ceiling=0), Settings("e", expect=expect, retain=retain)
    port.mem = types.SimpleNamespace(model=types.SimpleNamespace(committed=400_000_000))
    tokens, rows = port.size(cache_mod, config, cb, torch.bfloat16)
    groups, kinds = cache_mod.group_layers_by_attn_type(config)
    handler = cache_mod.PagedAttentionMemoryHandler(config=config, continuous_batching_config=cb, dtype=torch.bfloat16, group_types=kinds, group_size=len(groups[0]))
    return tokens, rows, handler, config


@pytest.mark.parametrize(("expect", "retain"), [(1, ""), (2, ""), (1, "group")])
def test_the_ceiling_costs_what_the_engines_share_of_the_device_holds(expect: int, retain: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ceiling row costs its K and V, its mask column and warm-up's read of it,
    whether committed or not: the rows are those whose whole cost fills the share (the
    device but the daemon's reserve, split between the round's engines, less the
    context, the weights and the round's headroom), well below what transformers' own
    solver gives the same share (an engine of that size ran out of memory on the H100)."""
    from gpumem.integrations.transformers import CONTEXT_BYTES, DAEMON_RESERVE, costs
    from gpumem.port import Settings

    tokens, rows, handler, config = _sized(expect, retain, monkeypatch)
    share = (H100 - DAEMON_RESERVE) // expect - CONTEXT_BYTES - 400_000_000 - Settings("e", retain=retain).round_headroom
    fixed, page = costs(handler, config, tokens, graphs=True)
    pages = (rows - TRASH) * handler.block_size
    assert fixed + pages * page <= share < fixed + (pages + handler.block_size) * page
    assert page - 2 * 8 * 1024 * 2 == 24584  # 24.0 KiB beside 32 KiB of K and V: the H100 measured 24.1
    handler.available_memory = share
    assert rows - TRASH < 0.8 * handler.infer_max_batch_tokens_and_num_blocks()[1]
