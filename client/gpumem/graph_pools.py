"""Graph pools in the daemon's registry, as their owner sees them.

After capturing CUDA graphs into an arena's pool, the owner registers the pool: its
segments (extents) and its free runs, the blocks torch's allocator holds inactive
between replays, coalesced. The daemon keeps them per pool with an epoch that every
recapture (and every change of the runs) bumps; ``gpumemctl extents`` shows them.
Leases on these pools, and borrowing their free runs, build on this registry.

The runs are free only while nothing else allocates in the arena's pool: after eager
allocations there (``arena.allocating()``), ``refresh()`` before the next borrow.
A pool registered with ``shared=True`` can be opened by clients the arena is shared
with (``session.open_graph_pool``): their view refreshes from the daemon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumem_shared import protocol as p
from gpumem.errors import InvalidArgument

if TYPE_CHECKING:
    from gpumem.arena import Arena


def extents_and_runs(segments: list[dict[str, Any]], base: int) -> tuple[list[p.Extent], list[p.Extent]]:
    """From torch's pool snapshot: every segment as an extent, and every run of adjacent
    inactive blocks as a free run, largest first. A run may sit in a segment that still
    holds live blocks, but never overlaps one."""
    extents: list[p.Extent] = []
    runs: list[p.Extent] = []
    for segment in sorted(segments, key=lambda s: s["address"]):
        extents.append(p.Extent(offset=segment["address"] - base, size=segment["total_size"]))
        start = end = -1
        for block in sorted(segment["blocks"], key=lambda b: b["address"]):
            if block["state"] == "inactive":
                if block["address"] == end:
                    end += block["size"]
                else:
                    if end > start:
                        runs.append(p.Extent(offset=start - base, size=end - start))
                    start, end = block["address"], block["address"] + block["size"]
            else:
                if end > start:
                    runs.append(p.Extent(offset=start - base, size=end - start))
                start = end = -1
        if end > start:
            runs.append(p.Extent(offset=start - base, size=end - start))
    runs.sort(key=lambda r: (-r.size, r.offset))
    return extents, runs


class GraphPool:
    """A registered graph pool: ``refresh()`` after the pool changed, with
    ``recaptured=True`` after a new capture into it."""

    def __init__(self, arena: Arena, status: p.GraphPoolStatus) -> None:
        self.arena = arena
        self.id = status.id
        self.label = status.label
        self._set(status)

    def _set(self, status: p.GraphPoolStatus) -> None:
        self.epoch = status.epoch
        self.slot = status.slot
        self.extents = status.extents
        self.free_runs = status.free_runs
        self.free_bytes = status.free_bytes
        self.shared = status.shared
        self.owner = status.owner

    @classmethod
    def register(cls, arena: Arena, label: str, *, shared: bool = False) -> GraphPool:
        if arena.session.backend == "cuda":
            # A borrower from another process may start on the runs right away: the
            # warm-up and capture work that used them must be done.
            arena.torch_pool().torch.cuda.synchronize(arena.session.device_ordinal)
        extents, runs = extents_and_runs(arena.torch_pool().segments(), arena.address)
        reply: p.GraphPoolReply = arena.session.call(
            p.RegisterGraphPool(arena=arena.name, label=label, extents=extents, free_runs=runs, shared=shared)
        )
        return cls(arena, reply.pool)

    def refresh(self, *, recaptured: bool = False) -> None:
        """The owner: report the pool's current extents and runs (``recaptured`` after a
        new capture into it). Another client: fetch the owner's latest view."""
        session = self.arena.session
        if not self.arena.is_owner:  # its owner reports captures; here the latest view is fetched
            reply: p.GraphPoolReply = session.call(p.OpenGraphPool(pool_id=self.id))
        else:
            extents, runs = extents_and_runs(self.arena.torch_pool().segments(), self.arena.address)
            reply = session.call(p.UpdateGraphPool(pool_id=self.id, extents=extents, free_runs=runs, recaptured=recaptured))
        self._set(reply.pool)

    def begin_capture(self) -> None:
        """Under the capture lease: no free runs until the capture is reported, and a new
        epoch, so every borrower's view of the old runs goes stale."""
        reply: p.GraphPoolReply = self.arena.session.call(
            p.UpdateGraphPool(pool_id=self.id, extents=list(self.extents), free_runs=[], recaptured=True)
        )
        self._set(reply.pool)

    def retire(self) -> None:
        session = self.arena.session
        borrowed = session.borrow_pools.get(self.id)
        if borrowed is not None:
            live = borrowed.live_bytes()
            if live:
                raise InvalidArgument(
                    f"graph pool {self.id} ('{self.label}') still has {live} bytes of borrowed tensors alive "
                    f"(scope '{borrowed.escaped_scope or '?'}'): free them before retiring it"
                )
            del session.borrow_pools[self.id]
            borrowed.close()
        session.call(p.RetireGraphPool(pool_id=self.id))

    def __repr__(self) -> str:
        return f"<gpumem.GraphPool {self.id} '{self.label}' epoch {self.epoch}, {len(self.free_runs)} free runs, {self.free_bytes} bytes free>"
