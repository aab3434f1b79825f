"""The client library's typed exceptions against real daemons: no daemon at all, and a
daemon that stops (SIGTERM) under a client that keeps using its mapped memory."""

from __future__ import annotations

import json
import socket
import time

import pytest

import gpumem
from gpumem.errors import DaemonUnavailable
from gpumem_shared.paths import Endpoints
from gpumemd_testkit import GiB, MiB, do, ping, reply, status


def _connect_fails_fast(runtime_dir, expect_in_message: str) -> DaemonUnavailable:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable) as info:
        gpumem.connect(0, name="nobody-home", runtime_dir=runtime_dir, timeout=10.0)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0, f"connect took {elapsed:.2f}s to find there is no daemon"
    assert not isinstance(info.value, gpumem.DaemonTimeout), info.value
    assert expect_in_message in str(info.value), str(info.value)
    return info.value


def test_connect_without_daemon_raises_daemon_unavailable(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    fd_path = str(Endpoints(runtime_dir, 0).fd_path)
    err = _connect_fails_fast(runtime_dir, fd_path)
    assert isinstance(err, ConnectionError) and err.code is None
    assert "gpumemd --device 0" in str(err)  # says how to start one
    # A directory that does not even exist says the same.
    _connect_fails_fast(runtime_dir / "missing", str(Endpoints(runtime_dir / "missing", 0).fd_path))


def test_connect_to_dead_daemons_socket_raises_daemon_unavailable(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    # A socket file with nobody listening: what a kill -9'd daemon leaves behind.
    path = Endpoints(runtime_dir, 0).fd_path
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as left_behind:
        left_behind.bind(str(path))
    assert path.exists()
    _connect_fails_fast(runtime_dir, str(path))


def test_daemon_stop_reaches_client_and_mapping_survives(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    client = run_client("shell", "survivor")
    client.expect("CONNECTED")
    do(client, f"create kv {64 * GiB}")
    assert int(do(client, f"commit kv {8 * MiB}")) == 8 * MiB
    do(client, f"fill kv 0 {8 * MiB} 90")
    do(client, "write kv 4096 deadbeef")
    ping(runtime_dir)
    assert [c["name"] for c in status(runtime_dir)["clients"]] == ["survivor"]

    assert daemon.stop() == 0, daemon.log()
    for leftover in ("gpu0.zmq", "gpu0.fd", "gpu0.json"):
        assert not (runtime_dir / leftover).exists(), f"{leftover} left behind by a clean stop"

    notices = json.loads(do(client, "notices"))
    stopping = [n for n in notices if n["kind"] == "stopping"]
    assert len(stopping) == 1 and "stopping" in stopping[0]["message"], notices
    started = time.monotonic()
    err = reply(client, "ping", timeout=5.0)
    assert err.startswith("ERR DaemonStopped "), err
    assert "stays valid" in err, err
    assert time.monotonic() - started < 2.0  # known at once, not after the call's timeout
    assert reply(client, f"commit kv {16 * MiB}", timeout=5.0).startswith("ERR DaemonStopped "), "a new request after the stop"
    # The memory this process mapped outlives the daemon.
    assert do(client, "read kv 4096 4") == "deadbeef"
    assert do(client, "check kv 0 4096 90") == "MATCH"
    assert do(client, f"check kv {8 * MiB - 4096} 4096 90") == "MATCH"
    do(client, "write kv 0 0102")
    assert do(client, "read kv 0 2") == "0102"
    client.send("exit")
    client.finish(timeout=20)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_call_after_the_daemon_went_away_fails_at_once(how, daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Nothing read the fd channel since the daemon went: the call that finds out sends
    its request, sees the hang-up (or the stopping notice) while the request is out,
    and fails then, not after a slice of its wait or its timeout."""
    d = daemon_factory("host")
    s = gpumem.connect(0, name="orphan", runtime_dir=runtime_dir, timeout=10.0)
    try:
        s.ping()
        if how == "killed":
            d.proc.kill()
            d.proc.wait()
        else:
            assert d.stop() == 0, d.log()
        for _ in range(2):  # the call that finds out, and the next one
            started = time.monotonic()
            try:
                s.ping()
            except gpumem.DaemonStopped as exc:
                message = exc.message
            else:
                pytest.fail("ping answered by a daemon that is gone")
            elapsed = time.monotonic() - started
            assert elapsed < 0.2, f"{elapsed:.3f}s to notice: the fd channel was not looked at while the request was out"
            assert ("went away" if how == "killed" else "is stopping") in message and message.count("stays valid") == 1, message
    finally:
        s.close()
