"""Lease slots: one per registered graph pool, each in a lease segment of its own.

A segment is a sealed memfd of one page that the daemon creates when the pool is
registered and hands only to the sessions allowed to use the pool: its owner, and the
sessions that open it (a shared pool, its arena attached). A session that may not use a
pool never receives its segment, so it holds no mapping of the pool's lease words; one
that loses its right keeps its mapping, so the pool then moves to a fresh segment and
the old one is retired (epoch 0), reaching nobody who may still use the pool.

The word of a free slot is 0; a held slot's word is ``kind << 56 | session << 32 |
pid``. Clients take and give back leases with the native module's compare-and-swap and
futex calls on the segment's address, without a daemon round trip; the daemon sweeps a
dead holder's word and repairs what a client could not rightly have written there, so
a segment is never trusted blindly.

The slot's layout, the statuses, kinds and flags, the segment and label sizes are
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

SEGMENT_BYTES: Final[int] = _native.LEASE_SEGMENT_BYTES
SLOT_BYTES: Final[int] = _native.LEASE_SLOT_BYTES
LABEL_BYTES: Final[int] = _native.LEASE_LABEL_BYTES
# In a slot's handoff field: its releaser freed the slot and is still recording its
# event; a taker waits for the record to land, within its own bound.
HANDOFF_RECORDING: Final[int] = _native.LEASE_HANDOFF_RECORDING
# The session bits of a handoff; a handoff with a bit outside these and RECORDING names
# nobody (see handoff_session).
HANDOFF_SESSION: Final[int] = _native.LEASE_HANDOFF_SESSION

# The name a segment's memfd carries (and /proc/PID/maps shows), before the pool's id.
SEGMENT_NAME = "gpumemd-lease-pool-"

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
    OK_WAITED = _STATUSES["OK_WAITED"]
    RECORDING = _STATUSES["RECORDING"]


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
    """The 32-bit value a slot carries for a pool at an epoch (never 0: a retired slot's).
    It names the pool too, so a view of one pool never passes another's check."""
    return ((pool_id & 0xFFFF) << 16) | (epoch & 0xFFFF) or 1


def word_session(session_id: int) -> int:
    """A session id as lease words and slot fields carry it: its low 24 bits (the daemon
    never hands out two live sessions, nor any session, whose 24 bits collide or are 0)."""
    return session_id & 0xFFFFFF


def handoff_session(handoff: int) -> int | None:
    """The 24-bit session a handoff field names (0: none), recording or not; None when
    it is no handoff at all (bits set outside the session and the recording mark)."""
    if handoff & ~(HANDOFF_RECORDING | HANDOFF_SESSION):
        return None
    return handoff & HANDOFF_SESSION


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


class _Order(ctypes.Structure):
    """After the slot (lease_table.h's lease_order_pair): under memops ordering
    (lease_order.py) the last releaser's sequence lane and the value its stream writes
    there. The native release writes it; this view reads it (and lets the daemon carry
    it over to a moved segment)."""

    _fields_ = [("lane", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("value", ctypes.c_uint64)]


_ORDER_OFFSET: Final[int] = _native.LEASE_ORDER_OFFSET


class _Hold(ctypes.Structure):
    """After the pair (lease_table.h's lease_hold): how long the slot's holders keep it,
    folded in by each release; a waiter sleeps until just before the holder it found is
    likely to let go and is awake when it does. The native calls write and read it; this
    view lets the daemon carry it over to a moved segment. Any value outside (0,
    HOLD_MAX_NS] predicts nothing."""

    _fields_ = [("typical_ns", ctypes.c_uint64)]


_HOLD_OFFSET: Final[int] = _native.LEASE_HOLD_OFFSET
# Holds longer than this predict nothing (lease_table.h).
HOLD_MAX_NS: Final[int] = _native.LEASE_HOLD_MAX_NS


# mmap(2) and munmap(2) themselves: Python's mmap keeps a duplicate of the descriptor
# open for the mapping's life, one more per segment in every process that maps one.
_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class LeaseSegment:
    """A mapping of one graph pool's lease segment. ``create()`` makes a new one (the
    daemon); ``LeaseSegment(fd)`` maps one received over the fd channel (clients), and
    the descriptor may be closed then. The native calls take the raw ``address``: the
    mapping lives as long as this object, so whatever may still call them (a pool, a
    held lease) keeps a reference to it."""

    __slots__ = ("_slot", "_order", "_hold", "address", "inode")

    def __init__(self, fd: int) -> None:
        self.address: int = 0  # until mapped: what close() finds if this fails
        stat = os.fstat(fd)
        self.inode = stat.st_ino
        size = stat.st_size
        if size != SEGMENT_BYTES:
            raise ValueError(f"a lease segment is {SEGMENT_BYTES} bytes, this fd has {size}")
        address = _mmap(None, SEGMENT_BYTES, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping a lease segment failed: {os.strerror(err)}")
        self.address = address
        self._slot = _Slot.from_address(address)
        self._order = _Order.from_address(address + _ORDER_OFFSET)
        self._hold = _Hold.from_address(address + _HOLD_OFFSET)

    @classmethod
    def create(cls, pool_id: int) -> tuple[LeaseSegment, int]:
        """A fresh segment for graph pool ``pool_id`` and its memfd. Sealed against
        resizing: a client that truncated it would make the daemon's next access fault."""
        fd = os.memfd_create(f"{SEGMENT_NAME}{pool_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SEGMENT_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return cls(fd), fd
        except BaseException:
            os.close(fd)
            raise

    def adopt(self, old: LeaseSegment, word: int, handoff: int) -> None:
        """The daemon, on a segment it just created and granted to nobody yet: carry over
        ``old``'s lease ``word`` (with its holder's time and label), ``handoff``, release
        count and hold estimate, for the pool that moves here."""
        slot, before = self._slot, old._slot
        slot.futex = before.futex
        slot.handoff = handoff
        self._order.lane, self._order.value = old._order.lane, old._order.value
        self._hold.typical_ns = old._hold.typical_ns
        if word:
            slot.since_ns, slot.label = before.since_ns, before.label
            slot.word = word

    def same_memory(self, other: LeaseSegment) -> bool:
        """Whether both map one segment (one memfd)."""
        return self.inode == other.inode

    def try_acquire(self, word: int, epoch: int, label: bytes) -> int:
        """One attempt, no wait, the label recorded: the uncontended fast path (one
        compare-and-swap in one native call). OK or OK_ORDER when taken."""
        return _native.lease_try(self.address, word, epoch, label)

    def acquire(self, word: int, epoch: int, timeout_s: float, label: bytes | None = None) -> tuple[int, int]:
        """(status, word found). Waits up to ``timeout_s`` for a holder to let go (a
        bounded spin, then asleep on the futex); records ``label`` once taken."""
        return _native.lease_acquire(self.address, word, epoch, int(timeout_s * 1e9), label)

    def try_acquire_ordered(self, word: int, epoch: int, label: bytes, context: int, stream: int, events: dict[int, int]) -> int:
        """``try_acquire`` on a shared pool, with its GPU order in the same native call: told
        OK_ORDER, ``stream`` waits on the last releaser's event if ``events`` (by 24-bit
        session) has it, and the answer is OK_WAITED; OK_ORDER means it has not. ``context``
        is the driver's ``native_context()``. A try waits for nothing: RECORDING (the slot
        given back) while the last releaser's record is still in flight."""
        return _native.lease_try_ordered(self.address, word, epoch, label, context, stream, events)

    def acquire_ordered(
        self, word: int, epoch: int, timeout_s: float, label: bytes | None, context: int, stream: int, events: dict[int, int]
    ) -> tuple[int, int]:
        """``acquire``, ordered as ``try_acquire_ordered`` is; the take and the wait for the
        last releaser's record together last ``timeout_s`` at most (RECORDING: the record
        did not land within what the take left)."""
        return _native.lease_acquire_ordered(self.address, word, epoch, int(timeout_s * 1e9), label, context, stream, events)

    def try_acquire_memops(self, word: int, epoch: int, label: bytes, context: int, stream: int, lanes_address: int, lanes: int) -> int:
        """``try_acquire_ordered`` under memops ordering: told OK_ORDER, ``stream`` waits for
        the value the last releaser published on its lane of the sequence chunk mapped at
        ``lanes_address`` (OK_WAITED). With ``context`` 0 (work is synchronous) OK_WAITED
        says the word reached it already, OK_ORDER that it has not (the caller polls);
        OK when nothing was published, or on a lane outside the chunk's ``lanes``."""
        return _native.lease_try_memops(self.address, word, epoch, label, context, stream, lanes_address, lanes)

    def acquire_memops(
        self, word: int, epoch: int, timeout_s: float, label: bytes | None, context: int, stream: int, lanes_address: int, lanes: int
    ) -> tuple[int, int]:
        """``acquire_ordered`` under memops ordering, ordered as ``try_acquire_memops`` is."""
        return _native.lease_acquire_memops(self.address, word, epoch, int(timeout_s * 1e9), label, context, stream, lanes_address, lanes)

    def await_record(self, timeout_s: float = 0.0) -> tuple[int, int]:
        """(status, releaser) for a taker told OK_ORDER: the session to order after (0:
        none), once its record landed (OK); RECORDING if it did not within ``timeout_s``
        (0: whether it has landed now)."""
        return _native.lease_await_record(self.address, int(timeout_s * 1e9))

    def release(self, word: int) -> int:
        """OK, NOT_HOLDER, or RECORD (nothing released: a shared pool; record the IPC
        event, then ``release_recorded``)."""
        return _native.lease_release(self.address, word)

    def release_recorded(self, word: int) -> int:
        return _native.lease_release_recorded(self.address, word)

    def release_ordered(self, word: int, context: int, event: int, stream: int) -> int:
        """A holder's release in one native call: on a shared pool, the slot is freed
        with its handoff marked recording, ``event`` (the driver's ``native_event``) is
        recorded on ``stream`` and the mark ends. OK or NOT_HOLDER."""
        return _native.lease_release_ordered(self.address, word, context, event, stream)

    def publish_order(self, lane: int, value: int) -> None:
        """The holder, before it frees the slot: its stream writes ``value`` to sequence
        lane ``lane`` once the lease's work is done (memops ordering)."""
        self._order.lane, self._order.value = lane, value

    def order(self) -> tuple[int, int]:
        """(lane, value) the last memops releaser published; (0, 0) before any."""
        return int(self._order.lane), int(self._order.value)

    def clear(self, word: int) -> int:
        """Free the slot if it holds ``word``, without ordering: the daemon's sweep."""
        return _native.lease_clear(self.address, word)

    def set_escaped(self, session: int) -> None:
        """The daemon: refuse replay and capture while any session's borrowed tensors
        outlive their scope; the slot names one of them (0: none)."""
        _native.lease_set_escaped(self.address, word_session(session))

    def escaped(self) -> int:
        return int(self._slot.escaped)

    def handoff(self) -> int:
        """The field as it is: the last releaser's session, ``| HANDOFF_RECORDING`` while
        its record is being made."""
        return int(self._slot.handoff)

    def flags(self) -> LeaseFlag:
        return LeaseFlag(self._slot.flags)

    def set_flags(self, flags: int) -> None:
        _native.lease_set_flags(self.address, flags)

    def forget_handoff(self, session: int) -> None:
        """If ``session`` released last, forget it: its IPC event is gone, or it may no
        longer use the pool."""
        _native.lease_forget_handoff(self.address, word_session(session))

    def clear_handoff(self, seen: int) -> bool:
        """The daemon's repair: clear the handoff if it still holds ``seen``."""
        return _native.lease_clear_handoff(self.address, seen) == LeaseStatus.OK

    def peek(self) -> int:
        return _native.lease_peek(self.address)

    def set_epoch(self, epoch: int) -> None:
        _native.lease_set_epoch(self.address, epoch)

    def epoch(self) -> int:
        return int(self._slot.epoch)

    def set_label(self, label: str) -> None:
        self._slot.label = label.encode()[:LABEL_BYTES]

    def releases(self) -> int:
        """The slot's futex word, which every release (and every clear) bumps by one:
        leases ended on the slot, modulo 2**32. A segment is new at its pool's
        registration, so the count starts at 0; the daemon's metrics read it."""
        return int(self._slot.futex)

    def waiters(self) -> int:
        """Processes asleep on the slot right now, waiting for its holder to let go."""
        return int(self._slot.waiters)

    def holder(self) -> Holder | None:
        entry = self._slot
        word = int(entry.word)
        if word == 0:
            return None
        kind, session, pid = decode(word)
        return Holder(kind, session, pid, int(entry.since_ns), entry.label.decode(errors="replace"))

    def close(self) -> None:
        """Unmap now (only once nothing will call the native functions on it again).
        Reads find zeros from then on, and native calls a refused address."""
        address, self.address = self.address, 0
        if address:
            self._slot, self._order, self._hold = _Slot(), _Order(), _Hold()
            _munmap(address, SEGMENT_BYTES)

    def __del__(self) -> None:
        self.close()
