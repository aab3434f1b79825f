"""What a built nano-vllm engine is measured by besides its tokens: each probe reads its
model runner (and on gpumemd the arenas of gpumem.integrations.nanovllm, ``runner._gpumem``)
and returns JSON-ready figures. ``diagnose`` runs one so that a failing probe says why in
the figures instead of ending the run.

- ``kv_scan``: what the KV cache's first blocks hold before any generation.
- ``StepParts``: the wall time of a step's pieces (``run``, the graphs' ``replay``, the
  ``sampler``), the same in both modes.
- ``device_use``: the device's used bytes, and those of the engine's arenas.
- ``borrow_overlaps``, ``sampler_borrowing``: whether the sampler's borrowed temporaries
  can meet what the decode graphs keep, and the reserved memory they add.
- ``model_arena_live``: what lives in the model arena a standby drops.

Used by bench/nanovllm_kit.py's ``engine`` command and bench/failover_engines.py's
standby. Nothing here imports the kit: it runs as a script (``__main__``), so an import
of it from here would load a second copy whose stand-in switches and sampler are not the
engine's; what a probe needs of the kit's model (its sampler, its logits' shape) is
passed in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def diagnose(out: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    """``out[key] = fn()``; a diagnostic that fails says why instead of ending the run."""
    try:
        out[key] = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the figures
        out[key] = {"error": f"{type(exc).__name__}: {exc}"}


def kv_scan(torch: Any, runner: Any, blocks: int, limit: int = 2048) -> dict[str, int]:
    """What the KV cache's first blocks hold before any generation (the ones a run's
    sequences get): non-finite and non-zero elements, over every layer's K and V."""
    n = min(blocks, limit)
    found = {"blocks": n, "elements": 0, "nonfinite": 0, "nonzero": 0}
    for module in runner.model.modules():
        if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
            for cache in (module.k_cache, module.v_cache):
                for start in range(0, n, 256):
                    part = cache[start:min(n, start + 256)]
                    found["elements"] += part.numel()
                    found["nonfinite"] += int((~torch.isfinite(part)).sum())
                    found["nonzero"] += int((part != 0).sum())
    return found


class StepParts:
    """Wall time of each call of a step's pieces, the same in both modes: the runner's
    ``run`` (prepare, forward, sample, read back: it waits for the GPU), the decode
    graphs' ``replay`` (launch, and on gpumemd the replay lease) and the ``sampler``
    (launches, and on gpumemd the borrow)."""

    def __init__(self) -> None:
        self.spent: dict[str, list[float]] = {"run": [], "replay": [], "sampler": []}

    def timed(self, key: str, fn: Any) -> Any:
        spent = self.spent[key]

        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - started)

        return call

    def install(self, runner: Any) -> None:
        runner.run = self.timed("run", runner.run)
        runner.sampler = self.timed("sampler", runner.sampler)
        if getattr(runner, "graphs", None):
            runner.graphs = {bs: _TimedGraph(g, self.timed("replay", g.replay)) for bs, g in runner.graphs.items()}

    def medians_ms(self) -> dict[str, float]:
        return {key: 1000 * statistics.median(spent) if spent else 0.0 for key, spent in self.spent.items()}

    def clear(self) -> None:
        for spent in self.spent.values():
            spent.clear()


class _TimedGraph:
    """A captured graph whose ``replay`` is timed; the rest is the graph's."""

    def __init__(self, graph: Any, replay: Any) -> None:
        self._graph = graph
        self.replay = replay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._graph, name)


def device_use(torch: Any, runner: Any) -> dict[str, int]:
    """The device's used bytes, and those of this engine's gpumemd arenas (0 shipped)."""
    free, total = torch.cuda.mem_get_info()
    mem = getattr(runner, "_gpumem", None)
    arenas = 0 if mem is None else mem.model.committed + mem.graphs.committed + mem.kv.pool.arena.committed
    return {"used_bytes": total - free, "arena_bytes": arenas, "outside_arenas_bytes": total - free - arenas}


def borrow_overlaps(runner: Any, mem: Any, logits_at: list[int]) -> dict[str, int]:
    """Whether what the sampler borrows (the graph pool's free runs) can meet what the
    decode graphs keep between replays (their static inputs and output, graph_vars) or
    the logits the sampler reads: overlaps, and those in the graphs arena at all."""
    base, end = mem.graphs.address, mem.graphs.address + mem.graphs.reserved
    runs = [(base + r.offset, base + r.offset + r.size) for r in mem.graph_pool.free_runs]
    kept = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in runner.graph_vars.values()]
    return {
        "free_runs": len(runs),
        "graph_vars_overlapping_runs": sum(1 for lo, hi in kept if any(a < hi and lo < b for a, b in runs)),
        "graph_vars_in_graphs_arena": sum(1 for lo, _ in kept if base <= lo < end),
        "logits_in_graphs_arena": sum(1 for at in logits_at if base <= at < end),
        "logits_seen": len(logits_at),
    }


def sampler_borrowing(torch: Any, mem: Any, sampler: Any, rows: int, vocab: int) -> dict[str, int]:
    """``sampler``'s temporaries over ``rows`` bf16 logit rows of ``vocab``: the reserved
    peak they add with torch's own allocator, and with borrowing from the graph pool's
    free runs (the borrow pool's segments alias graph-pool memory: left out, as
    gpumem.memory_reserved does)."""
    import gpumem

    with mem.running():
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        temperatures = torch.ones(rows, device="cuda")
    need = 4 * logits.numel()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    result = sampler(logits, temperatures)  # torch's default allocator: fresh segments
    del result
    plain = torch.cuda.max_memory_reserved() - base
    # The first borrow warms cuBLAS and builds the borrow pool; the copy of its result
    # out of the runs leaves a block cached where steady steps find it.
    mem.borrowed(sampler, logits, temperatures, need_bytes=need)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = gpumem.memory_reserved()
    aliases = torch.cuda.memory_reserved() - base
    mem.borrowed(sampler, logits, temperatures, need_bytes=need)
    borrowed = torch.cuda.max_memory_reserved() - aliases - base
    return {"temporaries_bytes": plain, "borrowed_peak_bytes": borrowed, "need_bytes": need}


def model_arena_live(runner: Any) -> dict[str, Any]:
    """What lives in the engine's model arena (torch's snapshot of its pool: host
    bookkeeping, readable while the arena sleeps): blocks in use and their bytes, how many
    are the decode graphs' static inputs and output (``graph_vars``, rewritten or zeroed
    before a replay reads them), and the sizes of the others, largest first (a standby
    drops this arena: cuBLAS's workspaces, scratch, are expected; anything else with
    contents would be lost)."""
    inputs = {t.data_ptr() for t in getattr(runner, "graph_vars", {}).values()}
    live = [b for seg in runner._gpumem.model.torch_pool().segments() for b in seg["blocks"] if b["state"] != "inactive"]
    others = sorted((b["size"] for b in live if b["address"] not in inputs), reverse=True)
    return {"blocks": len(live), "bytes": sum(b["size"] for b in live), "graph_vars": len(live) - len(others),
            "graph_vars_expected": len(inputs), "other_sizes": others[:16], "other_bytes": sum(others)}
