"""The block manager following the KV pool, over the port's block methods (an
``EngineAdapter``'s ``block_count`` .. ``step_need``): grows ahead of need, answers the
daemon's shrinks with live blocks moved down first, says its demand. The same policy as
gpumem.integrations.nanovllm_blocks, written against the adapter; it gives way to the
port's follower (gpumem.port.blocks) once that one takes an adapter.
"""

from __future__ import annotations

import time
from typing import Any

from gpumem.errors import DaemonTimeout, OutOfMemory
from gpumem.kv_pool import GrowWait, KvPool


class Follower:
    def __init__(self, pool: KvPool, adapter: Any, *, watermark: int = 16, step: int = 64, wait_s: float = 30.0) -> None:
        self.pool, self.adapter = pool, adapter
        self.watermark, self.step, self.wait_s = watermark, step, wait_s
        self.growing: GrowWait | None = None
        self.said = -1
        self.moved = 0
        pool.rows_in_use = lambda: max(adapter.used_blocks(), default=1) + 1

    def move_live(self, bound: int) -> int:
        """``answer_shrinks``'s hook: live blocks at or past ``bound`` copied into free
        blocks below it (packed under their count when asked below it)."""
        a = self.adapter
        used = a.used_blocks()
        bound = max(bound, len(used) + 2)
        moves = list(zip(sorted((i for i in used if i >= bound), reverse=True), sorted(i for i in a.free_blocks() if i < bound)))
        if moves:
            a.copy_blocks([s for s, _ in moves], [d for _, d in moves])
            a.relocate_blocks(moves)
            self.moved += len(moves)
        return max(a.used_blocks(), default=1) + 1

    def _collect(self, timeout: float) -> None:
        if self.growing is None:
            return
        try:
            self.growing.wait(timeout)
        except DaemonTimeout:
            return
        except OutOfMemory:  # refused: nothing came free; the next step asks again
            pass
        self.growing = None
        self.adapter.resize_blocks(self.pool.tokens)

    def before_step(self) -> None:
        """At a step boundary (and while idle): take an answered grow, answer shrinks,
        grow ahead of need, and wait for the grow only when the step cannot run without it."""
        a, pool = self.adapter, self.pool
        self._collect(0.001)
        need = a.step_need()
        used = len(a.used_blocks())
        kept = pool.answer_shrinks(self.move_live, down_to=-(-(used + need.blocks + self.watermark + 2) // self.step) * self.step)
        if kept is not None:
            a.resize_blocks(kept)
        demand = used + need.blocks if need.busy else 0
        if abs(demand - self.said) >= self.step or (demand == 0) != (self.said == 0):
            pool.report_demand(demand)
            self.said = demand
        free = len(a.free_blocks())
        target = min(pool.max_tokens, -(-(used + need.blocks + self.watermark + 2) // self.step) * self.step)
        if self.growing is None and free - need.blocks < self.watermark and target > pool.tokens:
            self.growing = pool.send_grow(target, in_use=used)
        if need.short and self.growing is not None:
            started = time.monotonic()
            self._collect(self.wait_s)
            if self.growing is not None:
                raise OutOfMemory(f"KV pool '{pool.name}': no grow answered within {self.wait_s:g}s (waited {time.monotonic() - started:.1f}s)")
