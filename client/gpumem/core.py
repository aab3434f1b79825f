"""What a session's objects share: its channel, its driver and device, the daemon's
address slice, its side of the leases, and the registries of what it made.

``Session`` (gpumem.session) is the public facade over one core. Arenas, graph pools,
KV pools, borrows, standbys and prefix directories hold the core, not the session, and
change its registries only through the methods here: so those are the one place where a
session's arenas, borrow pools and standbys come and go, and nothing below the facade
imports it (tests/unit/test_layering.py checks). A standby's windows are claims in the
address slice (gpumem.address_slices); the core keeps the standby, without knowing more
of it than how to close it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.driver import Driver, DriverError, DriverUnavailable, PeerAccessError
from gpumem_shared.paths import Endpoints
from gpumem import address_slices
from gpumem.address_slices import AddressSlice, StandbyClaim
from gpumem.channel import SessionChannel
from gpumem.errors import DaemonUnavailable, GpuMemError, InvalidArgument
from gpumem.handoffs import SessionLeases

if TYPE_CHECKING:
    from gpumem.arena import Arena
    from gpumem.borrow import BorrowPool


class Standby(Protocol):
    """What backs a retain group's windows with this session's placeholder
    (gpumem.standby's ``Reservation``): closing it unmaps the placeholder there."""

    def close(self) -> None: ...


class SessionCore:
    """One session's shared state (see the module doc). ``open`` connects; the
    constructor takes a channel that said HELLO and the driver for its device."""

    def __init__(self, channel: SessionChannel, driver: Driver, device_ordinal: int | None) -> None:
        hello = channel.hello
        self.channel = channel
        self.driver = driver
        self.endpoints = channel.endpoints
        self.name = channel.name
        self.timeout = channel.timeout
        self.session_id = hello.session_id
        self.backend = hello.backend
        self.device = hello.device
        self.daemon_pid = hello.daemon_pid
        # This process's CUDA ordinal for the daemon's device (None on the host backend).
        self.device_ordinal = device_ordinal
        self._arenas: dict[str, Arena] = {}
        # This process's borrow pools, by graph pool id (gpumem.borrow).
        self._borrow_pools: dict[int, BorrowPool] = {}
        # Read-only views, made once: the borrow path reads them on every scope.
        self.arenas: Mapping[str, Arena] = MappingProxyType(self._arenas)
        self.borrow_pools: Mapping[int, BorrowPool] = MappingProxyType(self._borrow_pools)
        # What backs retain groups' windows with this session's placeholder, by group; the
        # windows themselves are claims in the address slice (claim_standby).
        self._standbys: dict[str, Standby] = {}
        arenas = self._arenas  # not self: the channel must not keep the core alive
        channel.holdings = lambda: [arena.holding() for arena in list(arenas.values())]
        self._slice: AddressSlice | None = None  # the daemon's address slice, from the first arena on
        self._slice_lock = threading.Lock()  # two threads' first arenas take one hold
        daemon_key = f"{self.endpoints.runtime_dir}:{self.endpoints.index}"
        self.leasing = SessionLeases(channel, driver, hello.session_id, device_ordinal, daemon_key)

    @classmethod
    def open(cls, endpoints: Endpoints, name: str, timeout: float, peers: Sequence[int], tenant_token: str = "") -> SessionCore:
        """Say HELLO to the daemon at ``endpoints`` (presenting ``tenant_token``, if any)
        and open the driver for its device, with peer access to the CUDA ordinals ``peers``."""
        channel = SessionChannel(endpoints, name, timeout, tenant_token)  # closes its own sockets if HELLO fails
        try:
            driver, ordinal = _driver_for(channel.hello, peers)
            return cls(channel, driver, ordinal)
        except BaseException:
            channel.close()
            raise

    # ------------------------------------------------------------------ calls

    def call(self, message: p.RequestMessage, timeout: float | None = None) -> Any:
        """One request; returns the typed reply body. Requests whose descriptors matter
        (chunks, lease segments) go through ``channel.call``, which returns them too;
        here they are closed."""
        body, fds = self.channel.call(message, timeout)
        if fds:
            fdchannel.close_all(list(fds.values()))
        return body

    @property
    def closed(self) -> bool:
        return self.channel.closed

    def address_slice(self) -> AddressSlice:
        """The daemon's address slice in this process, where its arenas are mapped:
        reserved at the session's first arena, shared with the process's other sessions
        of the same daemon (gpumem.address_slices)."""
        with self._slice_lock:
            if self._slice is None:
                daemon = f"gpumemd pid {self.daemon_pid} (device {self.device.index}, {self.endpoints.runtime_dir})"
                self._slice = address_slices.hold(self.driver, self.device.index, daemon)
            return self._slice

    # ------------------------------------------------------------------ registries

    def add_arena(self, arena: Arena) -> None:
        """``arena`` is mapped in this session now: released at close, reported on resume."""
        self._arenas[arena.name] = arena

    def drop_arena(self, name: str) -> None:
        """Arena ``name`` was released (unmapped here): another session of this process may map it now."""
        self._arenas.pop(name, None)
        if self._slice is not None:
            address_slices.unclaim(self._slice, name, self.session_id)

    def add_borrow_pool(self, borrowed: BorrowPool) -> None:
        self._borrow_pools[borrowed.pool_id] = borrowed

    def close_borrow_pool(self, pool_id: int) -> None:
        """Graph pool ``pool_id``'s borrow pool goes (its graph pool or arena does): its
        native slot is released. The caller checked that no borrowed block is alive."""
        borrowed = self._borrow_pools.pop(pool_id, None)
        if borrowed is not None:
            borrowed.close()

    def claim_window(self, arena: Arena) -> None:
        """``arena``'s window (in the slice this session holds) is this session's to map:
        VaCollision if another session of this process maps the arena (the daemon plans
        it at one address for all; gpumem.address_slices) or if the window overlaps one
        a standby of this process holds (the retain group was released meanwhile and the
        daemon planned its window again). Last in reserve_window: a claim made is kept
        until drop_arena."""
        address_slices.claim(self.address_slice(), arena.name, arena.address, arena.address + arena.reserved, self.session_id, self.name)

    def claim_standby(self, group: str, standby: Standby, windows: dict[str, tuple[int, int]]) -> StandbyClaim:
        """``standby`` backs retain group ``group``'s ``windows`` (arena name -> [start, end)
        addresses) with this session's placeholder from now on (gpumem.standby): no arena
        of this process is mapped over one until the claim vacates it or ``drop_standby``;
        ``close`` closes the standby."""
        claim = address_slices.reserve(self.address_slice(), self.session_id, group, windows)
        self._standbys[group] = standby
        return claim

    def drop_standby(self, claim: StandbyClaim) -> None:
        """The standby of ``claim`` closed: its windows are free in this process again."""
        claim.drop()
        self._standbys.pop(claim.group, None)

    def standby(self, group: str) -> Standby | None:
        """What backs retain group ``group``'s windows in this session, if anything does."""
        return self._standbys.get(group)

    def close(self) -> None:
        """Release the arenas (unmapping them) and close both channels; a call another
        thread has in progress ends first (SessionClosed), not at its deadline. That
        call may still be putting its placeholder back: each arena's release waits for
        it (the arena's mappings change under one lock), then nothing is mapped."""
        self.channel.interrupt()
        for standby in list(self._standbys.values()):
            try:
                standby.close()  # its placeholder off the windows: the slice can go
            except (GpuMemError, DriverError):
                pass
        for arena in list(self._arenas.values()):
            try:
                arena.release()
            except (GpuMemError, DriverError):
                pass  # the daemon releases on EOF anyway; the mapping is gone locally
        for pool_id in list(self._borrow_pools):
            self.close_borrow_pool(pool_id)
        self.leasing.close()
        self.channel.close()
        # An arena that could not be released is still mapped: its slice stays reserved.
        with self._slice_lock:
            if self._slice is not None and not self._arenas:
                held, self._slice = self._slice, None
                address_slices.let_go(held)


def _driver_for(hello: p.HelloReply, peers: Sequence[int]) -> tuple[Driver, int | None]:
    """The driver that maps the daemon's chunks here, and this process's CUDA ordinal of
    its device (None on the host backend)."""
    device = hello.device
    if hello.backend == "host":
        from gpumem_shared.driver.host import HostDriver

        try:
            return HostDriver(device.index, peers=list(peers)), None
        except PeerAccessError as exc:
            raise InvalidArgument(str(exc)) from None
    from gpumem_shared.driver.cuda import CudaDriver, visible_device_uuids

    try:
        uuids = visible_device_uuids()
    except DriverUnavailable as exc:
        raise DaemonUnavailable(f"gpumemd serves CUDA device {device.uuid}, but this process cannot use CUDA: {exc}") from None
    if device.uuid not in uuids:
        raise DaemonUnavailable(
            f"gpumemd@{device.index} serves {device.uuid}, which this process does not see "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
    ordinal = uuids.index(device.uuid)
    try:
        return CudaDriver(ordinal, peers=list(peers)), ordinal
    except PeerAccessError as exc:
        raise InvalidArgument(f"peer access for gpumemd@{device.index} ({device.uuid}): {exc}") from None
    except DriverUnavailable as exc:
        raise DaemonUnavailable(f"gpumemd serves CUDA device {device.uuid}, which this process cannot use: {exc}") from None
