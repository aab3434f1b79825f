"""transformers' continuous batching (``model.generate_batch``, ``ContinuousBatchingManager``,
``transformers serve``) on gpumemd through the engine port (gpumem.port), transformers'
own code unchanged.

    from gpumem.integrations import transformers as gpumem_tf
    gpumem_tf.enable("engine-a", expect=2)        # once per process, before a manager is made
    model = AutoModelForCausalLM.from_pretrained(...).to("cuda")
    out = model.generate_batch(inputs, generation_config)     # or the manager, or serve

Three names of ``transformers.generation.continuous_batching`` are replaced, each checked
against the installed version first (``SeamMissing`` names it): ``ContinuousBatchingManager``
(a subclass: the model's weights moved into the model arena when it is made, its
warm-up and generation thread inside ``EngineMemory.running()``, its loop the port's step
hook), ``PagedAttentionCache`` (a subclass: K and V laid out virtually in a KV pool, at
the maximum transformers' own solver gives for the whole device but the weights, instead
of sized from free memory) and ``model_runner.get_cuda_pools`` (the graphs arena's pool
instead of a fresh one: warm-up's graphs land in gpumemd's memory). Once ``warmup()``
captured its graphs the round commits the blocks (without a warm-up: when the loop
starts) and the block manager follows the pool. The adapter: gpumem.integrations.transformers.adapter.

``port()`` is the engine's ``EnginePort`` once a manager was made: ``port().sleep()`` /
``port().wake()`` put its memory to sleep by tag between steps, graphs kept (requests that
come meanwhile wait); ``enable(name, retain=group)`` keeps the KV cache and a prefix
directory for a standby (``port().retain_secret()``); ``enable(name, standby=(group,
secret))`` builds one, which settles in ``warmup()``; its manager starts after
``port().take_over(wait=)``.
Refused (``Unsupported``): shared weights, tensor parallelism, layers without paged KV
blocks. One manager at a time per process.
"""

from __future__ import annotations

from typing import Any

from gpumem.errors import InvalidArgument
from gpumem.integrations.transformers.adapter import TRASH, Transformers, layer_types
from gpumem.port import SeamMissing, Settings, Unsupported, require_seams
from gpumem.port.engine_port import EnginePort

WRITTEN_FOR = "5.17"
# A process's CUDA context: 527 MiB on the H100 (CUDA 13, driver 580: a fresh process's
# mem_get_info, bench/control_rtt.py's free_bytes_at_start, 2026-12-07). Each engine has
# one, and so has gpumemd, beside its default --reserve of 1 GiB left uncommitted.
CONTEXT_BYTES = 544 << 20
DAEMON_RESERVE = (1 << 30) + CONTEXT_BYTES
HOOKED = ["warmup", "_create_batch_processor", "_run_generation_loop", "_generation_loop_body", "_generation_step"]


def seams(api: Any, runner: Any, cache: Any) -> None:
    """Refuse (``SeamMissing``) unless the continuous-batching modules have what this hooks."""
    for owner, names in [(api, ["ContinuousBatchingManager", "PagedAttentionCache"]), (runner, ["get_cuda_pools"]),
                         (cache, ["PagedAttentionMemoryHandler", "group_layers_by_attn_type"]), (getattr(api, "ContinuousBatchingManager", None), HOOKED)]:
        require_seams("transformers", owner, names, written_for=WRITTEN_FOR)


def costs(handler: Any, config: Any, tokens: int, *, graphs: bool) -> tuple[int, int]:
    """(bytes fixed, bytes a cache page) of an engine with ``tokens`` batch tokens: every
    page costs its K and V, its column of the attention mask (``tokens`` rows) and the
    attention's read of it, which warm-up sizes for the whole cache (``max_kv_read``),
    counted twice with graphs (a model of what the H100 measured, 2026-12-07: which
    tensors hold the second copy is not yet known). transformers' own solver counts the
    read once and without grouped-query attention's repeated K and V, so an engine of its
    size runs out of memory in warm-up, and a ceiling above the blocks committed pays
    these for nothing. Qwen3 (8 KV heads of 16, dim 128, 2,048 batch tokens): the H100's
    arenas held 24.1 (one engine) and 24.4 KiB (each of a pair) a ceiling page beside its
    32 KiB of K and V; this gives 24.0."""
    a, kv_width, io = handler.activation_dtype.itemsize, handler.page_size, handler.io_multiplier
    q_width, copies, masks = config.num_attention_heads * (kv_width // max(1, config.num_key_value_heads)), 2 if graphs else 1, io * handler.num_attention_masks * a
    # The read's peak: one layer's gathered V and its K and V repeated to every query head, together.
    page = 2 * handler.group_size * kv_width * handler.cache_dtype.itemsize + masks * tokens + io * handler.num_groups * 8 + copies * (kv_width + 2 * q_width if q_width != kv_width else 2 * kv_width) * a
    return copies * tokens * (config.hidden_size * a + config.vocab_size * 4) + masks * tokens * tokens, page


class Port(EnginePort):
    """This process's engine on the port, made with its first manager: the model its
    caller built moved into the model arena, the KV layout's ceiling
    (``KvLayout.max_blocks``: transformers sizes its batch tensors, the attention mask
    among them, and warm-up's read by the cache's pages, so the layout stops where the
    rows' whole cost fills the engine's share of the device: ``costs``). ``sleep()`` is
    the port's: the manager's loop steps in the port's step gate."""

    def __init__(self, settings: Settings, ceiling: int, model: Any) -> None:
        self.adapter = Transformers()
        super().__init__(self.adapter, settings)
        self.adapter.ceiling, self.model, self.serving = ceiling, model, None
        self.take_model(model)

    def size(self, cache_mod: Any, config: Any, cb: Any, dtype: Any) -> tuple[int, int]:
        """(max batch tokens, rows): the batch tokens transformers' own solver picks for the
        engine's share of the device, and the rows whose whole cost fills that share."""
        import torch

        groups, types = cache_mod.group_layers_by_attn_type(config)
        handler = cache_mod.PagedAttentionMemoryHandler(config=config, continuous_batching_config=cb, dtype=dtype, group_types=types, group_size=len(groups[0]))
        s, total = self.settings, torch.cuda.mem_get_info()[1]
        handler.available_memory = share = (total - DAEMON_RESERVE) // max(1, s.expect) - CONTEXT_BYTES - self.mem.model.committed - s.round_headroom
        tokens, blocks = handler.infer_max_batch_tokens_and_num_blocks()
        fixed, page = costs(handler, config, tokens, graphs=cb.use_cuda_graph is not False)
        return tokens, (self.adapter.ceiling or max(1, min(blocks, (share - fixed) // page // handler.block_size)) + TRASH)

    def serve(self) -> None:
        """Once the graphs are captured (or the loop starts without them): the port's
        start-up end (``built``); a later manager's cache takes the rows as they are."""
        if self.serving is None:
            self.serving = self.adapter.cache  # first: a standby's rehearsal (built's settle) runs the loop, which must not serve again
            self.built(self.adapter.committed)
        elif self.serving is not self.adapter.cache:
            self.adapter.committed(self.mem.kv.blocks if self.mem.kv else self.adapter.count)
            self.serving = self.adapter.cache


_enabled: list[Any] = []  # enable()'s settings and ceiling, then the Port


def port() -> Port:
    """The engine's port, once a manager was made: its ``mem`` (arenas, KV cache), its follower."""
    if not _enabled or not isinstance(_enabled[-1], Port):
        raise InvalidArgument("no manager on gpumemd in this process: gpumem.integrations.transformers.enable(name), then make one")
    return _enabled[-1]


def enable(name: str, *, max_blocks: int = 0, **options: Any) -> None:
    """Put the continuous-batching managers this process makes from now on on gpumemd
    (``options``: gpumem.port.Settings; ``max_blocks``: the layout's rows instead of
    transformers' own sizing of the device)."""
    try:
        from transformers.generation.continuous_batching import cache as cache_mod, continuous_api as api, model_runner as runner
    except ImportError as e:
        raise SeamMissing(f"transformers' continuous batching cannot be imported ({e}); gpumem's adapter was written for transformers {WRITTEN_FOR}") from e
    settings = Settings(name, **options)
    if settings.weights_to or settings.share_weights or isinstance(_enabled[-1:] or None, Port):
        raise Unsupported("weights_to= / share_weights=: the caller builds transformers' model, gpumem cannot share it; enable() once, before a manager")
    _enabled[:] = [(settings, max_blocks)]
    if getattr(api, "_gpumem_patched", False):
        return
    seams(api, runner, cache_mod)

    class Cache(api.PagedAttentionCache):  # type: ignore[misc]
        def __init__(self, config: Any, continuous_batching_config: Any, device: Any, distributed_helper: Any, tp_plan: Any, dtype: Any) -> None:
            p, cb = port(), continuous_batching_config
            layer_types(config)
            if distributed_helper.tp_size > 1:
                raise Unsupported("tensor parallelism: gpumem lays out one CUDA device per process")
            tokens, p.adapter.ceiling = p.size(cache_mod, config, cb, dtype)
            asked, (cb.num_blocks, cb.max_batch_tokens) = (cb.num_blocks, cb.max_batch_tokens), (1, tokens)  # one block made: replaced
            try:
                super().__init__(config, cb, device, distributed_helper, tp_plan, dtype)
            finally:
                cb.num_blocks, cb.max_batch_tokens = asked
            require_seams("transformers", self, ["read_trash_index", "sentinel_index", "write_trash_index", "_block_manager"], written_for=WRITTEN_FOR)
            require_seams("transformers", self._block_manager, ["_uninit_block_ids", "_init_block_ids", "_hash_to_id", "_id_to_block"], written_for=WRITTEN_FOR)
            p.adapter.cache = self
            if p.layout is None:
                p.lay_out_kv()
            elif p.layout != p.adapter.kv_layout() or p.mem.kv is None:
                raise Unsupported(f"engine '{p.settings.name}': a manager with another KV layout than its first ({p.layout})")
            else:
                p.adapter.bind_kv(p.mem.kv.tensors(p.layout.dtype))

    class Manager(api.ContinuousBatchingManager):  # type: ignore[misc]
        def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
            if not isinstance(_enabled[-1], Port):
                settings, ceiling = _enabled[0]
                _enabled.append(Port(settings, ceiling, model))
            elif port().model is not model:
                raise Unsupported("one model per process on gpumemd: this engine serves another already")
            self._gpumem = port()
            self._gpumem.adapter.manager = self
            super().__init__(model, *args, **kwargs)

        def warmup(self) -> None:
            with self._gpumem.mem.running():
                super().warmup()
            self._gpumem.serve()

        def _run_generation_loop(self) -> None:
            with self._gpumem.mem.running():
                super()._run_generation_loop()

        def _generation_loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
            p = self._gpumem
            if not p.may_step():  # requests wait for wake() or take_over(); a stop ends the loop
                self._has_new_requests.wait(timeout=0.1)
                return not self.background_thread_status.local_status or batch_processor.has_pending_requests()
            if p.serving is not p.adapter.cache:  # no warm-up: graphs come at first use, in the graphs arena's pool
                p.serve()
            with p.step(batch_processor.has_pending_requests()):
                return bool(super()._generation_loop_body(batch_processor, bootstrapping))

        def _generation_step(self) -> None:
            self._gpumem.scheduled()  # blocks taken, the step not run: no directory entry vouches for them
            super()._generation_step()

    # get_cuda_pools' stand-in: the graphs arena's pool and its id (warm-up's graphs land in gpumemd's memory).
    api.ContinuousBatchingManager, api.PagedAttentionCache = Manager, Cache
    runner.get_cuda_pools = lambda: (port().mem.graphs.mem_pool, port().mem.graphs.mem_pool.id)
    api._gpumem_patched = True
