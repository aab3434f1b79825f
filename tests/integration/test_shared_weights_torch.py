"""A model built on its primary's weights (gpumem.integrations.nanovllm_weights.build and
standby_model) with torch and a real daemon: the primary's parameters and buffers lie
in its model arena; the standby, in another session, builds the same module class on
the meta device, every parameter and buffer a view of the primary's bytes (tied aliases
and a buffer shared by two layers too), its empty plain tensors made anew, and computes
what the primary computes while holding no weight of its own. A standby of another
configuration is refused before it maps anything. nano-vllm's model is not needed: the
module below has the shapes of its kinds of state. On the host backend the tensors are
in host memory (torch on the CPU); on CUDA on the GPU. Skipped without torch."""

from __future__ import annotations

import functools
import types
from pathlib import Path
from typing import Any

import pytest

import gpumem
from gpumem.integrations.nanovllm_weights import WeightMapError, standby_model
from gpumem.integrations.nanovllm_weights import publish as publish_weights
from gpumemd_testkit import MiB

torch = pytest.importorskip("torch")
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


def test_the_standby_builds_on_the_primarys_weights_and_computes_the_same(daemon: Any, backend: str, runtime_dir: Path) -> None:
    torch.manual_seed(5)
    rope.cache_clear()
    primary = gpumem.connect(0, name="fo-primary", runtime_dir=runtime_dir)
    standby = gpumem.connect(0, name="fo-standby", runtime_dir=runtime_dir)
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
        ids = torch.arange(CFG["vocab"], device=device)
        expected = model(ids)

        rope.cache_clear()  # the standby is another process: its own rope, built on meta
        def load(model: Any, path: str) -> None:
            pytest.fail("the standby loaded weights")

        runner = types.SimpleNamespace(Qwen3ForCausalLM=Model, load_model=load)
        with standby_model(runner, standby, "fo") as shared:
            built = runner.Qwen3ForCausalLM(CFG)
            runner.load_model(built, "/nowhere")  # the weights are there already: loads nothing
        assert runner.Qwen3ForCausalLM is Model and runner.load_model is load  # put back
        assert shared.arena.read_only and shared.arena.address == arena.address
        inside = range(arena.address, arena.address + arena.reserved)
        state = [*built.named_parameters(remove_duplicate=False), *built.named_buffers(remove_duplicate=False)]
        assert len(state) == 2 + 2 * 3 and all(t.data_ptr() in inside and not t.is_meta for _, t in state)
        assert built.head.data_ptr() == built.embed.data_ptr()  # the tied head: one place
        assert built.layers[0].k_cache.device == device and built.layers[0].k_cache.numel() == 0  # made anew, empty
        assert torch.equal(built(ids), expected)
        with gpumem.connect(0, name="fo-status", runtime_dir=runtime_dir) as look:
            assert [a.name for a in look.status().arenas if a.owner == "fo-standby"] == []  # every byte it computes with is the primary's
        standby.close()

        standby = gpumem.connect(0, name="fo-standby", runtime_dir=runtime_dir)  # again, built to another config
        runner = types.SimpleNamespace(Qwen3ForCausalLM=Model, load_model=None)
        with pytest.raises(WeightMapError, match=r"embed is parameter float32 \[96, 32\], the model's parameter float32 \[96, 16\]"):
            with standby_model(runner, standby, "fo"):
                runner.Qwen3ForCausalLM(dict(CFG, hidden=16))
    finally:
        for session in (standby, primary):
            if not session.closed:
                session.close()
