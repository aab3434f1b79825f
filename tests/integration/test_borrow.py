"""Borrowing graph-pool free runs against a real daemon, on both backends: each scenario
of tests/borrow_scenarios.py runs in its own process (two, where a scenario needs a
second client), the same code on the host backend (raw views over a synthetic pool)
and on CUDA (torch tensors in a captured graph's pool)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env

SCRIPT = Path(__file__).resolve().parents[1] / "borrow_scenarios.py"

# (scenario, args, backends)
SCENARIOS = [
    ("in_runs_and_no_new_memory", [], ("host", "cuda")),
    ("oom_and_can_fit", [], ("host", "cuda")),
    ("escape_is_caught", [], ("host", "cuda")),
    ("rebuild_rules", [], ("host", "cuda")),
    ("raw_scopes_keep_their_torch_pool", [], ("cuda",)),  # the host backend has no torch pool
    ("stream_binding", [], ("host", "cuda")),
    ("cublas_warmed_before_first_borrow", [], ("cuda",)),
    ("handoff_orders_gpu_work", [], ("host", "cuda")),
    ("handoff_without_wait_reads_stale_bytes", [], ("cuda",)),  # host work is synchronous: nothing to see
]
# Two processes alternating replay and cross-process borrow: 10,000 rounds on the GPU,
# fewer on the host backend (CI), where each replay is a 12 MiB memset.
TORTURE = {"host": 1000, "cuda": 10000}


def run_scenario(runtime_dir: Path, daemon: object, args: list[str], timeout: float) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=child_env(runtime_dir))
    assert out.returncode == 0 and f"PASS {args[0]}" in out.stdout, (
        f"{args[0]} failed ({out.returncode}):\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}\n"
        f"daemon log:\n{daemon.log()}"  # type: ignore[attr-defined]
    )
    return out.stdout + out.stderr


@pytest.mark.parametrize("scenario,args,backends", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_borrow_scenario(scenario: str, args: list[str], backends: tuple[str, ...], backend: str, daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    if backend not in backends:
        pytest.skip(f"{scenario} needs the {' or '.join(backends)} backend")
    daemon = daemon_factory(backend)
    run_scenario(runtime_dir, daemon, [scenario, *args], 300)


def test_torture_alternating_replay_and_cross_process_borrow(backend: str, daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory(backend)
    output = run_scenario(runtime_dir, daemon, ["torture", str(TORTURE[backend])], 580)
    print(output)
