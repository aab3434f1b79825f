"""What the daemon installs on its host, checked before it serves: one daemon per GPU
UUID whatever its runtime directory, and a runtime directory nobody else controls."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumem_shared import paths
from gpumem_shared.paths import Endpoints, UnsafeRuntimeDir, check_private_dir, resolve_runtime_dir
from gpumemd import runtime
from gpumemd.runtime import StartupError


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


@pytest.fixture
def device() -> str:
    """A UUID no other test, and no real GPU, uses."""
    return f"GPU-test-{uuid.uuid4()}"


@pytest.fixture(autouse=True)
def lock_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Root daemons' device locks go here, not under /run, for the test's life."""
    path = Path(tempfile.mkdtemp(prefix="gl", dir="/tmp"))
    path.chmod(0o755)  # another user's process must reach it, as it reaches /run's
    monkeypatch.setattr(runtime, "DEVICE_LOCK_DIR", path / "devices")
    yield path / "devices"
    shutil.rmtree(path)


@pytest.fixture
def short() -> Iterator[Path]:
    """A directory whose path fits the holder's name whole, as /run/gpumemd does."""
    path = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def test_a_second_daemon_for_the_same_uuid_in_another_directory_is_refused_naming_the_first(device: str, short: Path) -> None:
    tmp_path = short
    (tmp_path / "a").mkdir()
    first = runtime.take_lock(Endpoints(tmp_path / "a", 0), device)
    try:
        (tmp_path / "b").mkdir()
        with pytest.raises(StartupError) as refused:
            runtime.take_lock(Endpoints(tmp_path / "b", 0), device)
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and str(tmp_path / "a") in message and device in message, message
        assert "\n" not in message
        assert not (tmp_path / "b" / "gpu0.lock").exists(), "the refused daemon took its directory's lock all the same"
        # Another GPU is another matter.
        _close(runtime.take_lock(Endpoints(tmp_path / "b", 1), f"{device}-other"))
    finally:
        _close(first)
    # Given back, the device's lock is anyone's.
    _close(runtime.take_lock(Endpoints(tmp_path / "b", 0), device))


def test_the_device_lock_of_a_killed_daemon_is_free_at_once(device: str, short: Path) -> None:
    tmp_path = short
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from gpumemd import runtime; "
         "runtime.DEVICE_LOCK_DIR = Path(sys.argv[3]); "
         "runtime.take_device_lock(sys.argv[1], Path(sys.argv[2])); print('held', flush=True); sys.stdin.read()",
         device, str(tmp_path), str(runtime.DEVICE_LOCK_DIR)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            with pytest.raises(StartupError, match=f"pid {holder.pid}, runtime directory {tmp_path}\\)"):
                runtime.take_device_lock(device, tmp_path)
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=30)
    _close(runtime.take_device_lock(device, tmp_path))


def test_without_a_uuid_only_the_directory_is_locked(tmp_path: Path) -> None:
    """The host backend: each daemon's device is its own memory, so parallel test daemons
    on "device 0" in their own directories do not collide."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = runtime.take_lock(Endpoints(tmp_path / "a", 0), None)
    try:
        _close(runtime.take_lock(Endpoints(tmp_path / "b", 0), None))
        with pytest.raises(StartupError, match="already serves device 0"):
            runtime.take_lock(Endpoints(tmp_path / "a", 0), None)
    finally:
        _close(a)


# ---------------------------------------------------------------------------- the runtime directory


@pytest.fixture
def tmpdir_(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory the fallback lives under."""
    monkeypatch.setattr(paths.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


# A user without XDG_RUNTIME_DIR: the test's own uid, or this one where the test runs as
# root (whose default is the system directory); the test's files are then given to it.
ME = os.geteuid() or 1000


def _mine(path: Path) -> Path:
    if os.geteuid() == 0:
        os.lchown(path, ME, -1)
    return path


def test_a_missing_directory_is_made_private(tmp_path: Path) -> None:
    made = tmp_path / "run"
    check_private_dir(made, os.geteuid())
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o770])
def test_a_fallback_others_may_write_is_refused(tmpdir_: Path, mode: int) -> None:
    """What the daemon accepted before: a 1777 directory (root's, or the user's own)."""
    shared = tmpdir_ / f"gpumemd-{ME}"
    shared.mkdir()
    shared.chmod(mode)
    _mine(shared)
    with pytest.raises(UnsafeRuntimeDir, match=f"{shared} is writable by others"):
        resolve_runtime_dir(None, {}, euid=ME)


def test_a_fallback_someone_else_owns_is_refused(tmpdir_: Path) -> None:
    """What /tmp allows: another user made gpumemd-<uid> first, even 0700."""
    planted = tmpdir_ / f"gpumemd-{ME + 1}"
    planted.mkdir(mode=0o700)
    _mine(planted)
    with pytest.raises(UnsafeRuntimeDir, match=f"{planted} belongs to uid {ME}, not to uid {ME + 1}"):
        resolve_runtime_dir(None, {}, euid=ME + 1)


def test_a_fallback_that_is_a_symlink_is_refused(tmpdir_: Path) -> None:
    target = tmpdir_ / "elsewhere"
    target.mkdir(mode=0o700)
    _mine(target)
    link = tmpdir_ / f"gpumemd-{ME}"
    link.symlink_to(target)
    _mine(link)
    with pytest.raises(UnsafeRuntimeDir, match="not a directory"):
        resolve_runtime_dir(None, {}, euid=ME)


def test_a_private_fallback_is_used(tmpdir_: Path) -> None:
    own = tmpdir_ / f"gpumemd-{ME}"
    own.mkdir(mode=0o700)
    _mine(own)
    assert resolve_runtime_dir(None, {}, euid=ME) == own


def test_given_directories_are_the_operators_choice_and_made_absolute(tmpdir_: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmpdir_)
    assert resolve_runtime_dir("rel/run", {}, euid=ME) == tmpdir_ / "rel" / "run"
    assert resolve_runtime_dir(None, {paths.ENV_RUNTIME_DIR: "env-run"}, euid=ME) == tmpdir_ / "env-run"
    assert resolve_runtime_dir(None, {"XDG_RUNTIME_DIR": "/run/user/1000"}, euid=ME) == Path("/run/user/1000/gpumemd")
    assert not (tmpdir_ / "rel").exists() and not (tmpdir_ / "env-run").exists(), "only the fallback is made here"


_HOLD = (
    "import sys; from pathlib import Path; from gpumemd import runtime; runtime.DEVICE_LOCK_DIR = Path(sys.argv[3]); "
    "fds = runtime.take_device_lock(sys.argv[1], Path(sys.argv[2])) if sys.argv[4] == 'lock' else None; "
    "import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
    "s.bind(runtime._abstract(runtime._lock_name(sys.argv[1]))) if sys.argv[4] == 'squat' else None; "
    "print('held', flush=True); sys.stdin.read()"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="the system daemon's lock is root's")
def test_a_squatter_of_the_abstract_name_does_not_keep_the_system_daemon_out(device: str, short: Path, lock_dir: Path) -> None:
    # The squatter binds the name first and holds no root lock: any process can.
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD, device, str(short), str(lock_dir), "squat"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as squatter:
        try:
            assert squatter.stdout is not None and squatter.stdout.readline() == "held\n"
            first = runtime.take_device_lock(device, short)  # refused before the root lock
            try:
                with pytest.raises(StartupError, match=f"pid {os.getpid()}, runtime directory {short}"):
                    runtime.take_device_lock(device, short / "other")  # a second root daemon still is
            finally:
                _close(first)
        finally:
            squatter.kill()
            squatter.wait(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="the system daemon's lock is root's")
def test_another_users_daemon_stands_back_for_the_system_daemon(device: str, short: Path) -> None:
    first = runtime.take_device_lock(device, short)
    try:
        # What a daemon of another user runs: it reads the root lock (its own open of the
        # file, so the system daemon's flock is seen) and stands back.
        with pytest.raises(StartupError, match=f"the system's gpumemd \\(pid {os.getpid()}, runtime directory {short}\\)"):
            runtime._stand_back_for_root(device)
    finally:
        _close(first)
    runtime._stand_back_for_root(device)  # gone: nothing to stand back for
