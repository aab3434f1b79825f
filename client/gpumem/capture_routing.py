"""CUDA-graph capture into an arena's pool, for engines that capture without ``pool=``.

    with graphs.capturing():                 # graphs: an arena (elastic, or committed)
        engine.capture_cudagraphs()          # torch.cuda.graph(g) inside lands in graphs' pool

torch gives a graph captured without a pool a private pool of its own, in memory from
torch's default allocator. Inside ``capturing()``, a capture that names no pool gets the
arena's pool instead; one that names a pool keeps it (an engine that passes the first
graph's ``graph.pool()`` to the next captures passes the arena's pool by then). The
choice is per thread: the scope sets a thread-local default that one wrapper around
``torch.cuda.CUDAGraph.capture_begin`` reads. The wrapper is installed at the first
``capturing()`` and stays; outside a scope it passes every call through unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gpumem.torch_support import check_nested_routing, require

if TYPE_CHECKING:
    from gpumem.arena import Arena
    from gpumem.torch_support import ArenaPool

_local = threading.local()
_install_lock = threading.Lock()
_installed: list[Any] = []  # the graph class whose capture_begin was wrapped


def _install(torch: Any) -> None:
    require(torch, "capture routing", "cuda.CUDAGraph.capture_begin")
    with _install_lock:
        if _installed:
            return
        graph_class = torch.cuda.CUDAGraph
        original = graph_class.capture_begin

        def capture_begin(self: Any, pool: Any = None, *args: Any, **kwargs: Any) -> Any:
            if pool is None:
                pool = getattr(_local, "pool", None)
            return original(self, pool, *args, **kwargs)

        capture_begin.__doc__ = original.__doc__
        graph_class.capture_begin = capture_begin
        _installed.append(graph_class)


@contextlib.contextmanager
def capturing(arena: Arena) -> Iterator[ArenaPool]:
    """Within this block, this thread's graph captures that name no pool use ``arena``'s
    (see the module doc). Nests: the innermost scope wins, the outer one comes back."""
    pool = arena.torch_pool()
    torch = pool.torch
    check_nested_routing(torch, pool.device)  # captures inside arena.allocating() must reach this pool
    _install(torch)
    before = getattr(_local, "pool", None)
    _local.pool = pool.graph_pool
    try:
        yield pool
    finally:
        _local.pool = before
