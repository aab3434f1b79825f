"""``gpumemctl status`` against real daemons: JSON shape and contents, the human view,
no daemon (exit 3, fast), --device picking another daemon, $GPUMEMD_RUNTIME_DIR
honoured by gpumemd, gpumemctl and the client library alike, and a user who may not
open the sockets told which group to join (exit 1, at once)."""

from __future__ import annotations

import grp
import json
import os
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpumem
from conftest import child_env
from gpumem_shared.paths import Endpoints, read_info
from gpumemd_testkit import GiB, MiB, do, ping, status

EXIT_NOT_RUNNING = 3


def ctl(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def ctl_json(runtime_dir: Path, *args: str) -> dict:  # type: ignore[type-arg]
    result = ctl("status", "--json", "--runtime-dir", str(runtime_dir), *args, env=child_env(runtime_dir))
    assert result.returncode == 0, result
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_status_json_and_human_with_client_and_arena(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    client = run_client("shell", "engine-json")
    client.expect("CONNECTED")
    address = int(do(client, f"create kv-ctl {8 * GiB}"))
    do(client, f"commit kv-ctl {6 * MiB}")
    do(client, "share kv-ctl engine-peer")

    s = ctl_json(runtime_dir)
    # extents: the graph pools' deprecated name, kept until the next protocol major
    assert list(s) == ["daemon", "device", "clients", "arenas", "extents", "leases", "rounds", "kv", "graph_pools", "sleepers", "retained", "tenants"]
    info = read_info(Endpoints(runtime_dir, 0).info_path)
    assert info is not None
    assert s["daemon"]["pid"] == daemon.pid and s["daemon"]["backend"] == daemon.backend
    assert s["daemon"]["state"] == "serving" and s["daemon"]["runtime_dir"] == str(runtime_dir)
    assert s["device"]["index"] == 0 and s["device"]["uuid"] == info["uuid"]
    assert s["device"]["accounted_bytes"] == 6 * MiB
    assert s["device"]["free_bytes"] <= s["device"]["total_bytes"]
    (c,) = s["clients"]
    assert c["name"] == "engine-json" and c["pid"] == client.pid and c["arenas"] == ["kv-ctl"]
    (a,) = s["arenas"]
    assert a["name"] == "kv-ctl" and a["owner"] == "engine-json" and a["owner_pid"] == client.pid
    assert a["address"] == address and a["reserved"] == 8 * GiB and a["committed"] == 6 * MiB
    assert a["chunks"] == 2 and a["shared_with"] == ["engine-peer"] and a["attached"] == ["engine-json"]
    assert s["graph_pools"] == s["extents"] == [] and s["leases"] == []

    human = ctl("status", "--runtime-dir", str(runtime_dir), env=child_env(runtime_dir))
    assert human.returncode == 0, human
    out = human.stdout
    for needle in ("CLIENTS", "ARENAS", "engine-json", "kv-ctl", "engine-peer", str(client.pid), f"{address:#x}", info["uuid"]):
        assert needle in out, f"{needle!r} missing from:\n{out}"
    assert human.stderr == ""

    # Once the client is gone, so is what ctl shows.
    client.send("exit")
    client.finish()
    deadline = time.monotonic() + 2.0
    while ctl_json(runtime_dir)["clients"] and time.monotonic() < deadline:
        time.sleep(0.02)
    s = ctl_json(runtime_dir)
    assert s["clients"] == [] and s["arenas"] == [] and s["device"]["accounted_bytes"] == 0
    assert "(none)" in ctl("status", "--runtime-dir", str(runtime_dir)).stdout


def _assert_not_running(result: subprocess.CompletedProcess[str], elapsed: float, runtime_dir: Path) -> None:
    assert result.returncode == EXIT_NOT_RUNNING, result
    assert elapsed < 5.0, f"gpumemctl took {elapsed:.1f}s to say no daemon runs"
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpumemctl: "), result.stderr
    assert "Traceback" not in result.stderr


def test_status_without_daemon_exits_3_fast(runtime_dir) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    result = ctl("status", "--runtime-dir", str(runtime_dir), env=child_env(runtime_dir))
    _assert_not_running(result, time.monotonic() - started, runtime_dir)
    assert "no gpumemd serves device 0" in result.stderr and str(runtime_dir) in result.stderr
    started = time.monotonic()
    result = ctl("status", "--json", "--device", "3", "--runtime-dir", str(runtime_dir), env=child_env(runtime_dir))
    _assert_not_running(result, time.monotonic() - started, runtime_dir)
    assert "device 3" in result.stderr


def test_status_of_a_killed_daemon_exits_3_at_once(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("host")
    ping(runtime_dir)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    assert Endpoints(runtime_dir, 0).zmq_path.exists()  # the stale socket is still there
    started = time.monotonic()
    result = ctl("status", "--timeout", "30", "--runtime-dir", str(runtime_dir), env=child_env(runtime_dir))
    elapsed = time.monotonic() - started
    _assert_not_running(result, elapsed, runtime_dir)
    assert "no live daemon" in result.stderr  # the lock tells a stale socket from a busy daemon
    assert elapsed < 10, f"gpumemctl waited {elapsed:.1f}s on a dead daemon's stale socket"


def test_device_option_addresses_another_daemon(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    d0 = daemon_factory("host", device=0)
    d1 = daemon_factory("host", device=1, args=["--host-capacity", "2GiB"])
    seen = {}
    for index, daemon, capacity in ((0, d0, 4 * GiB), (1, d1, 2 * GiB)):
        info = read_info(Endpoints(runtime_dir, index).info_path)
        assert info is not None
        for args in (("--device", str(index)), ("-d", str(index))):
            s = ctl_json(runtime_dir, *args)
            assert s["device"]["index"] == index and s["device"]["uuid"] == info["uuid"], s["device"]
            assert s["daemon"]["pid"] == daemon.pid and s["device"]["total_bytes"] == capacity
        seen[index] = info["uuid"]
        # The group-level option works too: gpumemctl -d N status
        result = ctl("-d", str(index), "--runtime-dir", str(runtime_dir), "status", "--json", env=child_env(runtime_dir))
        assert result.returncode == 0, result
        assert json.loads(result.stdout)["daemon"]["pid"] == daemon.pid
    assert seen[0] != seen[1]
    assert ctl_json(runtime_dir)["device"]["index"] == 0  # the default is device 0


def test_runtime_dir_env_is_honoured_everywhere(run_client, runtime_dir, tmp_path_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    env = child_env(runtime_dir)  # GPUMEMD_RUNTIME_DIR, no --runtime-dir anywhere below
    log = open(runtime_dir / "envd.log", "wb")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpumemd", "--backend", "host", "--host-capacity", "1GiB"], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    try:
        deadline = time.monotonic() + 20.0
        while read_info(runtime_dir / "gpu0.json") is None:
            assert daemon.poll() is None, (runtime_dir / "envd.log").read_text()
            assert time.monotonic() < deadline, "gpumemd did not start in $GPUMEMD_RUNTIME_DIR"
            time.sleep(0.02)
        ping(runtime_dir)

        client = run_client("shell", "env-client")  # child_env: the variable only
        client.expect("CONNECTED")

        monkeypatch.setenv("GPUMEMD_RUNTIME_DIR", str(runtime_dir))
        with gpumem.connect(0, name="env-in-process", timeout=5.0) as session:
            assert session.daemon_pid == daemon.pid
            result = ctl("status", "--json", env=env)
            assert result.returncode == 0, result
            s = json.loads(result.stdout)
            assert s["daemon"]["pid"] == daemon.pid and s["daemon"]["runtime_dir"] == str(runtime_dir)
            assert sorted(c["name"] for c in s["clients"]) == ["env-client", "env-in-process"]

        # Pointed elsewhere, every one of them looks elsewhere.
        elsewhere = tmp_path_factory.mktemp("elsewhere")
        monkeypatch.setenv("GPUMEMD_RUNTIME_DIR", str(elsewhere))
        with pytest.raises(gpumem.DaemonUnavailable, match=str(elsewhere)):
            gpumem.connect(0, name="lost", timeout=5.0)
        result = ctl("status", env=child_env(elsewhere))
        assert result.returncode == EXIT_NOT_RUNNING and str(elsewhere) in result.stderr, result
        client.send("exit")
        client.finish()
        assert status(runtime_dir)["daemon"]["pid"] == daemon.pid
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            assert daemon.wait(10) == 0
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            log.close()
    assert not (runtime_dir / "gpu0.zmq").exists()


OTHER_UID = 65534  # nobody
ROOT = Path(__file__).resolve().parents[2]


def _other_user_group() -> str:
    """A group the other user is not in, for the daemon's sockets."""
    for group in grp.getgrall():
        if group.gr_gid not in (0, OTHER_UID) and "nobody" not in group.gr_mem:
            return group.gr_name
    return grp.getgrgid(0).gr_name


def _other_user_python(runtime_dir: Path) -> tuple[str, dict[str, str]]:
    """An interpreter the other user may run, with this checkout importable: this one, or
    the system's of the same version where this one is private to root (a pyenv under
    /root). Skips the test when there is none."""
    env = child_env(runtime_dir)
    env["HOME"] = "/"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / d) for d in ("client", "shared", "daemon")] + site.getsitepackages())
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for python in (sys.executable, f"/usr/bin/python{version}"):
        try:
            probe = subprocess.run(
                [python, "-c", "import gpumem.ctl"], capture_output=True, timeout=60, env=env, user=OTHER_UID, group=OTHER_UID, extra_groups=[]
            )
        except (PermissionError, FileNotFoundError):
            continue
        if probe.returncode == 0:
            return python, env
    pytest.skip(f"no Python {version} that uid {OTHER_UID} may run can import this checkout")


def _as_other_user(python: tuple[str, dict[str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python[0], *args], capture_output=True, text=True, timeout=60, env=python[1], user=OTHER_UID, group=OTHER_UID, extra_groups=[]
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="starts gpumemctl as another user: needs root")
def test_without_access_to_the_sockets_ctl_and_library_say_which_group_to_join(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    python = _other_user_python(runtime_dir)
    group = _other_user_group()
    daemon_factory("host", args=["--socket-group", group])
    runtime_dir.chmod(0o755)  # the directory is open, the sockets (0660, root:group) are not
    ep = Endpoints(runtime_dir, 0)

    started = time.monotonic()
    result = _as_other_user(python, "-m", "gpumem.ctl", "status", "--timeout", "30", "--runtime-dir", str(runtime_dir))
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result
    assert result.stderr.startswith(f"gpumemctl: permission denied: join group {group} to use gpumemd's socket {ep.zmq_path}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr and result.stdout == ""
    assert elapsed < 10, f"gpumemctl took {elapsed:.1f}s to say it may not connect (its timeout is 30s)"

    library = _as_other_user(
        python,
        "-c",
        "import sys, gpumem\n"
        "try:\n"
        f"    gpumem.connect(0, name='outsider', runtime_dir={str(runtime_dir)!r}, timeout=30.0)\n"
        "except gpumem.SocketPermissionDenied as exc:\n"
        "    assert isinstance(exc, gpumem.DaemonUnavailable) and isinstance(exc, PermissionError)\n"
        "    print(exc)\n"
        "    sys.exit(0)\n"
        "sys.exit('connected')\n",
    )
    assert library.returncode == 0, library
    assert library.stdout.startswith(f"permission denied: join group {group} to use gpumemd's socket {ep.fd_path}"), library.stdout

    # A runtime directory closed to the user: named, and no traceback from looking into it.
    runtime_dir.chmod(0o700)
    result = _as_other_user(python, "-m", "gpumem.ctl", "status", "--runtime-dir", str(runtime_dir))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result
    assert f"permission denied: gpumemd's socket {ep.zmq_path} is closed to this user: the directory {runtime_dir} is closed" in result.stderr, result.stderr
    ping(runtime_dir)  # the daemon never noticed


@pytest.mark.skipif(os.geteuid() != 0, reason="starts gpumemctl as another user: needs root")
def test_a_root_daemon_without_a_socket_group_is_answered_with_socket_group_not_joining_root(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Joining root (the daemon's own group) would hand the user far more than the socket:
    the advice is a group for the sockets, and joining that."""
    python = _other_user_python(runtime_dir)
    daemon_factory("host")  # no --socket-group: the sockets are root:root 0660
    runtime_dir.chmod(0o755)
    result = _as_other_user(python, "-m", "gpumem.ctl", "status", "--runtime-dir", str(runtime_dir))
    assert result.returncode == 1, result
    assert "usermod -aG root" not in result.stderr, result.stderr
    assert "start gpumemd with --socket-group gpumem" in result.stderr and "'usermod -aG gpumem nobody'" in result.stderr, result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="starts gpumemctl as another user: needs root")
def test_status_all_shows_the_daemons_it_may_reach_and_names_the_others(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    python = _other_user_python(runtime_dir)
    daemon_factory("host", device=0, args=["--socket-group", str(OTHER_UID)])  # the other user's own group
    daemon_factory("host", device=1, args=["--socket-group", _other_user_group()])
    runtime_dir.chmod(0o755)
    result = _as_other_user(python, "-m", "gpumem.ctl", "status", "--all", "--runtime-dir", str(runtime_dir))
    assert result.returncode == 1, result
    assert "=== device 0 " in result.stdout and "=== device 1 " not in result.stdout, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpumemctl: device 1 ({runtime_dir}): permission denied"), result.stderr


def test_graph_pools_have_one_name_and_the_old_command_still_answers(daemon, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """The section and the command say "graph pools" as the JSON and the docs do;
    `gpumemctl extents`, the old name, still works for scripts and --help says what it is."""
    env = child_env(runtime_dir)
    shown = ctl("status", "--runtime-dir", str(runtime_dir), env=env).stdout
    assert "\nGRAPH POOLS\n" in shown and "\nEXTENTS\n" not in shown, shown
    new = ctl("graph-pools", "--runtime-dir", str(runtime_dir), env=env)
    old = ctl("extents", "--runtime-dir", str(runtime_dir), env=env)
    assert new.returncode == old.returncode == 0 and new.stdout == old.stdout and new.stdout.startswith("GRAPH POOLS\n"), (new, old)
    listed = " ".join(ctl("--help").stdout.split())
    assert "graph-pools Graph pools:" in listed and "extents The old name of graph-pools, kept so scripts keep working." in listed, listed
