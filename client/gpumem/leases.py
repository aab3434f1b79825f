"""Capture / replay / borrow leases on registered graph pools.

    with session.replay(pool):                       # uncontended: one compare-and-swap
        graph.replay()
    with session.borrow(pool, user="EAGLE probability borrow", wait=0.05):
        ...

Each lease is exclusive: capture re-carves the pool's free space, a replay overwrites
whatever lies in its free runs, and a borrow puts tensors there. Taking and giving back
a lease touches only the shared lease table (no daemon round trip); a conflict costs one
status request, to name the holder. The daemon sweeps the leases of a client that dies.

On a shared pool (one other processes open), a lease also orders GPU work: every release
records the holder's IPC event on its stream, and a holder from another session makes its
stream wait on that event before it touches the pool. The first release publishes the
event's handle to the daemon and the first wait on a peer looks it up: one round trip
each, once. A private pool records nothing. Within one session nothing is waited on:
work on one stream is ordered by the stream, and replaying on one stream while borrowing
on another is the caller's to order (a borrow takes ``stream=``).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from gpumem_shared import lease_table
from gpumem_shared.lease_table import LeaseStatus
from gpumem.errors import InvalidArgument, LeaseConflict, LeaseNotHeld, StaleEpoch

if TYPE_CHECKING:
    from gpumem.session import Session

_SLOTS = lease_table.SLOTS
# Module globals on the uncontended paths: before Python 3.12, reading an enum member off
# its class costs about 60 ns (EnumType.__getattr__ slows every attribute lookup on it).
_OK, _OK_ORDER, _RECORD = LeaseStatus.OK, LeaseStatus.OK_ORDER, LeaseStatus.RECORD

# While a slot holds an impossible value, waiters retry this often: the daemon clears
# such a slot on its next tick.
_CORRUPT_RETRY_S = 0.01


def current_stream(device: int | None) -> int:
    """The raw handle of the stream a lease orders: torch's current stream where this
    process uses torch on CUDA, else the default stream (0)."""
    torch = sys.modules.get("torch")
    if device is None or torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.current_stream(device).cuda_stream)


class Lease:
    __slots__ = ("session", "pool_id", "slot", "kind", "_word", "held", "stream")

    def __init__(self, session: Session, pool: Any, kind: int, word: int, stream: int | None) -> None:
        self.session = session
        self.pool_id: int = pool.id
        self.slot: int = pool.slot
        self.kind = kind
        self._word = word
        self.held = True
        self.stream = stream  # None: the current stream when it matters (a shared pool)

    @classmethod
    def acquire(cls, session: Session, pool: Any, kind: int, label: str, wait: float, stream: int | None = None) -> Lease:
        # The uncontended path is one native call; every line before it is on it too.
        slot = pool.slot
        if not 0 < slot < _SLOTS:
            raise InvalidArgument(f"graph pool {pool.id} has no lease slot ({slot}); is it registered?")
        table = session.leases
        word = session.lease_words[kind]
        epoch = ((pool.id & 0xFFFF) << 16 | (pool.epoch & 0xFFFF)) or 1  # lease_table.lease_epoch, inlined
        if session.borrow_escapes:
            session.clear_escape(slot)
        status = table._try(table.address, slot, word, epoch, label.encode())
        if not status:  # OK
            return cls(session, pool, kind, word, stream)
        if status == _OK_ORDER:
            return cls(session, pool, kind, word, stream)._ordered()
        deadline = time.monotonic() + wait
        while True:
            if status == LeaseStatus.ESCAPED:
                if not session.clear_escape(slot):
                    error = session.escape_error(pool, lease_table.KIND_NAMES[kind], label)
                    if error is not None:
                        raise error
                status = LeaseStatus.HELD  # the mark went meanwhile: try again
                continue
            status, found = table.acquire(pool.slot, word, epoch, max(0.0, deadline - time.monotonic()))
            if status in (LeaseStatus.OK, LeaseStatus.OK_ORDER):
                table.set_label(pool.slot, label)
                lease = cls(session, pool, kind, word, stream)
                return lease._ordered() if status == LeaseStatus.OK_ORDER else lease
            if status == LeaseStatus.ESCAPED:
                continue
            if status == LeaseStatus.STALE:
                raise StaleEpoch(
                    f"graph pool {pool.id} changed since this view of it (epoch {pool.epoch}): it was recaptured or "
                    "retired; refresh it (GraphPool.refresh or the daemon's status) and try again"
                )
            if status == LeaseStatus.CORRUPT and time.monotonic() < deadline:
                time.sleep(_CORRUPT_RETRY_S)
                continue
            raise cls._conflict(session, pool, kind, label, found, wait, status == LeaseStatus.CORRUPT)

    @staticmethod
    def _conflict(session: Session, pool: Any, kind: int, label: str, found: int, wait: float, corrupt: bool) -> LeaseConflict:
        want = lease_table.KIND_NAMES[kind]
        if corrupt:
            return LeaseConflict(
                f"{want} lease on graph pool {pool.id}: its slot holds an impossible value ({found:#x}); gpumemd clears "
                "such slots within a tick; retry with wait > 0"
            )
        holder = session.leases.holder(pool.slot)
        h_kind, h_session, h_pid = lease_table.decode(found)
        if holder is not None and lease_table.encode(holder.kind, holder.session, holder.pid) != found:
            holder = None  # the lease changed hands since: that label and time are another holder's
        name = f"session {h_session}"
        for entry in session.status().leases:  # the slow path only: name the holder
            if entry.slot == pool.slot and entry.pid == h_pid and entry.kind == lease_table.KIND_NAMES.get(h_kind):
                name = entry.holder
        since = time.strftime("%H:%M:%S", time.localtime(holder.since_ns / 1e9)) if holder else "?"
        held_label = holder.label if holder else ""
        waited = f" after waiting {wait:g}s" if wait else ""
        return LeaseConflict(
            f"{want} lease '{label}' on graph pool {pool.id} refused{waited}: client '{name}' (pid {h_pid}) holds its "
            f"{lease_table.KIND_NAMES.get(h_kind, h_kind)} lease '{held_label}' since {since}",
            {"holder": name, "pid": h_pid, "kind": lease_table.KIND_NAMES.get(h_kind, str(h_kind)), "label": held_label},
        )

    def _ordered(self) -> Lease:
        """The lease came from another process: order this stream after its release."""
        try:
            self.session.wait_for_handoff(self.pool_id, self.slot, self._stream())
        except BaseException:
            self.held = False
            self.session.leases.clear(self.slot, self._word)
            raise
        return self

    def _stream(self) -> int:
        return current_stream(self.session.device_ordinal) if self.stream is None else self.stream

    def release(self) -> None:
        if not self.held:
            raise LeaseNotHeld(f"{lease_table.KIND_NAMES[self.kind]} lease on graph pool {self.pool_id} was already released")
        self.held = False
        table = self.session.leases
        status = table._release(table.address, self.slot, self._word)
        if not status:  # OK: the uncontended path
            return
        if status == _RECORD:  # a shared pool: the next holder may be another process
            try:
                self.session.record_handoff(self.pool_id, self._stream())
            except BaseException:
                table.clear(self.slot, self._word)
                raise
            status = table.release_recorded(self.slot, self._word)
        if status != _OK:
            raise LeaseNotHeld(
                f"{lease_table.KIND_NAMES[self.kind]} lease on graph pool {self.pool_id} was no longer held at release: "
                "gpumemd swept it (the pool was retired, or the table was repaired)"
            )

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        # release() inlined for its uncontended case: this is on every step's path.
        if self.held:
            table = self.session.leases
            if not table._release(table.address, self.slot, self._word):
                self.held = False
                return
        self.release()

    def __repr__(self) -> str:
        return f"<gpumem.Lease {lease_table.KIND_NAMES[self.kind]} on graph pool {self.pool_id}{'' if self.held else ' (released)'}>"
