"""Capture / replay / borrow leases on registered graph pools.

    with session.replay(pool):                       # uncontended: one compare-and-swap
        graph.replay()
    with session.borrow(pool, user="EAGLE probability borrow", wait=0.05):
        ...

Each lease is exclusive: capture re-carves the pool's free space, a replay overwrites
whatever lies in its free runs, and a borrow puts tensors there. Taking and giving back
a lease touches only the pool's lease slot (no daemon round trip), in the segment of
shared memory the daemon granted this session with the pool (``GraphPool.segment``);
a conflict costs one status request, to name the holder. The daemon sweeps the leases
of a client that dies.

On a shared pool (one other processes open), a lease also orders GPU work at each
handoff, in the same native call as the compare-and-swap; the session's side of that,
and of every slow path (a pool moved to a fresh segment, an escaped borrow, naming the
holder), is ``SessionLeases`` (gpumem.handoffs).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from gpumem_shared import _native, lease_table
from gpumem_shared.lease_table import LeaseSegment, LeaseStatus
from gpumem.errors import InvalidArgument, LeaseConflict, LeaseNotHeld, StaleEpoch
from gpumem.handoffs import LeasePool, SessionLeases

# Module globals on the uncontended paths: before Python 3.12, reading an enum member off
# its class costs about 60 ns (EnumType.__getattr__ slows every attribute lookup on it).
_OK_ORDER, _OK_WAITED, _RECORD = LeaseStatus.OK_ORDER, LeaseStatus.OK_WAITED, LeaseStatus.RECORD
_RECORDING = LeaseStatus.RECORDING
_TAKEN = (LeaseStatus.OK, LeaseStatus.OK_ORDER, LeaseStatus.OK_WAITED)

# While a slot holds an impossible value, waiters retry this often: the daemon clears
# such a slot on its next tick.
_CORRUPT_RETRY_S = 0.01

# Moves of a pool to a fresh lease segment one acquire follows before it calls the pool
# stale (each move is one of the pool's users losing its right).
_FOLLOWS = 8

# torch's lookup of a device's current raw stream, once torch's CUDA is initialized in
# this process (it stays so).
_RAW_STREAM: list[Callable[[int], int]] = []


def current_stream(device: int | None) -> int:
    """The raw handle of the stream a lease orders: torch's current stream where this
    process uses torch on CUDA, else the default stream (0)."""
    if device is None:
        return 0
    if _RAW_STREAM:
        return _RAW_STREAM[0](device)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    # The raw handle without a Stream object (the call torch's generated code makes):
    # a borrow scope asks at every entry, and a release on a shared pool.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        cuda = torch.cuda
        raw = lambda index: int(cuda.current_stream(index).cuda_stream)  # noqa: E731
    _RAW_STREAM.append(raw)
    return raw(device)


class Lease:
    __slots__ = ("owner", "pool_id", "segment", "address", "kind", "_word", "held", "stream", "shared")

    def __init__(
        self, owner: SessionLeases, pool: LeasePool, segment: LeaseSegment, kind: int, word: int, stream: int | None, held: bool = True
    ) -> None:
        self.owner = owner
        self.pool_id: int = pool.id
        self.segment = segment  # kept mapped while the lease lives, whatever becomes of the pool object
        self.address = segment.address
        self.kind = kind
        self._word = word
        self.held = held
        self.stream = stream  # None: the current stream when it matters (a shared pool)
        self.shared: bool = pool.shared
        if held and pool.shared:
            owner.holding[pool.id] = self

    @classmethod
    def acquire(
        cls, owner: SessionLeases, pool: LeasePool, kind: int, label: str, wait: float, stream: int | None = None
    ) -> Lease:
        """Take ``kind`` on ``pool`` (a GraphPool of this session: registered or opened
        here) for the session ``owner`` belongs to (``session.leasing``)."""
        # The uncontended path is one native call; every line here is on it too. What a
        # refused first try needs lies in _contended.
        try:
            segment = pool.segment
        except AttributeError:
            raise InvalidArgument(
                f"{pool!r} is not a graph pool this session registered or opened: its lease slot is mapped only there"
            ) from None
        word = owner.words[kind]
        epoch = ((pool.id & 0xFFFF) << 16 | (pool.epoch & 0xFFFF)) or 1  # lease_table.lease_epoch, inlined
        if owner.escapes:
            owner.clear_escape(pool.id)
        order: tuple[Any, ...] | None = None
        if pool.shared:
            # The stream waits on the last releaser's event in the same native call as the
            # take, once that event is known here (memops: on the value it published).
            current = current_stream(owner.device_ordinal) if stream is None else stream
            if owner.lanes_count:
                order = (owner.context, current, owner.lanes_address, owner.lanes_count)
                status = _native.lease_try_memops(segment.address, word, epoch, label.encode(), *order)
            else:
                order = (owner.context, current, owner.waits_on(pool.id))
                status = _native.lease_try_ordered(segment.address, word, epoch, label.encode(), *order)
        else:
            status = owner.try_acquire(segment.address, word, epoch, label.encode())
        if not status:  # OK
            return cls(owner, pool, segment, kind, word, stream)
        if status in _TAKEN:
            return cls(owner, pool, segment, kind, word, stream)._ordered(status, label, wait)
        return cls._contended(owner, pool, segment, kind, word, epoch, label, wait, stream, order, status)

    @classmethod
    def _contended(
        cls,
        owner: SessionLeases,
        pool: LeasePool,
        segment: LeaseSegment,
        kind: int,
        word: int,
        epoch: int,
        label: str,
        wait: float,
        stream: int | None,
        order: tuple[Any, ...] | None,
        status: int,
    ) -> Lease:
        """``acquire`` past a refused first try (``status``): wait up to ``wait`` seconds
        for the slot, clearing an escape mark of this session's on the way, or raise
        saying why and naming the holder. Every wait inside (for the holder, for the last
        releaser's event record) comes out of ``wait``: a record still in flight refuses
        a ``wait=0`` take at once, as a held slot does."""
        deadline = time.monotonic() + wait
        encoded = label.encode()
        # Built before the wait: a waiter woken by a release runs on a core that slept,
        # where each line of Python costs several times its warm cost, and every line
        # between the wake and the return is on the handoff's path.
        lease = cls(owner, pool, segment, kind, word, stream, held=False)
        address = segment.address
        # The first try's kind of take: order is (context, stream, events), memops' (context, stream, lanes address, lanes).
        take = _native.lease_acquire if order is None else _native.lease_acquire_memops if owner.lanes_count else _native.lease_acquire_ordered
        follows = 0
        while True:
            if status == _RECORDING and time.monotonic() >= deadline:  # else wait what is left for the record
                raise owner.record_late(pool.id, segment, f"{lease_table.KIND_NAMES[kind]} lease '{label}'", wait)
            if status == LeaseStatus.ESCAPED:
                if not owner.clear_escape(pool.id):
                    error = owner.escape_error(pool, lease_table.KIND_NAMES[kind], label)
                    if error is not None:
                        raise error
                status = LeaseStatus.HELD  # the mark went meanwhile: try again
                continue
            timeout_ns = max(0, int((deadline - time.monotonic()) * 1e9))
            status, found = take(address, word, epoch, timeout_ns, encoded, *(order or ()))
            if status in _TAKEN:
                lease.held = True
                if lease.shared:
                    owner.holding[pool.id] = lease
                return lease._ordered(status, label, wait, deadline)
            if status == LeaseStatus.ESCAPED or status == _RECORDING:
                continue
            if status == LeaseStatus.STALE:
                follows += 1  # each move is a user losing its right: a handful at most in one wait
                # Another thread may have followed the pool already.
                if follows <= _FOLLOWS and segment.epoch() == 0 and (pool.segment is not segment or owner.follow(pool)):
                    segment = lease.segment = pool.segment
                    address = lease.address = segment.address
                    continue
                raise StaleEpoch(
                    f"graph pool {pool.id} changed since this view of it (epoch {pool.epoch}): it was recaptured or "
                    "retired; refresh it (GraphPool.refresh or the daemon's status) and try again"
                )
            if status == LeaseStatus.CORRUPT and time.monotonic() < deadline:
                time.sleep(_CORRUPT_RETRY_S)
                continue
            raise cls._conflict(owner, pool, kind, label, found, wait, status == LeaseStatus.CORRUPT)

    @staticmethod
    def _conflict(owner: SessionLeases, pool: LeasePool, kind: int, label: str, found: int, wait: float, corrupt: bool) -> LeaseConflict:
        want = lease_table.KIND_NAMES[kind]
        if corrupt:
            return LeaseConflict(
                f"{want} lease on graph pool {pool.id}: its slot holds an impossible value ({found:#x}); gpumemd clears "
                "such slots within a tick; retry with wait > 0"
            )
        holder = pool.segment.holder()
        h_kind, h_session, h_pid = lease_table.decode(found)
        if holder is not None and lease_table.encode(holder.kind, holder.session, holder.pid) != found:
            holder = None  # the lease changed hands since: that label and time are another holder's
        name = f"session {h_session}"
        for entry in owner.status().leases:  # the slow path only: name the holder
            if entry.pool_id == pool.id and entry.pid == h_pid and entry.kind == lease_table.KIND_NAMES.get(h_kind):
                name = entry.holder
        since = time.strftime("%H:%M:%S", time.localtime(holder.since_ns / 1e9)) if holder else "?"
        held_label = holder.label if holder else ""
        waited = f" after waiting {wait:g}s" if wait else ""
        return LeaseConflict(
            f"{want} lease '{label}' on graph pool {pool.id} refused{waited}: client '{name}' (pid {h_pid}) holds its "
            f"{lease_table.KIND_NAMES.get(h_kind, h_kind)} lease '{held_label}' since {since}",
            {"holder": name, "pid": h_pid, "kind": lease_table.KIND_NAMES.get(h_kind, str(h_kind)), "label": held_label},
        )

    def _ordered(self, status: int, label: str, wait: float, deadline: float | None = None) -> Lease:
        """The lease was taken with ``status``: OK_WAITED, the stream waits on the last
        releaser's event already; OK_ORDER, it must wait on one not known here yet, its
        record waited for within what is left of ``wait`` (all of it without a
        ``deadline``: nothing was waited for yet)."""
        if status == _OK_WAITED:
            self.owner.handoff_waits += 1
            return self
        if status != _OK_ORDER:
            return self
        left = wait if deadline is None else deadline - time.monotonic()
        lease = f"{lease_table.KIND_NAMES[self.kind]} lease '{label}'"
        try:
            self.owner.wait_for_handoff(self.pool_id, self.segment, self._stream(), lease, wait, left)
        except BaseException:
            self.held = False
            self.segment.clear(self._word)
            raise
        return self

    def _stream(self) -> int:
        return current_stream(self.owner.device_ordinal) if self.stream is None else self.stream

    def release(self) -> None:
        if not self.held:
            raise LeaseNotHeld(f"{lease_table.KIND_NAMES[self.kind]} lease on graph pool {self.pool_id} was already released")
        self.held = False
        owner = self.owner
        if self.shared:
            # The next holder may be another process, asleep until the native call below
            # wakes it: this path is kept to one frame, with the event (or lane) looked up inline.
            event = owner.recording.get(self.pool_id)
            stream = current_stream(owner.device_ordinal) if self.stream is None else self.stream
            if event is not None:
                status = _native.lease_release_ordered(self.address, self._word, owner.context, event, stream)
            elif (lane := owner.lanes.get(self.pool_id)) is not None:  # memops ordering: the lane's next value written
                status = _native.lease_release_memops(self.address, self._word, owner.context, lane.address, stream)
            else:  # the first release on the pool: creates and publishes the event
                status = owner.release_shared(self.pool_id, self.segment, self._word, stream)
            if status and self.segment.epoch() == 0 and owner.release_moved(self.pool_id, self._word, stream):
                status = 0  # the pool moved while held: given back where it went
        else:
            status = owner.try_release(self.address, self._word)
            if status == _RECORD:  # a slot flagged shared behind a private view of the pool
                status = owner.release_shared(self.pool_id, self.segment, self._word, self._stream())
        if status != LeaseStatus.OK:
            raise LeaseNotHeld(
                f"{lease_table.KIND_NAMES[self.kind]} lease on graph pool {self.pool_id} was no longer held at release: "
                "gpumemd swept it (the pool was retired, or its slot was repaired)"
            )

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        # release() inlined for a private pool's uncontended case: this is on every step's path.
        if self.held and not self.shared and not self.owner.try_release(self.address, self._word):
            self.held = False
            return
        self.release()

    def __repr__(self) -> str:
        return f"<gpumem.Lease {lease_table.KIND_NAMES[self.kind]} on graph pool {self.pool_id}{'' if self.held else ' (released)'}>"
