#!/usr/bin/env python3
"""Churn: client processes creating, sharing, attaching, syncing and releasing arenas
and KV pools against one daemon, random ones killed with SIGKILL and started again.

The workload of tests/integration/test_churn.py (tests/churn_workload.py), run longer:
``--workers`` processes (default 8) for ``--seconds`` (default 300), a kill about every
``--kill-every`` seconds (default 2.5). Each worker reads back what it maps (a tag the
owner wrote at every granule) and counts what the daemon refused as churn allows (an
arena released under it), what failed otherwise, and VaCollision apart.

    python bench/churn.py --backend cuda          # on the GPU
    python bench/churn.py --backend host          # host memfds

Last line: {"bench": "churn", ...}; ok means no VaCollision, no failure, no crash (every
worker not killed exited 0 with its report), the daemon alive, and at the end no client,
no arena and nothing accounted; on CUDA also the device's free memory back within
64 MiB of where it started.
"""

from __future__ import annotations

import contextlib
import sys
import time

import _common as c

BENCH = "churn"
MiB = 1 << 20


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=2.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    c.ensure_importable()
    sys.path.insert(0, str(c.REPO / "tests"))
    from churn_workload import churn, summary

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        result.targets = {"collisions": 0, "failures": 0, "crashes": 0, "accounted_bytes_end": 0}
        rt = cleanup.enter_context(c.runtime_dir())
        extra = ["--host-capacity", "8GiB"] if args.backend == "host" else []
        daemon = c.Daemon(rt, args.backend, args=extra)
        cleanup.callback(daemon.stop)
        daemon.wait_ready(60)
        logs = rt / "churn-logs"
        logs.mkdir()
        c.say(f"churning: {args.workers} workers for {args.seconds:g}s, a kill -9 about every {args.kill_every:g}s")
        started = time.monotonic()
        figures = churn(rt, seconds=args.seconds, workers=args.workers, kill_every=args.kill_every, seed=args.seed, log_dir=logs)
        elapsed = time.monotonic() - started
        alive = figures["daemon_alive"] and daemon.proc.poll() is None
        for error in figures["errors"]:
            c.say(f"  {error}")
        c.say(summary(args.backend, figures))
        free_back = args.backend != "cuda" or figures["free_bytes_end"] >= figures["free_bytes_baseline"] - figures["free_tolerance"]
        result.figures = {
            "workers": args.workers,
            "seconds": args.seconds,
            "operations": figures["operations"],
            "ops_per_s": figures["operations"] / elapsed,
            "reads_checked": figures["reads_checked"],
            "refused": figures["refused"],
            "kills": figures["kills"],
            "collisions": figures["collisions"],
            "failures": figures["failures"],
            "crashes": figures["crashes"],
            "unreported": figures["unreported"],
            "daemon_alive": alive,
            "clients_left": figures["clients_left"],
            "arenas_left": figures["arenas_left"],
            "accounted_bytes_end": figures["accounted_bytes_end"],
            "refused_by": figures["refused_by"],
        }
        if args.backend == "cuda":
            result.figures["free_delta_bytes"] = figures["free_bytes_end"] - figures["free_bytes_baseline"]
        result.ok = (
            figures["collisions"] == figures["failures"] == figures["crashes"] == figures["unreported"] == 0
            and alive
            and figures["clients_left"] == figures["arenas_left"] == figures["accounted_bytes_end"] == 0
            and free_back
        )

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    sys.exit(main())
