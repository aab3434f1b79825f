"""Graph pools in the daemon's registry, as their owner sees them.

After capturing CUDA graphs into an arena's pool, the owner registers the pool: its
segments (extents) and its free runs, the blocks torch's allocator holds inactive
between replays, coalesced. The daemon keeps them per pool with an epoch that every
recapture (and every change of the runs) bumps; ``gpumemctl graph-pools`` shows them.
Leases on these pools, and borrowing their free runs, build on this registry.

The runs are free only while nothing else allocates in the arena's pool: after eager
allocations there (``arena.allocating()``), ``refresh()`` before the next borrow.
A pool registered with ``shared=True`` can be opened by clients the arena is shared
with (``session.open_graph_pool``): their view refreshes from the daemon.

Registering or opening a pool brings its lease segment (gpumem.leases): the page of
shared memory its lease slot lives in, which the daemon grants only to the pool's
owner and to the sessions that open it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import LeaseSegment
from gpumem.errors import BadMessage, InvalidArgument, NotFound

if TYPE_CHECKING:
    from gpumem.arena import Arena
    from gpumem.core import SessionCore

# What a caller may give for extents and free runs: gpumem.Extent, or (offset, size).
ExtentLike: TypeAlias = p.Extent | tuple[int, int]


def as_extents(given: Sequence[ExtentLike] | None, what: str) -> list[p.Extent]:
    """``given`` as wire extents; anything else is refused here, in Python's terms,
    rather than as a wire error naming a field the caller never wrote."""
    if given is None:
        return []
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise InvalidArgument(f"{what} must be a list of gpumem.Extent or (offset, size) pairs, not {type(given).__name__}")
    extents: list[p.Extent] = []
    for item in given:
        if isinstance(item, p.Extent):
            extents.append(item)
            continue
        pair = tuple(item) if isinstance(item, (tuple, list)) else ()
        if len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in pair):
            raise InvalidArgument(f"{what}: {item!r} is neither a gpumem.Extent nor an (offset, size) pair of ints")
        extents.append(p.Extent(offset=pair[0], size=pair[1]))
    return extents


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


def granted_segment(reply: p.GraphPoolReply, fds: dict[int, int]) -> LeaseSegment:
    """The lease segment that came with ``reply`` (register, open), mapped. Every
    descriptor in ``fds`` is closed: the mapping keeps the segment."""
    fd = fds.pop(reply.pool.id, None)
    try:
        if fd is None:
            raise BadMessage(f"gpumemd granted graph pool {reply.pool.id} without its lease segment")
        try:
            return LeaseSegment(fd)
        except ValueError as exc:
            raise BadMessage(f"the lease segment of graph pool {reply.pool.id}: {exc}") from None
    finally:
        fdchannel.close_all(list(fds.values()) + ([] if fd is None else [fd]))


class GraphPool:
    """A registered graph pool: ``refresh()`` after the pool changed, with
    ``recaptured=True`` after a new capture into it."""

    def __init__(self, arena: Arena, status: p.GraphPoolStatus, segment: LeaseSegment) -> None:
        self.arena = arena
        self.id = status.id
        self.label = status.label
        # This session's mapping of the pool's lease slot. Every lease on the pool calls
        # into it (and keeps it mapped while held).
        self.segment = segment
        self._set(status)

    def _set(self, status: p.GraphPoolStatus) -> None:
        self.epoch = status.epoch
        self.extents = status.extents
        self.free_runs = status.free_runs
        self.free_bytes = status.free_bytes
        self.shared = status.shared
        self.owner = status.owner

    @classmethod
    def register(
        cls,
        arena: Arena,
        label: str,
        *,
        shared: bool = False,
        extents: Sequence[ExtentLike] | None = None,
        free_runs: Sequence[ExtentLike] | None = None,
    ) -> GraphPool:
        """Register the arena's torch pool, or, with ``extents`` (and ``free_runs``), a
        pool laid out by other means, whose GPU work that used the runs is done. Each
        extent or run is a gpumem.Extent or an (offset, size) pair, from the arena's base."""
        if extents is not None:
            extents, free_runs = as_extents(extents, "extents"), as_extents(free_runs, "free_runs")
        else:
            if arena.core.backend == "cuda":
                # A borrower from another process may start on the runs right away: the
                # warm-up and capture work that used them must be done.
                arena.torch_pool().torch.cuda.synchronize(arena.core.device_ordinal)
            extents, free_runs = extents_and_runs(arena.torch_pool().segments(), arena.address)
        reply, fds = arena.core.channel.call(
            p.RegisterGraphPool(arena=arena.name, label=label, extents=list(extents), free_runs=list(free_runs or []), shared=shared)
        )
        if reply.order_lane >= 0:  # memops ordering: the lane and the sequence chunk came too
            arena.core.leasing.ordered_by(reply, fds)
        return cls(arena, reply.pool, granted_segment(reply, fds))

    @classmethod
    def open(cls, core: SessionCore, pool_id: int = 0, *, owner: str = "", label: str = "") -> GraphPool:
        """``Session.open_graph_pool``: another client's shared pool, by id or by owner
        and label, in an arena attached in this session."""
        reply, fds = core.channel.call(p.OpenGraphPool(pool_id=pool_id, owner=owner, label=label))
        if reply.order_lane >= 0:
            core.leasing.ordered_by(reply, fds)
        segment = granted_segment(reply, fds)
        arena = core.arenas.get(reply.pool.arena)
        if arena is None:
            segment.close()
            raise NotFound(f"graph pool {reply.pool.id} lives in arena '{reply.pool.arena}': attach it first (attach_arena)")
        return cls(arena, reply.pool, segment)

    def refresh(self, *, recaptured: bool = False) -> None:
        """The owner: report the pool's current extents and runs (``recaptured`` after a
        new capture into it). Another client: fetch the owner's latest view."""
        core = self.arena.core
        if not self.arena.is_owner:  # its owner reports captures; here the latest view is fetched
            reply, fds = core.channel.call(p.OpenGraphPool(pool_id=self.id))
            fdchannel.close_all(list(fds.values()))  # the segment again: this pool maps it already
        else:
            extents, runs = extents_and_runs(self.arena.torch_pool().segments(), self.arena.address)
            reply = core.call(p.UpdateGraphPool(pool_id=self.id, extents=extents, free_runs=runs, recaptured=recaptured))
        self._set(reply.pool)

    def begin_capture(self) -> None:
        """Under the capture lease: no free runs until the capture is reported, and a new
        epoch, so every borrower's view of the old runs goes stale."""
        reply: p.GraphPoolReply = self.arena.core.call(
            p.UpdateGraphPool(pool_id=self.id, extents=list(self.extents), free_runs=[], recaptured=True)
        )
        self._set(reply.pool)

    def retire(self) -> None:
        core = self.arena.core
        borrowed = core.borrow_pools.get(self.id)
        if borrowed is not None:
            live = borrowed.live_bytes()
            if live:
                raise InvalidArgument(
                    f"graph pool {self.id} ('{self.label}') still has {live} bytes of borrowed tensors alive "
                    f"(scope '{borrowed.escaped_scope or '?'}'): free them before retiring it"
                )
            core.close_borrow_pool(self.id)
        core.call(p.RetireGraphPool(pool_id=self.id))

    def __repr__(self) -> str:
        return f"<gpumem.GraphPool {self.id} '{self.label}' epoch {self.epoch}, {len(self.free_runs)} free runs, {self.free_bytes} bytes free>"
