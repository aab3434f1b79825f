"""``EnginePort``: the calls an engine makes at its own seams, one object per engine, over
its adapter (gpumem.port.adapter) and an ``EngineMemory`` (gpumem.engine). The order is
the engine's start-up and serving loop:

    port = EnginePort(adapter, Settings("engine-a", expect=2))
    with port.starting():                      # build, load, warm up: into the arenas
        ...the engine builds its model...
        port.lay_out_kv()                      # where it would allocate its KV cache
        graphs = port.captured(graphs)         # its graphs captured: registered, leased
    port.started()                             # the round's report goes out, unwaited
    blocks = port.blocks()                     # before its block manager is built
    ...the engine builds its block manager of ``blocks`` blocks...
    port.follow()
    while serving:
        port.before_step()                     # before scheduling: grows, shrinks
        ...the scheduler takes blocks...
        port.scheduled()                       # before the step runs: prefix entries invalidated
        ...the step runs; its outputs reach the host...
        port.after_step()                      # the filled blocks published
    port.idle()                                # between requests
    port.close()

An engine whose caller built its model first moves it in (``take_model``); one whose
start-up ends in one place (its warm-up captured its graphs, its block manager exists)
makes ``built(make_blocks)`` its one call from ``captured`` to ``follow``; one that steps
on a thread of its own runs each step in ``step(busy)`` and none while ``may_step()`` is
false, so that ``sleep()``, from another thread, finds it between two steps
(gpumem.port.gate).

A primary that retains (``Settings.retain``) keeps its KV cache and a prefix directory
for a successor; a standby (``Settings.standby``) reserves the primary's KV windows in
``lay_out_kv`` (no round), ``settle()``s once built and ``take_over(wait=)``s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from gpumem.engine import EngineMemory
from gpumem.errors import InvalidArgument
from gpumem.port import takeover, weights
from gpumem.port.adapter import EngineAdapter, KvLayout
from gpumem.port.blocks import BlockFollower
from gpumem.port.gate import StepGate
from gpumem.port.prefix import DirectoryKeeper
from gpumem.port.settings import Settings
from gpumem.sleep import DEFAULT_WAKE_WAIT_S

if TYPE_CHECKING:
    from gpumem.arena import Arena
    from gpumem.kv_pool import RoundWait
    from gpumem.leased_graph import LeasedGraph
    from gpumem.retain import RetainGroup
    from gpumem.standby import Reservation

K = TypeVar("K")


class EnginePort:
    def __init__(self, engine: EngineAdapter, settings: Settings) -> None:
        s = self.settings = settings
        self.engine = engine
        self.mem = EngineMemory(s.name, s.device, runtime_dir=s.runtime_dir, tenant_token_file=s.tenant_token_file)
        self.layout: KvLayout | None = None
        self.round: RoundWait | None = None
        self.reservation: Reservation | None = None  # a standby's: the primary's KV windows
        self.group: RetainGroup | None = None  # a retaining primary's
        self.shared: weights.SharedWeights | None = None  # a standby's mapping of its primary's weights
        self.weights_map: Arena | None = None  # a primary's map of its weights, for its standby
        self.follower: BlockFollower | None = None
        self.keeper: DirectoryKeeper | None = None
        self.took: takeover.TakeOver | None = None
        self._standby_blocks = 0
        self.gate = StepGate(s.name)

    # ------------------------------------------------------------------ start-up

    @contextlib.contextmanager
    def starting(self) -> Iterator[EnginePort]:
        """Around the engine's construction (model, warm-up, KV cache, capture): torch's
        allocations go to the model arena, graphs to the graphs arena
        (``EngineMemory.running``); a standby with ``share_weights`` builds its model on
        the primary's weights (``EngineAdapter.building_model``) and loads none."""
        s = self.settings
        with self.mem.running():
            if s.standby and s.share_weights:
                with weights.standby_model(self.engine, self.mem.session, s.standby[0]) as self.shared:
                    yield self
            else:
                yield self

    def take_model(self, model: Any) -> None:
        """A model its caller built on the device before the engine was made, moved into
        the model arena (gpumem.port.weights.move_in); its first copies back to the device."""
        from gpumem.torch_support import import_torch

        weights.move_in(model, self.mem.model)
        import_torch("moving a model into its arena").cuda.empty_cache()

    def lay_out_kv(self) -> None:
        """Where the engine would allocate its KV cache: the cache laid out virtually (the
        placeholder under it) and handed to the engine (``bind_kv``); a standby's at the
        primary's windows; a retaining primary's retained with a prefix directory."""
        s, mem = self.settings, self.mem
        layout = self.layout = self.engine.kv_layout()
        if s.standby:
            self.reservation = mem.session.reserve_retained(*s.standby)
            kv = self.reservation.paged_kv(**layout.describe())
        else:
            kv = mem.kv_cache(**layout.describe(), max_blocks=layout.max_blocks, expect=s.expect)
            if s.retain:
                self.group = mem.retain(s.retain)
        self.engine.bind_kv(kv.tensors(layout.dtype))
        self._standby_blocks = kv.blocks

    def captured(self, graphs: Mapping[K, Any]) -> dict[K, LeasedGraph]:
        """Once the engine's graphs are captured: the arenas trimmed, the graph pool
        registered, ``graphs`` returned with their replays leased."""
        return self.mem.graphs_captured(graphs)

    def started(self) -> None:
        """The engine is built: a primary granting its weights publishes them, and the
        round's report goes out without waiting (a standby joins no round)."""
        s = self.settings
        if s.weights_to:  # built and loaded: every parameter lies where it will stay
            self.weights_map = weights.publish(self.mem.session, s.retain, self.engine.model(), self.mem.model, s.weights_to)
        if not s.standby:
            reserved = self.layout.reserved_blocks if self.layout is not None else 0
            min_blocks = max(s.min_blocks, reserved + 1) if reserved else s.min_blocks  # one to serve past the reserved
            self.round = self.mem.start_kv_commit(headroom_bytes=s.round_headroom, min_blocks=min_blocks, weight=s.weight)

    def blocks(self) -> int:
        """The blocks the engine's block manager starts with: the round's (waited for), or
        a standby's (the primary's, for the layout; real once taken over)."""
        if self.round is None:
            if not self.settings.standby:
                raise InvalidArgument(f"engine '{self.settings.name}': call started() before blocks()")
            return self._standby_blocks
        return self.round.wait()

    def follow(self) -> None:
        """The engine's block manager is built: it follows the pool (``Settings.follow``)
        and a retaining primary keeps its prefix directory."""
        s, kv = self.settings, self.mem.kv
        if s.standby or kv is None:
            return
        if s.follow:
            reserved = self.layout.reserved_blocks if self.layout is not None else 0
            self.follower = BlockFollower(kv.pool, self.engine, watermark=s.watermark_blocks, step=s.grow_step_blocks, reserved=reserved)
        if self.mem.prefix is not None:
            self.keeper = DirectoryKeeper(self.engine, self.mem.prefix)

    def built(self, make_blocks: Callable[[int], None], graphs: Mapping[K, Any] | None = None) -> dict[K, LeasedGraph]:
        """The start-up's end as one call, for an engine whose block manager exists once
        its graphs are captured: ``captured(graphs)``, ``started()``, the round's blocks
        (``blocks()``) given to ``make_blocks`` (the block manager to that many),
        ``follow()``, and a standby's ``settle()``. Returns the leased graphs."""
        leased = self.captured(graphs or {})
        self.started()
        make_blocks(self.blocks())
        self.follow()
        if self.settings.standby:
            self.settle()
        return leased

    # ------------------------------------------------------------------ serving (the step hook)

    def may_step(self) -> bool:
        """False while the engine's memory sleeps or ``sleep()`` waits for the step under
        way: an engine stepping on a thread of its own runs no step then (requests wait)."""
        return not self.mem.asleep and not self.gate.paused()

    @contextlib.contextmanager
    def step(self, busy: bool) -> Iterator[None]:
        """One step of an engine that steps on a thread of its own, inside the step gate:
        ``before_step()`` (``idle()`` when nothing waits or runs), the step, ``after_step()``."""
        with self.gate.step():
            if busy:
                self.before_step()
            else:
                self.idle()
            yield
            self.after_step()

    def before_step(self) -> None:
        """Before the scheduler runs: grows taken and sent, shrinks answered."""
        if self.follower is not None:
            self.follower.before_step()

    def scheduled(self) -> None:
        """The scheduler took the step's blocks, the step has not run: no directory entry
        vouches for a block the step may rewrite."""
        if self.keeper is not None:
            self.keeper.before_step()

    def after_step(self) -> None:
        """The step's outputs reached the host (its device work done): the blocks it filled
        are published."""
        if self.keeper is not None:
            self.keeper.after_step()

    def preempted(self) -> None:
        if self.follower is not None:
            self.follower.figures.preempted += 1

    def idle(self) -> None:
        """While the engine has nothing to do (between requests): answers the daemon's
        shrinks and says the engine idles, which its steps cannot do when none run."""
        if self.follower is not None:
            self.follower.idle()

    # ------------------------------------------------------------------ sleep

    def sleep(self, *tags: str, drop: Iterable[str] = ("kv",)) -> None:
        """Put an idle engine's memory to sleep (``EngineMemory.sleep``; default: weights
        and graph pool kept in host memory, the KV cache dropped), between two steps (it
        waits for the step under way: gpumem.port.gate). Refused while sequences hold KV
        blocks (the layout's reserved blocks apart); a dropped KV cache takes the prefix
        cache with it."""
        dropped = set(drop)
        with self.gate.closed():
            if "kv" in dropped and (not tags or "kv" in tags) and self.mem.kv is not None:
                reserved = self.layout.reserved_blocks if self.layout is not None else 0
                used = sum(1 for b in self.engine.used_blocks() if b >= reserved)
                if used:
                    raise InvalidArgument(f"engine '{self.mem.name}' has {used} KV blocks in use: finish its sequences before its KV cache sleeps")
                self.engine.forget_prefix_cache()  # what a block held is gone: no prefix may match it
                if self.keeper is not None:
                    self.keeper.forget_all()  # nor may the retained directory vouch for it
            self.engine.synchronize()  # an asynchronous step may still read or write what sleeps
            self.mem.sleep(*tags, drop=dropped)

    def prepare_sleep(self, *tags: str, drop: Iterable[str] = ("kv",)) -> None:
        """The host buffers ``sleep(*tags, drop=drop)`` copies into, made ahead."""
        self.mem.prepare_sleep(*tags, drop=drop)

    def wake(self, *, wait: float = DEFAULT_WAKE_WAIT_S, floor_blocks: int | None = None) -> None:
        """Wake what ``sleep`` put to sleep (``EngineMemory.wake``). A dropped KV cache of
        an engine that follows its pool wakes to what fits above ``floor_blocks`` (default:
        ``BlockFollower.wake_floor``), its block manager sized to what came, and regains
        the rest as memory comes back; without a follower it wakes to all its blocks."""
        follower = self.follower
        if follower is None:
            if floor_blocks is not None:
                raise InvalidArgument(f"engine '{self.settings.name}' does not follow its KV pool: its KV cache wakes whole")
            self.mem.wake(wait=wait)
            return
        self.mem.wake(wait=wait, kv_floor=follower.wake_floor() if floor_blocks is None else floor_blocks)
        follower.woke()

    # ------------------------------------------------------------------ retain and standby

    def retain_secret(self) -> str:
        """The secret of the retain group ``Settings.retain`` named, for the standby."""
        if self.group is None:
            raise InvalidArgument(f"engine '{self.settings.name}' retains nothing: build it with retain='group'")
        return self.group.secret

    def shared_weights_bytes(self) -> int:
        """What a standby with ``share_weights`` maps of its primary's model arena; 0 for
        an engine that loaded its own."""
        return 0 if self.shared is None else self.shared.map.shared_bytes()

    def settle(self) -> None:
        """A standby, once built: rehearse, reset and sleep (gpumem.port.takeover)."""
        if self.reservation is None:
            raise InvalidArgument(f"engine '{self.settings.name}' is no standby built on its primary's KV windows")
        takeover.settle(self.engine, self.mem, self.settings, self.reservation)

    def take_over(self, *, wait: float) -> takeover.TakeOver:
        """A standby: wait up to ``wait`` seconds for the primary's death and fence, adopt
        its KV cache and prefix directory, wake, size and seed (gpumem.port.takeover).
        The engine serves from then on, its prefix directory kept."""
        if self.reservation is None or self.layout is None:
            raise InvalidArgument(f"engine '{self.settings.name}' is no standby: build it with standby=(group, secret) to take over")
        promoted = takeover.take_over(self.engine, self.mem, self.settings, self.layout, self.reservation, wait=wait)
        self.keeper, self.follower, self.took = promoted.keeper, promoted.follower, promoted.took
        return promoted.took

    def close(self) -> None:
        """Close the session: the daemon takes back every arena and the KV cache."""
        self.mem.close()
