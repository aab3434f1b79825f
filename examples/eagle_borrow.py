#!/usr/bin/env python3
"""EAGLE-style speculative sampling whose probability tensors borrow a graph pool's free runs.

A toy speculative decoder (random weights, nothing downloaded; CUDA only):

1. The decode graphs are captured into an arena's torch pool (daemon memory): first the
   target model's verification graph (RMSNorm + SiLU MLP layers, an LM head over
   ``--vocab`` tokens, for the draft tokens plus a bonus position), then, under the
   pool's capture lease, the draft head's graph (a chain of draft logits, and a draft
   tree of ``--tree-nodes`` nodes per sequence expanded over the whole vocabulary and
   cut to its top-k). The tree expansion's vocabulary-wide intermediates are
   transient: after capture they are free blocks of the pool that only a replay uses.
   The pool is registered with gpumemd after the first capture and refreshed after the
   second; its free runs are printed.
2. Every decode step replays both graphs under the replay lease, then runs rejection
   sampling in plain torch: target and draft probabilities (softmax over
   ``(batch * draft tokens, vocab)``), draft proposals sampled from the draft
   distribution, the accept test ``coin < min(1, p_target / p_draft)`` per position,
   and a sample from the residual ``max(0, p_target - p_draft)`` at the first
   rejection (or from the target at the bonus position). Those step-local tensors are
   allocated inside ``with session.borrow(pool, user="EAGLE probability borrow")`` and
   deleted before it ends; the accepted token ids are allocated before it.
3. The same steps run twice in one process, with the same seeds: first with plain
   allocations (torch's default pool), then borrowing. Printed per mode: torch's
   ``max_memory_reserved()``, the borrow pool's segment bytes, the reserved bytes
   without them, and the device memory in use (``mem_get_info``) at the step's peak.
   The accepted tokens must be identical in both modes.

About the reserved figure: torch counts the borrow pool's segments in
``memory_reserved()``, although they alias graph-pool memory that is already counted
(the arena pool's segments). The figure that shows what borrowing saves is therefore
"reserved excluding borrow aliases"; the device-level figure needs no correction.

    python examples/eagle_borrow.py                         # starts a private gpumemd
    python examples/eagle_borrow.py --runtime-dir /run/gpumemd --steps 50

Exits 0 when the accepted tokens match, 1 when they do not (or on an error), 2 without
CUDA. ``bench/eagle_borrow.py`` reuses ``build`` and ``compare_modes``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parent.parent
BORROW_USER = "EAGLE probability borrow"
ARENA = "eagle-graphs"
POOL_LABEL = "eagle decode"

DEFAULTS = {
    "batch": 16,
    "draft_tokens": 6,
    "vocab": 128256,
    "hidden": 4096,
    "intermediate": 14336,
    "layers": 2,
    "tree_nodes": 64,
    "top_k": 8,
    "temperature": 1.0,
    "seed": 0,
}


def say(line: str = "") -> None:
    print(line, flush=True)


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f} MiB"


def import_gpumem() -> Any:
    """gpumem, installed or (failing that) from this checkout through bench/_common."""
    try:
        import gpumem
    except ImportError:
        sys.path.insert(0, str(REPO / "bench"))
        try:
            import _common
        except ImportError:
            raise SystemExit(
                "eagle_borrow: cannot import gpumem; install this checkout (pip install -e .) and run again"
            ) from None
        _common.ensure_importable()
        import gpumem
    return gpumem


# ---------------------------------------------------------------------------
# A private daemon
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def private_daemon(device: int = 0, timeout: float = 60.0) -> Iterator[Path]:
    """``python -m gpumemd`` (CUDA backend) in a fresh runtime directory, stopped and
    removed on exit."""
    runtime = Path(tempfile.mkdtemp(prefix="gmd-eagle-", dir="/tmp"))
    log_path = runtime / f"gpumemd{device}.log"
    env = dict(os.environ)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(name, None)  # the private daemon must not talk to our systemd
    argv = [sys.executable, "-m", "gpumemd", "--device", str(device), "--backend", "cuda", "--runtime-dir", str(runtime)]
    say(f"starting: {' '.join(argv)}")
    try:
        with open(log_path, "wb") as log:
            daemon = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                deadline = time.monotonic() + timeout
                while not (runtime / f"gpu{device}.json").exists():
                    if daemon.poll() is not None or time.monotonic() > deadline:
                        log.flush()
                        why = f"exited with status {daemon.returncode}" if daemon.returncode is not None else f"did not start in {timeout:g}s"
                        raise RuntimeError(f"gpumemd {why}; its log ({log_path}):\n{log_path.read_text(errors='replace')}")
                    time.sleep(0.05)
                say(f"gpumemd pid {daemon.pid} serves device {device} from {runtime}")
                yield runtime
            finally:
                if daemon.poll() is None:
                    daemon.terminate()
                    try:
                        daemon.wait(30)
                    except subprocess.TimeoutExpired:
                        daemon.kill()
                        daemon.wait(5)
        if daemon.returncode not in (0, None, -15):
            say(f"warning: gpumemd exited with status {daemon.returncode}; its log:\n{log_path.read_text(errors='replace')}")
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


# ---------------------------------------------------------------------------
# torch memory figures
# ---------------------------------------------------------------------------


def snapshot(torch: Any, pool_id: Any = None) -> list[dict[str, Any]]:
    """torch's segments: of one pool, or (no id) of every pool."""
    try:
        if pool_id is None:
            return list(torch.cuda.memory_snapshot(include_traces=False))
        return list(torch.cuda.memory_snapshot(pool_id, include_traces=False))
    except TypeError:  # a torch without the include_traces switch
        return list(torch.cuda.memory_snapshot() if pool_id is None else torch.cuda.memory_snapshot(pool_id))


def segment_bytes(segments: list[dict[str, Any]]) -> int:
    return sum(int(s["total_size"]) for s in segments)


def device_used(torch: Any) -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


# ---------------------------------------------------------------------------
# The toy model and its graphs
# ---------------------------------------------------------------------------


class Eagle:
    """Random-weight target and draft models, their decode graphs in an arena's pool,
    and the decode step. ``build()`` makes one."""

    def __init__(self, session: Any, *, batch: int, draft_tokens: int, vocab: int, hidden: int, intermediate: int,
                 layers: int, tree_nodes: int, top_k: int, temperature: float, seed: int) -> None:
        import torch

        if batch < 1 or draft_tokens < 1 or vocab < 2 or tree_nodes < 1 or not 0 < top_k <= vocab or temperature <= 0:
            raise ValueError(
                f"need batch >= 1, draft tokens >= 1, vocab >= 2, tree nodes >= 1, 0 < top-k <= vocab, temperature > 0 "
                f"(got {batch}, {draft_tokens}, {vocab}, {tree_nodes}, {top_k}, {temperature})"
            )
        self.torch = torch
        self.session = session
        self.batch, self.draft_tokens, self.vocab, self.hidden = batch, draft_tokens, vocab, hidden
        self.intermediate, self.layers_n, self.tree_nodes, self.top_k = intermediate, layers, tree_nodes, top_k
        self.temperature, self.seed = temperature, seed
        self.device = torch.device("cuda", session.device_ordinal)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)
        self.arena: Any = None
        self.pool: Any = None
        self.target_graph: Any = None
        self.draft_graph: Any = None
        self.outputs: dict[str, Any] = {}

        f16 = torch.float16

        def weight(rows: int, cols: int) -> Any:
            return torch.randn(rows, cols, generator=self.gen, device=self.device, dtype=f16).mul_(cols**-0.5)

        self.lm_head = weight(vocab, hidden)  # the draft head shares the target's LM head, as EAGLE does
        self.mlp = [(weight(intermediate, hidden), weight(hidden, intermediate)) for _ in range(layers)]
        self.draft_fc = weight(hidden, hidden)
        self.chain_embed = weight(draft_tokens, hidden)
        self.tree_embed = weight(tree_nodes, hidden)
        # Static inputs of the graphs, refilled before every replay.
        self.target_in = torch.zeros(batch, draft_tokens + 1, hidden, device=self.device, dtype=f16)
        self.draft_in = torch.zeros(batch, hidden, device=self.device, dtype=f16)

    # ------------------------------------------------------------------ sizes

    def pool_estimate(self) -> int:
        """Bytes the two graphs' pool needs (outputs and transients), roughly."""
        b, d, v, h, i, n = self.batch, self.draft_tokens, self.vocab, self.hidden, self.intermediate, self.tree_nodes
        target = b * (d + 1) * (v * (4 + 2) + i * 2 * 3 + h * 2 * 4)
        draft = b * d * v * (4 + 2) + b * n * (v * (2 + 4 + 4) + h * 2 * 4) + b * (d + n) * h * 2 * 2
        return target + draft

    def step_estimate(self) -> int:
        """Bytes of the step's probability tensors (target and draft, fp32), roughly."""
        return 4 * self.vocab * self.batch * (2 * (self.draft_tokens + 1) + 2 * self.draft_tokens + 4)

    # ------------------------------------------------------------------ forward passes

    def _rms(self, h: Any) -> Any:
        torch = self.torch
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)

    def target_forward(self) -> Any:
        """Logits of the target model at the draft positions and the bonus one: (batch, draft + 1, vocab), fp32."""
        F = self.torch.nn.functional
        h = self.target_in
        for up, down in self.mlp:
            h = h + F.linear(F.silu(F.linear(self._rms(h), up)), down)
        return F.linear(self._rms(h), self.lm_head).float()

    def draft_forward(self) -> tuple[Any, Any, Any]:
        """The draft head: chain logits (batch, draft, vocab) fp32, and the draft tree's
        top-k (scores, ids) per node. The tree's vocabulary-wide logits and
        probabilities are transient: free blocks of the pool once captured."""
        torch = self.torch
        F = torch.nn.functional
        base = F.linear(self._rms(self.draft_in), self.draft_fc)  # (batch, hidden)
        chain = self._rms(base.unsqueeze(1) + self.chain_embed)  # (batch, draft, hidden)
        draft_logits = F.linear(chain, self.lm_head).float()
        tree = self._rms(base.unsqueeze(1) + self.tree_embed)  # (batch, nodes, hidden)
        tree_logits = F.linear(tree, self.lm_head)  # (batch, nodes, vocab) fp16
        tree_probs = torch.softmax(tree_logits.float(), dim=-1)  # and two fp32 ones
        scores, ids = tree_probs.topk(self.top_k, dim=-1)
        return draft_logits, scores, ids

    def reseed(self, step: int, stream: int) -> None:
        """Seed the generator for one of a step's random streams (inputs, sampling):
        the same step draws the same numbers in every mode."""
        self.gen.manual_seed((self.seed * 1_000_003 + 4 * (step + 16) + stream) & 0x7FFF_FFFF_FFFF_FFFF)

    def fill_inputs(self, step: int) -> None:
        self.reseed(step, 0)
        self.target_in.normal_(generator=self.gen)
        self.draft_in.normal_(generator=self.gen)

    # ------------------------------------------------------------------ capture

    def capture(self, log: Callable[[str], None] = say) -> None:
        """Commit an arena, capture the target graph into its pool, register the pool,
        capture the draft graph under the capture lease, refresh the pool."""
        torch = self.torch
        session = self.session
        commit = -(-(int(self.pool_estimate() * 1.5) + GiB) // GiB) * GiB
        self.arena = session.create_arena(ARENA, commit + 4 * GiB)
        self.arena.commit(commit)
        log(f"arena '{ARENA}': {commit // GiB} GiB committed at {self.arena.address:#x} for the decode graphs")

        self.fill_inputs(-2)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: kernels and the capture stream's cuBLAS workspace, in torch's default pool
                self.target_forward()
                self.draft_forward()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

        # The first capture: no lease exists before the pool is registered.
        self.target_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.target_graph, pool=self.arena.torch_pool().graph_pool, stream=stream):
            self.outputs["target_logits"] = self.target_forward()
        self.pool = self.arena.register_graph_pool(POOL_LABEL)
        log(f"target graph captured; graph pool {self.pool.id} registered (epoch {self.pool.epoch})")
        self.print_runs(log)

        # Later captures into the pool hold its capture lease, then report the new runs.
        self.draft_graph = torch.cuda.CUDAGraph()
        with (
            session.capture(self.pool, label="eagle draft capture"),
            torch.cuda.graph(self.draft_graph, pool=self.arena.torch_pool().graph_pool, stream=stream),
        ):
            draft_logits, scores, ids = self.draft_forward()
        self.pool.refresh(recaptured=True)
        self.outputs.update(draft_logits=draft_logits, tree_scores=scores, tree_ids=ids)
        torch.cuda.synchronize()
        log(f"draft graph captured under the capture lease; pool refreshed (epoch {self.pool.epoch})")
        self.print_runs(log)
        self.check_graphs(log)

    def print_runs(self, log: Callable[[str], None] = say) -> None:
        runs = [r.size for r in self.pool.free_runs]
        shown = ", ".join(mib(size) for size in runs[:12]) + (f", ... ({len(runs) - 12} more)" if len(runs) > 12 else "")
        extents = sum(e.size for e in self.pool.extents)
        log(f"  pool extents {mib(extents)}; free runs: {len(runs)}, {mib(sum(runs))} in all, largest {mib(max(runs, default=0))}")
        log(f"  runs: [{shown}]")

    def replay(self) -> None:
        # Captured first, replayed first: the draft graph may have reused blocks the
        # target graph frees, so the graphs replay in the order they were captured.
        with self.session.replay(self.pool):
            self.target_graph.replay()
            self.draft_graph.replay()

    def check_graphs(self, log: Callable[[str], None] = say) -> None:
        """The graphs' outputs (in daemon memory) against an eager run."""
        torch = self.torch
        self.fill_inputs(-3)
        self.replay()
        eager_target = self.target_forward()
        eager_draft, _, _ = self.draft_forward()
        torch.cuda.synchronize()
        for name, eager in (("target_logits", eager_target), ("draft_logits", eager_draft)):
            got = self.outputs[name]
            if not self.in_arena(got):
                raise RuntimeError(f"the {name} graph output at {got.data_ptr():#x} is not in arena '{ARENA}'")
            if not (torch.isfinite(got).all() and torch.allclose(got, eager, atol=2e-2, rtol=2e-2)):
                diff = float((got - eager).abs().max())
                raise RuntimeError(f"the {name} graph output differs from an eager run (max abs difference {diff:g})")
        log("graph outputs match an eager run")

    def in_arena(self, t: Any) -> bool:
        a = self.arena
        return a.address <= t.data_ptr() < a.address + a.reserved

    # ------------------------------------------------------------------ the step

    def accept(self, tokens: Any, counts: Any, at_peak: Callable[[Any], None] | None = None) -> None:
        """Rejection sampling over this step's logits, into ``tokens`` (batch, draft + 1;
        -1 past the last accepted token and the one sampled after it) and ``counts``
        (batch: draft tokens accepted). Every tensor made here is deleted before it
        returns: inside a borrow scope, none may outlive it."""
        torch = self.torch
        bs, d, v, gen, dev = self.batch, self.draft_tokens, self.vocab, self.gen, self.device
        target_logits, draft_logits = self.outputs["target_logits"], self.outputs["draft_logits"]

        target_probs = torch.softmax(target_logits / self.temperature, dim=-1)  # (bs, d + 1, v)
        draft_probs = torch.softmax(draft_logits / self.temperature, dim=-1)  # (bs, d, v)
        # The draft model's proposals, sampled from its distribution (inverse CDF).
        draft_cdf = draft_probs.cumsum(-1)
        draft_u = torch.rand((bs, d, 1), generator=gen, device=dev) * draft_cdf[..., -1:]
        draft_ids = torch.searchsorted(draft_cdf, draft_u).squeeze(-1).clamp_(max=v - 1)  # (bs, d)
        del draft_cdf, draft_u
        coins = torch.rand((bs, d), generator=gen, device=dev)
        coins_for_final = torch.rand((bs, 1), generator=gen, device=dev)
        # Accept draft token i if coin < min(1, p_target / p_draft); keep the accepted prefix.
        p_target = target_probs[:, :d].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
        p_draft = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
        accepted = coins < torch.clamp(p_target / p_draft.clamp_min(1e-30), max=1.0)
        prefix = accepted.to(torch.int64).cumprod(dim=1)
        n_accepted = prefix.sum(dim=1)  # (bs,)
        # At the first rejection, sample from the residual max(0, p_target - p_draft);
        # after a fully accepted chain, from the target at the bonus position.
        rows = torch.arange(bs, device=dev)
        target_at = target_probs[rows, n_accepted]  # (bs, v)
        draft_at = draft_probs[rows, n_accepted.clamp(max=d - 1)] * (n_accepted < d).unsqueeze(-1)
        residual = (target_at - draft_at).clamp_(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_at)
        cdf = residual.cumsum(-1)
        final = torch.searchsorted(cdf, coins_for_final * cdf[:, -1:]).clamp_(max=v - 1)  # (bs, 1)
        tokens[:, :d].copy_(torch.where(prefix.bool(), draft_ids, -1))
        tokens.scatter_(1, n_accepted.unsqueeze(1), final)
        counts.copy_(n_accepted)
        if at_peak is not None:
            at_peak(target_probs)  # every step-local tensor is still alive here
        del target_probs, draft_probs, draft_ids, coins, coins_for_final, p_target, p_draft, accepted, prefix
        del n_accepted, rows, target_at, draft_at, residual, cdf, final

    def step(self, index: int, *, borrow: bool, at_peak: Callable[[Any, Any], None] | None = None) -> tuple[Any, Any]:
        """One decode step: replay, then rejection sampling (borrowing, or not). Returns
        the accepted tokens and counts, on the host."""
        torch = self.torch
        self.fill_inputs(index)
        self.replay()
        # The step's outputs outlive it: allocated before the borrow scope.
        tokens = torch.full((self.batch, self.draft_tokens + 1), -1, dtype=torch.int64, device=self.device)
        counts = torch.empty(self.batch, dtype=torch.int64, device=self.device)
        self.reseed(index, 1)
        if borrow:
            with self.session.borrow(self.pool, user=BORROW_USER) as b:
                self.accept(tokens, counts, None if at_peak is None else (lambda sample: at_peak(b, sample)))
        else:
            self.accept(tokens, counts, None if at_peak is None else (lambda sample: at_peak(None, sample)))
        return tokens.cpu(), counts.cpu()

    # ------------------------------------------------------------------ borrow accounting

    def borrow_pool(self) -> Any:
        """This process's borrow pool on the graph pool (None before the first borrow)."""
        return self.session.borrow_pools.get(self.pool.id)

    def alias_bytes(self) -> int:
        """Bytes of torch segments inside the arena that are not the arena pool's: the
        borrow pools' segments (this one, and any an earlier rebuild left cached)."""
        torch = self.torch
        own = {s["address"] for s in snapshot(torch, self.arena.mem_pool.id)}
        lo, hi = self.arena.address, self.arena.address + self.arena.reserved
        return sum(int(s["total_size"]) for s in snapshot(torch) if lo <= s["address"] < hi and s["address"] not in own)

    def close(self) -> None:
        """Drop the graphs and their outputs (the arena can then be released)."""
        if self.torch.cuda.is_initialized():
            self.torch.cuda.synchronize()
        self.outputs.clear()
        self.target_graph = self.draft_graph = None


def build(session: Any, log: Callable[[str], None] = say, **options: Any) -> Eagle:
    """An Eagle with its graphs captured into a registered pool (options: DEFAULTS)."""
    import torch

    if session.backend != "cuda" or session.device_ordinal is None:
        raise RuntimeError(f"gpumemd serves the {session.backend} backend here: borrowing into torch tensors needs CUDA")
    torch.cuda.set_device(session.device_ordinal)
    settings = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    unknown = set(settings) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    eagle = Eagle(session, **settings)
    log(
        f"toy EAGLE: batch {eagle.batch}, {eagle.draft_tokens} draft tokens, vocab {eagle.vocab}, hidden {eagle.hidden}, "
        f"{eagle.layers_n} target MLP layers ({eagle.intermediate}), draft tree of {eagle.tree_nodes} nodes (top-{eagle.top_k})"
    )
    eagle.capture(log)
    return eagle


# ---------------------------------------------------------------------------
# The two modes
# ---------------------------------------------------------------------------


def run_mode(eagle: Eagle, steps: int, *, borrow: bool) -> dict[str, Any]:
    """``steps`` decode steps, borrowing or not, from an emptied default pool. Returns
    the figures of the mode and the accepted tokens per step."""
    torch = eagle.torch
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = {"reserved": torch.cuda.memory_reserved(), "aliases": eagle.alias_bytes(), "device_used": device_used(torch)}
    peak = {"reserved": 0, "excl": 0, "aliases": 0, "pool_segments": 0, "pool_allocated": 0, "device_used": 0, "gpumem_reserved": 0}
    import gpumem

    # gpumem's own figure (torch's reserved bytes without the live borrow pools' segments),
    # where this checkout has it: a cross-check of the one computed here.
    gpumem_reserved = getattr(gpumem, "memory_reserved", None)

    def at_peak(b: Any, sample: Any) -> None:
        if b is not None and not eagle.in_arena(sample):
            raise RuntimeError(
                f"a tensor made inside the borrow scope lies at {sample.data_ptr():#x}, outside arena '{ARENA}': "
                "the borrow did not route torch's allocations into the pool's free runs"
            )
        if b is None and eagle.in_arena(sample):
            raise RuntimeError(f"a plain allocation landed in arena '{ARENA}' at {sample.data_ptr():#x}: something routes this thread")
        pool_segments = 0
        if b is not None:
            segments = snapshot(torch, b.borrow_pool.torch_pool.id)
            pool_segments = segment_bytes(segments)
            peak["pool_segments"] = max(peak["pool_segments"], pool_segments)
            peak["pool_allocated"] = max(peak["pool_allocated"], sum(int(s["allocated_size"]) for s in segments))
        reserved, aliases = torch.cuda.memory_reserved(), max(eagle.alias_bytes(), pool_segments)
        peak["reserved"] = max(peak["reserved"], reserved)
        peak["excl"] = max(peak["excl"], reserved - aliases)
        peak["aliases"] = max(peak["aliases"], aliases)
        peak["device_used"] = max(peak["device_used"], device_used(torch))
        if gpumem_reserved is not None:
            peak["gpumem_reserved"] = max(peak["gpumem_reserved"], int(gpumem_reserved(eagle.device.index)))

    tokens = []
    t0 = time.perf_counter()
    for index in range(steps):
        tokens.append(eagle.step(index, borrow=borrow, at_peak=at_peak))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    torch_max = torch.cuda.max_memory_reserved()
    bp = eagle.borrow_pool()
    aliases = peak["aliases"]
    # torch's caching allocator counts every pool's segments in memory_reserved(), the
    # borrow pool's included: checked here rather than assumed. Counted, they come off.
    alias_growth = aliases - start["aliases"]
    counted: bool | None = None  # None: no borrow segments appeared in this mode to tell
    if alias_growth > 0:
        counted = torch_max - start["reserved"] >= alias_growth // 2
    excl = torch_max - (0 if counted is False else aliases)
    return {
        "mode": "borrow" if borrow else "plain",
        "torch_max_reserved": torch_max,
        "borrow_segment_bytes": peak["pool_segments"],
        "borrow_alias_bytes": aliases,
        "borrow_allocated_bytes": peak["pool_allocated"],
        "reserved_excl_aliases": excl,
        "reserved_at_peak_max": peak["reserved"],
        "reserved_excl_aliases_at_peak_max": peak["excl"],
        "gpumem_memory_reserved_peak": peak["gpumem_reserved"] if gpumem_reserved is not None else None,
        "aliases_counted_by_torch": counted,
        "device_used_peak": peak["device_used"],
        "reserved_at_start": start["reserved"],
        "device_used_at_start": start["device_used"],
        "borrow_pool_builds": bp.builds if bp is not None else 0,
        "step_ms": elapsed / max(steps, 1) * 1e3,
        "tokens": tokens,
    }


def compare_modes(eagle: Eagle, steps: int, log: Callable[[str], None] = say) -> dict[str, Any]:
    """Run the steps without borrowing, then borrowing; return the figures (a dict of
    plain values: byte counts, fractions, flags; per-mode dicts under "plain" and "borrow")."""
    torch = eagle.torch
    if steps < 1:
        raise ValueError("need at least one step")
    # Warm-up, as a serving engine is warm: an empty borrow scope builds the borrow pool
    # (no segments yet) and creates the cuBLAS/cuBLASLt workspaces of this stream in
    # torch's default pool, which every later borrow expects to exist; a plain step loads
    # every kernel the step uses (module loading takes device memory once) and measures
    # what the step's own tensors need at their peak.
    with eagle.session.borrow(eagle.pool, user=BORROW_USER):
        pass
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    eagle.step(-1, borrow=False)
    step_local = torch.cuda.max_memory_allocated() - before
    runs = [r.size for r in eagle.pool.free_runs]
    log(f"step-local tensors need {mib(step_local)} at their peak (estimate {mib(eagle.step_estimate())}); "
        f"the pool's free runs hold {mib(sum(runs))} ({sum(runs) / max(step_local, 1):.1f}x), largest {mib(max(runs, default=0))}")
    if sum(runs) < 2 * step_local:
        log("WARNING: the free runs hold less than twice the step's tensors: the borrow pool will be rebuilt every scope "
            "(its cursor passes half the runs), which skews the figures; raise --tree-nodes or lower --batch/--draft-tokens")

    plain = run_mode(eagle, steps, borrow=False)
    borrowed = run_mode(eagle, steps, borrow=True)
    for mode in (plain, borrowed):
        log(
            f"{mode['mode']:>6}: step-local tensors {mib(step_local)} (peak), torch max_memory_reserved "
            f"{mib(mode['torch_max_reserved'])}, borrow segments "
            f"{mib(mode['borrow_alias_bytes'])}, reserved excluding borrow aliases {mib(mode['reserved_excl_aliases'])}; "
            f"device memory in use at the peak {mib(mode['device_used_peak'])}; {mode['step_ms']:.2f} ms/step"
            + (f" [gpumem.memory_reserved() at the peak: {mib(mode['gpumem_memory_reserved_peak'])}]"
               if mode["gpumem_memory_reserved_peak"] is not None else "")
        )
    if borrowed["aliases_counted_by_torch"] is False:
        log("note: this torch does not count the borrow pool's segments in memory_reserved(): nothing was subtracted")
    if borrowed["borrow_pool_builds"] > 1:
        log(f"WARNING: the borrow pool was built {borrowed['borrow_pool_builds']} times (once expected): its old "
            "segments stay cached in torch and count as aliases, and the bytes borrowed per step are understated")
    borrowed_bytes = borrowed["borrow_segment_bytes"]
    if borrowed_bytes <= 0:
        raise RuntimeError("the borrow scopes took no bytes from the pool's free runs: their tensors went elsewhere")

    mismatched = [i for i, (a, b) in enumerate(zip(plain["tokens"], borrowed["tokens"])) if not (a[0].equal(b[0]) and a[1].equal(b[1]))]
    accepted = sum(float(c.float().mean()) for _, c in plain["tokens"]) / steps
    reserved_drop = plain["reserved_excl_aliases"] - borrowed["reserved_excl_aliases"]
    device_drop = plain["device_used_peak"] - borrowed["device_used_peak"]
    figures = {
        "steps": steps,
        "batch": eagle.batch,
        "draft_tokens": eagle.draft_tokens,
        "vocab": eagle.vocab,
        "tree_nodes": eagle.tree_nodes,
        "step_local_bytes": step_local,
        "borrowed_bytes": borrowed_bytes,
        "free_run_bytes": sum(runs),
        "largest_free_run": max(runs, default=0),
        "reserved_drop_bytes": reserved_drop,
        "reserved_drop_fraction": reserved_drop / borrowed_bytes,
        "device_used_drop_bytes": device_drop,
        "device_used_drop_fraction": device_drop / borrowed_bytes,
        "tokens_identical": not mismatched,
        "mismatched_steps": len(mismatched),
        "accepted_per_sequence_mean": accepted,
        "plain": {k: v for k, v in plain.items() if k != "tokens"},
        "borrow": {k: v for k, v in borrowed.items() if k != "tokens"},
    }
    log(f"borrowed {mib(borrowed_bytes)} of the pool's free runs per step (step-local tensors: {mib(step_local)})")
    log(f"reserved (excluding borrow aliases) dropped by {mib(reserved_drop)}: {figures['reserved_drop_fraction']:.3f} of the bytes borrowed")
    log(f"device memory in use dropped by {mib(device_drop)}: {figures['device_used_drop_fraction']:.3f} of the bytes borrowed")
    if mismatched:
        log(f"MISMATCH: accepted tokens differ between the modes in {len(mismatched)} of {steps} steps (first: step {mismatched[0]})")
    else:
        log(f"accepted tokens identical in both modes over {steps} steps ({accepted:.2f} draft tokens accepted per sequence on average)")
    return figures


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="decode steps per mode (default 20)")
    ap.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per step (default %(default)s)")
    ap.add_argument("--draft-tokens", type=int, default=DEFAULTS["draft_tokens"], help="draft chain length (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=DEFAULTS["vocab"], help="vocabulary size (default %(default)s)")
    ap.add_argument("--tree-nodes", type=int, default=DEFAULTS["tree_nodes"],
                    help="draft-tree nodes per sequence: their vocabulary-wide intermediates are the pool's free runs (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=DEFAULTS["temperature"])
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--runtime-dir", help="use the gpumemd serving this runtime directory (default: start a private one)")
    ap.add_argument("--device", type=int, default=0, help="GPU index (default 0)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import torch
    except ImportError:
        print("eagle_borrow: needs torch with CUDA (pip install 'torch>=2.8'); torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"eagle_borrow: needs a CUDA GPU; torch {torch.__version__} sees none (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    gpumem = import_gpumem()
    try:
        with contextlib.ExitStack() as stack:
            runtime = args.runtime_dir or stack.enter_context(private_daemon(args.device))
            session = gpumem.connect(args.device, name="eagle-borrow", runtime_dir=runtime)
            stack.callback(session.close)
            eagle = build(session, batch=args.batch, draft_tokens=args.draft_tokens, vocab=args.vocab,
                          tree_nodes=args.tree_nodes, temperature=args.temperature, seed=args.seed)
            stack.callback(eagle.close)
            figures = compare_modes(eagle, args.steps)
            print(json.dumps(figures), flush=True)
    except Exception as exc:  # noqa: BLE001 (an example: say what failed, loudly, and exit 1)
        traceback.print_exc()
        print(f"eagle_borrow: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0 if figures["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
