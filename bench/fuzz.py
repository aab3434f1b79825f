#!/usr/bin/env python3
"""The protocol fuzzer of the test suite, run longer against a daemon of its own.

The generator and the checks are tests/integration/fuzz_kit.py's (typed requests built
from the protocol's own message types, garbage frames, wrong envelopes, huge and
multi-frame messages, fd-channel garbage and stray descriptors, sessions that come and
go, routing ids handed over between DEALERs, crowds of DEALERs that never speak); tests/integration/test_fuzz.py runs 5,000 cases in CI. Every case must get its one
typed reply (never INTERNAL) and the daemon must stay alive; at the end, with every
session closed, nothing may stay accounted and the daemon's RSS and descriptors must be
back near where they were.

    python bench/fuzz.py --backend host                 # 100,000 cases
    python bench/fuzz.py --backend cuda --cases 20000

Last line: {"bench": "fuzz", "backend", "figures": {"cases", "seconds", "daemon_alive",
"rss_growth_bytes", "fds_growth", "errors_by_code"}, "targets", "ok"}; ok means no
invariant broke and the growth stayed within its bounds. A broken invariant ends the run
with "error" naming the operation and the daemon's reply.
"""

from __future__ import annotations

import contextlib
import sys
import time

import _common as c

BENCH = "fuzz"
ROUND_TIMEOUT = 1.0  # rounds end quickly, so deferred replies come within the run
PROGRESS_EVERY = 10_000  # cases between two progress lines


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--host-capacity", default="1GiB", help="host backend: memory the daemon offers (small: running out is reachable)")
    parser.add_argument("--capacity", default="8GiB",
                        help="CUDA: the daemon's --capacity (small: running out is reachable, and a KV round, sized from what is "
                             "free, does not commit and zero the whole device at every round)")
    args = parser.parse_args()
    c.ensure_importable()
    sys.path.insert(0, str(c.REPO / "tests" / "integration"))

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        from fuzz_kit import Bounds, FuzzFailure, World, fuzz

        bounds = Bounds()
        result.targets = {"daemon_alive": True, "rss_growth_bytes_max": bounds.rss_growth, "fds_growth_max": bounds.fds_growth}
        rt = cleanup.enter_context(c.runtime_dir("gmb-fuzz-"))
        extra = ["--round-timeout", str(ROUND_TIMEOUT), "--hello-timeout", "2", "--retain-grace", str(ROUND_TIMEOUT)]
        extra += ["--host-capacity", args.host_capacity] if args.backend == "host" else ["--capacity", args.capacity]
        daemon = c.Daemon(rt, args.backend, args=extra)
        cleanup.callback(daemon.stop)
        daemon.wait_ready(60)
        world = World(rt, daemon.pid, log=daemon.log)
        started = time.monotonic()
        try:
            while world.cases < args.cases:
                fuzz(world, min(PROGRESS_EVERY, args.cases - world.cases))
                elapsed = time.monotonic() - started
                c.say(f"{world.cases} cases in {elapsed:.0f}s; daemon RSS {world.probe.rss() >> 20} MiB, {world.probe.fds()} descriptors")
            figures = world.finish(round_wait=ROUND_TIMEOUT + 5.0, bounds=bounds)
        except FuzzFailure:
            result.figures = {
                "cases": world.cases,
                "seconds": time.monotonic() - started,
                "daemon_alive": world.probe.alive(),
                "errors_by_code": dict(sorted(world.errors.items())),
            }
            raise
        slowest, what = world.slowest
        c.say(f"costliest operation: {slowest:.2f}s of daemon CPU: {what}")
        result.figures = {"cases": figures["cases"], "seconds": time.monotonic() - started, **figures}
        result.ok = figures["daemon_alive"]

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    sys.exit(main())
