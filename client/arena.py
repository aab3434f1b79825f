"""An arena as a client sees it: a reserved window at the daemon's planned address,
with the chunks it was handed mapped in place.

Every process maps an arena at the same virtual address, so an address inside it
names the same bytes in each of them (graph-pool extents rely on this).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError
from gpumem.errors import InvalidArgument, MappingError, SessionClosed, VaCollision

if TYPE_CHECKING:
    from gpumem.session import Session


class Arena:
    def __init__(self, session: Session, view: p.ArenaView, *, owner: bool) -> None:
        self.session = session
        self.name = view.name
        self.owner_name = view.owner
        self.address = view.address
        self.reserved = view.reserved
        self.granularity = view.granularity
        self.is_owner = owner
        self.committed = view.committed
        self._mapped: dict[int, p.ChunkView] = {}
        self._reserved_here = False

    # ------------------------------------------------------------------ lifecycle

    def _reserve(self) -> None:
        driver = self.session.driver
        try:
            got = driver.reserve(self.reserved, self.address)
        except DriverError as exc:
            raise MappingError(f"reserving arena '{self.name}' ({self.reserved} bytes at {self.address:#x}) failed: {exc}") from None
        if got != self.address:
            driver.free_reservation(got, self.reserved)
            raise VaCollision(
                f"arena '{self.name}' is planned at [{self.address:#x}, {self.address + self.reserved:#x}) but that "
                f"window is taken in this process (the driver offered {got:#x}); create or attach arenas before "
                "other large reservations, or move the daemon's plan range"
            )
        self._reserved_here = True

    def _apply(self, reply: p.MapReply, fds: dict[int, int]) -> None:
        """Map the chunks handed out, unmap the retired ones, and tell the daemon."""
        self.committed = reply.arena.committed
        driver = self.session.driver
        try:
            if reply.chunks:
                placements = [(fds[c.id], c.offset, c.size) for c in reply.chunks]
                try:
                    driver.map_fds(self.address, placements)
                except DriverError as exc:
                    self.session.call(p.ChunksUnmapped(name=self.name, chunk_ids=[c.id for c in reply.chunks]))
                    raise MappingError(f"mapping {len(placements)} chunk(s) of arena '{self.name}' failed: {exc}") from None
                for chunk in reply.chunks:
                    self._mapped[chunk.id] = chunk
        finally:
            fdchannel.close_all(list(fds.values()))  # the mapping holds the memory now
        if reply.retired:
            self._unmap(reply.retired)

    def _unmap(self, chunks: list[p.ChunkView]) -> None:
        driver = self.session.driver
        gone = []
        for chunk in chunks:
            if self._mapped.pop(chunk.id, None) is not None:
                driver.unmap(self.address + chunk.offset, chunk.size)
            gone.append(chunk.id)
        self.session.call(p.ChunksUnmapped(name=self.name, chunk_ids=gone))

    # ------------------------------------------------------------------ API

    def commit(self, nbytes: int) -> None:
        """Back the first ``nbytes`` (a multiple of the granularity) with physical
        memory. Idempotent; growing only. Fails whole, with the figures, when the
        device lacks the memory."""
        reply, fds = self.session._call(p.CommitArena(name=self.name, nbytes=nbytes))
        self._apply(reply, fds)

    def decommit(self, to_nbytes: int) -> int:
        """Give back physical memory beyond ``to_nbytes``, in whole chunks: the arena
        keeps the smallest chunk boundary at or above it. Returns the new committed size.
        Synchronizes the device first: in-flight work on the range must finish."""
        reply, fds = self.session._call(p.DecommitArena(name=self.name, to_nbytes=to_nbytes))
        self._apply(reply, fds)
        return self.committed

    def share(self, client: str) -> None:
        """Let sessions named ``client`` attach to this arena."""
        self.session.call(p.ShareArena(name=self.name, client=client))

    def sync(self) -> None:
        """Map what was committed since, unmap what was retired since."""
        reply, fds = self.session._call(p.SyncArena(name=self.name))
        self._apply(reply, fds)

    def release(self) -> None:
        """Unmap everything and give the arena back (an owner destroys it, a sharer
        detaches). Tensors on it must be gone: their memory disappears here."""
        if self.session.arenas.get(self.name) is not self:
            raise SessionClosed(f"arena '{self.name}' was already released by this process")
        driver = self.session.driver
        for chunk in self._mapped.values():
            driver.unmap(self.address + chunk.offset, chunk.size)
        self._mapped.clear()
        if self._reserved_here:
            driver.free_reservation(self.address, self.reserved)
            self._reserved_here = False
        del self.session.arenas[self.name]
        self.session.call(p.ReleaseArena(name=self.name))

    def _check_range(self, offset: int, size: int) -> None:
        end = offset + size
        if offset < 0 or size < 0 or not any(
            c.offset <= offset and end <= c.offset + c.size for c in self._contiguous_mapped()
        ):
            raise InvalidArgument(
                f"range [{offset}, {end}) of arena '{self.name}' is not mapped in this process "
                f"(committed {self.committed} bytes; a sharer may need sync())"
            )

    def _contiguous_mapped(self) -> list[p.ChunkView]:
        runs: list[p.ChunkView] = []
        for chunk in sorted(self._mapped.values(), key=lambda c: c.offset):
            if runs and runs[-1].offset + runs[-1].size == chunk.offset:
                runs[-1] = p.ChunkView(id=0, offset=runs[-1].offset, size=runs[-1].size + chunk.size)
            else:
                runs.append(p.ChunkView(id=0, offset=chunk.offset, size=chunk.size))
        return runs

    def write(self, offset: int, data: bytes) -> None:
        """Copy host bytes into the arena (a convenience for tools and tests)."""
        self._check_range(offset, len(data))
        self.session.driver.write(self.address + offset, data)

    def read(self, offset: int, size: int) -> bytes:
        self._check_range(offset, size)
        return self.session.driver.read(self.address + offset, size)

    @property
    def mapped_bytes(self) -> int:
        return sum(c.size for c in self._mapped.values())

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else f"shared by {self.owner_name}"
        return f"<gpumem.Arena '{self.name}' {role} at {self.address:#x} committed {self.committed}/{self.reserved}>"
