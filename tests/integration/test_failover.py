"""bench/failover.py, short: a primary engine killed with -9 mid-stream and its standby,
which reserved the KV windows and built its arrays there before, adopting the KV pool and
the prefix directory. Whatever the timings: the standby's tokens are the primary's for
the same prompts (its arrays, built before the adoption, read the adopted rows), the
prompt tokens served before come from the adopted cache, and nothing is left accounted
once it closed. And the same with gpumemd killed -9 during the failover (before it saw
the primary end) and restarted from its fd store: the restarted daemon orphans the dead
primary's group at once, not after the restart grace (30 s). On the host, stand-in
engines; on CUDA, nano-vllm, whose reference tokens are the primary's second pass over
the prompts (their full blocks from its prefix cache, as the standby's are)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT

BENCH = ROOT / "bench" / "failover.py"
NEEDS_NANOVLLM = pytest.mark.skipif(importlib.util.find_spec("nanovllm") is None, reason="needs nano-vllm (pip install 'gpumemd[nanovllm]')")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kill_daemon", [False, True], ids=["gpumemd-up", "gpumemd-killed"])
@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=[pytest.mark.gpu, NEEDS_NANOVLLM])])
def test_the_standby_serves_the_primarys_tokens_from_the_adopted_cache(backend: str, kill_daemon: bool) -> None:
    args = ["--prefixes", "4", "--per-prefix", "3", "--new-tokens", "12", *(["--kill-daemon"] if kill_daemon else [])]
    out = subprocess.run([sys.executable, str(BENCH), "--backend", backend, *args], capture_output=True, text=True, timeout=880)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0 and last.startswith("{"), f"bench failed ({out.returncode}):\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    print(last)  # the figures, for -rP
    f = json.loads(last)["figures"]
    timeline = [f[f"kill_to_{key}_s"] for key in ("adopted", "woke", "seeded", "first_step", "first_token")]
    print("kill -> adopted, woke, seeded, first step, first token (s):", [round(t, 4) for t in timeline],
          f"wake {f['wake_s']:.4f} s, first step {f['first_step_s']:.4f} s; the standby before promotion: "
          f"{f['standby_own_bytes'] / 2**20:.0f} MiB on the device, {f['standby_host_bytes'] / 2**20:.0f} MiB in host memory")
    assert timeline == sorted(timeline), f  # each part after the one before
    # bf16 on CUDA: a near-tie may part, never a clear lead (token_margins.TIE_GAP); stand-ins: exact
    assert (f["tokens_identical"] or backend == "cuda") and f["sequences_parting_at_a_clear_margin"] == 0, f"{json.dumps(f)}\n{out.stdout[-3000:]}"
    assert f["accounting_exact"], f"{json.dumps(f)}\n{out.stdout[-3000:]}"
    assert f["prompt_tokens_hit"] == f["prompt_tokens"] - 12, f  # every full block of every prompt: all but its last token
    assert f["directory_corrupt"] == 0 and f["directory_trusted"] > 0
    if kill_daemon:  # the restarted daemon held the accounting at the end, and nobody waited out its grace
        assert f["daemon_killed"] and f["daemon_generation"] == 1 and f["kill_to_first_token_s"] < 10.0, f
    # Asleep before its promotion: its graph pool in host memory, its model arena dropped
    # (the stand-in's two arenas, 16 MiB each, as nano-vllm's are); woken after the adoption.
    assert f["standby_asleep"] == ["weights", "graphs"] and f["standby_host_bytes"] > 0 and f["wake_s"] > 0, f
    if backend == "host":
        assert f["standby_host_bytes"] == 16 << 20 and f["standby_wake_bytes"] == 32 << 20, f
        assert 0 < f["standby_own_bytes"] <= 66 << 20  # its placeholder; the weights it maps are the primary's
    else:
        assert f["standby_own_bytes"] <= 1 << 30, f  # the target: 1 GiB beyond the shared weights
