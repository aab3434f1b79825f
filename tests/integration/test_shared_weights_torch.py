"""A model built on its primary's weights (gpumem.port.weights.build and
standby_model) with torch and a real daemon: the primary's parameters and buffers lie
in its model arena; the standby, in another process (tests/integration/weights_model.py:
a process maps an arena once, and the primary's session maps it here), builds the same
module class on the meta device, every parameter and buffer a view of the primary's
bytes (tied aliases and a buffer shared by two layers too), its empty plain tensors made
anew, and computes what the primary computes while holding no weight of its own. A
standby of another configuration is refused before it maps anything. nano-vllm's model
is not needed: the module in weights_model.py has the shapes of its kinds of state. On
the host backend the tensors are in host memory (torch on the CPU); on CUDA on the GPU.
Skipped without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gpumem
from conftest import child_env
from gpumem.port.weights import publish as publish_weights
from gpumemd_testkit import MiB

torch = pytest.importorskip("torch")
nn = torch.nn

from weights_model import CFG, Model, place, rope  # noqa: E402  (imports torch: after the skip)

STANDBY = Path(__file__).resolve().parent / "weights_model.py"


def test_the_standby_builds_on_the_primarys_weights_and_computes_the_same(daemon: Any, backend: str, runtime_dir: Path) -> None:
    torch.manual_seed(5)
    rope.cache_clear()
    primary = gpumem.connect(0, name="fo-primary", runtime_dir=runtime_dir)
    try:
        device = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
        arena = primary.create_arena("fo-primary-model", 64 * MiB)
        arena.commit(4 * MiB)
        with torch.device(device):
            model = Model(CFG)
            nn.init.normal_(model.embed)
            for layer in model.layers:
                nn.init.normal_(layer.proj, std=0.1)
        place(model, arena)
        publish_weights(primary, "fo", model, arena, "fo-standby")
        expected = runtime_dir / "expected.pt"
        torch.save(model(torch.arange(CFG["vocab"], device=device)).cpu(), expected)

        out = subprocess.run(
            [sys.executable, str(STANDBY), str(runtime_dir), backend, str(expected)],
            capture_output=True, text=True, timeout=180, env=child_env(runtime_dir),
        )
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        assert "loaded" not in seen, seen  # the weights were there already: it loaded nothing
        assert seen["put_back"]
        assert (seen["read_only"], seen["address"]) == (True, arena.address)
        assert (seen["state"], seen["all_inside"]) == (2 + 2 * 3, True)
        assert seen["tied"]
        assert seen["k_cache"] == [str(device), 0]
        assert seen["equal"]
        assert "fo-standby" in seen["attached"]["fo-primary-model"]
        assert seen["standby_owns"] == []  # every byte it computes with is the primary's
        assert re.search(r"embed is parameter float32 \[96, 32\], the model's parameter float32 \[96, 16\]", seen["other_config"])
    finally:
        primary.close()
