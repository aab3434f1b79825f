"""KV pools and post-capture commit rounds: layout and budget math, no I/O.

A KV pool is an arena laid out as buffers (typically K and V per layer), each a run of
token rows, so the first N rows of a buffer are a byte prefix of its region. A pool is
committed N tokens at a time: the prefix of every buffer, rounded up to the device
granularity, the same N across the pool's buffers.

A commit round gathers the pools of the engines that share a GPU. Each captures its
CUDA graphs on placeholder backing and reports capture-done with what it needs besides
KV. Once every member has reported (or the deadline passed), the daemon measures free
memory, takes off the reserve and the members' headroom, and splits the rest:

1. every member gets its ``min_tokens``; if the budget cannot cover them, pools
   committed in earlier rounds are asked to shrink (never forced), else the round fails;
2. what is left is shared in proportion to the members' weights, in bytes, each capped
   at its ``max_tokens``; what a capped member cannot use goes back to the others;
3. each member's tokens are the most whose rounded cost fits its share.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gpumem_shared import protocol as p


@dataclasses.dataclass(eq=False)
class KvBufferLayout:
    name: str
    row_bytes: int
    offset: int  # from the arena's base, granularity-aligned
    region: int  # bytes reserved for max_tokens rows, granularity-aligned


@dataclasses.dataclass(eq=False)
class KvPool:
    name: str  # also its arena's name
    owner_id: int
    buffers: list[KvBufferLayout]
    max_tokens: int  # the declared bound: every region holds this many rows
    granularity: int
    tokens: int = 0  # committed rows per buffer
    min_tokens: int = 0  # from its round's capture-done, kept for shrink requests
    shrink_request: int | None = None  # tokens the daemon asked it to shrink to

    @property
    def bytes_per_token(self) -> int:
        return sum(b.row_bytes for b in self.buffers)

    def prefix(self, buffer: KvBufferLayout, tokens: int) -> int:
        return align_up(tokens * buffer.row_bytes, self.granularity)

    def cost(self, tokens: int) -> int:
        """Bytes committed for ``tokens`` rows in every buffer."""
        return sum(self.prefix(b, tokens) for b in self.buffers)

    def ranges(self, tokens: int) -> list[tuple[int, int]]:
        """(offset, size) of every buffer's committed prefix at ``tokens`` rows."""
        return [(b.offset, self.prefix(b, tokens)) for b in self.buffers if self.prefix(b, tokens)]

    def most_tokens_within(self, nbytes: int, cap: int) -> int:
        """The most tokens (<= cap) whose cost fits in ``nbytes``."""
        if self.cost(cap) <= nbytes:
            return cap
        lo, hi = 0, cap  # cost(lo) fits, cost(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.cost(mid) <= nbytes:
                lo = mid
            else:
                hi = mid
        return lo

    def view(self, arena: p.ArenaView) -> p.KvPoolView:
        return p.KvPoolView(
            name=self.name,
            arena=arena,
            buffers=[p.KvBufferView(name=b.name, offset=b.offset, row_bytes=b.row_bytes, region_bytes=b.region) for b in self.buffers],
            max_tokens=self.max_tokens,
            tokens=self.tokens,
            bytes_per_token=self.bytes_per_token,
        )


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def layout(buffers: list[p.KvBuffer], max_tokens: int, granularity: int) -> tuple[list[KvBufferLayout], int]:
    """Place each buffer's region at an aligned offset; returns the layouts and the
    window size. Refuses inconsistent descriptors with INVALID_ARGUMENT."""
    if not buffers:
        raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "a KV pool needs at least one buffer")
    names: set[str] = set()
    out: list[KvBufferLayout] = []
    offset = 0
    for b in buffers:
        if b.name in names:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV buffer name '{b.name}' appears twice")
        names.add(b.name)
        if b.row_bytes <= 0:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV buffer '{b.name}' has a row of {b.row_bytes} bytes")
        align = b.align or 1
        if align & (align - 1) or align > granularity:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV buffer '{b.name}' alignment {b.align} is not a power of two up to the granularity {granularity}",
            )
        if b.row_bytes % align:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV buffer '{b.name}' rows of {b.row_bytes} bytes break its {align}-byte alignment from the second row on",
            )
        region = align_up(max_tokens * b.row_bytes, granularity)
        out.append(KvBufferLayout(name=b.name, row_bytes=b.row_bytes, offset=offset, region=region))
        offset += region
    return out, offset


@dataclasses.dataclass(eq=False)
class Member:
    pool: KvPool
    session_id: int
    client: str
    reported: bool = False
    headroom_bytes: int = 0
    graph_pool_bytes: int = 0
    min_tokens: int = 0
    max_tokens: int = 0
    weight: float = 1.0
    request_id: int = 0  # the deferred CAPTURE_DONE to answer
    tokens: int = 0
    bytes: int = 0
    # Chunks for its min_tokens, created and zeroed while the round waits for others
    # (the daemon's Chunk objects): what the last report has to wait for shrinks.
    staged: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Round:
    id: int
    created: float  # monotonic
    deadline: float  # monotonic
    policy: str  # "fail" | "partial"
    state: str = "open"  # open | awaiting-shrink | committed | failed
    expect: int = 0  # members to wait for before committing
    joined: int = 0  # members that ever joined (dropped ones included)
    members: list[Member] = dataclasses.field(default_factory=list)
    dropped: list[str] = dataclasses.field(default_factory=list)  # "client/pool: why"
    budget: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""

    def member(self, pool: str) -> Member | None:
        return next((m for m in self.members if m.pool.name == pool), None)

    @property
    def pending(self) -> list[Member]:
        return [m for m in self.members if not m.reported]


class BudgetShort(Exception):
    def __init__(self, needed: int, budget: int) -> None:
        super().__init__(f"the members' minimums need {needed} bytes, the budget is {budget}")
        self.needed = needed
        self.budget = budget


def split(members: list[Member], budget: int) -> dict[Member, int]:
    """Tokens per member: minimums first, then weighted shares of the rest, capped."""
    needed = sum(m.pool.cost(m.min_tokens) for m in members)
    if needed > budget:
        raise BudgetShort(needed, budget)
    tokens = {m: m.min_tokens for m in members}
    spare = budget - needed
    active = [m for m in members if m.max_tokens > m.min_tokens]
    # Water-filling: a member capped at its max returns the unused share to the others.
    while active and spare > 0:
        total_weight = sum(m.weight for m in active)
        capped = []
        for m in active:
            share = spare * m.weight / total_weight
            base = m.pool.cost(tokens[m])
            want = m.pool.cost(m.max_tokens) - base
            if want <= share:
                capped.append(m)
        if not capped:
            for m in active:
                share = math.floor(spare * m.weight / total_weight)
                tokens[m] = m.pool.most_tokens_within(m.pool.cost(tokens[m]) + share, m.max_tokens)
            break
        for m in capped:
            spare -= m.pool.cost(m.max_tokens) - m.pool.cost(tokens[m])
            tokens[m] = m.max_tokens
            active.remove(m)
    return tokens
