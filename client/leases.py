"""Capture / replay / borrow leases on registered graph pools.

    with session.replay(pool):                       # uncontended: one compare-and-swap
        graph.replay()
    with session.borrow(pool, user="EAGLE probability borrow", wait=0.05):
        ...

Each lease is exclusive: capture re-carves the pool's free space, a replay overwrites
whatever lies in its free runs, and a borrow puts tensors there. Taking and giving back
a lease touches only the shared lease table (no daemon round trip); a conflict costs one
status request, to name the holder. The daemon sweeps the leases of a client that dies.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gpumem_shared import leases
from gpumem.errors import InvalidArgument, LeaseConflict, LeaseNotHeld, StaleEpoch

if TYPE_CHECKING:
    from gpumem.session import Session

# While a slot holds an impossible value, waiters retry this often: the daemon clears
# such a slot on its next tick.
_CORRUPT_RETRY_S = 0.01


class Lease:
    __slots__ = ("session", "pool_id", "slot", "kind", "_word", "held")

    def __init__(self, session: Session, pool: Any, kind: int, word: int) -> None:
        self.session = session
        self.pool_id: int = pool.id
        self.slot: int = pool.slot
        self.kind = kind
        self._word = word
        self.held = True

    @classmethod
    def acquire(cls, session: Session, pool: Any, kind: int, label: str, wait: float) -> Lease:
        if not 0 < pool.slot < leases.SLOTS:
            raise InvalidArgument(f"graph pool {pool.id} has no lease slot ({pool.slot}); is it registered?")
        table = session.leases
        word = session.lease_words[kind]
        epoch = leases.lease_epoch(pool.id, pool.epoch)
        if table.try_acquire(pool.slot, word, epoch, label.encode()):  # the uncontended path
            return cls(session, pool, kind, word)
        deadline = time.monotonic() + wait
        while True:
            status, found = table.acquire(pool.slot, word, epoch, max(0.0, deadline - time.monotonic()))
            if status == leases.OK:
                table.set_label(pool.slot, label)
                return cls(session, pool, kind, word)
            if status == leases.STALE:
                raise StaleEpoch(
                    f"graph pool {pool.id} changed since this view of it (epoch {pool.epoch}): it was recaptured or "
                    "retired; refresh it (GraphPool.refresh or the daemon's status) and try again"
                )
            if status == leases.CORRUPT and time.monotonic() < deadline:
                time.sleep(_CORRUPT_RETRY_S)
                continue
            raise cls._conflict(session, pool, kind, label, found, wait, status == leases.CORRUPT)

    @staticmethod
    def _conflict(session: Session, pool: Any, kind: int, label: str, found: int, wait: float, corrupt: bool) -> LeaseConflict:
        want = leases.KIND_NAMES[kind]
        if corrupt:
            return LeaseConflict(
                f"{want} lease on graph pool {pool.id}: its slot holds an impossible value ({found:#x}); gpumemd clears "
                "such slots within a tick; retry with wait > 0"
            )
        holder = session.leases.holder(pool.slot)
        h_kind, h_session, h_pid = leases.decode(found)
        if holder is not None and leases.encode(holder.kind, holder.session, holder.pid) != found:
            holder = None  # the lease changed hands since: that label and time are another holder's
        name = f"session {h_session}"
        for entry in session.status().leases:  # the slow path only: name the holder
            if entry.slot == pool.slot and entry.pid == h_pid and entry.kind == leases.KIND_NAMES.get(h_kind):
                name = entry.holder
        since = time.strftime("%H:%M:%S", time.localtime(holder.since_ns / 1e9)) if holder else "?"
        held_label = holder.label if holder else ""
        waited = f" after waiting {wait:g}s" if wait else ""
        return LeaseConflict(
            f"{want} lease '{label}' on graph pool {pool.id} refused{waited}: client '{name}' (pid {h_pid}) holds its "
            f"{leases.KIND_NAMES.get(h_kind, h_kind)} lease '{held_label}' since {since}",
            {"holder": name, "pid": h_pid, "kind": leases.KIND_NAMES.get(h_kind, str(h_kind)), "label": held_label},
        )

    def release(self) -> None:
        if not self.held:
            raise LeaseNotHeld(f"{leases.KIND_NAMES[self.kind]} lease on graph pool {self.pool_id} was already released")
        self.held = False
        if self.session.leases.release(self.slot, self._word) != leases.OK:
            raise LeaseNotHeld(
                f"{leases.KIND_NAMES[self.kind]} lease on graph pool {self.pool_id} was no longer held at release: "
                "gpumemd swept it (the pool was retired, or the table was repaired)"
            )

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<gpumem.Lease {leases.KIND_NAMES[self.kind]} on graph pool {self.pool_id}{'' if self.held else ' (released)'}>"
