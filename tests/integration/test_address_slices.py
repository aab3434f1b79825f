"""Each daemon's address slice, reserved once per process (gpumem.address_slices):
shared by the sessions of one daemon and freed with the last; a slice something else
holds is a VaCollision naming it; two daemons planning the same slice cannot share a
process; peer daemons' slices sit side by side. The daemon's own slice, taken at start,
is a one-line startup error. Scenarios run in their own processes
(tests/slice_scenarios.py), on every backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon, child_env

SCRIPT = Path(__file__).resolve().parents[1] / "slice_scenarios.py"
EX_CONFIG = 78


def scenario(runtime_dir: Path, name: str, backend: str, *dirs: Path) -> None:
    args = [sys.executable, str(SCRIPT), name, backend, *(str(d) for d in (runtime_dir, *dirs))]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=child_env(runtime_dir))
    assert out.returncode == 0 and f"PASS {name}" in out.stdout, f"{name} failed:\n{out.stdout}\n{out.stderr}"


def test_sessions_of_one_daemon_share_its_slice_and_the_last_frees_it(daemon, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    scenario(runtime_dir, "shared_slice", daemon.backend)


def test_a_slice_taken_in_the_process_is_a_va_collision(daemon, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    scenario(runtime_dir, "collision", daemon.backend)


# Host only: on CUDA a second daemon for the same GPU is refused at start (one daemon per
# GPU UUID, test_daemon_lifecycle), whatever its runtime directory.
@pytest.mark.parametrize("backend", ["host"])
def test_two_daemons_of_one_device_index_cannot_share_a_process(daemon, runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    other_dir = runtime_dir / "other"  # removed with runtime_dir, whatever happens here
    other_dir.mkdir()
    other = Daemon(other_dir, daemon.backend, 0, [], child_env(other_dir))
    try:
        other.wait_ready()
        scenario(runtime_dir, "other_daemon_same_slice", daemon.backend, other_dir)
    finally:
        assert other.stop() == 0, other.log()


@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.gpu2])])
def test_peer_daemons_slices_sit_side_by_side(backend: str, daemon_factory: Any, runtime_dir: Path) -> None:
    daemon_factory(backend, device=0)
    daemon_factory(backend, device=1)
    scenario(runtime_dir, "peers", backend)


SQUATTER = """
import sys
from gpumem_shared.address_plan import plan_range
from gpumem_shared.driver.host import HostDriver
base, _ = plan_range(0)
assert HostDriver(0).reserve(2 << 20, base + (3 << 40)) == base + (3 << 40)
sys.argv = ["gpumemd", *sys.argv[1:]]
from gpumemd.cli import main
main()
"""


def test_a_daemon_whose_slice_is_taken_does_not_start(runtime_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SQUATTER, "--device", "0", "--backend", "host", "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir),
    )
    assert out.returncode == EX_CONFIG, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{out.stderr}"
    assert lines[0].startswith("gpumemd: cannot reserve device 0's address slice [0x200000000000, 0x240000000000) (4 TiB)"), lines
    assert "at its planned address" in lines[0], lines
    assert not (runtime_dir / "gpu0.json").exists() and not (runtime_dir / "gpu0.fd").exists()
