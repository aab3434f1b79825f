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
# Logit units (random weights: the logits' spread is about 0.9, a bf16 step near the top
# about 0.016): how far two runs' logits may have moved where a sequence parts.
NEAR_TIE = 0.25


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
    """nano-vllm on gpumemd computes what it computes as shipped. The prefill's logits are
    alike to the bit and no logit is ever non-finite. Where the engine reproduces itself
    (the same batch again, same tokens: the kit keeps torch off cuDNN's attention, which
    does not), gpumemd must not move one bit either: same tokens, same logits. Where it
    does not (other kernels, other torch), runs may part, but only at near-ties of the
    greedy choice: a corruption (a borrow over live memory, a bad KV block) would part
    them anywhere."""
    model = tmp_path / "model"
    go = {mode: tmp_path / f"go-{mode}" for mode in ("shipped", "gpumemd")}
    env = child_env(runtime_dir)
    common = ["--model", str(model), "--prompts", "16", "--tokens", "16", "--passes", "1"]
    engines = {}
    for mode, extra in [("shipped", ["--port", "29611"]), ("gpumemd", ["--runtime-dir", str(runtime_dir), "--port", "29612"])]:
        log = open(tmp_path / f"{mode}.log", "w")  # noqa: SIM115 - closed with the process below
        cmd = [sys.executable, str(KIT), "engine", "--mode", mode, "--out", str(tmp_path / f"{mode}.json"), *common, *extra,
               "--start-after", str(go[mode])]
        engines[mode] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)  # imports meanwhile
    results = {}
    try:
        subprocess.run([sys.executable, str(KIT), "build", str(model)], check=True, timeout=100, env=env)
        for mode in ("shipped", "gpumemd"):
            if mode == "gpumemd":
                daemon_factory("cuda")  # after the shipped run: its free memory is the GPU's
            go[mode].write_text("go")
            proc, log = engines[mode]
            code = proc.wait(timeout=100)
            log.close()
            assert code == 0, f"{mode} engine failed ({code}):\n{(tmp_path / f'{mode}.log').read_text()}"
            results[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    finally:
        for proc, log in engines.values():
            proc.kill()
            proc.wait()
            log.close()
    shipped, on = results["shipped"], results["gpumemd"]
    assert shipped["nonfinite_logit_rows"] == 0 and on["nonfinite_logit_rows"] == 0
    assert on["blocks"] > shipped["blocks"]
    prefill = shipped["prefill_steps"]
    assert prefill >= 1 and on["checksums"][:prefill] == shipped["checksums"][:prefill], "the prefill's logits differ in bits"
    if shipped["repeat_differ"] == 0 and on["repeat_differ"] == 0:
        assert on["tokens"] == shipped["tokens"]
        assert on["checksums"] == shipped["checksums"], "the tokens agree, the logits differ in bits"
        return
    for seq, (u, v) in enumerate(zip(on["tokens"], shipped["tokens"])):
        split = next((j for j, (p, q) in enumerate(zip(u, v)) if p != q), None)
        if split is not None:  # the two runs' top-1/top-2 gaps at the step they parted: what the logits moved by
            moved = on["margins"][seq][split] + shipped["margins"][seq][split]
            assert moved <= NEAR_TIE, f"sequence {seq} parted at token {split} where the logits had to move by {moved}"
