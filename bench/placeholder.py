#!/usr/bin/env python3
"""Placeholder backing of S bytes (default 64 GiB, or 0.8 of the device's free memory
where that is less) and the swap to real memory.

Times, in one client process against its own daemon:
- map: ``arena.placeholder(0, S)``: one 64 MiB chunk aliased over every slot;
- swap: ``arena.commit(S)`` over the placeholder (daemon creates and scrubs the chunks,
  client unmaps the placeholder slots and maps the real chunks at the same addresses);
- baselines, same run: the raw driver path of the same slots in this process, no
  daemon (one slot-sized chunk created, zeroed, exported, imported and aliased over
  every slot), and ``arena.commit(S)`` into a fresh arena with no placeholder.
Repetitions alternate swap and baseline (decommitting and releasing in between).

    python bench/placeholder.py --backend cuda          # 64 GiB on the GPU
    python bench/placeholder.py --backend host          # same figures on host memfds

Last line: {"bench": "placeholder", ...}; ok means the map takes <= 1.5x the raw driver
path of the same slots and the swap <= 1.5x the plain commit (the difference is the
unmapping of the placeholder slots).
"""

from __future__ import annotations

import contextlib
import os
import time

import _common as c

BENCH = "placeholder"
MiB = 1 << 20
GiB = 1 << 30


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--size", type=int, default=None, help="bytes (default: 64 GiB, or 0.8 of the free memory where less)")
    parser.add_argument("--slot", type=int, default=64 * MiB)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    c.ensure_importable()

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        result.targets = {"map_ratio_max": 1.5, "swap_ratio_max": 1.5}
        import gpumem

        from gpumem_shared.driver.base import Driver

        # One of the two arenas is committed at a time; whole slots.
        args.size = args.size or c.fit(64 * GiB, args.backend, 0.8, "placeholder") // args.slot * args.slot
        rt = cleanup.enter_context(c.runtime_dir())
        extra = ["--host-capacity", f"{2 * args.size + 4 * GiB}"] if args.backend == "host" else []
        daemon = c.Daemon(rt, args.backend, args=extra)
        cleanup.callback(daemon.stop)
        daemon.wait_ready(60)
        session = gpumem.connect(0, name="bench-placeholder", runtime_dir=rt)
        cleanup.callback(session.close)
        driver: Driver
        if args.backend == "cuda":
            from gpumem_shared.driver.cuda import CudaDriver

            driver = CudaDriver(session.device_ordinal or 0)
        else:
            from gpumem_shared.driver.host import HostDriver

            driver = HostDriver(0, 2 * args.size)
        # Below the daemons' slices (gpumem_shared.address_plan): the raw baseline's windows.
        made = driver.reserve(args.slot, 0x1000_0000_0000)
        window = driver.reserve(args.size, 0x1400_0000_0000)
        cleanup.callback(driver.free_reservation, made, args.slot)
        cleanup.callback(driver.free_reservation, window, args.size)
        offsets = list(range(0, args.size - args.slot + 1, args.slot))

        def raw_map() -> float:
            """The same slots without the daemon: one slot-sized chunk created, zeroed and
            exported, then imported and aliased over every slot (what the client maps)."""
            t0 = time.perf_counter_ns()
            handles = driver.create_chunks([(made, args.slot)])
            driver.zero([(made, args.slot)])
            fd = driver.export_fds([(made, args.slot, handles[0], False)])[0]
            driver.map_aliased(window, fd, args.slot, offsets)
            ms = (time.perf_counter_ns() - t0) / 1e6
            os.close(fd)
            driver.unmap_many(window, [(o, args.slot) for o in offsets])
            driver.destroy_chunks([(made, args.slot)], handles)
            return ms

        raw_map()
        maps, swaps, plains, raws = [], [], [], []
        for i in range(args.repeat):
            raws.append(raw_map())
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
            c.say(
                f"round {i}: placeholder map {maps[-1]:.1f} ms (raw driver {raws[-1]:.1f} ms), swap {swaps[-1]:.1f} ms, "
                f"plain commit {plains[-1]:.1f} ms"
            )
        slots = args.size // args.slot
        result.figures = {
            "size_gib": args.size / GiB,
            "slots": slots,
            "map_ms_median": c.median(maps),
            "raw_map_ms_median": c.median(raws),
            "map_ratio": c.ratio(c.median(maps), c.median(raws)),
            "swap_ms_median": c.median(swaps),
            "plain_commit_ms_median": c.median(plains),
            "swap_ratio": c.ratio(c.median(swaps), c.median(plains)),
            "swap_overhead_ms": c.median(swaps) - c.median(plains),
        }
        result.ok = result.figures["map_ratio"] <= 1.5 and result.figures["swap_ratio"] <= 1.5

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    raise SystemExit(main())
