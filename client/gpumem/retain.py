"""Retained memory, the client's side: keep a KV pool (and what goes with it) across the
engine's death, and take it over in another process at the same addresses.

    group = session.retain_group("engine-a")          # the daemon grants the group's secret
    group.retain(kv.pool)                             # and the prefix directory, the weights...
    hand group.secret to the standby (out of band: a file only its user reads, an env var)

    # the standby, once the engine died (waits up to 30 s for the daemon to let it):
    adopted = session.adopt("engine-a", secret, wait=30.0)
    pool = adopted.kv_pools["engine-a-kv"]            # same addresses, same rows, now its own

The daemon keeps the retained objects of a session that ended without releasing them
(orphaned, until ``gpumemd --retain-grace``), and hands them to a session of the same uid
that gives the secret, once the dead process can no longer write them (fenced). ``adopt``
maps everything, then confirms; an adopter that dies before confirming gives the group
back to the orphaned state with its deadline unchanged. An ordinary ``release`` or
``close`` releases retained objects as any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem.arena import Arena
from gpumem.errors import DaemonTimeout
from gpumem.kv_pool import KvPool
from gpumem.paged_kv import PagedKvCache
from gpumem.prefix_directory import PrefixDirectory

if TYPE_CHECKING:
    from gpumem.core import SessionCore
    from gpumem.standby import Reservation

Retainable = Arena | KvPool | PagedKvCache | PrefixDirectory

# Past the wait the daemon was given, how long its answer may take to come.
_ANSWER_S = 10.0


def _arena_name(obj: Retainable) -> str:
    if isinstance(obj, PagedKvCache):
        return obj.pool.name
    if isinstance(obj, PrefixDirectory):
        return obj.arena.name
    return obj.name


class RetainGroup:
    """A retain group this session holds: ``secret`` lets another process adopt it."""

    def __init__(self, core: SessionCore, name: str, secret: str) -> None:
        self.core = core
        self.name = name
        self.secret = secret

    @classmethod
    def open(cls, core: SessionCore, name: str) -> RetainGroup:
        reply: p.RetainGroupReply = core.call(p.RetainGroup(group=name))
        return cls(core, reply.group, reply.secret)

    def retain(self, *objects: Retainable) -> None:
        """Keep these (arenas, KV pools or caches, prefix directories this session owns)
        for the group if this session ends without releasing them."""
        for obj in objects:
            self.core.call(p.Retain(group=self.name, name=_arena_name(obj)))

    def unretain(self, *objects: Retainable) -> None:
        for obj in objects:
            self.core.call(p.Retain(group=self.name, name=_arena_name(obj), retained=False))

    def __repr__(self) -> str:
        return f"<gpumem.RetainGroup '{self.name}'>"


class Adopted:
    """What an adoption mapped in this process: the group (now held by this session), its
    plain arenas and its KV pools by name, and who held them before."""

    def __init__(self, core: SessionCore, reply: p.AdoptReply, secret: str) -> None:
        self.core = core
        self.group = RetainGroup(core, reply.group, secret)
        self.previous = reply.previous
        self.waited_for = reply.waited_for  # every dead writer the adoption waited out (1.13; [] from an older daemon)
        self.deadline_in_s = reply.deadline_in_s
        self.arenas: dict[str, Arena] = {}
        self.kv_pools: dict[str, KvPool] = {}
        self.confirmed = False

    def confirm(self) -> None:
        """The group is this session's for good (a later death orphans it afresh). Until
        then this process's death gives it back as it was before the adoption."""
        self.core.call(p.AdoptDone(group=self.group.name))
        self.confirmed = True

    def __repr__(self) -> str:
        return f"<gpumem.Adopted '{self.group.name}' from {self.previous}: {sorted(self.arenas)} {sorted(self.kv_pools)}>"


def adopt(
    core: SessionCore, group: str, secret: str, *, wait: float = 0.0, confirm: bool = True, reservation: Reservation | None = None
) -> Adopted:
    """``Session.adopt``: take over retain group ``group`` with its ``secret``. While
    its holder still lives (``GroupHeld``) or may still write (``NotFenced``), the daemon
    holds its answer for up to ``wait`` seconds (one request: it answers once the group
    is adoptable), then raises that error (which names the holder or the pid); at once
    where another adopter took it first (``GroupHeld`` naming it). Maps every object at its addresses; ``confirm`` (the default) then tells the
    daemon, or call ``Adopted.confirm()`` once the engine checked what it got.
    ``reservation`` (gpumem.standby): the windows this process backed with its
    placeholder; each is swapped for the adopted chunks at the same addresses, and a KV
    pool's uncommitted rows get the placeholder again (its own now), so what was captured
    against the reservation replays on the adopted memory."""
    try:
        reply, fds = core.channel.call(p.Adopt(group=group, secret=secret, wait=wait), timeout=wait + _ANSWER_S if wait else None)
    except DaemonTimeout as exc:
        raise DaemonTimeout(
            f"gpumemd did not answer the adoption of retain group '{group}' within the {wait:g}s it may wait and "
            f"{_ANSWER_S:g}s more: check that gpumemd runs and answers (gpumemctl status, gpumemctl retained) and its log ({exc})"
        ) from None
    adopted = Adopted(core, reply, secret)
    waiting = [(obj, {c.id: fds.pop(c.id) for c in obj.chunks if c.id in fds}) for obj in reply.objects]
    fdchannel.close_all(list(fds.values()))  # none expected beyond the objects' chunks
    try:
        while waiting:
            obj, mine = waiting.pop(0)
            _map(core, adopted, obj, mine, reservation)
    finally:
        for _, rest in waiting:  # a failed mapping stops the others: their fds go
            fdchannel.close_all(list(rest.values()))
    if confirm:
        adopted.confirm()
    return adopted


def _map(core: SessionCore, adopted: Adopted, obj: p.AdoptedObject, fds: dict[int, int], reservation: Reservation | None) -> None:
    """One adopted object mapped here at its window, its chunks handed in ``fds`` (this
    function owns them), in place of the reservation's placeholder there."""
    pool = KvPool(core, obj.kv) if obj.kv is not None else None
    arena = pool.arena if pool is not None else Arena(core, obj.arena, owner=True)
    try:
        reserved = reservation is not None and reservation.vacate(arena.name)
        arena.reserve_window()
    except BaseException:
        fdchannel.close_all(list(fds.values()))
        raise
    core.add_arena(arena)
    arena.apply(p.MapReply(arena=obj.arena, chunks=obj.chunks, retired=[], fd_batches=0), fds)
    if pool is not None and reserved and reservation is not None:
        pool.placeholder(reservation.slot_bytes)
    if pool is not None:
        adopted.kv_pools[pool.name] = pool
    else:
        adopted.arenas[arena.name] = arena
