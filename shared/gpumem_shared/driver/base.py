"""The interface both driver backends implement, for the daemon and for clients.

A backend knows how to reserve virtual address space, create physical chunks, pass
them between processes as POSIX file descriptors, and map them. The daemon creates
and exports; clients import and map. Addresses are plain ints everywhere.
"""

from __future__ import annotations

import abc
from typing import Any

Handle = Any  # a backend's physical-chunk handle (a CUDA generic handle, a memfd)


class DriverError(Exception):
    """A driver call failed. ``out_of_memory`` tells exhaustion from other failures."""

    def __init__(self, message: str, *, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


class PeerAccessError(Exception):
    """Another device cannot reach this device's memory (no peer path, or no such device)."""


class DriverUnavailable(Exception):
    """The backend cannot run on this machine (no NVIDIA driver, no such device)."""


class Driver(abc.ABC):
    kind: str  # "cuda" | "host"
    granularity: int

    # --- identity -----------------------------------------------------------
    @abc.abstractmethod
    def device_name(self) -> str: ...

    @abc.abstractmethod
    def device_uuid(self) -> str: ...

    @abc.abstractmethod
    def total_bytes(self) -> int: ...

    @abc.abstractmethod
    def measured_free(self) -> int | None:
        """Free device memory as the hardware sees it, or None where only the
        daemon's own accounting can tell (the host backend)."""

    # --- virtual address space ---------------------------------------------
    @abc.abstractmethod
    def reserve(self, size: int, hint: int) -> int:
        """Reserve ``size`` bytes of address space, at ``hint`` if it is free.
        Returns the address actually reserved (it may differ from the hint)."""

    @abc.abstractmethod
    def free_reservation(self, address: int, size: int) -> None: ...

    # --- physical chunks (daemon side) --------------------------------------
    @abc.abstractmethod
    def create_chunks(self, placements: list[tuple[int, int]]) -> list[Handle]:
        """Create one chunk per ``(address, size)``, all at once or none.

        ``address`` lies inside a reservation of this process; a backend may map the
        chunk there (CUDA does, to zero it before its first handout) and then keeps that
        mapping until ``destroy_chunks``."""

    @abc.abstractmethod
    def chunk_fd(self, handle: Handle) -> int:
        """The POSIX fd this process keeps for a chunk it created or adopted, for as long
        as the chunk lives (a restart finds the chunk by it: it goes to the fd store).
        Owned by the handle: ``destroy_chunks`` closes it."""

    @abc.abstractmethod
    def adopt_chunks(self, placements: list[tuple[int, int]], fds: list[int]) -> list[Handle]:
        """Handles for chunks an earlier process created, from the fds it kept, placed as
        ``create_chunks`` places new ones; all or none. The handles own the fds from then
        on; on failure the caller still owns them. An fd that is not such a chunk (of
        that size) is a DriverError naming it."""

    @abc.abstractmethod
    def destroy_chunks(self, placements: list[tuple[int, int]], handles: list[Handle]) -> None:
        """Drop this process's references; memory returns once no client maps it."""

    @abc.abstractmethod
    def zero(self, placements: list[tuple[int, int]]) -> None:
        """Zero chunks this process created (at their ``create_chunks`` placements)."""

    @abc.abstractmethod
    def export_fds(self, chunks: list[tuple[int, int, Handle, bool]]) -> list[int]:
        """New POSIX fds for ``(address, size, handle, fresh)`` chunks; the caller closes
        them after sending. Fresh chunks (never handed out) are zeroed first, so no
        tenant sees an earlier tenant's bytes; the fds exist only once that is done."""

    @abc.abstractmethod
    def read_only_fds(self, fds: list[int]) -> list[int]:
        """New descriptors of the chunks ``fds`` (from ``export_fds``, still the caller's)
        for a process that may only read them; all or none. What "only read" means is
        the backend's: see each one."""

    # --- mapping (client side) -----------------------------------------------
    @abc.abstractmethod
    def map_fds(self, address: int, placements: list[tuple[int, int, int]], read_only: bool = False) -> None:
        """Map chunks received as ``(fd, offset, size)`` at ``address + offset``, for
        reading only where ``read_only`` (chunks of a read-only grant).

        All or nothing; the fds stay owned by the caller."""

    @abc.abstractmethod
    def map_aliased(self, address: int, fd: int, size: int, offsets: list[int]) -> None:
        """Map one chunk (received as ``fd``) at every ``address + offset``: the same
        physical bytes aliased over many slots (placeholder backing). All or nothing."""

    @abc.abstractmethod
    def unmap(self, address: int, size: int) -> None:
        """Unmap one chunk's range, leaving it reserved."""

    def unmap_many(self, address: int, ranges: list[tuple[int, int]]) -> None:
        """Unmap each ``(offset, size)`` mapping at ``address + offset``."""
        for offset, size in ranges:
            self.unmap(address + offset, size)

    # --- ordering GPU work across processes (lease handoffs) ------------------
    @abc.abstractmethod
    def event_create(self) -> tuple[Any, bytes]:
        """A new inter-process event and the handle another process opens it with."""

    @abc.abstractmethod
    def event_open(self, handle: bytes) -> Any:
        """Another process's event, from its handle."""

    @abc.abstractmethod
    def stream_wait(self, event: Any, stream: int) -> None:
        """Work queued on ``stream`` (a raw stream handle, 0 = default) from now on runs
        after the event's recorded work."""

    # The lease calls of the native module record and wait themselves, in the same call
    # as the compare-and-swap (gpumem_shared/csrc/lease_order.c); they take these two ints.
    @abc.abstractmethod
    def native_context(self) -> int:
        """The context they record and wait in (pushed when the calling thread's current
        one differs); 0 where work is synchronous, so they make no driver call."""

    @abc.abstractmethod
    def native_event(self, event: Any) -> int:
        """An event of ``event_create`` or ``event_open`` as they take it."""

    @abc.abstractmethod
    def event_destroy(self, event: Any) -> None:
        """Let go of an event (one opened from another process's handle: the exporter's
        own must outlive every importer, so it lives as long as the process)."""

    # --- ordering by stream memory operations (gpumemd --lease-ordering memops) --------
    # The writes and waits themselves are the native lease calls' (lease_order.py), in
    # native_context().
    @abc.abstractmethod
    def memops_problem(self) -> str | None:
        """None when streams can write and wait on 64-bit words in device memory; else
        why not, naming what to check (the daemon refuses memops ordering with it)."""

    # --- sleep and wake (client side): copies between the device and a host buffer --
    @abc.abstractmethod
    def host_register(self, address: int, size: int) -> None:
        """Make ``size`` bytes of host memory mapped at ``address`` (a sleep buffer) a
        target of full-bandwidth copies (on CUDA: page-locked, once per mapping)."""

    @abc.abstractmethod
    def host_unregister(self, address: int) -> None:
        """Undo ``host_register`` before the mapping goes."""

    @abc.abstractmethod
    def copy_to_host(self, copies: list[tuple[int, int, int]]) -> None:
        """Each ``(device address, host address, size)``, device to host, several in
        flight; the device's earlier work finishes first, and every copy has landed on
        return."""

    @abc.abstractmethod
    def copy_to_device(self, copies: list[tuple[int, int, int]]) -> None:
        """Each ``(device address, host address, size)``, host to device, several in
        flight; every copy has landed on return."""

    # --- data access (tools, tests, small transfers) --------------------------
    @abc.abstractmethod
    def write(self, address: int, data: bytes) -> None: ...

    @abc.abstractmethod
    def read(self, address: int, size: int) -> bytes: ...


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


# Copies are cut in pieces of this size, spread over the backend's streams (threads on
# the host backend): a few in flight saturate the link, and a piece is small enough that
# the last one finishes soon after the others.
COPY_PIECE = 64 << 20
COPY_STREAMS = 4


def pieces(copies: list[tuple[int, int, int]], piece: int = COPY_PIECE) -> list[tuple[int, int, int]]:
    """``copies`` cut into pieces of at most ``piece`` bytes, in order."""
    out = []
    for device, host, size in copies:
        for at in range(0, size, piece):
            out.append((device + at, host + at, min(piece, size - at)))
    return out


def contiguous(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, size)`` ranges merged where one ends where the next begins."""
    runs: list[tuple[int, int]] = []
    for start, size in sorted(ranges):
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + size)
        else:
            runs.append((start, size))
    return runs
