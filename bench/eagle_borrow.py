#!/usr/bin/env python3
"""Borrowing a graph pool's free runs: allocation cost in a borrow scope, the scope's own
cost, and the reserved memory an EAGLE-style step saves (CUDA only).

One client process against its own daemon, on the toy EAGLE decoder of
examples/eagle_borrow.py (its decode graphs captured into a registered arena pool):

1. EAGLE step: the same decode steps without borrowing, then with the rejection
   sampler's probability tensors borrowed from the pool's free runs (same seeds; the
   accepted tokens must match). The figure is the drop of torch's peak reserved memory
   (excluding the borrow pool's segments, which alias graph-pool memory torch already
   counts) as a fraction of the bytes borrowed; the drop of device memory in use
   (``mem_get_info``) is reported beside it.
2. Allocation: ``torch.empty(1 MiB)`` + free, cached blocks, inside one borrow scope
   against torch's default allocator outside it; rounds alternate, and each sample
   times ``--ops`` cycles. The figure is the ratio of the p50 per operation.
3. Scope: entering and leaving an empty ``with session.borrow(pool, user=...)`` (the
   borrow lease taken and given back, the escape check at exit), timed one by one,
   against an upstream-style in-process scope measured in the same run, in alternating
   rounds: a ``contextlib.contextmanager`` that sets a slot (a tag on a Python object)
   and routes this thread's allocations to a ``torch.cuda.MemPool`` of the same
   pluggable allocator, the way an engine's own sleep-mode or tagging allocator does.
4. Scope parts: each part of the scope timed alone (torch's ``use_mem_pool`` on the
   borrow pool beside the library's routing, the lease, the escape check, the pool's
   readiness check, the stream lookup), to say where its time goes.

    python bench/eagle_borrow.py --backend cuda

Last line: {"bench": "eagle_borrow", ...}; ok means the allocation p50 ratio <= 1.1,
the empty scope's p50 <= 1.5x the upstream-style scope's, the reserved drop >= 0.95 of
the bytes borrowed, and identical accepted tokens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from typing import Any

import _common as c

BENCH = "eagle_borrow"
MiB = 1 << 20
EXAMPLE = c.REPO / "examples" / "eagle_borrow.py"


def load_example() -> Any:
    """examples/eagle_borrow.py as a module (under its own name: this file has the same one)."""
    if not EXAMPLE.exists():
        raise RuntimeError(f"{EXAMPLE} is missing: this benchmark runs the example's model and measurement")
    spec = importlib.util.spec_from_file_location("gpumem_example_eagle_borrow", EXAMPLE)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {EXAMPLE} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--steps", type=int, default=20, help="EAGLE decode steps per mode")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (the example's default)")
    parser.add_argument("--draft-tokens", type=int, default=None, help="draft chain length (the example's default)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (the example's default)")
    parser.add_argument("--tree-nodes", type=int, default=None, help="draft-tree nodes per sequence (the example's default)")
    parser.add_argument("--size", type=int, default=1 * MiB, help="bytes per torch.empty")
    parser.add_argument("--ops", type=int, default=50, help="allocate+free cycles per timed sample")
    parser.add_argument("--samples", type=int, default=400, help="timed samples per round and allocator")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--scopes", type=int, default=20000, help="empty scopes timed, of each kind")
    args = parser.parse_args()
    c.ensure_importable()

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        result.targets = {
            "empty_ratio_p50_max": 1.1,
            "scope_ratio_p50_max": 1.5,
            "reserved_drop_fraction_min": 0.95,
            "tokens_identical": True,
        }
        if args.backend != "cuda":
            raise RuntimeError(
                "borrowing into torch tensors needs the CUDA backend (torch MemPools over a graph pool's free runs); "
                "run with --backend cuda on a GPU machine"
            )
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA device: this benchmark needs a GPU")
        import gpumem

        example = load_example()
        rt = cleanup.enter_context(c.runtime_dir())
        daemon = c.Daemon(rt, "cuda")
        cleanup.callback(daemon.stop)
        daemon.wait_ready(60)
        session = gpumem.connect(0, name="bench-eagle-borrow", runtime_dir=rt)
        cleanup.callback(session.close)
        eagle = example.build(
            session, log=c.say, batch=args.batch, draft_tokens=args.draft_tokens, vocab=args.vocab, tree_nodes=args.tree_nodes
        )
        cleanup.callback(eagle.close)
        pool = eagle.pool
        device = eagle.device

        # 1. The EAGLE step, plain then borrowing (first, while torch's default pool holds
        #    nothing the timing loops below would leave cached).
        eagle_figures = example.compare_modes(eagle, args.steps, log=c.say)

        # 2. torch.empty + free with cached blocks: in a borrow scope, and outside it.
        n_bytes = args.size
        clock = time.perf_counter_ns

        def timed(samples: int) -> list[float]:
            out = []
            for _ in range(samples):
                t0 = clock()
                for _ in range(args.ops):
                    torch.empty(n_bytes, dtype=torch.uint8, device=device)
                out.append((clock() - t0) / args.ops / 1e3)
            return out

        user = example.BORROW_USER
        with session.borrow(pool, user=user) as b:
            timed(20)  # the borrow pool's block for the size, cached from here on
            probe = torch.empty(n_bytes, dtype=torch.uint8, device=device)
            inside = eagle.in_arena(probe)
            del probe
        if not inside:
            raise RuntimeError("torch.empty inside the borrow scope did not land in the graph pool's arena")
        builds = b.borrow_pool.builds
        timed(20)
        torch.cuda.synchronize()
        ours: list[float] = []
        default: list[float] = []
        for _ in range(args.rounds):
            with session.borrow(pool, user=user):
                ours += timed(args.samples)
            default += timed(args.samples)
        torch.cuda.synchronize()
        if b.borrow_pool.builds != builds:
            c.say(f"warning: the borrow pool was rebuilt during the allocation rounds ({builds} -> {b.borrow_pool.builds} builds)")
        p50_ours, p50_default = c.median(ours), c.median(default)
        ratio = c.ratio(p50_ours, p50_default)
        c.say(
            f"torch.empty({n_bytes} B) + free: in a borrow scope p50 {p50_ours:.3f} us, default allocator p50 "
            f"{p50_default:.3f} us per op (ratio {ratio:.3f}; {args.rounds} rounds x {args.samples} samples x {args.ops} ops)"
        )

        # 3. The scope itself: enter + exit of an empty borrow, against an upstream-style
        #    in-process scope (a slot set and a MemPool routed), rounds alternating.
        from gpumem.allocator import library_path

        upstream_allocator = torch.cuda.memory.CUDAPluggableAllocator(
            library_path(), b.borrow_pool.slot.alloc_symbol, b.borrow_pool.slot.free_symbol
        )
        upstream_pool = torch.cuda.MemPool(upstream_allocator.allocator())

        class Tags:
            current: str | None = None

        tags = Tags()

        @contextlib.contextmanager
        def upstream_scope(tag: str) -> Any:
            before, tags.current = tags.current, tag
            try:
                with torch.cuda.use_mem_pool(upstream_pool, device=device):
                    yield
            finally:
                tags.current = before

        for _ in range(200):
            with session.borrow(pool, user=user):
                pass
            with upstream_scope(user):
                pass
        scopes: list[int] = []
        upstream: list[int] = []
        per_round = max(1, args.scopes // args.rounds)
        for index in range(2 * args.rounds):
            if index % 2 == 0:
                for _ in range(per_round):
                    t0 = clock()
                    with session.borrow(pool, user=user):
                        pass
                    scopes.append(clock() - t0)
            else:
                for _ in range(per_round):
                    t0 = clock()
                    with upstream_scope(user):
                        pass
                    upstream.append(clock() - t0)
        scope_p50 = c.median(scopes) / 1e3
        scope_p99 = c.percentile(scopes, 99) / 1e3
        upstream_p50 = c.median(upstream) / 1e3
        scope_ratio = c.ratio(scope_p50, upstream_p50)
        c.say(
            f"empty borrow scope (enter + exit): p50 {scope_p50:.2f} us, p99 {scope_p99:.2f} us; upstream-style scope "
            f"(slot set + MemPool routed) p50 {upstream_p50:.2f} us, p99 {c.percentile(upstream, 99) / 1e3:.2f} us: "
            f"ratio {scope_ratio:.2f} ({len(scopes)} each, {args.rounds} rounds alternating)"
        )

        # 4. Where the scope's time goes: its parts alone, p50 of each (the best of
        #    --rounds rounds), beside torch's own use_mem_pool on the same pool.
        from gpumem.leases import Lease, current_stream
        from gpumem_shared.lease_table import LeaseKind

        bp = b.borrow_pool
        route = bp.route
        if route is None:
            raise RuntimeError("the borrow pool has no torch routing after a torch borrow")

        def part_use_mem_pool() -> None:
            with torch.cuda.use_mem_pool(bp.torch_pool, device=bp.device):
                pass

        def part_route() -> None:
            route.enter()
            route.exit()

        def part_lease() -> None:
            Lease.acquire(session.leasing, pool, LeaseKind.BORROW, user, 0.0, bp.stream).release()

        parts_fns = {
            "torch_use_mem_pool": part_use_mem_pool,
            "route": part_route,
            "lease": part_lease,
            "escape_check": bp.holds_nothing,
            "ensure": lambda: bp.ensure(pool, True),
            "current_stream": lambda: current_stream(bp.device),
        }
        parts: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, fn in parts_fns.items():
                samples = []
                for _ in range(per_round):
                    t0 = clock()
                    fn()
                    samples.append(clock() - t0)
                p50 = c.median(samples) / 1e3
                parts[name] = min(parts.get(name, p50), p50)
        c.say("scope parts alone, p50 us: " + ", ".join(f"{name} {value:.2f}" for name, value in parts.items()))

        plain, borrowed = eagle_figures["plain"], eagle_figures["borrow"]
        result.figures = {
            "empty_borrow_p50_us": p50_ours,
            "empty_default_p50_us": p50_default,
            "empty_ratio_p50": ratio,
            "scope_p50_us": scope_p50,
            "scope_p99_us": scope_p99,
            "upstream_scope_p50_us": upstream_p50,
            "upstream_scope_p99_us": c.percentile(upstream, 99) / 1e3,
            "scope_ratio_p50": scope_ratio,
            "scope_parts_p50_us": parts,
            "reserved_drop_fraction": eagle_figures["reserved_drop_fraction"],
            "device_used_drop_fraction": eagle_figures["device_used_drop_fraction"],
            "reserved_drop_bytes": eagle_figures["reserved_drop_bytes"],
            "device_used_drop_bytes": eagle_figures["device_used_drop_bytes"],
            "borrowed_bytes": eagle_figures["borrowed_bytes"],
            "step_local_bytes": eagle_figures["step_local_bytes"],
            "free_run_bytes": eagle_figures["free_run_bytes"],
            "plain_torch_max_reserved": plain["torch_max_reserved"],
            "borrow_torch_max_reserved": borrowed["torch_max_reserved"],
            "borrow_alias_bytes": borrowed["borrow_alias_bytes"],
            "plain_reserved_excl_aliases": plain["reserved_excl_aliases"],
            "borrow_reserved_excl_aliases": borrowed["reserved_excl_aliases"],
            "plain_device_used_peak": plain["device_used_peak"],
            "borrow_device_used_peak": borrowed["device_used_peak"],
            "aliases_counted_by_torch": borrowed["aliases_counted_by_torch"],
            "borrow_pool_builds": borrowed["borrow_pool_builds"],
            "tokens_identical": eagle_figures["tokens_identical"],
            "steps": eagle_figures["steps"],
            "batch": eagle_figures["batch"],
            "draft_tokens": eagle_figures["draft_tokens"],
            "vocab": eagle_figures["vocab"],
            "size_bytes": n_bytes,
        }
        result.ok = (
            ratio <= 1.1
            and scope_ratio <= 1.5
            and eagle_figures["reserved_drop_fraction"] >= 0.95
            and eagle_figures["tokens_identical"]
        )

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    raise SystemExit(main())
