"""The sleeper book: arenas asleep (their chunks handed back to the device, the size to
commit again remembered) and the host buffers their contents are kept in.

A host buffer is a memfd the daemon creates per arena, sealed at its size (a client
holding a descriptor cannot grow it past the accounting), granted to the arena's owner
like a lease segment (one FD_BATCH before the reply) and kept in the fd store, so it
outlives a daemon restart with the sleeper's contents in it. Its bytes count against
``--sleep-host-limit`` from its creation to its end (the owner frees it, or the arena
goes), and against its arena's uid's share of that limit (``--tenant-sleep-host-share``),
so one uid's buffers cannot leave the others none. The owner maps it and does the copies itself: it has the device mappings and,
on CUDA, the context and streams; registered once with CUDA, the buffer serves every
later sleep at pinned-copy speed, which is why it stays after a wake.

Sleeping is the decommit of every chunk, under graph pools too (their captured state
is in what the owner copied out, or dropped at its word); waking is a commit to the
size the arena had, at the same offsets: fresh chunks, zeroed before their first fd
leaves like any. The window, the graph pools' registry and their lease segments are
untouched. A wake that does not fit asks KV pools above their fair share to give back
(the KV book's one donor rule) and waits, deferred like a KV grow, until the memory is
free or its ``wait`` ends. An arena's sleep is a field of its record, which the arena
book writes. What this means for the other books (commit, decommit and attach refused
while asleep, the buffer dropped with its arena) is decided in state.py.

A KV pool sleeps by the KV book's own moves instead (kv_pools.py): a shrink to nothing
that says so, and the grow back that wakes it; it is asleep here all the same (status,
metrics, its host buffer kept while its contents are in it).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
from collections.abc import Callable, Mapping

import msgspec

from gpumem_shared import protocol as p
from gpumem_shared.units import format_size

from gpumemd.arenas import ArenaBook
from gpumemd.checks import check_size
from gpumemd.config import StateConfig
from gpumemd.image import Image, Imager, Keep, Take
from gpumemd.kv_pools import KvBook
from gpumemd.records import ArenaRecord, Completion, Notices, Outcome, PendingWait, SessionRecord, SleepRecord, wait_deadline

log = logging.getLogger("gpumemd.sleepers")

# The largest users a refusal names.
_NAMED = 3


def host_buffer_name(buffer_id: int) -> str:
    """A host buffer's name in the fd store."""
    return f"host-{buffer_id}"


@dataclasses.dataclass(eq=False)
class HostBufferRecord:
    id: int
    arena: str
    owner_id: int
    size: int
    fd: int = -1  # the daemon's memfd; the store keeps it across a restart


@dataclasses.dataclass(eq=False)
class PendingWake(PendingWait):
    """An ARENA_WAKE waiting for memory (its ``wait``)."""

    arena: str
    asked: list[str]  # the KV pools asked to give back for it


class SleeperBookImage(msgspec.Struct):
    buffers: list[Image]  # an arena's sleep is the arena's, imaged with it
    next_buffer: int


_BUFFER = Imager(HostBufferRecord, "fd")


def _sealed_memfd(name: str, size: int) -> int:
    fd = os.memfd_create(f"gpumemd-sleep-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except OSError:
        os.close(fd)
        raise
    return fd


class SleeperBook:
    def __init__(
        self,
        arenas: ArenaBook,
        kv: KvBook,
        sessions: Mapping[int, SessionRecord],
        config: StateConfig,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.arenas = arenas
        self.kv = kv
        self.sessions = sessions
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.buffers: dict[str, HostBufferRecord] = {}  # by arena
        self.wakes: list[PendingWake] = []
        self._completions: list[Completion] = []
        self.next_buffer = 1

    @property
    def asleep(self) -> dict[str, SleepRecord]:
        """Every arena asleep (KV pools' too), by name: the arena book keeps each sleep on its arena."""
        return {a.name: a.asleep for a in self.arenas.by_name.values() if a.asleep is not None}

    # ------------------------------------------------------------------ checks other requests make

    def check_awake(self, arena: str, action: str) -> None:
        record = self.arenas.by_name.get(arena)
        sleeper = record.asleep if record is not None else None
        if sleeper is not None:
            raise p.ProtocolError(
                p.ErrorCode.ARENA_ASLEEP,
                f"arena '{arena}' sleeps ({sleeper.committed} bytes to commit again at its wake): its owner wakes it "
                f"before anyone may {action} it",
                arena=arena,
                committed=sleeper.committed,
            )

    # ------------------------------------------------------------------ requests

    def buffer(self, s: SessionRecord, m: p.SleepBuffer) -> Outcome:
        arena = self.arenas.owned(s, m.arena, "keep a sleep buffer for", kv_ok=True)
        check_size(m.nbytes, "nbytes", self.arenas.device.granularity, allow_zero=False)
        if m.nbytes > arena.reserved:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"a sleep buffer of {m.nbytes} bytes is larger than arena '{arena.name}' ({arena.reserved} bytes)",
                requested=m.nbytes,
                reserved=arena.reserved,
            )
        have = self.buffers.get(arena.name)
        if have is None or have.size < m.nbytes:
            self._admit(s, m.nbytes - (have.size if have else 0), f"a {format_size(m.nbytes)} sleep buffer for arena '{arena.name}'")
            try:
                fd = _sealed_memfd(arena.name, m.nbytes)
            except OSError as exc:
                raise p.ProtocolError(p.ErrorCode.HOST_LIMIT, f"creating a {m.nbytes}-byte host buffer failed: {exc.strerror}") from None
            if have is not None:  # its owner unmapped it before asking for a larger one
                os.close(have.fd)
            have = HostBufferRecord(id=self.next_buffer, arena=arena.name, owner_id=s.id, size=m.nbytes, fd=fd)
            self.next_buffer += 1
            self.buffers[arena.name] = have
            log.info("arena %r: %s host buffer %d for client %r", arena.name, format_size(have.size), have.id, s.name)
        reply = p.HostBufferReply(arena=arena.name, buffer=p.HostBufferView(id=have.id, size=have.size), fd_batches=1)
        return Outcome(reply, host_buffers=[(have.id, have.fd)])

    def transfer(self, arena: str, s: SessionRecord) -> None:
        """``s`` owns arena ``arena`` from now on (an adoption): its host buffer, and a
        sleeping arena's contents in it, are ``s``'s too, counted against it."""
        buffer = self.buffers.get(arena)
        if buffer is not None:
            buffer.owner_id = s.id

    def granted(self, session_id: int, buffer_ids: list[int]) -> list[tuple[int, int]]:
        """(id, memfd) of the host buffers of ``buffer_ids`` that ``session_id`` still owns:
        a remembered SLEEP_BUFFER answer handed again after a restart."""
        mine = {b.id: b for b in self.buffers.values() if b.owner_id == session_id}
        return [(i, mine[i].fd) for i in buffer_ids if i in mine]

    def free(self, s: SessionRecord, m: p.FreeSleepBuffer) -> Outcome:
        self.arenas.owned(s, m.arena, "free the sleep buffer of", kv_ok=True)
        sleep = self.arenas.by_name[m.arena].asleep
        if sleep is not None and sleep.kept:
            raise p.ProtocolError(
                p.ErrorCode.ARENA_ASLEEP, f"arena '{m.arena}' sleeps with its contents in its host buffer: wake it first", arena=m.arena
            )
        self._drop_buffer(m.arena)
        return Outcome(p.Ack())

    def sleep(self, s: SessionRecord, m: p.SleepArena, notices: Notices) -> Outcome:
        arena = self.arenas.owned(s, m.name, "put to sleep")
        self.check_awake(arena.name, "put to sleep")
        others = sorted(self.sessions[sid].name for sid in arena.attached - {s.id} if sid in self.sessions)
        if others:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"arena '{arena.name}' is attached by {', '.join(others)} too: an arena sleeps only while its owner "
                "alone maps it (sharers release it first)",
                arena=arena.name,
            )
        room = self.buffers[arena.name].size if arena.name in self.buffers else 0
        if not 0 <= m.kept_bytes <= min(room, arena.committed):
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"kept_bytes {m.kept_bytes} is not within arena '{arena.name}'s committed {arena.committed} bytes and its "
                f"host buffer of {room}",
                kept_bytes=m.kept_bytes,
            )
        committed = arena.committed
        outcome = self.arenas.decommit(s, arena, list(arena.chunks))
        notices += outcome.notices
        outcome.notices = []
        self.arenas.fall_asleep(arena, committed, m.kept_bytes, self.wall_clock())
        log.info(
            "arena %r of client %r asleep: %d bytes handed back, %d kept in host memory", arena.name, s.name, committed, m.kept_bytes,
            extra={"figures": {"arena": arena.name, "committed": committed, "kept": m.kept_bytes}},
        )
        return outcome

    def wake(self, s: SessionRecord, m: p.WakeArena, request_id: int) -> Outcome:
        """Commit the arena again if its memory is free; else ask KV pools above their fair
        share to give back (KvBook.ask_back) and answer once it fits, or at the end of the
        request's ``wait`` (deferred), naming who holds the memory."""
        arena = self.arenas.owned(s, m.name, "wake")
        if arena.asleep is None:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"arena '{arena.name}' is not asleep", arena=arena.name)
        if any(w.arena == arena.name for w in self.wakes):
            raise p.ProtocolError(p.ErrorCode.ALREADY_EXISTS, f"a wake of arena '{arena.name}' is already waiting for memory", arena=arena.name)
        now = self.clock()
        deadline = wait_deadline(m.wait, now, f"waking arena '{arena.name}'")
        short = arena.asleep.committed - self.arenas.available_bytes()
        if short <= 0:
            return self._woken(s, arena, [], 0.0)
        asked = [k.name for k in self.kv.ask_back(short, f"client '{s.name}' wakes arena '{arena.name}'")]
        if m.wait <= 0:
            return self._woken(s, arena, asked, 0.0)  # refuses, with the figures and the holders
        self.wakes.append(PendingWake(s.id, request_id, now, deadline, arena=arena.name, asked=asked))
        log.info("waking arena %r of client %r: %d bytes short; waits up to %gs (asked %s to give back)", arena.name, s.name, short, m.wait, asked)
        return Outcome(None)

    def _woken(self, s: SessionRecord, arena: ArenaRecord, asked: list[str], waited: float) -> Outcome:
        """Commit the arena again at its size and offsets, or OUT_OF_MEMORY naming who holds
        the device's memory and the KV pools ``asked`` to give back."""
        assert arena.asleep is not None
        need = arena.asleep.committed
        if need:
            what = f"waking arena '{arena.name}'" + (f" (waited {waited:.3g}s)" if waited else "")
            try:
                available = self.arenas.require_available(need, what)
            except p.ProtocolError as exc:
                also = f"; KV pools {', '.join(asked)} were asked to give back" if asked else ""
                again = " (ask again once they have)" if asked and not waited else ""
                raise p.ProtocolError(exc.code, f"{exc.message}; the device's memory is held by {self._holders()}{also}{again}", **exc.detail) from None
            self.arenas.create_chunks([(arena, 0, need)], available)
        self.arenas.wake(arena)
        log.info("arena %r of client %r awake: %d bytes committed again", arena.name, s.name, need)
        return self.arenas.map_reply(s, arena)

    def settle(self) -> None:
        """Answer the waiting wakes that fit now, and those whose wait ended (refused, with
        the figures): called when memory comes free and on the tick."""
        now = self.clock()
        for wake in list(self.wakes):
            arena, s = self.arenas.by_name.get(wake.arena), self.sessions.get(wake.session_id)
            if arena is None or s is None or arena.asleep is None or arena.owner_id != s.id:
                self._end_wake(wake)  # its session or its arena went (an orphan's owner is gone too)
                continue
            short = arena.asleep.committed - self.arenas.available_bytes()
            if now < wake.deadline and short > 0:
                if not any(k.shrink_request is not None for k in self.kv.pools.values() if k.name in wake.asked):
                    # Every pool asked answered, and it is short still: those that can give more now are asked.
                    wake.asked = [k.name for k in self.kv.ask_back(short, f"client '{s.name}' wakes arena '{arena.name}'")]
                continue
            self.wakes.remove(wake)
            try:
                outcome = self._woken(s, arena, wake.asked, now - wake.created)
            except p.ProtocolError as exc:
                self._completions.append(Completion(wake.session_id, wake.request_id, exc))
                continue
            assert outcome.reply is not None
            self._completions.append(Completion(wake.session_id, wake.request_id, outcome.reply, outcome.handout))

    def _end_wake(self, wake: PendingWake) -> None:
        self.wakes.remove(wake)
        error = p.ProtocolError(p.ErrorCode.NOT_FOUND, f"arena '{wake.arena}' was released while its wake waited", arena=wake.arena)
        self._completions.append(Completion(wake.session_id, wake.request_id, error))

    def take_completions(self) -> list[Completion]:
        out, self._completions = self._completions, []
        return out

    def has_mail(self) -> bool:
        return bool(self._completions)

    # ------------------------------------------------------------------ the arena's end

    def drop_arena(self, name: str) -> None:
        """Arena ``name`` is gone: its host buffer goes with it (its sleep went with the
        arena), and a wake waiting for it is answered."""
        self._drop_buffer(name)
        for wake in [w for w in self.wakes if w.arena == name]:
            self._end_wake(wake)

    def _drop_buffer(self, arena: str) -> None:
        buffer = self.buffers.pop(arena, None)
        if buffer is not None:
            os.close(buffer.fd)
            log.info("arena %r: host buffer %d (%s) freed", arena, buffer.id, format_size(buffer.size))

    def close(self) -> None:
        for name in list(self.buffers):
            self._drop_buffer(name)

    # ------------------------------------------------------------------ accounting

    def host_bytes(self) -> int:
        return sum(b.size for b in self.buffers.values())

    def host_bytes_by_session(self) -> dict[int, int]:
        used: dict[int, int] = {}
        for b in self.buffers.values():
            used[b.owner_id] = used.get(b.owner_id, 0) + b.size
        return used

    def host_bytes_of(self, uid: int) -> int:
        """What the buffers of ``uid``'s arenas hold (an arena counts against its owner's
        uid, an orphan's against its dead owner's, as its device memory does)."""
        return sum(b.size for b in self.buffers.values() if self.arenas.tenants.owners.get(b.arena) == uid)

    def _admit(self, s: SessionRecord, more: int, what: str) -> None:
        limit, used = self.config.sleep_host_limit, self.host_bytes()
        share = int(limit * self.config.tenants.sleep_host_share)
        mine = self.host_bytes_of(s.uid)
        if mine + more > share and used + more <= limit:
            # One uid cannot take the whole limit (a sparse buffer costs it nothing) and
            # leave every other tenant's sleep refused.
            log.warning("refused: %s; uid %d's sleep buffers use %d of its %d-byte share", what, s.uid, mine, share)
            raise p.ProtocolError(
                p.ErrorCode.HOST_LIMIT,
                f"{what} needs {format_size(more)} more host memory; uid {s.uid}'s sleep buffers use {format_size(mine)} of "
                f"its share of {format_size(share)} ({self.config.tenants.sleep_host_share:g} of the {format_size(limit)} "
                "--sleep-host-limit, --tenant-sleep-host-share): free a buffer first (free_host)",
                limit=share,
                used=mine,
                requested=more,
                uid=s.uid,
            )
        if used + more <= limit:
            return
        users = sorted(self.host_bytes_by_session().items(), key=lambda kv: -kv[1])[:_NAMED]
        named = ", ".join(f"{self._who(sid)} {format_size(n)}" for sid, n in users) or "nobody"
        log.warning("refused: %s; sleep buffers use %d of the %d-byte host limit", what, used, limit)
        raise p.ProtocolError(
            p.ErrorCode.HOST_LIMIT,
            f"{what} needs {format_size(more)} more host memory; sleep buffers use {format_size(used)} of the "
            f"{format_size(limit)} limit (gpumemd --sleep-host-limit); the largest users: {named}",
            limit=limit,
            used=used,
            requested=more,
        )

    def _who(self, session_id: int) -> str:
        s = self.sessions.get(session_id)
        return f"client '{s.name}' ({s.pids})" if s is not None else f"session {session_id}"

    def _holders(self) -> str:
        """Who holds the device's memory, largest first: each owner's committed bytes."""
        held: dict[str, int] = {}
        for a in self.arenas.by_name.values():
            who = f"client '{a.owner_name}' (pid {a.owner_pid})"
            held[who] = held.get(who, 0) + a.committed + sum(c.size for c in a.placeholders)
        retiring = sum(c.size for c in self.arenas.retiring.values())
        if retiring:
            held["chunks still mapped after their release (retiring)"] = retiring
        top = sorted(((n, who) for who, n in held.items() if n), reverse=True)[:_NAMED]
        return ", ".join(f"{who} {format_size(n)}" for n, who in top) or "nobody gpumemd knows of (other processes on the device)"

    def status(self) -> list[p.SleeperStatus]:
        asleep = self.asleep
        out = []
        for name in sorted(set(asleep) | set(self.buffers)):
            sleeper, buffer = asleep.get(name), self.buffers.get(name)
            owner_id = self.arenas.by_name[name].owner_id if sleeper is not None else buffer.owner_id if buffer is not None else 0
            owner = self.sessions.get(owner_id)
            out.append(
                p.SleeperStatus(
                    arena=name,
                    owner=owner.name if owner is not None else "",
                    asleep=sleeper is not None,
                    committed_bytes=sleeper.committed if sleeper is not None else 0,
                    kept_bytes=sleeper.kept if sleeper is not None else 0,
                    host_bytes=buffer.size if buffer is not None else 0,
                    since=sleeper.since if sleeper is not None else 0.0,
                )
            )
        return out

    # ------------------------------------------------------------------ the durable record

    def image(self, keep: Keep) -> SleeperBookImage:
        for b in self.buffers.values():
            keep(host_buffer_name(b.id), b.fd)
        return SleeperBookImage([_BUFFER.image(b) for b in self.buffers.values()], self.next_buffer)

    def restore(self, part: object, take: Take) -> list[str]:
        """The book as ``image`` left it, for the arenas that were rebuilt; returns what it
        could not rebuild (a buffer missing from the store). ``take`` hands only the very
        file the daemon stored (durable.py checks its identity), and a sealed buffer
        cannot have changed its size since."""
        book = msgspec.convert(part, SleeperBookImage)
        problems = []
        for image in book.buffers:
            buffer = _BUFFER.restore(image, fd=-1)
            fd = take(host_buffer_name(buffer.id))
            if fd < 0 or buffer.arena not in self.arenas.by_name:
                problem = f"host buffer {buffer.id} of arena '{buffer.arena}' " + (
                    "missing from the fd store" if fd < 0 else "outlived its arena"
                )
                log.error("%s: dropped", problem)
                problems.append(problem)
                if fd >= 0:
                    os.close(fd)
                continue
            buffer.fd = fd
            self.buffers[buffer.arena] = buffer
        self.next_buffer = book.next_buffer
        return problems
