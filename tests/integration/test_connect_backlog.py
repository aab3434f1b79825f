"""Connecting while a listen backlog is full: a socket that never accepts, and a daemon
stopped with SIGSTOP. connect() on AF_UNIX fails at once with EAGAIN then; the client
library tries again with backoff within its timeout, and ends with a DaemonTimeout that
says what to check (it used to raise a bare BlockingIOError at once). gpumemctl's
ZeroMQ connection is retried by libzmq, and it ends with its timeout and exit status 3."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import gpumem
from conftest import child_env
from gpumem_shared.paths import Endpoints

EXIT_NOT_RUNNING = 3


def fill_backlog(path: Path, kind: int) -> list[socket.socket]:
    """Connect until the listener's backlog refuses more; the caller closes them."""
    filled: list[socket.socket] = []
    while len(filled) < 10_000:
        sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_NONBLOCK)
        try:
            sock.connect(str(path))
        except BlockingIOError:
            sock.close()
            return filled
        except BaseException:
            sock.close()
            raise
        filled.append(sock)
    raise AssertionError(f"{path} took 10,000 connections: its backlog never filled")


def test_a_listener_that_never_accepts_ends_in_daemon_timeout(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    fd_path = Endpoints(runtime_dir, 0).fd_path
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(fd_path))
    listener.listen(1)
    filled = fill_backlog(fd_path, socket.SOCK_SEQPACKET)
    try:
        started = time.monotonic()
        with pytest.raises(gpumem.DaemonTimeout) as info:
            gpumem.connect(0, name="queued", runtime_dir=runtime_dir, timeout=1.0)
        elapsed = time.monotonic() - started
    finally:
        for sock in filled:
            sock.close()
        listener.close()
    assert 0.9 <= elapsed < 3.0, f"connect gave up after {elapsed:.2f}s, its timeout is 1s"
    message = str(info.value)
    assert str(fd_path) in message and "backlog" in message and "systemctl status gpumemd@0" in message, message


def test_a_stopped_daemon_is_waited_for_within_the_timeout(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host")
    ep = Endpoints(runtime_dir, 0)
    daemon.proc.send_signal(signal.SIGSTOP)
    fillers: list[socket.socket] = []
    try:
        fillers = fill_backlog(ep.fd_path, socket.SOCK_SEQPACKET) + fill_backlog(ep.zmq_path, socket.SOCK_STREAM)
        with pytest.raises(gpumem.DaemonTimeout, match="backlog"):
            gpumem.connect(0, name="early", runtime_dir=runtime_dir, timeout=0.5)
        started = time.monotonic()
        ctl = subprocess.run(
            [sys.executable, "-m", "gpumem.ctl", "status", "--timeout", "1", "--runtime-dir", str(runtime_dir)],
            capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
        )
        elapsed = time.monotonic() - started
        assert ctl.returncode == EXIT_NOT_RUNNING, ctl
        assert "did not answer Status within 1s" in ctl.stderr and "systemctl status gpumemd@0" in ctl.stderr, ctl.stderr
        assert "Traceback" not in ctl.stderr and elapsed < 10, (elapsed, ctl.stderr)
        # A client already waiting gets in once the daemon runs again.
        result: dict[str, object] = {}

        def connect() -> None:
            try:
                with gpumem.connect(0, name="patient", runtime_dir=runtime_dir, timeout=15.0) as session:
                    session.ping()
                    result["ok"] = True
            except Exception as exc:  # reported below, in the test's thread
                result["error"] = exc

        waiter = threading.Thread(target=connect, daemon=True)
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive(), f"connect did not wait for the stopped daemon: {result}"
        for sock in fillers:
            sock.close()
        fillers = []
        daemon.proc.send_signal(signal.SIGCONT)
        waiter.join(20)
        assert result == {"ok": True}, result
    finally:
        for sock in fillers:
            sock.close()
        daemon.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("how", ["reset", "eof"])
def test_a_daemon_that_drops_the_handshake_is_a_typed_error(runtime_dir: Path, how: str) -> None:
    """A daemon that dies during HELLO (or RESUME) closes the connection under the client:
    with the request unread (the client's read is reset) or after reading it (EOF). Either
    is DaemonUnavailable, which a resume tries again (the reset was a bare
    ConnectionResetError, which ended the resume and the call: bench/restart.py's clients
    died of it when the daemon was stopped under them)."""
    path = Endpoints(runtime_dir, 0).fd_path
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(8)

    def drop() -> None:
        conn, _ = listener.accept()
        if how == "eof":
            conn.recv(1 << 16)
        else:
            time.sleep(0.2)  # the HELLO is in, unread, when the connection goes
        conn.close()

    dropper = threading.Thread(target=drop, daemon=True)
    dropper.start()
    try:
        with pytest.raises(gpumem.DaemonUnavailable, match="closed the connection during HELLO"):
            gpumem.connect(0, "eng", runtime_dir=runtime_dir, timeout=5.0)
    finally:
        dropper.join(5)
        listener.close()
