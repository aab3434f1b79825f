"""A session's side of its leases (``Lease`` is gpumem.leases): the handoffs on shared
pools, the pools moved to a fresh lease segment, the borrows that escaped their scope,
and the errors that name a holder; each a slow path of a lease, or once per pool.

On a shared pool (one other processes open), a lease also orders GPU work: every release
records the holder's IPC event on its stream, and a holder from another session makes its
stream wait on that event before it touches the pool, each in the same native call as the
compare-and-swap. The first release publishes the event's handle to the daemon and the
first wait on a peer looks it up: one round trip each, once. A private pool records
nothing. Under ``gpumemd --lease-ordering memops`` a stream write of the releaser's next
sequence value, and the taker's stream wait for it, take their place, on a lane of a
chunk the daemon grants with the pool (gpumem_shared/lease_order.py): no IPC handles.
Within one session nothing is waited on: work on one stream is ordered by the stream,
and replaying on one stream while borrowing on another is the caller's to order (a
borrow takes ``stream=``).

A release frees the slot before its record (or write) is made, so the next holder wakes
meanwhile and may find it in flight: it waits for it within its own ``wait``, which
bounds every wait inside one acquire. With ``wait=0`` a record in flight refuses the
take at once, as a slot held a moment longer would, with a LeaseConflict naming the
releaser; a record takes microseconds, so one that does not land within a wait means a
releaser stopped or stuck in the CUDA driver.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from gpumem_shared import _native, fdchannel, lease_order, lease_table
from gpumem_shared import protocol as p
from gpumem_shared.driver import Driver, DriverError
from gpumem_shared.lease_table import LeaseSegment, LeaseStatus
from gpumem.errors import BadMessage, BorrowEscaped, DeviceDriverError, LeaseConflict, NotFound, PermissionDenied
from gpumem.graph_pools import granted_segment

if TYPE_CHECKING:
    from gpumem.borrow import BorrowPool
    from gpumem.channel import SessionChannel

# Module globals, as in gpumem.leases: before Python 3.12, reading an enum member off its
# class costs about 60 ns (the first release on a pool and a handoff's wait read these).
_RECORD, _RECORDING = LeaseStatus.RECORD, LeaseStatus.RECORDING

# IPC events this process's sessions record at lease handoffs, by (daemon, pool id,
# 24-bit session): a taker from another session of this process waits on them directly
# (a process cannot open its own IPC handle).
_PROCESS_EVENTS: dict[tuple[str, int, int], Any] = {}


class LeasePool(Protocol):
    """What a lease needs of a graph pool (a ``GraphPool`` registered or opened in this
    session is one): its id and epoch, whether other processes open it, and this
    session's mapping of its lease slot."""

    id: int
    epoch: int
    shared: bool
    segment: LeaseSegment


class Held(Protocol):
    """What a session keeps of the lease it took last on a shared pool (a
    ``gpumem.leases.Lease``): whether it is held still."""

    held: bool


class SessionLeases:
    """One session's side of its leases: its lease words, the IPC events that order GPU
    work at handoffs on shared pools, and the pools its borrowed tensors escaped.
    ``Lease`` and ``Borrow`` go through it; the daemon round trips it needs (publishing
    and looking up events, reporting escapes, naming a holder) use the session's channel."""

    def __init__(
        self,
        channel: SessionChannel,
        driver: Driver,
        session_id: int,
        device_ordinal: int | None,
        daemon_key: str,
    ) -> None:
        # What the uncontended acquire and release call, one hop from the Lease, on the
        # pool's segment address: the native compare-and-swaps.
        self.try_acquire = _native.lease_try
        self.try_release = _native.lease_release
        # One word per kind: the hot path must not rebuild them.
        self.words = {kind: lease_table.encode(kind, session_id, os.getpid()) for kind in lease_table.KIND_NAMES}
        # This session's borrow pools whose tensors outlived their scope, by graph pool id.
        self.escapes: dict[int, BorrowPool] = {}
        self.device_ordinal = device_ordinal
        self.handoff_waits = 0  # times a stream of this session waited on another session's event
        # What the ordered native calls on shared pools take: the device context, this
        # session's event per pool (once published), and per pool the events of the other
        # sessions that released it, by 24-bit session (once looked up).
        self.context = driver.native_context()
        self.recording: dict[int, int] = {}
        self.waiting: dict[int, dict[int, int]] = {}
        self._channel = channel
        self._driver = driver
        self._word_session = lease_table.word_session(session_id)
        self._daemon_key = daemon_key
        self._peer_events: dict[tuple[int, int], Any] = {}  # by (pool id, 24-bit session), once opened
        # The lease this session took last on each shared pool: the only one of ours that
        # may still hold it (the slot is exclusive). A word of ours in a pool's slot while
        # that lease is not held was forged.
        self.holding: dict[int, Held] = {}
        # Under memops ordering: this session's lane per shared pool, and the daemon's
        # sequence chunk, mapped at the first grant for the process's life (streams may
        # still have writes and waits on it queued when the session ends).
        self.lanes: dict[int, lease_order.ReleaserLane] = {}
        self.lanes_address = 0
        self.lanes_count = 0

    def ordered_by(self, reply: p.GraphPoolReply, fds: dict[int, int]) -> None:
        """Take a pool grant's memops ordering out of ``fds`` (its chunk fd closed): the
        session's lane for the pool, and the sequence chunk, mapped once."""
        fd = fds.pop(lease_order.CHUNK_GRANT_ID, None)
        try:
            if reply.order_lane < 0:
                return
            if fd is None or not 0 <= reply.order_lane < reply.order_lanes:
                raise BadMessage(f"gpumemd granted graph pool {reply.pool.id} memops ordering without its sequence chunk")
            if not self.lanes_address:
                size = reply.order_lanes * lease_order.WORD_BYTES
                address = self._driver.reserve(size, 0)
                try:
                    self._driver.map_fds(address, [(fd, 0, size)])
                except BaseException:
                    self._driver.free_reservation(address, size)
                    raise
                self.lanes_address, self.lanes_count = address, reply.order_lanes
            if (lane := self.lanes.get(reply.pool.id)) is None or (lane.index, lane.base) != (reply.order_lane, reply.order_base):
                self.lanes[reply.pool.id] = lease_order.ReleaserLane(reply.order_lane, reply.order_base, self.lanes_address)
        except BaseException:
            fdchannel.close_all(list(fds.values()))  # the grant is unusable: its segment goes too
            fds.clear()
            raise
        finally:
            if fd is not None:
                fdchannel.close_all([fd])

    def _call(self, message: p.RequestMessage) -> Any:
        return self._channel.call(message)[0]

    def status(self) -> p.StatusReply:
        """The daemon's status: the slow paths name holders and escapers from it."""
        reply: p.StatusReply = self._call(p.Status())
        return reply

    # ------------------------------------------------------------------ handoffs

    def waits_on(self, pool_id: int) -> dict[int, int]:
        """The events of graph pool ``pool_id``'s other releasers known here, for the
        ordered acquire to wait on."""
        events = self.waiting.get(pool_id)
        if events is None:
            events = self.waiting[pool_id] = {}
        return events

    def release_shared(self, pool_id: int, segment: LeaseSegment, word: int, stream: int) -> int:
        """Give back a lease on a shared pool: our stream's work so far marked with our
        event (memops: the lane's next value written), then the slot freed, in one native
        call. The first release on the pool creates the event and publishes it first."""
        if (lane := self.lanes.get(pool_id)) is not None:
            return lane.release(self.context, segment.address, word, stream)
        address = segment.address
        event = self.recording.get(pool_id)
        if event is None:
            status = _native.lease_release(address, word)
            if status != _RECORD:  # not ours; or the slot is not flagged shared: released
                return status
            try:
                created, handle = self._driver.event_create()
                self._call(p.PublishLeaseEvent(pool_id=pool_id, handle=handle))
            except BaseException:
                _native.lease_clear(address, word)
                raise
            _PROCESS_EVENTS[(self._daemon_key, pool_id, self._word_session)] = created
            event = self.recording[pool_id] = self._driver.native_event(created)
        return _native.lease_release_ordered(address, word, self.context, event, stream)

    def wait_for_handoff(self, pool_id: int, segment: LeaseSegment, stream: int, lease: str, wait: float, left: float) -> None:
        """After taking ``lease`` ("replay lease 'decode'") another session released, its
        event not known here yet: look it up, make our stream wait for its work, and keep
        it for the ordered acquires. The releaser's record is waited for ``left`` seconds
        at most (what is left of the acquire's ``wait``). The releaser may be another
        session of this process: its event is used as is. Under memops the take waited
        already, unless work is synchronous and the value not reached yet: polled here."""
        if pool_id in self.lanes:
            self.handoff_waits += lease_order.order_after(self.context, segment, self.lanes_address, self.lanes_count, stream, left) is not None
            return
        status, peer = segment.await_record(left)
        if status == _RECORDING:
            raise self.record_late(pool_id, segment, lease, wait)
        if not peer or peer == self._word_session:
            return
        event = _PROCESS_EVENTS.get((self._daemon_key, pool_id, peer))
        if event is None:
            event = self._peer_events.get((pool_id, peer))
        try:
            if event is None:
                try:
                    reply: p.LeaseEventReply = self._call(p.LookupLeaseEvent(pool_id=pool_id, session=peer))
                except NotFound:
                    return  # the releaser ended: its context, and its queued work, went with it
                event = self._peer_events[(pool_id, peer)] = self._driver.event_open(reply.handle)
            self._driver.stream_wait(event, stream)
        except DriverError as exc:
            raise self.order_failed(pool_id, peer, lease, exc) from None
        self.waits_on(pool_id)[peer] = self._driver.native_event(event)
        self.handoff_waits += 1

    # ------------------------------------------------------------------ moved segments

    def moved_segment(self, pool_id: int) -> LeaseSegment | None:
        """Graph pool ``pool_id``'s lease segment now (a new mapping): gpumemd moves a
        shared pool to a fresh segment when one of its users loses its right (that user
        keeps its mapping of the old one, which gpumemd retires). None when the pool is
        gone; PermissionDenied when this session may no longer use it."""
        try:
            reply, fds = self._channel.call(p.OpenGraphPool(pool_id=pool_id))
        except NotFound:
            return None
        self.ordered_by(reply, fds)
        return granted_segment(reply, fds)

    def follow(self, pool: Any) -> bool:
        """``pool.segment`` was found retired: map the segment the pool moved to. A word
        of this session there that no lease of ours holds was written in our name by the
        user that lost its right (before it did); it goes. False when the pool did not
        move (it was retired, or the segment was written over: the daemon repairs it)."""
        segment = self.moved_segment(pool.id)
        if segment is None:
            return False
        if segment.same_memory(pool.segment):
            segment.close()
            return False
        pool.segment = segment
        word = segment.peek()
        last = self.holding.get(pool.id)
        if word in self.words.values() and (last is None or not last.held):
            segment.clear(word)
        return True

    def release_moved(self, pool_id: int, word: int, stream: int) -> bool:
        """Give back our lease (``word``) on graph pool ``pool_id``, held while the pool
        moved to a fresh segment: gpumemd carried it over there, and freed the old slot.
        Recorded for the next holder (on ``stream``) as any shared release is. False when
        the pool is gone, or the lease no longer held there."""
        try:
            segment = self.moved_segment(pool_id)
        except PermissionDenied:
            return False  # this session lost its right: its lease was swept with it
        if segment is None:
            return False
        try:
            return self.release_shared(pool_id, segment, word, stream) == LeaseStatus.OK
        finally:
            segment.close()

    # ------------------------------------------------------------------ escapes

    def report_escape(self, pool: LeasePool, borrowed: BorrowPool, scope: str) -> None:
        """Borrowed tensors outlived ``scope``: the daemon marks the pool's slot, refusing
        replay and capture in every process until we report them gone."""
        self._call(p.ReportEscape(pool_id=pool.id, escaped=True))
        borrowed.escaped_scope = scope
        self.escapes[pool.id] = borrowed

    def clear_escape(self, pool_id: int) -> bool:
        """Report this session's escaped tensors from graph pool ``pool_id`` gone, if they are."""
        borrowed = self.escapes.get(pool_id)
        if borrowed is None or borrowed.live_bytes():
            return False
        self._call(p.ReportEscape(pool_id=pool_id, escaped=False))
        del self.escapes[pool_id]
        borrowed.escaped_scope = None
        return True

    def escape_error(self, pool: LeasePool, kind: str, label: str) -> BorrowEscaped | None:
        """Why the slot refused: our own tensors, or another client's. None when the mark
        is gone already (the caller tries again)."""
        marker = pool.segment.escaped()
        if not marker:
            return None
        mine = self.escapes.get(pool.id)
        if mine is not None:
            return BorrowEscaped(
                f"{kind} lease '{label}' on graph pool {pool.id} refused: {mine.live_bytes()} bytes borrowed in scope "
                f"'{mine.escaped_scope}' of this process are still alive and a {kind} would overwrite them; free them first",
                {"scope": mine.escaped_scope or "", "pid": os.getpid()},
            )
        status = self.status()
        name, pid = self._client_named(status, marker)
        who = next((g.escaped_by for g in status.graph_pools if g.id == pool.id and g.escaped_by), f"client '{name}'")
        return BorrowEscaped(
            f"{kind} lease '{label}' on graph pool {pool.id} refused: {who} (pid {pid}) holds tensors borrowed from it "
            "past their borrow scope; the mark goes once they are freed (at the borrower's next lease on the pool) or "
            "when the borrower exits",
            {"holder": name, "pid": pid},
        )

    def record_late(self, pool_id: int, segment: LeaseSegment, lease: str, wait: float) -> LeaseConflict:
        """The last releaser freed the pool but its event record (memops: its stream write)
        did not land within the acquire's ``wait``; ``lease`` names the refused one."""
        releaser = segment.handoff() & ~lease_table.HANDOFF_RECORDING
        name, pid = self._client_named(self.status(), releaser)
        if wait:
            waited, then = f" after waiting {wait:g}s", "that process is stopped or stuck in the CUDA driver"
        else:
            waited, then = " at once (wait=0)", "retry with wait > 0; one that never lands means that process is stopped or stuck in the CUDA driver"
        return LeaseConflict(
            f"{lease} on graph pool {pool_id} refused{waited}: client '{name}' (pid {pid}) released it and has not "
            f"{'queued the stream write' if pool_id in self.lanes else 'recorded the event'} "
            f"that orders its GPU work before the next holder's yet; that takes microseconds: {then} "
            "(gpumemd clears the mark when it exits)",
            {"holder": name, "pid": pid},
        )

    def order_failed(self, pool_id: int, peer: int, lease: str, exc: DriverError) -> DeviceDriverError:
        """``lease`` was taken after session ``peer``'s release, and its IPC event could not
        be opened or waited on here (the caller gives the slot back)."""
        name, pid = self._client_named(self.status(), peer)
        return DeviceDriverError(
            f"{lease} on graph pool {pool_id} refused, nothing taken: it must order after client '{name}' (pid {pid}), "
            f"which released it last, and that client's IPC event failed here: {exc}. CUDA IPC events do not cross pid "
            "namespaces (engines in pods without hostPID): run gpumemd with --lease-ordering memops, which orders "
            "handoffs through shared memory instead",
            {"releaser": name, "pid": pid, "pool": pool_id},
        )

    @staticmethod
    def _client_named(status: p.StatusReply, session: int) -> tuple[str, int]:
        """(name, pid) of the client whose 24-bit session is ``session``, from ``status``."""
        client = next((c for c in status.clients if lease_table.word_session(c.session_id) == session), None)
        return (client.name, client.own_pid or client.pid) if client else (f"session {session}", 0)

    def close(self) -> None:
        """The session ends: drop the peers' events it opened; ours stay alive for the
        importers that may still hold them, but no new taker finds them."""
        for event in self._peer_events.values():
            try:
                self._driver.event_destroy(event)
            except DriverError:
                pass  # a broken context: the process's teardown frees it
        self._peer_events.clear()
        self.waiting.clear()
        for pool_id in self.recording:
            _PROCESS_EVENTS.pop((self._daemon_key, pool_id, self._word_session), None)
