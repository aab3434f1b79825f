"""transformers' continuous batching (``model.generate_batch``, ``ContinuousBatchingManager``,
``transformers serve``) on gpumemd, transformers' own code unchanged.

    from gpumem.integrations import transformers as gpumem_tf
    gpumem_tf.enable("engine-a", expect=2)        # once per process, before the manager starts
    model = AutoModelForCausalLM.from_pretrained(...).to("cuda")
    out = model.generate_batch(inputs, generation_config)     # or the manager, or serve

Three names of ``transformers.generation.continuous_batching`` are replaced, each checked
against the installed version first (``SeamMissing`` names it): ``ContinuousBatchingManager``
(a subclass: its model's weights moved into the model arena when it is made, its
warm-up and generation thread run inside ``EngineMemory.running()``, its step is the
port's step hook), ``PagedAttentionCache`` (a subclass: the K and V tensors are laid out
virtually in a KV pool at the maximum transformers' own solver gives for the whole
device, a placeholder under them, instead of sized from free memory) and
``model_runner.get_cuda_pools`` (the graphs arena's pool instead of a fresh one: the
warm-up's graphs land in gpumemd's memory). Once ``warmup()`` captured its graphs the
round commits the blocks; the block manager holds those and follows the pool
(gpumem.integrations.transformers.follow). Trash blocks: gpumem.integrations.transformers.blocks.

``sleep()`` / ``wake()`` put the engine's memory to sleep by tag (``EngineMemory.sleep``)
between steps, its graphs kept; requests that come meanwhile wait for ``wake``.
``enable(name, retain=group)`` keeps the KV cache across the engine's death
(``retain_secret()``). Not here, refused (``Unsupported``): a standby (``standby=``), shared
weights (``weights_to=``, ``share_weights=``), tensor parallelism; see docs/engines.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from gpumem.engine import EngineMemory
from gpumem.errors import InvalidArgument
from gpumem.integrations.transformers.blocks import TRASH, TransformersBlocks, layer_types
from gpumem.integrations.transformers.follow import Follower
from gpumem.port import KvLayout, SeamMissing, Settings, Unsupported, require_seams
from gpumem.sleep import DEFAULT_WAKE_WAIT_S

WRITTEN_FOR = "5.17"
GiB = 1 << 30
CONTEXT_BYTES = GiB  # the CUDA context and torch's own: out of the device's total when sizing the layout
STEP_WAIT_S = 30.0  # sleep() waits this long for the step under way


def seams(api: Any, runner: Any, cache: Any) -> None:
    """Refuse (``SeamMissing``) unless the continuous-batching modules have what this hooks."""
    require_seams("transformers", api, ["ContinuousBatchingManager", "PagedAttentionCache"], written_for=WRITTEN_FOR)
    require_seams("transformers", runner, ["get_cuda_pools"], written_for=WRITTEN_FOR)
    require_seams("transformers", cache, ["PagedAttentionMemoryHandler", "group_layers_by_attn_type"], written_for=WRITTEN_FOR)
    hooked = ["warmup", "_create_batch_processor", "_run_generation_loop", "_generation_loop_body", "is_running"]
    require_seams("transformers", api.ContinuousBatchingManager, hooked, written_for=WRITTEN_FOR)


class Engine:
    """This process's engine: its settings, its memory once a manager is made, its blocks."""

    def __init__(self, settings: Settings, max_blocks: int) -> None:
        for option in ("standby", "weights_to", "share_weights"):
            if getattr(settings, option):
                raise Unsupported(f"{option}=: transformers' continuous batching on gpumemd has no standby nor shared weights yet (docs/engines.md)")
        self.s, self.max_blocks = settings, max_blocks
        self.mem: EngineMemory | None = None
        self.model: Any = None
        self.manager: Any = None
        self.rows: list[list[Any]] = []
        self.blocks: TransformersBlocks | None = None
        self.follower: Follower | None = None
        self.committed = False
        self.retained: Any = None
        self.stepping = threading.Lock()  # held by the generation thread's step: sleep() waits for it
        self.awake = threading.Event()
        self.awake.set()

    def attach(self, model: Any) -> EngineMemory:
        """The engine's memory for ``model``'s manager; its weights moved into the model arena once."""
        if model.device.type != "cuda" or getattr(model, "_device_mesh", None) is not None:
            raise Unsupported(f"gpumem lays out one CUDA device per process; the model is on {model.device} (tensor parallel: no)")
        if self.mem is None:
            s = self.s
            self.mem = EngineMemory(s.name, s.device, runtime_dir=s.runtime_dir, tenant_token_file=s.tenant_token_file)
        if self.model is not model:
            if self.model is not None:
                raise Unsupported("one model per process on gpumemd: this engine serves another already")
            import torch

            seen: set[int] = set()
            with torch.no_grad(), self.mem.model.allocating():
                for module in model.modules():
                    for t in [*module._parameters.values(), *module._buffers.values()]:
                        if t is not None and t.is_cuda and id(t) not in seen:  # tied weights: once
                            seen.add(id(t))
                            t.data = t.data.clone()
            torch.cuda.empty_cache()  # their first copies back to the device
            self.model = model
        return self.mem

    def size(self, cache_mod: Any, config: Any, cb: Any, dtype: Any) -> tuple[int, int]:
        """(max batch tokens, blocks) as transformers' own solver sizes them for all of the
        device but the weights: the virtual layout's maximum; the round commits what is free."""
        import torch

        assert self.mem is not None
        groups, types = cache_mod.group_layers_by_attn_type(config)
        handler = cache_mod.PagedAttentionMemoryHandler(config=config, continuous_batching_config=cb, dtype=dtype, group_types=types, group_size=len(groups[0]))
        handler.available_memory = torch.cuda.mem_get_info()[1] - self.mem.model.committed - CONTEXT_BYTES
        tokens, blocks = handler.infer_max_batch_tokens_and_num_blocks()
        return tokens, (self.max_blocks - TRASH if self.max_blocks else blocks)

    def lay_out(self, cache: Any, max_blocks: int) -> None:
        """``cache``'s K and V made views of the KV pool (declared here once per process)."""
        assert self.mem is not None
        heads, dim, size = cache.num_key_value_heads, cache.head_dim, cache.block_size
        layout = KvLayout(layers=len(cache.key_cache), block_shape=(size, heads, dim), itemsize=cache.dtype.itemsize, dtype=cache.dtype)
        if not self.rows:
            kv = self.mem.kv_cache(**layout.describe(), max_blocks=max_blocks, expect=self.s.expect)
            self.retained = self.mem.retain(self.s.retain, directory=False) if self.s.retain else None
            self.rows = kv.tensors(layout.dtype)
        elif len(self.rows) != layout.layers or self.mem.kv is None or self.mem.kv.block_shape != layout.block_shape:
            raise Unsupported(f"engine '{self.s.name}': a manager with another KV layout ({layout}) than its first; one per process")
        import torch

        require_seams("transformers", cache, ["read_trash_index", "sentinel_index", "write_trash_index", "_block_manager"], written_for=WRITTEN_FOR)
        require_seams("transformers", cache._block_manager, ["_uninit_block_ids", "_init_block_ids", "_hash_to_id", "_id_to_block"], written_for=WRITTEN_FOR)
        cache.key_cache = [k.view(-1, heads, dim) for k, _ in self.rows]
        cache.value_cache = [v.view(-1, heads, dim) for _, v in self.rows]
        for t in (*cache.key_cache, *cache.value_cache):
            torch._dynamo.mark_static_address(t)
        cache.num_blocks = len(self.rows[0][0]) - TRASH
        cache.num_pages = cache.num_blocks * size
        cache.read_trash_index, cache.sentinel_index, cache.write_trash_index = 0, 1, size
        for cm in cache.group_cache_managers:
            if hasattr(cm, "sentinel_index"):  # sliding-window groups keep their own copy
                cm.sentinel_index, cm.write_trash_index = 1, size
        self.blocks = TransformersBlocks(cache, self.copy_rows, self.requests)
        self.blocks.reset(self.mem.kv.blocks if self.committed and self.mem.kv else len(self.rows[0][0]))  # before the round: placeholder blocks for warm-up
        if self.follower is not None:
            self.follower.adapter = self.blocks

    def commit(self) -> None:
        """Once the graphs are captured: register them, and take the round's blocks."""
        assert self.mem is not None and self.mem.kv is not None and self.blocks is not None
        if self.committed:
            return
        s = self.s
        self.mem.graphs_captured({})
        blocks = self.mem.kv_commit(headroom_bytes=s.round_headroom, min_blocks=max(s.min_blocks, TRASH + 1), weight=s.weight)
        self.committed = True
        self.blocks.reset(blocks)
        for k, v in self.rows:
            k[0].zero_()  # the read trash: padding tokens read zeros
            v[0].zero_()
        if s.follow:
            self.follower = Follower(self.mem.kv.pool, self.blocks, watermark=s.watermark_blocks, step=s.grow_step_blocks)

    def requests(self) -> list[Any]:
        scheduler = self.manager.batch_processor.scheduler
        return [*scheduler.waiting_requests.values(), *scheduler.active_requests.values()]

    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        import torch

        torch.cuda.synchronize()  # an asynchronous batch may still read the rows
        s, d = torch.tensor(src, device=self.rows[0][0].device), torch.tensor(dst, device=self.rows[0][0].device)
        for row in self.rows:
            for t in row:
                t[d] = t[s]
        torch.cuda.synchronize()


_engine: list[Engine] = []


def engine() -> Engine:
    if not _engine:
        raise InvalidArgument("gpumem.integrations.transformers.enable(name) was not called in this process")
    return _engine[0]


def enable(name: str, *, max_blocks: int = 0, **options: Any) -> None:
    """Put the continuous-batching managers this process makes from now on on gpumemd
    (``options``: gpumem.port.Settings; ``max_blocks``: the virtual layout's rows instead
    of transformers' own sizing of the whole device)."""
    try:
        from transformers.generation.continuous_batching import cache as cache_mod
        from transformers.generation.continuous_batching import continuous_api as api
        from transformers.generation.continuous_batching import model_runner as runner
    except ImportError as e:
        raise SeamMissing(f"transformers' continuous batching cannot be imported ({e}); gpumem's adapter was written for transformers {WRITTEN_FOR}") from e
    _engine[:] = [Engine(Settings(name, **options), max_blocks)]
    if getattr(api, "_gpumem_patched", False):
        return
    seams(api, runner, cache_mod)
    manager_cls, cache_cls = api.ContinuousBatchingManager, api.PagedAttentionCache

    class Cache(cache_cls):  # type: ignore[misc,valid-type]
        def __init__(self, config: Any, continuous_batching_config: Any, device: Any, distributed_helper: Any, tp_plan: Any, dtype: Any) -> None:
            e, cb = engine(), continuous_batching_config
            layer_types(config)
            if distributed_helper.tp_size > 1:
                raise Unsupported("tensor parallelism: gpumem lays out one CUDA device per process")
            tokens, blocks = e.size(cache_mod, config, cb, dtype)
            asked = cb.num_blocks, cb.max_batch_tokens
            cb.num_blocks, cb.max_batch_tokens = 1, tokens  # transformers allocates one block here: replaced below
            try:
                super().__init__(config, cb, device, distributed_helper, tp_plan, dtype)
            finally:
                cb.num_blocks, cb.max_batch_tokens = asked
            e.lay_out(self, blocks + TRASH)

    class Manager(manager_cls):  # type: ignore[misc,valid-type]
        def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
            self._gpumem = engine().attach(model)
            super().__init__(model, *args, **kwargs)

        def warmup(self) -> None:
            e = engine()
            e.manager, self._gpumem_warming = self, True
            try:
                with self._gpumem.running():
                    super().warmup()
            finally:
                self._gpumem_warming = False
            e.commit()

        def _create_batch_processor(self) -> Any:
            e = engine()
            e.manager = self
            with self._gpumem.running():
                processor = super()._create_batch_processor()
            if not getattr(self, "_gpumem_warming", False):
                self.batch_processor = processor
                e.commit()  # no warm-up: graphs come at first use, in the graphs arena's pool
            return processor

        def _run_generation_loop(self) -> None:
            with self._gpumem.running():
                super()._run_generation_loop()

        def _generation_loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
            e = engine()
            if not e.awake.is_set():  # asleep: requests wait for wake(), a stop ends the loop
                if self.background_thread_status.local_status and not batch_processor.has_pending_requests():
                    return False
                e.awake.wait(0.1)
                return True
            with e.stepping:
                if e.follower is not None:
                    e.follower.before_step()
                result: bool = super()._generation_loop_body(batch_processor, bootstrapping)
                return result

    api.ContinuousBatchingManager, api.PagedAttentionCache = Manager, Cache
    runner.get_cuda_pools = graph_pools
    api._gpumem_patched = True


def graph_pools() -> tuple[Any, Any]:
    """``model_runner.get_cuda_pools``'s stand-in: the graphs arena's pool and its id."""
    pool = memory().graphs.mem_pool
    return pool, pool.id


def sleep(*tags: str, drop: Iterable[str] = ("kv",)) -> None:
    """Put the engine's memory to sleep between steps (``EngineMemory.sleep``; default:
    weights and graphs kept in host memory, the KV cache dropped with the prefix cache).
    Refused while requests hold KV blocks."""
    e = engine()
    if e.mem is None or e.blocks is None:
        raise InvalidArgument(f"engine '{e.s.name}' has no manager yet: nothing to put to sleep")
    if not e.stepping.acquire(timeout=STEP_WAIT_S):
        raise InvalidArgument(f"engine '{e.s.name}': its step did not end within {STEP_WAIT_S:g}s; sleep() waits for it")
    try:
        dropped = set(drop)
        if "kv" in dropped and (not tags or "kv" in tags):
            if e.blocks.used_blocks():
                raise InvalidArgument(f"engine '{e.s.name}' has {len(e.blocks.used_blocks())} KV blocks in use: finish its requests first")
            e.blocks.forget_prefix_cache()
        import torch

        torch.cuda.synchronize()
        e.awake.clear()
        e.mem.sleep(*tags, drop=dropped)
    except BaseException:
        e.awake.set()
        raise
    finally:
        e.stepping.release()


def prepare_sleep(*tags: str, drop: Iterable[str] = ("kv",)) -> None:
    """The host buffers ``sleep`` copies into, made ahead (``EngineMemory.prepare_sleep``)."""
    mem = engine().mem
    if mem is None:
        raise InvalidArgument("no manager yet: nothing to prepare")
    mem.prepare_sleep(*tags, drop=drop)


def wake(*, wait: float = DEFAULT_WAKE_WAIT_S) -> None:
    """Wake what ``sleep`` put to sleep, at the same addresses; waiting requests run then."""
    e = engine()
    if e.mem is not None:
        e.mem.wake(wait=wait)
        if e.committed and "kv" not in e.mem.asleep:
            for k, v in e.rows:
                k[0].zero_()
                v[0].zero_()
    e.awake.set()


def retain_secret() -> str:
    """The secret of the retain group ``enable(name, retain=group)`` named, for a successor."""
    retained = engine().retained
    if retained is None:
        raise InvalidArgument("this engine retains nothing: enable(name, retain='group') and make a manager first")
    secret: str = retained.secret
    return secret


def memory() -> EngineMemory:
    """The engine's ``EngineMemory`` (once a manager was made): its arenas, KV cache and pool."""
    mem = engine().mem
    if mem is None:
        raise InvalidArgument("no manager yet")
    return mem
