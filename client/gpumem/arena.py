"""An arena as a client sees it: a window at the daemon's planned address, inside the
daemon's address slice that this process reserved (gpumem.address_slices), with the
chunks it was handed mapped in place.

Every process maps an arena at the same virtual address, so an address inside it
names the same bytes in each of them (graph-pool extents rely on this).

The window holds three kinds of space: committed (real chunks mapped), placeholder
(one small chunk aliased over many slots, so CUDA-graph capture can record copies
there before the real memory exists), and virtual-only (reserved, unmapped). The
client keeps the map of which is where; commit swaps placeholder for real chunks at
the same addresses, and decommit puts the placeholder back where it was.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError
from gpumem.errors import InvalidArgument, MappingError, PermissionDenied, SessionClosed
from gpumem.views import RawView

if TYPE_CHECKING:
    from gpumem.elastic import ArenaAllocator, ArenaUsage
    from gpumem.graph_pools import ExtentLike, GraphPool
    from gpumem.core import SessionCore
    from gpumem.torch_support import ArenaPool

MiB = 1 << 20
DEFAULT_PLACEHOLDER_SLOT = 64 * MiB

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


class Arena:
    def __init__(self, core: SessionCore, view: p.ArenaView, *, owner: bool) -> None:
        self.core = core
        self.name = view.name
        self.owner_name = view.owner
        self.address = view.address
        self.reserved = view.reserved
        self.granularity = view.granularity
        self.is_owner = owner
        self.read_only = False  # attached through read-only grants: mapped for reading only
        self.committed = view.committed
        # Real chunks mapped here, by id: the daemon may put a new chunk at the offset of
        # one this process still maps, so an offset does not name a chunk.
        self._chunks: dict[int, p.ChunkView] = {}
        self._aliases: dict[int, int] = {}  # placeholder mappings: offset -> size
        self._cover: Ranges = []  # where placeholder backing was asked for
        self._placeholder_fds: dict[int, int] = {}  # slot size -> fd, kept to map again
        self._placeholder_ids: list[int] = []  # the daemon's ids of those chunks
        self._released = False
        # Held while the mappings above change. A call that close() interrupts in another
        # thread still puts its placeholder back (or maps the reply it got) while close()
        # unmaps the arena: unserialized, close() closed the placeholder's descriptors under
        # the call's mapping (EBADF) or missed a mapping made after it listed them (left
        # in the address slice: on CUDA the slice then cannot be freed). Never held across
        # a request: a request's ``meanwhile`` takes it under the channel's lock.
        self._lock = threading.RLock()
        self._holder = ""  # the thread holding it, for the error of a wait that ran out
        # placeholder() one at a time, across its request: the daemon hands a session each chunk once.
        self._placeholder_lock = threading.Lock()
        self._allocator: ArenaAllocator | None = None
        self._torch: ArenaPool | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, core: SessionCore, name: str, reserve_bytes: int) -> Arena:
        """``Session.create_arena``: the daemon plans the arena, this process maps its window."""
        reply: p.ArenaReply = core.call(p.CreateArena(name=name, reserve_bytes=reserve_bytes))
        arena = cls(core, reply.arena, owner=True)
        try:
            arena.reserve_window()
        except BaseException:
            core.call(p.ReleaseArena(name=name))
            raise
        core.add_arena(arena)
        return arena

    @classmethod
    def attach(cls, core: SessionCore, name: str, token: str) -> Arena:
        """``Session.attach_arena``: another client's arena, its committed chunks mapped."""
        reply, fds = core.channel.call(p.AttachArena(name=name, token=token))
        arena = cls(core, reply.arena, owner=False)
        try:
            arena.reserve_window()
        except BaseException:
            fdchannel.close_all(list(fds.values()))
            core.call(p.ReleaseArena(name=name))
            raise
        core.add_arena(arena)
        arena.apply(reply, fds)
        return arena

    def reserve_window(self) -> None:
        """Make sure the arena's window is reserved in this process, at the daemon's
        planned address: it lies in the daemon's address slice, which the session holds
        from its first arena on, and no other session here maps it (called once the daemon created or shared it)."""
        held = self.core.address_slice()
        if not held.base <= self.address <= self.address + self.reserved <= held.end:
            raise MappingError(
                f"arena '{self.name}' is planned at [{self.address:#x}, {self.address + self.reserved:#x}), outside the "
                f"address slice of its daemon [{held.base:#x}, {held.end:#x}): the daemon and this client disagree on "
                "the address plan (check that both are the same gpumemd version)"
            )
        self.core.claim_window(self)

    def apply(self, reply: p.MapReply | p.KvCommitReply, fds: dict[int, int]) -> None:
        """Carry out a reply that changed the arena's backing (the session's and the KV
        pool's requests too): unmap the retired chunks, map the chunks handed out (over
        any placeholder there), put placeholder back where it was asked for and nothing
        else is mapped, and tell the daemon. Takes ownership of ``fds``. SessionClosed
        when the arena was released meanwhile (a close() on another thread): nothing
        of the reply is mapped then."""
        not_mapped: list[int] = []  # chunks handed out that could not be mapped: the daemon hears so
        try:
            with self._mapping():
                if self._released:
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
        self._backing_changed()

    @contextlib.contextmanager
    def _mapping(self) -> Iterator[None]:
        """Hold the arena's mappings (see ``_lock``). The holder runs driver calls only, so
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
        mine = [self._chunks.pop(c.id) for c in retired if c.id in self._chunks]
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
        self._unmap_aliases(touching(self._aliases, wanted))
        try:
            driver.map_fds(self.address, [(fds[c.id], c.offset, c.size) for c in chunks], self.read_only)
        except DriverError as exc:
            raise MappingError(f"mapping {len(chunks)} chunk(s) of arena '{self.name}' failed: {exc}") from None
        for chunk in chunks:
            self._chunks[chunk.id] = chunk

    def vacate(self, ranges: Ranges) -> None:
        """Unmap the placeholder under ``ranges``, where a request that is with the daemon
        now maps real chunks if it succeeds: unmapped while the daemon works, it costs the
        swap nothing (``apply`` would unmap it after the answer otherwise). Where the
        request fails, ``restore_placeholder`` puts it back."""
        with self._mapping():
            self._unmap_aliases(touching(self._aliases, merge(ranges)))

    def restore_placeholder(self) -> None:
        """Alias the placeholder again wherever it was asked for and nothing is mapped;
        nothing once the arena is released (a close() on another thread, meanwhile)."""
        with self._mapping():
            self._restore_placeholder()

    def _restore_placeholder(self) -> None:
        if not self._released:
            self._cover_free(subtract(self._cover, self.backed_ranges()))

    def _unmap_aliases(self, spans: list[tuple[int, int]]) -> None:
        if not spans:
            return
        try:
            self.core.driver.unmap_many(self.address, spans)
        except DriverError as exc:
            raise MappingError(f"unmapping the placeholder of arena '{self.name}' failed: {exc}") from None
        for offset, _ in spans:
            del self._aliases[offset]

    def _cover_free(self, ranges: Ranges) -> None:
        """Alias the placeholder over ``ranges`` (which must be unmapped): slot-sized
        pieces where aligned, granule-sized ones at the edges."""
        if not ranges or not self._placeholder_fds:
            return
        slot = max(self._placeholder_fds)
        granule = min(self._placeholder_fds)
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
                driver.map_aliased(self.address, self._placeholder_fds[slot], slot, big)
            if small and granule != slot:
                driver.map_aliased(self.address, self._placeholder_fds[granule], granule, small)
        except DriverError as exc:
            raise MappingError(f"aliasing the placeholder over arena '{self.name}' failed: {exc}") from None
        for offset in big:
            self._aliases[offset] = slot
        for offset in small if granule != slot else []:
            self._aliases[offset] = granule

    def _backing_changed(self) -> None:
        if self._allocator is not None:
            self._allocator.update_backing()

    # ------------------------------------------------------------------ API

    def commit(self, nbytes: int) -> None:
        """Back the first ``nbytes`` (a multiple of the granularity) with physical
        memory, replacing any placeholder there at the same addresses. Idempotent;
        growing only. Fails whole, with the figures, when the device lacks the memory."""
        self._check_open()
        message = p.CommitArena(name=self.name, nbytes=nbytes)
        if not self._aliases:  # no placeholder to swap out
            reply, fds = self.core.channel.call(message)
        else:
            try:
                reply, fds = self.core.channel.call(message, meanwhile=lambda: self.vacate([(0, nbytes)]))
            except BaseException:
                self.restore_placeholder()
                raise
        self.apply(reply, fds)

    def decommit(self, to_nbytes: int) -> int:
        """Give back physical memory beyond ``to_nbytes``, in whole chunks: the arena
        keeps the smallest chunk boundary at or above it. Placeholder backing returns
        where it was asked for. Returns the new committed size. Synchronizes the device
        first: in-flight work on the range must finish."""
        self._check_open()
        if self._torch is not None:
            keep = max((c.offset + c.size for c in self._chunks.values() if c.offset < to_nbytes), default=0)
            self._torch.check_unused(keep, self.committed)
        reply, fds = self.core.channel.call(p.DecommitArena(name=self.name, to_nbytes=to_nbytes))
        self.apply(reply, fds)
        return self.committed

    def placeholder(self, offset: int = 0, nbytes: int | None = None, slot_bytes: int = DEFAULT_PLACEHOLDER_SLOT) -> None:
        """Back ``[offset, offset + nbytes)`` (default: the rest of the window) with a placeholder:
        one ``slot_bytes`` chunk aliased over every slot, granule-sized chunks at the edges. Graph
        capture then works there; commit later swaps in real memory at the same addresses.
        Writes to placeholder space land in shared scratch bytes: nothing there is kept."""
        self._check_open()
        nbytes = self.reserved - offset if nbytes is None else nbytes
        g = self.granularity
        if offset < 0 or nbytes <= 0 or offset % g or nbytes % g or offset + nbytes > self.reserved:
            raise InvalidArgument(
                f"placeholder range [{offset}, {offset + nbytes}) must be granularity-aligned ({g}) and inside "
                f"arena '{self.name}' ({self.reserved} bytes)"
            )
        if not self._placeholder_lock.acquire(timeout=self.core.timeout):
            raise MappingError(f"arena '{self.name}': another thread's placeholder() waited on gpumemd over {self.core.timeout:g}s")
        try:
            if self._placeholder_fds and slot_bytes not in self._placeholder_fds:
                raise InvalidArgument(f"arena '{self.name}' already uses {max(self._placeholder_fds)}-byte placeholder slots")
            chunks: list[p.ChunkView] = []
            fds: dict[int, int] = {}
            if not self._placeholder_fds:
                reply, fds = self.core.channel.call(p.PlaceholderArena(name=self.name, slot_bytes=slot_bytes))
                chunks = reply.chunks
            with self._mapping():
                if self._released:
                    fdchannel.close_all(list(fds.values()))
                    raise SessionClosed(f"arena '{self.name}' was released by this process while the daemon answered")
                if chunks:
                    self._placeholder_fds = {c.size: fds[c.id] for c in chunks}
                    self._placeholder_ids = [c.id for c in chunks]
                self._cover = merge(self._cover + [(offset, offset + nbytes)])
                self._restore_placeholder()
        finally:
            self._placeholder_lock.release()
        self._backing_changed()

    def share(self, client: str | None = None, *, uid: int | None = None, gid: int | None = None, read_only: bool = False) -> str:
        """Grant attach rights to this arena; returns the grant's token. The grant admits
        sessions whose identity matches everything it names: ``client`` (the name given
        to ``connect``; alone, it means that name under this process's uid), ``uid``,
        ``gid`` (the peer's primary gid), as the kernel reports them. The token, handed to
        another engine out of band (``attach_arena(name, token=...)``), admits it under
        any uid where only ``client`` was named, and anyone where nothing was; what the
        share names explicitly still applies. Keep it secret; ``unshare(token)`` revokes.
        ``read_only``: the sessions it admits map the arena for reading only (a standby
        engine mapping the weights: on the host backend its descriptors cannot map
        writable; on CUDA its mapping has read access only, which its own driver calls
        could change: docs/architecture.md, "Read-only grants")."""
        self._check_open()
        for what, value in (("uid", uid), ("gid", gid)):
            if value is not None and value < 0:
                raise InvalidArgument(f"{what} {value} is not a valid id; leave it out to admit any {what}")
        reply: p.ShareReply = self.core.call(
            p.ShareArena(
                name=self.name, client=client or "", uid=-1 if uid is None else uid, gid=-1 if gid is None else gid, read_only=read_only
            )
        )
        return reply.token

    def unshare(self, token: str) -> None:
        """Revoke the grant ``share`` returned ``token`` for: new attaches it would admit
        are refused. Sessions attached already stay attached and keep what they map."""
        self._check_open()
        self.core.call(p.UnshareArena(name=self.name, token=token))

    def sync(self) -> None:
        """Map what was committed since, unmap what was retired since."""
        self._check_open()
        reply, fds = self.core.channel.call(p.SyncArena(name=self.name))
        self.apply(reply, fds)

    def release(self) -> None:
        """Unmap everything and give the arena back (an owner destroys it, a sharer
        detaches). Tensors on it must be gone: their memory disappears here."""
        self._check_open()
        if self._torch is not None:
            self._torch.check_unused(0, self.reserved, cached_ok=True)
        borrowed = [bp for bp in self.core.borrow_pools.values() if bp.arena == self.name]
        for bp in borrowed:
            live = bp.live_bytes()
            if live:
                raise InvalidArgument(
                    f"arena '{self.name}' still holds {live} bytes of tensors borrowed from graph pool {bp.pool_id} "
                    f"('{bp.label}', scope '{bp.escaped_scope or '?'}'): their memory would disappear; free them first"
                )
        for bp in borrowed:
            self.core.close_borrow_pool(bp.pool_id)
        if self._torch is not None:
            self._torch.retire()
        if self._allocator is not None:
            self._allocator.retire(keep_slot=self._torch is not None)
        with self._mapping():
            self._check_open()  # released by another thread meanwhile
            mapped = [(c.offset, c.size) for c in self._chunks.values()] + list(self._aliases.items())
            self.core.driver.unmap_many(self.address, mapped)
            self._aliases.clear()
            self._chunks.clear()
            fdchannel.close_all(list(self._placeholder_fds.values()))
            self._placeholder_fds.clear()
            self._placeholder_ids.clear()
            self._released = True
        self.core.drop_arena(self.name)
        self.core.call(p.ReleaseArena(name=self.name))

    def holding(self) -> p.Holding:
        """The chunks this process maps here, as a resume reports them to a restarted daemon."""
        return p.Holding(arena=self.name, chunks=list(self._chunks) + self._placeholder_ids)

    def _check_open(self) -> None:
        if self._released:
            raise SessionClosed(f"arena '{self.name}' was released by this process")
        if self.core.closed:
            raise SessionClosed(f"arena '{self.name}' belongs to a closed session ('{self.core.name}')")

    # ------------------------------------------------------------------ introspection

    def backed_ranges(self) -> Ranges:
        """Offsets that are mapped here, committed or placeholder (merged)."""
        return merge(self.committed_ranges() + [(o, o + size) for o, size in self._aliases.items()])

    def committed_ranges(self) -> Ranges:
        return merge([(c.offset, c.offset + c.size) for c in self._chunks.values()])

    @property
    def mapped_bytes(self) -> int:
        """Committed bytes mapped in this process (placeholders not counted)."""
        return sum(c.size for c in self._chunks.values())

    @property
    def placeholder_fds(self) -> dict[int, int]:
        """This arena's placeholder chunks as fds by size (still its own: a reservation
        aliases them over a retained group's windows, gpumem.standby)."""
        return dict(self._placeholder_fds)

    @property
    def placeholder_bytes(self) -> int:
        return sum(self._aliases.values())

    def _check_range(self, offset: int, size: int) -> None:
        end = offset + size
        if offset < 0 or size < 0 or not any(a <= offset and end <= b for a, b in self.committed_ranges()):
            raise InvalidArgument(
                f"range [{offset}, {end}) of arena '{self.name}' is not committed memory mapped in this process "
                f"(committed {self.committed} bytes; a sharer may need sync())"
            )

    # ------------------------------------------------------------------ data access

    def write(self, offset: int, data: bytes) -> None:
        """Copy host bytes into committed memory (a convenience for tools and tests)."""
        self._check_open()
        if self.read_only:
            raise PermissionDenied(f"arena '{self.name}' is mapped read-only here (attached through a read-only grant)")
        self._check_range(offset, len(data))
        self.core.driver.write(self.address + offset, data)

    def read(self, offset: int, size: int) -> bytes:
        """Copy ``size`` committed bytes at ``offset`` out to the host (a convenience for
        tools and tests, on either backend; engines use ``view`` or ``tensor``). The range
        must be backed: reading what is not committed raises InvalidArgument."""
        self._check_open()
        self._check_range(offset, size)
        return self.core.driver.read(self.address + offset, size)

    def view(self, offset: int = 0, nbytes: int | None = None) -> RawView:
        """Bytes ``[offset, offset + nbytes)`` as a framework-agnostic view (DLPack,
        ``__cuda_array_interface__`` on CUDA, ``__array_interface__`` on the host
        backend). The range may be virtual-only: touching it before it is backed faults."""
        self._check_open()
        nbytes = self.reserved - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > self.reserved:
            raise InvalidArgument(f"view [{offset}, {offset + nbytes}) is outside arena '{self.name}' ({self.reserved} bytes)")
        if self.core.backend == "cuda":
            return RawView(self.address + offset, nbytes, "cuda", self.core.device_ordinal or 0, owner=self)
        return RawView(self.address + offset, nbytes, "cpu", owner=self)

    # ------------------------------------------------------------------ allocation

    def allocator(self) -> ArenaAllocator:
        """The arena's native allocator slot (gpumem.elastic): torch's pool allocates
        through it; on the host backend, callers use its slot directly."""
        self._check_open()
        if self._allocator is None:
            from gpumem.elastic import ArenaAllocator

            self._allocator = ArenaAllocator(self, self.core.device_ordinal or 0)
        return self._allocator

    def set_elastic(self, step: int | None = None, cap: int | None = None) -> Arena:
        """Commit on demand: when the allocator meets unbacked space, commit up to the
        request's end rounded up to ``step`` bytes (256 MiB by default), never past
        ``cap`` (default: the whole reservation). Owner only. Returns the arena."""
        from gpumem.elastic import DEFAULT_STEP

        if not self.is_owner:
            raise InvalidArgument(f"arena '{self.name}' belongs to '{self.owner_name}': only its owner commits to it")
        self.allocator().set_elastic(DEFAULT_STEP if step is None else step, cap)
        return self

    def usage(self) -> ArenaUsage:
        """Committed, in use, peak (the allocator's high-water mark), free, cap."""
        return self.allocator().usage()

    def trim(self) -> int:
        """Give back the whole chunks that lie above the allocator's peak; returns the
        bytes given back. Tensors and torch's cached blocks all lie below the peak."""
        before = self.committed
        target = self.allocator().trim_target()
        if target >= before:
            return 0
        return before - self.decommit(target)

    # ------------------------------------------------------------------ torch

    @property
    def mem_pool(self) -> Any:
        """A ``torch.cuda.MemPool`` allocating inside this arena (for
        ``torch.cuda.graph(g, pool=arena.mem_pool.id)`` or ``use_mem_pool``)."""
        return self.torch_pool().pool

    def torch_pool(self) -> ArenaPool:
        self._check_open()
        if self._torch is None:
            from gpumem.torch_support import ArenaPool

            self._torch = ArenaPool(self)
        return self._torch

    @contextlib.contextmanager
    def allocating(self, *, virtual: bool = False) -> Iterator[ArenaPool]:
        """Route this thread's torch allocations into the arena. Requests must land on
        backed (committed or placeholder) space unless ``virtual=True``, which lays out
        virtual-only tensors that nothing may touch before their memory is committed.
        Running out of space raises ``gpumem.ArenaOutOfMemory`` naming the arena."""
        with self.torch_pool().routing(virtual=virtual) as pool:
            yield pool

    @contextlib.contextmanager
    def capturing(self) -> Iterator[ArenaPool]:
        """Within this block, this thread's CUDA-graph captures that name no pool
        (``torch.cuda.graph(g)``) capture into this arena's pool. See
        gpumem.capture_routing."""
        from gpumem.capture_routing import capturing

        with capturing(self) as pool:
            yield pool

    def register_graph_pool(
        self,
        label: str,
        *,
        shared: bool = False,
        extents: Sequence[ExtentLike] | None = None,
        free_runs: Sequence[ExtentLike] | None = None,
    ) -> GraphPool:
        """Register the graphs captured into this arena's pool with the daemon (extents
        and free runs; owner only). ``shared``: clients the arena is shared with may
        open the pool, take its leases and borrow its free runs. ``extents`` and
        ``free_runs`` (gpumem.Extent or (offset, size) pairs, offsets from the arena's
        base) describe a pool laid out by other means than the arena's torch pool. See
        gpumem.graph_pools."""
        from gpumem.graph_pools import GraphPool

        self._check_open()
        return GraphPool.register(self, label, shared=shared, extents=extents, free_runs=free_runs)

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """A torch tensor over the arena's bytes at ``offset``, outside any pool (for
        layouts the engine computes itself, like KV buffers). The bytes may be
        virtual-only; decommit can take them back once nothing uses the tensor."""
        from gpumem.torch_support import tensor

        return tensor(self, offset, shape, dtype)

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else f"shared by {self.owner_name}"
        return f"<gpumem.Arena '{self.name}' {role} at {self.address:#x} committed {self.committed}/{self.reserved}>"
