"""Eight client processes churning arenas and KV pools against one daemon for 60 s,
random ones killed with SIGKILL and started again (tests/churn_workload.py), on every
backend: no VaCollision, no failure, no crash, the daemon alive, and at the end nothing
accounted (on CUDA, the device's free memory back within 64 MiB of where it started).
Prints one summary line; bench/churn.py runs the same workload longer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from churn_workload import churn, summary

SECONDS = 60.0
WORKERS = 8


@pytest.mark.timeout(180)
def test_eight_processes_churning_with_kill_9(daemon: Any, runtime_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = runtime_dir / "churn-logs"
    logs.mkdir()
    figures = churn(runtime_dir, seconds=SECONDS, workers=WORKERS, kill_every=2.5, seed=7, log_dir=logs)
    with capsys.disabled():
        print("\n" + summary(daemon.backend, figures))
    errors = "\n".join(figures["errors"])
    assert figures["collisions"] == 0 and figures["failures"] == 0, errors
    assert figures["crashes"] == 0 and figures["unreported"] == 0, errors
    assert figures["kills"] >= 10, "the workload did not kill enough workers to mean anything"
    assert figures["operations"] >= 1000 and figures["reads_checked"] >= 1000, figures
    assert figures["daemon_alive"] and daemon.proc.poll() is None, daemon.log()
    assert (figures["clients_left"], figures["arenas_left"], figures["accounted_bytes_end"]) == (0, 0, 0), figures
    if daemon.backend == "cuda":
        assert figures["free_bytes_end"] >= figures["free_bytes_baseline"] - figures["free_tolerance"], figures
