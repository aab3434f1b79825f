"""What an engine needs from gpumemd, in one object: a session, an elastic arena for the
model and its activations, one for its CUDA graphs, a paged KV cache sized by a round
after capture, leased replays and borrowed temporaries.

    mem = gpumem.EngineMemory("engine-a", device=0)
    with mem.running():                                  # model arena + graph capture routing
        model = load_model()
        warm_up(model)
        kv = mem.kv_cache(layers=28, block_shape=(256, 8, 128), itemsize=2)
        ...point the attention layers at kv.layer_tensors(i, dtype)...
        graphs = capture(model)                          # torch.cuda.graph(g) with or without pool=
    graphs = mem.graphs_captured(graphs)                 # registered, arenas trimmed, replays leased
    pending = mem.start_kv_commit(headroom_bytes=1 << 30)        # the round runs on
    ...finish starting up...
    blocks = pending.wait()
    with mem.running():
        ...serve; sample with mem.borrowed(sampler, logits, ...) ...
    mem.sleep(drop=["kv"])                               # weights and graphs to host memory, KV dropped
    mem.wake()                                           # same addresses, graphs replay as captured

The order is the engine's: nothing here needs the KV cache before capture or the round
before the scheduler. See docs/engines.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from gpumem.errors import InvalidArgument
from gpumem.kv_pool import RoundFigures, waited
from gpumem.leased_graph import DEFAULT_WAIT_S, LeasedGraph, leased_graphs
from gpumem.paged_kv import PagedKvCache
from gpumem.prefix_directory import PrefixDirectory
from gpumem.session import DEFAULT_TIMEOUT, connect
from gpumem.sleep import DEFAULT_WAKE_WAIT_S, ArenaSleep

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from gpumem.arena import Arena
    from gpumem.graph_pools import GraphPool
    from gpumem.kv_pool import RoundWait
    from gpumem.retain import Adopted, RetainGroup
    from gpumem.session import Session
    from gpumem.standby import Reservation

K = TypeVar("K")
R = TypeVar("R")

GiB = 1 << 30
# Address space only: the arenas commit what torch asks for, in steps.
DEFAULT_MODEL_RESERVE = 256 * GiB
DEFAULT_GRAPH_RESERVE = 64 * GiB
DEFAULT_MODEL_STEP = 256 << 20
# Graph pools grow by torch's segments (2 or 20 MiB): small steps keep the trim tight.
DEFAULT_GRAPH_STEP = 32 << 20
# What sleep() and wake() name: the model arena (weights and activations), the graphs
# arena (the graph pools' memory) and the KV cache; woken in this order.
TAGS = ("weights", "graphs", "kv")


class EngineMemory:
    def __init__(
        self,
        name: str,
        device: int | str = 0,
        *,
        runtime_dir: str | None = None,
        tenant_token_file: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        model_reserve: int = DEFAULT_MODEL_RESERVE,
        graph_reserve: int = DEFAULT_GRAPH_RESERVE,
        model_step: int = DEFAULT_MODEL_STEP,
        graph_step: int = DEFAULT_GRAPH_STEP,
    ) -> None:
        self.name = name
        self.session: Session = connect(device, name, runtime_dir=runtime_dir, timeout=timeout, tenant_token_file=tenant_token_file)
        try:
            self.model: Arena = self.session.create_arena(f"{name}-model", model_reserve).set_elastic(model_step)
            self.graphs: Arena = self.session.create_arena(f"{name}-graphs", graph_reserve).set_elastic(graph_step)
        except BaseException:
            self.session.close()
            raise
        self.kv: PagedKvCache | None = None
        self.graph_pool: GraphPool | None = None
        self.prefix: PrefixDirectory | None = None  # the KV cache's prefix directory, once made or adopted
        self._running = threading.local()  # whether this thread is inside running()
        self._sleepers: dict[str, ArenaSleep] = {}  # by tag, from its first sleep on (each keeps its host buffer)

    @contextlib.contextmanager
    def running(self) -> Iterator[EngineMemory]:
        """This thread's torch allocations go to the model arena, and graphs captured
        without a pool to the graphs arena's pool. Re-entrant: an engine's step may run
        inside its own start-up (a warm-up), and torch refuses a pool routed twice."""
        if getattr(self._running, "on", False):
            yield self
            return
        self._running.on = True
        try:
            with self.model.allocating(), self.graphs.capturing():
                yield self
        finally:
            self._running.on = False

    def kv_cache(
        self,
        *,
        layers: int,
        block_shape: tuple[int, ...],
        itemsize: int,
        combined: bool = False,
        max_blocks: int = 0,
        expect: int = 0,
    ) -> PagedKvCache:
        """Declare the paged KV cache (see gpumem.paged_kv), placeholder under it, and join
        the round; ``expect``: how many engines the round gathers (0: whoever reports)."""
        if self.kv is not None:
            raise InvalidArgument(f"engine '{self.name}' declared its KV cache already")
        self.kv = self.session.declare_paged_kv(
            f"{self.name}-kv", layers=layers, block_shape=block_shape, itemsize=itemsize, combined=combined, max_blocks=max_blocks,
            expect=expect,
        )
        return self.kv

    def graphs_captured(
        self, graphs: Mapping[K, Any], *, label: str = "decode", shared: bool = False, wait: float = DEFAULT_WAIT_S
    ) -> dict[K, LeasedGraph]:
        """After capture: give back what both arenas hold above their peaks, register the
        graphs arena's pool with the daemon, and return ``graphs`` with their replays
        leased."""
        self.model.trim()
        self.graphs.trim()
        self.graph_pool = self.graphs.register_graph_pool(label, shared=shared)
        return leased_graphs(graphs, self.session, self.graph_pool, wait=wait)

    def start_kv_commit(
        self, *, min_blocks: int = 0, max_blocks: int = 0, timeout: float | None = None, **figures: Unpack[RoundFigures]
    ) -> RoundWait:
        """Report capture done for the KV cache's round (``RoundFigures``; the graphs
        arena's bytes as the graph-pool figure), without waiting: the engine finishes
        its start-up while the round gathers, and calls ``wait()`` on the ``RoundWait``
        (the blocks committed) before its scheduler needs the blocks. ``kv_commit`` is
        the same report, waited for."""
        if self.kv is None:
            raise InvalidArgument(f"engine '{self.name}' has no KV cache: call kv_cache() first")
        return self.kv.send_capture_done(
            min_blocks=min_blocks, max_blocks=max_blocks, timeout=timeout, graph_pool_bytes=self.graphs.committed, **figures
        )

    kv_commit = waited(start_kv_commit)

    def borrowed(self, fn: Callable[..., R], *args: Any, user: str = "sampler", need_bytes: int = 0, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)`` with its temporaries in the graph pool's free runs
        (a borrow, see gpumem.borrow); its tensor results are copied out before the
        borrow ends, to where allocations go outside it (the model arena inside
        ``running()``). Where no run holds ``need_bytes`` (an estimate of
        the largest temporary), or before the graphs are registered, ``fn`` runs as
        usual instead: borrowing saves memory, it must not fail a step."""
        pool = self.graph_pool
        if pool is None:
            return fn(*args, **kwargs)
        with self.session.borrow(pool, user=user) as borrow:
            if need_bytes and not borrow.can_fit(need_bytes):
                borrow.release()
                return fn(*args, **kwargs)
            result = fn(*args, **kwargs)
            borrow.stop_routing()
            kept: R = _copied(result)
            del result
        return kept

    def sleep(self, *tags: str, drop: Iterable[str] = ()) -> None:
        """Hand the memory of ``tags`` (of TAGS: "weights", "graphs", "kv"; none named:
        all) back to the device, each one's contents kept in host memory unless its tag
        is in ``drop``: ``mem.sleep(drop=["kv"])``. Graph-pool memory is dropped only
        when "graphs" is named there, and then its graphs must be captured again. The
        session stays valid; the memory must not be touched (no step, no replay) until
        ``wake``. The copies run at pinned bandwidth from the second sleep on (the first
        registers each host buffer, unless ``prepare_sleep`` did)."""
        dropped = set(drop)
        for tag in self._tags(tags, dropped):  # the order of TAGS: a failure leaves the rest awake
            sleeper = self._sleeper(tag)
            if not sleeper.asleep:
                sleeper.sleep(keep=tag not in dropped)

    def prepare_sleep(self, *tags: str, drop: Iterable[str] = ()) -> None:
        """Make, now, the host buffers that ``sleep(*tags, drop=drop)`` copies into, so
        that its first call costs the copies only: registering a buffer pins its pages
        (on the H200 about 0.6 s a GiB). Call it where nothing waits, e.g. once the engine
        is built; the buffers are host memory the daemon accounts from then on."""
        dropped = set(drop)
        for tag in self._tags(tags, dropped):
            if tag not in dropped:
                self._sleeper(tag).prepare()

    def _tags(self, tags: tuple[str, ...], dropped: set[str]) -> list[str]:
        wanted = list(tags) or [t for t in TAGS if t != "kv" or self.kv is not None]
        unknown = sorted((set(wanted) | dropped) - set(TAGS))
        if unknown:
            raise InvalidArgument(f"engine '{self.name}': no memory tagged {unknown}; the tags are {', '.join(TAGS)}")
        return [t for t in TAGS if t in wanted]

    def wake(self, *, wait: float = DEFAULT_WAKE_WAIT_S, kv_floor: int | None = None) -> None:
        """Wake what sleeps, at the same addresses, kept contents copied back; waits up to
        ``wait`` seconds for memory others hold (OutOfMemory names them after).
        ``kv_floor``: a dropped KV cache wakes to what fits once that many blocks do, the
        rest grown in the background (``ArenaSleep.wake``; the engine's block manager
        must follow ``kv.blocks``); None: all its blocks."""
        for tag in TAGS:
            sleeper = self._sleepers.get(tag)
            if sleeper is not None and sleeper.asleep:
                sleeper.wake(wait=wait, floor=kv_floor if tag == "kv" else None)

    @property
    def asleep(self) -> list[str]:
        """The tags asleep now."""
        return [tag for tag, s in self._sleepers.items() if s.asleep]

    def _sleeper(self, tag: str) -> ArenaSleep:
        sleeper = self._sleepers.get(tag)
        if sleeper is None:
            if tag == "kv":
                if self.kv is None:
                    raise InvalidArgument(f"engine '{self.name}' has no KV cache to put to sleep")
                sleeper = ArenaSleep(self.kv.pool.arena, self.kv.pool)
            else:
                sleeper = ArenaSleep(self.model if tag == "weights" else self.graphs)
            self._sleepers[tag] = sleeper
        return sleeper

    def retain(self, group: str, *, directory: bool = True) -> RetainGroup:
        """Keep the KV cache (and a prefix directory for it, made here unless
        ``directory`` is false) across this engine's death, for an engine that gives the
        returned group's ``secret`` to ``adopt_kv`` (see gpumem.retain)."""
        if self.kv is None:
            raise InvalidArgument(f"engine '{self.name}' has no KV cache to retain: call kv_cache() first")
        if directory and self.prefix is None:
            self.prefix = self.session.create_prefix_directory(f"{self.name}-prefix", blocks=self.kv.max_blocks)
        retained = self.session.retain_group(group)
        retained.retain(self.kv, *([self.prefix] if self.prefix is not None else []))
        return retained

    def adopt_kv(
        self, group: str, secret: str, *, layers: int, block_shape: tuple[int, ...], itemsize: int, combined: bool = False,
        wait: float = 0.0, reservation: Reservation | None = None,
    ) -> Adopted:
        """Take over a dead engine's retained KV cache (laid out as ``kv_cache`` describes
        it) and its prefix directory, if it kept one: they become this engine's ``kv`` and
        ``prefix``, at the same addresses. ``wait``, ``reservation``: as ``Session.adopt``."""
        if self.kv is not None:
            raise InvalidArgument(f"engine '{self.name}' has a KV cache already")
        adopted = self.session.adopt(group, secret, wait=wait, reservation=reservation)
        if len(adopted.kv_pools) != 1:
            raise InvalidArgument(f"retain group '{group}' holds {len(adopted.kv_pools)} KV pools, not one: {sorted(adopted.kv_pools)}")
        (pool,) = adopted.kv_pools.values()
        self.kv = PagedKvCache(pool, layers, block_shape, itemsize, combined)
        for arena in adopted.arenas.values():  # the group may keep other arenas too (weights)
            try:
                self.prefix = PrefixDirectory.open(arena)
                break
            except InvalidArgument:
                continue
        return adopted

    def close(self) -> None:
        """Close the session: the daemon takes back every arena and the KV cache (and
        the host buffers of what slept)."""
        for sleeper in self._sleepers.values():
            sleeper.close()
        self.session.close()

    def __enter__(self) -> EngineMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpumem.EngineMemory '{self.name}' model {self.model.committed} graphs {self.graphs.committed} kv {self.kv!r}>"


def _copied(result: Any) -> Any:
    """``result`` with every torch tensor in it (alone, or in a tuple or list) cloned."""
    if isinstance(result, (tuple, list)):
        return type(result)(_copied(item) for item in result)
    clone = getattr(result, "clone", None)
    return clone() if callable(clone) else result
