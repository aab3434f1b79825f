"""The daemon process itself: one per device, stale sockets of a dead one cleaned up,
socket modes, a clear refusal without a driver, and sd_notify readiness, watchdog
and stopping messages."""

from __future__ import annotations

import grp
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import child_env, cuda_available
from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints, read_info
from gpumemd_testkit import RawSession, ping, status

EX_CONFIG = 78


def _gpumemd(runtime_dir: Path, *args: str, timeout: float = 30.0, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpumemd", "--runtime-dir", str(runtime_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(runtime_dir, **env),
    )


def _wait_serving(daemon, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Until the identity file names this very process and it answers a ping."""
    deadline = time.monotonic() + timeout
    while True:
        assert daemon.proc.poll() is None, f"gpumemd exited with {daemon.proc.returncode}:\n{daemon.log()}"
        info = read_info(daemon.info_path)
        if info is not None and info.get("pid") == daemon.pid:
            ping(daemon.runtime_dir, daemon.device)
            return
        assert time.monotonic() < deadline, f"gpumemd did not serve within {timeout}s:\n{daemon.log()}"
        time.sleep(0.02)


# ---------------------------------------------------------------------------- one per device


def test_second_daemon_for_same_device_refuses_to_start(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    first = daemon_factory("host")
    ping(runtime_dir)
    ep = Endpoints(runtime_dir, 0)
    inodes = {path: path.stat().st_ino for path in (ep.zmq_path, ep.fd_path, ep.info_path)}
    with RawSession(runtime_dir, "before-the-second") as session:
        started = time.monotonic()
        second = _gpumemd(runtime_dir, "--device", "0", "--backend", "host")
        assert time.monotonic() - started < 10.0
        assert second.returncode == EX_CONFIG, second
        assert second.stdout == ""
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, f"expected one line, got:\n{second.stderr}"
        assert f"pid {first.pid}" in lines[0] and "device 0" in lines[0], lines[0]
        # The first daemon keeps serving, on the very same sockets, its session untouched.
        assert first.proc.poll() is None
        assert {path: path.stat().st_ino for path in inodes} == inodes
        assert read_info(ep.info_path)["pid"] == first.pid  # type: ignore[index]
        assert session.call(p.MsgType.PING)["ok"]
        assert [c["name"] for c in status(runtime_dir)["clients"]] == ["before-the-second"]
        with RawSession(runtime_dir, "after-the-second") as newcomer:
            assert newcomer.hello["daemon_pid"] == first.pid
    # Another device in the same directory is a different matter.
    other = daemon_factory("host", device=1)
    assert status(runtime_dir, device=1)["daemon"]["pid"] == other.pid
    assert status(runtime_dir, device=0)["daemon"]["pid"] == first.pid


def test_one_daemon_per_gpu_whatever_its_runtime_directory(backend, daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """On CUDA the device is shared, so a second daemon for it elsewhere is refused by its
    UUID; on the host backend each daemon's device is its own memory, so daemons in their
    own directories (parallel tests) all serve."""
    first = daemon_factory(backend)
    elsewhere = Path(tempfile.mkdtemp(prefix="gpumemd-t-", dir="/tmp"))
    try:
        with subprocess.Popen(
            [sys.executable, "-m", "gpumemd", "--device", "0", "--backend", backend, "--runtime-dir", str(elsewhere)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(elsewhere),
        ) as second:
            if backend == "cuda":
                out, err = second.communicate(timeout=60)
                assert second.returncode == EX_CONFIG and out == "", (second.returncode, err)
                lines = err.strip().splitlines()
                assert len(lines) == 1 and f"pid {first.pid}, runtime directory {runtime_dir})" in lines[0], err
                assert status(runtime_dir)["daemon"]["pid"] == first.pid
                assert list(elsewhere.glob("gpu0.*")) in ([], [elsewhere / "gpu0.lock"]), list(elsewhere.iterdir())
                return
            try:
                deadline = time.monotonic() + 20
                while read_info(Endpoints(elsewhere, 0).info_path) is None:
                    assert second.poll() is None and time.monotonic() < deadline, second.stderr.read() if second.stderr else ""
                    time.sleep(0.02)
                assert status(elsewhere)["daemon"]["pid"] == second.pid and status(runtime_dir)["daemon"]["pid"] == first.pid
            finally:
                second.terminate()
                second.communicate(timeout=30)
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_a_relative_runtime_directory_is_made_absolute(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Clients started elsewhere must find the same sockets: the daemon says, and works
    in, the absolute directory."""
    where = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))
    try:
        with subprocess.Popen(
            [sys.executable, "-m", "gpumemd", "--backend", "host", "--runtime-dir", "run"],
            cwd=where, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(where / "run"),
        ) as daemon:
            try:
                deadline = time.monotonic() + 20
                while read_info(Endpoints(where / "run", 0).info_path) is None:
                    assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr.read() if daemon.stderr else ""
                    time.sleep(0.02)
                assert status(where / "run")["daemon"]["runtime_dir"] == str(where / "run")
            finally:
                daemon.terminate()
                daemon.communicate(timeout=30)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_the_cuda_backend_without_cuda_bindings_names_the_extra(runtime_dir: Path) -> None:
    # The import fails as it does where the cuda extra is not installed.
    without = "import sys; sys.modules['cuda'] = None; from gpumemd.cli import main; sys.argv[0] = 'gpumemd'; main()"
    result = subprocess.run(
        [sys.executable, "-c", without, "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=60, env=child_env(runtime_dir),
    )
    assert result.returncode == EX_CONFIG, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'gpumemd[cuda]'" in lines[0] and "--backend host" in lines[0], result.stderr
    assert list(runtime_dir.glob("gpu0.*")) == []


def test_stale_sockets_of_a_killed_daemon_are_replaced(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    ep = Endpoints(runtime_dir, 0)
    dead = daemon_factory("host")
    ping(runtime_dir)
    dead.proc.send_signal(signal.SIGKILL)
    dead.proc.wait(10)
    assert ep.zmq_path.exists() and ep.fd_path.exists()
    assert ep.info_path.exists() and read_info(ep.info_path)["pid"] == dead.pid  # type: ignore[index]
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        with pytest.raises(ConnectionRefusedError):
            probe.connect(str(ep.fd_path))  # nobody behind the stale file

    fresh = daemon_factory("host", wait=False)
    _wait_serving(fresh)
    # (inode numbers are recycled at once, so the proof is that both sockets answer)
    assert fresh.log().count("removing stale socket") == 2, fresh.log()
    with RawSession(runtime_dir, "after-restart") as session:
        assert session.hello["daemon_pid"] == fresh.pid
    assert status(runtime_dir)["daemon"]["pid"] == fresh.pid
    assert fresh.stop() == 0


def test_socket_files_are_0660_and_owned_by_the_socket_group(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    old_umask = os.umask(0)  # the daemon must not depend on a friendly umask
    try:
        group = grp.getgrgid(os.getgid()).gr_name
        daemon_factory("host", args=["--socket-group", group])
    finally:
        os.umask(old_umask)
    ep = Endpoints(runtime_dir, 0)
    for path in (ep.zmq_path, ep.fd_path):
        st = path.lstat()
        assert stat.S_ISSOCK(st.st_mode), path
        assert stat.S_IMODE(st.st_mode) == 0o660, f"{path}: {oct(stat.S_IMODE(st.st_mode))}"
        assert st.st_gid == os.getgid()
    assert stat.S_IMODE(ep.info_path.stat().st_mode) == 0o644  # identity is world-readable
    ping(runtime_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving sockets to another group takes root")
def test_a_socket_group_given_by_number_needs_no_name(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A container image may not list the group engine pods share: its number is enough."""
    gid = next(g for g in range(4242, 5000) if g not in {x.gr_gid for x in grp.getgrall()})
    daemon_factory("host", args=["--socket-group", str(gid)])
    ep = Endpoints(runtime_dir, 0)
    assert ep.zmq_path.lstat().st_gid == ep.fd_path.lstat().st_gid == gid
    ping(runtime_dir)


def test_unknown_socket_group_is_one_line_and_exit_78(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    result = _gpumemd(runtime_dir, "--backend", "host", "--socket-group", "no-such-group-gpumemd-test")
    assert result.returncode == EX_CONFIG, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-group-gpumemd-test" in lines[0], result.stderr
    assert not Endpoints(runtime_dir, 0).zmq_path.exists()


# ---------------------------------------------------------------------------- no driver


@pytest.mark.skipif(cuda_available(), reason="a CUDA driver is present: the CUDA backend would start")
def test_without_driver_and_backend_one_line_pointing_at_host_backend(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = _gpumemd(runtime_dir)
    assert time.monotonic() - started < 20.0
    assert result.returncode == EX_CONFIG, result
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{result.stderr}"
    assert "--backend host" in lines[0] and lines[0].startswith("gpumemd: "), lines[0]
    assert "Traceback" not in result.stderr
    assert list(runtime_dir.glob("gpu0.*")) == []  # refused before binding anything


# ---------------------------------------------------------------------------- sd_notify


class NotifyListener:
    """The systemd end of sd_notify: a DGRAM socket collecting (arrival time, fields)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.messages: list[tuple[float, list[str]]] = []

    def until(self, field: str, timeout: float) -> float:
        """Collect until a message carrying ``field`` arrives; returns its arrival time."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {field} within {timeout}s; got {self.messages}"
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            now = time.monotonic()
            self.messages.append((now, data.decode().split("\n")))
            if field in self.messages[-1][1]:
                return now

    def times(self, field: str) -> list[float]:
        return [t for t, fields in self.messages if field in fields]

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_sd_notify_ready_watchdog_stopping(kind, daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    address = str(runtime_dir / "notify.sock") if kind == "path" else f"@gpumemd-test-{os.getpid()}-{runtime_dir.name}"
    listener = NotifyListener(address)
    try:
        watchdog_usec = 200_000
        daemon = daemon_factory("host", wait=False, NOTIFY_SOCKET=address, WATCHDOG_USEC=str(watchdog_usec))
        ready_at = listener.until("READY=1", 20.0)
        # READY means serving: the sockets are there and answer at once.
        ping(runtime_dir, timeout=2.0)
        first = listener.messages[0][1]
        assert first[0] == "READY=1" and any(f.startswith("STATUS=") for f in first), listener.messages
        # Watch the watchdog for a while.
        while time.monotonic() < ready_at + 1.5:
            listener.until("WATCHDOG=1", 2.0)
        pings = listener.times("WATCHDOG=1")
        assert len(pings) >= 7, listener.messages
        gaps = [b - a for a, b in zip([ready_at, *pings], pings)]
        # systemd kills a service whose pings are WATCHDOG_USEC apart; sd_watchdog_enabled(3)
        # says to ping at half of it.
        assert max(gaps) < watchdog_usec / 1e6 * 0.9, f"watchdog gaps {[round(g, 3) for g in gaps]}"
        daemon.proc.send_signal(signal.SIGTERM)
        listener.until("STOPPING=1", 10.0)
        assert daemon.proc.wait(10) == 0, daemon.log()
        assert len(listener.times("READY=1")) == 1, listener.messages
        stopping = listener.times("STOPPING=1")
        assert len(stopping) == 1 and stopping[0] > pings[-1]
    finally:
        listener.close()


def test_watchdog_for_another_pid_is_not_ours(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    address = str(runtime_dir / "notify.sock")
    listener = NotifyListener(address)
    try:
        daemon = daemon_factory(
            "host", wait=False, NOTIFY_SOCKET=address, WATCHDOG_USEC="100000", WATCHDOG_PID=str(os.getpid())
        )
        listener.until("READY=1", 20.0)
        ping(runtime_dir)
        time.sleep(0.5)
        daemon.proc.send_signal(signal.SIGTERM)
        listener.until("STOPPING=1", 10.0)
        assert daemon.proc.wait(10) == 0
        assert listener.times("WATCHDOG=1") == [], listener.messages
    finally:
        listener.close()


# ---------------------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--bogus"], "--bogus"),
        (["--chunk-size", "3MiB"], "nearest valid: 2MiB or 4MiB"),
        (["--kv-chunk-size", "3000kB"], "nearest valid: 2097.152kB or 4194.304kB"),
        (["--chunk-size", "8XB"], "is not a size"),
        (["--chunk-size", "512M"], "nearest valid: 511.705088M or 513.80224M; did you mean 512MiB?"),
        (["--host-capacity", "8G"], "did you mean 8GiB?"),
        (["--host-capacity", "1.5b"], "whole number of bytes"),
        (["--host-capacity", "0"], "--host-capacity 0"),
        (["--host-capacity", "1GiB", "--reserve", "1GiB"], "leaves nothing to serve"),
        (["--capacity", "64MiB", "--reserve", "64MiB"], "--capacity 64 MiB leaves nothing to serve"),
        (["--round-timeout", "-1"], "positive number of seconds"),
        (["--round-policy", "sometimes"], "--round-policy"),
        (["--device", "99"], "devices 0-15"),
    ],
)
def test_configuration_errors_are_one_line_and_exit_78(runtime_dir, args, says) -> None:  # type: ignore[no-untyped-def]
    result = _gpumemd(runtime_dir, "--backend", "host", *args)
    assert result.returncode == EX_CONFIG, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpumemd: ") and says in lines[0], result.stderr
    assert not Endpoints(runtime_dir, 0).zmq_path.exists()


def test_a_runtime_directory_it_cannot_use_is_one_line_and_exit_78(tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for unusable in (blocker / "gpumemd", Path("/proc")):  # a file on the path; a directory nobody may write
        result = _gpumemd(unusable, "--backend", "host")
        assert result.returncode == EX_CONFIG, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(unusable) in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_sizes_take_iec_and_si_units(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host", args=["--host-capacity", "1Gi", "--chunk-size", "64Mi", "--reserve", "4194304", "--kv-chunk-size", "0.125GiB"])
    assert status(runtime_dir)["device"]["total_bytes"] == 1 << 30
    assert status(runtime_dir)["device"]["reserve_bytes"] == 4 << 20


def test_log_lines_carry_timestamps_and_refusals_carry_figures(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("host", args=["--host-capacity", "64MiB"])
    with RawSession(runtime_dir, "greedy") as s:
        s.create("big", 256 << 20)
        refusal = s.commit("big", 128 << 20)
        assert refusal["ok"] is False and refusal["code"] == p.ErrorCode.OUT_OF_MEMORY, refusal
    lines = daemon.log().splitlines()
    assert lines and all(re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ gpumemd", line) for line in lines), lines[:3]
    refused = [line for line in lines if "refused" in line]
    assert len(refused) == 1 and "arena 'big'" in refused[0] and str(128 << 20) in refused[0] and str(64 << 20) in refused[0], refused
