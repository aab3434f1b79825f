"""Where clients find daemons when no runtime directory is named: the system directory
(systemd's daemons, run as root) first, then the user's own. An engine that is not root
must find a root daemon; root finds the system one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpumem
from gpumem import discovery
from gpumem_shared import paths
from gpumem_shared.paths import runtime_dir_candidates

NOBODY = 65534

# Runs as root long enough to import everything, then drops to an ordinary user that
# keeps group 0 (the test daemon's socket group), so the interpreter and the modules,
# which live where only root reads, are loaded already.
AS_NOBODY = """
import os, sys
from pathlib import Path
import gpumem, gpumem.session, gpumem_shared.driver.host
from gpumem_shared import paths
paths.SYSTEM_RUNTIME_DIR = Path(sys.argv[1])  # stands in for /run/gpumemd
os.setgid(0)
os.setuid(%d)
with gpumem.connect(0, name="ordinary-engine") as s:
    print(os.geteuid(), s.endpoints.runtime_dir)
""" % NOBODY


def test_candidates_in_order() -> None:
    assert runtime_dir_candidates({"GPUMEMD_RUNTIME_DIR": "/x"}, euid=1000) == [Path("/x")]
    assert runtime_dir_candidates({}, euid=0) == [paths.SYSTEM_RUNTIME_DIR]
    assert runtime_dir_candidates({"XDG_RUNTIME_DIR": "/run/user/1000"}, euid=1000) == [
        paths.SYSTEM_RUNTIME_DIR,
        Path("/run/user/1000/gpumemd"),
    ]
    user = runtime_dir_candidates({}, euid=1000)[1]
    assert user.name == "gpumemd-1000"


@pytest.fixture
def two_places(runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A "system" directory and the user's own; the daemons start in ``runtime_dir``."""
    monkeypatch.delenv("GPUMEMD_RUNTIME_DIR", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    return empty, runtime_dir


def test_the_first_place_with_a_live_daemon_wins(two_places, daemon_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    empty, live = two_places
    daemon_factory("host")
    monkeypatch.setattr(discovery, "runtime_dir_candidates", lambda: [empty, live])
    assert discovery.resolve_device(0).runtime_dir == live
    with gpumem.connect(0, name="finds-it") as s:
        s.ping()
    monkeypatch.setattr(discovery, "runtime_dir_candidates", lambda: [live, empty])
    assert discovery.resolve_device(0).runtime_dir == live


def test_nowhere_names_every_place_looked(two_places, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    empty, other = two_places
    monkeypatch.setattr(discovery, "runtime_dir_candidates", lambda: [empty, other])
    with pytest.raises(gpumem.DaemonUnavailable) as info:
        discovery.resolve_device(0)
    assert str(empty) in info.value.message and str(other) in info.value.message


def test_an_ordinary_user_finds_the_system_daemon(daemon_factory, runtime_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    daemon_factory("host")
    os.chmod(runtime_dir, 0o755)  # as /run/gpumemd: RuntimeDirectoryMode=0755
    env = {k: v for k, v in os.environ.items() if k != "GPUMEMD_RUNTIME_DIR"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "xdg")  # the user's own place holds nothing
    out = subprocess.run([sys.executable, "-c", AS_NOBODY, str(runtime_dir)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(NOBODY), str(runtime_dir)], out.stdout
