"""Runtime KV moves: which pools give back memory when another pool's grow does not fit.
Pure functions, no state, no I/O (the KV book applies them): the policy over figures
in bytes, and what a pool's chunks commit and free.

Each pool has a guaranteed minimum, a demand (what it wants now, capped at its maximum)
and a weight. Its fair share is the weighted max-min split of everything the pools hold
plus what is free: pools that want less than their weighted part get what they want,
and the rest is split again among the others by weight, never below a minimum. A pool
that holds more than its share may be asked to give the excess back; nothing else is.

The floor, a pool's guaranteed minimum, is defined once, by ``floor``, and every path
that could take memory from a pool for another's demand calls it: the fair split
(each Claim's minimum: no share below it; a grow's, a round's and a wake's donors all
come from it, KvBook.ask_back) and every shrink request (``shrink_bound`` never names
fewer tokens, but where the floors of a tenant's pools pass its even part across tenants:
KvBook._evened).

A demand is the engine's word, so a pool that claims more than it uses gains nothing by
it: its share is bounded by its weight whatever it claims, and what it holds above that
share stays askable. Its weight and its minimum are its engine's word too: the KV book
bounds them across tenants before the claims come here (KvBook._evened). Idle pools (nothing in use) are asked first, then the pools furthest
above their share.
"""

from __future__ import annotations

import bisect
import dataclasses

from gpumemd.records import ArenaRecord, ChunkRecord, KvPoolRecord, PendingWait


@dataclasses.dataclass(eq=False)
class PendingGrow(PendingWait):
    """A KV_GROW waiting for other pools to give back."""

    pool: KvPoolRecord
    tokens: int  # asked for
    asked: list[KvPoolRecord]  # the pools asked to give back for it
    gone: list[str] = dataclasses.field(default_factory=list)  # "client/pool" of those that went before answering
    whole: bool = False  # its wait (a wake's): answered with all its rows, or at its deadline


@dataclasses.dataclass(frozen=True)
class Claim:
    """One pool as the policy sees it, in bytes."""

    name: str
    held: int  # committed now
    minimum: int  # guaranteed: no other pool's demand pushes it below this
    demand: int  # wanted now: at least its minimum, at most its maximum
    weight: float
    idle: bool = False  # nothing in use: asked before the others


def floor(pool: KvPoolRecord) -> int:
    """The fewest tokens another pool's demand may leave ``pool``: the minimum its round's
    CAPTURE_DONE guaranteed. Its owner may shrink below it; nobody may ask it to."""
    return pool.min_tokens


def fair_shares(claims: list[Claim], total: int) -> dict[str, int]:
    """Each pool's share of ``total`` bytes: minimums first, then weighted water-filling
    capped at each demand. Shares may sum to less than ``total`` when every demand is met;
    no share is below its minimum, so nothing above a share is under a floor."""
    shares = {c.name: c.minimum for c in claims}
    spare = total - sum(shares.values())
    active = [c for c in claims if c.demand > shares[c.name]]
    while active and spare > 0:
        weight = sum(c.weight for c in active)
        met = [c for c in active if c.demand - shares[c.name] <= spare * c.weight / weight]
        if not met:
            for c in active:
                shares[c.name] += int(spare * c.weight / weight)
            break
        for c in met:
            spare -= c.demand - shares[c.name]
            shares[c.name] = c.demand
            active.remove(c)
    return shares


def donors(claims: list[Claim], total: int, taker: str, deficit: int) -> list[tuple[str, int]]:
    """(pool, bytes to give back) covering as much of ``deficit`` as the pools other than
    ``taker`` hold above their fair share (never below their minimum): idle pools first,
    then the ones furthest above their share. Less than ``deficit`` when that is all there is."""
    shares = fair_shares(claims, total)
    excess = {c.name: c.held - shares[c.name] for c in claims if c.name != taker}
    order = sorted((c for c in claims if excess.get(c.name, 0) > 0), key=lambda c: (not c.idle, -excess[c.name], c.name))
    out = []
    for c in order:
        if deficit <= 0:
            break
        give = min(excess[c.name], deficit)
        out.append((c.name, give))
        deficit -= give
    return out


def said(pool: KvPoolRecord, in_use: int) -> None:
    """Keep what the engine says it uses (-1: nothing said); no more than the rows it holds."""
    if in_use >= 0:
        pool.in_use = min(in_use, pool.tokens)


def demand(pool: KvPoolRecord, waiting: int | None) -> int:
    """Tokens the pool wants now: a waiting grow's, else the rows in use its engine
    reported (what it holds if it never did), within its minimum and its top."""
    wanted = waiting if waiting is not None else pool.in_use if pool.in_use >= 0 else pool.tokens
    return max(floor(pool), min(wanted, pool.top_tokens or pool.max_tokens))


# ------------------------------------------------------------------ a pool's chunks


def by_buffer(pool: KvPoolRecord, arena: ArenaRecord) -> list[list[ChunkRecord]]:
    """Each buffer's chunks, in one pass over the arena's: a pool may have thousands of
    buffers and as many chunks, and a scan of every chunk per buffer held the daemon's
    only thread for seconds (found by the protocol fuzzer)."""
    starts = [b.offset for b in pool.buffers]  # the layout places them in order
    out: list[list[ChunkRecord]] = [[] for _ in pool.buffers]
    for chunk in arena.chunks:
        i = bisect.bisect_right(starts, chunk.offset) - 1
        if i >= 0 and chunk.offset < pool.buffers[i].offset + pool.buffers[i].region:
            out[i].append(chunk)
    return out


def missing(pool: KvPoolRecord, arena: ArenaRecord, tokens: int) -> list[tuple[int, int]]:
    """(offset, size) still to commit so every buffer holds ``tokens`` rows."""
    out = []
    for buffer, mine in zip(pool.buffers, by_buffer(pool, arena)):
        have = max((c.offset + c.size for c in mine), default=buffer.offset)
        want = buffer.offset + pool.prefix(buffer, tokens)
        if want > have:
            out.append((have, want - have))
    return out


def freeable(pool: KvPoolRecord, arena: ArenaRecord, tokens: int) -> int:
    """Bytes KV_SHRINK to ``tokens`` would give back: the chunks past every buffer's bound."""
    freed = 0
    for buffer, mine in zip(pool.buffers, by_buffer(pool, arena)):
        bound = buffer.offset + pool.prefix(buffer, tokens)
        freed += sum(c.size for c in mine if c.offset >= bound)
    return freed


def shrink_bound(pool: KvPoolRecord, arena: ArenaRecord, give: int, least: int | None = None) -> int:
    """The most tokens (not below the pool's floor, or ``least`` where another tenant's
    need bounds it lower) a shrink to which frees ``give`` bytes: a shrink gives back
    whole chunks only, so count what chunk boundaries free. Asked for more than its
    ``spare``, the pool is asked for its floor."""
    lo, hi = floor(pool) if least is None else min(least, floor(pool)), pool.tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if freeable(pool, arena, mid) >= give:
            lo = mid
        else:
            hi = mid - 1
    return lo


def need(pool: KvPoolRecord, arena: ArenaRecord, tokens: int) -> int:
    return sum(size for _, size in missing(pool, arena, tokens))


def most_within(pool: KvPoolRecord, arena: ArenaRecord, tokens: int, available: int) -> int:
    """The most tokens (from the pool's own up to ``tokens``) whose missing chunks fit."""
    lo, hi = pool.tokens, tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(pool, arena, mid) <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo
