#!/usr/bin/env python3
"""torch.empty/free cycles inside an arena's MemPool against torch's default caching
allocator, in the same process and run (CUDA only: torch pools need the CUDA backend).

Each round times N cycles of ``torch.empty(size)`` + drop in the arena pool, then the
same in the default allocator; rounds alternate so drift hits both. Both are cache hits
after warm-up: what is measured is torch's allocator path plus gpumem's routing, the
per-call cost an engine pays.

    python bench/alloc.py --backend cuda

Last line: {"bench": "alloc", ...}; ok means median(arena) <= 1.1 x median(default).
"""

from __future__ import annotations

import contextlib
import time

import _common as c

BENCH = "alloc"
MiB = 1 << 20
GiB = 1 << 30


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--cycles", type=int, default=20000, help="cycles per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size", type=int, default=1 * MiB, help="bytes per torch.empty")
    args = parser.parse_args()
    c.ensure_importable()

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        result.targets = {"ratio_median_max": 1.1}
        if args.backend != "cuda":
            raise RuntimeError("torch MemPools on arenas need the CUDA backend; run with --backend cuda on a GPU machine")
        import torch

        import gpumem

        rt = cleanup.enter_context(c.runtime_dir())
        daemon = c.Daemon(rt, "cuda")
        cleanup.callback(daemon.stop)
        daemon.wait_ready(60)
        session = gpumem.connect(0, name="bench-alloc", runtime_dir=rt)
        cleanup.callback(session.close)
        arena = session.create_arena("alloc", 8 * GiB)
        arena.commit(1 * GiB)
        n_elems = args.size // 4

        def cycles(n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                torch.empty(n_elems, dtype=torch.float32, device="cuda")
            return (time.perf_counter_ns() - t0) / n / 1e3

        with arena.allocating():
            cycles(200)
        cycles(200)
        ours, default = [], []
        for _ in range(args.rounds):
            with arena.allocating():
                ours.append(cycles(args.cycles))
            default.append(cycles(args.cycles))
        m_ours, m_default = c.median(ours), c.median(default)
        c.say(f"torch.empty({args.size} B) + free: arena pool {m_ours:.3f} us, default allocator {m_default:.3f} us (medians of {args.rounds} rounds x {args.cycles})")
        stats = arena.torch_pool().slot.stats()
        c.say(f"native slot: {stats.calls} calls, {stats.cursor_bytes} bytes handed out (torch caches the rest)")
        result.figures = {
            "arena_us_median": m_ours,
            "default_us_median": m_default,
            "ratio_median": c.ratio(m_ours, m_default),
            "native_calls": stats.calls,
            "size_bytes": args.size,
        }
        result.ok = result.figures["ratio_median"] <= 1.1

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    raise SystemExit(main())
