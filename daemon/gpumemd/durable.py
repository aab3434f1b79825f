"""The durable record: what a restarted daemon rebuilds its state from, kept where the
next daemon finds it, systemd's file-descriptor store.

The store holds, each under its own FDNAME: every chunk's POSIX fd (``chunk-<id>``;
a client cannot hand a chunk back, since an importer cannot export it again), every graph
pool's lease segment (``lease-<id>``, so the leases in it stay held), and the record
itself (``record-0``, ``record-1``): two memfds written in turn, each a header (magic,
sequence number, length, CRC-32) and a msgpack image of the books. A torn or corrupt
write fails its check, and the other one, a write older, is read instead.

Write order, so that a crash at any instant loses nothing a client holds and leaks
nothing: new fds go to the store, a barrier waits until the manager has them, then the
record is written, then fds no longer named by it are removed from the store; only then
do descriptors and the reply leave (the server calls ``persist`` before it sends). A fd
the store holds that the record does not name (a crash after the store, before the
record) is closed at the next start; a chunk the record names is in the store.

At start the daemon reads what the manager passed (LISTEN_FDS), rebuilds the books with
every session waiting for its client, and releases after the grace period what no client
came back for, like a dead client's. Nothing in the store: a fresh start, as ever.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import zlib

import msgspec

from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError
from gpumem_shared.lease_table import LeaseSegment

from gpumemd.arenas import map_batches
from gpumemd.image import (
    IMAGE_VERSION,
    ArenaImage,
    ChunkImage,
    GraphPoolImage,
    StateImage,
    capture,
    chunk_name,
    decode,
    lease_name,
)
from gpumemd.notify import StoreError, SystemdNotifier
from gpumemd.records import (
    Answer,
    ArenaRecord,
    ChunkRecord,
    GrantRecord,
    GraphPoolRecord,
    KvBufferLayout,
    KvPoolRecord,
    MemberRecord,
    RoundRecord,
    SessionRecord,
)
from gpumemd.state import DaemonState

log = logging.getLogger("gpumemd.durable")

MAGIC = b"gpumemd\x01"
_HEADER = struct.Struct("<8sQQI4x")  # magic, sequence, payload length, CRC-32 of the payload
RECORD_NAMES = ("record-0", "record-1")

# The service manager answers a barrier at once unless it is wedged.
BARRIER_TIMEOUT = 5.0


# ---------------------------------------------------------------------------- the record


class RecordFile:
    """The record's two memfds, written in turn; ``read`` returns the newest whole one."""

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        self.sequence = 0  # of the last write, read or made

    @classmethod
    def create(cls) -> RecordFile:
        return cls([os.memfd_create(f"gpumemd-{name}", os.MFD_CLOEXEC) for name in RECORD_NAMES])

    @staticmethod
    def is_record(fd: int) -> bool:
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            return False

    def read(self) -> bytes | None:
        best: tuple[int, bytes] | None = None
        for name, fd in zip(RECORD_NAMES, self.fds):
            head = os.pread(fd, _HEADER.size, 0)
            if len(head) < _HEADER.size:
                if head:
                    log.error("durable record %s is truncated (%d bytes, no whole header)", name, len(head))
                continue
            magic, sequence, length, crc = _HEADER.unpack(head)
            if magic != MAGIC:
                log.error("durable record %s is not a gpumemd record (magic %r)", name, magic)
                continue
            # A corrupt length must not make this read (or allocate) what is not there.
            payload = os.pread(fd, min(length, max(os.fstat(fd).st_size - _HEADER.size, 0)), _HEADER.size)
            if len(payload) != length or zlib.crc32(payload) != crc:
                log.error("durable record %s (write %d) is truncated or corrupt: %d of %d bytes, checksum %s", name, sequence,
                          len(payload), length, "matches" if zlib.crc32(payload) == crc else "differs")
                continue
            if best is None or sequence > best[0]:
                best = (sequence, payload)
        if best is None:
            return None
        self.sequence = best[0]
        return best[1]

    def write(self, payload: bytes) -> None:
        """Into the slot not holding the newest record: the payload first, then the
        header that vouches for it, so a write cut short leaves the other slot newest."""
        self.sequence += 1
        fd = self.fds[self.sequence % 2]
        os.pwrite(fd, payload, _HEADER.size)
        os.pwrite(fd, _HEADER.pack(MAGIC, self.sequence, len(payload), zlib.crc32(payload)), 0)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


# ---------------------------------------------------------------------------- store + record


class Durable:
    """The daemon's side of the fd store: rebuild at start, ``persist`` before replies."""

    def __init__(self, notifier: SystemdNotifier) -> None:
        self.notifier = notifier
        self.record = RecordFile([])
        self._stored: set[str] = set()  # names the manager holds for this daemon
        self._warned_full = False

    def start(self, state: DaemonState, inherited: dict[str, list[int]]) -> None:
        """Rebuild ``state`` from what the store passed (nothing: a fresh start) and write
        the first record of this daemon; every fd passed is kept, adopted or closed."""
        self._stored = set(inherited)
        fds = {name: list(group) for name, group in inherited.items()}
        for name, group in fds.items():
            if len(group) > 1:
                log.error("fd store: %d descriptors named %r; keeping the first, closing the rest", len(group), name)
                for fd in group[1:]:
                    os.close(fd)
                del group[1:]
        record_fds = [fds.pop(name, [-1])[0] for name in RECORD_NAMES]
        payload = None
        if all(fd >= 0 and RecordFile.is_record(fd) for fd in record_fds):
            self.record = RecordFile(record_fds)
            payload = self.record.read()
        else:
            if any(fd >= 0 for fd in record_fds) or fds:
                log.error("fd store: the durable record is missing or is not a memfd (%s passed); state is not rebuilt",
                          ", ".join(sorted(inherited)) or "nothing")
            for fd in record_fds:
                if fd >= 0:
                    os.close(fd)
            self.record = RecordFile.create()
        if payload is not None:
            try:
                image = decode(payload)
            except msgspec.DecodeError as exc:
                log.error("durable record unreadable (%s); state is not rebuilt", exc)
            else:
                _Rebuild(state, fds).run(image)
        elif fds:
            log.error("fd store: no readable durable record; state is not rebuilt")
        for name, group in sorted(fds.items()):  # what no record names: stored just before a crash, or foreign
            log.warning("fd store: %r is named by no record; closed", name)
            for fd in group:
                os.close(fd)
        state.resumable = True
        self.persist(state)

    def persist(self, state: DaemonState) -> None:
        payload, live = capture(state)
        for name, fd in zip(RECORD_NAMES, self.record.fds):
            live[name] = fd
        new = [name for name in live if name not in self._stored]
        try:
            for name in new:
                self.notifier.store(name, live[name])
                self._stored.add(name)
            if new:
                self.notifier.barrier(BARRIER_TIMEOUT)
        except StoreError as exc:
            log.error("%s; a restart now would lose what was not stored", exc)
        try:
            self.record.write(payload)
        except OSError as exc:
            log.error("writing the durable record failed (%s); a restart now would rebuild an older state", exc.strerror)
        gone = self._stored - live.keys()
        try:
            for name in gone:
                self.notifier.unstore(name)
                self._stored.discard(name)
        except StoreError as exc:
            log.error("%s; the store keeps descriptors the record no longer names (closed at the next start)", exc)
        if len(live) > self.notifier.store_max and not self._warned_full:
            self._warned_full = True
            log.error(
                "the fd store holds at most %d descriptors (FileDescriptorStoreMax=) and the state needs %d: chunks beyond "
                "it do not survive a restart; raise FileDescriptorStoreMax= in the unit", self.notifier.store_max, len(live),
            )
        state.dirty = False

    def close(self) -> None:
        self.record.close()
        self.notifier.close()


class _Rebuild:
    """The books rebuilt from an image and the fds passed (taken out of ``fds`` as they
    are adopted); whatever cannot be rebuilt is logged and given back."""

    def __init__(self, state: DaemonState, fds: dict[str, list[int]]) -> None:
        self.state = state
        self.fds = fds

    def _take(self, name: str) -> int:
        group = self.fds.pop(name, None)
        return group[0] if group else -1

    def run(self, image: StateImage) -> None:
        state = self.state
        mine = (state.device.uuid, state.driver.kind, state.config.va_base)
        if image.version != IMAGE_VERSION or (image.device_uuid, image.backend, image.va_base) != mine:
            log.error(
                "durable record is of another daemon (version %d, device %s, backend %s, slice %#x; this one: %s, %s, %#x); "
                "state is not rebuilt", image.version, image.device_uuid, image.backend, image.va_base, *mine,
            )
            return
        now = state.clock()
        for si in image.sessions:
            state.sessions[si.id] = SessionRecord(
                id=si.id, name=si.name, pid=si.pid, uid=si.uid, gid=si.gid, since=si.since, token=si.token,
                credential=si.credential, waiting=True,
                answers={rid: Answer(reply, list(handout), list(grants)) for rid, reply, handout, grants in si.answers},
            )
        arenas = state.arenas
        for ai in image.arenas:
            self._arena(ai)
        for ci in image.retiring:
            if ci.holders:
                arenas.retiring[ci.id] = self._record(ci, None)
        for gi in image.graph_pools:
            self._graph_pool(gi)
        kv = state.kv
        for ki in image.kv_pools:
            if ki.name in arenas.by_name:
                kv.pools[ki.name] = KvPoolRecord(
                    name=ki.name, owner_id=ki.owner_id, buffers=[KvBufferLayout(*b) for b in ki.buffers], max_tokens=ki.max_tokens,
                    granularity=ki.granularity, tokens=ki.tokens, min_tokens=ki.min_tokens, shrink_request=ki.shrink_request,
                )
        chunks = {c.id: c for a in arenas.by_name.values() for c in a.chunks}
        for ri in image.rounds:
            members = [
                MemberRecord(
                    pool=kv.pools[mi.pool], session_id=mi.session_id, client=mi.client, reported=mi.reported,
                    headroom_bytes=mi.headroom_bytes, graph_pool_bytes=mi.graph_pool_bytes, min_tokens=mi.min_tokens,
                    max_tokens=mi.max_tokens, weight=mi.weight, request_id=mi.request_id, tokens=mi.tokens, bytes=mi.bytes,
                    staged=[chunks[c] for c in mi.staged if c in chunks],
                )
                for mi in ri.members
                if mi.pool in kv.pools
            ]
            kv.rounds.append(
                RoundRecord(
                    id=ri.id, created=now - ri.age, deadline=now + ri.left, policy=ri.policy, state=ri.state, expect=ri.expect,
                    joined=ri.joined, members=members, dropped=ri.dropped, budget=ri.budget, error=ri.error,
                )
            )
        state.next_session = image.next_session
        arenas.next_chunk, arenas.next_grant = image.next_chunk, image.next_grant
        state.graph_pools.next_id = image.next_pool
        kv.next_round = image.next_round
        state.generation = image.generation + 1
        if state.sessions:
            state.grace_deadline = now + state.config.restart_grace
        log.info(
            "rebuilt from the fd store (generation %d): %d session(s) waiting up to %gs for their clients, %d arena(s), "
            "%d graph pool(s), %d KV pool(s), %d bytes accounted",
            state.generation, len(state.sessions), state.config.restart_grace, len(arenas.by_name), len(state.graph_pools.by_id),
            len(kv.pools), arenas.accounted_bytes(),
            extra={"figures": {"generation": state.generation, "sessions": len(state.sessions), "arenas": len(arenas.by_name)}},
        )

    @staticmethod
    def _record(ci: ChunkImage, handle: object) -> ChunkRecord:
        return ChunkRecord(
            id=ci.id, arena=ci.arena, offset=ci.offset, size=ci.size, address=ci.address, handle=handle,
            holders=set(ci.holders), fresh=ci.fresh,
        )

    def _arena(self, ai: ArenaImage) -> None:
        arenas = self.state.arenas
        images = ai.chunks + ai.placeholders
        fds = [self._take(chunk_name(ci.id)) for ci in images]
        missing = [ci.id for ci, fd in zip(images, fds) if fd < 0]
        problem = f"chunk(s) {missing} missing from the fd store" if missing else ""
        handles: list[object] = []
        if not problem:
            try:
                handles = arenas.driver.adopt_chunks([(ci.address, ci.size) for ci in images], fds)
            except DriverError as exc:
                problem = f"a stored chunk is not one ({exc})"
        if problem:
            # Lost: its chunks go (their bytes stay with the clients that map them, counted as
            # retiring until those report the unmap or die).
            log.error("arena %r (owner %r) cannot be rebuilt: %s; it is dropped", ai.name, ai.owner_name, problem)
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            for ci in images:
                if ci.holders:
                    arenas.retiring[ci.id] = self._record(ci, None)
            return
        records = [self._record(ci, h) for ci, h in zip(images, handles)]
        arena = ArenaRecord(
            name=ai.name, owner_id=ai.owner_id, owner_name=ai.owner_name, owner_pid=ai.owner_pid, address=ai.address,
            reserved=ai.reserved, kv=ai.kv, owner_alive=ai.owner_alive, released=ai.released,
            chunks=records[: len(ai.chunks)], placeholders=records[len(ai.chunks):],
            grants=[GrantRecord(id=g.id, token=g.token, client=g.client, uid=g.uid, gid=g.gid, uid_implied=g.uid_implied) for g in ai.grants],
            attached=set(ai.attached),
        )
        arenas.by_name[arena.name] = arena

    def _graph_pool(self, gi: GraphPoolImage) -> None:
        fd = self._take(lease_name(gi.id, gi.segment_moves))
        problem = "its lease segment is missing from the fd store" if fd < 0 else ""
        if not problem and gi.arena not in self.state.arenas.by_name:
            problem = f"its arena {gi.arena!r} was not rebuilt"
        segment = None
        if not problem:
            try:
                segment = LeaseSegment(fd)
            except (ValueError, OSError) as exc:
                problem = f"the stored lease segment is not one ({exc})"
        if segment is None:
            log.error("graph pool %d (%r of client %r) cannot be rebuilt: %s; it is dropped", gi.id, gi.label, gi.owner_name, problem)
            if fd >= 0:
                os.close(fd)
            return
        self.state.graph_pools.by_id[gi.id] = GraphPoolRecord(
            id=gi.id, owner_id=gi.owner_id, owner_name=gi.owner_name, arena=gi.arena, label=gi.label, epoch=gi.epoch,
            extents=list(gi.extents), free_runs=list(gi.free_runs),
            segment=segment, segment_fd=fd, shared=gi.shared, users=set(gi.users), events=dict(gi.events),
            escapers=set(gi.escapers), lease_repairs=gi.lease_repairs, segment_moves=gi.segment_moves,
        )


def replay(
    state: DaemonState, session: SessionRecord, request_id: int, message: p.RequestMessage
) -> tuple[bytes, list[ChunkRecord], list[tuple[int, int]]]:
    """The answer to a request resent after a restart that the daemon before had carried
    out (its reply, from the record): the reply, the chunks to hand out again and the
    lease segments to grant again. Chunks it handed out that went since (retired by their
    owner meanwhile) leave the reply."""
    kept = session.answers[request_id]
    live = {c.id: c for a in state.arenas.by_name.values() for c in a.chunks + a.placeholders}
    chunks = state.arenas.hand(session, [live[cid] for cid in kept.handout if cid in live])
    reply = kept.reply
    if len(chunks) < len(kept.handout):
        answer = p.decode_reply(reply)
        body = p.decode_body(message.REPLY, answer.body)
        views = [c for c in getattr(body, "chunks", []) if c.id in live or c.id not in kept.handout]
        reply = p.encode_reply(request_id, msgspec.structs.replace(body, chunks=views, fd_batches=map_batches(len(chunks))))
    pools = state.graph_pools.by_id
    grants = [(pid, pools[pid].segment_fd) for pid in kept.grants if pid in pools and session.id in pools[pid].users]
    log.info("request %d of client %r answered again after the restart (%d chunk(s))", request_id, session.name, len(chunks))
    return reply, chunks, grants
