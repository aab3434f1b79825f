"""A nano-vllm primary's weights for its standby (gpumem.port.weights)
through a real daemon, without torch: the primary publishes the map of a model whose
tensors lie in its model arena and grants both arenas read-only to the standby's name;
the standby, in another process (a process maps an arena once: the primary's session
maps it here), reads the map, lets go of it, and maps the model arena at the primary's
address, for reading only. Another client, or a standby of a group nobody published
for, is told what to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gpumem
from conftest import child_env
from gpumem.errors import NotFound, PermissionDenied
from gpumem.port.weights import attach, describe, encode, map_arena_name, publish
from gpumemd_testkit import MiB
from nanovllm_fakes import FakeModel, FakeTensor

# The standby's side, in a process of its own: attaches, checks the map it read against
# the primary's (passed in, encoded), and answers one JSON line.
STANDBY = """
import json, sys
import gpumem
from gpumem.errors import PermissionDenied
from gpumem.port.weights import attach, decode, map_arena_name
with gpumem.connect(0, name="fo-standby", runtime_dir=sys.argv[1]) as standby:
    shared = attach(standby, "fo")
    try:
        shared.arena.write(2 << 20, b"\\0")
        write = "allowed"
    except PermissionDenied:
        write = "PermissionDenied"
    print(json.dumps({
        "map_matches": shared.map == decode(bytes.fromhex(sys.argv[2])),
        "shared_bytes": shared.map.shared_bytes(),
        "address": shared.arena.address,
        "read_only": shared.arena.read_only,
        "bytes": shared.arena.read(2 << 20, 4096).hex(),
        "write": write,
        "attached": {a.name: a.attached for a in standby.status().arenas},
    }))
"""


def test_the_standby_maps_the_primarys_model_arena_read_only_through_the_published_map(daemon: Any, runtime_dir: Path) -> None:
    primary = gpumem.connect(0, name="fo-primary", runtime_dir=runtime_dir)
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
        # Refused by the daemon, before anything is mapped: these may ask in this process.
        with pytest.raises(PermissionDenied, match="weights_to='fo-other'"):
            attach(other, "fo")  # granted to the standby's name only
        with pytest.raises(NotFound, match="enable\\(retain='nobody'"):
            attach(other, "nobody")
        expected = encode(describe(model, arena)).hex()  # type: ignore[arg-type]
        out = subprocess.run(
            [sys.executable, "-c", STANDBY, str(runtime_dir), expected],
            capture_output=True, text=True, timeout=120, env=child_env(runtime_dir),
        )
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        assert seen["map_matches"]
        assert seen["shared_bytes"] == 64 * 32 * 2 + 32 * 4
        assert (seen["address"], seen["read_only"]) == (arena.address, True)
        assert bytes.fromhex(seen["bytes"]) == bytes(range(256)) * 16
        assert seen["write"] == "PermissionDenied"
        assert "fo-standby" in seen["attached"]["fo-primary-model"]
        assert "fo-standby" not in seen["attached"][map_arena_name("fo")]  # the map was read and let go
        assert arena.read(2 * MiB, 4096) == bytes(range(256)) * 16  # the primary's mapping is its own still
    finally:
        for s in (other, primary):
            s.close()
