"""bench/burst.py, short: two engines, one bursts while the other idles, in the four
configurations of issue 24. Whatever the timings, the elastic run must have moved memory
(grows answered by the other's shrinks) without a preemption, and every request's token
ids must be those of the static split: on the host, stand-in engines whose tokens read
every KV slot back; on CUDA, two nano-vllm engines (skipped without nano-vllm), up to
near-ties where the batches differ (the round's, the same batches, exactly)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT

BENCH = ROOT / "bench" / "burst.py"
NEEDS_NANOVLLM = pytest.mark.skipif(importlib.util.find_spec("nanovllm") is None, reason="needs nano-vllm (pip install 'gpumemd[nanovllm]')")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_NANOVLLM])])
def test_memory_moves_to_the_bursting_engine_and_the_tokens_are_those_of_a_static_split(backend: str) -> None:
    args = ["--cycles", "1", "--repeats", "1", "--grow-mib", "64"] + (["--phase-s", "3"] if backend == "host" else [])
    out = subprocess.run([sys.executable, str(BENCH), "--backend", backend, *args], capture_output=True, text=True, timeout=880)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0 and last.startswith("{"), f"bench failed ({out.returncode}):\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    print(last)  # the figures, for -rP
    f = json.loads(last)["figures"]
    if backend == "host":  # stand-ins: exact arithmetic
        assert f["sequences_differing_from_static"] == {"round": 0, "static": 0, "elastic": 0, "alone": 0}, f
    else:  # bf16: a batch of another size may flip a near-tie, never a clear lead (bench/burst.py, TIE_GAP)
        assert f["sequences_differing_from_static"]["round"] == 0, f  # the same batches as static
    assert f["sequences_parting_at_a_clear_margin"] == {"round": 0, "static": 0, "elastic": 0, "alone": 0}, f
    assert f["requests"] > 0 and f["elastic_requests"] == f["static_requests"]
    moves = f["elastic_moves"]
    assert moves["grows"] >= 2 and moves["shrinks"] >= 1, moves  # each engine grew; a neighbour gave back
    assert f["elastic_neighbour_grows"] >= 1, f  # a grow the daemon answered with what a neighbour gave back
    assert f["elastic_preempted"] == 0
    if backend == "host":
        # The stand-ins' long requests after a burst still run when the neighbour bursts, in
        # blocks the burst left anywhere: some sit past the bound asked and are moved down.
        # (nano-vllm's idle engine holds no live block when asked: on the H200 it gave back
        # free blocks only; test_nanovllm_follow moves live blocks on CUDA.)
        assert moves["blocks_moved"] > 0, moves
        # Both end at once: the bursting engine above the round's split, the other below it.
        ends = sorted(end for _, end in f["elastic_blocks"].values())
        assert ends[0] < f["blocks_per_engine"] < ends[1], f["elastic_blocks"]
