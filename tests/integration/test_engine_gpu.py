"""The engine-facing API with torch on the CUDA backend (tests/engine_scenarios.py, each
scenario in its own process), and nano-vllm on gpumemd against nano-vllm as shipped
(bench/nanovllm_kit.py; skipped where nano-vllm is not installed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env

SCENARIOS = ["elastic_torch_arena", "engine_memory_end_to_end"]
SCRIPT = ROOT / "tests" / "engine_scenarios.py"
KIT = ROOT / "bench" / "nanovllm_kit.py"


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_scenario(scenario: str, daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("cuda")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), scenario], capture_output=True, text=True, timeout=300, env=child_env(runtime_dir)
    )
    assert out.returncode == 0 and f"PASS {scenario}" in out.stdout, (
        f"{scenario} failed ({out.returncode}):\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}\ndaemon log:\n{daemon.log()}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("nanovllm") is None, reason="needs nano-vllm (pip install 'gpumemd[nanovllm]')")
def test_nanovllm_on_gpumemd_generates_what_it_generates_as_shipped(daemon_factory, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = tmp_path / "model"
    subprocess.run([sys.executable, str(KIT), "build", str(model)], check=True, timeout=300)
    results = {}
    for mode, extra in [("shipped", []), ("gpumemd", ["--runtime-dir", str(runtime_dir)])]:
        if mode == "gpumemd":
            daemon_factory("cuda")  # after the shipped run: its free memory is the GPU's
        out = tmp_path / f"{mode}.json"
        run = subprocess.run(
            [sys.executable, str(KIT), "engine", "--model", str(model), "--mode", mode, "--out", str(out), "--prompts", "16",
             "--tokens", "16", *extra],
            capture_output=True, text=True, timeout=300, env=child_env(runtime_dir),
        )
        assert run.returncode == 0, f"{mode} engine failed:\n{run.stdout}\n{run.stderr}"
        results[mode] = json.loads(out.read_text())
    assert results["gpumemd"]["tokens"] == results["shipped"]["tokens"]
    assert results["gpumemd"]["blocks"] > results["shipped"]["blocks"]
