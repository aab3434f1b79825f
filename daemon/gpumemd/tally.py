"""What the daemon counts for its metrics: plain integers and fixed-bucket histograms,
owned and written by the daemon's one thread only.

No other thread reads these: the metrics snapshot (metrics.py) copies them, on the
daemon's thread, into immutable values that the exporter's thread serves. So nothing
here needs a lock, and counting costs the control path a dict update per request.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from gpumem_shared import protocol as p

# Seconds. Reclaiming a dead client is driver calls (milliseconds on CUDA); a KV round
# lasts from its first join, through the engines' graph capture, to its commit.
RECLAIM_BOUNDS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
MOVE_BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)  # a grow's wait for others' shrinks
ROUND_BOUNDS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    """Observations counted per bucket (upper bounds, inclusive), with their sum."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one past every bound: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


@dataclasses.dataclass(eq=False)
class Tally:
    # Requests served, by message class: a defaultdict's ``+= 1`` stays in C, the
    # cheapest count the control path can pay. Refused ones by class and error code.
    served: collections.defaultdict[type[p.RequestMessage], int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
    refused: dict[tuple[type[p.RequestMessage], int], int] = dataclasses.field(default_factory=dict)
    sessions_opened: int = 0
    # Sessions that ended still attached to arenas (the client died, or closed without
    # releasing): the daemon took back what they held.
    sessions_reclaimed: int = 0
    reclaimed_bytes: int = 0  # accounted bytes those ends gave back to the device
    reclaim_seconds: Histogram = dataclasses.field(default_factory=lambda: Histogram(RECLAIM_BOUNDS))
    rounds: dict[p.RoundState, int] = dataclasses.field(default_factory=dict)  # ended rounds, by final state
    round_seconds: Histogram = dataclasses.field(default_factory=lambda: Histogram(ROUND_BOUNDS))
    last_round_budget: int = 0  # the budget and what was committed, of the last round measured
    last_round_committed: int = 0
    # Graph pool id -> its lease slot's release count when the pool was registered, so
    # that leases are counted from the registration on (metrics.py reads the rest).
    escapes: dict[int, int] = dataclasses.field(default_factory=dict)  # graph pool id -> escapes reported
    # Runtime KV moves: grows that had to wait for other pools, KV_SHRINK notices sent for
    # grows and rounds, shrinks that answered one, and the waiting grows' ends: got all
    # they asked, got part, got nothing; bytes they got and how long they waited.
    kv_grows_deferred: int = 0
    kv_shrinks_asked: int = 0
    kv_shrinks_confirmed: int = 0
    kv_grows_satisfied: int = 0
    kv_grows_partial: int = 0
    kv_grows_refused: int = 0
    kv_moved_bytes: int = 0
    kv_move_seconds: Histogram = dataclasses.field(default_factory=lambda: Histogram(MOVE_BOUNDS))

    def refuse(self, cls: type[p.RequestMessage], code: int) -> None:
        key = (cls, code)
        self.refused[key] = self.refused.get(key, 0) + 1

    def requests(self) -> list[tuple[type[p.RequestMessage], int, int]]:
        """(message class, error code: 0 when served, count), by type then code."""
        rows = [(cls, 0, n) for cls, n in self.served.items()] + [(cls, code, n) for (cls, code), n in self.refused.items()]
        return sorted(rows, key=lambda row: (row[0].TYPE, row[1]))

    def round_ended(self, state: p.RoundState, seconds: float, budget: p.RoundBudget) -> None:
        self.rounds[state] = self.rounds.get(state, 0) + 1
        self.round_seconds.observe(seconds)
        if budget != p.RoundBudget():  # measured (a round that failed before measuring has none)
            self.last_round_budget = budget.budget
            self.last_round_committed = budget.committed

    def kv_grew(self, full: bool, moved: int, seconds: float) -> None:
        if full:
            self.kv_grows_satisfied += 1
        else:
            self.kv_grows_partial += 1
        self.kv_moved_bytes += moved
        self.kv_move_seconds.observe(seconds)
