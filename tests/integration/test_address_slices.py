"""Each daemon's address slice: the daemon's own, taken at start, is a one-line
startup error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import child_env

EX_CONFIG = 78


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
