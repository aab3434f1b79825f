"""A captured graph whose ``replay()`` holds the pool's replay lease, for engines that
call ``graph.replay()`` themselves.

    runner.graphs = gpumem.leased_graphs(runner.graphs, session, pool)
    ...
    runner.graphs[bs].replay()               # engine code, unchanged: leased now

The lease excludes borrows of the pool's free runs and captures into it while the
replay is queued (see gpumem.leases): uncontended, it is one compare-and-swap each way.
A holder of another kind makes the replay wait up to ``wait`` seconds, then raise
``LeaseConflict`` naming the holder. Anything else the engine reads off the graph
(``pool()``, ``reset()``, ...) is the wrapped graph's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from gpumem_shared.lease_table import LeaseKind
from gpumem.leases import Lease

if TYPE_CHECKING:
    from gpumem.graph_pools import GraphPool
    from gpumem.session import Session

K = TypeVar("K")

# How long a replay waits for a borrower or a capture to give the pool back: a borrow
# spans one sampling step, so a second is ample and an error names the holder after it.
DEFAULT_WAIT_S = 1.0

# Read once: an enum member looked up on its class costs ~60 ns before Python 3.12.
_REPLAY = LeaseKind.REPLAY


class LeasedGraph:
    """``graph`` (anything with ``replay()``, such as a ``torch.cuda.CUDAGraph``) replayed
    under ``pool``'s replay lease."""

    # Private names: every other attribute is the wrapped graph's (pool(), reset(), ...).
    __slots__ = ("_graph", "_leasing", "_pool", "_wait", "_label")

    def __init__(self, graph: Any, session: Session, pool: GraphPool, *, wait: float = DEFAULT_WAIT_S, label: str = "replay") -> None:
        self._graph = graph
        self._leasing = session.leasing
        self._pool = pool
        self._wait = wait
        self._label = label

    @property
    def graph(self) -> Any:
        """The wrapped graph."""
        return self._graph

    def replay(self) -> None:
        with Lease.acquire(self._leasing, self._pool, _REPLAY, self._label, self._wait):
            self._graph.replay()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._graph, name)

    def __repr__(self) -> str:
        return f"<gpumem.LeasedGraph on graph pool {self._pool.id} ('{self._pool.label}'): {self._graph!r}>"


def leased_graphs(
    graphs: Mapping[K, Any], session: Session, pool: GraphPool, *, wait: float = DEFAULT_WAIT_S, label: str = "replay"
) -> dict[K, LeasedGraph]:
    """Every graph of ``graphs`` (an engine's table of graphs by batch size, say) wrapped
    in a ``LeasedGraph`` on ``pool``, under the same keys."""
    return {key: LeasedGraph(graph, session, pool, wait=wait, label=label) for key, graph in graphs.items()}
