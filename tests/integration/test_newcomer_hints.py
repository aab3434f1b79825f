"""What a newcomer is told, fitted to the machine: a runtime directory others may write
is refused with the fix, a clean stop leaves no lock file, a second daemon started by
hand names the pid to stop (not a unit that runs nothing), an unknown flag points to
--help, and with no daemon gpumemctl suggests what starts one here (the host backend
where there is no NVIDIA GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env
from gpumem.discovery import NVIDIA_DRIVER
from gpumem_shared.paths import Endpoints
from gpumemd import runtime

EXIT_CONFIG, EXIT_NOT_RUNNING = 78, 3


def _gpumemd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumemd", *args], capture_output=True, text=True, timeout=60, env=env)


def test_a_runtime_directory_others_may_write_is_refused_with_the_fix(runtime_dir: Path) -> None:
    shared = runtime_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # as /tmp
    result = _gpumemd("--backend", "host", "--host-capacity", "1GiB", "--runtime-dir", str(shared), env=child_env(runtime_dir))
    assert result.returncode == EXIT_CONFIG, result
    assert f"runtime directory {shared} may be written by others (mode 1777)" in result.stderr, result.stderr
    assert f"--runtime-dir {shared}/gpumemd" in result.stderr, "the fix is named"
    assert list(shared.iterdir()) == [], "nothing was made there"


def test_a_clean_stop_removes_the_lock_file(daemon_factory, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("host")
    lock = Endpoints(runtime_dir, 0).lock_path
    assert lock.exists()
    assert d.stop() == 0, d.log()
    assert not lock.exists(), "gpu0.lock outlived a clean stop"
    assert daemon_factory("host").wait_ready(), "the next daemon takes a new lock"


def test_a_second_daemon_by_hand_is_told_the_pid_to_stop(daemon_factory, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    first = daemon_factory("host")
    second = daemon_factory("host", wait=False)
    assert second.proc.wait(60) == EXIT_CONFIG, second.log()
    assert f"stop pid {first.pid} first (kill {first.pid}): no systemd unit runs it" in second.log(), second.log()
    assert "systemctl" not in second.log(), second.log()


def test_an_unknown_flag_points_to_help(runtime_dir: Path) -> None:
    result = _gpumemd("--frobnicate", env=child_env(runtime_dir))
    assert result.returncode == EXIT_CONFIG, result
    assert result.stderr == "gpumemd: No such option '--frobnicate'; gpumemd --help lists the flags\n", result.stderr
    ctl = subprocess.run([str(Path(sys.executable).parent / "gpumemctl"), "status", "--frobnicate"], capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 2 and "gpumemctl status --help" in ctl.stderr, ctl  # click's own pointer


def test_with_no_daemon_gpumemctl_says_what_starts_one_on_this_machine(runtime_dir: Path) -> None:
    for args in (["status"], ["status", "--all"], ["-d", "3", "status"]):
        result = subprocess.run([sys.executable, "-m", "gpumem.ctl", *args, "--runtime-dir", str(runtime_dir)],
                                capture_output=True, text=True, timeout=60, env=child_env(runtime_dir))
        assert result.returncode == EXIT_NOT_RUNNING, result
        if NVIDIA_DRIVER.exists():
            assert "--backend host" not in result.stderr and "gpumemd@" in result.stderr or "gpumemd --device" in result.stderr, result
        else:
            assert "no NVIDIA GPU here, so start one on host memory: gpumemd --device " in result.stderr, result.stderr
            assert "--backend host --host-capacity 8GiB" in result.stderr and "systemctl" not in result.stderr, result.stderr


def test_the_suites_summary_counts_skips_by_reason(tmp_path: Path) -> None:
    """"153 skipped" said nothing of why: the summary names each reason with its count."""
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('n', range(3))\n"
        "def test_gpu(n):\n    pytest.skip('needs an NVIDIA GPU')\n"
        "@pytest.mark.skipif(True, reason='systemd-analyze is not installed')\n"
        "def test_unit():\n    pass\n"
        "def test_runs():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result
    summary = result.stdout.split("4 skipped, by reason", 1)[1].splitlines()
    assert [line.strip() for line in summary[1:3]] == ["3  needs an NVIDIA GPU", "1  systemd-analyze is not installed"], result.stdout


def test_a_lock_taken_on_a_file_a_stopping_daemon_removed_is_taken_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopping daemon removes its lock file: a starting one that opened that file just
    before, and locks it once released, must not serve beside a third on a new file."""
    endpoints = Endpoints(tmp_path, 0)
    real_flock = runtime.fcntl.flock
    removed: list[Path] = []

    def flock_after_the_stop(fd: int, operation: int) -> None:
        if not removed:  # between this open and this lock, the old holder removed the file
            endpoints.lock_path.unlink()
            removed.append(endpoints.lock_path)
        real_flock(fd, operation)

    monkeypatch.setattr(runtime.fcntl, "flock", flock_after_the_stop)
    (fd,) = runtime.take_lock(endpoints, None)
    try:
        assert removed and os.fstat(fd).st_ino == os.stat(endpoints.lock_path).st_ino, "locked a file no one else can find"
    finally:
        os.close(fd)


def test_the_test_script_installs_no_system_package_and_names_what_is_missing(tmp_path: Path) -> None:
    """Run as root without systemd-analyze, scripts/test.sh ran apt-get install systemd."""
    stamp = ROOT / ".venv" / ".gpumemd-installed"
    if not stamp.exists() or stamp.stat().st_mtime < (ROOT / "pyproject.toml").stat().st_mtime:
        # The script would reinstall first, with this test's bare PATH (no compiler): it
        # would remove the checkout's native module and fail to build it again.
        pytest.skip("./.venv's install is older than pyproject.toml: run scripts/test.sh once to bring it up to date")
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "dirname", "basename", "id", "touch", "rm"):
        found = shutil.which(tool)
        assert found is not None, tool
        (tools / tool).symlink_to(found)
    called = tmp_path / "called"
    for installer in ("apt-get", "dnf", "yum", "sudo"):
        (tools / installer).write_text(f"#!{shutil.which('bash')}\necho {installer} \"$@\" >> {called}\n")
        (tools / installer).chmod(0o755)
    result = subprocess.run([str(ROOT / "scripts" / "test.sh"), "--co", "-q", "tests/unit/test_readme.py"], capture_output=True,
                            text=True, timeout=300, env={"PATH": str(tools), "HOME": str(tmp_path)})
    assert result.returncode == 0, result
    assert not called.exists(), called.read_text()
    assert "systemd-analyze is not installed" in result.stderr and "apt-get install systemd" in result.stderr, result.stderr
