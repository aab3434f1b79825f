"""The colocation scenario of issue 25 on the H200: a nano-vllm engine on gpumemd sleeps
(weights and graphs kept in host memory, its KV cache dropped), a trainer stand-in in
another process commits and uses at least 90% of the bytes it freed and gives them back,
and the engine wakes and generates the same token ids as before. Wake time and the time
to the first token after it are printed. Skipped where nano-vllm is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, child_env
from gpumemd_testkit import wait_json

KIT = ROOT / "bench" / "nanovllm_kit.py"
GRANULARITY = 2 << 20


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("nanovllm") is None, reason="needs nano-vllm (pip install 'gpumemd[nanovllm]')")
def test_an_engine_sleeps_a_trainer_uses_its_memory_and_it_wakes_generating_the_same(daemon_factory, run_client, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("cuda")
    env = child_env(runtime_dir)
    model, folder = tmp_path / "model", tmp_path / "cycle"
    folder.mkdir()
    subprocess.run([sys.executable, str(KIT), "build", str(model)], check=True, timeout=100, env=env)
    # The trainer lives beside the engine from the start, as in RL colocation: its CUDA
    # context and torch's kernels (about 0.5 GiB outside any arena) exist when the engine
    # sizes its KV cache from measured free memory. A process that first appears while
    # the engine sleeps holds memory the wake then lacks (the H200 showed it: 0.52 GiB short).
    trainer = run_client("shell", "trainer")
    trainer.expect("CONNECTED")
    for line in (f"create warm {GRANULARITY}", f"commit warm {GRANULARITY}", f"viewfill warm 0 {GRANULARITY} 1", "release warm"):
        trainer.send(line)
        trainer.expect("OK", timeout=60)
    log = tmp_path / "engine.log"
    with open(log, "w") as out:
        engine = subprocess.Popen(
            [sys.executable, str(KIT), "engine", "--mode", "gpumemd", "--model", str(model), "--out", str(tmp_path / "engine.json"),
             "--runtime-dir", str(runtime_dir), "--prompts", "16", "--tokens", "16", "--passes", "0", "--sleep-cycle", str(folder)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    try:
        asleep = wait_json(folder / "asleep.json", engine, log, 300)
        freed = int(asleep["freed_bytes"])  # type: ignore[call-overload]
        assert freed > 0, asleep
        take = int(freed * 0.9) // GRANULARITY * GRANULARITY + GRANULARITY  # at least 90%
        trainer.send(f"create train {2 * take}")
        trainer.expect("OK")
        trainer.send(f"commit train {take}")
        assert int(trainer.expect("OK", timeout=60)) == take
        trainer.send(f"viewfill train 0 {take} 7")  # every byte touched on the device
        trainer.expect("OK", timeout=120)
        for at in (0, take // 2, take - 64 * (1 << 20)):
            trainer.send(f"check train {at} {64 * (1 << 20)} 7")
            assert trainer.expect("OK", timeout=60) == "MATCH"
        trainer.send("release train")
        trainer.expect("OK")
        (folder / "wake").touch()
        woke = wait_json(folder / "woke.json", engine, log, 300)
        print(f"\ncolocation: slept {asleep['sleep_s']:.3f} s freeing {freed / (1 << 30):.1f} GiB (trainer used {take / freed:.0%}); "
              f"wake {woke['wake_s']:.3f} s; first token after wake {woke['ttft_s']:.3f} s")
        assert woke["same_tokens"], f"{woke['differ']} sequence(s) differ after the wake:\n{log.read_text()}\n{daemon.log()}"
        assert engine.wait(120) == 0, log.read_text()
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
