"""CuPy on a gpumem arena: a CuPy process takes its GPU memory from gpumemd.

    import cupy, gpumem
    from gpumem.integrations import cupy as gpumem_cupy

    session = gpumem.connect(0, name="cupy-worker")
    arena = session.create_arena("cupy", 8 << 30).set_elastic()   # commits as CuPy asks
    pool = gpumem_cupy.use_arena(arena)         # cupy.cuda.set_allocator(pool.malloc)
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    offset = x.data.ptr - arena.address         # where x lies in the arena
    token = arena.share("torch-worker")

In the torch process, the same bytes: ``session.attach_arena("cupy", token).view(offset,
x.nbytes)`` through ``torch.from_dlpack`` (see gpumem.views).

CuPy's own ``MemoryPool`` (its block cache, splitting and stream ordering) sits on the
arena's native slot (gpumem.elastic), as torch's caching allocator does for
``arena.allocating()``. The slot hands out the arena's window from the bottom up and
serves only backed space; an elastic arena commits on demand. A block CuPy frees goes
back to its pool and is reused there; the daemon gets the bytes back when the arena is
trimmed or released, and when the process dies, as from any client. Importing this module
imports no CuPy; ``use_arena`` and ``ArenaMalloc`` do.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from gpumem.errors import ArenaOutOfMemory, InvalidArgument

if TYPE_CHECKING:
    from gpumem.arena import Arena
    from gpumem.elastic import ArenaAllocator


def import_cupy(feature: str) -> Any:
    try:
        import cupy
    except ImportError:
        raise ImportError(f"{feature} needs CuPy, which is not installed (pip install cupy-cuda12x, or the wheel for your CUDA)") from None
    return cupy


class ArenaMalloc:
    """CuPy's base allocator over one arena: ``malloc(nbytes)`` returns a
    ``cupy.cuda.MemoryPointer`` into the arena; the block is counted free (the arena's
    ``usage().in_use``) when CuPy drops its last reference to it."""

    def __init__(self, arena: Arena) -> None:
        cupy = import_cupy("a CuPy allocator on gpumem")
        if arena.core.backend != "cuda" or arena.core.device_ordinal is None:
            raise InvalidArgument(
                f"arena '{arena.name}' lives in host shared memory (host backend): CuPy needs the CUDA backend"
            )
        self.cupy = cupy
        self.arena = arena
        self.device = arena.core.device_ordinal
        self.allocator: ArenaAllocator = arena.allocator()
        # CuPy's pool may allocate from any thread; the slot's failure counters are read
        # right after the call that failed.
        self._lock = threading.Lock()

    def malloc(self, nbytes: int) -> Any:
        self.arena._check_open()
        current = self.cupy.cuda.runtime.getDevice()
        if current != self.device:
            raise InvalidArgument(
                f"arena '{self.arena.name}' lives on cuda:{self.device} ({self.arena.core.device.uuid}) but CuPy's "
                f"current device is cuda:{current}; allocate inside cupy.cuda.Device({self.device})"
            )
        slot = self.allocator.slot
        with self._lock:
            address = slot.alloc(nbytes) if nbytes else self.arena.address
            if not address:
                stats = slot.stats()
                raise ArenaOutOfMemory(self.allocator.refusal(stats), {"requested": stats.last_failed, "available": stats.largest_free})
        owner = _Block(self, address, nbytes)
        memory = self.cupy.cuda.UnownedMemory(address, nbytes, owner, self.device)
        return self.cupy.cuda.MemoryPointer(memory, 0)

    __call__ = malloc

    def _free(self, address: int, nbytes: int) -> None:
        slot = self.allocator.slot
        if nbytes and slot.index >= 0:  # a released arena's slot counts nothing
            slot.free(address, nbytes)


class _Block:
    """What CuPy's UnownedMemory keeps alive for one allocation; when CuPy lets go of it,
    the slot counts the bytes free."""

    __slots__ = ("__weakref__",)

    def __init__(self, malloc: ArenaMalloc, address: int, nbytes: int) -> None:
        weakref.finalize(self, malloc._free, address, nbytes)


class CupyPool:
    """The arena as this process's CuPy allocator: CuPy's ``MemoryPool`` over an
    ``ArenaMalloc`` (``use_arena`` makes one)."""

    def __init__(self, arena: Arena) -> None:
        self.base = ArenaMalloc(arena)
        self.pool: Any = self.base.cupy.cuda.MemoryPool(self.base.malloc)
        self._previous: Any = None

    def malloc(self, nbytes: int) -> Any:
        return self.pool.malloc(nbytes)

    def install(self) -> CupyPool:
        self._previous = self.base.cupy.cuda.get_allocator()
        self.base.cupy.cuda.set_allocator(self.malloc)
        return self

    def uninstall(self) -> None:
        """CuPy's allocator as it was before ``install``; blocks CuPy cached go back to
        the slot's count (arrays still alive keep their bytes)."""
        self.base.cupy.cuda.set_allocator(self._previous)
        self.pool.free_all_blocks()


def use_arena(arena: Arena) -> CupyPool:
    """Every CuPy allocation of this process from ``arena`` from now on
    (``cupy.cuda.set_allocator``); ``uninstall()`` on the result puts the previous
    allocator back."""
    return CupyPool(arena).install()
