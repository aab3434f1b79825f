"""The lease table: shared memory the daemon creates and every client maps.

One 64-byte slot per registered graph pool. The word of a free slot is 0; a held
slot's word is ``kind << 56 | session << 32 | pid``. Clients take and give back leases
with the native module's compare-and-swap and futex calls, without a daemon round trip;
the daemon sweeps a dead holder's slots and clears impossible states, so the table is
never trusted blindly.

The slot's layout, the statuses, kinds and flags, the slot count and the label size are
described once, in csrc/lease_table.h; this module reads them from the native module,
which exports them. The ctypes view of a slot below only reads fields of the mapping
(and writes the holder's label); a unit test checks it against the exported layout.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import mmap
import os
from enum import IntEnum, IntFlag
from typing import Final

from gpumem_shared import _native  # built with the package; see setup.py

SLOTS: Final[int] = _native.LEASE_SLOTS
SLOT_BYTES: Final[int] = _native.LEASE_SLOT_BYTES
LABEL_BYTES: Final[int] = _native.LEASE_LABEL_BYTES
TABLE_BYTES: Final[int] = SLOTS * SLOT_BYTES

_STATUSES = dict(_native.LEASE_STATUSES)
_KINDS = dict(_native.LEASE_KINDS)
_FLAGS = dict(_native.LEASE_FLAGS)


class LeaseStatus(IntEnum):
    """What the lease calls return (lease_table.h says what each means). The calls
    return plain ints, which compare equal to these: making an enum member on every call
    would cost the uncontended path."""

    OK = _STATUSES["OK"]
    HELD = _STATUSES["HELD"]
    STALE = _STATUSES["STALE"]
    CORRUPT = _STATUSES["CORRUPT"]
    NOT_HOLDER = _STATUSES["NOT_HOLDER"]
    OK_ORDER = _STATUSES["OK_ORDER"]
    ESCAPED = _STATUSES["ESCAPED"]
    RECORD = _STATUSES["RECORD"]


class LeaseKind(IntEnum):
    """A lease word's kind: what its holder does with the pool."""

    CAPTURE = _KINDS["CAPTURE"]
    REPLAY = _KINDS["REPLAY"]
    BORROW = _KINDS["BORROW"]

    @property
    def noun(self) -> str:
        """The kind as messages and status replies name it: "capture", "replay", "borrow"."""
        return self.name.lower()


class LeaseFlag(IntFlag):
    """A slot's flags, written by the daemon. SHARED: other processes take leases on the
    pool, so its releasers record an IPC event for the next holder to wait on."""

    SHARED = _FLAGS["SHARED"]


# By kind value, for words that may hold any value (a corrupt slot's): ``.get(kind)``.
KIND_NAMES: Final[dict[int, str]] = {kind: kind.noun for kind in LeaseKind}


def lease_epoch(pool_id: int, epoch: int) -> int:
    """The 32-bit value a slot carries for a pool at an epoch. It names the pool too, so a
    waiter on a retired pool whose slot went to another pool sees a stale epoch."""
    return ((pool_id & 0xFFFF) << 16) | (epoch & 0xFFFF) or 1


def word_session(session_id: int) -> int:
    """A session id as lease words and slot fields carry it: its low 24 bits (the daemon
    never hands out two live sessions, nor any session, whose 24 bits collide or are 0)."""
    return session_id & 0xFFFFFF


def encode(kind: int, session: int, pid: int) -> int:
    return (kind << 56) | (word_session(session) << 32) | (pid & 0xFFFFFFFF)


@dataclasses.dataclass(frozen=True)
class Holder:
    kind: int
    session: int
    pid: int
    since_ns: int
    label: str

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, f"invalid kind {self.kind}")


def decode(word: int) -> tuple[int, int, int]:
    return word >> 56, (word >> 32) & 0xFFFFFF, word & 0xFFFFFFFF


class _Slot(ctypes.Structure):
    """A slot as the mapping's fields (reads, and the holder's label); the native calls
    do every synchronised write."""

    _fields_ = [
        ("word", ctypes.c_uint64),
        ("futex", ctypes.c_uint32),
        ("waiters", ctypes.c_uint32),
        ("since_ns", ctypes.c_uint64),
        ("epoch", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("handoff", ctypes.c_uint32),
        ("escaped", ctypes.c_uint32),
        ("label", ctypes.c_char * LABEL_BYTES),
    ]


class LeaseTable:
    """A mapping of the table. ``create()`` makes a new one (the daemon); ``LeaseTable(fd)``
    maps one received over the fd channel (clients). The mapping lives as long as the
    process: the native calls hold raw pointers into it."""

    def __init__(self, fd: int) -> None:
        if os.fstat(fd).st_size != TABLE_BYTES:
            raise ValueError(f"a lease table is {TABLE_BYTES} bytes, this fd has {os.fstat(fd).st_size}")
        self._map = mmap.mmap(fd, TABLE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._slots = (_Slot * SLOTS).from_buffer(self._map)
        self.address = ctypes.addressof(self._slots)
        # The client's fast path calls these straight (gpumem.leases): one native call each.
        self._try = _native.lease_try
        self._release = _native.lease_release

    @classmethod
    def create(cls) -> tuple[LeaseTable, int]:
        """A fresh table and its memfd. The memfd is sealed against resizing: a client
        that truncated it would make the daemon's next access fault."""
        fd = os.memfd_create("gpumemd-leases", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, TABLE_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return cls(fd), fd

    def try_acquire(self, slot: int, word: int, epoch: int, label: bytes) -> int:
        """One attempt, no wait, the label recorded: the uncontended fast path (one
        compare-and-swap in one native call). OK or OK_ORDER when taken."""
        return self._try(self.address, slot, word, epoch, label)

    def acquire(self, slot: int, word: int, epoch: int, timeout_s: float) -> tuple[int, int]:
        """(status, word found). Waits up to ``timeout_s`` for a holder to let go."""
        return _native.lease_acquire(self.address, slot, word, epoch, int(timeout_s * 1e9))

    def release(self, slot: int, word: int) -> int:
        """OK, NOT_HOLDER, or RECORD (nothing released: a shared pool; record the IPC
        event, then ``release_recorded``)."""
        return self._release(self.address, slot, word)

    def release_recorded(self, slot: int, word: int) -> int:
        return _native.lease_release_recorded(self.address, slot, word)

    def clear(self, slot: int, word: int) -> int:
        """Free the slot if it holds ``word``, without ordering: the daemon's sweep."""
        return _native.lease_clear(self.address, slot, word)

    def set_escaped(self, slot: int, session: int) -> None:
        """The daemon: refuse replay and capture while any session's borrowed tensors
        outlive their scope; the slot names one of them (0: none)."""
        _native.lease_set_escaped(self.address, slot, word_session(session))

    def escaped(self, slot: int) -> int:
        return int(self._slots[slot].escaped)

    def handoff(self, slot: int) -> int:
        return int(self._slots[slot].handoff)

    def releases(self, slot: int) -> int:
        """The slot's futex word, which every release (and every clear) bumps by one:
        leases ended on the slot, modulo 2**32. The daemon's metrics count from it."""
        return int(self._slots[slot].futex)

    def waiters(self, slot: int) -> int:
        """Processes asleep on the slot right now, waiting for its holder to let go."""
        return int(self._slots[slot].waiters)

    def flags(self, slot: int) -> LeaseFlag:
        return LeaseFlag(self._slots[slot].flags)

    def set_flags(self, slot: int, flags: int) -> None:
        _native.lease_set_flags(self.address, slot, flags)

    def forget_handoff(self, slot: int, session: int) -> None:
        """A session ended: if it was the last to release, its IPC event went with it."""
        _native.lease_forget_handoff(self.address, slot, word_session(session))

    def peek(self, slot: int) -> int:
        return _native.lease_peek(self.address, slot)

    def set_epoch(self, slot: int, epoch: int) -> None:
        _native.lease_set_epoch(self.address, slot, epoch)

    def epoch(self, slot: int) -> int:
        return int(self._slots[slot].epoch)

    def set_label(self, slot: int, label: str) -> None:
        self._slots[slot].label = label.encode()[:LABEL_BYTES]

    def holder(self, slot: int) -> Holder | None:
        entry = self._slots[slot]
        word = int(entry.word)
        if word == 0:
            return None
        kind, session, pid = decode(word)
        return Holder(kind, session, pid, int(entry.since_ns), entry.label.decode(errors="replace"))

    def close(self) -> None:
        """Unmap (only once nothing will call the native functions on it again)."""
        if not self._map.closed:
            del self._slots
            self._map.close()

    def words(self) -> list[int]:
        return [int(self._slots[i].word) for i in range(SLOTS)]
