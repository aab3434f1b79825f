"""The graph-pool book: the registry of CUDA-graph pools captured into arenas, and the
upkeep of the lease table that clients take capture / replay / borrow leases in.

The table is shared memory every client maps read-write, so it is not trusted: the
daemon writes a slot's epoch, flags and escape mark, and every tick repairs what a
client could have scribbled there (an unknown kind, a holder session that does not
exist, a slot no pool owns, fields that disagree with the registry).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
from collections.abc import Mapping

from gpumem_shared import lease_table
from gpumem_shared import protocol as p

from gpumemd.arenas import ArenaBook
from gpumemd.records import ArenaRecord, GraphPoolRecord, Outcome, SessionRecord

log = logging.getLogger("gpumemd.graph_pools")


def within(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) lies inside one of ``spans`` (sorted, disjoint, as merged() makes them)."""
    i = bisect.bisect_right(spans, (start, math.inf)) - 1
    return i >= 0 and end <= spans[i][1]


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class GraphPoolBook:
    def __init__(self, arenas: ArenaBook, sessions: Mapping[int, SessionRecord], device: p.DeviceInfo) -> None:
        self.arenas = arenas
        self.sessions = sessions
        self.device = device
        self.by_id: dict[int, GraphPoolRecord] = {}
        self._next_id = 1
        self.table, self.table_fd = lease_table.LeaseTable.create()
        self._free_slots = list(range(lease_table.SLOTS - 1, 0, -1))  # slot 0 stays unused

    # ------------------------------------------------------------------ lookups

    def _get(self, pool_id: int) -> GraphPoolRecord:
        pool = self.by_id.get(pool_id)
        if pool is None:
            raise p.ProtocolError(
                p.ErrorCode.NOT_FOUND, f"no graph pool {pool_id} on device {self.device.index} (retired, or its owner left)"
            )
        return pool

    def _owned(self, s: SessionRecord, pool_id: int) -> GraphPoolRecord:
        pool = self._get(pool_id)
        if pool.owner_id != s.id:
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"graph pool {pool_id} ('{pool.label}') belongs to client '{pool.owner_name}'")
        return pool

    def _used_by(self, s: SessionRecord, pool_id: int) -> GraphPoolRecord:
        """A pool ``s`` may take leases on: its own, or one in an arena it attached."""
        pool = self._get(pool_id)
        if s.id != pool.owner_id and s.id not in self.arenas.by_name[pool.arena].attached:
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"this client has not attached arena '{pool.arena}' of graph pool {pool.id}")
        return pool

    def in_arena(self, arena: str) -> list[GraphPoolRecord]:
        return [g for g in self.by_id.values() if g.arena == arena]

    # ------------------------------------------------------------------ requests

    def register(self, s: SessionRecord, m: p.RegisterGraphPool) -> Outcome:
        arena = self.arenas.owned(s, m.arena, "register graph pools in")
        if not m.label or len(m.label) > 256:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "a graph pool needs a label of 1-256 characters")
        extents, runs = self._checked(arena, m.extents, m.free_runs, exclude=None)
        if not self._free_slots:
            raise p.ProtocolError(p.ErrorCode.OUT_OF_MEMORY, f"all {lease_table.SLOTS - 1} lease slots are in use; retire graph pools first")
        pool = GraphPoolRecord(
            id=self._next_id,
            owner_id=s.id,
            owner_name=s.name,
            arena=arena.name,
            label=m.label,
            epoch=1,
            extents=extents,
            free_runs=runs,
            slot=self._free_slots.pop(),
            shared=m.shared,
        )
        self._next_id += 1
        self.by_id[pool.id] = pool
        self.table.set_epoch(pool.slot, lease_table.lease_epoch(pool.id, pool.epoch))
        self.table.set_flags(pool.slot, self._flags(pool))
        # A free slot is clients' shared memory too: nothing written there carries over.
        self.table.forget_handoff(pool.slot, self.table.handoff(pool.slot))
        self.table.set_escaped(pool.slot, 0)
        return Outcome(p.GraphPoolReply(pool=pool.status()))

    def update(self, s: SessionRecord, m: p.UpdateGraphPool) -> Outcome:
        pool = self._owned(s, m.pool_id)
        extents, runs = self._checked(self.arenas.by_name[pool.arena], m.extents, m.free_runs, exclude=pool)
        # A borrower's view of the runs must not outlive them: new runs, new epoch.
        changed = (extents, runs) != (pool.extents, pool.free_runs)
        pool.extents, pool.free_runs = extents, runs
        if m.recaptured or changed:
            pool.epoch += 1
            self.table.set_epoch(pool.slot, lease_table.lease_epoch(pool.id, pool.epoch))
        return Outcome(p.GraphPoolReply(pool=pool.status()))

    def retire(self, s: SessionRecord, m: p.RetireGraphPool) -> Outcome:
        self.drop(self._owned(s, m.pool_id))
        return Outcome(p.Ack())

    def open(self, s: SessionRecord, m: p.OpenGraphPool) -> Outcome:
        if m.pool_id:
            pool = self.by_id.get(m.pool_id)
            what = f"graph pool {m.pool_id}"
        else:
            found = [g for g in self.by_id.values() if g.owner_name == m.owner and g.label == m.label]
            what = f"graph pool '{m.label}' of client '{m.owner}'"
            if len(found) > 1:
                raise p.ProtocolError(
                    p.ErrorCode.INVALID_ARGUMENT,
                    f"{len(found)} pools match {what} (pools {', '.join(str(g.id) for g in found)}): open one by id",
                )
            pool = found[0] if found else None
        if pool is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no {what} on device {self.device.index} (not registered, retired, or its owner left)")
        if pool.owner_id != s.id:
            if not pool.shared:
                raise p.ProtocolError(
                    p.ErrorCode.PERMISSION_DENIED,
                    f"graph pool {pool.id} ('{pool.label}') of client '{pool.owner_name}' is private: its owner registers "
                    "it with shared=True for other clients to borrow from it",
                )
            if s.id not in self.arenas.by_name[pool.arena].attached:
                raise p.ProtocolError(
                    p.ErrorCode.PERMISSION_DENIED,
                    f"graph pool {pool.id} ('{pool.label}') lives in arena '{pool.arena}', which this client has not "
                    f"attached: '{pool.owner_name}' shares the arena with it, then it attaches",
                )
        return Outcome(p.GraphPoolReply(pool=pool.status()))

    def publish_event(self, s: SessionRecord, m: p.PublishLeaseEvent) -> Outcome:
        pool = self._used_by(s, m.pool_id)
        if not pool.shared:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"graph pool {pool.id} is not shared: its leases need no IPC event")
        if not 0 < len(m.handle) <= 256:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"an IPC event handle has 1-256 bytes, not {len(m.handle)}")
        pool.events[s.id] = m.handle
        return Outcome(p.Ack())

    def lookup_event(self, s: SessionRecord, m: p.LookupLeaseEvent) -> Outcome:
        pool = self._used_by(s, m.pool_id)
        for sid, handle in pool.events.items():
            if lease_table.word_session(sid) == m.session:
                return Outcome(p.LeaseEventReply(handle=handle))
        raise p.ProtocolError(
            p.ErrorCode.NOT_FOUND,
            f"session {m.session} published no IPC event for graph pool {pool.id} (it ended, or never released a lease there)",
        )

    def report_escape(self, s: SessionRecord, m: p.ReportEscape) -> Outcome:
        pool = self._used_by(s, m.pool_id)
        if m.escaped:
            pool.escapers.add(s.id)
            log.warning("graph pool %d ('%s'): client %r holds borrowed tensors past their scope; replays refused", pool.id, pool.label, s.name)
        else:
            pool.escapers.discard(s.id)
        self.table.set_escaped(pool.slot, self._escape_mark(pool))
        return Outcome(p.Ack())

    # ------------------------------------------------------------------ what others change

    def refuse_from(self, arena: ArenaRecord, from_offset: int, action: str) -> None:
        """A graph pool lives at or past ``from_offset`` of the arena: refuse ``action``."""
        for pool in self.in_arena(arena.name):
            if any(o + n > from_offset for o, n in pool.extents):
                raise p.ProtocolError(
                    p.ErrorCode.INVALID_ARGUMENT,
                    f"cannot {action} arena '{arena.name}' from offset {from_offset}: graph pool {pool.id} ('{pool.label}') "
                    "lives there; retire it first",
                )

    def forget_user(self, pool: GraphPoolRecord, session_id: int) -> None:
        """``session_id`` no longer uses the pool (it ended, or let go of its arena): its
        event and its escapes go; if it was the last to release, nobody waits on it."""
        pool.events.pop(session_id, None)
        if session_id in pool.escapers:
            pool.escapers.discard(session_id)
            self.table.set_escaped(pool.slot, self._escape_mark(pool))
        self.table.forget_handoff(pool.slot, lease_table.word_session(session_id))

    def drop(self, pool: GraphPoolRecord) -> None:
        """Forget the pool and free its lease slot: a holder is swept, waiters wake and
        find the slot's epoch no longer theirs."""
        del self.by_id[pool.id]
        self.table.set_epoch(pool.slot, 0)
        self.table.set_flags(pool.slot, 0)
        self.table.forget_handoff(pool.slot, self.table.handoff(pool.slot))
        self.table.set_escaped(pool.slot, 0)
        word = self.table.peek(pool.slot)
        if word:
            self.table.clear(pool.slot, word)
        self._free_slots.append(pool.slot)

    def session_ended(self, session_id: int) -> None:
        """Its leases are swept, its events and escapes forgotten, its pools dropped."""
        self.sweep(session_id)
        for pool in [g for g in self.by_id.values() if g.owner_id == session_id]:
            self.drop(pool)

    # ------------------------------------------------------------------ the table's upkeep

    @staticmethod
    def _flags(pool: GraphPoolRecord) -> int:
        return lease_table.LeaseFlag.SHARED if pool.shared else 0

    @staticmethod
    def _escape_mark(pool: GraphPoolRecord) -> int:
        """What the slot's escape field must hold: one of the escaping sessions, or 0."""
        return lease_table.word_session(min(pool.escapers)) if pool.escapers else 0

    def sweep(self, session_id: int | None = None) -> None:
        """Clear slots held by ``session_id`` (its client is gone), or, with None, slots in
        a state that cannot be: a kind the daemon does not know, a holder session that
        does not exist, a slot no pool owns, daemon-written fields that disagree with the
        registry. A buggy client can write anything there."""
        owned = {g.slot: g for g in self.by_id.values()}
        live = {lease_table.word_session(i) for i in self.sessions}
        if session_id is not None:
            for pool in self.by_id.values():
                self.forget_user(pool, session_id)
        else:
            for slot, pool in owned.items():
                if self.table.flags(slot) != self._flags(pool):
                    log.warning("lease slot %d: flags %#x repaired", slot, self.table.flags(slot))
                    self.table.set_flags(slot, self._flags(pool))
                escaped = self._escape_mark(pool)
                if self.table.escaped(slot) != escaped:
                    log.warning("lease slot %d: escape mark %d repaired to %d", slot, self.table.escaped(slot), escaped)
                    self.table.set_escaped(slot, escaped)
                handoff = self.table.handoff(slot)
                if handoff and handoff not in live:
                    log.warning("lease slot %d named session %d, which does not exist; cleared", slot, handoff)
                    self.table.forget_handoff(slot, handoff)
        for slot, word in enumerate(self.table.words()):
            if not word:
                continue
            kind, holder, pid = lease_table.decode(word)
            if session_id is not None:
                if holder == lease_table.word_session(session_id):
                    self.table.clear(slot, word)
                    log.info("lease slot %d: swept a %s lease of session %d (pid %d), which ended", slot, lease_table.KIND_NAMES.get(kind, kind), holder, pid)
                continue
            if kind not in lease_table.KIND_NAMES or holder not in live or slot not in owned:
                self.table.clear(slot, word)
                log.warning("lease slot %d held an impossible word %#x (kind %d, session %d, pid %d); cleared", slot, word, kind, holder, pid)

    def close(self) -> None:
        self.table.close()
        if self.table_fd >= 0:
            os.close(self.table_fd)
            self.table_fd = -1

    # ------------------------------------------------------------------ validation

    def _checked(
        self, arena: ArenaRecord, extents: list[p.Extent], runs: list[p.Extent], exclude: GraphPoolRecord | None
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Extents in committed memory of the arena, disjoint from each other and from other
        pools; free runs inside the extents and disjoint. Returns them normalized. Every
        lookup is a bisection of sorted spans: a request may carry thousands of each, and
        pairwise checks held the daemon's one thread for seconds."""
        committed = merged([(c.offset, c.offset + c.size) for c in arena.chunks])
        spans = sorted((e.offset, e.offset + e.size) for e in extents)
        if not spans:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "a graph pool needs at least one extent")
        for start, end in spans:
            if start < 0 or end <= start:
                raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"extent [{start}, {end}) is empty or negative")
            if not within(committed, start, end):
                raise p.ProtocolError(
                    p.ErrorCode.INVALID_ARGUMENT,
                    f"extent [{start}, {end}) is not committed memory of arena '{arena.name}': graph pools must be "
                    "captured into committed daemon memory",
                )
        if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "the pool's extents overlap each other")
        starts = [start for start, _ in spans]
        for other in self.in_arena(arena.name):
            if other is exclude:
                continue
            for o, n in other.extents:
                # The extents are disjoint and sorted: only the last one starting before
                # this one ends can reach into it.
                i = bisect.bisect_left(starts, o + n) - 1
                if i >= 0 and spans[i][1] > o:
                    raise p.ProtocolError(
                        p.ErrorCode.ALREADY_EXISTS,
                        f"extent [{o}, {o + n}) of arena '{arena.name}' already belongs to graph pool {other.id} ('{other.label}')",
                    )
        run_spans = sorted((r.offset, r.offset + r.size) for r in runs)
        pool_spans = merged(spans)  # adjacent extents: the runs are coalesced across them below
        for start, end in run_spans:
            if end <= start or not within(pool_spans, start, end):
                raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"free run [{start}, {end}) lies outside the pool's extents")
        if any(run_spans[i][1] > run_spans[i + 1][0] for i in range(len(run_spans) - 1)):
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "free runs overlap each other")
        coalesced = merged(run_spans)
        return [(a, b - a) for a, b in spans], sorted(((a, b - a) for a, b in coalesced), key=lambda r: (-r[1], r[0]))
