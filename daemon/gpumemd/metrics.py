"""The daemon's metrics, as an immutable snapshot rebuilt on the daemon's own thread.

The server calls ``refresh`` after each tick's work (at most every tick interval). It
reads the lease table, and rebuilds the snapshot only when something changed: a
request or a session came or went, a round ended, the device's free memory moved, a
lease was taken, waited for or given back. ``snapshot`` is replaced whole and never
mutated: the exporter's thread (exporter.py) reads the attribute once per scrape and
renders what it got, so the daemon's thread takes no lock and never waits on a scrape.
The counters themselves are plain integers the daemon's thread keeps (tally.py).

Leases: their fast path (take, give back) never reaches the daemon. What it can read
honestly is the lease table, on each tick, for every registered graph pool:

- releases: every release, and every clear, bumps the slot's futex word by one;
  the count since the pool was registered is the leases on it that ended (given back
  by the holder, undone by a taker that found a new epoch, or swept by the daemon).
  A lease still held is counted when it ends.
- waiters: processes asleep on the slot at the tick, waiting for its holder.
- conflicts: holders seen at a tick with processes asleep behind them, each holder
  counted once. A lower bound: a holder that lets go within a tick is never seen.
- wait seconds: for each such holder, how long it had held the lease at the last tick
  that still saw processes asleep behind it: a lower bound on the longest wait it caused.
- escapes: ESCAPE reports the daemon accepted (exact), and the clients whose borrowed
  tensors are out past their scope now. Borrowed bytes live in the borrower's process;
  the daemon knows only what can be borrowed: the pool's free runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import time
from typing import Literal

from gpumem_shared import __version__
from gpumem_shared import protocol as p
from gpumem_shared.lease_order import LeaseOrdering
from gpumem_shared.lease_table import LeaseKind

from gpumemd.state import DaemonState
from gpumemd.tally import Histogram

# Seconds a holder held the lease it kept others asleep on (see the module's docstring).
WAIT_BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_U32 = 0xFFFFFFFF

_COMMITS = (p.CommitArena, p.KvGrow)
_DECOMMITS = (p.DecommitArena, p.KvShrink)

Kind = Literal["gauge", "counter", "histogram"]


@dataclasses.dataclass(frozen=True)
class HistogramValue:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket, not cumulative; the last one past every bound
    sum: float

    @classmethod
    def of(cls, histogram: Histogram) -> HistogramValue:
        return cls(histogram.bounds, tuple(histogram.counts), histogram.sum)


Sample = tuple[tuple[str, ...], float | HistogramValue]  # label values, value


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as exposed: counters end in _total
    kind: Kind
    help: str
    labels: tuple[str, ...]
    samples: tuple[Sample, ...]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    families: tuple[Family, ...]


@dataclasses.dataclass(eq=False)
class _LeaseWatch:
    """What the daemon's thread keeps between ticks about one graph pool's lease slot."""

    word: int  # the slot's futex word when last read
    releases: int = 0
    waiters: int = 0
    held: int = 0  # the holder's kind at the last tick, 0 when free
    conflicts: int = 0
    blocking: tuple[int, int, int, int] | None = None  # the holder others sleep behind: kind, session, pid, since
    blocked_for: float = 0.0  # how long it had held the lease at the last tick that saw it
    waits: Histogram = dataclasses.field(default_factory=lambda: Histogram(WAIT_BOUNDS))


# Every series carries the device as DCGM exporter labels it (``gpu``: the index, ``UUID``),
# so gpumemd's series join DCGM's with on(gpu) or on(UUID), whichever the dashboard keys by.
DEVICE_LABELS = ("gpu", "UUID")


class _Families:
    """Collects the families of one snapshot; every one carries the device's labels. A
    family equal to the one in the snapshot before is that same object, so the exporter
    renders only the families that changed."""

    def __init__(self, device: tuple[str, str], before: Snapshot | None) -> None:
        self.device = device
        self.before = {f.name: f for f in before.families} if before is not None else {}
        self.out: list[Family] = []

    def add(self, name: str, kind: Kind, help: str, labels: tuple[str, ...], samples: list[Sample]) -> None:
        family = Family(name, kind, help, (*DEVICE_LABELS, *labels), tuple(((*self.device, *values), v) for values, v in samples))
        same = self.before.get(name)
        self.out.append(same if same == family else family)

    def one(self, name: str, kind: Kind, help: str, value: float | HistogramValue) -> None:
        self.add(name, kind, help, (), [((), value)])


class Metrics:
    """``hide_names``: the labels that name tenants (client, arena, KV pool, graph pool
    label) carry a keyed digest of the name instead: the same name the same digest while
    the daemon runs, so series stay apart and join, but nobody without the daemon's key
    can tell which tenant it is (or test a guess at a name)."""

    def __init__(self, state: DaemonState, hide_names: bool = False) -> None:
        self.state = state
        self._key = os.urandom(16) if hide_names else b""
        self._started = state.wall_clock() - (state.clock() - state.started)
        self._watch: dict[int, _LeaseWatch] = {}
        self._seen: tuple[object, ...] = ()
        self.snapshot = self._build(state.arenas.free_bytes(), None)

    def refresh(self) -> None:
        """On the daemon's thread: read the lease table; publish a new snapshot if
        anything changed since the last one."""
        leases_moved = self._watch_leases()
        free = self.state.arenas.free_bytes()
        tally = self.state.tally
        seen = (
            sum(tally.served.values()),
            sum(tally.refused.values()),
            tally.sessions_opened,
            len(self.state.sessions),
            sum(tally.rounds.values()),
            tally.kv_shrinks_asked + tally.kv_grows_refused + tally.kv_move_seconds.count,  # moves answered at a tick
            free,
            self.state.stopping,
            self._lanes(),  # a tick settles swept lanes: no request tells of it
        )
        if leases_moved or seen != self._seen:
            self._seen = seen
            self.snapshot = self._build(free, self.snapshot)

    # ------------------------------------------------------------------ leases

    def _watch_leases(self) -> bool:
        graph_pools = self.state.graph_pools
        now = time.time()  # holders stamp the slot with CLOCK_REALTIME
        moved = False
        for pool in graph_pools.by_id.values():
            watch = self._watch.get(pool.id)
            if watch is None:  # its segment is new at registration: counted from 0, no lease missed
                watch = self._watch[pool.id] = _LeaseWatch(word=0)
                moved = True
            segment = pool.segment
            word = segment.releases()
            ended = (word - watch.word) & _U32  # the word wraps; a tick sees far fewer than 2**32
            waiters = segment.waiters()
            holder = segment.holder()
            held = holder.kind if holder is not None else 0
            if ended or waiters != watch.waiters or held != watch.held:
                moved = True
            watch.word, watch.releases = word, watch.releases + ended
            watch.waiters, watch.held = waiters, held
            if waiters and holder is not None:
                key = (holder.kind, holder.session, holder.pid, holder.since_ns)
                if key != watch.blocking:
                    if watch.blocking is not None:
                        watch.waits.observe(watch.blocked_for)
                    watch.blocking = key
                    watch.conflicts += 1
                    moved = True
                # A client writes since_ns: a clock it got wrong must not make a negative wait.
                watch.blocked_for = max(0.0, now - holder.since_ns / 1e9)
            elif watch.blocking is not None:
                watch.waits.observe(watch.blocked_for)
                watch.blocking = None
                moved = True
        for gone in self._watch.keys() - graph_pools.by_id.keys():
            del self._watch[gone]
            moved = True
        return moved

    def _lanes(self) -> tuple[int, int] | None:
        """Memops ordering's lanes and those in use; None under IPC events."""
        order = self.state.graph_pools.order
        return None if order is None else (order.lanes.lanes, order.lanes.in_use())

    # ------------------------------------------------------------------ the snapshot

    def _name(self, name: str) -> str:
        if not self._key:
            return name
        return hmac.new(self._key, name.encode(), hashlib.sha256).hexdigest()[:16]

    def _build(self, free: int, before: Snapshot | None) -> Snapshot:
        state, tally = self.state, self.state.tally
        arenas, device = state.arenas, state.device
        f = _Families((str(device.index), device.uuid), before)

        f.add(
            "gpumemd_info", "gauge", "The daemon: version, backend, and the device it serves (always 1).",
            ("version", "backend", "modelName"), [((__version__, state.driver.kind, device.name), 1)],
        )
        f.one(
            "gpumemd_daemon_generation", "gauge",
            "Daemon generation: 0 at a fresh start, one more with each restart that rebuilt the state from the fd store "
            "(the generation gpumemctl status --json shows).",
            state.session_desk.generation,
        )
        f.one("gpumemd_start_time_seconds", "gauge", "When the daemon started, unix time.", self._started)

        retiring = sum(c.size for c in arenas.retiring.values())
        f.one("gpumemd_device_total_bytes", "gauge", "The device's memory.", device.total_bytes)
        f.one("gpumemd_device_free_bytes", "gauge", "Free device memory: measured (cuMemGetInfo) on CUDA, capacity less held on host.", free)
        f.one("gpumemd_device_held_bytes", "gauge", "Memory the daemon created and someone still holds (committed, placeholders, retiring).", arenas.accounted_bytes())
        f.one("gpumemd_device_reserve_bytes", "gauge", "Memory the daemon never commits (--reserve).", arenas.config.reserve_bytes)
        f.one("gpumemd_device_retiring_bytes", "gauge", "Memory taken out of arenas that some client still maps.", retiring)

        f.one("gpumemd_sessions", "gauge", "Client sessions open now.", len(state.sessions))
        f.one("gpumemd_sessions_opened_total", "counter", "Client sessions opened.", tally.sessions_opened)
        f.one(
            "gpumemd_sessions_reclaimed_total", "counter",
            "Sessions that ended still attached to arenas (the client died, or closed without releasing): the daemon took back what they held.",
            tally.sessions_reclaimed,
        )
        f.one("gpumemd_reclaimed_bytes_total", "counter", "Held bytes those sessions' ends gave back to the device.", tally.reclaimed_bytes)
        f.one("gpumemd_reclaim_seconds", "histogram", "Time the daemon took to take back what an ended session held.", HistogramValue.of(tally.reclaim_seconds))

        owned: dict[str, int] = {s.name: 0 for s in state.sessions.values()}
        for arena in arenas.by_name.values():
            if arena.owner_id in state.sessions:
                owned[arena.owner_name] += arena.committed
        f.add("gpumemd_client_committed_bytes", "gauge", "Committed bytes of the arenas (KV pools included) each live client owns.",
              ("client",), [((self._name(name),), n) for name, n in sorted(owned.items())])
        caps = arenas.caps.status()  # tenants are uids, gids and the operator's names for tokens: no client's names to hide
        f.add("gpumemd_tenant_cap_bytes", "gauge", "Each capped tenant's maximum of device memory (--tenant-policy, DRA claims); -1: none.",
              ("tenant",), [((c.tenant,), c.max_bytes) for c in caps])
        f.add("gpumemd_tenant_min_bytes", "gauge", "Each capped tenant's guaranteed minimum of device memory.",
              ("tenant",), [((c.tenant,), c.min_bytes) for c in caps])
        f.add("gpumemd_tenant_used_bytes", "gauge", "Device memory each capped tenant holds (above its cap after a lowering: nothing is taken away).",
              ("tenant",), [((c.tenant,), c.used_bytes) for c in caps])
        by_arena = sorted(arenas.by_name.values(), key=lambda a: a.name)
        arena_labels = ("arena", "client")
        named = {a.name: (self._name(a.name), self._name(a.owner_name)) for a in by_arena}
        f.add("gpumemd_arena_committed_bytes", "gauge", "Committed bytes of each arena; client is its owner.", arena_labels,
              [(named[a.name], a.committed) for a in by_arena])
        f.add("gpumemd_arena_reserved_bytes", "gauge", "Virtual window of each arena.", arena_labels,
              [(named[a.name], a.reserved) for a in by_arena])
        f.add("gpumemd_arena_placeholder_bytes", "gauge", "Placeholder chunks each arena's owner aliases over uncommitted space.", arena_labels,
              [(named[a.name], sum(c.size for c in a.placeholders)) for a in by_arena])
        f.add("gpumemd_arena_retiring_bytes", "gauge", "Bytes taken out of each arena that some client still maps.", arena_labels,
              [(named[a.name], sum(c.size for c in arenas.retiring.values() if c.arena == a.name)) for a in by_arena])

        requests = tally.requests()
        f.add("gpumemd_requests_total", "counter", "Control requests served, by message type and outcome (ok, or the error code).",
              ("type", "outcome"), [((cls.TYPE.name.lower(), _outcome(code)), n) for cls, code, n in requests])
        f.one("gpumemd_commits_total", "counter", "Commits served (arena commits and KV pool grows).",
              sum(n for cls, code, n in requests if cls in _COMMITS and code == 0))
        refused: dict[str, int] = {}
        for cls, code, n in requests:
            if cls in _COMMITS and code != 0:
                refused[_outcome(code)] = refused.get(_outcome(code), 0) + n
        f.add("gpumemd_commits_refused_total", "counter", "Commits refused, by reason (the error code: out_of_memory, invalid_argument, ...).",
              ("reason",), [((reason,), n) for reason, n in sorted(refused.items())])
        f.one("gpumemd_decommits_total", "counter", "Decommits served (arena decommits and KV pool shrinks).",
              sum(n for cls, code, n in requests if cls in _DECOMMITS and code == 0))

        kv = state.kv
        f.add("gpumemd_kv_rounds_total", "counter", "KV commit rounds that ended, by outcome.", ("outcome",),
              [((str(s),), tally.rounds.get(s, 0)) for s in (p.RoundState.COMMITTED, p.RoundState.FAILED)])
        f.one("gpumemd_kv_rounds_active", "gauge", "KV commit rounds open or waiting for shrinks.", len(kv.active_rounds()))
        f.one("gpumemd_kv_round_duration_seconds", "histogram", "KV rounds from their first join to their commit or failure.",
              HistogramValue.of(tally.round_seconds))
        f.one("gpumemd_kv_round_budget_bytes", "gauge", "The budget of the last KV round measured: free - reserve - headroom.", tally.last_round_budget)
        f.one("gpumemd_kv_round_committed_bytes", "gauge", "What the last KV round measured committed (0 if it failed).", tally.last_round_committed)
        moves = (("grow_deferred", tally.kv_grows_deferred), ("shrink_asked", tally.kv_shrinks_asked),
                 ("shrink_confirmed", tally.kv_shrinks_confirmed), ("grow_satisfied", tally.kv_grows_satisfied),
                 ("grow_partial", tally.kv_grows_partial), ("grow_refused", tally.kv_grows_refused))
        f.add("gpumemd_kv_moves_total", "counter", "Runtime KV moves, by kind: grows that waited for others, shrinks asked and confirmed, "
              "and the waiting grows' ends.", ("kind",), [((kind,), n) for kind, n in moves])
        f.one("gpumemd_kv_moved_bytes_total", "counter", "Bytes waiting grows got once others gave back.", tally.kv_moved_bytes)
        f.one("gpumemd_kv_move_seconds", "histogram", "How long a grow that got memory waited for others' shrinks.",
              HistogramValue.of(tally.kv_move_seconds))
        f.add("gpumemd_kv_pool_tokens", "gauge", "Committed token rows of each KV pool; client is its owner.", ("pool", "client"),
              [(named[k.name], k.tokens) for k in sorted(kv.pools.values(), key=lambda k: k.name)])
        f.one("gpumemd_arenas_asleep", "gauge", "Arenas asleep now: their chunks handed back, committed again at their wake.",
              len(state.sleepers.asleep))
        f.one("gpumemd_sleep_host_bytes", "gauge", "Host memory of sleepers' buffers (the daemon's memfds; --sleep-host-limit caps it).",
              state.sleepers.host_bytes())

        pools = sorted(state.graph_pools.by_id.values(), key=lambda g: g.id)
        watches = [
            (g, (str(g.id), self._name(g.label), self._name(g.arena), self._name(g.owner_name)), self._watch.get(g.id) or _LeaseWatch(0))
            for g in pools
        ]
        pool_labels = ("pool_id", "pool", "arena", "client")
        f.add("gpumemd_graph_pool_free_bytes", "gauge", "Free runs of each graph pool: what borrowers can borrow.", pool_labels,
              [(labels, sum(n for _, n in g.free_runs)) for g, labels, _ in watches])
        f.add("gpumemd_lease_held", "gauge", "Whether a lease of this kind held the pool at the last tick.", (*pool_labels, "kind"),
              [((*labels, kind.noun), int(w.held == kind)) for _, labels, w in watches for kind in LeaseKind])
        f.add("gpumemd_lease_releases_total", "counter",
              "Leases on the pool that ended (given back, undone, or swept), from the slot's release count; a held lease counts when it ends.",
              pool_labels, [(labels, w.releases) for _, labels, w in watches])
        f.add("gpumemd_lease_waiters", "gauge", "Processes asleep on the pool's lease slot at the last tick.", pool_labels,
              [(labels, w.waiters) for _, labels, w in watches])
        f.add("gpumemd_lease_conflicts_total", "counter",
              "Holders seen at a tick with processes asleep behind them, each once: a lower bound (ticks are 0.2 s apart).",
              pool_labels, [(labels, w.conflicts) for _, labels, w in watches])
        f.add("gpumemd_lease_wait_seconds", "histogram",
              "Per conflict: how long its holder had held the lease at the last tick that saw others waiting (a lower bound on the wait).",
              pool_labels, [(labels, HistogramValue.of(w.waits)) for _, labels, w in watches])
        f.add("gpumemd_lease_escapes_total", "counter", "Borrow scopes reported to have ended with tensors still alive.", pool_labels,
              [(labels, tally.escapes.get(g.id, 0)) for g, labels, _ in watches])
        ordering = state.config.lease_ordering
        f.add("gpumemd_lease_ordering", "gauge", "How lease handoffs order GPU work (--lease-ordering): 1 on the mode in force.",
              ("mode",), [((mode.value,), int(mode is ordering)) for mode in LeaseOrdering])
        lanes = self._lanes()
        f.add("gpumemd_lease_ordering_lanes", "gauge", "Lanes of memops ordering's sequence chunk (none under ipc-events).",
              (), [] if lanes is None else [((), lanes[0])])
        f.add("gpumemd_lease_ordering_lanes_in_use", "gauge",
              "Lanes held by a session's use of a shared pool, or swept and not yet free (their writer not yet fenced).",
              (), [] if lanes is None else [((), lanes[1])])
        f.add("gpumemd_lease_escaped_clients", "gauge", "Clients whose borrowed tensors are out past their scope now: replays refused.",
              pool_labels, [(labels, len(g.escapers)) for g, labels, _ in watches])
        return Snapshot(tuple(f.out))


def _outcome(code: int) -> str:
    return "ok" if code == 0 else p.ErrorCode(code).name.lower()
