"""What a start does with LISTEN_FDS that do not add up: LISTEN_FDS counting
descriptors not passed is a configuration error (exit 78, one line), and descriptors
passed for another pid (LISTEN_PID) are neither adopted nor kept open."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import child_env

# In the child before gpumemd: a memfd named argv[1] at descriptor 3, LISTEN_FDS=argv[2]
# and LISTEN_PID this pid plus argv[3] (0: this process, which execs gpumemd).
_LAUNCH = """
import os, sys
fd = os.memfd_create(sys.argv[1], 0)
os.dup2(fd, 3, inheritable=True)
if fd != 3:
    os.close(fd)
os.environ.update(LISTEN_FDS=sys.argv[2], LISTEN_FDNAMES="chunk-1", LISTEN_PID=str(os.getpid() + int(sys.argv[3])))
os.execv(sys.executable, [sys.executable, "-m", "gpumemd", *sys.argv[4:]])
"""


def launch(runtime_dir: Path, memfd_name: str, listen_fds: str, pid_offset: int, **kw: object) -> subprocess.Popen[bytes]:
    args = ["--device", "0", "--backend", "host", "--host-capacity", "1GiB", "--runtime-dir", str(runtime_dir)]
    return subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, memfd_name, listen_fds, str(pid_offset), *args],
        env=child_env(runtime_dir, FDSTORE="16"), **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("listen_fds", "said"),
    [
        ("5", "LISTEN_FDS=5 but descriptor 4 was not passed (not open); check what starts gpumemd (systemd sets LISTEN_FDS itself)"),
        ("many", "LISTEN_FDS='many' is not a number of descriptors"),
    ],
)
def test_listen_fds_that_do_not_add_up_are_one_line_and_exit_78(runtime_dir: Path, listen_fds: str, said: str) -> None:
    proc = launch(runtime_dir, "passed", listen_fds, 0, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 78, err.decode()
    assert err.decode().strip().splitlines() == [f"gpumemd: {said}"]


def test_descriptors_passed_for_another_pid_are_closed(runtime_dir: Path) -> None:
    log = runtime_dir / "gpumemd.log"
    with open(log, "wb") as out:
        proc = launch(runtime_dir, "not-for-this-daemon", "1", 1, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (runtime_dir / "gpu0.json").exists():  # what the daemon writes once it serves
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        links = []
        for fd in os.listdir(f"/proc/{proc.pid}/fd"):
            try:
                links.append(os.readlink(f"/proc/{proc.pid}/fd/{fd}"))
            except FileNotFoundError:
                continue
        assert not [link for link in links if "not-for-this-daemon" in link], links
        assert "is for pid" in log.read_text() and "1 of them open here, closed" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
