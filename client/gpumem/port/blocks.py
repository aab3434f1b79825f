"""An engine's block manager following its KV pool at run time (issue 24): more blocks
when the pool grows, fewer when the daemon asks for some back, live blocks moved down
first. No torch and no engine here: the block manager is read and changed through the
engine's adapter (gpumem.port.adapter: its free and used blocks, ``resize_blocks``,
``copy_blocks`` and ``relocate_blocks``, ``step_need``).

    follower = BlockFollower(pool, adapter)
    ... at every step boundary, before the scheduler runs:
    follower.before_step()
    ... while the engine has nothing to do:
    follower.idle()

Block ids stay below the pool's committed rows (a block is one row of every buffer), so
the manager's block count is the pool's ``tokens``. A step that neither grows nor shrinks
makes no daemon call: ``before_step`` looks at the notices the session already holds and
compares counts (demand is said when the engine turns busy or idle, and when it moved by
a grow step since it was last said). Growth runs ahead of need: once fewer than ``watermark`` blocks would
stay free after what the waiting and running sequences need next, a grow is sent without
waiting, for what they need plus the watermark in ``step`` blocks; the step waits for it
only when it cannot run otherwise (``StepNeed.short``: nothing could be scheduled, or a
running sequence would be preempted for want of a block). Asked for blocks back, the
follower packs its live blocks low (the adapter's device-to-device copies) and gives
back down to what it needs, in grow steps, not only the rows asked for: a burst's grows
come one after another as its requests arrive, and each further ask would wait for a
step of this engine. A grow that does not fit is answered at once with what is free,
the daemon asking neighbours for the rest (the reply's ``unanswered``): the next
boundary asks again without the pause a refusal costs, and that grow is answered once
they gave back, collected between steps; only a step that is ``short`` waits for it.

A dropped KV cache wakes to what fits above a floor (``wake_floor``: what the queue needs
next and the watermark, or an eighth of the blocks, the larger), its block manager
sized to what the wake gave (``woke``), and the rest of its blocks come by the grow the
wake left waiting in the daemon, collected between steps like any grow.

A copy that raises stops the shrink before anything is given back: the rows stay the
pool's, the daemon's books as they were (its ask is answered by the next boundary, or
its move deadline), and the error reaches the engine's step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Sequence
from typing import Any

from gpumem.errors import DaemonTimeout, GpuMemError, OutOfMemory
from gpumem.kv_pool import GrowWait, KvPool
from gpumem.port.adapter import EngineAdapter

# After a grow the daemon refused, the next one waits this long (memory came free meanwhile, or not).
RETRY_S = 0.5
# Blocks a copy of live blocks gathers at a time: the gather's index and temporary are
# allocated outside the arenas, so they stay small.
COPY_BATCH = 32
# A woken KV cache's default floor: this part of its blocks at least.
WAKE_FLOOR_PART = 8


def top(used: Collection[int]) -> int:
    """One past the highest block id in use: what the pool cannot give back."""
    return max(used, default=-1) + 1


def plan(used: Collection[int], free: Collection[int], bound: int) -> list[tuple[int, int]]:
    """(from, to) for the live blocks at or past ``bound``, highest first, each to the
    lowest free block below it; as many as there are free blocks below."""
    live = sorted((i for i in used if i >= bound), reverse=True)
    return list(zip(live, sorted(i for i in free if i < bound)))


def resize(engine: EngineAdapter, blocks: int) -> None:
    """The block manager to ``blocks`` blocks, refused while one from there on is in use."""
    if blocks == engine.block_count():
        return
    if top(engine.used_blocks()) > blocks:
        raise GpuMemError(f"block {top(engine.used_blocks()) - 1} is in use; the block manager cannot drop the blocks from {blocks} on")
    engine.resize_blocks(blocks)


class MoveFailed(GpuMemError):
    """The engine's ``copy_blocks`` raised while live blocks moved for a shrink: the pool
    kept every row (the daemon's books are as before the ask), the engine's blocks are
    where they were; the copy's own error is the cause."""


def copy_rows(tensors: Sequence[Any], src: list[int], dst: list[int]) -> None:
    """``EngineAdapter.copy_blocks`` for an engine that kept the tensors ``bind_kv`` gave
    it (block ``i`` is row ``i`` of each): rows ``src`` into ``dst`` in every tensor,
    device to device, complete on return. The device's work is waited for first: an
    engine's asynchronous batch (transformers') may still read the rows on a stream of
    its own."""
    from gpumem.torch_support import import_torch

    torch = import_torch("moving live KV blocks")
    device = tensors[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for at in range(0, len(src), COPY_BATCH):
        s = torch.tensor(src[at : at + COPY_BATCH], device=device)
        d = torch.tensor(dst[at : at + COPY_BATCH], device=device)
        for t in tensors:
            t[d] = t[s]  # gathered first: sources and destinations never overlap
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Figures:
    """What following the pool cost and did, for a bench."""

    grows: int = 0  # grows sent
    grows_short: int = 0  # answered with fewer blocks than asked, or refused
    grow_waits_s: list[float] = dataclasses.field(default_factory=list)  # steps that waited for a grow
    shrinks: int = 0  # shrink requests answered
    blocks_moved: int = 0
    move_s: float = 0.0  # spent copying live blocks
    preempted: int = 0  # counted by the engine's integration


class BlockFollower:
    """One engine's block manager kept to its KV pool (see the module doc)."""

    def __init__(
        self, pool: KvPool, engine: EngineAdapter, *, watermark: int = 16, step: int = 64, wait_s: float = 30.0, reserved: int = 0
    ) -> None:
        self.pool = pool
        self.engine = engine
        self.watermark = watermark
        self.step = step
        self.wait_s = wait_s
        self.figures = Figures()
        self.growing: GrowWait | None = None
        self._asked = 0  # the blocks the grow on its way asks for
        self._retry_at = 0.0
        self._busy: bool | None = None
        self._said = 0  # the demand last reported
        pool.rows_in_use, pool.reserved_rows = lambda: top(self.engine.used_blocks()), reserved
        resize(engine, pool.tokens)

    def move_live(self, bound: int) -> int:
        """``answer_shrinks``'s hook: copy the live blocks at or past ``bound`` into free
        blocks below it; returns the blocks still in use up to the highest. Asked below
        what is live, the live blocks are packed under their count instead: the pool then
        keeps the fewest rows it can (a moved block is cheap, a kept chunk is not)."""
        used = self.engine.used_blocks()
        moves = plan(used, self.engine.free_blocks(), max(bound, len(used)))
        if moves:
            started = time.perf_counter()
            try:
                self.engine.copy_blocks([s for s, _ in moves], [d for _, d in moves])
            except Exception as exc:
                raise MoveFailed(
                    f"KV pool '{self.pool.name}': the engine's copy of {len(moves)} live blocks (from {moves[0][0]} down) for "
                    f"the daemon's shrink to {bound} blocks failed ({type(exc).__name__}: {exc}); nothing was given back, "
                    "the blocks stay where they were"
                ) from exc
            self.engine.relocate_blocks(moves)
            self.figures.move_s += time.perf_counter() - started
            self.figures.blocks_moved += len(moves)
        return top(self.engine.used_blocks())

    def wake_floor(self) -> int:
        """The fewest blocks a dropped KV cache wakes to: what the sequences queued
        meanwhile need next plus the watermark, or ``1/WAKE_FLOOR_PART`` of the blocks
        it had (the block manager keeps their count through the sleep), the larger."""
        engine = self.engine
        blocks = engine.block_count()
        need = len(engine.used_blocks()) + engine.step_need().blocks + self.watermark
        return max(1, min(blocks, max(need, blocks // WAKE_FLOOR_PART)))

    def woke(self) -> None:
        """The pool woke (to part of its rows, maybe): the block manager to what it got,
        and the grow for the rest, which the wake left waiting, collected as any grow."""
        if self.growing is None and self.pool.growing is not None:
            self.growing, self._asked = self.pool.growing, self.engine.block_count()
        resize(self.engine, self.pool.tokens)

    def idle(self) -> None:
        """While the engine has nothing to do: say so once, and answer shrinks."""
        self._say_busy(False, 0)
        self._collect(0.001)
        self._answer_shrinks(0)

    def before_step(self) -> None:
        """At a step boundary: take an answered grow, answer shrinks, grow ahead of need,
        and wait for the grow only when the step cannot run without it."""
        self._collect(0.001)  # first: a shrink starts from the rows the pool holds
        engine = self.engine
        need = engine.step_need()
        self._answer_shrinks(need.blocks)
        used = len(engine.used_blocks())
        self._say_busy(need.busy, used + need.blocks)
        deadline = time.monotonic() + self.wait_s
        while True:
            free = len(engine.free_blocks())
            if self.growing is None and free - need.blocks < self.watermark:
                self._grow(used + need.blocks + self.watermark, used)
            if not need.short:
                return
            now = time.monotonic()
            if now >= deadline:
                raise OutOfMemory(
                    f"KV pool '{self.pool.name}' holds {self.pool.tokens} blocks, {free} free; the next step needs more and "
                    f"no grow got them within {self.wait_s:g}s (not answered: {', '.join(self.pool.unanswered) or 'none'})"
                )
            if self.growing is not None:
                self._collect(deadline - now)
            else:  # refused a moment ago: ask again once RETRY_S has passed
                time.sleep(min(deadline - now, max(self._retry_at - now, 0.001)))
            self.figures.grow_waits_s.append(time.monotonic() - now)
            need = engine.step_need()

    def _grow(self, wanted: int, used: int) -> None:
        pool = self.pool
        target = min(pool.max_tokens, -(-wanted // self.step) * self.step)
        if target <= pool.tokens or time.monotonic() < self._retry_at:
            return
        self.growing = pool.send_grow(target, in_use=used)
        self._asked = target
        self.figures.grows += 1

    def _collect(self, timeout: float) -> None:
        """Take the grow's answer if it came within ``timeout``: the manager gets the blocks."""
        if self.growing is None:
            return
        refused = False
        try:
            got = self.growing.wait(timeout)
        except DaemonTimeout:
            return
        except OutOfMemory:  # refused: nothing came free
            got, refused = self.pool.tokens, True
        self.growing = None
        if got < self._asked:
            self.figures.grows_short += 1
            if refused or not self.pool.unanswered:
                self._retry_at = time.monotonic() + RETRY_S
            # else: the daemon gave what was free at once and asked neighbours for the rest,
            # which the next grow finds free (or waits for, off the step unless it is short).
        resize(self.engine, self.pool.tokens)

    def _answer_shrinks(self, need: int) -> None:
        """Asked for blocks back, give back down to what the engine needs (in use, the
        next steps' ``need`` and the watermark, in grow steps), not only what was asked:
        the daemon asks for the neighbour's grow in hand, and a burst's grows come one
        after another as its requests arrive; each further ask would wait for a step of
        this engine."""
        wanted = len(self.engine.used_blocks()) + need + self.watermark
        kept = self.pool.answer_shrinks(self.move_live, down_to=-(-wanted // self.step) * self.step)
        if kept is not None:
            self.figures.shrinks += 1
            resize(self.engine, kept)

    def _say_busy(self, busy: bool, demand: int) -> None:
        """Report demand on a change between idle and busy, and while busy once it moved
        by ``step`` blocks from what was said (a burst's queue fills, its requests end):
        the daemon's fair share follows the engine's real need, not the figure of the
        step a burst began with. Steady decode moves it by a block now and then: no call."""
        demand = demand if busy else 0
        if busy != self._busy or abs(demand - self._said) >= self.step:
            self.pool.report_demand(demand)
            self._busy, self._said = busy, demand
