"""The model of test_shared_weights_torch (the shapes of nano-vllm's kinds of state: tied
parameters, a buffer two layers share, empty plain tensors), and the standby's side of
that test, run in a process of its own (a process maps an arena once, and the primary's
session maps the model arena in the test's process):

    python tests/integration/weights_model.py RUNTIME_DIR BACKEND EXPECTED

connects as 'fo-standby', builds the model on the weights the primary published for
group 'fo', computes it on every token id and compares with the primary's output (saved
with torch.save in EXPECTED), then builds a standby of another configuration, which is
refused; prints one JSON object of what it saw."""

from __future__ import annotations

import functools
import json
import sys
import types
from typing import Any

import torch

import gpumem
from gpumem.integrations.nanovllm import NanoVllm
from gpumem.port.weights import WeightMapError, standby_model

nn = torch.nn


@functools.lru_cache(1)
def rope(dim: int, positions: int) -> Any:
    """One module for every layer, as nano-vllm's get_rope gives."""
    return Rope(dim, positions)


class Rope(nn.Module):  # type: ignore[misc]
    def __init__(self, dim: int, positions: int) -> None:
        super().__init__()
        t = torch.arange(positions, dtype=torch.float32)[:, None] * torch.arange(1, dim + 1, dtype=torch.float32)
        self.register_buffer("cache", torch.cat((t.cos(), t.sin()), dim=-1), persistent=False)


class Layer(nn.Module):  # type: ignore[misc]
    def __init__(self, hidden: int, positions: int) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.empty(hidden, hidden))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.rope = rope(hidden // 2, positions)
        self.k_cache = self.v_cache = torch.tensor([])  # the engine sets these later

    def forward(self, x: Any, pos: Any) -> Any:
        return (x @ self.proj.t()) * self.norm + self.rope.cache[pos]


class Model(nn.Module):  # type: ignore[misc]
    def __init__(self, cfg: dict[str, int]) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.empty(cfg["vocab"], cfg["hidden"]))
        self.layers = nn.ModuleList(Layer(cfg["hidden"], cfg["positions"]) for _ in range(2))
        self.head = nn.Parameter(torch.empty(cfg["vocab"], cfg["hidden"]))
        self.head.data = self.embed.data  # tied, as nano-vllm ties a head

    def forward(self, ids: Any) -> Any:
        x = self.embed[ids]
        for layer in self.layers:
            x = layer(x, ids)
        return x @ self.head.t()


CFG = {"vocab": 96, "hidden": 32, "positions": 96}


def place(model: Any, arena: Any) -> None:
    """Put every parameter and buffer in ``arena`` (what loading inside
    EngineMemory.running() does on CUDA), a tied alias where its twin went."""
    at, placed = 0, {}
    for kind in ("parameters", "buffers"):
        for name, t in list(getattr(model, f"named_{kind}")(remove_duplicate=False)):
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            key = t.data_ptr()
            if key not in placed:
                nbytes = t.numel() * t.element_size()
                placed[key] = arena.tensor(at, (nbytes,), torch.uint8).view(t.dtype).view(t.shape)
                placed[key].copy_(t)
                at += -(-nbytes // 4096) * 4096
            mapped = placed[key]
            setattr(module, leaf, nn.Parameter(mapped, requires_grad=False) if kind == "parameters" else mapped)


def main() -> int:
    runtime_dir, backend, expected_path = sys.argv[1:4]
    device = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    expected = torch.load(expected_path, map_location=device)
    ids = torch.arange(CFG["vocab"], device=device)
    seen: dict[str, Any] = {}

    def load(model: Any, path: str) -> None:
        seen["loaded"] = path  # the standby loaded weights: the test fails on it

    standby = gpumem.connect(0, name="fo-standby", runtime_dir=runtime_dir)
    try:
        runner = types.SimpleNamespace(Qwen3ForCausalLM=Model, load_model=load)  # nano-vllm's model_runner module, as far as its adapter reroutes it
        with standby_model(NanoVllm(runner, object, lambda n: n), standby, "fo") as shared:
            built = runner.Qwen3ForCausalLM(CFG)
            runner.load_model(built, "/nowhere")  # the weights are there already: loads nothing
        seen["put_back"] = runner.Qwen3ForCausalLM is Model and runner.load_model is load
        seen["read_only"], seen["address"] = shared.arena.read_only, shared.arena.address
        inside = range(shared.arena.address, shared.arena.address + shared.arena.reserved)
        state = [*built.named_parameters(remove_duplicate=False), *built.named_buffers(remove_duplicate=False)]
        seen["state"] = len(state)
        seen["all_inside"] = all(t.data_ptr() in inside and not t.is_meta for _, t in state)
        seen["tied"] = built.head.data_ptr() == built.embed.data_ptr()  # the tied head: one place
        k_cache = built.layers[0].k_cache  # made anew, empty
        seen["k_cache"] = [str(k_cache.device), k_cache.numel()]
        seen["equal"] = bool(torch.equal(built(ids), expected))
        with gpumem.connect(0, name="fo-status", runtime_dir=runtime_dir) as look:
            seen["standby_owns"] = [a.name for a in look.status().arenas if a.owner == "fo-standby"]
            seen["attached"] = {a.name: a.attached for a in look.status().arenas}
        standby.close()

        standby = gpumem.connect(0, name="fo-standby", runtime_dir=runtime_dir)  # again, built to another config
        runner = types.SimpleNamespace(Qwen3ForCausalLM=Model, load_model=None)
        try:
            with standby_model(NanoVllm(runner, object, lambda n: n), standby, "fo"):
                runner.Qwen3ForCausalLM(dict(CFG, hidden=16))
            seen["other_config"] = "built"
        except WeightMapError as exc:
            seen["other_config"] = str(exc)
    finally:
        if not standby.closed:
            standby.close()
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
