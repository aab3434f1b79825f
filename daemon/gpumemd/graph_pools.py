"""The graph-pool book: the registry of CUDA-graph pools captured into arenas, and the
upkeep of their lease slots, in which clients take capture / replay / borrow leases.

Each pool's slot lives in a lease segment of its own (a sealed memfd of one page),
created here at registration and granted only to the sessions that may use the pool:
its owner, and the sessions that open it (a shared pool, its arena attached). The book
keeps those sessions per pool (``users``); a session that may not use a pool never
receives its segment, so it cannot reach the pool's lease words at all.

A segment is shared memory its users map read-write, and a session that loses its
right (it lets go of the arena, or ends) keeps its mapping, through which it could forge
any user's word. So the pool then moves to a fresh segment that only the users left
receive (``_move``), and the old one is retired. Within a segment, the daemon writes
the slot's epoch, flags and escape mark, and every tick repairs, logs and counts
(``lease_repairs``) what no client could rightly have written there: a word or a field
naming a session that is not a user, a kind it does not know, a handoff that is no
session, daemon-written fields that disagree with the registry. A retired segment is
never reused, by its pool or another: a stale view or waiter only ever sees it retired.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import time
from collections.abc import Mapping

import msgspec

from gpumem_shared import lease_order, lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import LeaseSegment

from gpumemd.arenas import ArenaBook
from gpumemd.image import Image, Imager, Keep, Take, lease_name
from gpumemd.lease_order_lanes import SequenceChunk
from gpumemd.records import ArenaRecord, GraphPoolRecord, Outcome, SessionRecord

log = logging.getLogger("gpumemd.graph_pools")

# Graph pools the daemon keeps at once: each holds a lease segment (a memfd and a page
# mapped here), and no client may make the daemon run out of descriptors.
MAX_POOLS = 1023
# How long a move waits for a releaser's event record in flight to land (see _recorded).
_RECORD_AT_MOVE_S = 0.01


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


_POOL = Imager(GraphPoolRecord, "segment", "segment_fd")  # the process's mapping and fd: the segment's memfd is stored


class GraphPoolBookImage(msgspec.Struct):
    pools: list[Image]
    next_id: int


class GraphPoolBook:
    def __init__(
        self, arenas: ArenaBook, sessions: Mapping[int, SessionRecord], device: p.DeviceInfo, order: SequenceChunk | None = None
    ) -> None:
        self.arenas = arenas
        self.order = order  # memops lease ordering: the sequence chunk (None: IPC events)
        self.sessions = sessions
        self.device = device
        self.by_id: dict[int, GraphPoolRecord] = {}
        self.next_id = 1

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
        """A pool ``s`` may take leases on: its own, or one it opened (its arena still attached)."""
        pool = self._get(pool_id)
        if s.id not in pool.users:
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"graph pool {pool.id} ('{pool.label}') of client '{pool.owner_name}' is not open in this session: "
                f"attach arena '{pool.arena}', then open the pool (open_graph_pool)",
            )
        return pool

    def in_arena(self, arena: str) -> list[GraphPoolRecord]:
        return [g for g in self.by_id.values() if g.arena == arena]

    # ------------------------------------------------------------------ requests

    def register(self, s: SessionRecord, m: p.RegisterGraphPool) -> Outcome:
        arena = self.arenas.owned(s, m.arena, "register graph pools in")
        if not m.label or len(m.label) > 256:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "a graph pool needs a label of 1-256 characters")
        extents, runs = self._checked(arena, m.extents, m.free_runs, exclude=None)
        if len(self.by_id) >= MAX_POOLS:
            raise p.ProtocolError(
                p.ErrorCode.OUT_OF_MEMORY, f"gpumemd keeps {MAX_POOLS} graph pools, its limit (each has a lease segment); retire graph pools first"
            )
        self.arenas.tenants.check_graph_pool(s, (g.owner_id for g in self.by_id.values()), MAX_POOLS)
        pool_id = self.next_id
        try:
            segment, fd = LeaseSegment.create(pool_id)
        except OSError as exc:
            log.error("creating the lease segment of graph pool %d failed: %s", pool_id, exc)
            raise p.ProtocolError(
                p.ErrorCode.INTERNAL,
                f"gpumemd could not create graph pool {pool_id}'s lease segment ({exc.strerror}); check its descriptor limit (LimitNOFILE)",
            ) from None
        pool = GraphPoolRecord(
            id=pool_id,
            owner_id=s.id,
            owner_name=s.name,
            arena=arena.name,
            label=m.label,
            epoch=1,
            extents=extents,
            free_runs=runs,
            segment=segment,
            segment_fd=fd,
            shared=m.shared,
            users={s.id},
        )
        self.next_id += 1
        self.by_id[pool.id] = pool
        segment.set_epoch(lease_table.lease_epoch(pool.id, pool.epoch))
        segment.set_flags(self._flags(pool))
        return self._granted(pool, s)

    def update(self, s: SessionRecord, m: p.UpdateGraphPool) -> Outcome:
        pool = self._owned(s, m.pool_id)
        extents, runs = self._checked(self.arenas.by_name[pool.arena], m.extents, m.free_runs, exclude=pool)
        # A borrower's view of the runs must not outlive them: new runs, new epoch.
        changed = (extents, runs) != (pool.extents, pool.free_runs)
        pool.extents, pool.free_runs = extents, runs
        if m.recaptured or changed:
            pool.epoch += 1
            pool.segment.set_epoch(lease_table.lease_epoch(pool.id, pool.epoch))
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
        pool.users.add(s.id)
        return self._granted(pool, s)

    def _granted(self, pool: GraphPoolRecord, s: SessionRecord) -> Outcome:
        """The pool, its lease segment going with the reply: to its owner at registration,
        to a session that opens it (every time: a client that dropped its mapping needs it
        again). Under memops ordering a shared pool's grant adds the session's lane and the
        sequence chunk."""
        reply = p.GraphPoolReply(pool=pool.status(), fd_batches=1)
        grants = [(pool.id, pool.segment_fd)]
        if self.order is not None and pool.shared:
            try:
                reply.order_lane, reply.order_base = self.order.grant(pool.id, s)
            except LookupError as exc:
                raise p.ProtocolError(p.ErrorCode.OUT_OF_MEMORY, f"graph pool {pool.id}: {exc}; retire graph pools first") from None
            reply.order_lanes = self.order.lanes.lanes
            grants.append((lease_order.CHUNK_GRANT_ID, self.order.fd))
        return Outcome(reply, grants=grants)

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
        pool.segment.set_escaped(self._escape_mark(pool))
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

    def forget_user(self, pool: GraphPoolRecord, session_id: int, why: str) -> None:
        """``session_id`` may no longer use the pool (``why``: it ended, or let go of the
        arena): its lease goes, its event and escapes with it, and the slot stops naming
        it. Its mapping may outlive its right: unless it owned the pool (which then goes),
        the pool moves to a fresh segment that mapping does not reach."""
        if session_id not in pool.users:
            return
        pool.users.discard(session_id)
        pool.events.pop(session_id, None)
        if self.order is not None:
            self.order.sweep(pool.id, session_id)
        segment = pool.segment
        if session_id in pool.escapers:
            pool.escapers.discard(session_id)
            segment.set_escaped(self._escape_mark(pool))
        segment.forget_handoff(session_id)
        word = segment.peek()
        kind, holder, pid = lease_table.decode(word)
        if word and holder == lease_table.word_session(session_id) and segment.clear(word) == lease_table.LeaseStatus.OK:
            log.info(
                "graph pool %d ('%s'): swept a %s lease of session %d (pid %d), which %s",
                pool.id, pool.label, lease_table.KIND_NAMES.get(kind, kind), session_id, pid, why,
            )
        if session_id != pool.owner_id:  # the owner leaving drops the pool
            self._move(pool, session_id)

    def _move(self, pool: GraphPoolRecord, leaver: int) -> None:
        """A user lost its right to the pool but keeps its mapping of the segment, and
        anything it writes there would look rightful (it can forge any user's word): the
        pool moves to a fresh segment, which only the users left receive, as their next
        lease on the old one finds it retired (epoch 0). A lease a user holds at the move
        is carried over (its holder gives it back in the new segment); the old segment is
        emptied, so its waiters wake to find it retired."""
        old = pool.segment
        try:
            segment, fd = LeaseSegment.create(pool.id)
        except OSError as exc:
            log.error(
                "graph pool %d ('%s'): a fresh lease segment for the users left after session %d failed (%s); the old one "
                "stays, guarded by the tick's repairs only", pool.id, pool.label, leaver, exc,
            )
            return
        old.set_epoch(0)  # first: a take that lands from now on undoes itself
        word = old.peek()
        found = old.handoff()
        if found & lease_table.HANDOFF_RECORDING:
            found = self._recorded(old, found)
        releaser = lease_table.handoff_session(found)
        segment.adopt(
            old,
            word=word if self._rightful(pool, word) else 0,
            handoff=found if releaser and releaser in self._word_users(pool) else 0,
        )
        segment.set_epoch(lease_table.lease_epoch(pool.id, pool.epoch))
        segment.set_flags(self._flags(pool))
        segment.set_escaped(self._escape_mark(pool))
        if word:
            old.clear(word)
        os.close(pool.segment_fd)
        pool.segment, pool.segment_fd = segment, fd
        pool.segment_moves += 1
        old.close()
        log.info("graph pool %d ('%s'): moved to a fresh lease segment, session %d having lost its right", pool.id, pool.label, leaver)

    def _word_users(self, pool: GraphPoolRecord) -> set[int]:
        return {lease_table.word_session(sid) for sid in pool.users}

    def _rightful(self, pool: GraphPoolRecord, word: int) -> bool:
        """Whether ``word`` could be a lease a user holds: a kind that exists, a user's
        session, and the pid that session's client writes there (its own, which HELLO said:
        the kernel's may be 0 or another namespace's number)."""
        kind, session, pid = lease_table.decode(word)
        if kind not in lease_table.KIND_NAMES:
            return False
        return any(
            lease_table.word_session(sid) == session and self.sessions[sid].own_pid == pid
            for sid in pool.users if sid in self.sessions
        )

    @staticmethod
    def _recorded(segment: LeaseSegment, found: int) -> int:
        """The handoff once its releaser's record landed: a record takes microseconds, so
        this waits briefly. A releaser stopped mid-record is then named as recorded, and
        the next holder orders after its event's previous record (one handoff's order)."""
        deadline = time.monotonic() + _RECORD_AT_MOVE_S
        while found & lease_table.HANDOFF_RECORDING and time.monotonic() < deadline:
            time.sleep(0.0001)
            found = segment.handoff()
        return found & ~lease_table.HANDOFF_RECORDING

    def drop(self, pool: GraphPoolRecord) -> None:
        """Forget the pool and its segment: a holder is swept, and waiters wake to find
        the epoch 0. Clients keep their mappings of the segment; no other pool ever gets it."""
        del self.by_id[pool.id]
        if self.order is not None:
            for user in pool.users:
                self.order.sweep(pool.id, user)
        segment = pool.segment
        segment.set_epoch(0)  # before the clear: a waiter woken by it finds the pool retired
        word = segment.peek()
        if word:
            segment.clear(word)
        segment.close()
        os.close(pool.segment_fd)

    def session_ended(self, session_id: int) -> None:
        """Its leases are swept, its events and escapes forgotten, its pools dropped."""
        for pool in self.by_id.values():
            self.forget_user(pool, session_id, "ended")
        for pool in [g for g in self.by_id.values() if g.owner_id == session_id]:
            self.drop(pool)

    # ------------------------------------------------------------------ the slots' upkeep

    @staticmethod
    def _flags(pool: GraphPoolRecord) -> int:
        return lease_table.LeaseFlag.SHARED if pool.shared else 0

    @staticmethod
    def _escape_mark(pool: GraphPoolRecord) -> int:
        """What the slot's escape field must hold: one of the escaping sessions, or 0."""
        return lease_table.word_session(min(pool.escapers)) if pool.escapers else 0

    def sweep(self) -> None:
        """Every pool's slot as the registry says it must be: the daemon's fields (epoch,
        flags, escape mark) rewritten where they differ, a handoff or a held word naming
        a session that is not one of the pool's users (or a kind that does not exist)
        cleared. Each repair is logged and counted: the segment's users can write anything.
        Swept lease ordering lanes whose writer is fenced are topped off for good."""
        for pool in self.by_id.values():
            self._repair(pool)
        if self.order is not None and self.order.draining:
            self.order.settle()

    def _repair(self, pool: GraphPoolRecord) -> None:
        segment = pool.segment
        users = self._word_users(pool)
        epoch = lease_table.lease_epoch(pool.id, pool.epoch)
        if segment.epoch() != epoch:
            self._repaired(pool, "epoch", f"{segment.epoch():#x}, not {epoch:#x}")
            segment.set_epoch(epoch)
        flags = self._flags(pool)
        if segment.flags() != flags:
            self._repaired(pool, "flags", f"{int(segment.flags()):#x}, not {flags:#x}")
            segment.set_flags(flags)
        mark, found = self._escape_mark(pool), segment.escaped()
        if found != mark:
            named = self._named(found, pool) if found else "no session"
            self._repaired(pool, "escape mark", f"{named}, not {self._named(mark, pool) if mark else 'no session'}")
            segment.set_escaped(mark)
        found = segment.handoff()
        releaser = lease_table.handoff_session(found)  # a user still recording its event is one
        if found and releaser not in users and segment.clear_handoff(found):
            named = f"{found:#x}, which is no session" if releaser is None else self._named(releaser, pool)
            self._repaired(pool, "handoff", named)
        word = segment.peek()
        if not word:
            return
        kind, holder, pid = lease_table.decode(word)
        if kind in lease_table.KIND_NAMES and holder in users:
            return
        if segment.clear(word) != lease_table.LeaseStatus.OK:
            return  # it changed meanwhile: the next tick looks again
        what = f"an unknown kind {kind}" if kind not in lease_table.KIND_NAMES else self._named(holder, pool)
        self._repaired(pool, "lease word", f"{word:#x} (pid {pid}): {what}")

    def _named(self, session: int, pool: GraphPoolRecord) -> str:
        """A 24-bit session as a slot field names it, for the log: who, and why it may not
        be there."""
        client = next((s for sid, s in self.sessions.items() if lease_table.word_session(sid) == session), None)
        if client is None:
            return f"session {session}, which does not exist"
        if client.id in pool.users:
            return f"session {session}, client '{client.name}' ({client.pids})"
        return (
            f"session {session}, client '{client.name}' ({client.pids}), which may not use the pool "
            "(it never opened it, or let go of its arena)"
        )

    def _repaired(self, pool: GraphPoolRecord, field: str, found: str) -> None:
        pool.lease_repairs += 1
        log.warning(
            "graph pool %d ('%s') of client '%s': its lease slot's %s held %s; repaired (%d repairs of this pool so far)",
            pool.id, pool.label, pool.owner_name, field, found, pool.lease_repairs,
        )

    def close(self) -> None:
        """At exit: every pool left goes, with its segment."""
        for pool in list(self.by_id.values()):
            self.drop(pool)
        if self.order is not None:
            self.order.close()

    # ------------------------------------------------------------------ the durable record

    def image(self, keep: Keep) -> GraphPoolBookImage:
        pools = []
        for g in self.by_id.values():
            keep(lease_name(g.id, g.segment_moves), g.segment_fd)
            pools.append(_POOL.image(g))
        return GraphPoolBookImage(pools, self.next_id)

    def restore(self, part: object, take: Take) -> None:
        """The book as ``image`` left it (the arena book restored first), each pool with
        its lease segment from ``take``; a pool whose segment or arena is missing is
        dropped."""
        book = msgspec.convert(part, GraphPoolBookImage)
        for image in (_POOL.fields(i) for i in book.pools):
            pool_id = msgspec.convert(image["id"], int)
            fd = take(lease_name(pool_id, msgspec.convert(image["segment_moves"], int)))
            problem = "its lease segment is missing from the fd store" if fd < 0 else ""
            if not problem and image["arena"] not in self.arenas.by_name:
                problem = f"its arena {image['arena']!r} was not rebuilt"
            segment = None
            if not problem:
                try:
                    segment = LeaseSegment(fd)
                except (ValueError, OSError) as exc:
                    problem = f"the stored lease segment is not one ({exc})"
            if segment is None:
                log.error("graph pool %d (%r of client %r) cannot be rebuilt: %s; it is dropped", pool_id, image["label"],
                          image["owner_name"], problem)
                if fd >= 0:
                    os.close(fd)
                continue
            self.by_id[pool_id] = _POOL.restore(image, segment=segment, segment_fd=fd)
        self.next_id = book.next_id

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
