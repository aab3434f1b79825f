"""A daemon with a small open-file limit, flooded with fd-channel connections that never
say HELLO: it stays alive and nearly idle, sessions already open keep working, and a new
client gets in once the flood stops.

Before the daemon budgeted its descriptors it accepted until EMFILE, then spun on the
still-readable listener (about 90% CPU on this test's machine) until libzmq aborted the
process in an assert, failing to accept a control-channel peer ("Too many open files
(src/ipc_listener.cpp)")."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import gpumem
from conftest import child_env
from gpumem_shared import protocol as p
from gpumemd_testkit import MiB, Probe, RawSession, envelope, status

NOFILE = 256
FLOOD_SECONDS = 3.0
# Under a flood the daemon accepts at most its pending cap per EVICT_AFTER (24 per half
# second at this limit) and wakes once per tick: a few percent of one CPU. The bound
# leaves room for a slow CI machine; the daemon that spun used about 90%.
CPU_SHARE_BOUND = 0.25

# Opens fd-channel connections as fast as the daemon's backlog takes them, never says a
# word on them, and holds up to a few thousand (closing the oldest beyond that), until
# killed. Prints how many it opened, and how often it found the backlog full, when asked
# to stop.
FLOODER = """
import os, resource, signal, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
keep = min(3000, hard - 64)
path, opened, refused, held = sys.argv[1], 0, 0, []
signal.signal(signal.SIGTERM, lambda *_: (print(opened, refused, flush=True), os._exit(0)))
print("flooding", flush=True)
while True:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setblocking(False)
    try:
        s.connect(path)
    except BlockingIOError:
        s.close()
        refused += 1
        time.sleep(0.001)
        continue
    opened += 1
    held.append(s)
    if len(held) > keep:
        held.pop(0).close()
"""


def test_connection_flood_under_a_small_fd_limit(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", nofile=NOFILE)
    probe = Probe(daemon.pid)
    with RawSession(runtime_dir, "steady") as steady:
        steady.create("kv", 1 << 30)
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, str(runtime_dir / "gpu0.fd")], stdout=subprocess.PIPE, text=True, env=child_env(runtime_dir)
        )
        try:
            assert flooder.stdout is not None and flooder.stdout.readline().strip() == "flooding"
            cpu_before, started = probe.cpu_seconds(), time.monotonic()
            committed = 0
            while time.monotonic() - started < FLOOD_SECONDS:
                assert probe.alive(), f"gpumemd died under the flood:\n{daemon.log()[-3000:]}"
                committed += 2 * MiB
                assert steady.commit("kv", committed)["ok"], "a session opened before the flood stopped working"
                assert steady.call(3)["ok"]  # STATUS through the session
                time.sleep(0.1)
            cpu = probe.cpu_seconds() - cpu_before
            wall = time.monotonic() - started
        finally:
            flooder.terminate()
            out, _ = flooder.communicate(timeout=10)
        opened, refused = (int(n) for n in out.split())
        # The backlog full again and again: more than the daemon takes.
        assert refused > 100, f"the flooder opened {opened} connections and found the backlog full only {refused} times"
        assert probe.alive(), f"gpumemd died under the flood:\n{daemon.log()[-3000:]}"
        assert cpu < CPU_SHARE_BOUND * wall, f"gpumemd used {cpu:.2f}s of CPU in {wall:.1f}s of flood ({opened} connections)"
        # Once the flood stops, a new client gets in through the library's connect().
        with gpumem.connect(0, name="after-flood", runtime_dir=runtime_dir, timeout=10.0) as late:
            late.ping()
        assert steady.call(2)["ok"]
        assert {c["name"] for c in status(runtime_dir)["clients"]} == {"steady"}
    log = daemon.log()
    assert f"open-file limit {NOFILE}" in log and "evicted for newer connections" in log, log[-2000:]


def test_accept_failing_for_want_of_descriptors_backs_off(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """The daemon's descriptors spent on other things (chunks' memfds, as many as the host
    backend makes, and sessions that hold only their fd channel) while fd-channel
    connections wait: accept fails with EMFILE. The daemon logs it, rests its listener
    instead of polling it, readable, in a tight loop (its CPU time over a second stays
    low), and accepts again once descriptors are free."""
    daemon = daemon_factory("host", nofile=NOFILE)
    probe = Probe(daemon.pid)
    held: list[socket.socket] = []
    with RawSession(runtime_dir, "filler") as filler:
        filler.create("kv", 1 << 30)
        committed = 0
        while True:
            committed += 2 * MiB
            if not filler.commit("kv", committed)["ok"]:  # the host backend keeps its spare descriptors
                break
        try:
            for i in range(NOFILE):
                if "accept on the fd channel failed" in daemon.log():
                    break
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.settimeout(0.5)
                held.append(sock)
                sock.connect(str(runtime_dir / "gpu0.fd"))
                sock.send(envelope(p.MsgType.HELLO, {"name": f"fd-only-{i}", "client_version": "raw"}, 1))
                try:
                    sock.recv(1 << 16)
                except TimeoutError:  # not accepted: the daemon is out of descriptors
                    continue
            assert "accept on the fd channel failed" in daemon.log(), f"accept never failed ({probe.fds()} descriptors)"
            assert "Too many open files" in daemon.log(), daemon.log()[-2000:]
            for _ in range(8):  # waiting in the backlog: the listener stays readable
                held.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
                held[-1].connect(str(runtime_dir / "gpu0.fd"))
            cpu_before, started = probe.cpu_seconds(), time.monotonic()
            time.sleep(1.0)
            cpu, wall = probe.cpu_seconds() - cpu_before, time.monotonic() - started
            assert probe.alive(), daemon.log()[-3000:]
            assert cpu < CPU_SHARE_BOUND * wall, f"gpumemd used {cpu:.2f}s of CPU in {wall:.1f}s with accept failing"
            released = filler.call(p.MsgType.ARENA_RELEASE, {"name": "kv"})
            assert released["ok"], released  # its chunks' descriptors go
        finally:
            for sock in held:
                sock.close()
        with gpumem.connect(0, name="after-emfile", runtime_dir=runtime_dir, timeout=10.0) as late:
            late.ping()
        assert filler.call(2)["ok"]
