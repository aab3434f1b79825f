"""The decode-loop example on the CUDA backend: two engine processes capture decode
graphs (memcpy nodes included) on placeholder KV, join one round, and serve from real
memory at the same addresses; the round's figures account for the measured free memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "decode_loop.py"
GRANULARITY = 2 << 20


@pytest.mark.gpu
def test_decode_loop_two_engines_one_round(daemon_factory, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory("cuda")
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--engines", "2", "--layers", "32", "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(runtime_dir),
    )
    assert out.returncode == 0, f"example failed:\n{out.stdout}\n{out.stderr}\ndaemon:\n{daemon.log()}"
    engines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"engine"')]
    assert len(engines) == 2 and all(e["ok"] for e in engines), out.stdout
    assert engines[0]["round"] == engines[1]["round"], "both engines must be sized by one round"
    budget = engines[0]["budget"]
    committed = sum(e["kv_bytes"] for e in engines)
    assert budget["committed"] == committed
    # Every byte of the measured free memory is accounted for: the reserve, the engines'
    # headroom and their KV, up to the rounding the split leaves (about one granule per
    # buffer and one token per pool).
    slack = sum(e["buffers"] * GRANULARITY + e["bytes_per_token"] for e in engines)
    unused = budget["free"] - budget["reserve"] - budget["headroom"] - committed
    assert 0 <= unused <= slack, (budget, committed, slack)
    # weights 1 and 2: the second engine got about twice the first's share above minimums
    assert engines[1]["tokens"] > 1.8 * engines[0]["tokens"], [e["tokens"] for e in engines]
