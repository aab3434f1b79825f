"""An arena as a client sees it: the requests that change it (create, attach, commit,
decommit, placeholder, share, sync, release), raw data access, its allocator and the
torch facade. Its window (gpumem.window) holds what this process maps where, at the
daemon's planned address inside the daemon's address slice this process reserved
(gpumem.address_slices), and carries out the daemon's answers there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem.errors import InvalidArgument, MappingError, PermissionDenied
from gpumem.views import RawView
from gpumem.window import Ranges, Window

if TYPE_CHECKING:
    from gpumem.elastic import ArenaAllocator, ArenaUsage
    from gpumem.graph_pools import ExtentLike, GraphPool
    from gpumem.core import SessionCore
    from gpumem.torch_support import ArenaPool

MiB = 1 << 20
DEFAULT_PLACEHOLDER_SLOT = 64 * MiB


class Arena:
    """An arena of this session's (owned, or attached through a grant), mapped in its ``window``."""

    def __init__(self, core: SessionCore, view: p.ArenaView, *, owner: bool) -> None:
        self.core = core
        self.name = view.name
        self.owner_name = view.owner
        self.address = view.address
        self.reserved = view.reserved
        self.granularity = view.granularity
        self.is_owner = owner
        self.window = Window(core, view)
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
        """Carry out a reply that changed the arena's backing in its window
        (``Window.apply``: takes ownership of ``fds``), then let the allocator know."""
        self.window.apply(reply, fds)
        self._backing_changed()

    def vacate(self, ranges: Ranges) -> None:
        """``Window.vacate``: the placeholder under ``ranges`` goes while a request that
        maps real chunks there is with the daemon."""
        self.window.vacate(ranges)

    def restore_placeholder(self) -> None:
        """``Window.restore_placeholder``: after a request that ``vacate`` made room for failed."""
        self.window.restore_placeholder()

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
        if not self.window.aliases:  # no placeholder to swap out
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
            keep = max((c.offset + c.size for c in self.window.chunks.values() if c.offset < to_nbytes), default=0)
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
            held = self.window.placeholder_fds
            if held and slot_bytes not in held:
                raise InvalidArgument(f"arena '{self.name}' already uses {max(held)}-byte placeholder slots")
            chunks: list[p.ChunkView] = []
            fds: dict[int, int] = {}
            if not held:
                reply, fds = self.core.channel.call(p.PlaceholderArena(name=self.name, slot_bytes=slot_bytes))
                chunks = reply.chunks
            self.window.cover(offset, offset + nbytes, chunks, fds)
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
        self.window.release()
        self.core.drop_arena(self.name)
        self.core.call(p.ReleaseArena(name=self.name))

    def holding(self) -> p.Holding:
        """The chunks this process maps here, as a resume reports them to a restarted daemon."""
        return self.window.holding()

    def _check_open(self) -> None:
        self.window.check_open()

    # ------------------------------------------------------------------ introspection

    @property
    def committed(self) -> int:
        """Bytes committed, as of the daemon's last answer carried out here."""
        return self.window.committed

    @property
    def read_only(self) -> bool:
        """Attached through read-only grants: mapped for reading only."""
        return self.window.read_only

    def backed_ranges(self) -> Ranges:
        """Offsets that are mapped here, committed or placeholder (merged)."""
        return self.window.backed_ranges()

    def committed_ranges(self) -> Ranges:
        return self.window.committed_ranges()

    @property
    def mapped_bytes(self) -> int:
        """Committed bytes mapped in this process (placeholders not counted)."""
        return sum(c.size for c in self.window.chunks.values())

    @property
    def placeholder_fds(self) -> dict[int, int]:
        """This arena's placeholder chunks as fds by size (still its own: a reservation
        aliases them over a retained group's windows, gpumem.standby)."""
        return dict(self.window.placeholder_fds)

    @property
    def placeholder_bytes(self) -> int:
        return sum(self.window.aliases.values())

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
