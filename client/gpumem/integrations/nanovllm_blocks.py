"""nano-vllm's block manager following its KV pool at run time (issue 24): more blocks
when the pool grows, fewer when the daemon asks for some back, live blocks moved down
first. No torch and no nano-vllm here: the block manager and the sequences are duck-typed
(nano-vllm's ``BlockManager``: ``blocks``, ``free_block_ids``, ``used_block_ids``,
``hash_to_block_id``; a sequence's ``block_table`` and ``num_blocks``), and the copy of
the blocks' bytes is the caller's (device to device on CUDA, a NumPy copy on the host).

    follower = BlockFollower(pool, manager, new_block=Block, copy_blocks=copy)
    ... at every step boundary, before the scheduler runs:
    follower.before_step(scheduler.waiting, scheduler.running)
    ... while the engine has nothing to do:
    follower.idle()

Block ids stay below the pool's committed rows (a block is one row of every buffer), so
the manager's block count is the pool's ``tokens``. A step that neither grows nor shrinks
makes no daemon call: ``before_step`` looks at the notices the session already holds and
compares counts (demand is said when the engine turns busy or idle, and when it moved by
a grow step since it was last said). Growth runs ahead of need: once fewer than ``watermark`` blocks would
stay free after what the waiting and running sequences need next, a grow is sent without
waiting, for what they need plus the watermark in ``step`` blocks; the step waits for it
only when it cannot run otherwise (nothing could be scheduled, or a running sequence
would be preempted for want of a block). Asked for blocks back, the follower packs its
live blocks low (device-to-device copies) and gives back down to what it needs, in grow
steps, not only the rows asked for: a burst's grows come one after another as its
requests arrive, and each further ask would wait for a step of this engine.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gpumem.errors import DaemonTimeout, GpuMemError, OutOfMemory
from gpumem.kv_pool import GrowWait, KvPool

# After a grow the daemon refused, the next one waits this long (memory came free meanwhile, or not).
RETRY_S = 0.5


def top(manager: Any) -> int:
    """One past the highest block id in use: what the pool cannot give back."""
    return max(manager.used_block_ids, default=-1) + 1


def resize(manager: Any, blocks: int, new_block: Callable[[int], Any]) -> None:
    """Make the manager hold ``blocks`` blocks: new ones free at the end, or the free ones
    from ``blocks`` on dropped (every block there must be free)."""
    have = len(manager.blocks)
    if blocks >= have:
        manager.blocks.extend(new_block(i) for i in range(have, blocks))
        manager.free_block_ids.extend(range(have, blocks))
        return
    if top(manager) > blocks:
        raise GpuMemError(f"block {top(manager) - 1} is in use; the block manager cannot drop the blocks from {blocks} on")
    del manager.blocks[blocks:]
    manager.free_block_ids = collections.deque(i for i in manager.free_block_ids if i < blocks)
    for h, i in list(manager.hash_to_block_id.items()):
        if i >= blocks:  # a freed block's prefix-cache entry
            del manager.hash_to_block_id[h]


def plan(manager: Any, bound: int) -> list[tuple[int, int]]:
    """(from, to) for the live blocks at or past ``bound``, highest first, each to the
    lowest free block below it; as many as there are free blocks below."""
    live = sorted((i for i in manager.used_block_ids if i >= bound), reverse=True)
    free = sorted(i for i in manager.free_block_ids if i < bound)
    return list(zip(live, free))


def relocate(manager: Any, sequences: Iterable[Any], moves: Sequence[tuple[int, int]]) -> None:
    """The bookkeeping of ``moves`` once their bytes are copied: each destination block
    takes its source's place (reference count, prefix hash, tokens), in the manager and in
    every sequence's block table; the sources become free."""
    to = dict(moves)
    for src, dst in moves:
        a, b = manager.blocks[src], manager.blocks[dst]
        b.ref_count, b.hash, b.token_ids = a.ref_count, a.hash, a.token_ids
        a.ref_count, a.hash, a.token_ids = 0, -1, []
    manager.used_block_ids = {to.get(i, i) for i in manager.used_block_ids}
    taken = set(to.values())
    manager.free_block_ids = collections.deque([i for i in manager.free_block_ids if i not in taken] + list(to))
    for h, i in manager.hash_to_block_id.items():
        manager.hash_to_block_id[h] = to.get(i, i)
    for seq in sequences:
        seq.block_table[:] = [to.get(i, i) for i in seq.block_table]


@dataclasses.dataclass
class Figures:
    """What following the pool cost and did, for a bench."""

    grows: int = 0  # grows sent
    grows_short: int = 0  # answered with fewer blocks than asked, or refused
    grow_waits_s: list[float] = dataclasses.field(default_factory=list)  # steps that waited for a grow
    shrinks: int = 0  # shrink requests answered
    blocks_moved: int = 0
    move_s: float = 0.0  # spent copying live blocks
    preempted: int = 0  # counted by the scheduler


class BlockFollower:
    """One engine's block manager kept to its KV pool (see the module doc)."""

    def __init__(
        self,
        pool: KvPool,
        manager: Any,
        *,
        new_block: Callable[[int], Any],
        copy_blocks: Callable[[list[int], list[int]], None],
        sequences: Callable[[], Iterable[Any]],
        watermark: int = 16,
        step: int = 64,
        wait_s: float = 30.0,
    ) -> None:
        self.pool = pool
        self.manager = manager
        self.new_block = new_block
        self.copy_blocks = copy_blocks  # (from ids, to ids): copied, and complete, when it returns
        self.sequences = sequences  # every sequence holding blocks
        self.watermark = watermark
        self.step = step
        self.wait_s = wait_s
        self.figures = Figures()
        self.growing: GrowWait | None = None
        self._asked = 0  # the blocks the grow on its way asks for
        self._retry_at = 0.0
        self._busy: bool | None = None
        self._said = 0  # the demand last reported
        pool.rows_in_use = lambda: top(self.manager)
        resize(manager, pool.tokens, new_block)

    def move_live(self, bound: int) -> int:
        """``answer_shrinks``'s hook: copy the live blocks at or past ``bound`` into free
        blocks below it; returns the blocks still in use up to the highest. Asked below
        what is live, the live blocks are packed under their count instead: the pool then
        keeps the fewest rows it can (a moved block is cheap, a kept chunk is not)."""
        moves = plan(self.manager, max(bound, len(self.manager.used_block_ids)))
        if moves:
            started = time.perf_counter()
            self.copy_blocks([s for s, _ in moves], [d for _, d in moves])
            relocate(self.manager, self.sequences(), moves)
            self.figures.move_s += time.perf_counter() - started
            self.figures.blocks_moved += len(moves)
        return top(self.manager)

    def idle(self) -> None:
        """While the engine has nothing to do: say so once, and answer shrinks."""
        self._say_busy(False, 0)
        self._collect(0.001)
        self._answer_shrinks(0)

    def before_step(self, waiting: Sequence[Any], running: Sequence[Any]) -> None:
        """At a step boundary: take an answered grow, answer shrinks, grow ahead of need,
        and wait for the grow only when the step cannot run without it."""
        self._collect(0.001)  # first: a shrink starts from the rows the pool holds
        manager = self.manager
        need = self._need(waiting, running)
        self._answer_shrinks(need)
        used = len(manager.used_block_ids)
        self._say_busy(bool(waiting or running), used + need)
        deadline = time.monotonic() + self.wait_s
        while True:
            free = len(manager.free_block_ids)
            if self.growing is None and free - need < self.watermark:
                self._grow(used + need + self.watermark, used)
            if not self._short(waiting, running):
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

    def _need(self, waiting: Sequence[Any], running: Sequence[Any]) -> int:
        """Blocks the next steps take: the waiting sequences', one for each running
        sequence about to start a block (nano-vllm's may_append)."""
        size: int = self.manager.block_size
        blocks: int = sum(seq.num_blocks for seq in waiting)
        return blocks + sum(1 for seq in running if len(seq) % size in (0, 1))

    def _short(self, waiting: Sequence[Any], running: Sequence[Any]) -> bool:
        """Whether the step cannot run as it should: nothing running and the first waiting
        sequence does not fit (nano-vllm would have nothing to schedule), or a running
        sequence would be preempted for want of a block."""
        free = len(self.manager.free_block_ids)
        if not running:
            return bool(waiting) and waiting[0].num_blocks > free
        size = self.manager.block_size
        return sum(1 for seq in running if len(seq) % size == 1) > free

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
        try:
            got = self.growing.wait(timeout)
        except DaemonTimeout:
            return
        except OutOfMemory:  # refused: nothing came free
            got = self.pool.tokens
        self.growing = None
        if got < self._asked:
            self.figures.grows_short += 1
            self._retry_at = time.monotonic() + RETRY_S
        resize(self.manager, self.pool.tokens, self.new_block)

    def _answer_shrinks(self, need: int) -> None:
        """Asked for blocks back, give back down to what the engine needs (in use, the
        next steps' ``need`` and the watermark, in grow steps), not only what was asked:
        the daemon asks for the neighbour's grow in hand, and a burst's grows come one
        after another as its requests arrive; each further ask would wait for a step of
        this engine."""
        wanted = len(self.manager.used_block_ids) + need + self.watermark
        kept = self.pool.answer_shrinks(self.move_live, down_to=-(-wanted // self.step) * self.step)
        if kept is not None:
            self.figures.shrinks += 1
            resize(self.manager, kept, self.new_block)

    def _say_busy(self, busy: bool, demand: int) -> None:
        """Report demand on a change between idle and busy, and while busy once it moved
        by ``step`` blocks from what was said (a burst's queue fills, its requests end):
        the daemon's fair share follows the engine's real need, not the figure of the
        step a burst began with. Steady decode moves it by a block now and then: no call."""
        demand = demand if busy else 0
        if busy != self._busy or abs(demand - self._said) >= self.step:
            self.pool.report_demand(demand)
            self._busy, self._said = busy, demand
