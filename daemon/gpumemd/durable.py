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

from gpumemd.image import IMAGE_VERSION, decode, encode
from gpumemd.notify import StoreError, SystemdNotifier
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
            self._rebuild(state, payload, fds)
        elif fds:
            log.error("fd store: no readable durable record; state is not rebuilt")
        for name, group in sorted(fds.items()):  # what no record names: stored just before a crash, or foreign
            log.warning("fd store: %r is named by no record; closed", name)
            for fd in group:
                os.close(fd)
        state.resumable = True
        self.persist(state)

    def _rebuild(self, state: DaemonState, payload: bytes, fds: dict[str, list[int]]) -> None:
        """The books restored from the record; the fds they adopt are taken out of ``fds``."""

        def take(name: str) -> int:
            group = fds.pop(name, None)
            return group[0] if group else -1

        try:
            image = decode(payload)
        except msgspec.DecodeError as exc:
            log.error("durable record unreadable (%s); state is not rebuilt", exc)
            return
        mine = (state.device.uuid, state.driver.kind, state.config.va_base)
        if image.version != IMAGE_VERSION or (image.device_uuid, image.backend, image.va_base) != mine:
            log.error(
                "durable record is of another daemon (version %d, device %s, backend %s, slice %#x; this one: %s, %s, %#x); "
                "state is not rebuilt", image.version, image.device_uuid, image.backend, image.va_base, *mine,
            )
            return
        try:
            state.restore(image, take)
        except msgspec.ValidationError as exc:  # written by this version: only a bug gets here
            log.error("durable record does not match its version's layout (%s); state is rebuilt only in part", exc)

    def persist(self, state: DaemonState) -> None:
        live: dict[str, int] = {}
        payload = encode(state.image(live.__setitem__))
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
