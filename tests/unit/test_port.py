"""The engine port's small parts (gpumem.port): what an engine is asked (Settings), its
KV layout's keywords, the seam check, and that nano-vllm's adapter is an EngineAdapter."""

from __future__ import annotations

import types

import pytest

from gpumem.errors import InvalidArgument
from gpumem.integrations.nanovllm import NanoVllm
from gpumem.port import STANDBY_ROOM, EngineAdapter, KvLayout, SeamMissing, Settings, require_seams


def test_a_retaining_primarys_round_leaves_room_for_its_standby() -> None:
    assert Settings("a").round_headroom == 512 << 20
    assert Settings("a", retain="g").round_headroom == (512 << 20) + STANDBY_ROOM
    assert Settings("a", retain="g", standby_room=0, headroom_bytes=1 << 20).round_headroom == 1 << 20


@pytest.mark.parametrize("options", [{"weights_to": "b"}, {"share_weights": True}, {"retain": "g", "standby": ("g", "s")}])
def test_settings_that_contradict_each_other_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        Settings("a", **options)  # type: ignore[arg-type]


def test_a_layout_gives_the_kv_cache_its_keywords() -> None:
    layout = KvLayout(28, (256, 8, 128), 2, "bf16", max_blocks=4096)
    assert layout.describe() == {"layers": 28, "block_shape": (256, 8, 128), "itemsize": 2, "combined": False}  # max_blocks apart


def test_a_missing_seam_is_named_with_the_version_installed() -> None:
    owner = types.SimpleNamespace(__name__="engine.runner", step=None)
    require_seams("no-such-engine-dist", owner, ["step"], written_for="1.0")
    with pytest.raises(SeamMissing, match=r"no-such-engine-dist \(version unknown.*engine.runner has no warmup, capture.*written for no-such-engine-dist 1.0"):
        require_seams("no-such-engine-dist", owner, ["step", "warmup", "capture"], written_for="1.0")


def test_nano_vllms_adapter_is_an_engine_adapter() -> None:
    adapter: EngineAdapter = NanoVllm(None, object, lambda n: n)  # mypy over client/ checks it where the integration builds its EnginePort
    assert callable(adapter.copy_blocks)
