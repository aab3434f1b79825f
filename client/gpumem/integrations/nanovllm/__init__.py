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
At run time the block manager follows the KV pool (gpumem.port.blocks):
before each step the scheduler grows ahead of need and answers the daemon's shrinks,
moving live blocks down with device-to-device copies; ``idle(llm)`` answers them while
the engine has nothing to do (``follow=False``: the round's blocks, fixed).
What is nano-vllm's here is its adapter (``adapter.NanoVllm``: the port's questions
answered over its fields) and the patches below; the rest is the engine port
(gpumem.port, docs/engines.md "The engine port"), every engine's.
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
before it is written anew (gpumem.port.prefix). The standby side
is ``enable(name, standby=(group, secret))``: the engine builds as usual (its own
weights) but reserves the primary's KV windows instead of declaring a cache (no round),
builds its KV tensors there and captures its graphs on them. Once built it settles
(gpumem.port.takeover): it rehearses serving on its placeholder, so that
its first step after the take-over pays no first-use costs (``standby_rehearses``), resets
its scheduler and block manager, and puts its own memory to sleep (``standby_sleeps``:
its graph pool kept in host memory, its model arena dropped when it holds no weights).
``take_over(llm, wait=)`` then adopts the pool and the directory into the reservation,
wakes what slept, sizes the block manager to the adopted blocks and seeds its prefix
cache. Run no step before ``take_over``.
With ``weights_to=<the standby's name>`` on the primary and ``share_weights=True`` on the
standby, the standby maps the primary's weights read-only instead of loading its own
copy (gpumem.port.weights): before it takes over it holds only its
placeholder, and in host memory its graph pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from gpumem.errors import InvalidArgument
from gpumem.integrations.nanovllm.adapter import NanoVllm
from gpumem.port.adapter import require_seams
from gpumem.port.engine_port import EnginePort
from gpumem.port.settings import Settings
from gpumem.port.takeover import TakeOver
from gpumem.sleep import DEFAULT_WAKE_WAIT_S

_settings: list[Settings] = []


def enable(name: str, **options: Any) -> None:
    """Put the nano-vllm engines this process builds from now on on gpumemd (``options``:
    ``gpumem.port.Settings``'s fields)."""
    from nanovllm.engine import block_manager, llm_engine, model_runner

    settings = Settings(name, **options)
    runner = model_runner.ModelRunner
    for owner, names in [(runner, ("allocate_kv_cache", "capture_cudagraph", "run", "exit")), (llm_engine, ("Scheduler", "LLMEngine")),
                         (llm_engine.Scheduler, ("schedule", "postprocess", "preempt")), (block_manager, ("Block",)),
                         (model_runner, ("Qwen3ForCausalLM", "load_model") if settings.share_weights else ())]:
        require_seams("nano-vllm-fork", owner, names, written_for="20260210 (the seams as they are there)")
    _settings[:] = [settings]
    if getattr(runner, "_gpumem_patched", False):
        return
    init, capture, run_, exit_ = runner.__init__, runner.capture_cudagraph, runner.run, runner.exit
    engine_init = llm_engine.LLMEngine.__init__

    def engine__init__(self: Any, model: str, **kwargs: Any) -> None:
        engine_init(self, model, **kwargs)
        self.model_runner.gpumem_port.engine.llm = self
        if self.model_runner.gpumem_port.settings.standby:  # built, its graphs captured on the placeholder
            self.model_runner.gpumem_port.settle()

    def __init__(self: Any, config: Any, rank: int, event: Any) -> None:
        if config.tensor_parallel_size != 1:
            raise InvalidArgument("gpumem's nano-vllm integration runs one engine per process (tensor_parallel_size 1)")
        from nanovllm import SamplingParams

        adapter = NanoVllm(model_runner, block_manager.Block, lambda n: SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True))
        adapter.runner = self
        self.gpumem_port = config.gpumem_port = port = EnginePort(adapter, _settings[0])
        self._gpumem = port.mem
        with port.starting():
            init(self, config, rank, event)
        port.started()
        if port.settings.borrow_sampler:
            sampler = self.sampler
            self.sampler = lambda logits, *a, **k: port.mem.borrowed(sampler, logits, *a, need_bytes=4 * logits.numel(), **k)

    def allocate_kv_cache(self: Any) -> None:
        self.gpumem_port.lay_out_kv()

    def capture_cudagraph(self: Any) -> None:
        capture(self)
        self.graphs = self.gpumem_port.captured(self.graphs)

    def run(self: Any, seqs: Any, is_prefill: bool) -> Any:
        with self._gpumem.running():
            return run_(self, seqs, is_prefill)

    def exit(self: Any) -> None:
        exit_(self)
        self.gpumem_port.close()

    class Scheduler(llm_engine.Scheduler):  # type: ignore[misc]
        def __init__(self, config: Any) -> None:
            self.gpumem_port = port = config.gpumem_port
            config.num_kvcache_blocks = port.blocks()
            super().__init__(config)
            port.engine.scheduler = self
            port.follow()

        def schedule(self) -> Any:
            self.gpumem_port.before_step()
            scheduled = super().schedule()
            self.gpumem_port.scheduled()  # before the step writes a block the directory vouches for
            return scheduled

        def postprocess(self, seqs: Any, token_ids: Any) -> Any:
            self.gpumem_port.after_step()  # the step's tokens reached the host: its KV writes are done
            return super().postprocess(seqs, token_ids)

        def preempt(self, seq: Any) -> None:
            self.gpumem_port.preempted()
            super().preempt(seq)

    for name, patched in [("__init__", __init__), ("allocate_kv_cache", allocate_kv_cache),
                          ("capture_cudagraph", capture_cudagraph), ("run", run), ("exit", exit)]:
        setattr(runner, name, patched)
    llm_engine.Scheduler = Scheduler
    llm_engine.LLMEngine.__init__ = engine__init__  # LLM's too: it inherits it
    runner._gpumem_patched = True


def port(llm: Any) -> EnginePort:
    """The engine port of an engine built after ``enable`` (its follower's figures, its
    ``EngineMemory`` as ``port(llm).mem``)."""
    return cast(EnginePort, llm.model_runner.gpumem_port)


def idle(llm: Any) -> None:
    """Call while ``llm`` has nothing to do (between requests): answers the daemon's
    shrinks and says the engine idles, which its steps cannot do when none run."""
    port(llm).idle()


def retain_secret(llm: Any) -> str:
    """The secret of the retain group ``enable(retain=...)`` named, for the standby."""
    return port(llm).retain_secret()


def shared_weights_bytes(llm: Any) -> int:
    """What a standby built with ``share_weights=True`` maps of its primary's model arena
    (its weights and buffers); 0 for an engine that loaded its own."""
    return port(llm).shared_weights_bytes()


def take_over(llm: Any, *, wait: float) -> TakeOver:
    """A standby (``enable(..., standby=(group, secret))``): wait up to ``wait`` seconds for
    the primary's death and its fence, adopt its KV cache and prefix directory into the
    reservation (the graphs captured on it replay on the adopted rows), wake what the
    standby put to sleep, size the block manager to the adopted blocks and seed its
    prefix cache from the directory's trusted entries; returns what was seeded and when
    each part was done (``gpumem.port.takeover.TakeOver``). The engine serves from then on."""
    return port(llm).take_over(wait=wait)


def sleep(llm: Any, *tags: str, drop: Iterable[str] = ("kv",)) -> None:
    """Put an idle engine's memory to sleep (``EngineMemory.sleep``; default: weights and
    graph pool kept in host memory, the KV cache dropped). Refused while sequences hold
    KV blocks; a dropped KV cache takes the prefix cache with it."""
    port(llm).sleep(*tags, drop=drop)


def prepare_sleep(llm: Any, *tags: str, drop: Iterable[str] = ("kv",)) -> None:
    """Make the host buffers ``sleep(llm, *tags, drop=drop)`` copies into, ahead
    (``EngineMemory.prepare_sleep``): its first call then costs the copies only."""
    port(llm).prepare_sleep(*tags, drop=drop)


def wake(llm: Any, *, wait: float = DEFAULT_WAKE_WAIT_S) -> None:
    """Wake what ``sleep`` put to sleep (``EngineMemory.wake``)."""
    port(llm).wake(wait=wait)
