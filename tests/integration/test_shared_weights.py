"""A nano-vllm primary's weights for its standby (gpumem.integrations.nanovllm_weights)
through a real daemon, without torch: the primary publishes the map of a model whose
tensors lie in its model arena and grants both arenas read-only to the standby's name;
the standby reads the map, lets go of it, and maps the model arena at the primary's
address, for reading only. Another client, or a standby of a group nobody published
for, is told what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import gpumem
from gpumem.errors import NotFound, PermissionDenied
from gpumem.integrations.nanovllm_weights import attach, describe, map_arena_name, publish
from gpumemd_testkit import MiB, status
from nanovllm_fakes import FakeModel, FakeTensor


def test_the_standby_maps_the_primarys_model_arena_read_only_through_the_published_map(daemon: Any, runtime_dir: Path) -> None:
    primary = gpumem.connect(0, name="fo-primary", runtime_dir=runtime_dir)
    standby = gpumem.connect(0, name="fo-standby", runtime_dir=runtime_dir)
    other = gpumem.connect(0, name="fo-other", runtime_dir=runtime_dir)
    try:
        arena = primary.create_arena("fo-primary-model", 64 * MiB)
        arena.commit(8 * MiB)
        arena.write(2 * MiB, bytes(range(256)) * 16)
        model = FakeModel({
            "embed.weight": FakeTensor(arena.address + 2 * MiB, "torch.bfloat16", (64, 32), (32, 1)),
            "norm.weight": FakeTensor(arena.address + 4 * MiB, "torch.float32", (32,), (1,)),
        })
        publish(primary, "fo", model, arena, "fo-standby")
        with pytest.raises(PermissionDenied, match="weights_to='fo-other'"):
            attach(other, "fo")  # granted to the standby's name only
        with pytest.raises(NotFound, match="enable\\(retain='nobody'"):
            attach(standby, "nobody")
        shared = attach(standby, "fo")
        assert shared.map == describe(model, arena)  # type: ignore[arg-type]
        assert shared.map.shared_bytes() == 64 * 32 * 2 + 32 * 4
        assert (shared.arena.address, shared.arena.read_only) == (arena.address, True)
        assert shared.arena.read(2 * MiB, 4096) == bytes(range(256)) * 16
        with pytest.raises(PermissionDenied):
            shared.arena.write(2 * MiB, b"\0")
        attached = {a["name"]: a["attached"] for a in status(runtime_dir)["arenas"]}
        assert "fo-standby" in attached["fo-primary-model"]
        assert "fo-standby" not in attached[map_arena_name("fo")]  # the map was read and let go
    finally:
        for s in (other, standby, primary):
            s.close()
