"""A standby's reservation of a retained group's windows: capture against the KV cache
before the engine that owns it dies, adopt it afterwards without a second capture.

    reservation = session.reserve_retained("engine-a", secret)   # the windows, this process's placeholder under them
    kv = reservation.kv_pools["engine-a-kv"]                     # layout and addresses (no byte of the primary's)
    ... build the KV tensors at kv.arena.address, capture the graphs ...
    adopted = session.adopt("engine-a", secret, wait=3600, reservation=reservation)
    # the real chunks replaced the placeholder at the same addresses: the graphs replay on them

The daemon plans every arena in one address slice that each process reserves whole
(gpumem.address_slices), and a window stays planned while its arena lives, held or
orphaned: in the standby's process the primary's windows are inside the slice it
reserved, and nothing of its own is ever planned there. RETAIN_RESERVE, with the group's
secret, says where they are; this process aliases a placeholder of its own over them
(chunks of a small scratch arena it owns: writes land in scratch bytes, reads see
scratch, nothing of the primary's). ADOPT then swaps: each window's placeholder is
unmapped and the adopted chunks are mapped in its place (gpumem.retain.adopt), so a
pointer taken before, a view or a captured graph, reads the adopted contents.
docs/architecture.md, "Retained memory", the standby.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError
from gpumem.arena import DEFAULT_PLACEHOLDER_SLOT, Arena
from gpumem.errors import InvalidArgument, MappingError
from gpumem.kv_pool import KvPool
from gpumem.paged_kv import PagedKvCache
from gpumem.views import RawView

if TYPE_CHECKING:
    from gpumem.core import SessionCore


class Reservation:
    """A retained group's windows backed by this process's placeholder, until adopted
    (``gpumem.retain.adopt(reservation=)``) or ``close()``d."""

    def __init__(self, core: SessionCore, reply: p.ReserveReply, scratch: Arena, slot_bytes: int) -> None:
        self.core = core
        self.group = reply.group
        self.slot_bytes = slot_bytes
        self.objects = {o.arena.name: o for o in reply.objects}
        self._scratch = scratch
        self._aliases: dict[str, list[tuple[int, int]]] = {}  # by object: (offset, size) of each placeholder mapping
        self._parked: set[str] = set()  # windows whose placeholder went before the adoption (``park``)
        # The windows are this reservation's in the process's address slice until vacated (gpumem.address_slices).
        windows = {o.arena.name: (o.arena.address, o.arena.address + o.arena.reserved) for o in reply.objects}
        self._claim = core.claim_standby(self.group, self, windows)

    @classmethod
    def open(cls, core: SessionCore, group: str, secret: str, slot_bytes: int = DEFAULT_PLACEHOLDER_SLOT) -> Reservation:
        """``Session.reserve_retained``."""
        if core.standby(group) is not None:
            raise InvalidArgument(f"this session reserved the windows of retain group '{group}' already")
        reply: p.ReserveReply = core.call(p.RetainReserve(group=group, secret=secret))
        scratch = Arena.create(core, f"{group}-standby-{core.session_id}", core.device.granularity)
        reservation = cls(core, reply, scratch, slot_bytes)
        try:
            scratch.placeholder(0, core.device.granularity, slot_bytes)
            reservation._cover_all()
        except BaseException:
            reservation.close()
            raise
        return reservation

    @classmethod
    def held(cls, core: SessionCore, group: str) -> Reservation | None:
        """The session's reservation of retain group ``group``'s windows, if it holds one."""
        standby = core.standby(group)
        return standby if isinstance(standby, cls) else None

    def address(self, name: str) -> int:
        return self.objects[name].arena.address

    @property
    def kv_pools(self) -> dict[str, p.KvPoolView]:
        return {n: o.kv for n, o in self.objects.items() if o.kv is not None}

    def view(self, name: str, offset: int = 0, nbytes: int | None = None) -> RawView:
        """Bytes of ``name``'s window as a view (gpumem.views): scratch until the group is
        adopted with this reservation, the adopted contents after, at the same address
        (none while parked: nothing is mapped there)."""
        if name in self._parked:
            raise InvalidArgument(f"the window of '{name}' (retain group '{self.group}') is parked: nothing is mapped there until the adoption")
        window = self.objects[name].arena
        nbytes = window.reserved - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > window.reserved:
            raise InvalidArgument(f"view [{offset}, {offset + nbytes}) is outside the window of '{name}' ({window.reserved} bytes)")
        if self.core.backend == "cuda":
            return RawView(window.address + offset, nbytes, "cuda", self.core.device_ordinal or 0, owner=self)
        return RawView(window.address + offset, nbytes, "cpu", owner=self)

    def paged_kv(self, layers: int, block_shape: tuple[int, ...], itemsize: int, combined: bool = False) -> PagedKvCache:
        """The group's KV pool as a paged KV cache (gpumem.paged_kv), for its layout and
        ``tensors`` only: its memory is this reservation's placeholder, and it is no pool
        of this session (nothing may be asked of the daemon through it) until adopted."""
        (view,) = self.kv_pools.values()
        return PagedKvCache(KvPool(self.core, view), layers, block_shape, itemsize, combined)

    def _cover_all(self) -> None:
        fds = self._scratch.placeholder_fds
        slot, granule = max(fds), min(fds)
        driver = self.core.driver
        for name, obj in self.objects.items():
            start, size = obj.arena.address, obj.arena.reserved
            big = list(range(0, size - size % slot, slot))
            small = list(range(len(big) * slot, size, granule))
            try:
                if big:
                    driver.map_aliased(start, fds[slot], slot, big)
                self._aliases[name] = [(o, slot) for o in big]
                if small:
                    driver.map_aliased(start, fds[granule], granule, small)
                self._aliases[name] += [(o, granule) for o in small]
            except DriverError as exc:
                raise MappingError(f"aliasing the placeholder over the window of '{name}' (retain group '{self.group}') failed: {exc}") from None

    def park(self) -> None:
        """Unmap the placeholder from every window now, keeping the windows reserved, for
        a standby that has built and captured what it needs and only waits: the adoption
        then maps the adopted chunks without first unmapping thousands of placeholder
        slots (on the H200 about 50 ms for a 124 GiB KV pool in 64 MiB slots, on the way
        to the successor's first token). Until the adoption nothing may touch the windows:
        a view read or a graph replayed over them faults (a sleeping engine runs nothing)."""
        for name in list(self._aliases):
            self._unmap(name, self._aliases[name])
            del self._aliases[name]
            self._parked.add(name)

    def vacate(self, name: str) -> bool:
        """Unmap the placeholder over ``name``'s window (the adopted chunks take its
        place); whether this reservation covered it (parked windows too)."""
        if name in self._parked:
            self._parked.discard(name)
            self._claim.vacate(name)
            return True
        spans = self._aliases.pop(name, None)
        if spans is None:
            return False
        self._claim.vacate(name)
        self._unmap(name, spans)
        return True

    def _unmap(self, name: str, spans: list[tuple[int, int]]) -> None:
        try:
            self.core.driver.unmap_many(self.objects[name].arena.address, spans)
        except DriverError as exc:
            raise MappingError(f"unmapping the placeholder over the window of '{name}' (retain group '{self.group}') failed: {exc}") from None

    def close(self) -> None:
        """Unmap what is still reserved and give the scratch arena back (after an
        adoption: its placeholder no longer backs anything)."""
        for name in list(self._aliases):
            self.vacate(name)
        self._parked.clear()
        self.core.drop_standby(self._claim)
        if not self.core.closed and self.core.arenas.get(self._scratch.name) is self._scratch:
            self._scratch.release()

    def __repr__(self) -> str:
        return f"<gpumem.Reservation '{self.group}': {sorted(self._aliases)}" + (f" parked {sorted(self._parked)}>" if self._parked else ">")
