"""torch on daemon arenas, on the CUDA backend: each scenario of tests/torch_scenarios.py
runs in its own process against a real CUDA daemon."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env

SCENARIOS = [
    "tensors_land_in_arena",
    "writer_then_reader",
    "placeholder_capture_commit_replay",
    "graph_pool_in_daemon_chunks",
    "oom_names_the_arena",
    "bad_routing",
]
SCRIPT = Path(__file__).resolve().parents[1] / "torch_scenarios.py"


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torch_scenario(scenario: str, daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("cuda")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), scenario], capture_output=True, text=True, timeout=300, env=child_env(runtime_dir)
    )
    assert out.returncode == 0 and f"PASS {scenario}" in out.stdout, (
        f"{scenario} failed ({out.returncode}):\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}\ndaemon log:\n{daemon.log()}"
    )
