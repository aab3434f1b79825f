"""The daemon's state: sessions, arenas, chunks and their accounting.

Plain Python owned by the daemon's one thread. It never touches a socket: the server
decodes a request, calls ``handle``, and carries out the ``Outcome`` (send the reply,
pass the handed-out chunks' fds, deliver notices). The driver is the only I/O here,
behind ``gpumem_shared.driver.Driver``, so tests drive this class with the host
backend and no zmq at all.

Accounting: a chunk counts against the device from its creation until nobody holds
it. The daemon drops its own reference when the chunk leaves an arena (decommit,
release), but clients that mapped it keep the memory alive until they report the
unmap or die, so such a chunk stays counted, as "retiring", until then.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from gpumem_shared import __version__
from gpumem_shared import protocol as p
from gpumem_shared.driver import Driver, DriverError
from gpumem_shared.driver.base import Handle
from gpumem_shared import leases
from gpumemd import kv

log = logging.getLogger("gpumemd.state")

GiB = 1 << 30
MiB = 1 << 20
# Beyond each arena's client-visible window the daemon reserves this much more in its own
# address space, to map (and scrub) the arena's placeholder chunks, which have no place
# of their own in the window.
PLACEHOLDER_SCRATCH = 512 * MiB
MAX_PLACEHOLDER_SLOT = 256 * MiB
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}\Z")


VA_PLAN_BASE = 0x2000_0000_0000
VA_PLAN_SLICE = 4 << 40
VA_PLAN_SLICES = 16  # 64 TiB in all, below the top-down mmap area near 128 TiB


def plan_range(index: int) -> tuple[int, int]:
    """The address range the daemon of device ``index`` plans arena windows in. Each
    device has its own slice: a process that maps arenas of several daemons (a
    tensor-parallel rank reading a peer GPU's chunks) needs their windows disjoint."""
    if not 0 <= index < VA_PLAN_SLICES:
        raise ValueError(f"device index {index}: address slices exist for 0-{VA_PLAN_SLICES - 1}")
    base = VA_PLAN_BASE + index * VA_PLAN_SLICE
    return base, base + VA_PLAN_SLICE


@dataclasses.dataclass
class StateConfig:
    index: int
    runtime_dir: str = ""
    bulk_chunk: int = 512 * MiB  # bulk commits come in chunks this large
    # KV prefixes: one chunk per this much of each buffer. Larger makes rounds faster
    # (fewer creates, exports and maps) and shrinks coarser (whole chunks only).
    kv_chunk: int = GiB
    reserve_bytes: int = 0  # never committed: the headroom other users of the device need
    va_base: int = VA_PLAN_BASE  # arenas are planned from here, far from where heaps,
    va_limit: int = VA_PLAN_BASE + VA_PLAN_SLICE  # libraries and torch's own allocations sit
    max_reserve: int = VA_PLAN_SLICE
    round_timeout: float = 300.0  # seconds from a round's first join to its deadline
    round_policy: str = "partial"  # at the deadline: "fail" the round, or commit the "partial" set


@dataclasses.dataclass(eq=False)
class Session:
    id: int
    name: str
    pid: int
    uid: int
    gid: int
    since: float
    token: bytes


@dataclasses.dataclass(eq=False)
class Chunk:
    id: int
    arena: str
    offset: int
    size: int
    address: int
    handle: Handle | None  # None once the daemon dropped its reference (retiring)
    holders: set[int] = dataclasses.field(default_factory=set)  # sessions that map it
    fresh: bool = True  # never handed out: zeroed before its first fd leaves the daemon

    def view(self) -> p.ChunkView:
        return p.ChunkView(id=self.id, offset=self.offset, size=self.size)


@dataclasses.dataclass(eq=False)
class Arena:
    name: str
    owner_id: int
    owner_name: str
    owner_pid: int
    address: int
    reserved: int
    owner_alive: bool = True
    released: bool = False  # the owner released it; waits for sharers to detach
    chunks: list[Chunk] = dataclasses.field(default_factory=list)  # live, by offset
    placeholders: list[Chunk] = dataclasses.field(default_factory=list)  # owner's, any offset
    shared_with: set[str] = dataclasses.field(default_factory=set)
    attached: set[int] = dataclasses.field(default_factory=set)  # owner and sharers

    @property
    def window(self) -> int:
        """What the daemon reserves: the clients' window plus the placeholder scratch."""
        return self.reserved + PLACEHOLDER_SCRATCH

    @property
    def committed(self) -> int:
        return sum(c.size for c in self.chunks)

    def owner_label(self) -> str:
        return f"client '{self.owner_name}' (pid {self.owner_pid})"


@dataclasses.dataclass(eq=False)
class GraphPool:
    """A CUDA-graph pool captured into an arena, as its owner last described it."""

    id: int
    owner_id: int
    owner_name: str
    arena: str
    label: str
    epoch: int
    extents: list[tuple[int, int]]  # (offset, size), by offset
    free_runs: list[tuple[int, int]]  # (offset, size), largest first
    slot: int  # in the lease table
    shared: bool = False  # clients the arena is shared with may open it
    events: dict[int, bytes] = dataclasses.field(default_factory=dict)  # session id -> its IPC event handle
    escapers: set[int] = dataclasses.field(default_factory=set)  # sessions with borrowed tensors past their scope

    def status(self) -> p.GraphPoolStatus:
        return p.GraphPoolStatus(
            id=self.id,
            owner=self.owner_name,
            arena=self.arena,
            label=self.label,
            epoch=self.epoch,
            extents=[p.Extent(offset=o, size=n) for o, n in self.extents],
            free_runs=[p.Extent(offset=o, size=n) for o, n in self.free_runs],
            free_bytes=sum(n for _, n in self.free_runs),
            slot=self.slot,
            shared=self.shared,
        )


@dataclasses.dataclass
class Outcome:
    reply: Any  # None: the answer comes later, as a Completion
    handout: list[Chunk] = dataclasses.field(default_factory=list)
    notices: list[tuple[int, p.Notice]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Completion:
    """A deferred answer (a CAPTURE_DONE answered when its round commits or fails)."""

    session_id: int
    request_id: int
    reply: Any  # a reply body, or a ProtocolError
    handout: list[Chunk] = dataclasses.field(default_factory=list)


def plan_chunk_sizes(nbytes: int, bulk: int, granularity: int) -> list[int]:
    """Bulk chunks while they fit, then a descending ladder of power-of-two multiples
    of the granularity for the tail: few map calls, and no chunk larger than needed."""
    sizes = [bulk] * (nbytes // bulk)
    tail = (nbytes % bulk) // granularity
    step = 1 << max(tail.bit_length() - 1, 0)
    while tail:
        if tail >= step:
            sizes.append(step * granularity)
            tail -= step
        step >>= 1
    return sizes


class DaemonState:
    def __init__(
        self,
        driver: Driver,
        config: StateConfig,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.driver = driver
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.started = clock()
        self.stopping = False
        self.sessions: dict[int, Session] = {}
        self.arenas: dict[str, Arena] = {}
        self.retiring: dict[int, Chunk] = {}
        self.kv_pools: dict[str, kv.KvPool] = {}
        self.rounds: list[kv.Round] = []  # the active one last; finished ones kept for status
        self.completions: list[Completion] = []
        self.graph_pools: dict[int, GraphPool] = {}
        self._next_graph_pool = 1
        self.lease_table, self.lease_fd = leases.LeaseTable.create()
        self._free_slots = list(range(leases.SLOTS - 1, 0, -1))  # slot 0 stays unused
        self._next_round = 1
        self._pending_notices: list[tuple[int, p.Notice]] = []
        self._next_session = 1
        self._next_chunk = 1
        self.device = p.DeviceInfo(
            index=config.index,
            uuid=driver.device_uuid(),
            name=driver.device_name(),
            total_bytes=driver.total_bytes(),
            granularity=driver.granularity,
        )
        self._handlers: dict[type, Callable[[Session | None, Any], Outcome]] = {
            p.Ping: self._ping,
            p.Status: self._status,
            p.CreateArena: self._create_arena,
            p.AttachArena: self._attach_arena,
            p.ShareArena: self._share_arena,
            p.CommitArena: self._commit,
            p.DecommitArena: self._decommit,
            p.SyncArena: self._sync,
            p.ReleaseArena: self._release,
            p.ChunksUnmapped: self._chunks_unmapped,
            p.PlaceholderArena: self._placeholder,
            p.KvDeclare: self._kv_declare,
            p.RoundJoin: self._round_join,
            p.KvGrow: self._kv_grow,
            p.KvShrink: self._kv_shrink,
            p.RegisterGraphPool: self._register_graph_pool,
            p.UpdateGraphPool: self._update_graph_pool,
            p.RetireGraphPool: self._retire_graph_pool,
            p.OpenGraphPool: self._open_graph_pool,
            p.PublishLeaseEvent: self._publish_lease_event,
            p.LookupLeaseEvent: self._lookup_lease_event,
            p.ReportEscape: self._report_escape,
        }

    # ------------------------------------------------------------------ sessions

    def open_session(self, hello: p.Hello, pid: int, uid: int, gid: int) -> tuple[Session, p.HelloReply]:
        if self.stopping:
            raise p.ProtocolError(p.ErrorCode.SHUTTING_DOWN, "gpumemd is stopping; connect again once it is back")
        if not _NAME.match(hello.name):
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"client name {hello.name!r} is not valid: 1-128 characters of letters, digits and ._:@+-",
            )
        live = {leases.word_session(i) for i in self.sessions}
        # Lease words must tell live sessions apart, and 0 in a slot's fields means nobody.
        while leases.word_session(self._next_session) in live or leases.word_session(self._next_session) == 0:
            self._next_session += 1
        session = Session(
            id=self._next_session, name=hello.name, pid=pid, uid=uid, gid=gid, since=self.wall_clock(), token=os.urandom(16)
        )
        self._next_session += 1
        self.sessions[session.id] = session
        log.info("session %d opened: client %r pid %d uid %d", session.id, session.name, pid, uid)
        reply = p.HelloReply(
            lease_slots=leases.SLOTS,
            protocol=list(p.PROTOCOL_VERSION),
            daemon_version=__version__,
            daemon_pid=os.getpid(),
            session_id=session.id,
            token=session.token,
            backend=self.driver.kind,
            device=self.device,
        )
        return session, reply

    def close_session(self, session_id: int) -> list[tuple[int, p.Notice]]:
        """The client is gone (EOF on its fd channel): its mappings died with it."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return []
        notices: list[tuple[int, p.Notice]] = []
        rounds = self._active_rounds()
        for round_ in rounds:
            for member in [m for m in round_.members if m.session_id == session_id]:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{member.pool.name}: the client went away")
        self.sweep_leases(session_id)
        for pool_id in [g.id for g in self.graph_pools.values() if g.owner_id == session_id]:
            self._drop_graph_pool(self.graph_pools[pool_id])
        for arena in [a for a in self.arenas.values() if session_id in a.attached]:
            self._drop_holder_everywhere(arena, session_id)
            arena.attached.discard(session_id)
            if arena.owner_id == session_id:
                arena.owner_alive = False
                self._retire(arena.placeholders, notices, "", arena.name)
                arena.placeholders = []
            if not arena.attached:
                self._destroy_arena(arena, notices)
            elif arena.owner_id == session_id:
                log.info("arena %r outlives its owner %s: still attached by %d client(s)", arena.name, session.name, len(arena.attached))
        for round_ in rounds:  # once its memory is given back: the budget counts it as free
            self._try_finish(round_)
        log.info("session %d closed: client %r pid %d", session.id, session.name, session.pid)
        return notices

    # ------------------------------------------------------------------ requests

    def handle(self, session: Session | None, message: Any, request_id: int = 0) -> Outcome:
        if isinstance(message, p.CaptureDone):
            return self._capture_done(session, message, request_id)
        handler = self._handlers.get(type(message))
        if handler is None:
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_MESSAGE, f"{type(message).__name__} is not a request the daemon serves")
        if self.stopping and not isinstance(message, (p.Ping, p.Status, p.ChunksUnmapped, p.ReleaseArena)):
            raise p.ProtocolError(p.ErrorCode.SHUTTING_DOWN, "gpumemd is stopping; mapped memory stays valid in your process")
        return handler(session, message)

    def _ping(self, session: Session | None, message: p.Ping) -> Outcome:
        return Outcome(p.Ack())

    def _status(self, session: Session | None, message: p.Status) -> Outcome:
        return Outcome(self.status())

    def _create_arena(self, session: Session | None, m: p.CreateArena) -> Outcome:
        s = self._need_session(session)
        self._check_name(m.name, "arena name")
        self._check_size(m.reserve_bytes, "reserve_bytes", allow_zero=False)
        if m.reserve_bytes > self.config.max_reserve:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"reserve_bytes {m.reserve_bytes} exceeds the daemon's limit of {self.config.max_reserve} per arena",
                requested=m.reserve_bytes,
                limit=self.config.max_reserve,
            )
        existing = self.arenas.get(m.name)
        if existing is not None:
            raise p.ProtocolError(
                p.ErrorCode.ALREADY_EXISTS, f"arena '{m.name}' already exists, owned by {existing.owner_label()}"
            )
        address = self._plan_window(m.reserve_bytes + PLACEHOLDER_SCRATCH)
        arena = Arena(
            name=m.name, owner_id=s.id, owner_name=s.name, owner_pid=s.pid, address=address, reserved=m.reserve_bytes
        )
        arena.attached.add(s.id)
        self.arenas[m.name] = arena
        log.info("arena %r created by %r: %d bytes at %#x", m.name, s.name, m.reserve_bytes, address)
        return Outcome(p.ArenaReply(arena=self._view(arena)))

    def _attach_arena(self, session: Session | None, m: p.AttachArena) -> Outcome:
        s = self._need_session(session)
        arena = self._arena(m.name)
        if s.id in arena.attached:
            raise p.ProtocolError(p.ErrorCode.ALREADY_EXISTS, f"this session is already attached to arena '{m.name}'")
        if arena.released:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"arena '{m.name}' was released by {arena.owner_label()}")
        if s.name not in arena.shared_with:
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"arena '{m.name}' belongs to {arena.owner_label()} and is not shared with client '{s.name}'",
            )
        arena.attached.add(s.id)
        return self._map_reply(s, arena)

    def _share_arena(self, session: Session | None, m: p.ShareArena) -> Outcome:
        s = self._need_session(session)
        arena = self._owned_arena(s, m.name, "share")
        self._refuse_kv(arena, "sharing")
        self._check_name(m.client, "client name")
        arena.shared_with.add(m.client)
        return Outcome(p.Ack())

    def _commit(self, session: Session | None, m: p.CommitArena) -> Outcome:
        s = self._need_session(session)
        arena = self._owned_arena(s, m.name, "commit")
        self._refuse_kv(arena, "commit")
        self._check_size(m.nbytes, "nbytes", allow_zero=False)
        if m.nbytes > arena.reserved:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"commit of {m.nbytes} bytes exceeds arena '{arena.name}'s reservation of {arena.reserved}",
                requested=m.nbytes,
                reserved=arena.reserved,
            )
        committed = arena.committed
        if m.nbytes < committed:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"arena '{arena.name}' already has {committed} bytes committed; decommit shrinks it",
                requested=m.nbytes,
                committed=committed,
            )
        need = m.nbytes - committed
        if need == 0:
            return self._map_reply(s, arena)
        available = self._require_available(need, f"committing {need} more bytes to arena '{arena.name}'")
        self._create([(arena, committed, need)], available)
        outcome = self._map_reply(s, arena)
        outcome.notices = self._notify_sharers(arena, s.id, "arena-grown", f"arena '{arena.name}' grew to {arena.committed} bytes; sync to map it")
        return outcome

    def _decommit(self, session: Session | None, m: p.DecommitArena) -> Outcome:
        s = self._need_session(session)
        arena = self._owned_arena(s, m.name, "decommit")
        self._refuse_kv(arena, "decommit")
        self._check_size(m.to_nbytes, "to_nbytes", allow_zero=True)
        if m.to_nbytes > arena.committed:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"decommit to {m.to_nbytes} bytes is above arena '{arena.name}'s committed {arena.committed}; commit grows it",
                requested=m.to_nbytes,
                committed=arena.committed,
            )
        keep = [c for c in arena.chunks if c.offset < m.to_nbytes]
        drop = arena.chunks[len(keep) :]
        if drop:
            self._refuse_if_graph_pools(arena, drop[0].offset, "decommit")
        arena.chunks = keep
        notices: list[tuple[int, p.Notice]] = []
        self._retire(drop, notices, f"arena '{arena.name}' shrank to {arena.committed} bytes; sync to unmap the rest", arena.name, exclude=s.id)
        retired = [c.view() for c in drop if s.id in c.holders]
        return Outcome(p.MapReply(arena=self._view(arena), chunks=[], retired=retired, fd_batches=0), notices=notices)

    def _sync(self, session: Session | None, m: p.SyncArena) -> Outcome:
        s = self._need_session(session)
        arena = self._arena(m.name)
        if s.id not in arena.attached:
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"this session is not attached to arena '{m.name}'")
        return self._map_reply(s, arena)

    def _release(self, session: Session | None, m: p.ReleaseArena) -> Outcome:
        s = self._need_session(session)
        arena = self._arena(m.name)
        if s.id not in arena.attached:
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"this session is not attached to arena '{m.name}'")
        notices: list[tuple[int, p.Notice]] = []
        self._drop_holder_everywhere(arena, s.id)
        arena.attached.discard(s.id)
        for pool in [g for g in self.graph_pools.values() if g.arena == arena.name]:
            self._forget_user(pool, s.id)
        if arena.owner_id == s.id:
            arena.released = True
            arena.owner_alive = False
            for pool_id in [g.id for g in self.graph_pools.values() if g.arena == arena.name]:
                self._drop_graph_pool(self.graph_pools[pool_id])  # its memory goes now, even while sharers stay attached
            self._retire(arena.placeholders, notices, "", arena.name)
            arena.placeholders = []
            if arena.attached:
                self._retire(arena.chunks, notices, f"arena '{arena.name}' was released by its owner; release it too", arena.name)
                arena.chunks = []
        if not arena.attached:
            self._destroy_arena(arena, notices)
        return Outcome(p.Ack(), notices=notices)

    def _placeholder(self, session: Session | None, m: p.PlaceholderArena) -> Outcome:
        s = self._need_session(session)
        arena = self._owned_arena(s, m.name, "back with placeholders")
        self._check_size(m.slot_bytes, "slot_bytes", allow_zero=False)
        if m.slot_bytes > MAX_PLACEHOLDER_SLOT:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"placeholder slot of {m.slot_bytes} bytes exceeds the limit of {MAX_PLACEHOLDER_SLOT}",
                slot_bytes=m.slot_bytes,
                limit=MAX_PLACEHOLDER_SLOT,
            )
        sizes = sorted({m.slot_bytes, self.device.granularity}, reverse=True)
        have = {c.size: c for c in arena.placeholders}
        missing = [size for size in sizes if size not in have]
        used = sum(c.size for c in arena.placeholders)
        if used + sum(missing) > PLACEHOLDER_SCRATCH:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"arena '{arena.name}' already holds placeholders of {sorted(have)} bytes; "
                f"at most {PLACEHOLDER_SCRATCH} bytes of placeholders per arena",
            )
        if missing:
            need = sum(missing)
            self._require_available(need, f"placeholders of {need} bytes for arena '{arena.name}'")
            placements = []
            for size in missing:
                placements.append((arena.address + arena.reserved + used, size))
                used += size
            try:
                handles = self.driver.create_chunks(placements)
            except DriverError as exc:
                code = p.ErrorCode.OUT_OF_MEMORY if exc.out_of_memory else p.ErrorCode.DRIVER_ERROR
                raise p.ProtocolError(code, f"creating placeholders for arena '{arena.name}' failed: {exc}") from None
            for (address, size), handle in zip(placements, handles):
                chunk = Chunk(id=self._next_chunk, arena=arena.name, offset=0, size=size, address=address, handle=handle)
                self._next_chunk += 1
                arena.placeholders.append(chunk)
                have[size] = chunk
        wanted = [have[size] for size in sizes]
        handout = [c for c in wanted if s.id not in c.holders]
        for chunk in handout:
            chunk.holders.add(s.id)
        reply = p.PlaceholderReply(
            arena=self._view(arena),
            chunks=[c.view() for c in wanted],
            fd_batches=-(-len(handout) // p.MAX_FDS_PER_MESSAGE),
        )
        return Outcome(reply, handout=handout)

    # ------------------------------------------------------------------ graph-pool registry

    def _register_graph_pool(self, session: Session | None, m: p.RegisterGraphPool) -> Outcome:
        s = self._need_session(session)
        arena = self._owned_arena(s, m.arena, "register graph pools in")
        self._refuse_kv(arena, "graph pools")
        if not m.label or len(m.label) > 256:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "a graph pool needs a label of 1-256 characters")
        extents, runs = self._check_graph_pool(arena, m.extents, m.free_runs, exclude=None)
        if not self._free_slots:
            raise p.ProtocolError(p.ErrorCode.OUT_OF_MEMORY, f"all {leases.SLOTS - 1} lease slots are in use; retire graph pools first")
        pool = GraphPool(
            id=self._next_graph_pool,
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
        self._next_graph_pool += 1
        self.graph_pools[pool.id] = pool
        self.lease_table.set_epoch(pool.slot, leases.lease_epoch(pool.id, pool.epoch))
        self.lease_table.set_flags(pool.slot, leases.FLAG_SHARED if pool.shared else 0)
        # A free slot is clients' shared memory too: nothing written there carries over.
        self.lease_table.forget_handoff(pool.slot, self.lease_table.handoff(pool.slot))
        self.lease_table.set_escaped(pool.slot, 0)
        return Outcome(p.GraphPoolReply(pool=pool.status()))

    def _update_graph_pool(self, session: Session | None, m: p.UpdateGraphPool) -> Outcome:
        s = self._need_session(session)
        pool = self._owned_graph_pool(s, m.pool_id)
        extents, runs = self._check_graph_pool(self.arenas[pool.arena], m.extents, m.free_runs, exclude=pool)
        # A borrower's view of the runs must not outlive them: new runs, new epoch.
        changed = (extents, runs) != (pool.extents, pool.free_runs)
        pool.extents, pool.free_runs = extents, runs
        if m.recaptured or changed:
            pool.epoch += 1
            self.lease_table.set_epoch(pool.slot, leases.lease_epoch(pool.id, pool.epoch))
        return Outcome(p.GraphPoolReply(pool=pool.status()))

    def _retire_graph_pool(self, session: Session | None, m: p.RetireGraphPool) -> Outcome:
        s = self._need_session(session)
        self._drop_graph_pool(self._owned_graph_pool(s, m.pool_id))
        return Outcome(p.Ack())

    def _open_graph_pool(self, session: Session | None, m: p.OpenGraphPool) -> Outcome:
        s = self._need_session(session)
        if m.pool_id:
            pool = self.graph_pools.get(m.pool_id)
            what = f"graph pool {m.pool_id}"
        else:
            found = [g for g in self.graph_pools.values() if g.owner_name == m.owner and g.label == m.label]
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
            if s.id not in self.arenas[pool.arena].attached:
                raise p.ProtocolError(
                    p.ErrorCode.PERMISSION_DENIED,
                    f"graph pool {pool.id} ('{pool.label}') lives in arena '{pool.arena}', which this client has not "
                    f"attached: '{pool.owner_name}' shares the arena with it, then it attaches",
                )
        return Outcome(p.GraphPoolReply(pool=pool.status()))

    def _publish_lease_event(self, session: Session | None, m: p.PublishLeaseEvent) -> Outcome:
        s = self._need_session(session)
        pool = self.graph_pools.get(m.pool_id)
        if pool is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no graph pool {m.pool_id} on device {self.device.index}")
        self._check_pool_user(s, pool)
        if not pool.shared:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"graph pool {pool.id} is not shared: its leases need no IPC event")
        if not 0 < len(m.handle) <= 256:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"an IPC event handle has 1-256 bytes, not {len(m.handle)}")
        pool.events[s.id] = m.handle
        return Outcome(p.Ack())

    def _check_pool_user(self, s: Session, pool: GraphPool) -> None:
        if s.id != pool.owner_id and s.id not in self.arenas[pool.arena].attached:
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"this client has not attached arena '{pool.arena}' of graph pool {pool.id}")

    def _lookup_lease_event(self, session: Session | None, m: p.LookupLeaseEvent) -> Outcome:
        s = self._need_session(session)
        pool = self.graph_pools.get(m.pool_id)
        if pool is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no graph pool {m.pool_id} on device {self.device.index}")
        self._check_pool_user(s, pool)
        for sid, handle in pool.events.items():
            if leases.word_session(sid) == m.session:
                return Outcome(p.LeaseEventReply(handle=handle))
        raise p.ProtocolError(
            p.ErrorCode.NOT_FOUND,
            f"session {m.session} published no IPC event for graph pool {pool.id} (it ended, or never released a lease there)",
        )

    def _report_escape(self, session: Session | None, m: p.ReportEscape) -> Outcome:
        s = self._need_session(session)
        pool = self.graph_pools.get(m.pool_id)
        if pool is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no graph pool {m.pool_id} on device {self.device.index}")
        self._check_pool_user(s, pool)
        if m.escaped:
            pool.escapers.add(s.id)
            log.warning("graph pool %d ('%s'): client %r holds borrowed tensors past their scope; replays refused", pool.id, pool.label, s.name)
        else:
            pool.escapers.discard(s.id)
        self._write_escape(pool)
        return Outcome(p.Ack())

    @staticmethod
    def _escape_mark(pool: GraphPool) -> int:
        """What the slot's escape field must hold: one of the escaping sessions, or 0."""
        return leases.word_session(min(pool.escapers)) if pool.escapers else 0

    def _write_escape(self, pool: GraphPool) -> None:
        self.lease_table.set_escaped(pool.slot, self._escape_mark(pool))

    def _forget_user(self, pool: GraphPool, session_id: int) -> None:
        """``session_id`` no longer uses the pool (it ended, or let go of its arena): its
        event and its escapes go; if it was the last to release, nobody waits on it."""
        pool.events.pop(session_id, None)
        if session_id in pool.escapers:
            pool.escapers.discard(session_id)
            self._write_escape(pool)
        self.lease_table.forget_handoff(pool.slot, leases.word_session(session_id))

    def _drop_graph_pool(self, pool: GraphPool) -> None:
        """Forget the pool and free its lease slot: a holder is swept, waiters wake and
        find the slot's epoch no longer theirs."""
        del self.graph_pools[pool.id]
        self.lease_table.set_epoch(pool.slot, 0)
        self.lease_table.set_flags(pool.slot, 0)
        self.lease_table.forget_handoff(pool.slot, self.lease_table.handoff(pool.slot))
        self.lease_table.set_escaped(pool.slot, 0)
        word = self.lease_table.peek(pool.slot)
        if word:
            self.lease_table.clear(pool.slot, word)
        self._free_slots.append(pool.slot)

    def sweep_leases(self, session_id: int | None = None) -> None:
        """Clear slots held by ``session_id`` (its client is gone), or, with None, slots in
        a state that cannot be: a kind the daemon does not know, a holder session that
        does not exist, a slot no pool owns. A buggy client can write anything there."""
        owned = {g.slot: g for g in self.graph_pools.values()}
        live = {leases.word_session(i) for i in self.sessions}
        if session_id is not None:
            for pool in self.graph_pools.values():
                self._forget_user(pool, session_id)
        else:
            # Fields only the daemon writes, and one that must name a live session: a
            # buggy client may have written anything there.
            for slot, pool in owned.items():
                if self.lease_table.flags(slot) != (leases.FLAG_SHARED if pool.shared else 0):
                    log.warning("lease slot %d: flags %#x repaired", slot, self.lease_table.flags(slot))
                    self.lease_table.set_flags(slot, leases.FLAG_SHARED if pool.shared else 0)
                escaped = self._escape_mark(pool)
                if self.lease_table.escaped(slot) != escaped:
                    log.warning("lease slot %d: escape mark %d repaired to %d", slot, self.lease_table.escaped(slot), escaped)
                    self.lease_table.set_escaped(slot, escaped)
                handoff = self.lease_table.handoff(slot)
                if handoff and handoff not in live:
                    log.warning("lease slot %d named session %d, which does not exist; cleared", slot, handoff)
                    self.lease_table.forget_handoff(slot, handoff)
        for slot, word in enumerate(self.lease_table.words()):
            if not word:
                continue
            kind, holder, pid = leases.decode(word)
            if session_id is not None:
                if holder == leases.word_session(session_id):
                    self.lease_table.clear(slot, word)
                    log.info("lease slot %d: swept a %s lease of session %d (pid %d), which ended", slot, leases.KIND_NAMES.get(kind, kind), holder, pid)
                continue
            if kind not in leases.KIND_NAMES or holder not in live or slot not in owned:
                self.lease_table.clear(slot, word)
                log.warning("lease slot %d held an impossible word %#x (kind %d, session %d, pid %d); cleared", slot, word, kind, holder, pid)

    def _owned_graph_pool(self, s: Session, pool_id: int) -> GraphPool:
        pool = self.graph_pools.get(pool_id)
        if pool is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no graph pool {pool_id} on device {self.device.index} (retired, or its owner left)")
        if pool.owner_id != s.id:
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED, f"graph pool {pool_id} ('{pool.label}') belongs to client '{pool.owner_name}'"
            )
        return pool

    def _check_graph_pool(
        self, arena: Arena, extents: list[p.Extent], runs: list[p.Extent], exclude: GraphPool | None
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Extents in committed memory of the arena, disjoint from each other and from other
        pools; free runs inside the extents and disjoint. Returns them normalized."""
        committed = _merged([(c.offset, c.offset + c.size) for c in arena.chunks])
        spans = sorted((e.offset, e.offset + e.size) for e in extents)
        if not spans:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "a graph pool needs at least one extent")
        for start, end in spans:
            if start < 0 or end <= start:
                raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"extent [{start}, {end}) is empty or negative")
            if not any(a <= start and end <= b for a, b in committed):
                raise p.ProtocolError(
                    p.ErrorCode.INVALID_ARGUMENT,
                    f"extent [{start}, {end}) is not committed memory of arena '{arena.name}': graph pools must be "
                    "captured into committed daemon memory",
                )
        if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "the pool's extents overlap each other")
        for other in self.graph_pools.values():
            if other is exclude or other.arena != arena.name:
                continue
            for o, n in other.extents:
                if any(start < o + n and o < end for start, end in spans):
                    raise p.ProtocolError(
                        p.ErrorCode.ALREADY_EXISTS,
                        f"extent [{o}, {o + n}) of arena '{arena.name}' already belongs to graph pool {other.id} ('{other.label}')",
                    )
        run_spans = sorted((r.offset, r.offset + r.size) for r in runs)
        pool_spans = _merged(spans)  # adjacent extents: the runs are coalesced across them below
        for start, end in run_spans:
            if end <= start or not any(a <= start and end <= b for a, b in pool_spans):
                raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"free run [{start}, {end}) lies outside the pool's extents")
        if any(run_spans[i][1] > run_spans[i + 1][0] for i in range(len(run_spans) - 1)):
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, "free runs overlap each other")
        coalesced = _merged(run_spans)
        return [(a, b - a) for a, b in spans], sorted(((a, b - a) for a, b in coalesced), key=lambda r: (-r[1], r[0]))

    def _refuse_if_graph_pools(self, arena: Arena, from_offset: int, action: str) -> None:
        for pool in self.graph_pools.values():
            if pool.arena == arena.name and any(o + n > from_offset for o, n in pool.extents):
                raise p.ProtocolError(
                    p.ErrorCode.INVALID_ARGUMENT,
                    f"cannot {action} arena '{arena.name}' from offset {from_offset}: graph pool {pool.id} ('{pool.label}') "
                    "lives there; retire it first",
                )

    # ------------------------------------------------------------------ KV pools and rounds

    def _kv_declare(self, session: Session | None, m: p.KvDeclare) -> Outcome:
        s = self._need_session(session)
        self._check_name(m.name, "KV pool name")
        g = self.device.granularity
        if m.max_tokens < 0 or m.reserve_bytes < 0 or (m.max_tokens == 0) == (m.reserve_bytes == 0):
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{m.name}' needs exactly one positive bound: max_tokens ({m.max_tokens}) or reserve_bytes ({m.reserve_bytes})",
            )
        max_tokens = m.max_tokens
        if not max_tokens:
            per_token = sum(max(b.row_bytes, 1) for b in m.buffers) or 1
            max_tokens = m.reserve_bytes // per_token
            layouts, window = kv.layout(m.buffers, max_tokens, g)
            if window > m.reserve_bytes:  # rounding each region up costs a little: the most that still fit
                lo, hi = 0, max_tokens - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if kv.layout(m.buffers, mid, g)[1] <= m.reserve_bytes:
                        lo = mid
                    else:
                        hi = mid - 1
                max_tokens = lo
            if max_tokens <= 0:
                raise p.ProtocolError(
                    p.ErrorCode.INVALID_ARGUMENT, f"reserve_bytes {m.reserve_bytes} holds no token of KV pool '{m.name}'"
                )
        layouts, window = kv.layout(m.buffers, max_tokens, g)
        if window > self.config.max_reserve:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{m.name}' needs a {window}-byte window for {max_tokens} tokens, above the limit of "
                f"{self.config.max_reserve}",
                requested=window,
                limit=self.config.max_reserve,
            )
        reply = self._create_arena(s, p.CreateArena(name=m.name, reserve_bytes=window)).reply
        pool = kv.KvPool(name=m.name, owner_id=s.id, buffers=layouts, max_tokens=max_tokens, granularity=g)
        self.kv_pools[m.name] = pool
        return Outcome(p.KvDeclareReply(pool=pool.view(reply.arena)))

    def _round_join(self, session: Session | None, m: p.RoundJoin) -> Outcome:
        s = self._need_session(session)
        pool = self._owned_pool(s, m.pool, "join a round with")
        if pool.tokens:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' already holds {pool.tokens} tokens; grow it instead"
            )
        if m.expect < 0:  # before any round is opened or touched
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"expect must be >= 0, not {m.expect}")
        active = self._active_rounds()
        if any(r.member(pool.name) for r in active):
            raise p.ProtocolError(p.ErrorCode.ALREADY_EXISTS, f"KV pool '{pool.name}' is already in round {active[-1].id}")
        if active:
            round_ = active[-1]
            round_.state = "open"
        else:
            now = self.clock()
            round_ = kv.Round(
                id=self._next_round, created=now, deadline=now + self.config.round_timeout, policy=self.config.round_policy
            )
            self._next_round += 1
            self.rounds.append(round_)
            del self.rounds[:-16]  # finished rounds stay visible for a while
        round_.expect = max(round_.expect, m.expect)
        round_.joined += 1
        round_.members.append(kv.Member(pool=pool, session_id=s.id, client=s.name))
        log.info("round %d: %r joined with pool %r", round_.id, s.name, pool.name)
        return Outcome(self._round_view(round_))

    def _capture_done(self, session: Session | None, m: p.CaptureDone, request_id: int) -> Outcome:
        s = self._need_session(session)
        if self.stopping:
            raise p.ProtocolError(p.ErrorCode.SHUTTING_DOWN, "gpumemd is stopping")
        pool = self._owned_pool(s, m.pool, "report capture-done for")
        round_ = next((r for r in self._active_rounds() if r.member(pool.name)), None)
        if round_ is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"KV pool '{pool.name}' is in no open round; join one first")
        member = round_.member(pool.name)
        assert member is not None
        if member.reported:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' already reported capture-done in round {round_.id}")
        max_tokens = m.max_tokens or pool.max_tokens
        if not 0 <= m.min_tokens <= max_tokens <= pool.max_tokens:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{pool.name}': need 0 <= min_tokens ({m.min_tokens}) <= max_tokens ({max_tokens}) <= the "
                f"declared {pool.max_tokens}",
            )
        if m.headroom_bytes < 0 or m.graph_pool_bytes < 0 or not m.weight > 0:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT, "headroom_bytes and graph_pool_bytes must be >= 0 and weight > 0"
            )
        member.reported = True
        member.headroom_bytes = m.headroom_bytes
        member.graph_pool_bytes = m.graph_pool_bytes
        member.min_tokens = m.min_tokens
        member.max_tokens = max_tokens
        member.weight = m.weight
        member.request_id = request_id
        if round_.pending or round_.joined < round_.expect:
            self._stage(member)
        self._try_finish(round_)
        return Outcome(None)

    def _kv_grow(self, session: Session | None, m: p.KvGrow) -> Outcome:
        s = self._need_session(session)
        pool = self._owned_pool(s, m.pool, "grow")
        in_round = next((r for r in self._active_rounds() if r.member(pool.name)), None)
        if in_round is not None:  # the round decides its tokens; a grow now would be overwritten
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' is in round {in_round.id}; it grows once the round commits"
            )
        if not pool.tokens < m.tokens <= pool.max_tokens:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{pool.name}' holds {pool.tokens} tokens of at most {pool.max_tokens}; cannot grow to {m.tokens}",
            )
        arena = self.arenas[pool.name]
        wanted = self._kv_missing(pool, arena, m.tokens)
        need = sum(size for _, size in wanted)
        available = self._require_available(need, f"growing KV pool '{pool.name}' from {pool.tokens} to {m.tokens} tokens")
        before = {c.id for c in arena.chunks}
        self._create([(arena, offset, size) for offset, size in wanted], available, ladder=False)
        pool.tokens = m.tokens
        new = [c for c in arena.chunks if c.id not in before]
        return Outcome(self._kv_reply(s, pool, new, []), handout=self._hand(s, new))

    def _kv_shrink(self, session: Session | None, m: p.KvShrink) -> Outcome:
        s = self._need_session(session)
        pool = self._owned_pool(s, m.pool, "shrink")
        if not 0 <= m.tokens < pool.tokens:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' holds {pool.tokens} tokens; cannot shrink to {m.tokens}"
            )
        arena = self.arenas[pool.name]
        drop: list[Chunk] = []
        kept_tokens = pool.tokens
        for buffer in pool.buffers:
            bound = buffer.offset + pool.prefix(buffer, m.tokens)
            mine = [c for c in arena.chunks if buffer.offset <= c.offset < buffer.offset + buffer.region]
            drop += [c for c in mine if c.offset >= bound]
            kept_end = max((c.offset + c.size for c in mine if c.offset < bound), default=buffer.offset)
            kept_tokens = min(kept_tokens, (kept_end - buffer.offset) // buffer.row_bytes)
        arena.chunks = [c for c in arena.chunks if c not in drop]
        notices: list[tuple[int, p.Notice]] = []
        self._retire(drop, notices, "", arena.name, exclude=s.id)
        pool.tokens = kept_tokens
        pool.shrink_request = None
        log.info("KV pool %r shrank to %d tokens (asked %d), %d bytes retired", pool.name, kept_tokens, m.tokens, sum(c.size for c in drop))
        reply = self._kv_reply(s, pool, [], [c.view() for c in drop if s.id in c.holders])
        return Outcome(reply, notices=notices)

    def tick(self) -> None:
        """Deadlines and the lease table's sanity: called by the server's loop."""
        self.sweep_leases()
        for round_ in self._active_rounds():
            if self.clock() >= round_.deadline:
                self._try_finish(round_)

    def take_completions(self) -> list[Completion]:
        out, self.completions = self.completions, []
        return out

    def _active_rounds(self) -> list[kv.Round]:
        return [r for r in self.rounds if r.state in ("open", "awaiting-shrink")]

    def _try_finish(self, round_: kv.Round) -> None:
        """Commit the round once every member reported (or its deadline passed)."""
        now = self.clock()
        if round_.state not in ("open", "awaiting-shrink"):
            return
        late = now >= round_.deadline
        absent = max(0, round_.expect - round_.joined)
        if (round_.pending or absent) and not late:
            return
        if round_.pending or absent:
            missing = ", ".join(
                [f"{m.client}/{m.pool.name}" for m in round_.pending] + ([f"{absent} expected pool(s) that never joined"] if absent else [])
            )
            if round_.policy == "fail":
                self._fail_round(round_, f"round {round_.id} passed its deadline; these members did not report capture-done: {missing}")
                return
            for member in round_.pending:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{member.pool.name}: did not report capture-done by the deadline")
            log.warning("round %d: deadline passed; committing without %s", round_.id, missing)
        members = list(round_.members)
        if not members:
            round_.state = "failed"
            round_.error = "no member reported capture-done"
            return
        staged = sum(c.size for m in members for c in m.staged)
        free = self.free_bytes() + staged  # staged minimums are the members' own
        headroom = sum(m.headroom_bytes for m in members)
        budget = free - self.config.reserve_bytes - headroom
        round_.budget = {
            "free": free,
            "staged": staged,
            "reserve": self.config.reserve_bytes,
            "headroom": headroom,
            "graph_pools": sum(m.graph_pool_bytes for m in members),
            "budget": budget,
            "minimums": sum(m.pool.cost(m.min_tokens) for m in members),
        }
        try:
            tokens = kv.split(members, max(budget, 0))
        except kv.BudgetShort as short:
            if round_.state == "open" and not late and self._ask_shrinks(round_, short.needed - max(budget, 0)):
                round_.state = "awaiting-shrink"
                return
            if round_.state == "awaiting-shrink" and not late:
                return
            self._fail_round(
                round_,
                f"round {round_.id}: the members' minimum KV needs {short.needed} bytes but the budget is {budget} "
                f"(free {free} - reserve {self.config.reserve_bytes} - headroom {headroom})",
                needed=short.needed,
                budget=budget,
            )
            return
        work = []
        for member in members:
            arena = self.arenas[member.pool.name]
            work += [(arena, offset, size) for offset, size in self._kv_missing(member.pool, arena, tokens[member])]
        started = time.perf_counter()
        try:
            self._create(work, max(budget, 0), ladder=False)
        except p.ProtocolError as exc:
            self._fail_round(round_, f"round {round_.id}: {exc.message}")
            return
        created_ms = (time.perf_counter() - started) * 1e3
        round_.state = "committed"
        handouts = []
        for member in members:
            pool = member.pool
            pool.tokens = tokens[member]
            pool.min_tokens = member.min_tokens
            member.tokens = tokens[member]
            member.bytes = pool.cost(tokens[member])
            member.staged = []
            handouts.append((member, [c for c in self.arenas[pool.name].chunks if member.session_id not in c.holders]))
        handed = sum(len(new) for _, new in handouts)
        committed = sum(c.size for _, new in handouts for c in new)
        round_.budget["committed"] = committed  # before the replies: each carries a copy of the budget
        for member, new in handouts:
            session = self.sessions[member.session_id]
            reply = self._kv_reply(session, member.pool, new, [], round_)
            self.completions.append(Completion(member.session_id, member.request_id, reply, self._hand(session, new)))
        log.info(
            "round %d committed: %s (%d bytes in %d chunks; %d staged before the last report, the rest created in %.1f ms)",
            round_.id,
            ", ".join(f"{m.client}/{m.pool.name}={m.tokens} tokens" for m in members),
            committed,
            handed,
            staged,
            created_ms,
        )

    def _stage(self, member: kv.Member) -> None:
        """Create and zero the reporting member's minimum while the round waits for the
        others: it gets at least that much if the round commits, and the round's last
        report then waits only for what is left. Given back if the round fails."""
        arena = self.arenas[member.pool.name]
        work = [(arena, offset, size) for offset, size in self._kv_missing(member.pool, arena, member.min_tokens)]
        need = sum(size for _, _, size in work)
        if not work or need > self.available_bytes():
            return
        before = {c.id for c in arena.chunks}
        try:
            self._create(work, need, ladder=False)
            new = [c for c in arena.chunks if c.id not in before]
            self.driver.zero([(c.address, c.size) for c in new])
        except (p.ProtocolError, DriverError) as exc:
            log.warning("staging the minimum of %s/%s failed (%s); the round will create it", member.client, member.pool.name, exc)
            new = [c for c in arena.chunks if c.id not in before]
            arena.chunks = [c for c in arena.chunks if c.id in before]
            self._retire(new, [], "", arena.name)
            return
        for chunk in new:
            chunk.fresh = False
        member.staged = new

    def _unstage(self, member: kv.Member) -> None:
        arena = self.arenas.get(member.pool.name)
        if arena is not None and member.staged:
            ids = {c.id for c in member.staged}
            drop = [c for c in arena.chunks if c.id in ids]
            arena.chunks = [c for c in arena.chunks if c.id not in ids]
            self._retire(drop, [], "", arena.name)
        member.staged = []

    def _fail_round(self, round_: kv.Round, message: str, **detail: int | str) -> None:
        round_.state = "failed"
        round_.error = message
        log.warning("%s", message)
        for member in round_.members:
            self._unstage(member)
            if member.reported:
                error = p.ProtocolError(p.ErrorCode.ROUND_FAILED, message, **detail)
                self.completions.append(Completion(member.session_id, member.request_id, error))

    def _ask_shrinks(self, round_: kv.Round, deficit: int) -> bool:
        """Ask pools committed earlier to give back ``deficit`` bytes, in proportion to
        what they hold above their minimum. Only their owners can free rows; nothing is
        taken without the owner's KV_SHRINK."""
        in_round = {m.pool.name for m in round_.members}
        donors = [
            pool
            for pool in self.kv_pools.values()
            if pool.name not in in_round and pool.tokens > pool.min_tokens and pool.owner_id in self.sessions
        ]
        # A shrink gives back whole chunks only (KV_SHRINK keeps any chunk the bound falls
        # in), so count and ask for what chunk boundaries can actually free.
        spare = {pool: self._kv_freeable(pool, pool.min_tokens) for pool in donors}
        donors = [pool for pool in donors if spare[pool] > 0]
        total = sum(spare[pool] for pool in donors)
        if total < deficit:
            return False
        for pool in donors:
            give = -(-deficit * spare[pool] // total)
            lo, hi = pool.min_tokens, pool.tokens  # freeable(lo) >= give; the most tokens that free it
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._kv_freeable(pool, mid) >= give:
                    lo = mid
                else:
                    hi = mid - 1
            pool.shrink_request = lo
            names = ", ".join(f"{m.client}/{m.pool.name}" for m in round_.members)
            notice = p.Notice(
                kind="kv-shrink",
                arena=pool.name,
                tokens=pool.shrink_request,
                message=f"gpumemd needs {deficit} bytes for round {round_.id} ({names}): when rows from "
                f"{pool.shrink_request} on are free, confirm with shrink({pool.shrink_request})",
            )
            self._pending_notices.append((pool.owner_id, notice))
        return True

    def _kv_freeable(self, pool: kv.KvPool, tokens: int) -> int:
        """Bytes KV_SHRINK to ``tokens`` would give back: the chunks past every buffer's bound."""
        arena = self.arenas[pool.name]
        freed = 0
        for buffer in pool.buffers:
            bound = buffer.offset + pool.prefix(buffer, tokens)
            freed += sum(c.size for c in arena.chunks if bound <= c.offset < buffer.offset + buffer.region)
        return freed

    def take_notices(self) -> list[tuple[int, p.Notice]]:
        out, self._pending_notices = self._pending_notices, []
        return out

    def _kv_missing(self, pool: kv.KvPool, arena: Arena, tokens: int) -> list[tuple[int, int]]:
        """(offset, size) still to commit so every buffer holds ``tokens`` rows."""
        out = []
        for buffer in pool.buffers:
            have = max(
                (c.offset + c.size for c in arena.chunks if buffer.offset <= c.offset < buffer.offset + buffer.region),
                default=buffer.offset,
            )
            want = buffer.offset + pool.prefix(buffer, tokens)
            if want > have:
                out.append((have, want - have))
        return out

    def _kv_reply(
        self, s: Session, pool: kv.KvPool, new: list[Chunk], retired: list[p.ChunkView], round_: kv.Round | None = None
    ) -> p.KvCommitReply:
        arena = self.arenas[pool.name]
        view = self._view(arena)
        return p.KvCommitReply(
            pool=pool.view(view),
            arena=view,
            chunks=[c.view() for c in new],
            retired=retired,
            fd_batches=-(-len(new) // p.MAX_FDS_PER_MESSAGE),
            round_id=round_.id if round_ else 0,
            budget=dict(round_.budget) if round_ else {},
        )

    def _hand(self, s: Session, chunks: list[Chunk]) -> list[Chunk]:
        for chunk in chunks:
            chunk.holders.add(s.id)
        return chunks

    def _owned_pool(self, s: Session, name: str, action: str) -> kv.KvPool:
        pool = self.kv_pools.get(name)
        if pool is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no KV pool named '{name}' on device {self.device.index}")
        if pool.owner_id != s.id:
            arena = self.arenas[name]
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED, f"KV pool '{name}' belongs to {arena.owner_label()}; only its owner may {action} it"
            )
        return pool

    def _refuse_kv(self, arena: Arena, action: str) -> None:
        if arena.name in self.kv_pools:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"arena '{arena.name}' is a KV pool: its memory comes from commit rounds, grow and shrink, not {action}",
            )

    def _round_view(self, round_: kv.Round) -> p.RoundView:
        return p.RoundView(
            round_id=round_.id,
            state=round_.state,
            deadline_in_s=round(round_.deadline - self.clock(), 3),
            members=[f"{m.client}/{m.pool.name}" for m in round_.members],
        )

    def _create(self, work: list[tuple[Arena, int, int]], available: int, *, ladder: bool = True) -> None:
        """Create chunks for every (arena, offset, size) range at once, all or none: bulk
        chunks, then a ladder for each range's tail (or, without ``ladder``, the tail as
        one chunk: KV rounds touch a hundred buffers at once, and every chunk costs a
        create, an export and a map)."""
        placements: list[tuple[Arena, int, int]] = []
        bulk = self.config.bulk_chunk if ladder else self.config.kv_chunk
        for arena, offset, size in work:
            sizes = plan_chunk_sizes(size, bulk, self.device.granularity) if ladder else [bulk] * (size // bulk) + ([size % bulk] if size % bulk else [])
            for chunk_size in sizes:
                placements.append((arena, offset, chunk_size))
                offset += chunk_size
        need = sum(size for _, _, size in placements)
        try:
            handles = self.driver.create_chunks([(a.address + offset, size) for a, offset, size in placements])
        except DriverError as exc:
            code = p.ErrorCode.OUT_OF_MEMORY if exc.out_of_memory else p.ErrorCode.DRIVER_ERROR
            raise p.ProtocolError(code, f"creating {need} bytes failed: {exc}", requested=need, available=available) from None
        touched = set()
        for (arena, offset, size), handle in zip(placements, handles):
            arena.chunks.append(
                Chunk(id=self._next_chunk, arena=arena.name, offset=offset, size=size, address=arena.address + offset, handle=handle)
            )
            self._next_chunk += 1
            touched.add(arena.name)
        for name in touched:
            self.arenas[name].chunks.sort(key=lambda c: c.offset)

    def _chunks_unmapped(self, session: Session | None, m: p.ChunksUnmapped) -> Outcome:
        s = self._need_session(session)
        arena = self._arena(m.name)
        by_id = {c.id: c for c in arena.chunks + arena.placeholders}
        for chunk_id in m.chunk_ids:
            chunk = by_id.get(chunk_id) or self.retiring.get(chunk_id)
            if chunk is None or chunk.arena != arena.name or s.id not in chunk.holders:
                raise p.ProtocolError(
                    p.ErrorCode.NOT_FOUND, f"chunk {chunk_id} of arena '{arena.name}' is not mapped by this session"
                )
        for chunk_id in m.chunk_ids:
            chunk = by_id.get(chunk_id) or self.retiring[chunk_id]
            chunk.holders.discard(s.id)
            self._forget_if_unheld(chunk)
        for round_ in self._active_rounds():
            if round_.state == "awaiting-shrink":
                self._try_finish(round_)  # memory a shrink freed may complete it
        return Outcome(p.Ack())

    # ------------------------------------------------------------------ shutdown

    def begin_stop(self) -> list[tuple[int, p.Notice]]:
        self.stopping = True
        notice = p.Notice(kind="stopping", message="gpumemd is stopping; memory you mapped stays valid in your process")
        return [(sid, notice) for sid in self.sessions]

    def drop_all(self) -> None:
        """Drop the daemon's own references at exit; clients keep what they mapped."""
        for arena in list(self.arenas.values()):
            self._destroy_arena(arena, [])
        self.retiring.clear()
        self.lease_table.close()
        if self.lease_fd >= 0:
            os.close(self.lease_fd)
            self.lease_fd = -1

    # ------------------------------------------------------------------ accounting

    def accounted_bytes(self) -> int:
        live = sum(c.size for a in self.arenas.values() for c in a.chunks + a.placeholders)
        return live + sum(c.size for c in self.retiring.values())

    def free_bytes(self) -> int:
        measured = self.driver.measured_free()
        return measured if measured is not None else max(0, self.device.total_bytes - self.accounted_bytes())

    def available_bytes(self) -> int:
        return max(0, self.free_bytes() - self.config.reserve_bytes)

    def _require_available(self, need: int, what: str) -> int:
        available = self.available_bytes()
        if need > available:
            raise p.ProtocolError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"{what} needs {need} bytes; {available} are available on device {self.device.index} "
                f"(free memory less the {self.config.reserve_bytes}-byte reserve)",
                requested=need,
                available=available,
            )
        return available

    def status(self) -> p.StatusReply:
        names = {sid: s.name for sid, s in self.sessions.items()}
        return p.StatusReply(
            daemon=p.DaemonStatus(
                version=__version__,
                protocol=f"{p.PROTOCOL_VERSION[0]}.{p.PROTOCOL_VERSION[1]}",
                pid=os.getpid(),
                backend=self.driver.kind,
                uptime_s=round(self.clock() - self.started, 3),
                runtime_dir=self.config.runtime_dir,
                state="stopping" if self.stopping else "serving",
            ),
            device=p.DeviceStatus(
                index=self.device.index,
                uuid=self.device.uuid,
                name=self.device.name,
                total_bytes=self.device.total_bytes,
                free_bytes=self.free_bytes(),
                granularity=self.device.granularity,
                accounted_bytes=self.accounted_bytes(),
                reserve_bytes=self.config.reserve_bytes,
            ),
            clients=[
                p.ClientStatus(
                    session_id=s.id,
                    name=s.name,
                    pid=s.pid,
                    uid=s.uid,
                    gid=s.gid,
                    since=s.since,
                    arenas=sorted(a.name for a in self.arenas.values() if s.id in a.attached),
                )
                for s in self.sessions.values()
            ],
            arenas=[
                p.ArenaStatus(
                    name=a.name,
                    owner=a.owner_name,
                    owner_pid=a.owner_pid,
                    owner_alive=a.owner_alive,
                    address=a.address,
                    reserved=a.reserved,
                    committed=a.committed,
                    chunks=len(a.chunks),
                    shared_with=sorted(a.shared_with),
                    attached=sorted(names[sid] for sid in a.attached if sid in names),
                    retiring_bytes=sum(c.size for c in self.retiring.values() if c.arena == a.name),
                    placeholder_bytes=sum(c.size for c in a.placeholders),
                )
                for a in self.arenas.values()
            ],
            extents=[self._graph_pool_view(g, names) for g in self.graph_pools.values()],
            leases=self._lease_status(),
            rounds=[
                p.RoundStatus(
                    id=r.id,
                    state=r.state,
                    expect=r.expect,
                    policy=r.policy,
                    deadline_in_s=round(r.deadline - self.clock(), 3),
                    members=[
                        p.RoundMemberStatus(
                            client=m.client,
                            pool=m.pool.name,
                            reported=m.reported,
                            headroom_bytes=m.headroom_bytes,
                            graph_pool_bytes=m.graph_pool_bytes,
                            min_tokens=m.min_tokens,
                            max_tokens=m.max_tokens,
                            weight=m.weight,
                            tokens=m.tokens,
                            bytes=m.bytes,
                        )
                        for m in r.members
                    ],
                    dropped=list(r.dropped),
                    budget=dict(r.budget),
                    error=r.error,
                )
                for r in self.rounds
            ],
            kv=[
                p.KvPoolStatus(
                    name=pool.name,
                    owner=self.arenas[pool.name].owner_name,
                    buffers=len(pool.buffers),
                    bytes_per_token=pool.bytes_per_token,
                    max_tokens=pool.max_tokens,
                    tokens=pool.tokens,
                    committed_bytes=self.arenas[pool.name].committed,
                    min_tokens=pool.min_tokens,
                    shrink_request=-1 if pool.shrink_request is None else pool.shrink_request,
                )
                for pool in self.kv_pools.values()
            ],
        )

    # ------------------------------------------------------------------ helpers

    def _graph_pool_view(self, pool: GraphPool, names: dict[int, str]) -> p.GraphPoolStatus:
        view = pool.status()
        view.escaped_by = ", ".join(f"client '{names.get(sid, sid)}'" for sid in sorted(pool.escapers))
        return view

    def _lease_status(self) -> list[p.LeaseStatus]:
        out = []
        by_word = {leases.word_session(i): s for i, s in self.sessions.items()}
        for pool in self.graph_pools.values():
            holder = self.lease_table.holder(pool.slot)
            if holder is None:
                continue
            session = by_word.get(holder.session)
            out.append(
                p.LeaseStatus(
                    pool_id=pool.id,
                    slot=pool.slot,
                    kind=holder.kind_name,
                    holder=session.name if session else f"session {holder.session}",
                    pid=holder.pid,
                    label=holder.label,
                    since=holder.since_ns / 1e9,
                )
            )
        return out

    def _need_session(self, session: Session | None) -> Session:
        if session is None:
            raise p.ProtocolError(
                p.ErrorCode.NO_SESSION, "this request needs a session: open one with HELLO on the fd channel first"
            )
        return session

    def _check_name(self, name: str, what: str) -> None:
        if not _NAME.match(name):
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT, f"{what} {name!r} is not valid: 1-128 characters of letters, digits and ._:@+-"
            )

    def _check_size(self, value: int, what: str, *, allow_zero: bool) -> None:
        g = self.device.granularity
        if value < 0 or (value == 0 and not allow_zero):
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"{what} must be positive, not {value}", **{what: value})
        if value % g:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"{what} {value} is not a multiple of the device granularity {g} "
                f"(nearest valid: {value // g * g} or {(value // g + 1) * g})",
                **{what: value, "granularity": g},
            )

    def _arena(self, name: str) -> Arena:
        arena = self.arenas.get(name)
        if arena is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no arena named '{name}' on device {self.device.index}")
        return arena

    def _owned_arena(self, s: Session, name: str, action: str) -> Arena:
        arena = self._arena(name)
        if arena.owner_id != s.id:
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"arena '{name}' belongs to {arena.owner_label()}; only its owner may {action} it",
            )
        if arena.released:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"arena '{name}' was released")
        return arena

    def _view(self, arena: Arena) -> p.ArenaView:
        return p.ArenaView(
            name=arena.name,
            owner=arena.owner_name,
            address=arena.address,
            reserved=arena.reserved,
            committed=arena.committed,
            granularity=self.device.granularity,
        )

    def _map_reply(self, s: Session, arena: Arena) -> Outcome:
        handout = [c for c in arena.chunks if s.id not in c.holders]
        for chunk in handout:
            chunk.holders.add(s.id)
        retired = [c.view() for c in self.retiring.values() if c.arena == arena.name and s.id in c.holders]
        batches = -(-len(handout) // p.MAX_FDS_PER_MESSAGE)
        reply = p.MapReply(arena=self._view(arena), chunks=[c.view() for c in handout], retired=retired, fd_batches=batches)
        return Outcome(reply, handout=handout)

    def _plan_window(self, size: int) -> int:
        """First fit between the live windows; the daemon reserves the window in its own
        address space too, so the driver itself vouches that the range is usable."""
        align = max(self.device.granularity, GiB)
        taken = sorted((a.address, a.address + a.window) for a in self.arenas.values())
        hint = self.config.va_base
        for start, end in taken:
            if (hint + size + align - 1) // align * align + align <= start:  # a guard step before it too
                break
            hint = max(hint, (end + align - 1) // align * align + align)  # one guard step between windows
        if hint + size > self.config.va_limit:
            raise p.ProtocolError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"no free virtual window of {size} bytes left in the daemon's plan range; release arenas first",
                requested=size,
            )
        try:
            address = self.driver.reserve(size, hint)
        except DriverError as exc:
            raise p.ProtocolError(p.ErrorCode.DRIVER_ERROR, f"reserving a {size}-byte window failed: {exc}") from None
        if any(address < end and start < address + size for start, end in taken):
            self.driver.free_reservation(address, size)
            raise p.ProtocolError(p.ErrorCode.INTERNAL, f"the driver placed a window at {address:#x}, over a live arena")
        return address

    def _notify_sharers(self, arena: Arena, exclude: int, kind: str, message: str) -> list[tuple[int, p.Notice]]:
        notice = p.Notice(kind=kind, message=message, arena=arena.name)
        return [(sid, notice) for sid in arena.attached if sid != exclude]

    def _retire(
        self, chunks: list[Chunk], notices: list[tuple[int, p.Notice]], message: str, arena: str, exclude: int = 0
    ) -> None:
        """Take chunks out of service: the daemon drops its reference now, the bytes stay
        counted until every holder reported the unmap (or died)."""
        live = [c for c in chunks if c.handle is not None]
        if live:
            self.driver.destroy_chunks([(c.address, c.size) for c in live], [c.handle for c in live])
        told: set[int] = set()
        for chunk in chunks:
            chunk.handle = None
            if chunk.holders:
                self.retiring[chunk.id] = chunk
                told |= chunk.holders
        notice = p.Notice(kind="arena-retired", message=message, arena=arena)
        notices.extend((sid, notice) for sid in sorted(told) if sid != exclude)

    def _forget_if_unheld(self, chunk: Chunk) -> None:
        if chunk.handle is None and not chunk.holders:
            self.retiring.pop(chunk.id, None)

    def _drop_holder_everywhere(self, arena: Arena, session_id: int) -> None:
        for chunk in arena.chunks + arena.placeholders:
            chunk.holders.discard(session_id)
        for chunk in [c for c in self.retiring.values() if c.arena == arena.name]:
            chunk.holders.discard(session_id)
            self._forget_if_unheld(chunk)

    def _destroy_arena(self, arena: Arena, notices: list[tuple[int, p.Notice]]) -> None:
        self._retire(arena.chunks + arena.placeholders, notices, f"arena '{arena.name}' is gone", arena.name)
        arena.chunks = []
        arena.placeholders = []
        del self.arenas[arena.name]
        self.kv_pools.pop(arena.name, None)
        for pool_id in [g.id for g in self.graph_pools.values() if g.arena == arena.name]:
            self._drop_graph_pool(self.graph_pools[pool_id])
        left = []
        for round_ in self._active_rounds():
            for member in [m for m in round_.members if m.pool.name == arena.name]:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{arena.name}: the pool was released")
                left.append(round_)
        try:
            self.driver.free_reservation(arena.address, arena.window)
        except DriverError:
            log.exception("freeing the window of arena %r failed", arena.name)
        log.info("arena %r destroyed", arena.name)
        for round_ in left if not self.stopping else []:  # it may have been the last one pending
            self._try_finish(round_)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
