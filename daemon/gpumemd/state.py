"""The daemon's state: a dispatcher over the books that keep it.

Plain Python owned by the daemon's one thread. It never touches a socket: the outbox
(outbox.py) hands it each request (``handle``) and the loop's upkeep (``tick``), and
turns the ``Outcome`` and what is left to take (notices, deferred answers) into mail.
The driver is the only I/O, behind ``gpumem_shared.driver.Driver``, so tests drive this
class with the host backend and no zmq at all.

The books, each in its own module, bottom up: arenas.py (arenas, chunks, accounting,
admission; the window plan in window_plan.py), graph_pools.py (the registry and the
pools' lease segments), kv_pools.py (KV pools, their grows and commit rounds),
sleepers.py (arenas asleep), retained.py (retain groups and adoption), sessions.py
(HELLO, RESUME and the restart's grace period); status.py assembles the STATUS reply
from them. Each request type maps to one handler in an explicit table. A book never
imports one above it; what one event means for several books (a session ending, an arena
released or destroyed, a decommit under a graph pool) is decided here, and the session
desk's verdicts (a session to close) are carried out here. An arena's life is decided in
one place (``_reap``: it lives while attached, or while an orphaned retain group keeps
it), and the answers that wait (a round, a grow, a wake, an adoption) are looked at in
one (``_follow_up``): the arena book raises ``freed`` where memory comes free and the
dispatcher reads it once per request, session end and tick, instead of each place that
frees memory calling the others' follow-ups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from gpumem_shared import protocol as p
from gpumem_shared.driver import Driver
from gpumem_shared.lease_order import LeaseOrdering

from gpumemd import names, status
from gpumemd.arenas import ArenaBook
from gpumemd.config import StateConfig
from gpumemd.fencing import Fence, fence_for
from gpumemd.graph_pools import GraphPoolBook
from gpumemd.lease_order_lanes import SequenceChunk
from gpumemd.image import IMAGE_VERSION, Keep, StateImage, Take
from gpumemd.kv_pools import KvBook
from gpumemd.records import ArenaRecord, Completion, Notices, Outcome, SessionRecord
from gpumemd.sleepers import SleeperBook
from gpumemd.retained import RetainBook
from gpumemd.sessions import SessionDesk
from gpumemd.tally import Tally
from gpumemd.tenants import Tenants

log = logging.getLogger("gpumemd.state")

Handler = Callable[[Any, Any], Outcome]

# Requests that change nothing a restart must find: no durable record is written for them.
_READ_ONLY: frozenset[type] = frozenset({p.Ping, p.Status, p.LookupLeaseEvent, p.RetainReserve})

# The field of each request that names an arena (a KV pool is one): the daemon reads it
# as a name of the sender's uid (names.resolve) before any book sees it.
_ARENA_FIELD: dict[type, str] = {
    **dict.fromkeys(
        [p.CreateArena, p.AttachArena, p.ShareArena, p.UnshareArena, p.CommitArena, p.DecommitArena, p.SyncArena,
         p.ReleaseArena, p.ChunksUnmapped, p.PlaceholderArena, p.KvDeclare], "name"),
    **dict.fromkeys([p.RoundJoin, p.CaptureDone, p.KvGrow, p.KvShrink, p.KvDemand], "pool"),
    p.RegisterGraphPool: "arena",
    **dict.fromkeys([p.SleepBuffer, p.FreeSleepBuffer], "arena"),
    **dict.fromkeys([p.SleepArena, p.WakeArena, p.Retain], "name"),
}
_CREATES: dict[type, str] = {p.CreateArena: "arena name", p.KvDeclare: "KV pool name"}

class DaemonState:
    def __init__(
        self,
        driver: Driver,
        config: StateConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        fence: Fence | None = None,
        gone: Callable[[int, float], bool] | None = None,
    ) -> None:
        self.driver = driver
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.started = clock()
        self.stopping = False
        # Whether anything a restart must find changed since the durable record was last written.
        self.dirty = False
        # What the start could not rebuild from the store (durable.py says), shown in status.
        self.restore_problems: list[str] = []
        self._notices: Notices = []
        self.sessions: dict[int, SessionRecord] = {}
        self.device = p.DeviceInfo(
            index=config.index,
            uuid=driver.device_uuid(),
            name=driver.device_name(),
            total_bytes=driver.total_bytes(),
            granularity=driver.granularity,
        )
        self.tally = Tally()
        self._served = self.tally.served  # counted on every request: one lookup fewer
        self.tenants = Tenants(config.tenants, self.sessions)
        self.arenas = ArenaBook(driver, config, self.device, self.tenants)
        fence = fence or fence_for(driver.kind, self.device.uuid)
        order = SequenceChunk(driver, fence) if config.lease_ordering is LeaseOrdering.MEMOPS else None
        self.graph_pools = GraphPoolBook(self.arenas, self.sessions, self.device, order)
        self.kv = KvBook(self.arenas, self.sessions, config, clock, wall_clock, self.tally)
        self.sleepers = SleeperBook(self.arenas, self.kv, self.sessions, config, clock, wall_clock)
        self.retained = RetainBook(self.arenas, self.kv, self.sleepers, self.sessions, config, clock, fence)
        self.session_desk = SessionDesk(
            self.sessions, p.Backend(driver.kind), self.device, config, self.arenas, self.tenants, self.tally, clock, wall_clock, gone,
        )
        self._handlers: dict[type, Handler] = {
            p.Ping: lambda s, m: Outcome(p.Ack()),
            p.Status: lambda s, m: Outcome(self.status()),
            p.CreateArena: self._create_arena,
            p.AttachArena: self._awake(self._attach, "attach"),
            p.ShareArena: self.arenas.share,
            p.UnshareArena: self.arenas.unshare,
            p.CommitArena: self._awake(self.arenas.commit, "commit to"),
            p.DecommitArena: self._awake(self._decommit, "decommit"),
            p.SyncArena: self.arenas.sync,
            p.ReleaseArena: self._release,
            p.ChunksUnmapped: self.arenas.chunks_unmapped,
            p.PlaceholderArena: self.arenas.placeholder,
            p.KvDeclare: self.kv.declare,
            p.RoundJoin: self.kv.join,
            p.KvShrink: self.kv.shrink,
            p.KvDemand: self.kv.report_demand,
            p.RegisterGraphPool: self.graph_pools.register,
            p.UpdateGraphPool: self.graph_pools.update,
            p.RetireGraphPool: self.graph_pools.retire,
            p.OpenGraphPool: self.graph_pools.open,
            p.PublishLeaseEvent: self.graph_pools.publish_event,
            p.LookupLeaseEvent: self.graph_pools.lookup_event,
            p.ReportEscape: self._report_escape,
            p.SleepBuffer: self.sleepers.buffer,
            p.FreeSleepBuffer: self.sleepers.free,
            p.SleepArena: self._sleep,
            p.RetainGroup: self.retained.open,
            p.Retain: self.retained.mark,
            p.AdoptDone: self.retained.adopt_done,
            p.RetainReserve: self.retained.reserve,
        }
        # Answered later (when their round commits or fails, or once what they wait for
        # comes, or their wait ends): they need the request id.
        self._deferred: dict[type, Callable[[Any, Any, int], Outcome]] = {
            p.CaptureDone: self.kv.capture_done, p.KvGrow: self.kv.grow, p.WakeArena: self.sleepers.wake, p.Adopt: self._adopt,
        }

    # ------------------------------------------------------------------ sessions

    def open_session(self, hello: p.Hello, pid: int, uid: int, gid: int) -> tuple[SessionRecord, p.HelloReply]:
        if self.stopping:
            raise p.ProtocolError(p.ErrorCode.SHUTTING_DOWN, "gpumemd is stopping; connect again once it is back")
        tenant_key, taken_over = self.session_desk.admit(hello, pid, uid)
        if taken_over is not None:  # its process is gone: released as a dead client's, its name goes to this one
            self._close_all([taken_over])
        opened = self.session_desk.open(hello, pid, uid, gid, tenant_key)
        self.dirty = True
        return opened

    def resume(self, m: p.Resume, pid: int, uid: int, gid: int) -> tuple[SessionRecord, p.HelloReply]:
        if self.stopping:
            raise p.ProtocolError(p.ErrorCode.SHUTTING_DOWN, "gpumemd is stopping; resume once it is back")
        resumed = self.session_desk.resume(m, pid, uid, gid)
        self.dirty = True
        return resumed

    def _close_all(self, session_ids: list[int]) -> None:
        """Sessions the desk gave up on (sessions.py): closed as dead clients', their notices kept for the loop."""
        for session_id in session_ids:
            self._notices += self.close_session(session_id)

    def close_session(self, session_id: int) -> Notices:
        """The client is gone (EOF on its fd channel): its mappings died with it."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return []
        self.dirty = True
        started = time.perf_counter()
        held = self.arenas.accounted_bytes()
        left = [a for a in self.arenas.by_name.values() if session_id in a.attached]
        notices: Notices = []
        rounds = self.kv.drop_session(session_id)
        self.graph_pools.session_ended(session_id)
        self.retained.session_ended(session, notices)  # what it retained is orphaned for an adopter, not reclaimed
        for arena in left:
            self.arenas.detach(arena, session_id)
            if arena.owner_id == session_id:
                self.arenas.owner_left(arena, notices, released=False)
            self._reap(arena, notices)
            if arena.attached and arena.owner_id == session_id:
                log.info("arena %r outlives its owner %s: still attached by %d client(s)", arena.name, session.name, len(arena.attached))
        # Chunks of arenas gone since (one a restart could not rebuild) stop counting it.
        self.arenas.drop_holder(session_id)
        for round_ in rounds:  # once its memory is given back: the budget counts it as free
            self.kv.try_finish(round_)
        self._follow_up()  # a grow or a wake waiting for its memory, an adopter for its end, may go ahead
        if not left:  # it released what it had: a clean close
            log.info("session %d closed: client %r %s", session.id, session.name, session.pids)
            return notices
        # It ended still attached: it died (or closed without releasing), and the daemon
        # took back what it held. Bytes stay accounted while another client maps them.
        reclaimed = held - self.arenas.accounted_bytes()
        seconds = time.perf_counter() - started
        self.tally.sessions_reclaimed += 1
        self.tally.reclaimed_bytes += reclaimed
        self.tally.reclaim_seconds.observe(seconds)
        log.info(
            "session %d closed: client %r %s left %d arena(s) attached (%s); %d bytes reclaimed in %.0f µs",
            session.id, session.name, session.pids, len(left), ", ".join(a.name for a in left), reclaimed, seconds * 1e6,
            extra={"figures": {"session": session.id, "pid": session.own_pid, "arenas": len(left), "reclaimed": reclaimed, "micros": round(seconds * 1e6)}},
        )
        return notices

    # ------------------------------------------------------------------ requests

    def handle(self, session: SessionRecord | None, message: Any, request_id: int = 0) -> Outcome:
        cls = type(message)
        try:
            handler = self._handlers.get(cls)
            deferred = self._deferred.get(cls)
            if handler is None and deferred is None:
                raise p.ProtocolError(p.ErrorCode.UNKNOWN_MESSAGE, f"{cls.__name__} is not a request the daemon serves")
            if self.stopping and not cls.WHILE_STOPPING:
                raise p.ProtocolError(p.ErrorCode.SHUTTING_DOWN, "gpumemd is stopping; mapped memory stays valid in your process")
            if session is None and cls.NEEDS_SESSION:
                raise p.ProtocolError(p.ErrorCode.NO_SESSION, "this request needs a session: open one with HELLO on the fd channel first")
            field = _ARENA_FIELD.get(cls)
            if field is not None and session is not None:
                key = names.resolve(session, getattr(message, field), self.arenas.by_name, self.tenants.owners, create=_CREATES.get(cls, ""))
                message = msgspec.structs.replace(message, **{field: key})
            if deferred is not None:
                outcome = deferred(session, message, request_id)
            else:
                assert handler is not None
                outcome = handler(session, message)
        except p.ProtocolError as exc:
            self.tally.refuse(cls, int(exc.code))
            raise
        except Exception:
            self.tally.refuse(cls, int(p.ErrorCode.INTERNAL))  # what the server answers for it
            raise
        self._served[cls] += 1
        if cls not in _READ_ONLY:
            self.dirty = True
            self._follow_up()
        return outcome

    def _create_arena(self, s: SessionRecord, m: p.CreateArena) -> Outcome:
        return Outcome(p.ArenaReply(arena=self.arenas.view(self.arenas.create(s, m.name, m.reserve_bytes))))

    def _attach(self, s: SessionRecord, m: p.AttachArena) -> Outcome:
        self.retained.check_attach(m.name)
        return self.arenas.attach(s, m)

    def _decommit(self, s: SessionRecord, m: p.DecommitArena) -> Outcome:
        arena, drop = self.arenas.decommit_cut(s, m)
        if drop:
            self.graph_pools.refuse_from(arena, drop[0].offset, "decommit")
        return self.arenas.decommit(s, arena, drop)

    def _awake(self, handler: Handler, action: str) -> Handler:
        """``handler``, refused (ARENA_ASLEEP) for an arena that sleeps: its chunks are
        the device's meanwhile, and its wake commits them again at their offsets."""

        def checked(s: SessionRecord, m: Any) -> Outcome:
            self.sleepers.check_awake(m.name, action)
            return handler(s, m)

        return checked

    def _sleep(self, s: SessionRecord, m: p.SleepArena) -> Outcome:
        """Every chunk goes back, under graph pools too (unlike a decommit): the pools stay
        registered, their contents are in what the owner kept, and its wake maps the same
        addresses again."""
        notices: Notices = []
        outcome = self.sleepers.sleep(s, m, notices)
        outcome.notices = notices
        return outcome

    def _report_escape(self, s: SessionRecord, m: p.ReportEscape) -> Outcome:
        outcome = self.graph_pools.report_escape(s, m)
        if m.escaped:
            self.tally.escapes[m.pool_id] = self.tally.escapes.get(m.pool_id, 0) + 1
        return outcome

    def _release(self, s: SessionRecord, m: p.ReleaseArena) -> Outcome:
        """Owner: destroy the arena (once its sharers detach too). Sharer: detach."""
        arena = self.arenas.attached(s, m.name)
        notices: Notices = []
        self.arenas.detach(arena, s.id)
        for pool in self.graph_pools.in_arena(arena.name):
            self.graph_pools.forget_user(pool, s.id, f"let go of arena '{arena.name}'")
        if arena.owner_id == s.id:
            for pool in self.graph_pools.in_arena(arena.name):
                self.graph_pools.drop(pool)  # its memory goes now, even while sharers stay attached
            self.arenas.owner_left(arena, notices, released=True)
        self._reap(arena, notices)
        return Outcome(p.Ack(), notices=notices)

    def _reap(self, arena: ArenaRecord, notices: Notices) -> None:
        """Where an arena's life is decided: it lives while a session attaches it, or while
        an orphaned retain group keeps it for an adopter (its last sharer leaving keeps
        it); else it goes."""
        if not arena.attached and not self.retained.orphaned(arena.name):
            self._destroy(arena, notices)

    def _destroy(self, arena: ArenaRecord, notices: Notices) -> None:
        for pool in self.graph_pools.in_arena(arena.name):
            self.graph_pools.drop(pool)
        left = self.kv.drop_pool(arena.name) if arena.kv else []
        self.sleepers.drop_arena(arena.name)
        self.retained.forget(arena.name)
        self.arenas.destroy(arena, notices)
        if not self.stopping:
            for round_ in left:  # it may have been the last one pending
                self.kv.try_finish(round_)

    # ------------------------------------------------------------------ the loop's hooks

    def tick(self) -> None:
        """Lease-slot repairs, round deadlines, the counts of pools gone: called by the server's loop."""
        self.graph_pools.sweep()
        if self.kv.active_rounds() or self.kv.grows or self.sleepers.wakes or self.retained.adopts:
            self.dirty = True  # deadlines may end a round or a wait: what it commits must be kept
        self.kv.tick()
        self._close_all(self.session_desk.tick())  # clients that died before they resumed, or did not resume in time
        for name in self.retained.expired():
            arena = self.arenas.by_name.get(name)
            if arena is not None:  # a sharer still attached keeps it, as a dead owner's
                self._reap(arena, self._notices)
                self.dirty = True
        self.sleepers.settle()  # waits that reached their deadline, and those the fence now lets go
        self.retained.settle()
        self._follow_up()
        escapes = self.tally.escapes
        if len(escapes) > len(self.graph_pools.by_id):  # pools went: their counts go too
            for gone in escapes.keys() - self.graph_pools.by_id.keys():
                del escapes[gone]

    def _adopt(self, s: SessionRecord, m: p.Adopt, request_id: int) -> Outcome:
        # A holder kept across a restart that died since (it was still exiting when the
        # daemon came back): its group is orphaned for this ADOPT, not at the next tick.
        self._close_all(self.session_desk.release_gone())
        return self.retained.adopt(s, m, request_id)

    def _follow_up(self) -> None:
        """What a request, a session's end or the tick let go ahead, looked at once: memory
        the arena book says came free, for the rounds, grows and wakes waiting for it; a
        holder's end, for the adoptions waiting."""
        while self.arenas.freed and not self.stopping:
            self.arenas.freed = False
            self.kv.memory_freed()
            self.sleepers.settle()
        if self.retained.adopts:
            self.retained.settle()

    def take_completions(self) -> list[Completion]:
        return self.kv.take_completions() + self.sleepers.take_completions() + self.retained.take_completions()

    def has_mail(self) -> bool:
        """Notices or deferred answers waiting to be taken."""
        return bool(self._notices) or self.kv.has_mail() or self.sleepers.has_mail() or self.retained.has_mail()

    def take_notices(self) -> Notices:
        notices, self._notices = self._notices, []
        return notices + self.kv.take_notices()

    def status(self) -> p.StatusReply:
        now, desk = self.clock(), self.session_desk
        daemon = status.daemon_status(
            self.driver.kind, now - self.started, self.config.runtime_dir, self.stopping, desk.generation, desk.grace_left(now),
            self.restore_problems,
        )
        return status.assemble(daemon, self.sessions, self.arenas, self.graph_pools, self.kv, self.sleepers, self.retained, now)

    # ------------------------------------------------------------------ the durable record

    def image(self, keep: Keep) -> StateImage:
        """What a restart rebuilds from: each book's part; ``keep`` is told the fds the
        store must hold for it."""
        return StateImage(
            IMAGE_VERSION, self.device.uuid, self.driver.kind, self.config.va_base, self.session_desk.generation,
            self.session_desk.image(),
            self.arenas.image(keep), self.graph_pools.image(keep), self.kv.image(),
            sleepers=self.sleepers.image(keep), retained=self.retained.image(),
        )

    def restore(self, image: StateImage, take: Take) -> None:
        """The state ``image`` was taken of, every session waiting for its client to
        resume (``take``: the stored fds by name)."""
        self.session_desk.restore(image.sessions, image.generation)
        self.arenas.restore(image.arenas, take)
        self.graph_pools.restore(image.graph_pools, take)
        self.kv.restore(image.kv)
        if image.sleepers is not None:
            self.restore_problems += self.sleepers.restore(image.sleepers, take)
        if image.retained is not None:
            self.retained.restore(image.retained)
        self._close_all(self.session_desk.start_grace())
        arenas = self.arenas
        log.info(
            "rebuilt from the fd store (generation %d): %d session(s) waiting up to %gs for their clients, %d arena(s), "
            "%d graph pool(s), %d KV pool(s), %d bytes accounted",
            self.session_desk.generation, len(self.sessions), self.config.restart_grace, len(arenas.by_name), len(self.graph_pools.by_id),
            len(self.kv.pools), arenas.accounted_bytes(),
            extra={"figures": {"generation": self.session_desk.generation, "sessions": len(self.sessions), "arenas": len(arenas.by_name)}},
        )

    # ------------------------------------------------------------------ shutdown

    def begin_stop(self) -> Notices:
        self.stopping = True
        notice = p.Notice(kind=p.NoticeKind.STOPPING, message="gpumemd is stopping; memory you mapped stays valid in your process")
        return [(sid, notice) for sid in self.sessions]

    def drop_all(self) -> None:
        """Drop the daemon's own references at exit; clients keep what they mapped."""
        for arena in list(self.arenas.by_name.values()):
            self._destroy(arena, [])
        self.arenas.retiring.clear()
        self.arenas.close()
        self.graph_pools.close()
        self.sleepers.close()
