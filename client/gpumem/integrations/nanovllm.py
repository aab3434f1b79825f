"""nano-vllm (the ``nano-vllm-fork`` package) on gpumemd, its own code unchanged.

    from gpumem.integrations import nanovllm
    nanovllm.enable("engine-a", expect=2)     # before the engine is built; per process
    llm = LLM(model_dir, max_num_seqs=64)     # nano-vllm as usual

The seams (``ModelRunner`` and ``llm_engine.Scheduler``, patched once, in this process):
``__init__`` runs inside ``EngineMemory.running()``, so weights, warm-up activations and
the decode graphs land in elastic arenas; ``allocate_kv_cache`` declares a paged KV cache
(virtual, placeholder under it) instead of sizing one from free memory;
``capture_cudagraph`` then registers the graph pool, trims the arenas and leases every
replay, and the round's report goes out without waiting; the scheduler, built after the
tokenizer loads, waits for the round and takes its block count; ``run`` allocates in the
model arena, the sampler borrows the graph pool's free runs; ``exit`` closes the session.
At run time the block manager follows the KV pool (gpumem.integrations.nanovllm_blocks):
before each step the scheduler grows ahead of need and answers the daemon's shrinks,
moving live blocks down with device-to-device copies; ``idle(llm)`` answers them while
the engine has nothing to do (``follow=False``: the round's blocks, fixed).
``gpu_memory_utilization`` is not read: the round sizes the KV cache. One process per
engine (``tensor_parallel_size`` 1).

Between batches an idle engine sleeps and wakes (``EngineMemory.sleep``): by default
its weights and graph pool go to host memory and its KV cache is dropped, with the
block manager's prefix cache, whose blocks no longer hold what it says:

    nanovllm.prepare_sleep(llm)               # optional, once: host buffers registered ahead
    nanovllm.sleep(llm)                       # the GPU's memory is others' meanwhile
    nanovllm.wake(llm)                        # same addresses: the graphs replay as captured

``enable(name, retain="group")`` keeps the KV cache and a prefix directory for a
successor (gpumem.retain; ``retain_secret(llm)`` is the secret to hand over): the
scheduler publishes each full block after the step that wrote it and invalidates a block
before it is written anew (gpumem.integrations.nanovllm_prefix). The standby side
is ``enable(name, standby=(group, secret))``: the engine builds as usual (its own
weights) but reserves the primary's KV windows instead of declaring a cache (no round),
builds its KV tensors there and captures its graphs on them. Once built it settles
(gpumem.integrations.nanovllm_standby): it rehearses serving on its placeholder, so that
its first step after the take-over pays no first-use costs (``standby_rehearses``), resets
its scheduler and block manager, and puts its own memory to sleep (``standby_sleeps``:
its graph pool kept in host memory, its model arena dropped when it holds no weights).
``take_over(llm, wait=)`` then adopts the pool and the directory into the reservation,
wakes what slept, sizes the block manager to the adopted blocks and seeds its prefix
cache. Run no step before ``take_over``.
With ``weights_to=<the standby's name>`` on the primary and ``share_weights=True`` on the
standby, the standby maps the primary's weights read-only instead of loading its own
copy (gpumem.integrations.nanovllm_weights): before it takes over it holds only its
placeholder, and in host memory its graph pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gpumem.engine import EngineMemory
from gpumem.errors import InvalidArgument
from gpumem.integrations import nanovllm_standby, nanovllm_weights
from gpumem.integrations.nanovllm_blocks import BlockFollower
from gpumem.integrations.nanovllm_prefix import DirectoryKeeper
from gpumem.sleep import DEFAULT_WAKE_WAIT_S


@dataclasses.dataclass
class Settings:
    name: str
    device: int | str = 0
    expect: int = 0  # engines the round gathers (0: whoever reported by then)
    headroom_bytes: int = 512 << 20  # left free by the round: what the engine takes past its arenas after it (bench/engine.py: after_round)
    min_blocks: int = 0
    weight: float = 1.0
    borrow_sampler: bool = True
    runtime_dir: str | None = None
    tenant_token_file: str | None = None  # the engine pod's tenant token (its DRA claim's directory gives it)
    follow: bool = True  # the block manager follows the pool at run time
    watermark_blocks: int = 16  # grow once fewer would stay free
    grow_step_blocks: int = 64  # grows in multiples of this
    retain: str = ""  # a retain group for the KV cache and its prefix directory (retain_secret(llm) gives the secret)
    standby: tuple[str, str] | None = None  # (group, secret): build as the standby of the engine retaining that group
    weights_to: str = ""  # with retain: grant the model's weights read-only to this standby (its client name)
    share_weights: bool = False  # with standby: map the primary's weights (its weights_to names this engine), load none
    standby_rehearses: bool = True  # with standby: serve a few requests on the placeholder once built (nanovllm_standby)
    standby_sleeps: bool = True  # with standby: then sleep until take_over (graphs kept, model arena dropped with share_weights)


_settings: list[Settings] = []
_COPY_BLOCKS = 32  # blocks a copy of live blocks gathers at a time


def enable(name: str, **options: Any) -> None:
    """Put the nano-vllm engines this process builds from now on on gpumemd."""
    from nanovllm.engine import block_manager, llm_engine, model_runner

    settings = Settings(name, **options)
    if settings.weights_to and not settings.retain or settings.share_weights and not settings.standby:
        raise InvalidArgument("weights_to= goes with retain= (a primary), share_weights=True with standby= (its standby)")
    _settings[:] = [settings]
    runner = model_runner.ModelRunner
    if getattr(runner, "_gpumem_patched", False):
        return
    init, capture, run_, exit_ = runner.__init__, runner.capture_cudagraph, runner.run, runner.exit
    engine_init = llm_engine.LLMEngine.__init__

    def engine__init__(self: Any, model: str, **kwargs: Any) -> None:
        engine_init(self, model, **kwargs)
        s = _settings[0]
        if s.standby:  # built, its graphs captured on the placeholder: it settles before take_over
            import torch
            from nanovllm import SamplingParams

            nanovllm_standby.settle(
                self, s, params=lambda n: SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True),
                synchronize=torch.cuda.synchronize,
            )

    def __init__(self: Any, config: Any, rank: int, event: Any) -> None:
        if config.tensor_parallel_size != 1:
            raise InvalidArgument("gpumem's nano-vllm integration runs one engine per process (tensor_parallel_size 1)")
        s = _settings[0]
        self._gpumem = mem = EngineMemory(s.name, s.device, runtime_dir=s.runtime_dir, tenant_token_file=s.tenant_token_file)
        with mem.running():
            if s.standby and s.share_weights:
                with nanovllm_weights.standby_model(model_runner, mem.session, s.standby[0]) as shared:
                    init(self, config, rank, event)
                config.gpumem_shared_weights = shared
            else:
                init(self, config, rank, event)
        if s.weights_to:  # built and loaded: every parameter lies where it will stay
            config.gpumem_weights_map = nanovllm_weights.publish(mem.session, s.retain, self.model, mem.model, s.weights_to)
        config.gpumem_round = None if s.standby else mem.start_kv_commit(headroom_bytes=s.headroom_bytes, min_blocks=s.min_blocks, weight=s.weight)
        if s.borrow_sampler:
            sampler = self.sampler
            self.sampler = lambda logits, *a, **k: mem.borrowed(sampler, logits, *a, need_bytes=4 * logits.numel(), **k)

    def allocate_kv_cache(self: Any) -> None:
        hf = self.config.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        s = _settings[0]
        layout = {"layers": hf.num_hidden_layers, "block_shape": (self.block_size, hf.num_key_value_heads, head_dim), "itemsize": self.dtype.itemsize}
        self.config.gpumem_layout = layout
        if s.standby:
            # The primary's KV windows, this process's placeholder under them: the tensors
            # and the graphs captured on them are at the addresses take_over adopts.
            reservation = self._gpumem.session.reserve_retained(*s.standby)
            kv = reservation.paged_kv(**layout)
            self.config.gpumem_reservation, self.config.gpumem_standby_blocks = reservation, kv.blocks
        else:
            kv = self._gpumem.kv_cache(**layout, expect=s.expect)
        layers = kv.tensors(self.dtype)
        caches = iter(layers)
        for module in self.model.modules():
            if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
                module.k_cache, module.v_cache = next(caches)
        every = [t for layer in layers for t in layer]
        self.config.gpumem_copy = lambda src, dst: _copy_blocks(every, src, dst)
        self.config.gpumem_pool = None if s.standby else kv.pool
        self.config.gpumem_group = self._gpumem.retain(s.retain) if s.retain else None
        self.config.gpumem_prefix = self._gpumem.prefix if s.retain else None

    def capture_cudagraph(self: Any) -> None:
        capture(self)
        self.graphs = self._gpumem.graphs_captured(self.graphs)

    def run(self: Any, seqs: Any, is_prefill: bool) -> Any:
        with self._gpumem.running():
            return run_(self, seqs, is_prefill)

    def exit(self: Any) -> None:
        exit_(self)
        self._gpumem.close()

    class Scheduler(llm_engine.Scheduler):  # type: ignore[misc]
        def __init__(self, config: Any) -> None:
            s = _settings[0]
            config.num_kvcache_blocks = config.gpumem_standby_blocks if s.standby else config.gpumem_round.wait()
            super().__init__(config)
            self.gpumem = None if not s.follow or s.standby else BlockFollower(
                config.gpumem_pool, self.block_manager, new_block=block_manager.Block, copy_blocks=config.gpumem_copy,
                sequences=lambda: [*self.running, *self.waiting], watermark=s.watermark_blocks, step=s.grow_step_blocks,
            )
            prefix = config.gpumem_prefix
            self.gpumem_prefix = None if prefix is None else DirectoryKeeper(self.block_manager, prefix)

        def schedule(self) -> Any:
            if self.gpumem is not None:
                self.gpumem.before_step(self.waiting, self.running)
            scheduled = super().schedule()
            if self.gpumem_prefix is not None:
                self.gpumem_prefix.before_step()  # before the step writes a block the directory vouches for
            return scheduled

        def postprocess(self, seqs: Any, token_ids: Any) -> Any:
            if self.gpumem_prefix is not None:
                self.gpumem_prefix.after_step()  # the step's tokens reached the host: its KV writes are done
            return super().postprocess(seqs, token_ids)

        def preempt(self, seq: Any) -> None:
            if self.gpumem is not None:
                self.gpumem.figures.preempted += 1
            super().preempt(seq)

    for name, patched in [("__init__", __init__), ("allocate_kv_cache", allocate_kv_cache),
                          ("capture_cudagraph", capture_cudagraph), ("run", run), ("exit", exit)]:
        setattr(runner, name, patched)
    llm_engine.Scheduler = Scheduler
    llm_engine.LLMEngine.__init__ = engine__init__  # LLM's too: it inherits it
    runner._gpumem_patched = True


def idle(llm: Any) -> None:
    """Call while ``llm`` has nothing to do (between requests): answers the daemon's
    shrinks and says the engine idles, which its steps cannot do when none run."""
    follower = llm.scheduler.gpumem
    if follower is not None:
        follower.idle()


def retain_secret(llm: Any) -> str:
    """The secret of the retain group ``enable(retain=...)`` named, for the standby."""
    group = llm.model_runner.config.gpumem_group
    if group is None:
        raise InvalidArgument("this engine retains nothing: enable(name, retain='group') before building it")
    secret: str = group.secret
    return secret


def shared_weights_bytes(llm: Any) -> int:
    """What a standby built with ``share_weights=True`` maps of its primary's model arena
    (its weights and buffers); 0 for an engine that loaded its own."""
    shared = getattr(llm.model_runner.config, "gpumem_shared_weights", None)
    return 0 if shared is None else shared.map.shared_bytes()


def take_over(llm: Any, *, wait: float) -> nanovllm_standby.TakeOver:
    """A standby (``enable(..., standby=(group, secret))``): wait up to ``wait`` seconds for
    the primary's death and its fence, adopt its KV cache and prefix directory into the
    reservation (the graphs captured on it replay on the adopted rows), wake what the
    standby put to sleep, size the block manager to the adopted blocks and seed its
    prefix cache from the directory's trusted entries; returns what was seeded and when
    each part was done (``nanovllm_standby.TakeOver``). The engine serves from then on."""
    runner = llm.model_runner
    return nanovllm_standby.take_over(
        llm, _settings[0], wait=wait, new_block=_block_class(), restore_inputs=lambda: _zero_graph_inputs(runner),
    )


def _zero_graph_inputs(runner: Any) -> None:
    """The decode graphs' static inputs and output as capture left them (zeros): after a
    dropped model arena woke, the rows a replay does not rewrite must hold token ids,
    positions and block ids in range (gpumem.integrations.nanovllm_standby)."""
    import torch

    with torch.inference_mode():  # made in it (capture_cudagraph): written only in it
        for buffer in getattr(runner, "graph_vars", {}).values():
            buffer.zero_()


def _block_class() -> type:
    from nanovllm.engine import block_manager

    block: type = block_manager.Block
    return block


def _copy_blocks(caches: list[Any], src: list[int], dst: list[int]) -> None:
    """Blocks ``src`` into ``dst`` in every layer's K and V (device to device), complete
    on return: the rows at ``src`` may be unmapped next."""
    import torch

    device = caches[0].device
    for at in range(0, len(src), _COPY_BLOCKS):  # the gather's temporary stays small: it is outside the arenas
        s = torch.tensor(src[at:at + _COPY_BLOCKS], device=device)
        d = torch.tensor(dst[at:at + _COPY_BLOCKS], device=device)
        for cache in caches:
            cache[d] = cache[s]  # gathered first: sources and destinations never overlap
    torch.cuda.synchronize(device)


def sleep(llm: Any, *tags: str, drop: Iterable[str] = ("kv",)) -> None:
    """Put an idle engine's memory to sleep (``EngineMemory.sleep``; default: weights and
    graph pool kept in host memory, the KV cache dropped). Refused while sequences hold
    KV blocks; a dropped KV cache takes the prefix cache with it."""
    mem: EngineMemory = llm.model_runner._gpumem
    dropped = set(drop)
    blocks = llm.scheduler.block_manager
    if "kv" in dropped and (not tags or "kv" in tags):
        if blocks.used_block_ids:
            raise InvalidArgument(
                f"engine '{mem.name}' has {len(blocks.used_block_ids)} KV blocks in use: finish its sequences before its KV "
                "cache sleeps"
            )
        blocks.hash_to_block_id.clear()  # what a block held is gone: no prefix may match it
        if llm.scheduler.gpumem_prefix is not None:
            llm.scheduler.gpumem_prefix.forget_all()  # nor may the retained directory vouch for it
        for block in blocks.blocks:
            block.hash, block.token_ids = -1, []
    mem.sleep(*tags, drop=dropped)


def prepare_sleep(llm: Any, *tags: str, drop: Iterable[str] = ("kv",)) -> None:
    """Make the host buffers ``sleep(llm, *tags, drop=drop)`` copies into, ahead
    (``EngineMemory.prepare_sleep``): its first call then costs the copies only."""
    llm.model_runner._gpumem.prepare_sleep(*tags, drop=drop)


def wake(llm: Any, *, wait: float = DEFAULT_WAKE_WAIT_S) -> None:
    """Wake what ``sleep`` put to sleep (``EngineMemory.wake``)."""
    llm.model_runner._gpumem.wake(wait=wait)
