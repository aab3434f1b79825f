"""The durable record: what a restarted daemon rebuilds its state from, kept where the
next daemon finds it, systemd's file-descriptor store.

The store holds, each under its own FDNAME: every chunk's POSIX fd (``chunk-<id>``;
a client cannot hand a chunk back, since an importer cannot export it again), every graph
pool's lease segment (``lease-<id>``, so the leases in it stay held), and the record
itself (``record-0``, ``record-1``): two memfds written in turn, each a header (magic,
sequence number, length, CRC-32) and a msgpack image of the books. A torn or corrupt
write fails its check, and the other one, a write older, is read instead (a whole header
newer than the one read means an acknowledged write is lost: said in the log and in
status). The record names each stored fd's identity (device, inode): a descriptor put in
the store under a name by anyone else is closed, not adopted.

Write order, so that a crash at any instant loses nothing a client holds and leaks
nothing: new fds go to the store, a barrier waits until the manager has them, then the
record is written, then fds no longer named by it are removed from the store; only then
do descriptors and the reply leave (outbox.py calls ``persist`` before it hands the
server anything to send). A fd
the store holds that the record does not name (a crash after the store, before the
record) is closed at the next start; a chunk the record names is in the store.

At start the daemon reads what the manager passed (LISTEN_FDS), and each book restores
its part of the image (image.py) with every session waiting for its client, and releases after the grace period what no client
came back for, like a dead client's. Nothing in the store: a fresh start, as ever.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import zlib

import msgspec

from gpumemd.image import IMAGE_VERSION, bad_counter, decode, encode
from gpumemd.notify import StoreError, SystemdNotifier
from gpumemd.state import DaemonState

log = logging.getLogger("gpumemd.durable")

MAGIC = b"gpumemd\x01"
_HEADER = struct.Struct("<8sQQI4x")  # magic, sequence, payload length, CRC-32 of the payload
RECORD_NAMES = ("record-0", "record-1")
SEQUENCE_BOUND = 1 << 62

# The service manager answers a barrier at once unless it is wedged.
BARRIER_TIMEOUT = 5.0


# ---------------------------------------------------------------------------- the record


class RecordFile:
    """The record's two memfds, written in turn; ``read`` returns the newest whole one."""

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        self.sequence = 0  # of the last write, read or made
        self.lost: int | None = None  # a write newer than the one read that was damaged since

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
        best: tuple[int, int, bytes] | None = None  # sequence, slot, payload
        broken: list[int] = []  # sequence numbers of whole headers whose payload fails its check
        for slot, (name, fd) in enumerate(zip(RECORD_NAMES, self.fds)):
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
                if sequence < SEQUENCE_BOUND:  # a number no write has is not one this daemon lost
                    broken.append(sequence)
                continue
            if sequence >= SEQUENCE_BOUND:  # no daemon writes that many: its successors would not fit the header
                log.error("durable record %s claims write %d, beyond any a daemon makes; refused", name, sequence)
                continue
            if best is None or sequence > best[0]:
                best = (sequence, slot, payload)
        if best is None:
            return None
        sequence, slot, payload = best
        # The next write goes to the other slot, under a number above every one seen.
        self.sequence = max([sequence, *broken])
        if (self.sequence + 1) % 2 == slot:
            self.sequence += 1
        # A write cut short by a crash leaves its slot with the header of two writes
        # before (the header goes last), older than the other: nothing acknowledged is
        # lost. A whole header newer than the write read was written whole, and its
        # reply may have left: damaged since (only the service's own store or root
        # reaches it).
        newer = [n for n in broken if n > sequence]
        if newer:
            self.lost = max(newer)
            log.error(
                "durable record: write %d, the newest, is corrupt; the state is rebuilt from write %d, the one before: what "
                "the daemon acknowledged in write %d is lost (a client may find a change it was told of undone)",
                self.lost, sequence, self.lost,
            )
        return payload

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
        # The identity of what the daemon stored under each name, as the record names it;
        # ``_adopted``: names passed at start, whose identity the first write takes from what was adopted.
        self._identities: dict[str, tuple[int, int]] = {}
        self._adopted: set[str] = set()
        self._warned_full = False

    def start(self, state: DaemonState, inherited: dict[str, list[int]]) -> None:
        """Rebuild ``state`` from what the store passed (nothing: a fresh start) and write
        the first record of this daemon; every fd passed is kept, adopted or closed."""
        fds = {name: list(group) for name, group in inherited.items()}
        record_fds = []
        for name in RECORD_NAMES:
            group = fds.pop(name, [])
            if len(group) > 1:  # which one is the daemon's cannot be told: none is trusted
                _lost(state, "fd store: %d descriptors named %r; none is read, all closed", len(group), name)
                _close_all(group)
                group = []
            record_fds.append(group[0] if group else -1)
        payload = None
        if all(fd >= 0 and RecordFile.is_record(fd) for fd in record_fds):
            self.record = RecordFile(record_fds)
            payload = self.record.read()
            if self.record.lost is not None:
                state.restore_problems.append(
                    f"durable record write {self.record.lost}, the newest, is corrupt: what it acknowledged is lost"
                )
        else:
            if any(fd >= 0 for fd in record_fds) or fds:
                _lost(state, "fd store: the durable record is missing or is not a memfd (%s passed); state is not rebuilt",
                      ", ".join(sorted(inherited)) or "nothing")
            _close_all([fd for fd in record_fds if fd >= 0])
            self.record = RecordFile.create()
        if payload is not None:
            self._rebuild(state, payload, fds)
        elif fds:
            _lost(state, "fd store: no readable durable record; state is not rebuilt")
        for name, group in sorted(fds.items()):  # what no record names: stored just before a crash, or foreign
            log.warning("fd store: %r is named by no record; closed", name)
            _close_all(group)
        # The manager still holds every name passed: the first persist removes those the
        # state does not name, and takes the identity of those it does from what it adopted.
        self._stored = set(inherited)
        self._adopted = set(inherited)
        if self.record.fds != record_fds:  # new memfds: what the store holds under their names goes first
            for name in RECORD_NAMES:
                if name in self._stored:
                    self._stored.discard(name)
                    self._unstore(name)
        state.session_desk.resumable = True
        self.persist(state)

    def _rebuild(self, state: DaemonState, payload: bytes, fds: dict[str, list[int]]) -> None:
        """The books restored from the record; the fds they adopt are taken out of ``fds``."""
        try:
            image = decode(payload)
        except msgspec.DecodeError as exc:
            _lost(state, "durable record unreadable (%s); state is not rebuilt", exc)
            return
        mine = (state.device.uuid, state.driver.kind, state.config.va_base)
        if image.version != IMAGE_VERSION or (image.device_uuid, image.backend, image.va_base) != mine:
            _lost(
                state, "durable record is of another daemon (version %d, device %s, backend %s, slice %#x; this one: %s, %s, %#x); "
                "state is not rebuilt", image.version, image.device_uuid, image.backend, image.va_base, *mine,
            )
            return
        bad = bad_counter(image)
        if bad is not None:
            _lost(state, "durable record refused: %s is beyond any id a daemon issues; state is not rebuilt", bad)
            return
        identities = image.stored or {}

        def take(name: str) -> int:
            """The one descriptor under ``name`` that is the one the record names: the
            same file (device and inode) the daemon stored; any other is closed."""
            group = fds.pop(name, [])
            want = identities.get(name)
            found = [fd for fd in group if _identity(fd) == want]
            if found[1:] or len(found) < len(group):
                _lost(
                    state, "fd store: %d descriptor(s) named %r that are not the one the daemon stored (device:inode %s); closed%s",
                    len(group) - len(found[:1]), name, "%d:%d" % want if want else "unrecorded", "" if found else ", and it is lost",
                )
                _close_all([fd for fd in group if fd not in found[:1]])
            return found[0] if found else -1

        try:
            state.restore(image, take)
        except Exception as exc:  # a record this daemon did not write: whatever it holds must not stop the start
            _lost(state, "durable record does not restore (%s: %s); state is rebuilt only in part", type(exc).__name__, exc)

    def persist(self, state: DaemonState) -> None:
        live: dict[str, int] = {}
        image = state.image(live.__setitem__)
        for name, fd in zip(RECORD_NAMES, self.record.fds):
            live[name] = fd
        stored, identities = self._stored, self._identities
        new = [name for name in live if name not in stored]
        try:
            for name in new:
                self.notifier.store(name, live[name])
                stored.add(name)
                _remember(identities, name, live[name])
            if new:
                self.notifier.barrier(BARRIER_TIMEOUT)
        except StoreError as exc:
            log.error("%s; a restart now would lose what was not stored", exc)
        if self._adopted:
            for name in self._adopted & live.keys():
                _remember(identities, name, live[name])
            self._adopted = set()
        image.stored = identities
        payload = encode(image)
        try:
            self.record.write(payload)
        except OSError as exc:
            log.error("writing the durable record failed (%s); a restart now would rebuild an older state", exc.strerror)
        for name in stored - live.keys():
            if self._unstore(name):
                stored.discard(name)
                identities.pop(name, None)
        if len(live) > self.notifier.store_max and not self._warned_full:
            self._warned_full = True
            log.error(
                "the fd store holds at most %d descriptors (FileDescriptorStoreMax=) and the state needs %d: chunks beyond "
                "it do not survive a restart; raise FileDescriptorStoreMax= in the unit", self.notifier.store_max, len(live),
            )
        state.dirty = False

    def _unstore(self, name: str) -> bool:
        try:
            self.notifier.unstore(name)
        except StoreError as exc:
            log.error("%s; the store keeps descriptors the record no longer names (closed at the next start)", exc)
            return False
        return True

    def close(self) -> None:
        self.record.close()
        self.notifier.close()


def _identity(fd: int) -> tuple[int, int] | None:
    """The file behind ``fd``: what a descriptor put in the store by someone else cannot match."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _remember(identities: dict[str, tuple[int, int]], name: str, fd: int) -> None:
    found = _identity(fd)
    if found is not None:
        identities[name] = found


def _lost(state: DaemonState, message: str, *args: object) -> None:
    """An error the start could not rebuild past: logged, and shown in status for the daemon's life."""
    log.error(message, *args)
    state.restore_problems.append(message % args)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
