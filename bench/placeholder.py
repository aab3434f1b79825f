#!/usr/bin/env python3
"""Placeholder backing of S bytes (default 64 GiB) and the swap to real memory.

Times, in one client process against its own daemon:
- map: ``arena.placeholder(0, S)``: one 64 MiB chunk aliased over every slot;
- swap: ``arena.commit(S)`` over the placeholder (daemon creates and scrubs the chunks,
  client unmaps the placeholder slots and maps the real chunks at the same addresses);
- baseline, same run: ``arena.commit(S)`` into a fresh arena with no placeholder.
Repetitions alternate swap and baseline (decommitting and releasing in between).

    python bench/placeholder.py --backend cuda          # 64 GiB on the GPU
    python bench/placeholder.py --backend host          # same figures on host memfds

Last line: {"bench": "placeholder", ...}; ok means the map takes <= 50 ms and the swap
costs <= 50 ms more than the plain commit (the unmapping of the placeholder slots).
"""

from __future__ import annotations

import contextlib
import time

import _common as c

BENCH = "placeholder"
MiB = 1 << 20
GiB = 1 << 30


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--size", type=int, default=64 * GiB)
    parser.add_argument("--slot", type=int, default=64 * MiB)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    c.ensure_importable()

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        result.targets = {"map_ms_max": 50.0, "swap_overhead_ms_max": 50.0}
        import gpumem

        rt = cleanup.enter_context(c.runtime_dir())
        extra = ["--host-capacity", f"{2 * args.size + 4 * GiB}"] if args.backend == "host" else []
        daemon = c.Daemon(rt, args.backend, args=extra)
        cleanup.callback(daemon.stop)
        daemon.wait_ready(60)
        session = gpumem.connect(0, name="bench-placeholder", runtime_dir=rt)
        cleanup.callback(session.close)
        maps, swaps, plains = [], [], []
        for i in range(args.repeat):
            arena = session.create_arena(f"ph{i}", args.size + 4 * GiB)
            t0 = time.perf_counter_ns()
            arena.placeholder(0, args.size, args.slot)
            maps.append((time.perf_counter_ns() - t0) / 1e6)
            t0 = time.perf_counter_ns()
            arena.commit(args.size)
            swaps.append((time.perf_counter_ns() - t0) / 1e6)
            assert arena.placeholder_bytes == 0 and arena.mapped_bytes == args.size
            arena.release()
            plain = session.create_arena(f"plain{i}", args.size + 4 * GiB)
            t0 = time.perf_counter_ns()
            plain.commit(args.size)
            plains.append((time.perf_counter_ns() - t0) / 1e6)
            plain.release()
            c.say(f"round {i}: placeholder map {maps[-1]:.1f} ms, swap {swaps[-1]:.1f} ms, plain commit {plains[-1]:.1f} ms")
        slots = args.size // args.slot
        result.figures = {
            "size_gib": args.size / GiB,
            "slots": slots,
            "map_ms_median": c.median(maps),
            "swap_ms_median": c.median(swaps),
            "plain_commit_ms_median": c.median(plains),
            "swap_ratio": c.ratio(c.median(swaps), c.median(plains)),
            "swap_overhead_ms": c.median(swaps) - c.median(plains),
        }
        result.ok = result.figures["map_ms_median"] <= 50.0 and result.figures["swap_overhead_ms"] <= 50.0

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    raise SystemExit(main())
