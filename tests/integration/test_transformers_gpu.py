"""transformers' continuous batching on gpumemd against transformers as shipped, on CUDA
(bench/transformers_kit.py: random-weight Qwen3 and sliding-window Mistral built offline;
skipped where transformers is not installed). Each engine is a process of its own."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, child_env

KIT = ROOT / "bench" / "transformers_kit.py"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def _engine(tmp_path: Path, runtime_dir: Path, label: str, *args: str) -> dict[str, Any]:
    out = tmp_path / f"{label}.json"
    done = subprocess.run([sys.executable, str(KIT), "engine", "--out", str(out), "--prompts", "16", "--tokens", "24", *args],
                          capture_output=True, text=True, timeout=280, env=child_env(runtime_dir))
    assert done.returncode == 0, f"{label} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.gpu
@needs_transformers
@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_transformers_on_gpumemd_generates_what_plain_generates_and_sleeps(arch: str, daemon_factory, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The KV cache laid out virtually and committed by the round after warm-up's graphs:
    at least the blocks transformers sizes for itself, the same greedy tokens; asleep
    (weights, graphs, KV dropped) it frees its memory, and woken it generates the same
    tokens again with the graphs it captured; its KV cache is retained for a successor."""
    plain = _engine(tmp_path, runtime_dir, "plain", "--mode", "plain", "--arch", arch)
    daemon = daemon_factory("cuda")
    on = _engine(tmp_path, runtime_dir, "gpumemd", "--mode", "gpumemd", "--arch", arch, "--runtime-dir", str(runtime_dir),
                 "--sleep-cycle", "--retain", "tf-group")
    assert on["blocks"] >= plain["blocks"], (on["blocks"], plain["blocks"], daemon.log()[-2000:])
    assert on["tokens"] == plain["tokens"]
    assert on["tokens_after_wake"] == on["tokens"]
    assert on["freed_bytes"] > 4 * on["block_bytes"]
    assert on["retain_secret_len"] > 0


@pytest.mark.gpu
@needs_transformers
def test_two_transformers_engines_started_together_share_one_round(daemon_factory, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two engines started at the same moment (expect=2): both start, the round splits
    the device between them, and each generates what a plain engine generates."""
    plain = _engine(tmp_path, runtime_dir, "plain", "--mode", "plain", "--arch", "qwen3", "--max-memory-percent", "0.45")
    daemon_factory("cuda")
    go = tmp_path / "go"
    procs = []
    for x in "ab":
        out = tmp_path / f"pair-{x}.json"
        cmd = [sys.executable, str(KIT), "engine", "--out", str(out), "--prompts", "16", "--tokens", "24", "--mode", "gpumemd",
               "--arch", "qwen3", "--runtime-dir", str(runtime_dir), "--expect", "2", "--name", f"pair-{x}", "--start-after", str(go)]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(runtime_dir)), out))
    go.write_text("go")
    results = []
    for proc, out in procs:
        log, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, log.decode()[-6000:]
        results.append(json.loads(out.read_text()))
    for r in results:
        assert r["blocks"] >= 0.9 * plain["blocks"], ([r["blocks"] for r in results], plain["blocks"])
        assert r["tokens"] == plain["tokens"]
