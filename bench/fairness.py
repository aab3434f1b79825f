#!/usr/bin/env python3
"""Fair service: one session's round trip while other peers flood the control channel.

The probe is a gpumem session that calls ``Session.ping()`` one at a time. Its idle p99
is the baseline, measured in the same run before the flood starts. Then ``--flooders``
peers, each a process of its own with ``--sockets`` DEALERs on the daemon's control
socket (connections cost a peer nothing), keep ``--depth`` requests in flight on each
without pause (a new one for every reply), and the probe's round trip is measured
again; then once more after they stopped (a recovery check: it shows whether the flood
left anything behind). On a machine with fewer cores than flooders plus two, the
flooders take CPU from the probe and the daemon, and p99 measures the scheduler.

With ``--sessions N`` each flooder opens N sessions instead (HELLO on the fd channel,
then a DEALER under the session's token, ``--depth`` requests in flight on each), as
``--flood-uid`` (default: 65534 when run as root, the daemon's sockets opened to its
group; otherwise the bench's own uid, and the figures say so; anonymous flooders run as
the bench's uid unless told): the daemon's turns are
per uid, so N sessions of one uid must delay another uid's probe no more than one.

    python bench/fairness.py --backend host
    python bench/fairness.py --backend host --flooders 1 --sessions 200
    python bench/fairness.py --backend cuda --flooders 4 --sockets 1 --depth 64

Last line: {"bench": "fairness", "backend", "figures", "targets", "ok"}; ok means
ratio_p99 = flooded p99 / idle p99 <= --target (default 3).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import sys
import time
from pathlib import Path

import _common as c

BENCH = "fairness"


# ---------------------------------------------------------------------------
# A flooder (runs in its own process: this file with --flooder)
# ---------------------------------------------------------------------------


def open_session(fd_path: str, name: str) -> tuple[socket.socket, bytes]:
    """A session opened by hand: HELLO on the fd channel; its channel and its token."""
    from gpumem_shared import protocol as p

    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    channel.connect(fd_path)
    channel.send(p.encode_request(1, p.Hello(name=name, client_version="bench")))
    reply = p.decode_reply(channel.recv(1 << 16))
    if not reply.ok:
        raise RuntimeError(f"HELLO refused: {reply.code.name} {reply.message}")
    return channel, p.decode_body(p.HelloReply, reply.body).token


def flooder(url: str, request: str, depth: int, sockets: int, sessions: int, uid: int, ready_file: str) -> int:
    """Keep ``depth`` requests in flight on each of ``sockets`` anonymous DEALERs, or on
    each of ``sessions`` sessions' (as ``uid``), until SIGTERM (or orphaned)."""
    import zmq

    from gpumem_shared import protocol as p

    if uid >= 0 and uid != os.getuid():
        os.setgid(uid)
        os.setuid(uid)
    message: p.RequestMessage = p.Status() if request == "status" else p.Ping()
    parent = os.getppid()
    ctx = zmq.Context()
    socks = []
    poller = zmq.Poller()
    frames = [p.encode_request(i, message) for i in range(1, depth + 1)]
    fd_path = str(Path(url.removeprefix("ipc://")).with_suffix(".fd"))
    channels = [open_session(fd_path, f"bench-flood-{os.getpid()}-{i}") for i in range(sessions)]
    for i in range(sessions or sockets):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if channels:
            sock.setsockopt(zmq.ROUTING_ID, channels[i][1])
        sock.connect(url)
        for frame in frames:
            sock.send(frame)
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    Path(ready_file).write_text(f"{os.getpid()}\n")
    try:
        while True:
            ready = poller.poll(1000)  # wake up now and then to notice an orphaning
            if not ready and os.getppid() != parent:
                return 0
            for sock, _ in ready:
                while True:
                    try:
                        sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sock.send(frames[0])
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        for channel, _ in channels:
            channel.close()


# ---------------------------------------------------------------------------


def time_pings(session: object, n: int) -> list[float]:
    ping = session.ping  # type: ignore[attr-defined]
    clock = time.perf_counter_ns
    out: list[float] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(n):
            t0 = clock()
            ping()
            out.append(clock() - t0)
    finally:
        gc.enable()
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = c.ArgumentParser(BENCH, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host", help="daemon backend (default: host)")
    ap.add_argument("--device", type=int, default=0, help="device index the daemon serves (default: 0)")
    ap.add_argument("--iterations", type=int, default=5000, help="timed probe round trips per phase (default: 5000)")
    ap.add_argument("--warmup", type=int, default=1000, help="untimed probe round trips first (default: 1000)")
    ap.add_argument("--flooders", type=int, default=4, help="flooding peers, one process each (default: 4)")
    ap.add_argument("--depth", type=int, default=16, help="requests each flooder keeps in flight per connection (default: 16)")
    ap.add_argument("--sockets", type=int, default=16,
                    help="control connections each flooder opens: ZeroMQ turns over connections, not peers (default: 16)")
    ap.add_argument("--request", choices=["ping", "status"], default="ping", help="what the flooders send (default: ping)")
    ap.add_argument("--sessions", type=int, default=0,
                    help="sessions each flooder opens and floods through, instead of --sockets anonymous connections (default: 0)")
    ap.add_argument("--flood-uid", type=int, default=None,
                    help="the uid the flooders run as (default: with --sessions, 65534 when run as root; else the bench's own)")
    ap.add_argument("--target", type=float, default=3.0, help="ok when ratio_p99 <= this (default: 3)")
    ap.add_argument("--start-timeout", type=float, default=60.0, help="seconds the daemon and flooders get to start")
    ap.add_argument("--call-timeout", type=float, default=10.0, help="seconds one round trip may take before failing")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                    help="an extra gpumemd argument (repeatable), e.g. --daemon-arg=--control-batch=1")
    ap.add_argument("--cpus", metavar="CLIENT:SERVER", default=None,
                    help="pin the benchmark to CPU list CLIENT and the daemon and flooders to SERVER (default: no pinning)")
    ap.add_argument("--flooder", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--as-uid", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.flooder is None:
        if args.iterations < 100 or args.warmup < 0 or min(args.flooders, args.depth, args.sockets) < 1 or args.sessions < 0:
            ap.error("--iterations must be >= 100, --flooders, --sockets and --depth >= 1, --warmup and --sessions >= 0")
        if args.flood_uid is None:
            args.flood_uid = 65534 if os.getuid() == 0 and args.sessions else os.getuid()
        try:
            args.cpus = c.parse_cpus(args.cpus)
        except ValueError as exc:
            ap.error(str(exc))
    return args


def _figures(prefix: str, ns: list[float]) -> dict[str, float]:
    us = 1e-3
    return {
        f"{prefix}_p50_us": c.percentile(ns, 50) * us,
        f"{prefix}_p99_us": c.percentile(ns, 99) * us,
        f"{prefix}_max_us": max(ns) * us,
    }


def body(args: argparse.Namespace, result: c.Result, cleanup: contextlib.ExitStack) -> None:
    result.targets = {"ratio_p99_max": args.target}
    c.pin(args.cpus)
    rdir = cleanup.enter_context(c.runtime_dir("gmb-fair-"))
    c.say(f"{BENCH}: backend={args.backend} device={args.device} iterations={args.iterations} flooders={args.flooders} "
          f"sockets={args.sockets} sessions={args.sessions} flood uid={args.flood_uid} depth={args.depth} "
          f"request={args.request} runtime dir {rdir}")
    daemon_args, ddir = list(args.daemon_arg), rdir
    if args.flood_uid != os.getuid():
        # The flooders' uid reaches the daemon's sockets through their group and writes its
        # ready files and logs here; gpumemd refuses a directory others may write, so it
        # gets one of its own inside.
        rdir.chmod(0o1777)
        ddir = rdir / "gpumemd"
        ddir.mkdir(mode=0o755)
        daemon_args += [f"--socket-group={args.flood_uid}"]
    daemon = c.Daemon(ddir, args.backend, args.device, daemon_args)
    cleanup.callback(daemon.stop)
    daemon.wait_ready(args.start_timeout)

    import gpumem
    from gpumem_shared.paths import Endpoints

    session = gpumem.connect(args.device, name="bench-fairness-probe", runtime_dir=ddir, timeout=args.call_timeout)
    cleanup.callback(session.close)
    c.say(f"connected: {session!r}")
    time_pings(session, args.warmup)

    idle = time_pings(session, args.iterations)
    c.say(f"idle   : p50 {c.median(idle) / 1e3:8.1f} us  p99 {c.percentile(idle, 99) / 1e3:8.1f} us")

    url = Endpoints(ddir, args.device).zmq_url
    flooders = []
    for i in range(args.flooders):
        ready = rdir / f"flooder{i}.ready"
        child = c.Child(f"flooder {i}", [str(Path(__file__).resolve()), "--flooder", url, "--ready-file", str(ready),
                                         "--request", args.request, "--depth", str(args.depth),
                                         "--sockets", str(args.sockets), "--sessions", str(args.sessions),
                                         "--as-uid", str(args.flood_uid)], rdir / f"flooder{i}.log")
        cleanup.callback(child.stop)
        flooders.append((child, ready))
    for child, ready in flooders:
        child.wait_for(ready.exists, args.start_timeout, "sending its first requests")
    time_pings(session, args.warmup)  # the flood reaches its steady state
    started = time.monotonic()
    flooded = time_pings(session, args.iterations)
    seconds = time.monotonic() - started
    c.say(f"flooded: p50 {c.median(flooded) / 1e3:8.1f} us  p99 {c.percentile(flooded, 99) / 1e3:8.1f} us "
          f"({args.iterations} pings in {seconds:.2f}s)")
    for child, _ in flooders:
        child.stop()
    after = time_pings(session, args.iterations)
    c.say(f"after  : p50 {c.median(after) / 1e3:8.1f} us  p99 {c.percentile(after, 99) / 1e3:8.1f} us")

    fig: dict[str, object] = {"iterations": args.iterations, "flooders": args.flooders, "sockets": args.sockets,
                              "sessions": args.sessions, "flood_uid": args.flood_uid, "probe_uid": os.getuid(), "depth": args.depth,
                              "request": args.request, "daemon_args": " ".join(daemon_args)}
    fig |= _figures("idle", idle) | _figures("flooded", flooded) | _figures("after", after)
    fig["ratio_p50"] = c.ratio(c.median(flooded), c.median(idle))
    fig["ratio_p99"] = c.ratio(c.percentile(flooded, 99), c.percentile(idle, 99))
    fig["ratio_after_p99"] = c.ratio(c.percentile(after, 99), c.percentile(idle, 99))
    result.figures = fig
    result.ok = fig["ratio_p99"] <= args.target
    c.say("")
    c.say(f"probe p99 under {args.flooders} flooders / idle p99: {fig['ratio_p99']:.2f} "
          f"(target <= {args.target:g}: {'met' if result.ok else 'NOT met'}); p50 ratio {fig['ratio_p50']:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.flooder is not None:
        if not args.ready_file:
            sys.exit("--flooder needs --ready-file")
        c.ensure_importable()
        return flooder(args.flooder, args.request, args.depth, args.sockets, args.sessions, args.as_uid, args.ready_file)
    c.ensure_importable()
    return c.run(BENCH, args.backend, lambda result, cleanup: body(args, result, cleanup), args.device)


if __name__ == "__main__":
    sys.exit(main())
