"""gpumem.integrations.cupy's bookkeeping, without CuPy or a GPU: a stand-in ``cupy``
module (the few names the allocator uses) and a stand-in arena over the real native slot
(gpumem.elastic), so what the slot counts is what a CUDA arena's slot would count."""

from __future__ import annotations

import gc
import subprocess
import sys
import types
from typing import Any

import pytest

from gpumem.elastic import ArenaAllocator
from gpumem.errors import ArenaOutOfMemory, InvalidArgument

MiB = 1 << 20
GRANULE = 2 * MiB


class FakeMemory:
    """cupy.cuda.UnownedMemory: keeps its owner alive, as CuPy's does."""

    def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class FakePointer:
    def __init__(self, mem: FakeMemory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class FakePool:
    """cupy.cuda.MemoryPool over a base allocator: caches every block it was given."""

    def __init__(self, allocator: Any) -> None:
        self.allocator, self.blocks = allocator, []

    def malloc(self, nbytes: int) -> FakePointer:
        pointer = self.allocator(nbytes)
        self.blocks.append(pointer)
        return FakePointer(pointer.mem, 0)

    def free_all_blocks(self) -> None:
        self.blocks.clear()


def fake_cupy(device: int = 0) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    state = {"allocator": "cupy's default pool"}
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        UnownedMemory=FakeMemory,
        MemoryPointer=FakePointer,
        MemoryPool=FakePool,
        runtime=types.SimpleNamespace(getDevice=lambda: device),
        get_allocator=lambda: state["allocator"],
        set_allocator=lambda allocator: state.update(allocator=allocator),
    )
    cupy.state = state  # type: ignore[attr-defined]
    return cupy


class FakeArena:
    """What the allocator reads of an Arena: its window, its backing, commit."""

    def __init__(self, reserved: int = 64 * MiB, committed: int = 0, backend: str = "cuda") -> None:
        self.name = "cupy"
        self.address = 1 << 40
        self.reserved = reserved
        self.granularity = GRANULE
        self.committed = committed
        self.released = False
        self.core = types.SimpleNamespace(backend=backend, device_ordinal=0, device=types.SimpleNamespace(uuid="GPU-fake"))
        self._allocator: ArenaAllocator | None = None

    def backed_ranges(self) -> list[tuple[int, int]]:
        return [(0, self.committed)] if self.committed else []

    def commit(self, nbytes: int) -> None:
        self.committed = nbytes
        self.allocator().update_backing()

    def allocator(self) -> ArenaAllocator:
        if self._allocator is None:
            self._allocator = ArenaAllocator(self, 0)  # type: ignore[arg-type]
        return self._allocator

    def _check_open(self) -> None:
        if self.released:
            raise InvalidArgument(f"arena '{self.name}' was released")


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


@pytest.fixture
def arena() -> Any:
    made = FakeArena(committed=16 * MiB)
    yield made
    if made._allocator is not None:
        made._allocator.retire(keep_slot=False)


def test_the_module_imports_without_cupy_and_names_it_when_asked() -> None:
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import gpumem.integrations.cupy as g\n"
        "assert 'cupy' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n    g.ArenaMalloc(None)\nexcept ImportError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "needs CuPy, which is not installed" in result.stdout


def test_blocks_land_in_the_arena_and_are_counted_until_cupy_lets_go(cupy: Any, arena: FakeArena) -> None:
    from gpumem.integrations.cupy import ArenaMalloc

    malloc = ArenaMalloc(arena)  # type: ignore[arg-type]
    a, b = malloc(3 * MiB), malloc(1000)
    spans = sorted((p.ptr, p.ptr + p.mem.size) for p in (a, b))
    assert arena.address <= spans[0][0] and spans[1][1] <= arena.address + arena.committed
    assert spans[0][1] <= spans[1][0], "two live blocks overlap"
    assert a.mem.device_id == 0 and a.mem.size == 3 * MiB
    usage = arena.allocator().usage()
    assert usage.in_use >= 3 * MiB + 1000 and usage.peak == usage.in_use
    del a
    gc.collect()
    after = arena.allocator().usage()
    assert after.in_use == usage.in_use - 3 * MiB, "a block CuPy dropped is still counted in use"
    assert after.peak == usage.peak  # the slot does not reuse space: the bytes return by trim or release
    del b


def test_unbacked_space_is_refused_with_the_reason(cupy: Any) -> None:
    from gpumem.integrations.cupy import ArenaMalloc

    bare = FakeArena(committed=0)
    try:
        with pytest.raises(ArenaOutOfMemory, match=r"arena 'cupy' cannot place a request of \d+ bytes: the space at offset 0 is not backed"):
            ArenaMalloc(bare)(1 * MiB)  # type: ignore[arg-type]
        full = FakeArena(reserved=4 * MiB, committed=4 * MiB)
        malloc = ArenaMalloc(full)  # type: ignore[arg-type]
        keep = malloc(3 * MiB)
        with pytest.raises(ArenaOutOfMemory, match=r"cannot hold a request of \d+ bytes: \d+ bytes are left of its 4194304-byte window"):
            malloc(2 * MiB)
        del keep
    finally:
        for made in (bare, locals().get("full")):
            if made is not None and made._allocator is not None:
                made._allocator.retire(keep_slot=False)


def test_an_elastic_arena_commits_as_cupy_asks(cupy: Any) -> None:
    from gpumem.integrations.cupy import ArenaMalloc

    elastic = FakeArena(reserved=64 * MiB, committed=0)
    try:
        elastic.allocator().set_elastic(step=4 * MiB, cap=32 * MiB)
        malloc = ArenaMalloc(elastic)  # type: ignore[arg-type]
        block = malloc(5 * MiB)
        assert elastic.committed == 8 * MiB and elastic.allocator().grows == 1
        with pytest.raises(ArenaOutOfMemory, match="past the arena's cap of 33554432 bytes"):
            malloc(40 * MiB)
        del block
    finally:
        if elastic._allocator is not None:
            elastic._allocator.retire(keep_slot=False)


def test_another_device_or_a_released_arena_gets_nothing(cupy: Any, arena: FakeArena, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumem.integrations.cupy import ArenaMalloc

    malloc = ArenaMalloc(arena)  # type: ignore[arg-type]
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 1)
    with pytest.raises(InvalidArgument, match=r"lives on cuda:0 \(GPU-fake\) but CuPy's current device is cuda:1"):
        malloc(MiB)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    arena.released = True
    with pytest.raises(InvalidArgument, match="was released"):
        malloc(MiB)
    assert arena.allocator().usage().peak == 0, "a refused request took space"


def test_a_host_backend_arena_is_refused(cupy: Any) -> None:
    from gpumem.integrations.cupy import ArenaMalloc

    with pytest.raises(InvalidArgument, match="host backend.*CuPy needs the CUDA backend"):
        ArenaMalloc(FakeArena(backend="host"))  # type: ignore[arg-type]


def test_use_arena_installs_cupys_pool_over_the_arena_and_puts_the_old_one_back(cupy: Any, arena: FakeArena) -> None:
    from gpumem.integrations.cupy import use_arena

    pool = use_arena(arena)  # type: ignore[arg-type]
    assert cupy.state["allocator"] == pool.malloc
    pointer = cupy.state["allocator"](2 * MiB)
    assert arena.address <= pointer.ptr < arena.address + arena.committed
    assert arena.allocator().usage().in_use >= 2 * MiB
    del pointer
    pool.uninstall()
    gc.collect()
    assert cupy.state["allocator"] == "cupy's default pool"
    assert arena.allocator().usage().in_use == 0, "blocks CuPy's pool cached are counted free once it lets go of them"
