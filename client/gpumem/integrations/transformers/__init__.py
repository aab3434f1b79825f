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

``sleep()`` / ``wake()``: the engine's memory by tag, between steps, graphs kept; requests
that come meanwhile wait. ``enable(name, retain=group)`` keeps the KV cache and a prefix
directory for a standby (``retain_secret()``); ``enable(name, standby=(group, secret))``
builds one, which settles in ``warmup()`` and serves after ``take_over(wait=)``. Refused
(``Unsupported``): shared weights, tensor parallelism, layers without paged KV blocks.
One manager at a time per process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from gpumem.errors import InvalidArgument
from gpumem.integrations.transformers.adapter import TRASH, Transformers, layer_types
from gpumem.port import SeamMissing, Settings, Unsupported, require_seams
from gpumem.port.engine_port import EnginePort
from gpumem.port.takeover import TakeOver
from gpumem.sleep import DEFAULT_WAKE_WAIT_S

WRITTEN_FOR = "5.17"
CONTEXT_BYTES = 1 << 30  # the CUDA context and torch's own: out of the device's total when sizing the layout
STEP_WAIT_S = 30.0  # sleep() waits this long for the step under way
HOOKED = ["warmup", "_create_batch_processor", "_run_generation_loop", "_generation_loop_body", "_generation_step", "is_running"]


def seams(api: Any, runner: Any, cache: Any) -> None:
    """Refuse (``SeamMissing``) unless the continuous-batching modules have what this hooks."""
    require_seams("transformers", api, ["ContinuousBatchingManager", "PagedAttentionCache"], written_for=WRITTEN_FOR)
    require_seams("transformers", runner, ["get_cuda_pools"], written_for=WRITTEN_FOR)
    require_seams("transformers", cache, ["PagedAttentionMemoryHandler", "group_layers_by_attn_type"], written_for=WRITTEN_FOR)
    require_seams("transformers", api.ContinuousBatchingManager, HOOKED, written_for=WRITTEN_FOR)


class Port(EnginePort):
    """The port with a ceiling on the KV layout: transformers sizes its batch tensors (the
    attention mask: batch tokens by pages) by the cache's pages, so the layout stops at
    transformers' own sizing of the device, not at what the device could hold."""

    max_blocks = 0

    def lay_out_kv(self) -> None:
        s = self.settings
        if s.standby:  # the primary's windows: its ceiling
            super().lay_out_kv()
            return
        layout = self.layout = self.engine.kv_layout()
        kv = self.mem.kv_cache(**layout.describe(), max_blocks=self.max_blocks, expect=s.expect)
        if s.retain:
            self.group = self.mem.retain(s.retain)
        self.engine.bind_kv(kv.tensors(layout.dtype))


class Engine:
    """This process's engine: its settings, its port once a manager is made."""

    def __init__(self, settings: Settings, max_blocks: int) -> None:
        if settings.weights_to or settings.share_weights:
            raise Unsupported("weights_to= / share_weights=: transformers' model is built by its caller; gpumem cannot share it (docs/engines.md)")
        self.s, self.max_blocks = settings, max_blocks
        self.adapter = Transformers()
        self.port: Port | None = None
        self.serving = False
        self.stepping = threading.Lock()  # held by the generation thread's step: sleep() waits for it
        self.woken = threading.Event()  # set when what slept wakes: the loop steps again at once

    def attach(self, model: Any) -> Port:
        """The port for ``model``'s manager; the weights moved into the model arena once."""
        if model.device.type != "cuda" or getattr(model, "_device_mesh", None) is not None:
            raise Unsupported(f"gpumem lays out one CUDA device per process; the model is on {model.device} (tensor parallel: no)")
        if self.port is None:
            import torch

            port = self.port = Port(self.adapter, self.s)
            seen: set[int] = set()
            with torch.no_grad(), port.mem.model.allocating():
                for module in model.modules():
                    for t in [*module._parameters.values(), *module._buffers.values()]:
                        if t is not None and t.is_cuda and id(t) not in seen:  # tied weights: once
                            seen.add(id(t))
                            t.data = t.data.clone()
            torch.cuda.empty_cache()  # their first copies back to the device
            self.model = model
        elif self.model is not model:
            raise Unsupported("one model per process on gpumemd: this engine serves another already")
        return self.port

    def size(self, cache_mod: Any, config: Any, cb: Any, dtype: Any) -> tuple[int, int]:
        """(max batch tokens, blocks): transformers' own solver over the device but the weights."""
        import torch

        groups, types = cache_mod.group_layers_by_attn_type(config)
        handler = cache_mod.PagedAttentionMemoryHandler(config=config, continuous_batching_config=cb, dtype=dtype, group_types=types, group_size=len(groups[0]))
        handler.available_memory = torch.cuda.mem_get_info()[1] - self.live().mem.model.committed - CONTEXT_BYTES
        tokens, blocks = handler.infer_max_batch_tokens_and_num_blocks()
        return tokens, (self.max_blocks - TRASH if self.max_blocks else blocks)

    def live(self) -> Port:
        if self.port is None:
            raise InvalidArgument(f"engine '{self.s.name}' has no manager yet")
        return self.port

    def start_serving(self) -> None:
        """Once the graphs are captured (or the loop starts without them): the round's
        blocks, the follower, a standby's settling. A later manager takes the blocks as they are."""
        port, adapter = self.live(), self.adapter
        if self.serving:
            adapter.committed(port.mem.kv.blocks if port.mem.kv else adapter.count)
            return
        port.captured({})
        port.started()
        adapter.committed(port.blocks())
        port.follow()
        self.serving = True
        if self.s.standby:
            port.settle()


_engine: list[Engine] = []


def engine() -> Engine:
    if not _engine:
        raise InvalidArgument("gpumem.integrations.transformers.enable(name) was not called in this process")
    return _engine[0]


def enable(name: str, *, max_blocks: int = 0, **options: Any) -> None:
    """Put the continuous-batching managers this process makes from now on on gpumemd
    (``options``: gpumem.port.Settings; ``max_blocks``: the layout's rows instead of
    transformers' own sizing of the device)."""
    try:
        from transformers.generation.continuous_batching import cache as cache_mod
        from transformers.generation.continuous_batching import continuous_api as api
        from transformers.generation.continuous_batching import model_runner as runner
    except ImportError as e:
        raise SeamMissing(f"transformers' continuous batching cannot be imported ({e}); gpumem's adapter was written for transformers {WRITTEN_FOR}") from e
    if _engine and _engine[0].port is not None:
        raise InvalidArgument(f"engine '{_engine[0].s.name}' has made a manager already: enable() once per process, first")
    _engine[:] = [Engine(Settings(name, **options), max_blocks)]
    if getattr(api, "_gpumem_patched", False):
        return
    seams(api, runner, cache_mod)

    class Cache(api.PagedAttentionCache):  # type: ignore[misc]
        def __init__(self, config: Any, continuous_batching_config: Any, device: Any, distributed_helper: Any, tp_plan: Any, dtype: Any) -> None:
            e, cb = engine(), continuous_batching_config
            layer_types(config)
            if distributed_helper.tp_size > 1:
                raise Unsupported("tensor parallelism: gpumem lays out one CUDA device per process")
            tokens, blocks = e.size(cache_mod, config, cb, dtype)
            asked = cb.num_blocks, cb.max_batch_tokens
            cb.num_blocks, cb.max_batch_tokens = 1, tokens  # transformers allocates one block here: replaced
            try:
                super().__init__(config, cb, device, distributed_helper, tp_plan, dtype)
            finally:
                cb.num_blocks, cb.max_batch_tokens = asked
            require_seams("transformers", self, ["read_trash_index", "sentinel_index", "write_trash_index", "_block_manager"], written_for=WRITTEN_FOR)
            require_seams("transformers", self._block_manager, ["_uninit_block_ids", "_init_block_ids", "_hash_to_id", "_id_to_block"], written_for=WRITTEN_FOR)
            port, e.adapter.cache = e.live(), self
            if port.layout is None:
                port.max_blocks = blocks + TRASH
                port.lay_out_kv()
            elif port.layout != e.adapter.kv_layout() or port.mem.kv is None:
                raise Unsupported(f"engine '{e.s.name}': a manager with another KV layout than its first ({port.layout}); one per process")
            else:
                e.adapter.bind_kv(port.mem.kv.tensors(port.layout.dtype))

    class Manager(api.ContinuousBatchingManager):  # type: ignore[misc]
        def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
            self._gpumem = engine().attach(model)
            self._gpumem_warming = False
            super().__init__(model, *args, **kwargs)

        def warmup(self) -> None:
            e = engine()
            e.adapter.manager, self._gpumem_warming = self, True
            try:
                with self._gpumem.mem.running():
                    super().warmup()
            finally:
                self._gpumem_warming = False
            e.start_serving()

        def _create_batch_processor(self) -> Any:
            e = engine()
            e.adapter.manager = self
            with self._gpumem.mem.running():
                processor = super()._create_batch_processor()
            if not self._gpumem_warming:
                self.batch_processor = processor
                e.start_serving()  # no warm-up: graphs come at first use, in the graphs arena's pool
            return processor

        def _run_generation_loop(self) -> None:
            e = engine()
            while self._gpumem.mem.asleep:  # a settled standby: its memory comes back with take_over()
                if self.background_thread_status.local_status:
                    return
                e.woken.wait(0.1)
            with self._gpumem.mem.running():
                super()._run_generation_loop()

        def _generation_loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
            e, port = engine(), self._gpumem
            if port.mem.asleep:  # requests wait for wake() or take_over(); a stop ends the loop
                if self.background_thread_status.local_status and not batch_processor.has_pending_requests():
                    return False
                e.woken.wait(0.1)
                return True
            with e.stepping:
                if batch_processor.has_pending_requests():
                    port.before_step()
                else:
                    port.idle()
                result: bool = super()._generation_loop_body(batch_processor, bootstrapping)
                port.after_step()
                return result

        def _generation_step(self) -> None:
            self._gpumem.scheduled()  # blocks taken, the step not run: no directory entry vouches for them
            super()._generation_step()

    api.ContinuousBatchingManager, api.PagedAttentionCache = Manager, Cache
    runner.get_cuda_pools = graph_pools
    api._gpumem_patched = True


def graph_pools() -> tuple[Any, Any]:
    """``model_runner.get_cuda_pools``'s stand-in: the graphs arena's pool and its id."""
    pool = engine().live().mem.graphs.mem_pool
    return pool, pool.id


def sleep(*tags: str, drop: Iterable[str] = ("kv",)) -> None:
    """Put the engine's memory to sleep between steps (``EnginePort.sleep``: by default
    weights and graphs kept in host memory, the KV cache dropped with the prefix cache).
    Refused while requests hold KV blocks."""
    e = engine()
    port = e.live()
    if not e.stepping.acquire(timeout=STEP_WAIT_S):
        raise InvalidArgument(f"engine '{e.s.name}': its step did not end within {STEP_WAIT_S:g}s; sleep() waits for it")
    try:
        e.adapter.synchronize()
        e.woken.clear()
        port.sleep(*tags, drop=drop)
    finally:
        e.stepping.release()


def prepare_sleep(*tags: str, drop: Iterable[str] = ("kv",)) -> None:
    """The host buffers ``sleep`` copies into, made ahead (``EngineMemory.prepare_sleep``)."""
    engine().live().prepare_sleep(*tags, drop=drop)


def wake(*, wait: float = DEFAULT_WAKE_WAIT_S) -> None:
    """Wake what ``sleep`` put to sleep, at the same addresses; waiting requests run then."""
    e = engine()
    e.live().wake(wait=wait)
    e.adapter.zero_trash()  # a dropped KV cache woke: the read trash reads zeros again
    e.woken.set()


def take_over(*, wait: float) -> TakeOver:
    """A standby (``enable(name, standby=(group, secret))``, its manager warmed up and
    started): adopt the primary's KV cache once it died (``EnginePort.take_over``); the
    loop serves from then on."""
    e = engine()
    took = e.live().take_over(wait=wait)
    e.woken.set()
    return took


def retain_secret() -> str:
    """The secret of the retain group ``enable(name, retain=group)`` named, for a standby."""
    return engine().live().retain_secret()


def port() -> EnginePort:
    """The engine's port (once a manager was made): its ``mem`` (arenas, KV cache), its follower."""
    return engine().live()
