"""KV layout and the commit round's budget split: pure functions, no state, no I/O.

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

import math

from gpumem_shared import protocol as p

from gpumemd.records import KvBufferLayout, MemberRecord, align_up


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


def tokens_within(buffers: list[p.KvBuffer], reserve_bytes: int, granularity: int) -> int:
    """The most tokens whose laid-out window fits in ``reserve_bytes`` (0 if none does):
    rounding each region up costs a little beyond the rows themselves."""
    per_token = sum(max(b.row_bytes, 1) for b in buffers) or 1
    tokens = reserve_bytes // per_token
    if layout(buffers, tokens, granularity)[1] <= reserve_bytes:
        return tokens
    lo, hi = 0, tokens - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if layout(buffers, mid, granularity)[1] <= reserve_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


class BudgetShort(Exception):
    def __init__(self, needed: int, budget: int) -> None:
        super().__init__(f"the members' minimums need {needed} bytes, the budget is {budget}")
        self.needed = needed
        self.budget = budget


def split(members: list[MemberRecord], budget: int) -> dict[MemberRecord, int]:
    """Tokens per member: minimums first, then weighted shares of the rest, capped."""
    needed = sum(m.pool.cost(m.report.min_tokens) for m in members)
    if needed > budget:
        raise BudgetShort(needed, budget)
    tokens = {m: m.report.min_tokens for m in members}
    spare = budget - needed
    active = [m for m in members if m.report.max_tokens > m.report.min_tokens]
    # Water-filling: a member capped at its max returns the unused share to the others.
    while active and spare > 0:
        total_weight = sum(m.report.weight for m in active)
        capped = []
        for m in active:
            share = spare * m.report.weight / total_weight
            base = m.pool.cost(tokens[m])
            want = m.pool.cost(m.report.max_tokens) - base
            if want <= share:
                capped.append(m)
        if not capped:
            for m in active:
                share = math.floor(spare * m.report.weight / total_weight)
                tokens[m] = m.pool.most_tokens_within(m.pool.cost(tokens[m]) + share, m.report.max_tokens)
            break
        for m in capped:
            spare -= m.pool.cost(m.report.max_tokens) - m.pool.cost(tokens[m])
            tokens[m] = m.report.max_tokens
            active.remove(m)
    return tokens
