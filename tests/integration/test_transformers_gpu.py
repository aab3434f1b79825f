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
from gpumemd_testkit import lines_until

KIT = ROOT / "bench" / "transformers_kit.py"
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
# Each test starts two to three engine processes (model built, warmed up, graphs captured): minutes.
pytestmark = pytest.mark.timeout(900)


def _engine(tmp_path: Path, runtime_dir: Path, label: str, *args: str) -> dict[str, Any]:
    out = tmp_path / f"{label}.json"
    done = subprocess.run([sys.executable, str(KIT), "engine", "--out", str(out), "--prompts", "16", "--tokens", "24", *args],
                          capture_output=True, text=True, timeout=280, env=child_env(runtime_dir))
    assert done.returncode == 0, f"{label} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# A plain engine's run depends on its arguments only (seeded weights and prompts, no
# daemon): tests asking for the same one share it (an engine start is ~30 s on the H100).
_PLAIN: dict[tuple[str, ...], dict[str, Any]] = {}


def _plain(tmp_path: Path, runtime_dir: Path, *args: str) -> dict[str, Any]:
    if args not in _PLAIN:
        _PLAIN[args] = _engine(tmp_path, runtime_dir, "plain", "--mode", "plain", *args)
    return _PLAIN[args]


@pytest.mark.gpu
@needs_transformers
@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_transformers_on_gpumemd_generates_what_plain_generates_and_sleeps(arch: str, daemon_factory, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The KV cache laid out virtually and committed by the round after warm-up's graphs:
    at least the blocks transformers sizes for itself, the same greedy tokens; asleep
    (weights, graphs, KV dropped) it frees its memory, and woken it generates the same
    tokens again with the graphs it captured; its KV cache is retained for a successor."""
    # transformers' own sizing at its default max_memory_percent; on the H100 that many
    # blocks leave its warm-up and first batch out of memory, so the tokens come from a
    # plain engine at half the memory.
    sized = _engine(tmp_path, runtime_dir, "sized", "--mode", "plain", "--arch", arch, "--sizing-only")
    plain = _plain(tmp_path, runtime_dir, "--arch", arch, "--max-memory-percent", "0.45")
    daemon = daemon_factory("cuda")
    on = _engine(tmp_path, runtime_dir, "gpumemd", "--mode", "gpumemd", "--arch", arch, "--runtime-dir", str(runtime_dir),
                 "--sleep-cycle", "--retain", "tf-group")
    print(f"blocks: gpumemd {on['blocks']}, transformers' own sizing {sized['blocks']}, plain at 0.45 {plain['blocks']}")
    print(json.dumps({"gpumemd": on["memory"], "plain": plain["memory"]}))
    assert on["blocks"] >= plain["blocks"], (on["blocks"], plain["blocks"], on["memory"], daemon.log()[-2000:])
    assert on["tokens"] == plain["tokens"]
    assert on["tokens_after_wake"] == on["tokens"]
    assert on["freed_bytes"] > 4 * on["block_bytes"]
    assert on["retain_secret_len"] > 0


@pytest.mark.gpu
@needs_transformers
def test_two_transformers_engines_started_together_share_one_round(daemon_factory, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two engines started at the same moment (expect=2): both start, the round splits
    the device between them, each gets at least 0.95x the blocks of a plain engine that
    takes half the device, and generates what a plain engine generates."""
    plain = _plain(tmp_path, runtime_dir, "--arch", "qwen3", "--max-memory-percent", "0.45")
    (tmp_path / "plain-045.json").write_text(json.dumps(plain))
    half = _plain(tmp_path, runtime_dir, "--arch", "qwen3", "--half-of", str(tmp_path / "plain-045.json"))
    daemon = daemon_factory("cuda")
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
    print(json.dumps({"half_plain": {k: v for k, v in half.items() if k != "tokens"}, "pair": [r["memory"] for r in results]}))
    for r in results:
        assert r["blocks"] >= 0.95 * half["blocks"], ([r["blocks"] for r in results], half, [r["memory"] for r in results], daemon.log()[-4000:])
        assert r["tokens"] == plain["tokens"]


def _spawn(runtime_dir: Path, out: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(KIT), "engine", "--out", str(out), "--mode", "gpumemd", "--runtime-dir", str(runtime_dir), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(runtime_dir))


def _until(proc: subprocess.Popen[str], word: str, timeout: float = 240.0) -> list[str]:
    """Lines of ``proc`` up to one starting with ``word`` (bounded by ``timeout``)."""
    return lines_until(proc, lambda line: line.startswith(word), f"no '{word}'", timeout)


def _reap(*procs: subprocess.Popen[str] | None) -> None:
    """Each engine killed and waited for, and its output pipe closed (one killed while a
    test read it keeps the pipe open)."""
    for proc in procs:
        if proc is not None:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


# Small pools for the elastic test: a 1024-token batch and at most 512 blocks of 8 MiB.
SMALL = ["--arch", "qwen3", "--max-batch-tokens", "1024", "--max-blocks", "512"]


@pytest.mark.gpu
@needs_transformers
def test_transformers_block_manager_follows_its_pool(daemon_factory, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two engines in one round on a 10 GiB device: B idles, serving, while A takes a burst
    of long prompts past its round's share; A's grows are answered from B's blocks (B's
    follower moves its live blocks down and gives back), and A's tokens are what a plain
    engine with enough blocks generates."""
    burst = ["--prompts", "48", "--prompt-len", "1600", "--tokens", "16"]
    plain = _plain(tmp_path, runtime_dir, "--arch", "qwen3", "--max-batch-tokens", "1024",
                    "--num-blocks", "500", *burst)
    # Both engines' arenas (weights, warm-up's and graphs' memory) took 4.7 GiB on the H100;
    # the rest, less the reserve and the headroom, is a round that cannot give A its burst.
    daemon_factory("cuda", args=["--capacity", "10GiB", "--kv-chunk-size", "32MiB"])
    stop = tmp_path / "stop"
    b = _spawn(runtime_dir, tmp_path / "b.json", *SMALL, "--name", "b", "--expect", "2", "--prompts", "4", "--serve-until", str(stop))
    a = _spawn(runtime_dir, tmp_path / "a.json", *SMALL, "--name", "a", "--expect", "2", *burst)
    try:
        _until(b, "SERVING")
        log, _ = a.communicate(timeout=280)
        assert a.returncode == 0, log[-6000:]
        stop.write_text("stop")
        blog, _ = b.communicate(timeout=60)
        assert b.returncode == 0, blog[-6000:]
    finally:
        _reap(a, b)
    ra, rb = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    assert ra["tokens"] == plain["tokens"]
    assert ra["blocks_after"] > ra["blocks"] and ra["follow"]["grows"] >= 1, (ra, rb)
    assert rb["blocks_final"] < rb["blocks"] and rb["follow"]["shrinks"] >= 1, (ra, rb)


@pytest.mark.gpu
@needs_transformers
def test_transformers_standby_takes_over_a_killed_primary(daemon_factory, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A primary retains its KV cache and prefix directory; a standby built beside it
    (graphs captured on the primary's windows, rehearsed, asleep) takes over after kill -9
    of the primary, seeds its prefix cache from the directory and generates what the
    primary generated."""
    # float32: the standby's prefill from seeded blocks and the plain one's from scratch part
    # nowhere near a tie. A small layout: the standby's batch tensors (the mask: batch tokens
    # by the primary's pages) fit the room the primary's round leaves it.
    small = ["--arch", "qwen3", "--dtype", "float32", "--max-batch-tokens", "512", "--prompts", "16", "--tokens", "24",
             "--prompt-len", "1200"]  # prompts that fill whole 256-token blocks: only those are in the directory
    plain = _plain(tmp_path, runtime_dir, *small)
    daemon_factory("cuda")
    secret, stop = tmp_path / "secret", tmp_path / "stop"
    primary = _spawn(runtime_dir, tmp_path / "primary.json", *small, "--max-blocks", "2048", "--name", "primary", "--retain", "tf",
                     "--secret-file", str(secret), "--serve-until", str(stop))
    standby = None
    try:
        _until(primary, "SERVING")
        standby = _spawn(runtime_dir, tmp_path / "standby.json", *small, "--name", "standby", "--standby", "tf", "--secret-file", str(secret))
        _until(standby, "STANDBY READY")
        primary.kill()
        primary.wait()
        log, _ = standby.communicate(timeout=200)
        assert standby.returncode == 0, log[-6000:]
    finally:
        _reap(primary, standby)
    took = json.loads((tmp_path / "standby.json").read_text())
    assert took["tokens"] == plain["tokens"]
    assert took["take_over"]["seeded"] > 0 and took["take_over"]["corrupt"] == 0, took["take_over"]


@pytest.mark.gpu
@needs_transformers
@pytest.mark.skipif(importlib.util.find_spec("nanovllm") is None, reason="needs nano-vllm")
def test_nanovllm_and_transformers_share_one_round(daemon_factory, runtime_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One KV round gathers a nano-vllm engine and a transformers engine (expect=2): both
    start with blocks, and the transformers one generates what it generates alone."""
    model = tmp_path / "model"
    nano_kit = ROOT / "bench" / "nanovllm_kit.py"
    subprocess.run([sys.executable, str(nano_kit), "build", str(model)], check=True, timeout=100, env=child_env(runtime_dir))
    plain = _plain(tmp_path, runtime_dir, "--arch", "mistral")
    daemon_factory("cuda")
    nano = subprocess.Popen([sys.executable, str(nano_kit), "engine", "--model", str(model), "--mode", "gpumemd", "--name", "nano",
                             "--out", str(tmp_path / "nano.json"), "--expect", "2", "--runtime-dir", str(runtime_dir),
                             "--prompts", "8", "--tokens", "8", "--passes", "0", "--port", "29631"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(runtime_dir))
    tf = _spawn(runtime_dir, tmp_path / "tf.json", "--arch", "mistral", "--name", "tf", "--expect", "2", "--prompts", "16", "--tokens", "24")
    try:
        for proc in (tf, nano):
            log, _ = proc.communicate(timeout=280)
            assert proc.returncode == 0, log[-6000:]
    finally:
        _reap(tf, nano)
    rt, rn = (json.loads((tmp_path / f"{x}.json").read_text()) for x in ("tf", "nano"))
    assert rt["blocks"] > 0 and rn["blocks"] > 0
    assert rt["tokens"] == plain["tokens"]
