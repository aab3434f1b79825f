"""The arena book: arenas and their chunks, the accounting of every byte the daemon
created, and commit admission.

Windows: every arena's window is planned in the device's address slice, which the daemon
reserves whole at start (window_plan.py); chunks are mapped there, and nothing is
reserved per arena.

Sharing: an arena's grants say who may attach it besides its owner. A grant admits by
identity, the uid and gid the kernel reports for the session's fd channel
(SO_PEERCRED) and the client name it said HELLO with, which no live session can share
with another; or by its token, a random capability the owner hands over out of band.
A client name alone stands for that name under the owner's uid, so a name is never
enough to reach another user's memory; the token lifts that implied uid and nothing
the share named itself.

Accounting: a chunk counts against the device from its creation until nobody holds
it. The daemon drops its own reference when the chunk leaves an arena (decommit,
release), but clients that mapped it keep the memory alive until they report the
unmap or die, so such a chunk stays counted, as "retiring", until then.

The driver is this book's only I/O. What a change means for graph pools and KV pools
is decided above it, by the dispatcher (state.py).
"""

from __future__ import annotations

import logging
import os

import msgspec

from gpumem_shared import protocol as p
from gpumem_shared.driver import Driver, DriverError

from gpumemd import grants
from gpumemd.checks import check_name, check_size
from gpumemd.config import MiB, StateConfig
from gpumemd.image import Image, Imager, Keep, Take, chunk_name
from gpumemd.memory_caps import Caps
from gpumemd.names import plain_name
from gpumemd.records import PLACEHOLDER_SCRATCH, ArenaRecord, ChunkRecord, Notices, Outcome, SessionRecord, SleepRecord
from gpumemd.tenants import Tenants
from gpumemd.window_plan import WindowPlan

log = logging.getLogger("gpumemd.arenas")

MAX_PLACEHOLDER_SLOT = 256 * MiB


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


def map_batches(chunks: int) -> int:
    """FD_BATCH messages needed to pass ``chunks`` descriptors."""
    return -(-chunks // p.MAX_FDS_PER_MESSAGE)


class ArenaBookImage(msgspec.Struct):
    arenas: list[Image]
    retiring: list[Image]  # chunks out of service that clients still map
    next_chunk: int
    next_grant: int


_CHUNK = Imager(ChunkRecord, "handle")  # a driver's handle dies with the process: the chunk's fd is stored
_ARENA = Imager(ArenaRecord)


class ArenaBook:
    def __init__(self, driver: Driver, config: StateConfig, device: p.DeviceInfo, tenants: Tenants) -> None:
        self.driver = driver
        self.config = config
        self.device = device
        self.tenants = tenants
        self.by_name: dict[str, ArenaRecord] = {}
        self.retiring: dict[int, ChunkRecord] = {}
        self.caps = Caps(
            config.tenant_policy, config.tenant_claims, self.by_name, self.retiring, tenants.owners, tenants.groups, tenants.tokens
        )
        self.next_chunk = 1
        self.next_grant = 1
        # Memory came free since the dispatcher last looked (a chunk nobody holds any
        # more), or an ask for it was answered: whatever waits for memory may go ahead.
        self.freed = False
        self.windows = WindowPlan(driver, config, device)

    def close(self) -> None:
        """Give the address slice back (at exit, once every arena is destroyed)."""
        self.windows.close()

    # ------------------------------------------------------------------ lookups

    def get(self, name: str) -> ArenaRecord:
        arena = self.by_name.get(name)
        if arena is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no arena named '{name}' on device {self.device.index}")
        return arena

    def owned(self, s: SessionRecord, name: str, action: str, *, kv_ok: bool = False) -> ArenaRecord:
        """The arena ``s`` owns and may ``action``; a KV pool's arena only if ``kv_ok``."""
        arena = self.get(name)
        if arena.owner_id != s.id:
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"arena '{name}' belongs to {arena.owner_label()}; only its owner may {action} it",
            )
        if arena.released:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"arena '{name}' was released")
        if arena.kv and not kv_ok:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"arena '{name}' is a KV pool (its memory comes from commit rounds, grow and shrink): clients cannot {action} it",
            )
        return arena

    def attached(self, s: SessionRecord, name: str) -> ArenaRecord:
        arena = self.get(name)
        if s.id not in arena.attached:
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"this session is not attached to arena '{name}'")
        return arena

    def view(self, arena: ArenaRecord) -> p.ArenaView:
        return p.ArenaView(
            name=arena.name,
            owner=arena.owner_name,
            address=arena.address,
            reserved=arena.reserved,
            committed=arena.committed,
            granularity=self.device.granularity,
        )

    # ------------------------------------------------------------------ requests

    def create(self, s: SessionRecord, name: str, reserve_bytes: int, *, kv: bool = False) -> ArenaRecord:
        check_name(plain_name(name), "KV pool name" if kv else "arena name")
        check_size(reserve_bytes, "reserve_bytes", self.device.granularity, allow_zero=False)
        if reserve_bytes > self.config.max_reserve:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"reserve_bytes {reserve_bytes} exceeds the daemon's limit of {self.config.max_reserve} per arena",
                requested=reserve_bytes,
                limit=self.config.max_reserve,
            )
        existing = self.by_name.get(name)
        if existing is not None:  # names are per uid (names.resolve): this uid holds it
            raise p.ProtocolError(
                p.ErrorCode.ALREADY_EXISTS,
                f"arena '{name}' already exists, owned by {existing.owner_label()} of this uid; choose another name",
                arena=name,
                owner=existing.owner_name,
                owner_pid=existing.owner_pid,
            )
        window = reserve_bytes + PLACEHOLDER_SCRATCH
        self.tenants.check_arena(s, self.by_name.values(), window, self.device.granularity, self.windows.size)
        address = self.windows.place(window, ((a.address, a.window) for a in self.by_name.values()))
        arena = ArenaRecord(
            name=name, owner_id=s.id, owner_name=s.name, owner_pid=s.own_pid, address=address, reserved=reserve_bytes, kv=kv
        )
        self.tenants.own(name, s)
        arena.attached.add(s.id)
        self.by_name[name] = arena
        log.info("arena %r created by %r: %d bytes at %#x", name, s.name, reserve_bytes, address)
        return arena

    def attach(self, s: SessionRecord, m: p.AttachArena) -> Outcome:
        arena = self.get(m.name)
        if s.id in arena.attached:
            raise p.ProtocolError(p.ErrorCode.ALREADY_EXISTS, f"this session is already attached to arena '{m.name}'")
        if arena.released:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"arena '{m.name}' was released by {arena.owner_label()}")
        refusal, read_only = grants.admit(arena, s, m.token)
        if refusal:
            log.warning("arena %r: attach by client %r (%s, uid %d, gid %d) refused: %s", arena.name, s.name, s.pids, s.uid, s.gid, refusal)
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"arena '{m.name}' belongs to {arena.owner_label()} and {refusal}",
                arena=arena.name,
                owner=arena.owner_name,
                owner_pid=arena.owner_pid,
                uid=s.uid,
                gid=s.gid,
            )
        arena.attached.add(s.id)
        if read_only:
            arena.readers.add(s.id)
        return self.map_reply(s, arena)

    def read_only_for(self, session_id: int, name: str) -> bool:
        """Whether chunks of arena ``name`` go to ``session_id`` as read-only descriptors."""
        arena = self.by_name.get(name)
        return arena is not None and session_id in arena.readers

    def share(self, s: SessionRecord, m: p.ShareArena) -> Outcome:
        arena = self.owned(s, m.name, "share")
        grant = grants.new_grant(arena, s, m, self.next_grant)
        self.next_grant += 1
        arena.grants.append(grant)
        log.info("arena %r: grant %d admits %s%s", arena.name, grant.id, grants.describe(grant), " read-only" if grant.read_only else "")
        return Outcome(p.ShareReply(token=grant.token.decode(), grant=grant.status()))

    def unshare(self, s: SessionRecord, m: p.UnshareArena) -> Outcome:
        arena = self.owned(s, m.name, "unshare")
        grant = grants.by_token(arena, m.token)
        if grant is None:
            raise p.ProtocolError(
                p.ErrorCode.NOT_FOUND, f"no grant on arena '{arena.name}' has this token (revoked already, or issued for another arena)"
            )
        arena.grants.remove(grant)
        # Memory is never taken from a process that maps it: only new attaches are refused.
        sharers = len(arena.attached - {arena.owner_id})
        log.info("arena %r: grant %d (%s) revoked; %d sharer(s) stay attached", arena.name, grant.id, grants.describe(grant), sharers)
        return Outcome(p.Ack())

    def commit(self, s: SessionRecord, m: p.CommitArena) -> Outcome:
        arena = self.owned(s, m.name, "commit")
        check_size(m.nbytes, "nbytes", self.device.granularity, allow_zero=False)
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
            return self.map_reply(s, arena)
        available = self.require_available(need, f"committing {need} more bytes to arena '{arena.name}'")
        self.create_chunks([(arena, committed, need)], available)
        outcome = self.map_reply(s, arena)
        notice = p.Notice(
            kind=p.NoticeKind.ARENA_GROWN, message=f"arena '{arena.name}' grew to {arena.committed} bytes; sync to map it", arena=arena.name
        )
        outcome.notices = [(sid, notice) for sid in arena.attached if sid != s.id]
        return outcome

    def decommit_cut(self, s: SessionRecord, m: p.DecommitArena) -> tuple[ArenaRecord, list[ChunkRecord]]:
        """The arena and the chunks a decommit would take out (validated, nothing done)."""
        arena = self.owned(s, m.name, "decommit")
        check_size(m.to_nbytes, "to_nbytes", self.device.granularity, allow_zero=True)
        if m.to_nbytes > arena.committed:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"decommit to {m.to_nbytes} bytes is above arena '{arena.name}'s committed {arena.committed}; commit grows it",
                requested=m.to_nbytes,
                committed=arena.committed,
            )
        return arena, [c for c in arena.chunks if c.offset >= m.to_nbytes]

    def decommit(self, s: SessionRecord, arena: ArenaRecord, drop: list[ChunkRecord]) -> Outcome:
        gone = set(drop)  # a list's membership test would make this quadratic in chunks
        arena.chunks = [c for c in arena.chunks if c not in gone]
        notices: Notices = []
        self.retire(drop, notices, f"arena '{arena.name}' shrank to {arena.committed} bytes; sync to unmap the rest", arena.name, exclude=s.id)
        retired = [c.view() for c in drop if s.id in c.holders]
        return Outcome(p.MapReply(arena=self.view(arena), chunks=[], retired=retired, fd_batches=0), notices=notices)

    def sync(self, s: SessionRecord, m: p.SyncArena) -> Outcome:
        return self.map_reply(s, self.attached(s, m.name))

    def placeholder(self, s: SessionRecord, m: p.PlaceholderArena) -> Outcome:
        arena = self.owned(s, m.name, "back with placeholders", kv_ok=True)
        check_size(m.slot_bytes, "slot_bytes", self.device.granularity, allow_zero=False)
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
            self.require_available(need, f"placeholders of {need} bytes for arena '{arena.name}'")
            self.caps.check([(arena, 0, need)], self.available_bytes)  # device memory like a commit's: capped
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
                chunk = ChunkRecord(id=self.next_chunk, arena=arena.name, offset=0, size=size, address=address, handle=handle)
                self.next_chunk += 1
                arena.placeholders.append(chunk)
                have[size] = chunk
        wanted = [have[size] for size in sizes]
        handout = self.hand(s, [c for c in wanted if s.id not in c.holders])
        reply = p.PlaceholderReply(arena=self.view(arena), chunks=[c.view() for c in wanted], fd_batches=map_batches(len(handout)))
        return Outcome(reply, handout=handout)

    def chunks_unmapped(self, s: SessionRecord, m: p.ChunksUnmapped) -> Outcome:
        arena = self.get(m.name)
        by_id = {c.id: c for c in arena.chunks + arena.placeholders}
        for chunk_id in m.chunk_ids:
            chunk = by_id.get(chunk_id) or self.retiring.get(chunk_id)
            if chunk is None or chunk.arena != arena.name or s.id not in chunk.holders:
                raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"chunk {chunk_id} of arena '{arena.name}' is not mapped by this session")
        for chunk_id in m.chunk_ids:
            chunk = by_id.get(chunk_id) or self.retiring[chunk_id]
            chunk.holders.discard(s.id)
            self._forget_if_unheld(chunk)
        return Outcome(p.Ack())

    def drop_holder(self, session_id: int, chunk_ids: set[int] | None = None) -> None:
        """``session_id`` maps none of ``chunk_ids`` (None: no chunk at all)."""
        for arena in self.by_name.values():
            for chunk in arena.chunks + arena.placeholders:
                if chunk_ids is None or chunk.id in chunk_ids:
                    chunk.holders.discard(session_id)
        for chunk in list(self.retiring.values()):
            if (chunk_ids is None or chunk.id in chunk_ids) and session_id in chunk.holders:
                chunk.holders.discard(session_id)
                self._forget_if_unheld(chunk)

    # ------------------------------------------------------------------ leaving arenas

    def detach(self, arena: ArenaRecord, session_id: int) -> None:
        """``session_id`` maps nothing of the arena any more (it released it, or died)."""
        for chunk in arena.chunks + arena.placeholders:
            chunk.holders.discard(session_id)
        for chunk in [c for c in self.retiring.values() if c.arena == arena.name]:
            chunk.holders.discard(session_id)
            self._forget_if_unheld(chunk)
        arena.attached.discard(session_id)
        arena.readers.discard(session_id)

    def owner_left(self, arena: ArenaRecord, notices: Notices, *, released: bool) -> None:
        """The owner released the arena or died: its placeholders go; on a release, the
        sharers still attached are told to unmap the chunks too."""
        arena.owner_alive = False
        self.retire(arena.placeholders, notices, "", arena.name)
        arena.placeholders = []
        if released:
            arena.released = True
            if arena.attached:
                self.retire(arena.chunks, notices, f"arena '{arena.name}' was released by its owner; release it too", arena.name)
                arena.chunks = []

    # ------------------------------------------------------------------ an arena's owner and sleep (this book writes them alone)

    def transfer(self, arena: ArenaRecord, s: SessionRecord) -> None:
        """``s`` owns the arena from now on (an adoption): attached, counted against its
        tenant (a pod of its own, its token). The dead owner's grants die: ``s`` shares anew."""
        arena.owner_id, arena.owner_name, arena.owner_pid, arena.owner_alive = s.id, s.name, s.pid, True
        arena.attached.add(s.id)
        arena.grants = []
        self.tenants.own(arena.name, s)

    def fall_asleep(self, arena: ArenaRecord, committed: int, kept: int, since: float) -> None:
        arena.asleep = SleepRecord(committed, kept, since)

    def wake(self, arena: ArenaRecord) -> SleepRecord | None:  # the sleep ended (None: it was awake)
        sleep, arena.asleep = arena.asleep, None
        return sleep

    def destroy(self, arena: ArenaRecord, notices: Notices) -> None:
        """Drop the arena and its window; chunks still mapped somewhere stay retiring."""
        self.retire(arena.chunks + arena.placeholders, notices, f"arena '{arena.name}' is gone", arena.name)
        arena.chunks = []
        arena.placeholders = []
        del self.by_name[arena.name]
        self.tenants.forget(arena.name)
        log.info("arena %r destroyed", arena.name)

    # ------------------------------------------------------------------ chunks

    def create_chunks(self, work: list[tuple[ArenaRecord, int, int]], available: int, *, ladder: bool = True) -> list[ChunkRecord]:
        """Create chunks for every (arena, offset, size) range at once, all or none: bulk
        chunks, then a ladder for each range's tail (or, without ``ladder``, the tail as
        one chunk: KV rounds touch a hundred buffers at once, and every chunk costs a
        create, an export and a map). Returns the new chunks."""
        placements: list[tuple[ArenaRecord, int, int]] = []
        bulk = self.config.bulk_chunk if ladder else self.config.kv_chunk
        for arena, offset, size in work:
            if ladder:
                sizes = plan_chunk_sizes(size, bulk, self.device.granularity)
            else:
                sizes = [bulk] * (size // bulk) + ([size % bulk] if size % bulk else [])
            for chunk_size in sizes:
                placements.append((arena, offset, chunk_size))
                offset += chunk_size
        need = sum(size for _, _, size in placements)
        self.caps.check(work, self.available_bytes)
        try:
            handles = self.driver.create_chunks([(a.address + offset, size) for a, offset, size in placements])
        except DriverError as exc:
            code = p.ErrorCode.OUT_OF_MEMORY if exc.out_of_memory else p.ErrorCode.DRIVER_ERROR
            raise p.ProtocolError(code, f"creating {need} bytes failed: {exc}", requested=need, available=available) from None
        new = []
        for (arena, offset, size), handle in zip(placements, handles):
            chunk = ChunkRecord(id=self.next_chunk, arena=arena.name, offset=offset, size=size, address=arena.address + offset, handle=handle)
            self.next_chunk += 1
            arena.chunks.append(chunk)
            new.append(chunk)
        for arena in {a.name: a for a, _, _ in placements}.values():
            arena.chunks.sort(key=lambda c: c.offset)
        return new

    def retire(self, chunks: list[ChunkRecord], notices: Notices, message: str, arena: str, exclude: int = 0) -> None:
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
            else:
                self.freed = True
        notice = p.Notice(kind=p.NoticeKind.ARENA_RETIRED, message=message, arena=arena)
        notices.extend((sid, notice) for sid in sorted(told) if sid != exclude)

    def _forget_if_unheld(self, chunk: ChunkRecord) -> None:
        if chunk.handle is None and not chunk.holders and self.retiring.pop(chunk.id, None) is not None:
            self.freed = True

    def hand(self, s: SessionRecord, chunks: list[ChunkRecord]) -> list[ChunkRecord]:
        """``s`` maps these from now on (their fds go to it before the reply)."""
        for chunk in chunks:
            chunk.holders.add(s.id)
        return chunks

    def map_reply(self, s: SessionRecord, arena: ArenaRecord) -> Outcome:
        """Chunks ``s`` does not map yet, and retired chunks it still maps."""
        handout = self.hand(s, [c for c in arena.chunks if s.id not in c.holders])
        retired = [c.view() for c in self.retiring.values() if c.arena == arena.name and s.id in c.holders]
        reply = p.MapReply(
            arena=self.view(arena), chunks=[c.view() for c in handout], retired=retired, fd_batches=map_batches(len(handout)),
            read_only=s.id in arena.readers,
        )
        return Outcome(reply, handout=handout)

    # ------------------------------------------------------------------ accounting

    def accounted_bytes(self) -> int:
        live = sum(c.size for a in self.by_name.values() for c in a.chunks + a.placeholders)
        return live + sum(c.size for c in self.retiring.values())

    def free_bytes(self) -> int:
        measured = self.driver.measured_free()
        free = measured if measured is not None else max(0, self.device.total_bytes - self.accounted_bytes())
        if self.config.capacity_bytes:
            free = min(free, max(0, self.config.capacity_bytes - self.accounted_bytes()))
        return free

    def available_bytes(self) -> int:
        return max(0, self.free_bytes() - self.config.reserve_bytes)

    def require_available(self, need: int, what: str) -> int:
        free = self.free_bytes()
        available = max(0, free - self.config.reserve_bytes)
        if need > available:
            log.warning(
                "refused: %s needs %d bytes; %d available on device %d (free %d less the %d-byte reserve)",
                what, need, available, self.device.index, free, self.config.reserve_bytes,
                extra={"figures": {"requested": need, "available": available, "free": free, "reserve": self.config.reserve_bytes}},
            )
            raise p.ProtocolError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"{what} needs {need} bytes; {available} are available on device {self.device.index} "
                f"(free memory less the {self.config.reserve_bytes}-byte reserve)",
                requested=need,
                available=available,
            )
        return available

    # ------------------------------------------------------------------ the durable record

    def image(self, keep: Keep) -> ArenaBookImage:
        arenas = []
        for a in self.by_name.values():
            for c in a.chunks + a.placeholders:
                keep(chunk_name(c.id), self.driver.chunk_fd(c.handle))
            chunks, placeholders = [_CHUNK.image(c) for c in a.chunks], [_CHUNK.image(c) for c in a.placeholders]
            arenas.append(_ARENA.image(a, chunks=chunks, placeholders=placeholders))
        return ArenaBookImage(arenas, [_CHUNK.image(c) for c in self.retiring.values()], self.next_chunk, self.next_grant)

    def restore(self, part: object, take: Take) -> None:
        """The book as ``image`` left it, its chunks adopted from the fds ``take`` gives.
        An arena whose chunks are not all there is dropped (its chunks that clients map
        count as retiring until those report the unmap or die)."""
        book = msgspec.convert(part, ArenaBookImage)
        for image in book.arenas:
            fields = _ARENA.fields(image)
            chunks = [_CHUNK.restore(c, handle=None) for c in fields["chunks"]]
            placeholders = [_CHUNK.restore(c, handle=None) for c in fields["placeholders"]]
            arena = _ARENA.restore(fields, chunks=chunks, placeholders=placeholders)
            if not self._adopt(arena, chunks + placeholders, take):
                for chunk in chunks + placeholders:
                    if chunk.holders:
                        self.retiring[chunk.id] = chunk
                continue
            self.by_name[arena.name] = arena
            self.tenants.adopt(arena)
        for chunk in (_CHUNK.restore(c, handle=None) for c in book.retiring):
            if chunk.holders:
                self.retiring[chunk.id] = chunk
        self.next_chunk, self.next_grant = book.next_chunk, book.next_grant

    def _adopt(self, arena: ArenaRecord, chunks: list[ChunkRecord], take: Take) -> bool:
        fds = [take(chunk_name(c.id)) for c in chunks]
        missing = [c.id for c, fd in zip(chunks, fds) if fd < 0]
        problem = f"chunk(s) {missing} missing from the fd store" if missing else ""
        if not problem:
            try:
                handles = self.driver.adopt_chunks([(c.address, c.size) for c in chunks], fds)
            except DriverError as exc:
                problem = f"a stored chunk is not one ({exc})"
            else:
                for chunk, handle in zip(chunks, handles):
                    chunk.handle = handle
                return True
        log.error("arena %r (owner %r) cannot be rebuilt: %s; it is dropped", arena.name, arena.owner_name, problem)
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        return False
