"""Every benchmark in bench/ runs: each script, on the host backend at about its smallest
size, ends with the JSON line of bench/_common.py (bench, backend, device, figures,
targets, ok). Timings are never judged (``ok`` may be false on a loaded machine); a
benchmark that stopped running (a renamed driver call, a flag gone) fails here, named.
A benchmark with no host path must say why in that line and nothing else. The list of
benchmarks is checked against the folder, so a new one cannot go unrun. On CUDA (-m gpu),
those whose default sizes come from the card run at those defaults and name the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from conftest import ROOT

BENCH_DIR = ROOT / "bench"

# What each benchmark needs to be quick on the host backend: few repeats, small sizes.
BENCHES: dict[str, list[str]] = {
    "alloc": [],
    "burst": ["--cycles", "1", "--repeats", "1", "--phase-s", "0.5", "--requests", "4", "--grow-mib", "64", "--capacity", "64MiB"],
    "churn": ["--seconds", "1", "--workers", "2"],
    "commit": ["--size", "64MiB", "--repeats", "1", "--warmup", "0"],
    "control_rtt": ["--iterations", "100", "--warmup", "10", "--rounds", "2"],
    "driver_probe": [],
    "eagle_borrow": [],
    "engine": ["--prompts", "2", "--tokens", "4"],
    "failover": ["--prefixes", "1", "--per-prefix", "1", "--prefix-blocks", "1", "--suffix-blocks", "1", "--new-tokens", "2",
                 "--blocks", "64"],
    "fairness": ["--iterations", "100", "--warmup", "10", "--flooders", "1", "--depth", "2", "--sockets", "2"],
    "fence_probe": ["--trials", "1", "--window", "5"],
    "fuzz": ["--cases", "50"],
    "kv_round": ["--kv-gib", "0.25", "--headroom-gib", "0.25", "--rounds", "1", "--settle-s", "0"],
    "lease": ["--iterations", "1000", "--pings", "100", "--handoffs", "10"],
    "lease_orderings": ["--blocks", "2", "--per-block", "5"],
    "metrics_rtt": ["--iterations", "100", "--warmup", "10", "--rounds", "2", "--arenas", "2"],
    "placeholder": ["--size", str(128 << 20), "--repeat", "1"],
    "restart": ["--bytes", "64MiB", "--restarts", "1", "--commits", "5"],
    "sleep": ["--sizes", "64MiB", "--repeats", "1", "--drop-size", "64MiB", "--settle-s", "0"],
}

# These need CUDA (torch, or the driver itself); on the host their line says so.
NO_HOST_PATH = {
    "alloc": "need the CUDA backend",
    "driver_probe": "the host backend has no driver to probe",
    "eagle_borrow": "needs the CUDA backend",
}

# Not benchmarks: what they share, and the engines and kits they start or import.
HELPERS = {
    "_common.py": "the benchmarks' plumbing and their JSON line",
    "burst_engines.py": "burst.py's engine processes",
    "failover_engines.py": "failover.py's engine processes",
    "nanovllm_kit.py": "the nano-vllm model, engines and margins of the CUDA benchmarks",
    "nanovllm_probes.py": "the nano-vllm engine's probes: KV scan, step parts, device and arena use, the sampler's borrowing",
    "token_margins.py": "two runs' tokens compared, near-ties told by the logit gap: burst.py, failover.py and the kit",
    "sleep_engines.py": "sleep.py's engine side: the captured graph and each engine's sleep and wake",
    "transformers_kit.py": "transformers' random-weight models and engines of the CUDA benchmarks' --engine transformers and its GPU tests",
    "futex_floor.c": "lease.py's C futex floor, compiled by it",
}

KEYS = ["bench", "backend", "device", "figures", "targets", "ok"]
# Keys a bench may put beside "bench" to say what its line is about (the engine it ran: --engine).
LABELS = {"burst": "engine", "engine": "engine", "failover": "engine", "sleep": "engine"}


def test_the_smoke_test_knows_every_file_in_bench() -> None:
    found = sorted(p.name for p in BENCH_DIR.iterdir() if p.is_file() and not p.name.startswith("."))
    known = sorted([f"{name}.py" for name in BENCHES] + list(HELPERS))
    assert found == known, (
        f"new in bench/: {sorted(set(found) - set(known))} (a benchmark goes in BENCHES with its quick flags, "
        f"a helper in HELPERS); gone: {sorted(set(known) - set(found))}"
    )
    assert set(NO_HOST_PATH) <= set(BENCHES) and set(FITTED) <= set(BENCHES)


def run_bench(name: str, backend: str, args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str]:
    """Run bench/NAME.py; its exit, its last line (checked to be the JSON object) and,
    for failures, what it printed."""
    argv = [sys.executable, str(BENCH_DIR / f"{name}.py"), "--backend", backend, *args]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:  # SIGKILLed: its helpers die with it (PDEATHSIG)
        pytest.fail(f"{name} ran over {timeout:g} s: {' '.join(argv)}\n{exc.stdout!s:.6000}")
    lines = out.stdout.strip().splitlines()
    shown = f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    try:
        line = json.loads(lines[-1])
    except (IndexError, ValueError):
        pytest.fail(f"the last line is not JSON: {shown}")
    print(lines[-1])  # the figures, for -rP
    assert isinstance(line, dict), shown
    label = LABELS.get(name)
    assert [k for k in line if k != label][: len(KEYS)] == KEYS and (label is None or list(line)[1] == label), shown
    assert (line["bench"], line["backend"]) == (name, backend), shown
    assert isinstance(line["figures"], dict) and isinstance(line["targets"], dict) and isinstance(line["ok"], bool), shown
    return out, line, shown


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(BENCHES))
def test_the_benchmark_runs_on_the_host_and_ends_with_its_json_line(name: str) -> None:
    out, line, shown = run_bench(name, "host", BENCHES[name], 120)
    assert line["device"] == "host", shown
    if name in NO_HOST_PATH:
        assert out.returncode == 1 and NO_HOST_PATH[name] in line.get("error", ""), shown
        assert line["ok"] is False and set(line) == {*KEYS, "error"}, shown
    else:
        assert out.returncode == 0 and "error" not in line, shown
        assert line["figures"], shown


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["burst", "failover", "sleep"])
def test_a_benchmark_of_an_engine_takes_transformers_and_on_the_host_says_no_engine_ran(name: str) -> None:
    """``--engine transformers`` is the CUDA run's; on the host the stand-ins (or the
    arenas alone) run as with the default, and the line's engine says that none did."""
    out, line, shown = run_bench(name, "host", [*BENCHES[name], "--engine", "transformers"], 120)
    assert out.returncode == 0 and "error" not in line, shown
    assert line["engine"].startswith("none (host"), shown


@pytest.mark.timeout(150)
@pytest.mark.skipif(os.getuid() != 0, reason="floods as another uid only when run as root")
def test_fairness_floods_as_another_uid_beside_a_daemon_in_a_directory_of_its_own() -> None:
    """Run as root, ``--sessions`` floods as uid 65534: its ready files go in a directory
    it may write, and gpumemd, which refuses such a directory, runs in one of its own
    inside (on the GPU machine the bench died at the daemon's start)."""
    out, line, shown = run_bench("fairness", "host", [*BENCHES["fairness"], "--sessions", "3"], 120)
    assert out.returncode == 0 and "error" not in line, shown
    assert line["figures"]["flood_uid"] == 65534 and line["figures"]["sessions"] == 3, shown


# The benchmarks whose default sizes come from the card (bench/_common.py's fit), at those
# defaults with one repeat: on an 80 GB H100 kv_round and restart ran out of memory at the
# 100 GiB that an H200 holds.
FITTED = {
    "commit": ["--repeats", "1", "--warmup", "0"],
    "driver_probe": ["--settle-s", "0", "--register-gib", "1"],
    "kv_round": ["--rounds", "1", "--settle-s", "0"],
    "placeholder": ["--repeat", "1"],
    "restart": ["--restarts", "1", "--commits", "5"],
    "sleep": ["--sizes", "1GiB", "--repeats", "1", "--settle-s", "0", "--no-tms"],
}


@pytest.mark.gpu
@pytest.mark.timeout(620)
@pytest.mark.parametrize("name", sorted(FITTED))
def test_the_benchmark_fits_the_card_at_its_default_size_and_names_it(name: str) -> None:
    out, line, shown = run_bench(name, "cuda", FITTED[name], 600)
    assert out.returncode == 0 and "error" not in line, shown
    gpu = line["device"]
    assert isinstance(gpu, dict) and gpu["name"] and 0 < gpu["free_bytes_at_start"] <= gpu["total_bytes"], shown
