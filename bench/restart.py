#!/usr/bin/env python3
"""Daemon restart under live clients: how long from the new daemon's start until every
client has resumed, and how long the calls the restart caught waited.

gpumemd runs under tests/integration/fdstore_kit.py's ServiceManager, which speaks
systemd's fd-store protocol (the daemon cannot tell it from systemd). ``--clients``
client processes each commit their share of ``--bytes`` into an arena, then ping the
daemon in a loop (a call every ``--interval`` seconds), timing every call. The daemon is
killed with kill -9 and started again ``--restarts`` times; after each start the bench
polls STATUS until no session waits for its client.

    python bench/restart.py --backend host                  # 2 GiB
    python bench/restart.py --backend cuda                  # 100 GiB, the target's size (where it fits)

Figures: ready_s (start to READY=1: the rebuild), resumed_s (start to every client
resumed) p50 and max, the daemon's own startup phases (its "startup phases:" log line,
daemon/gpumemd/startup.py) as phase_<name>_ms_p50, max_delayed_call_s (the slowest
call any client made), and the cost of the durable record on the control path: commit_us p50 (a 2 MiB commit and its
decommit, with the fd store) against commit_plain_us p50 (the same against a daemon with
no store). Last line: {"bench": "restart", "backend", "figures", "targets", "ok"}; ok
means resumed_max_s <= --target (default 1.0 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import _common as c

BENCH = "restart"
MiB = 1 << 20
_PHASE = re.compile(r"(\w+) ([\d.]+) ms")


def client(name: str, runtime_dir: str, nbytes: int, interval: float, commits: int) -> int:
    """One client: its share committed, commit timing, then pings until stdin closes."""
    import gpumem

    session = gpumem.connect(0, name, runtime_dir=runtime_dir, timeout=120)
    granularity = session.device.granularity
    if nbytes:
        big = session.create_arena(f"{name}-big", nbytes)
        big.commit(nbytes)
    small = session.create_arena(f"{name}-small", 64 * MiB)
    times = []
    for _ in range(commits):
        started = time.perf_counter()
        small.commit(granularity)
        small.decommit(0)
        times.append(time.perf_counter() - started)
    print("COMMIT", json.dumps(sorted(times)[len(times) // 2] * 1e6 if times else 0.0), flush=True)
    if interval < 0:
        session.close()
        return 0
    slowest = 0.0
    calls = 0
    while not select.select([sys.stdin], [], [], 0)[0]:  # stdin closed: stop
        started = time.monotonic()
        session.ping()
        slowest = max(slowest, time.monotonic() - started)
        calls += 1
        time.sleep(interval)
    print("DONE", json.dumps({"slowest_s": slowest, "calls": calls}), flush=True)
    session.close()
    return 0


def main() -> int:
    ap = c.ArgumentParser(BENCH, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--bytes", help="committed across all clients (default: 100GiB on cuda, 2GiB on host, "
                    "or 0.75 of the device's free memory where less)")
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--interval", type=float, default=0.002, help="seconds between a client's pings (default: 0.002)")
    ap.add_argument("--commits", type=int, default=300, help="timed commit+decommit pairs per client (default: 300)")
    ap.add_argument("--target", type=float, default=1.0, help="ok when resumed_max_s <= this (default: 1.0)")
    ap.add_argument("--client", nargs=5, metavar=("NAME", "DIR", "BYTES", "INTERVAL", "COMMITS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        name, runtime_dir, nbytes, interval, commits = args.client
        return client(name, runtime_dir, int(nbytes), float(interval), int(commits))
    c.ensure_importable()
    return c.run(BENCH, args.backend, lambda result, cleanup: body(args, result, cleanup))


def spawn(name: str, runtime_dir: Path, nbytes: int, interval: float, commits: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--client", name, str(runtime_dir), str(nbytes), str(interval), str(commits)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=c.child_env(GPUMEMD_RUNTIME_DIR=str(runtime_dir)),
    )


def expect(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise RuntimeError(f"a client exited ({proc.wait()}) before printing {prefix!r}")


def startup_phases(log: str) -> list[dict[str, float]]:
    """Each start's phases in ms, from the daemon's "startup phases:" lines, in start order."""
    starts = []
    for line in log.splitlines():
        _, found, rest = line.partition("startup phases: ")
        if found:
            starts.append({name: float(ms) for name, ms in _PHASE.findall(rest.partition(" (")[0])})
    return starts


def body(a: argparse.Namespace, result: c.Result, cleanup: contextlib.ExitStack) -> None:
    from gpumem_shared import protocol as p
    from gpumem_shared.paths import Endpoints
    from gpumem_shared.units import parse

    from gpumem.control import ControlChannel

    sys.path.insert(0, str(c.REPO / "tests" / "integration"))
    from fdstore_kit import ServiceManager

    default = (100 if a.backend == "cuda" else 2) << 30
    total = parse(a.bytes).bytes if a.bytes else c.fit(default, a.backend, 0.75, "committed across the clients")
    granularity = 2 * MiB
    share = total // a.clients // granularity * granularity
    rd = cleanup.enter_context(c.runtime_dir("gmr-"))
    daemon_args = ["--device", "0", "--backend", a.backend, "--runtime-dir", str(rd)]
    if a.backend == "host":
        daemon_args += ["--host-capacity", f"{max(total * 2, 4 << 30)}"]

    # The control path without a store: the figure the record's cost is measured against.
    plain = c.Daemon(rd, a.backend, args=daemon_args[6:])
    cleanup.callback(plain.stop)
    plain.wait_ready(60)
    probe = spawn("plain", rd, 0, -1, a.commits)
    commit_plain = float(expect(probe, "COMMIT "))
    probe.wait(60)
    plain.stop()

    manager = ServiceManager(rd)
    cleanup.callback(manager.close)
    env = c.child_env()
    manager.start(daemon_args, env)
    clients = [spawn(f"engine-{i}", rd, share, a.interval, a.commits) for i in range(a.clients)]
    for proc in clients:
        cleanup.callback(proc.kill)
    commit_store = [float(expect(proc, "COMMIT ")) for proc in clients]
    c.say(f"{a.clients} clients hold {share * a.clients} bytes; restarting {a.restarts} times")
    ready: list[float] = []
    resumed: list[float] = []
    for n in range(a.restarts):
        time.sleep(0.3)
        manager.kill()
        started = time.monotonic()
        manager.start(daemon_args, env, wait=False)
        manager.wait_ready(120)
        ready.append(time.monotonic() - started)
        # A new DEALER for each daemon: one kept across the restart would reconnect only
        # at ZeroMQ's reconnect interval (100 ms), and the figure would be that.
        with contextlib.closing(ControlChannel(Endpoints(rd, 0))) as control:
            while True:
                s: p.StatusReply = control.call(p.Status(), 30)
                if s.daemon.waiting == 0 and s.daemon.generation == n + 1:
                    break
                time.sleep(0.002)
        resumed.append(time.monotonic() - started)
        c.say(f"restart {n + 1}: ready in {ready[-1]:.3f}s, every client resumed in {resumed[-1]:.3f}s")
    phases = startup_phases(manager.log())[1:]  # the restarts, not the first start
    if len(phases) != a.restarts:
        raise RuntimeError(f"{len(phases)} 'startup phases:' lines in {manager.log_path} for {a.restarts} restarts")
    phase_p50 = {f"phase_{name}_ms_p50": c.median([s[name] for s in phases]) for name in phases[0]}
    c.say("daemon startup phases, p50: " + ", ".join(f"{k[6:-7]} {v:.1f} ms" for k, v in phase_p50.items()))
    slowest = 0.0
    for proc in clients:
        assert proc.stdin is not None
        proc.stdin.close()
        done = json.loads(expect(proc, "DONE "))
        slowest = max(slowest, done["slowest_s"])
        proc.wait(60)
    result.figures = {
        "restarts": a.restarts, "clients": a.clients, "bytes": share * a.clients,
        "ready_p50_s": c.median(ready), "ready_max_s": max(ready),
        "resumed_p50_s": c.median(resumed), "resumed_max_s": max(resumed),
        "max_delayed_call_s": slowest, **phase_p50,
        "commit_us_p50": c.median(commit_store), "commit_plain_us_p50": commit_plain,
    }
    result.targets = {"resumed_max_s": a.target}
    result.ok = max(resumed) <= a.target


if __name__ == "__main__":
    sys.exit(main())
