"""The engine port's small parts (gpumem.port): what an engine is asked (Settings), its
KV layout's keywords, the seam check, that nano-vllm's adapter is an EngineAdapter; a
model its caller built moved into the model arena, the step gate, and EnginePort's
sleep, round and start-up over a stand-in EngineMemory (no daemon)."""

from __future__ import annotations

import contextlib
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpumem.errors import InvalidArgument
from gpumem.integrations.nanovllm import NanoVllm
from gpumem.port import STANDBY_ROOM, EngineAdapter, EnginePort, KvLayout, SeamMissing, Settings, engine_port, require_seams, weights
from gpumem.port.gate import StepGate, StepTimeout


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


# ---------------------------------------------------------------------- a model its caller built, moved in


class FakeTensor:
    """A tensor as weights.move_in sees it: ``data`` replaced by a clone made where the
    arena routes allocations."""

    def __init__(self, arena: FakeArena, cuda: bool = True, numel: int = 4) -> None:
        self.arena, self.is_cuda, self._numel = arena, cuda, numel
        self.data: object = self  # as torch's: the same storage, no autograd

    def clone(self) -> tuple[str, int]:
        self.arena.clones.append((id(self), self.arena.routing))
        return ("in arena", id(self))

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 2


class FakeArena:
    def __init__(self) -> None:
        self.routing = False
        self.clones: list[tuple[int, bool]] = []

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        self.routing = True
        try:
            yield
        finally:
            self.routing = False


def model_of(modules: dict[str, tuple[dict[str, FakeTensor], dict[str, FakeTensor]]]) -> Any:
    mods = [types.SimpleNamespace(_parameters=p, _buffers=b) for p, b in modules.values()]
    named = lambda which: [(f"{m}.{n}", t) for m, pb in modules.items() for n, t in pb[which].items()]  # noqa: E731
    return types.SimpleNamespace(modules=lambda: mods, named_parameters=lambda: named(0), named_buffers=lambda: named(1))


def test_a_model_its_caller_built_moves_into_the_arena_each_tensor_once() -> None:
    arena = FakeArena()
    embed, rope = FakeTensor(arena), FakeTensor(arena, numel=2)
    model = model_of({"embed": ({"weight": embed}, {"rope": rope}), "head": ({"weight": embed}, {})})  # a tied weight
    assert weights.move_in(model, arena) == (4 + 2) * 2  # type: ignore[arg-type]
    assert sorted(arena.clones) == sorted([(id(embed), True), (id(rope), True)])  # once each, inside allocating()
    assert embed.data == ("in arena", id(embed)) and rope.data == ("in arena", id(rope))


def test_a_model_not_on_the_device_is_refused_naming_its_tensors() -> None:
    arena = FakeArena()
    model = model_of({"embed": ({"weight": FakeTensor(arena)}, {"rope": FakeTensor(arena, cuda=False)})})
    with pytest.raises(InvalidArgument, match=r"1 of the model's tensors are not on a CUDA device \(embed.rope\)"):
        weights.move_in(model, arena)  # type: ignore[arg-type]
    assert arena.clones == []  # nothing moved


# ---------------------------------------------------------------------- the step gate


def wait_until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.001)


def test_closing_the_gate_pauses_the_loop_before_it_waits_for_the_step_under_way() -> None:
    """The loop asks paused() between steps: raised while the closer still waits for the
    step under way, the loop takes no next step and the closer gets in (a lock alone
    starved it: the loop took the lock again at once)."""
    gate, inside = StepGate("e"), threading.Event()

    def close() -> None:
        with gate.closed():
            inside.set()

    with gate.step():
        closer = threading.Thread(target=close)
        closer.start()
        wait_until(gate.paused)  # raised while the step is under way
        assert not inside.is_set()
    assert inside.wait(10)
    closer.join(10)
    assert not gate.paused()  # lowered once the closer is done


def test_a_step_that_does_not_end_is_named_and_the_pause_lowered() -> None:
    gate, stepping, done = StepGate("e", wait_s=0.05), threading.Event(), threading.Event()

    def loop() -> None:
        with gate.step():
            stepping.set()
            done.wait(10)

    stepper = threading.Thread(target=loop, name="generation-loop")
    stepper.start()
    assert stepping.wait(10)
    try:
        with pytest.raises(StepTimeout, match=r"engine 'e': its step on thread 'generation-loop' did not end within 0.05s"):
            with gate.closed():
                pass
        assert not gate.paused()
    finally:
        done.set()
        stepper.join(10)


# ---------------------------------------------------------------------- EnginePort without a daemon


class FakeMemory:
    """EngineMemory as EnginePort calls it, with no daemon: what it was asked, in order."""

    def __init__(self, name: str, device: object, **_: object) -> None:
        self.name, self.calls, self.asleep = name, [], []  # type: ignore[var-annotated]
        self.kv: Any = types.SimpleNamespace(blocks=8)
        self.prefix = None

    def sleep(self, *tags: str, drop: set[str]) -> None:
        self.calls.append(("sleep", tags, sorted(drop)))
        self.asleep = list(tags) or ["weights", "graphs", "kv"]

    def graphs_captured(self, graphs: dict[str, object]) -> dict[str, object]:
        self.calls.append(("captured", graphs))
        return graphs

    def start_kv_commit(self, **figures: object) -> Any:
        self.calls.append(("round", figures))
        return types.SimpleNamespace(wait=lambda: 7)


class FakeEngine:
    def __init__(self, used: list[int]) -> None:
        self.used, self.calls = used, []  # type: ignore[var-annotated]

    def used_blocks(self) -> list[int]:
        return self.used

    def forget_prefix_cache(self) -> None:
        self.calls.append("forget")

    def synchronize(self) -> None:
        self.calls.append("synchronize")


def fake_port(monkeypatch: pytest.MonkeyPatch, used: list[int], reserved: int, **options: Any) -> tuple[EnginePort, FakeEngine]:
    monkeypatch.setattr(engine_port, "EngineMemory", FakeMemory)
    engine = FakeEngine(used)
    port = EnginePort(engine, Settings("e", follow=False, **options))  # type: ignore[arg-type]
    port.layout = KvLayout(2, (4, 2, 8), 2, "bf16", reserved_blocks=reserved)
    return port, engine


def test_sleep_leaves_the_layouts_reserved_blocks_out_of_the_blocks_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    port, engine = fake_port(monkeypatch, [0, 1], reserved=2)  # transformers' trash blocks, in use for good
    port.sleep()
    assert engine.calls == ["forget", "synchronize"] and port.mem.calls == [("sleep", (), ["kv"])]  # type: ignore[attr-defined]
    port, engine = fake_port(monkeypatch, [0, 1, 5], reserved=2)
    with pytest.raises(InvalidArgument, match="has 1 KV blocks in use"):
        port.sleep()
    assert port.mem.calls == []  # type: ignore[attr-defined]


def test_sleep_waits_for_the_step_under_way_and_the_loop_steps_nothing_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = fake_port(monkeypatch, [], reserved=0)
    asleep = threading.Event()
    with port.step(busy=False):
        sleeper = threading.Thread(target=lambda: (port.sleep(), asleep.set()))
        sleeper.start()
        wait_until(lambda: not port.may_step())
        assert port.mem.calls == []  # type: ignore[attr-defined]  # not in the middle of the step
    assert asleep.wait(10)
    sleeper.join(10)
    assert not port.may_step() and port.mem.asleep  # asleep now: the loop still steps nothing


def test_the_round_commits_a_block_past_the_reserved_ones_and_built_ends_the_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = fake_port(monkeypatch, [], reserved=2, min_blocks=1)
    got: list[int] = []
    assert port.built(got.append, {"g": 1}) == {"g": 1}
    assert got == [7]  # the round's blocks, to the engine's block manager
    calls = port.mem.calls  # type: ignore[attr-defined]
    assert [c[0] for c in calls] == ["captured", "round"] and calls[1][1]["min_blocks"] == 3
    port, _ = fake_port(monkeypatch, [], reserved=0, min_blocks=1)
    port.started()
    assert port.mem.calls[-1][1]["min_blocks"] == 1  # type: ignore[attr-defined]
