"""An arena's window in this process: what is mapped where, at the daemon's planned
address, inside the daemon's address slice this process reserved (gpumem.address_slices).

Every process maps an arena at the same virtual address, so an address inside it
names the same bytes in each of them (graph-pool extents rely on this).

The window holds three kinds of space: committed (real chunks mapped), placeholder
(one small chunk aliased over many slots, so CUDA-graph capture can record copies
there before the real memory exists), and virtual-only (reserved, unmapped). The
window keeps the map of which is where; a commit swaps placeholder for real chunks at
the same addresses, and a decommit puts the placeholder back where it was.
``gpumem.arena.Arena`` holds one and asks the daemon; this carries out its answers.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError
from gpumem.errors import MappingError, SessionClosed

if TYPE_CHECKING:
    from gpumem.core import SessionCore

Ranges = list[tuple[int, int]]  # sorted, disjoint [start, end) offsets


def merge(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif start < end:
            out.append((start, end))
    return out


def subtract(ranges: Ranges, cut: Ranges) -> Ranges:
    out: Ranges = []
    cut = merge(cut)
    for start, end in merge(ranges):
        pos = start
        for c_start, c_end in cut:
            if c_end <= pos or c_start >= end:
                continue
            if c_start > pos:
                out.append((pos, c_start))
            pos = max(pos, c_end)
        if pos < end:
            out.append((pos, end))
    return out


def intersect(a: Ranges, b: Ranges) -> Ranges:
    return subtract(a, subtract(a, b))


def touching(spans: dict[int, int], ranges: Ranges) -> list[tuple[int, int]]:
    """The ``(offset, size)`` spans that overlap ``ranges`` (sorted, disjoint): one
    bisection each, for the hundreds of placeholder slots of a large pool."""
    starts = [start for start, _ in ranges]
    out = []
    for offset, size in spans.items():
        i = bisect.bisect_left(starts, offset + size) - 1  # the last range starting before the span ends
        if i >= 0 and ranges[i][1] > offset:
            out.append((offset, size))
    return out


class Window:
    """Arena ``view.name``'s mappings in this process (see the module doc)."""

    def __init__(self, core: SessionCore, view: p.ArenaView) -> None:
        self.core = core
        self.name = view.name
        self.address = view.address
        self.committed = view.committed  # the daemon's figure, as of the last answer carried out here
        self.read_only = False  # attached through read-only grants: mapped for reading only
        # Real chunks mapped here, by id: the daemon may put a new chunk at the offset of
        # one this process still maps, so an offset does not name a chunk.
        self.chunks: dict[int, p.ChunkView] = {}
        self.aliases: dict[int, int] = {}  # placeholder mappings: offset -> size
        self._cover: Ranges = []  # where placeholder backing was asked for
        self.placeholder_fds: dict[int, int] = {}  # slot size -> fd, kept to map again
        self.placeholder_ids: list[int] = []  # the daemon's ids of those chunks
        self.released = False
        # Held while the mappings above change. A call that close() interrupts in another
        # thread still puts its placeholder back (or maps the reply it got) while close()
        # unmaps the arena: unserialized, close() closed the placeholder's descriptors under
        # the call's mapping (EBADF) or missed a mapping made after it listed them (left
        # in the address slice: on CUDA the slice then cannot be freed). Never held across
        # a request: a request's ``meanwhile`` takes it under the channel's lock.
        self._lock = threading.RLock()
        self._holder = ""  # the thread holding it, for the error of a wait that ran out

    def check_open(self) -> None:
        if self.released:
            raise SessionClosed(f"arena '{self.name}' was released by this process")
        if self.core.closed:
            raise SessionClosed(f"arena '{self.name}' belongs to a closed session ('{self.core.name}')")

    def apply(self, reply: p.MapReply | p.KvCommitReply, fds: dict[int, int]) -> None:
        """Carry out a reply that changed the arena's backing (the session's and the KV
        pool's requests too): unmap the retired chunks, map the chunks handed out (over
        any placeholder there), put placeholder back where it was asked for and nothing
        else is mapped, and tell the daemon. Takes ownership of ``fds``. SessionClosed
        when the arena was released meanwhile (a close() on another thread): nothing
        of the reply is mapped then."""
        not_mapped: list[int] = []  # chunks handed out that could not be mapped: the daemon hears so
        try:
            with self.mapping():
                if self.released:
                    raise SessionClosed(f"arena '{self.name}' was released by this process while the daemon answered; nothing was mapped")
                self.committed = reply.arena.committed
                if isinstance(reply, p.MapReply) and reply.read_only:
                    self.read_only = True
                # Retired first: a chunk handed out now may sit where a retired one is mapped.
                self._unmap(reply.retired)
                try:
                    if reply.chunks:
                        not_mapped = [c.id for c in reply.chunks]
                        self._map_chunks(reply.chunks, fds)
                        not_mapped = []
                finally:
                    self._restore_placeholder()
        finally:
            fdchannel.close_all(list(fds.values()))  # the mappings hold the memory now
            if not_mapped:
                self.core.call(p.ChunksUnmapped(name=self.name, chunk_ids=not_mapped))
        if reply.retired:
            self.core.call(p.ChunksUnmapped(name=self.name, chunk_ids=[c.id for c in reply.retired]))

    @contextlib.contextmanager
    def mapping(self) -> Iterator[None]:
        """Hold the window's mappings (see ``_lock``). The holder runs driver calls only, so
        the session's timeout is ample; past it the driver hangs."""
        timeout = self.core.timeout
        if not self._lock.acquire(timeout=timeout):
            raise MappingError(
                f"arena '{self.name}': thread '{self._holder}' of this process kept changing its mappings for more than "
                f"{timeout:g}s (a driver call that does not return: check the device, e.g. with nvidia-smi)"
            )
        outer, self._holder = self._holder, threading.current_thread().name
        try:
            yield
        finally:
            self._holder = outer
            self._lock.release()

    def _unmap(self, retired: list[p.ChunkView]) -> None:
        """Unmap the retired chunks mapped here, where this process mapped them."""
        mine = [self.chunks.pop(c.id) for c in retired if c.id in self.chunks]
        if mine:
            self.core.driver.unmap_many(self.address, [(c.offset, c.size) for c in mine])

    def _map_chunks(self, chunks: list[p.ChunkView], fds: dict[int, int]) -> None:
        driver = self.core.driver
        wanted = merge([(c.offset, c.offset + c.size) for c in chunks])
        overlap = intersect(wanted, self.committed_ranges())
        if overlap:
            raise MappingError(
                f"the daemon handed out chunks of arena '{self.name}' over committed memory this process still maps "
                f"(offsets {overlap}); they were not mapped"
            )
        self._unmap_aliases(touching(self.aliases, wanted))
        try:
            driver.map_fds(self.address, [(fds[c.id], c.offset, c.size) for c in chunks], self.read_only)
        except DriverError as exc:
            raise MappingError(f"mapping {len(chunks)} chunk(s) of arena '{self.name}' failed: {exc}") from None
        for chunk in chunks:
            self.chunks[chunk.id] = chunk

    def vacate(self, ranges: Ranges) -> None:
        """Unmap the placeholder under ``ranges``, where a request that is with the daemon
        now maps real chunks if it succeeds: unmapped while the daemon works, it costs the
        swap nothing (``apply`` would unmap it after the answer otherwise). Where the
        request fails, ``restore_placeholder`` puts it back."""
        with self.mapping():
            self._unmap_aliases(touching(self.aliases, merge(ranges)))

    def restore_placeholder(self) -> None:
        """Alias the placeholder again wherever it was asked for and nothing is mapped;
        nothing once the arena is released (a close() on another thread, meanwhile)."""
        with self.mapping():
            self._restore_placeholder()

    def cover(self, start: int, end: int, chunks: list[p.ChunkView], fds: dict[int, int]) -> None:
        """Back ``[start, end)`` with the placeholder from now on, wherever nothing else is
        mapped. ``chunks``: the placeholder's own, with their ``fds`` (taken over), the
        first time the arena asks for it. SessionClosed when the arena was released
        meanwhile (a close() on another thread): nothing is mapped then."""
        with self.mapping():
            if self.released:
                fdchannel.close_all(list(fds.values()))
                raise SessionClosed(f"arena '{self.name}' was released by this process while the daemon answered")
            if chunks:
                self.placeholder_fds = {c.size: fds[c.id] for c in chunks}
                self.placeholder_ids = [c.id for c in chunks]
            self._cover = merge(self._cover + [(start, end)])
            self._restore_placeholder()

    def _restore_placeholder(self) -> None:
        if not self.released:
            self._cover_free(subtract(self._cover, self.backed_ranges()))

    def _unmap_aliases(self, spans: list[tuple[int, int]]) -> None:
        if not spans:
            return
        try:
            self.core.driver.unmap_many(self.address, spans)
        except DriverError as exc:
            raise MappingError(f"unmapping the placeholder of arena '{self.name}' failed: {exc}") from None
        for offset, _ in spans:
            del self.aliases[offset]

    def _cover_free(self, ranges: Ranges) -> None:
        """Alias the placeholder over ``ranges`` (which must be unmapped): slot-sized
        pieces where aligned, granule-sized ones at the edges."""
        if not ranges or not self.placeholder_fds:
            return
        slot = max(self.placeholder_fds)
        granule = min(self.placeholder_fds)
        big: list[int] = []
        small: list[int] = []
        for start, end in ranges:
            pos = start
            while pos < end:
                if pos % slot == 0 and pos + slot <= end:
                    big.append(pos)
                    pos += slot
                else:
                    small.append(pos)
                    pos += granule
        driver = self.core.driver
        try:
            if big:
                driver.map_aliased(self.address, self.placeholder_fds[slot], slot, big)
            if small and granule != slot:
                driver.map_aliased(self.address, self.placeholder_fds[granule], granule, small)
        except DriverError as exc:
            raise MappingError(f"aliasing the placeholder over arena '{self.name}' failed: {exc}") from None
        for offset in big:
            self.aliases[offset] = slot
        for offset in small if granule != slot else []:
            self.aliases[offset] = granule

    def release(self) -> None:
        """Unmap everything here and close the placeholder's descriptors: a late answer
        maps nothing after (``apply``). SessionClosed if released already (by another
        thread, meanwhile)."""
        with self.mapping():
            self.check_open()
            mapped = [(c.offset, c.size) for c in self.chunks.values()] + list(self.aliases.items())
            self.core.driver.unmap_many(self.address, mapped)
            self.aliases.clear()
            self.chunks.clear()
            fdchannel.close_all(list(self.placeholder_fds.values()))
            self.placeholder_fds.clear()
            self.placeholder_ids.clear()
            self.released = True

    def holding(self) -> p.Holding:
        """The chunks this process maps here, as a resume reports them to a restarted daemon."""
        return p.Holding(arena=self.name, chunks=list(self.chunks) + self.placeholder_ids)

    def backed_ranges(self) -> Ranges:
        """Offsets that are mapped here, committed or placeholder (merged)."""
        return merge(self.committed_ranges() + [(o, o + size) for o, size in self.aliases.items()])

    def committed_ranges(self) -> Ranges:
        return merge([(c.offset, c.offset + c.size) for c in self.chunks.values()])
