#!/usr/bin/env python3
"""Lease handoffs under both orderings at once, interleaved: the CPU side's comparison.

``bench/lease.py`` measures IPC events, then memops against a second daemon, one after
the other (on CUDA one gpumemd serves a device): a machine whose speed drifts between
the halves moves their ratio. On the host backend two daemons can run together, so here
both do (``--lease-ordering ipc-events`` and ``memops``), each with its owner process
(its arena and shared pool) and two client processes taking turns on the pool's replay
lease as lease.py's do (1 ms hold, 300 us pause after each release). The turns run in
blocks of ``--per-block`` per process, alternating between the orderings (and which one
goes first), so both see the same moments of the machine.

Figures: each ordering's handoff p50 / p99 (release to the waiter holding the lease), the
release call's own p50 and the clients' CPU time per handoff, and ``memops_to_events_p50`` (target: at most 1, the memops
handoff at or below the IPC-event one). Host backend only: no driver call is made, so
this compares the Python and native work of the two paths around the same futex wake.

    python bench/lease_orderings.py --blocks 16 --per-block 50
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as c
import lease as lease_bench

BENCH = "lease_orderings"
MiB = 1 << 20
ORDERINGS = ("ipc-events", "memops")
CLIENTS = ("turn-a", "turn-b")


def owner(runtime_dir: str) -> int:
    """The pool's owner: its arena, the shared pool, shared with the clients; it stays
    until its stdin closes."""
    import gpumem
    from gpumem_shared import protocol as p

    session = gpumem.connect(0, name="owner", runtime_dir=runtime_dir)
    arena = session.create_arena("graphs", 1 << 30)
    arena.commit(64 * MiB)
    arena.register_graph_pool("pool", extents=[p.Extent(offset=0, size=32 * MiB)], free_runs=[], shared=True)
    for name in CLIENTS:
        arena.share(name)
    print("READY", flush=True)
    sys.stdin.read()
    session.close()
    return 0


def client(name: str, runtime_dir: str) -> int:
    """A turn taker: per line ``n`` on stdin, n turns; prints their (acquired, released,
    release call ns, ns from the take to the next line) as a JSON line."""
    import gpumem

    session = gpumem.connect(0, name=name, runtime_dir=runtime_dir)
    session.attach_arena("graphs")
    pool = session.open_graph_pool(owner="owner", label="pool")
    print("READY", flush=True)
    for line in sys.stdin:
        cpu = time.process_time_ns()
        turns = lease_bench.turns(session, pool, int(line))
        cpu = time.process_time_ns() - cpu
        print(json.dumps({"turns": turns, "waits": session.leasing.handoff_waits, "cpu_ns": cpu}), flush=True)
    session.close()
    return 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--owner":
        return owner(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[1] == "--client":
        return client(sys.argv[2], sys.argv[3])
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["host", "cuda"], default="host", help="host only (cuda is refused: one gpumemd serves a GPU)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per ordering")
    parser.add_argument("--per-block", type=int, default=50, help="turns per process in a block")
    args = parser.parse_args()
    c.ensure_importable()

    def ready(proc: Any, what: str, daemon: c.Daemon) -> None:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("READY"):
            proc.wait(10)
            raise RuntimeError(f"{what} said {line!r} (exit status {proc.returncode}); daemon log:\n{daemon.log()}")

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        result.targets = {"memops_to_events_p50_max": 1.0}
        if args.backend == "cuda":
            raise RuntimeError("host backend only: on CUDA one gpumemd serves a GPU, so both orderings cannot run at once; "
                               "bench/lease.py --backend cuda measures them one after the other")
        procs: dict[str, list[Any]] = {}
        for ordering in ORDERINGS:
            rt: Path = cleanup.enter_context(c.runtime_dir())
            daemon = c.Daemon(rt, "host", args=["--lease-ordering", ordering])
            cleanup.callback(daemon.stop)
            daemon.wait_ready(60)
            env = c.child_env(GPUMEMD_RUNTIME_DIR=str(rt))
            # The owner in a process of its own per daemon: one process's arenas of two
            # daemons would land on each other (both plan device 0's address slice).
            own = subprocess.Popen([sys.executable, __file__, "--owner", str(rt)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            cleanup.callback(own.kill)
            ready(own, f"the {ordering} pool's owner", daemon)
            turners = c.spawn_clients(__file__, CLIENTS, [str(rt)], env, cleanup)
            for name, proc in zip(CLIENTS, turners):
                ready(proc, f"{ordering} client {name}", daemon)
            procs[ordering] = turners
        turns: dict[str, list[tuple[int, int, int, int]]] = {o: [] for o in ORDERINGS}
        handoffs: dict[str, list[float]] = {o: [] for o in ORDERINGS}
        waits: dict[str, dict[int, int]] = {o: {} for o in ORDERINGS}  # each client's count so far
        cpu_ns = dict.fromkeys(ORDERINGS, 0)  # the clients' CPU time in their turns
        for block in range(2 * args.blocks):
            ordering = ORDERINGS[(block + block // 2) % 2]  # a b b a a b ...: each goes first as often
            block_turns = []
            for proc in procs[ordering]:
                proc.stdin.write(f"{args.per_block}\n")
                proc.stdin.flush()
            for index, proc in enumerate(procs[ordering]):
                report = json.loads(proc.stdout.readline())
                block_turns += [(acquired, released, index, call) for acquired, released, call, _after in report["turns"]]
                waits[ordering][index] = report["waits"]
                cpu_ns[ordering] += report["cpu_ns"]
            block_turns.sort()
            handoffs[ordering] += [
                (nxt[0] - cur[1]) / 1e3 for cur, nxt in zip(block_turns, block_turns[1:]) if nxt[2] != cur[2] and nxt[0] >= cur[1]
            ]
            turns[ordering] += block_turns
        for ordering in ORDERINGS:
            p50, p99 = c.median(handoffs[ordering]), c.percentile(handoffs[ordering], 99)
            call = c.median([t[3] for t in turns[ordering]]) / 1e3
            cpu = cpu_ns[ordering] / max(1, len(handoffs[ordering])) / 1e3
            c.say(
                f"{ordering}: handoff p50 {p50:.1f} us, p99 {p99:.1f} us over {len(handoffs[ordering])}; release call p50 {call:.1f} us; "
                f"the clients' CPU time per handoff {cpu:.1f} us"
            )
            key = "events" if ordering == "ipc-events" else "memops"
            result.figures |= {f"{key}_handoff_p50_us": p50, f"{key}_handoff_p99_us": p99, f"{key}_release_call_p50_us": call}
            result.figures[f"{key}_client_cpu_per_handoff_us"] = cpu
            result.figures[f"{key}_handoffs"] = len(handoffs[ordering])
            result.figures[f"{key}_handoff_waits"] = sum(waits[ordering].values())
        ratio = c.ratio(result.figures["memops_handoff_p50_us"], result.figures["events_handoff_p50_us"])
        result.figures["memops_to_events_p50"] = ratio
        c.say(f"memops handoff p50 / IPC-event handoff p50: {ratio:.3f}")
        # Every handoff ordered: a stream wait (host: the word found reached) at each.
        result.ok = ratio <= 1.0 and all(
            result.figures[f"{key}_handoff_waits"] >= result.figures[f"{key}_handoffs"] > 0 for key in ("events", "memops")
        )

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    raise SystemExit(main())
