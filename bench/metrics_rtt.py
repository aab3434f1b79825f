#!/usr/bin/env python3
"""Control round trip with metrics on and scraped, against the same daemon without them.

Three private gpumemd processes with the same state (a helper process's session holding
``--arenas`` committed arenas and a registered graph pool, in each): one with
``--metrics-port 0``, two without ("plain" and "control"). The benchmark pings all three
through the whole client stack (``Session.ping()``), call by call, rotating which goes
first, in two phases:

- idle: nobody scrapes. The metrics daemon still rebuilds its snapshot on every tick
  (each ping changes a counter): what the snapshot costs, and any difference between
  two daemon processes on this machine.
- scraped: a scraper process GETs /metrics every ``--scrape-interval`` seconds (0.1).

The control daemon is the same as the plain one: control_ratio_p50 (control p50 / plain
p50) is how far two identical daemons land apart on this machine in the same run, the
floor under which ratio_p50 says nothing.

    python bench/metrics_rtt.py --backend host
    python bench/metrics_rtt.py --backend cuda --cpus 2:4

Last line: {"bench": "metrics_rtt", "backend", "figures", "targets", "ok"}; ok means
ratio_p50 (scraped phase: metrics p50 / plain p50) <= --target (default 1.02).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import sys
import time
import urllib.request
from pathlib import Path

import _common as c

BENCH = "metrics_rtt"
MiB = 1 << 20


def scraper(url: str, interval: float) -> int:
    """GET ``url`` every ``interval`` seconds until terminated; a line per scrape."""
    while True:
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                size = len(response.read())
            print(f"ok {size} {(time.perf_counter() - started) * 1e3:.3f}", flush=True)
        except OSError as exc:
            print(f"failed {exc}", flush=True)
        time.sleep(max(0.0, interval - (time.perf_counter() - started)))


def metrics_url(daemon: c.Daemon, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        match = re.search(r"serving metrics at (http://\S+)", daemon.log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the metrics daemon logged no URL within {timeout:g}s; its log:\n{daemon.log()}")
        time.sleep(0.05)


def holder(runtime_dir: str, device: int, arenas: int, ready_file: str) -> int:
    """In its own process (both daemons plan windows at the same addresses, so one
    process cannot map both): the same state in each daemon, so the snapshot has rows
    to render; held until terminated."""
    import gpumem
    from gpumem_shared import protocol as p

    session = gpumem.connect(device, name="bench-holder", runtime_dir=runtime_dir, timeout=10.0)
    for i in range(arenas):
        arena = session.create_arena(f"bench-{i}", 64 * MiB)
        arena.commit(4 * MiB)
        if i == 0:
            extent = p.Extent(offset=0, size=4 * MiB)
            session.call(p.RegisterGraphPool(arena=arena.name, label="decode", extents=[extent], free_runs=[extent]))
    Path(ready_file).write_text("ready\n")
    while True:
        time.sleep(3600)


def time_rotating(sessions: list[object], n: int, outs: list[list[float]]) -> None:
    """One ping to each daemon per iteration, the first one rotating."""
    pings = [s.ping for s in sessions]  # type: ignore[attr-defined]
    order = [[(k + i) % len(pings) for k in range(len(pings))] for i in range(len(pings))]
    clock = time.perf_counter_ns
    for i in range(n):
        for k in order[i % len(order)]:
            t0 = clock()
            pings[k]()
            outs[k].append(clock() - t0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = c.ArgumentParser(BENCH, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host", help="daemon backend (default: host)")
    ap.add_argument("--device", type=int, default=0, help="device index both daemons serve (default: 0)")
    ap.add_argument("--iterations", type=int, default=20000, help="timed round trips per daemon and phase (default: 20000)")
    ap.add_argument("--warmup", type=int, default=2000, help="untimed round trips per daemon first (default: 2000)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds each phase is split into (default: 10)")
    ap.add_argument("--arenas", type=int, default=16, help="committed arenas in each daemon (default: 16)")
    ap.add_argument("--scrape-interval", type=float, default=0.1, help="seconds between scrapes (default: 0.1)")
    ap.add_argument("--target", type=float, default=1.02, help="ok when the scraped phase's ratio_p50 <= this (default: 1.02)")
    ap.add_argument("--start-timeout", type=float, default=60.0, help="seconds the daemons get to start")
    ap.add_argument("--call-timeout", type=float, default=10.0, help="seconds one round trip may take before failing")
    ap.add_argument("--cpus", metavar="CLIENT:SERVER", default=None,
                    help="pin the benchmark to CPU list CLIENT, the daemons, holders and scraper to SERVER (default: no pinning)")
    ap.add_argument("--scraper", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--holder", metavar="RUNTIME_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.scraper is None and args.holder is None:
        if args.iterations < 1 or args.rounds < 1 or args.warmup < 0 or args.arenas < 1:
            ap.error("--iterations, --rounds and --arenas must be >= 1, --warmup >= 0")
        if args.backend == "cuda":
            # Three daemons side by side, one device: gpumemd serves each GPU once. What
            # the metrics cost is the daemon's own work, which the host backend measures.
            ap.error("the three daemons it compares cannot share one GPU (one gpumemd per GPU); run --backend host")
        try:
            args.cpus = c.parse_cpus(args.cpus)
        except ValueError as exc:
            ap.error(str(exc))
    return args


ROLES = ("metrics", "plain", "control")


def phase(name: str, sessions: dict[str, object], args: argparse.Namespace) -> dict[str, float]:
    every: dict[str, list[float]] = {role: [] for role in ROLES}
    ratios = []
    per_round = [args.iterations // args.rounds + (1 if r < args.iterations % args.rounds else 0) for r in range(args.rounds)]
    for r, n in enumerate(per_round):
        outs: list[list[float]] = [[] for _ in ROLES]
        gc.collect()
        gc.disable()
        try:
            time_rotating([sessions[role] for role in ROLES], n, outs)
        finally:
            gc.enable()
        p50 = {role: c.median(out) for role, out in zip(ROLES, outs)}
        for role, out in zip(ROLES, outs):
            every[role] += out
        ratios.append(c.ratio(p50["metrics"], p50["plain"]))
        c.say(f"  {name} round {r + 1:2d}/{args.rounds}: p50 metrics {p50['metrics'] / 1e3:6.1f} us  plain {p50['plain'] / 1e3:6.1f} us  "
              f"control {p50['control'] / 1e3:6.1f} us  ratio {ratios[-1]:.3f}")
    us = 1e-3
    out = {f"{role}_{q}_us": c.percentile(every[role], int(q[1:])) * us for role in ROLES for q in ("p50", "p99")}
    out["ratio_p50"] = c.ratio(out["metrics_p50_us"], out["plain_p50_us"])
    out["ratio_p99"] = c.ratio(out["metrics_p99_us"], out["plain_p99_us"])
    out["control_ratio_p50"] = c.ratio(out["control_p50_us"], out["plain_p50_us"])
    out["round_ratio_p50_min"], out["round_ratio_p50_max"] = min(ratios), max(ratios)
    return out


def body(args: argparse.Namespace, result: c.Result, cleanup: contextlib.ExitStack) -> None:
    result.targets = {"ratio_p50_max": args.target, "scrape_interval_s": args.scrape_interval}
    c.say(f"{BENCH}: backend={args.backend} device={args.device} iterations={args.iterations} per phase, "
          f"arenas={args.arenas}, scrape every {args.scrape_interval:g}s")
    c.pin(args.cpus)
    daemons = {}
    for role in ROLES:
        extra = ["--metrics-port", "0"] if role == "metrics" else []
        rdir = cleanup.enter_context(c.runtime_dir(f"gmb-met-{role[0]}-"))
        daemon = c.Daemon(rdir, args.backend, args.device, extra)
        cleanup.callback(daemon.stop)
        daemons[role] = daemon
    for daemon in daemons.values():
        daemon.wait_ready(args.start_timeout)
    url = metrics_url(daemons["metrics"], args.start_timeout)
    c.say(f"metrics at {url}")

    import gpumem

    sessions = {}
    for role, daemon in daemons.items():
        ready = daemon.runtime_dir / "holder.ready"
        hold = c.Child(f"{role} state holder", [str(Path(__file__).resolve()), "--holder", str(daemon.runtime_dir), "--device",
                                                str(args.device), "--arenas", str(args.arenas), "--ready-file", str(ready)],
                       daemon.runtime_dir / "holder.log")
        cleanup.callback(hold.stop)
        hold.wait_for(ready.exists, args.start_timeout, f"holding {args.arenas} arenas")
        session = gpumem.connect(args.device, name=f"bench-{role}", runtime_dir=daemon.runtime_dir, timeout=args.call_timeout)
        cleanup.callback(session.close)
        sessions[role] = session
    for _ in range(args.warmup):
        for session in sessions.values():
            session.ping()

    idle = phase("idle", sessions, args)
    log = daemons["metrics"].runtime_dir / "scraper.log"
    scrape = c.Child("scraper", [str(Path(__file__).resolve()), "--scraper", url, "--scrape-interval", str(args.scrape_interval)], log)
    cleanup.callback(scrape.stop)
    scrape.wait_for(lambda: "ok " in log.read_text(), args.start_timeout, "its first scrape")
    started = time.monotonic()
    scraped = phase("scraped", sessions, args)
    elapsed = time.monotonic() - started
    scrape.stop()
    lines = log.read_text().splitlines()
    times = [float(line.split()[2]) for line in lines if line.startswith("ok ")]
    sizes = [int(line.split()[1]) for line in lines if line.startswith("ok ")]
    failed = [line for line in lines if line.startswith("failed")]
    if failed:
        raise RuntimeError(f"{len(failed)} scrape(s) failed, e.g. {failed[0]}")

    fig = {f"idle_{k}": v for k, v in idle.items()} | scraped
    fig |= {
        "iterations": args.iterations,
        "cpus": None if args.cpus is None else "{}:{}".format(*(",".join(map(str, sorted(s))) for s in args.cpus)),
        "scrapes": len(times),
        "scraped_phase_s": elapsed,
        "scrape_p50_ms": c.median(times),
        "scrape_bytes": max(sizes),
    }
    result.figures = fig
    result.ok = scraped["ratio_p50"] <= args.target
    c.say("")
    c.say(f"idle (metrics on, not scraped): ratio p50 {idle['ratio_p50']:.3f}  (metrics {idle['metrics_p50_us']:.1f} us, "
          f"plain {idle['plain_p50_us']:.1f} us); control/plain {idle['control_ratio_p50']:.3f}")
    c.say(f"scraped every {args.scrape_interval:g}s ({len(times)} scrapes of {max(sizes)} bytes, p50 {c.median(times):.2f} ms): "
          f"ratio p50 {scraped['ratio_p50']:.3f} (target <= {args.target}: {'met' if result.ok else 'NOT met'}), "
          f"p99 {scraped['ratio_p99']:.3f}  (metrics {scraped['metrics_p50_us']:.1f} us, plain {scraped['plain_p50_us']:.1f} us); "
          f"control/plain {scraped['control_ratio_p50']:.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.scraper is not None:
        return scraper(args.scraper, args.scrape_interval)
    if args.holder is not None:
        return holder(args.holder, args.device, args.arenas, args.ready_file)
    c.ensure_importable()
    return c.run(BENCH, args.backend, lambda result, cleanup: body(args, result, cleanup), args.device)


if __name__ == "__main__":
    sys.exit(main())
