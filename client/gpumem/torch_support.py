"""torch on gpumem arenas: one native allocator slot, one CUDAPluggableAllocator and one
``torch.cuda.MemPool`` per arena, and thread-local routing into it.

torch is optional: nothing in gpumem imports this module until an arena is asked for
a pool. Features are detected, not inferred from version numbers; where torch lacks
one, the error names the feature and what it needs.

The slot covers the arena's whole window. It serves a request only on backed space
(committed or placeholder) unless the calling thread is laying out virtual-only
tensors, because a kernel that touches unmapped space kills the CUDA context. torch's
caching allocator sits on top: it asks the slot for segments and keeps freed blocks
in the pool, so the memory returns by decommit or release, never by ``del``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gpumem.allocator import library_path, virtual_only
from gpumem.errors import ArenaOutOfMemory, InvalidArgument, TorchFeatureMissing

if TYPE_CHECKING:
    from gpumem.arena import Arena

# Allocators and pools live as long as the process: a tensor's block can stay cached
# in a pool after its arena's user let go of it, and torch keeps raw pointers to the
# allocator functions (pytorch issue 146431).
_KEEP: list[Any] = []


# Pool routings gpumem has open (arena allocating(), borrows), in every thread: one entry
# each. torch 2.11 aborts the process (an internal assert, captures_underway.empty()) when
# its cache is emptied while any routing is open: torch.cuda.empty_cache(), which engines
# call around warm-up and which torch.cuda.graph calls before every capture. While
# routings are open, empty_cache() is skipped: it only hands cached blocks back to the
# driver. A list, not a counter under a lock: append and pop are atomic, and a borrow
# scope opens a routing at every engine step.
_OPEN_ROUTES: list[None] = []


class PoolRoute:
    """``torch.cuda.use_mem_pool(pool, device)`` as a reusable object, counted (see
    ``_OPEN_ROUTES``). It makes the calls torch's context manager makes (route this
    thread's allocations to the pool; stop; drop the pool's use count) itself, because a
    borrow scope enters one per engine step: on the H200, torch's generator-based
    ``use_mem_pool`` took 2.7 us to enter and leave, and a counted wrapper around it 4.4."""

    __slots__ = ("pool", "device", "pool_id", "_begin", "_end", "_release")

    def __init__(self, torch: Any, pool: Any, device: int) -> None:
        require(
            torch, "pool routing", "_C._cuda_beginAllocateCurrentThreadToPool", "_C._cuda_endAllocateToPool", "_C._cuda_releasePool"
        )
        _guard_empty_cache(torch)
        self.pool = pool  # alive while routed: dropping a pool empties its cache, which aborts under a routing
        self.device = device
        self.pool_id = pool.id
        self._begin = torch._C._cuda_beginAllocateCurrentThreadToPool
        self._end = torch._C._cuda_endAllocateToPool
        self._release = torch._C._cuda_releasePool

    def enter(self) -> None:
        _OPEN_ROUTES.append(None)
        try:
            self._begin(self.device, self.pool_id)
        except BaseException:
            _OPEN_ROUTES.pop()
            raise

    def exit(self) -> None:
        try:
            self._end(self.device, self.pool_id)
            self._release(self.device, self.pool_id)
        finally:
            _OPEN_ROUTES.pop()

    def __enter__(self) -> PoolRoute:
        self.enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.exit()


def _guard_empty_cache(torch: Any) -> None:
    memory = torch.cuda.memory
    original = memory.empty_cache
    if getattr(original, "_gpumem_guard", False):
        return

    def empty_cache() -> None:
        if _OPEN_ROUTES:
            return  # torch would abort: see _OPEN_ROUTES
        original()

    empty_cache._gpumem_guard = True  # type: ignore[attr-defined]
    empty_cache.__doc__ = original.__doc__
    memory.empty_cache = empty_cache
    torch.cuda.empty_cache = empty_cache


def import_torch(feature: str) -> Any:
    try:
        import torch
    except ImportError:
        raise TorchFeatureMissing(f"{feature} needs torch, which is not installed (pip install 'torch>=2.8')") from None
    return torch


def require(torch: Any, feature: str, *paths: str) -> None:
    for path in paths:
        obj = torch
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise TorchFeatureMissing(
                    f"{feature} needs torch.{path}, which torch {torch.__version__} lacks "
                    "(torch.cuda.MemPool with a pluggable allocator arrived around torch 2.8)"
                )


# Where nested routing was seen to reach the innermost pool (the versions the library's
# GPU tests ran on); named in the error for a torch that routes otherwise.
NESTED_ROUTING_TESTED = "torch 2.11"
_NESTED_OK: set[int] = set()


def check_nested_routing(torch: Any, device: int) -> None:
    """Engines nest pools on one thread: a borrow or a graph capture inside an arena's
    ``allocating()``. torch must route each allocation to the innermost pool; a torch
    whose allocator takes the outermost would put borrowed temporaries and graphs in the
    model's arena. Checked once per device and process, with two throwaway pools."""
    if device in _NESTED_OK:
        return
    require(torch, "nested pool routing", "cuda.MemPool", "cuda.use_mem_pool")
    with torch.cuda.device(device):
        outer, inner = torch.cuda.MemPool(), torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(outer, device=device), torch.cuda.use_mem_pool(inner, device=device):
            probe = torch.empty(1, device=f"cuda:{device}")
        address = probe.data_ptr()
        del probe
        landed = any(s["address"] <= address < s["address"] + s["total_size"] for s in pool_segments(torch, inner))
        # Kept: destroying a pool empties its cache, which aborts under an open routing.
        _KEEP.extend((outer, inner))
    if not landed:
        raise TorchFeatureMissing(
            f"torch {torch.__version__} routes an allocation made inside nested torch.cuda.use_mem_pool scopes to the "
            f"outer pool; gpumem needs the innermost pool to win (borrows and captures inside arena.allocating()). "
            f"Tested: {NESTED_ROUTING_TESTED}"
        )
    _NESTED_OK.add(device)


def pool_segments(torch: Any, pool: Any) -> list[dict[str, Any]]:
    """torch's snapshot of one MemPool: its segments with their blocks."""
    snapshot = getattr(pool, "snapshot", None)
    if snapshot is not None:
        return list(snapshot())
    require(torch, "pool snapshots", "cuda.memory_snapshot")
    return list(torch.cuda.memory_snapshot(pool.id))


class ArenaPool:
    """The torch side of one arena."""

    def __init__(self, arena: Arena) -> None:
        torch = import_torch("arena memory pools")
        require(torch, "arena memory pools", "cuda.MemPool", "cuda.use_mem_pool", "cuda.memory.CUDAPluggableAllocator")
        if arena.core.backend != "cuda" or arena.core.device_ordinal is None:
            raise InvalidArgument(
                f"arena '{arena.name}' lives in host shared memory (host backend): torch CUDA pools need the CUDA "
                "backend; use arena.view() with DLPack or NumPy instead"
            )
        if not torch.cuda.is_available():
            raise TorchFeatureMissing(f"arena '{arena.name}' needs a torch build with CUDA ({torch.__version__} has none)")
        self.torch = torch
        self.arena = arena
        self.device = arena.core.device_ordinal
        self.allocator = arena.allocator()
        self.slot = self.allocator.slot
        self.pool = self._new_pool()
        # Virtual-only layouts get a pool of their own on the same slot (so the same
        # cursor: the addresses never overlap). torch keeps freed blocks cached per pool;
        # a block cached from a virtual-only segment must never serve a tensor that
        # will be touched.
        self._virtual_pool: Any = None
        self.retired = False

    def _new_pool(self) -> Any:
        torch = self.torch
        allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), self.slot.alloc_symbol, self.slot.free_symbol)
        with torch.cuda.device(self.device):
            pool = torch.cuda.MemPool(allocator.allocator())
        _KEEP.append((allocator, pool, self.slot))
        return pool

    # ------------------------------------------------------------------ routing

    def _check_device(self) -> None:
        current = self.torch.cuda.current_device()
        if current != self.device:
            raise InvalidArgument(
                f"arena '{self.arena.name}' lives on cuda:{self.device} ({self.arena.core.device.uuid}) but the "
                f"current device is cuda:{current}; enter torch.cuda.device({self.device}) first"
            )

    @contextlib.contextmanager
    def routing(self, *, virtual: bool = False) -> Iterator[ArenaPool]:
        self.arena._check_open()
        self._check_device()
        before = self.slot.stats().failures
        if virtual and self._virtual_pool is None:
            self._virtual_pool = self._new_pool()
        pool = self._virtual_pool if virtual else self.pool
        scope = virtual_only() if virtual else contextlib.nullcontext()
        try:
            with scope, PoolRoute(self.torch, pool, self.device):
                yield self
        except RuntimeError as exc:  # torch.OutOfMemoryError, or a plain RuntimeError from older torch
            stats = self.slot.stats()
            if stats.failures > before:
                raise ArenaOutOfMemory(self.allocator.refusal(stats), {"requested": stats.last_failed, "available": stats.largest_free}) from exc
            raise

    @property
    def graph_pool(self) -> Any:
        """The pool id for ``torch.cuda.graph(g, pool=...)``, once the arena has backed
        space at its cursor: capture on unbacked space would fail mid-capture."""
        self.arena._check_open()
        self._check_device()
        at = self.arena.address + self.slot.stats().cursor_bytes
        if not self.allocator.step and not any(self.arena.address + a <= at < self.arena.address + b for a, b in self.arena.backed_ranges()):
            raise InvalidArgument(
                f"arena '{self.arena.name}' has no backing at its allocation cursor (offset "
                f"{at - self.arena.address}): commit or placeholder it before capturing a graph into it"
            )
        return self.pool.id

    # ------------------------------------------------------------------ introspection

    def segments(self, *, virtual: bool = False) -> list[dict[str, Any]]:
        """torch's view of the (backed, or virtual-only) pool: segments with their blocks
        (address, size, state)."""
        pool = self._virtual_pool if virtual else self.pool
        if pool is None:
            return []
        return pool_segments(self.torch, pool)

    def check_unused(self, start: int, end: int, *, cached_ok: bool = False) -> None:
        """Refuse to unmap ``[start, end)`` of the arena while torch's pool uses it: live
        tensors there, or (unless ``cached_ok``) cached segments torch could hand out again."""
        lo, hi = self.arena.address + start, self.arena.address + end
        live = 0
        cached = 0
        for segment in self.segments() + self.segments(virtual=True):
            s_lo = segment["address"]
            if not (s_lo < hi and lo < s_lo + segment["total_size"]):
                continue
            cached += 1
            live += sum(b["size"] for b in segment["blocks"] if b["state"] != "inactive")
        if live or (cached and not cached_ok):
            raise InvalidArgument(
                f"arena '{self.arena.name}' offsets [{start}, {end}) are still used by its torch pool: "
                f"{live} bytes of live tensors in {cached} segment(s); torch reuses cached segments, so memory the "
                "pool has used returns only when the arena is released (lay tensors you mean to decommit out with "
                "arena.tensor(), which bypasses the pool)"
            )

    def retire(self) -> None:
        """The arena is going away: nothing may be placed in it any more (the arena
        retires the slot)."""
        self.retired = True


def tensor(arena: Arena, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """A torch tensor over ``arena`` bytes at ``offset``, outside any pool: the bytes
    are the arena's (committed, placeholder or virtual-only), and decommit may take
    them back once the caller stops using the tensor."""
    torch = import_torch("arena tensors")
    require(torch, "arena tensors", "from_dlpack")
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in shape:
        count *= dim
    raw = torch.from_dlpack(arena.view(offset, count * itemsize))
    return raw.view(dtype).reshape(shape)
