"""Each daemon's address slice, reserved once in this process.

Every process maps an arena at the address its daemon planned (graph-pool extents
rely on it). A driver reservation per arena at that address is not reliable: the CUDA
driver treats the address as a hint, and with several processes creating, attaching
and releasing arenas it often places the reservation elsewhere (seen on an H200). So a
process reserves the daemon's whole slice of the plan (gpumem_shared.address_plan)
once, when one of its sessions with that daemon needs its first arena, and maps every
arena of that daemon inside it. The sessions of one daemon in a process share the
reservation; the last of them to close frees it. A peer daemon's slice is another
range, reserved beside it.

An arena's address is the same for every session, so a process maps each arena once:
a second session's mapping would land on the first one's (CUDA refuses it with
CUDA_ERROR_INVALID_VALUE; the host backend's mmap silently replaces it, read-only
even, and either session's release unmaps the other's). The slice records which
session maps each arena; another session of the process asking for it is refused.

A standby (gpumem.standby) backs the windows of a retain group's arenas with its own
placeholder before it adopts them; the slice records those windows too, as the
standby's claim, and no arena of the process is mapped over them until the adoption
maps the group's arenas there or the standby closes: were the group released meanwhile
and its windows planned again, a new arena would share bytes with the placeholder the
standby's graphs were captured on.
"""

from __future__ import annotations

import dataclasses
import threading

from gpumem_shared.address_plan import plan_range
from gpumem_shared.driver import Driver, DriverError
from gpumem.errors import MappingError, VaCollision


@dataclasses.dataclass(eq=False)
class AddressSlice:
    base: int
    size: int
    daemon: str  # the daemon whose arenas live here, as collisions name it
    driver: Driver  # the one that reserved it, and frees it
    holders: int = 0  # sessions of this process that map arenas here
    # Arena name -> (session id, client name) of the one session of this process mapping it.
    mapped: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    # Standbys' windows, by (session id, retain group): see StandbyClaim.
    standbys: dict[tuple[int, str], StandbyClaim] = dataclasses.field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.base + self.size


@dataclasses.dataclass(eq=False)
class StandbyClaim:
    """The windows of retain group ``group``'s arenas that session ``session_id`` of this
    process backs with a standby's placeholder (gpumem.standby), by arena name: no arena
    of the process is mapped over one until the adoption maps the group's arena there
    (``vacate``) or the standby closes (``drop``). Plain data: the session's core keeps
    the standby itself."""

    held: AddressSlice
    session_id: int
    group: str
    windows: dict[str, tuple[int, int]]  # arena name -> [start, end) addresses

    def vacate(self, window: str) -> None:
        """Window ``window`` is the standby's no longer: the adopted arena is mapped there next."""
        with _lock:
            self.windows.pop(window, None)

    def drop(self) -> None:
        """The standby closed: none of its windows is held for it any more."""
        with _lock:
            self.windows.clear()
            if self.held.standbys.get((self.session_id, self.group)) is self:
                del self.held.standbys[(self.session_id, self.group)]


_held: dict[int, AddressSlice] = {}  # by base
_lock = threading.Lock()  # sessions of one process may open and close on any thread


def hold(driver: Driver, index: int, daemon: str) -> AddressSlice:
    """The slice of device ``index``'s daemon (described by ``daemon``), reserved in
    this process unless a session of the same daemon already holds it."""
    base, end = plan_range(index)
    with _lock:
        held = _held.get(base)
        if held is None:
            held = AddressSlice(base, end - base, daemon, driver)
            _reserve(held, index)
            _held[base] = held
        elif held.daemon != daemon:
            raise VaCollision(
                f"the address slice of device {index}, [{base:#x}, {end:#x}), is in use in this process by the arenas "
                f"of {held.daemon}; {daemon} plans its arenas there too, so they would land on each other: close the "
                "sessions of the first daemon (its arenas released) before using the second"
            )
        held.holders += 1
        return held


def claim(held: AddressSlice, arena: str, start: int, end: int, session_id: int, client: str) -> None:
    """Session ``client`` (``session_id``) maps ``arena``, at ``[start, end)``, here from
    now on; VaCollision if another session of this process maps it (the same session may
    claim it again), or if a standby of this process holds a window there."""
    with _lock:
        for standby in held.standbys.values():
            for window, (w_start, w_end) in standby.windows.items():
                if start < w_end and w_start < end:
                    raise VaCollision(
                        f"arena '{arena}' is planned at [{start:#x}, {end:#x}), over the window of '{window}' that this "
                        f"process reserved for retain group '{standby.group}' (the group was released meanwhile and its "
                        "window planned again): close the reservation first"
                    )
        mapper = held.mapped.setdefault(arena, (session_id, client))
    if mapper[0] != session_id:
        raise VaCollision(
            f"arena '{arena}' is mapped in this process already, by session '{mapper[1]}' (session {mapper[0]} of "
            f"{held.daemon}): '{client}' would map it at the same address, over that mapping; a process maps an "
            f"arena once: use the Arena of '{mapper[1]}' in this process, or attach from another process"
        )


def reserve(held: AddressSlice, session_id: int, group: str, windows: dict[str, tuple[int, int]]) -> StandbyClaim:
    """Session ``session_id`` backs retain group ``group``'s ``windows`` (arena name ->
    [start, end) addresses) with a standby's placeholder from now on."""
    standby = StandbyClaim(held, session_id, group, dict(windows))
    with _lock:
        held.standbys[(session_id, group)] = standby
    return standby


def unclaim(held: AddressSlice, arena: str, session_id: int) -> None:
    """Session ``session_id`` no longer maps ``arena`` (released or never mapped)."""
    with _lock:
        if held.mapped.get(arena, (None, ""))[0] == session_id:
            del held.mapped[arena]


def let_go(held: AddressSlice) -> None:
    """One session that held ``held`` closed, its arenas released; the last frees it."""
    with _lock:
        held.holders -= 1
        if held.holders == 0:
            held.driver.free_reservation(held.base, held.size)
            del _held[held.base]


def _reserve(held: AddressSlice, index: int) -> None:
    where = f"the address slice of device {index}, [{held.base:#x}, {held.end:#x})"
    try:
        got = held.driver.reserve(held.size, held.base)
    except DriverError as exc:
        raise MappingError(f"reserving {where} failed: {exc} (address space only, no memory: check 'ulimit -v')") from None
    if got != held.base:
        held.driver.free_reservation(got, held.size)
        raise VaCollision(
            f"{where}, where {held.daemon} plans every arena, is taken in this process (the driver offered {got:#x} "
            "instead): something reserved or mapped part of it first; connect and create or attach the first arena "
            "before making other large reservations"
        )
