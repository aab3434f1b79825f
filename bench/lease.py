#!/usr/bin/env python3
"""Leases on a graph pool: the uncontended fast path and the handoff between processes.

1. Uncontended: ``with session.replay(pool): pass`` timed one by one (acquire +
   release through the client library: a compare-and-swap each way, no daemon), against
   the control round trip (``session.ping()``) measured in the same run.
2. Handoff: two processes take turns holding the pool's lease. The holder keeps it
   about a millisecond, so the other is asleep on the slot's futex when it is released;
   the figure is from the release (CLOCK_MONOTONIC, shared by the processes) to the
   waiter holding the lease.

The pool is a synthetic registration in a committed arena (no GPU work is involved in
a lease), so the same figures come from either backend.

    python bench/lease.py --backend host
    python bench/lease.py --backend cuda

Last line: {"bench": "lease", ...}; ok means uncontended p50 <= 2 us, at least 40x
faster than the control round trip, and handoff p50 <= 50 us.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import _common as c

BENCH = "lease"
MiB = 1 << 20


def handoff_client(name: str, rounds: int) -> int:
    """Take the lease ``rounds`` times, hold it ~1 ms each; print the event times."""
    import gpumem

    session = gpumem.connect(0, name=name)
    pool = next(g for g in session.status().extents if g.label == "bench-pool")
    print("READY", flush=True)
    sys.stdin.readline()
    events = []
    for _ in range(rounds):
        lease = session.replay(pool, wait=5.0)
        acquired = time.monotonic_ns()
        time.sleep(0.001)
        released = time.monotonic_ns()
        lease.release()
        events.append((acquired, released))
        time.sleep(0.0003)  # the other side, asleep on the futex, takes it now
    print(json.dumps(events), flush=True)
    session.close()
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        return handoff_client(sys.argv[2], int(sys.argv[3]))
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="host")
    parser.add_argument("--iterations", type=int, default=200000)
    parser.add_argument("--pings", type=int, default=5000)
    parser.add_argument("--handoffs", type=int, default=500, help="turns per process")
    args = parser.parse_args()
    c.ensure_importable()

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        result.targets = {"uncontended_p50_us_max": 2.0, "speedup_vs_rtt_min": 40.0, "handoff_p50_us_max": 50.0}
        import gpumem
        from gpumem_shared import protocol as p

        rt = cleanup.enter_context(c.runtime_dir())
        daemon = c.Daemon(rt, args.backend)
        cleanup.callback(daemon.stop)
        daemon.wait_ready(60)
        session = gpumem.connect(0, name="bench-lease", runtime_dir=rt)
        cleanup.callback(session.close)
        arena = session.create_arena("graphs", 1 << 30)
        arena.commit(64 * MiB)
        reply = session.call(
            p.RegisterGraphPool(arena="graphs", label="bench-pool", extents=[p.Extent(offset=0, size=64 * MiB)], free_runs=[])
        )
        pool = reply.pool

        for _ in range(2000):
            with session.replay(pool):
                pass
        samples = []
        clock = time.perf_counter_ns
        for _ in range(args.iterations):
            t0 = clock()
            with session.replay(pool):
                pass
            samples.append(clock() - t0)
        pings = []
        for _ in range(args.pings):
            t0 = clock()
            session.ping()
            pings.append(clock() - t0)
        lease_p50 = c.median(samples) / 1e3
        ping_p50 = c.median(pings) / 1e3
        c.say(f"uncontended replay lease acquire+release: p50 {lease_p50:.2f} us, p99 {c.percentile(samples, 99) / 1e3:.2f} us")
        c.say(f"control round trip (ping): p50 {ping_p50:.1f} us: the lease is {ping_p50 / lease_p50:.0f}x faster")

        env = c.child_env(GPUMEMD_RUNTIME_DIR=str(rt))
        procs = c.spawn_clients(__file__, ["turn-a", "turn-b"], [str(args.handoffs)], env, cleanup)
        for proc in procs:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.startswith("READY"):
                raise RuntimeError(f"a handoff client said {line!r}; daemon log:\n{daemon.log()}")
        for proc in procs:
            assert proc.stdin
            proc.stdin.write("go\n")
            proc.stdin.flush()
        events = []
        for index, proc in enumerate(procs):
            assert proc.stdout
            events += [(acquired, released, index) for acquired, released in json.loads(proc.stdout.readline())]
            proc.wait(60)
        events.sort()
        handoffs = [
            (nxt[0] - cur[1]) / 1e3 for cur, nxt in zip(events, events[1:]) if nxt[2] != cur[2] and nxt[0] >= cur[1]
        ]
        handoff_p50 = c.median(handoffs)
        c.say(f"handoff to a waiting process: p50 {handoff_p50:.1f} us, p99 {c.percentile(handoffs, 99):.1f} us over {len(handoffs)} handoffs")
        result.figures = {
            "uncontended_p50_us": lease_p50,
            "uncontended_p99_us": c.percentile(samples, 99) / 1e3,
            "control_rtt_p50_us": ping_p50,
            "speedup_vs_rtt": c.ratio(ping_p50, lease_p50),
            "handoff_p50_us": handoff_p50,
            "handoff_p99_us": c.percentile(handoffs, 99),
            "handoffs": len(handoffs),
        }
        result.ok = lease_p50 <= 2.0 and result.figures["speedup_vs_rtt"] >= 40.0 and handoff_p50 <= 50.0

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    raise SystemExit(main())
