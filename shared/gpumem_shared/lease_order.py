"""Ordering GPU work across a lease handoff with stream memory operations (``memops``),
the alternative to CUDA IPC events (``ipc-events``), which need a shared IPC namespace
(``hostIPC`` in Kubernetes).

The daemon owns one sequence chunk per device: device memory on CUDA (a VMM chunk it
exports like any other, each session maps it through the fd channel), plain shared
memory on the host backend. It holds 64-bit words, one lane per (graph pool, user
session): only that session's streams write it (``cuStreamWriteValue64`` at each of its
releases of that pool), and the daemon writes it once more when the session goes.

A release on a shared pool takes the next value of the releaser's lane, publishes the
(lane, value) pair in the lease segment, frees the slot marked recording (as an IPC-event
release does: the waiter wakes meanwhile), enqueues the write of that value on its stream
(after the work the lease covered) and ends the mark. A taker from another session waits
for the mark to go, reads the pair and makes its stream wait until the lane reaches the
value (``cuStreamWaitValue64``, cyclic greater-or-equal), in the same native call as its
take. A write that fails to queue ends the mark naming nobody: no taker waits for it. A
value is never written twice on a lane, and values only grow, so an old value never
satisfies a newer wait:

- a lane's values are ``generation << SEQ_BITS | n``, n counting the releases from 1;
  the daemon bumps the generation each time it hands the lane to a new session, so a
  new holder of a lane starts above whatever the last one wrote;
- one session releasing one pool from two streams would let the second write land
  first and the first write then lower the word: a releaser whose stream differs from
  its last release's first waits (on that stream) for its previous value, so the lane's
  writes land in order. Two pools never share a lane, so no pool's releases wait on
  another's.

A releaser that dies between taking a value and its stream writing it (or whose context
dies with the write queued) would leave a taker's stream waiting forever. The daemon,
which sweeps a dead session's leases, writes the lane's ``swept`` value, the top of the
generation: every value the session could have published is reached, and the next
generation starts above it. The taker's stream is then held only until the daemon's
sweep (its tick), never indefinitely.

Which ordering a daemon uses is its operator's explicit choice (``gpumemd
--lease-ordering``); ``ipc-events`` stays the default until the H200 measures memops.
A device without 64-bit stream memory operations refuses ``memops`` at start, naming the
attribute; nothing falls back silently.
"""

from __future__ import annotations

import ctypes
import enum
import time
from typing import Final

from gpumem_shared import _native
from gpumem_shared.driver.base import DriverError
from gpumem_shared.lease_table import LeaseSegment

WORD_BYTES: Final[int] = 8
# The id the sequence chunk's fd carries in a graph pool grant's fd batch (pool ids start at 1).
CHUNK_GRANT_ID: Final[int] = 0
# Releases one session may make of one pool before its lane wraps into the next
# generation: 2**40, a million releases a second for twelve days.
SEQ_BITS: Final[int] = _native.LEASE_SEQ_BITS
SEQ_MASK: Final[int] = (1 << SEQ_BITS) - 1
GENERATIONS: Final[int] = 1 << (64 - SEQ_BITS)
_U64: Final[int] = (1 << 64) - 1


class LeaseOrderLate(DriverError):
    """A taker's wait for its releaser's value did not end within its bound (where work
    is synchronous, so the wait is the taker's own)."""


class LeaseOrdering(enum.Enum):
    """How a handoff on a shared pool orders the taker's GPU work after the releaser's."""

    IPC_EVENTS = "ipc-events"
    MEMOPS = "memops"


def reached(word: int, target: int) -> bool:
    """Whether a lane holding ``word`` satisfies a wait for ``target``: the cyclic
    greater-or-equal ``cuStreamWaitValue64`` applies by default, ``(int64)(word - target)
    >= 0``."""
    return ((word - target) & _U64) < (1 << 63)


class _LaneState(ctypes.Structure):
    """lease_table.h's lease_lane: what the native release reads and updates."""

    _fields_ = [
        ("word", ctypes.c_uint64),
        ("last", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("lane", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class ReleaserLane:
    """A session's side of one lane: the values its releases of the pool publish. The
    count lives in memory the native release updates (``address``), so that a release is
    one native call, as under IPC events."""

    __slots__ = ("index", "base", "state", "address")

    def __init__(self, index: int, base: int, lanes_address: int) -> None:
        self.index = index
        self.base = base  # this session's generation on the lane, shifted: the daemon's grant
        self.state = _LaneState(word=lanes_address + index * WORD_BYTES, last=base, lane=index)
        self.address = ctypes.addressof(self.state)

    def release(self, context: int, segment_address: int, word: int, stream: int) -> int:
        """Give back the lease ``word`` holds on the pool whose lease segment is mapped at
        ``segment_address``, its work ordered by this lane, in one native call
        (``lease_release_memops``: the value written after that work on ``stream``; the
        taker is woken first). OK or NOT_HOLDER; a driver failure raises with the slot
        freed and no taker ordered after the write that failed, which is not counted: no
        later release waits for a value nobody writes. ``context`` is the driver's
        ``native_context()``; ``Lease.release`` makes the same call inline."""
        return _native.lease_release_memops(segment_address, word, context, self.address, stream)


def order_after(context: int, segment: LeaseSegment, lanes_address: int, lanes: int, stream: int, timeout_s: float) -> int | None:
    """For a taker told OK_ORDER by a take that did not wait (the memops takes, which wait
    in the same native call, answer OK_WAITED instead, except where work is synchronous
    and the word has not reached the value yet): ``stream`` waits for the last releaser's
    published value on its lane. Returns the value waited for (None: nothing published,
    or a lane outside the chunk, which no daemon grants: a forged order names nothing to
    wait for). Where work is synchronous (the host backend, ``context`` 0) the wait is
    here: a bounded poll of the word."""
    value, waited = _native.lease_order_wait(segment.address, context, lanes_address, lanes, stream)
    if not value:
        return None
    if not waited:
        lane, _ = segment.order()
        _poll(lanes_address + lane * WORD_BYTES, value, timeout_s)
    return value


def _poll(address: int, value: int, timeout_s: float) -> None:
    word = ctypes.c_uint64.from_address(address)
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not reached(word.value, value):
        if time.monotonic() >= deadline:
            raise LeaseOrderLate(
                f"the sequence word at {address:#x} holds {word.value:#x}, not {value:#x}, after {timeout_s:g}s: its "
                "releaser took the value and never wrote it (gpumemd writes a dead releaser's lane at its sweep)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class LaneBook:
    """The daemon's side: which session writes which lane of the sequence chunk, for which
    graph pool, and each lane's generation. Plain state; the caller writes the words."""

    def __init__(self, lanes: int) -> None:
        if lanes <= 0:
            raise ValueError("a sequence chunk holds at least one lane")
        self.lanes = lanes
        self._generation = [0] * lanes  # the generation the lane's last holder had
        self._free = list(range(lanes - 1, -1, -1))
        self._held: dict[tuple[int, int], int] = {}  # (pool id, session id) -> lane

    def grant(self, pool_id: int, session_id: int) -> tuple[int, int]:
        """(lane, base) for ``session_id``'s releases of ``pool_id``: the same lane for as
        long as it may use the pool. The lane's last holder was swept (``release``
        wrote its ``swept`` value), so the new generation starts above all it wrote."""
        key = (pool_id, session_id)
        lane = self._held.get(key)
        if lane is None:
            if not self._free:
                raise LookupError(f"all {self.lanes} lease ordering lanes are in use")
            lane = self._held[key] = self._free.pop()
            self._generation[lane] = (self._generation[lane] + 1) % GENERATIONS
        return lane, self._generation[lane] << SEQ_BITS

    def lane(self, pool_id: int, session_id: int) -> int | None:
        return self._held.get((pool_id, session_id))

    def in_use(self) -> int:
        """Lanes not free for a new holder: held, or released and not settled yet."""
        return self.lanes - len(self._free)

    def release(self, pool_id: int, session_id: int) -> tuple[int, int] | None:
        """``session_id`` may no longer use ``pool_id`` (it ended, or lost its right):
        (lane, value) the daemon writes there so no taker's stream waits on the lane
        past now, or None when it held none. The lane is not handed out again until
        ``settle``: a write the session queued may still land and lower the word below
        the swept value, which the next holder's values must not meet."""
        lane = self._held.pop((pool_id, session_id), None)
        if lane is None:
            return None
        return lane, swept(self._generation[lane] << SEQ_BITS)

    def settle(self, lane: int) -> None:
        """Nothing of the lane's last holder can land any more (its process is fenced),
        and the daemon wrote the swept value after that: the lane may go to a new holder."""
        self._free.append(lane)


def swept(base: int) -> int:
    """The value the daemon writes on a lane whose holder (generation ``base``) went:
    reaches every value of that generation, below every value of the next."""
    return base | SEQ_MASK
