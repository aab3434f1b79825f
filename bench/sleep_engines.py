"""bench/sleep.py's engine side, on CUDA: a graph captured into gpumem arenas replayed after
its memory slept and woke, and an engine's own sleep and wake between two passes of the
same batch (``CYCLES``: one per engine ``--engine`` names, each run through the engine's
kit as a process of its own against the bench's daemon), its tokens compared.

An engine cycle gives: ``engine_sleep_s`` and ``engine_wake_s`` (the integration's sleep,
the KV cache dropped and weights and graphs kept in host memory, and its wake),
``engine_freed_bytes`` (what the sleep gave back), ``engine_tokens_identical`` (the batch's
greedy tokens after the wake against before it, the same engine and batch: bit for bit)
and where the kit times it ``engine_first_token_after_wake_s``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as c

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT = 300.0  # an engine's imports, build, warm-up and capture, a pass of the batch: about a minute on the H100


def graph_replays_after_wake(rdir: Any, device: int, timeout: float) -> dict[str, Any]:
    """A graph captured into gpumem arenas, its output kept; weights and graph pool slept
    and woken; replayed without a recapture; the outputs compared bit for bit."""
    import torch

    import gpumem

    with gpumem.EngineMemory("bench-sleep-graph", device, runtime_dir=str(rdir), timeout=timeout) as mem:
        with mem.running():
            torch.manual_seed(0)
            w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    (x @ w).relu() @ w.t()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = ((x @ w).relu() @ w.t()).softmax(-1)
            g.replay()
            torch.cuda.synchronize()
            before = y.clone()
        held = mem.model.committed + mem.graphs.committed
        t0 = time.perf_counter()
        mem.sleep("weights", "graphs")
        slept = time.perf_counter() - t0
        t0 = time.perf_counter()
        mem.wake()
        woke = time.perf_counter() - t0
        g.replay()
        torch.cuda.synchronize()
        identical = bool(torch.equal(y, before))
        return {"identical": identical, "sleep_s": slept, "wake_s": woke, "slept_bytes": held}


def nanovllm(rdir: Path) -> dict[str, Any]:
    """nano-vllm (bench/nanovllm_kit.py's random-weight Qwen3, built offline) on the daemon:
    the kit's ``--sleep-cycle`` (tests/integration/test_sleep_gpu.py's): a pass, sleep
    (``asleep.json``), wake when told, the first token timed, the pass again (``woke.json``)."""
    kit, model, folder = HERE / "nanovllm_kit.py", rdir / "nanovllm-model", rdir / "nanovllm-cycle"
    folder.mkdir()
    subprocess.run([sys.executable, str(kit), "build", str(model)], check=True, timeout=ENGINE_TIMEOUT, env=c.child_env())
    child = c.Child("nano-vllm", [str(kit), "engine", "--mode", "gpumemd", "--model", str(model), "--out", str(rdir / "nanovllm.json"),
                                  "--runtime-dir", str(rdir), "--prompts", "16", "--tokens", "16", "--passes", "0", "--sleep-cycle", str(folder)],
                    rdir / "nanovllm.log")
    try:
        child.wait_for((folder / "asleep.json").exists, ENGINE_TIMEOUT, "its pass and its sleep")
        asleep = json.loads((folder / "asleep.json").read_text())
        (folder / "wake").touch()
        child.wait_for((folder / "woke.json").exists, ENGINE_TIMEOUT, "its wake and its pass again")
        woke = json.loads((folder / "woke.json").read_text())
    finally:
        child.stop()
    return {"engine_sleep_s": asleep["sleep_s"], "engine_wake_s": woke["wake_s"], "engine_freed_bytes": asleep["freed_bytes"],
            "engine_tokens_identical": bool(woke["same_tokens"]), "engine_first_token_after_wake_s": woke["ttft_s"]}


def transformers(rdir: Path) -> dict[str, Any]:
    """transformers' continuous batching (bench/transformers_kit.py's random-weight Qwen3,
    bfloat16) alone on the daemon: the kit's ``--sleep-cycle`` (tests/integration/
    test_transformers_gpu.py's): a pass, ``port().sleep("weights", "graphs", "kv",
    drop=["kv"])``, ``port().wake()``, the pass again."""
    out = rdir / "transformers.json"
    child = c.Child("transformers", [str(HERE / "transformers_kit.py"), "engine", "--mode", "gpumemd", "--name", "bench-sleep-tf",
                                     "--expect", "1", "--runtime-dir", str(rdir), "--out", str(out), "--prompts", "16", "--tokens", "24",
                                     "--sleep-cycle"], rdir / "transformers.log")
    try:
        child.wait_for(lambda: child.proc.poll() is not None, ENGINE_TIMEOUT, "its pass, sleep, wake and pass again")
        if child.proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"transformers' engine ended {child.proc.returncode} without its figures; its log:\n{child.log()[-4000:]}")
    finally:
        child.stop()
    r = json.loads(out.read_text())
    return {"engine_sleep_s": r["sleep_s"], "engine_wake_s": r["wake_s"], "engine_freed_bytes": r["freed_bytes"],
            "engine_tokens_identical": r["tokens_after_wake"] == r["tokens"]}


CYCLES: dict[str, Callable[[Path], dict[str, Any]]] = {"nanovllm": nanovllm, "transformers": transformers}
