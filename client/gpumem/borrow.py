"""Borrowing a graph pool's free runs: step-local tensors in memory the pool's graphs
use only while they replay.

    with session.borrow(pool, user="EAGLE probability borrow"):
        target_probs = torch.softmax(logits, dim=-1)     # lands in the pool's free runs
        ...
        del target_probs                                 # before the scope ends

A borrow holds the pool's borrow lease, so no replay or capture runs meanwhile (in any
process). Inside it, this thread's torch allocations go to a borrow ``MemPool`` whose
native allocator bump-allocates over the free runs (first fit, at most 64 runs); off
torch, ``Borrow.allocate`` hands out raw views the same way. What no run can hold is an
out-of-memory error, never memory from elsewhere.

The borrow pool persists across scopes (torch caches its blocks, so a steady step costs
no allocator calls) and is rebuilt when the runs change (a new epoch), when torch gave
segments back (freed bytes), or when the bump cursor passed half the runs. A capture
lease retires it: capture re-carves the pool's free space. It serves one stream, the
one its first borrow ran on: torch caches blocks per stream, and the lease orders only
that stream's work.

At scope exit, a borrowed tensor still alive is an error naming the scope, and the
pool's lease slot is marked: every replay and capture, in any process, is refused until the
tensor is freed and this process notices (at its next lease on the pool) or exits. The
check asks torch whether the pool holds any allocated block (a pass over the device's
allocated blocks in C++, no Python object per block) and the raw views' table; only an
escape, or a scope that starts beside earlier escaped blocks, counts the bytes from
torch's snapshot of the pool.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

from gpumem_shared.lease_table import LeaseKind
from gpumem.allocator import FAIL_STREAM, MAX_EXTENTS, Slot
from gpumem.errors import BorrowEscaped, BorrowOutOfMemory, BorrowStreamMismatch, GpuMemError, InvalidArgument
from gpumem.leases import Lease, current_stream
from gpumem.torch_support import PoolRoute
from gpumem.views import RawView

if TYPE_CHECKING:
    from gpumem.graph_pools import GraphPool
    from gpumem.core import SessionCore

ALIGNMENT = 512

# torch's caching allocator sizes (c10/cuda/CUDACachingAllocator.cpp): a block rounds up
# to 512 bytes; a segment holding it is 2 MiB for requests up to 1 MiB, 20 MiB below
# 10 MiB, else the request rounded up to 2 MiB.
_MIN_BLOCK = 512
_SMALL_SIZE = 1 << 20
_SMALL_BUFFER = 2 << 20
_MIN_LARGE_ALLOC = 10 << 20
_LARGE_BUFFER = 20 << 20
_ROUND_LARGE = 2 << 20

# Every borrow pool of the process, for memory_reserved().
_LIVE_POOLS: weakref.WeakSet[BorrowPool] = weakref.WeakSet()

# Streams whose cuBLAS workspaces exist: a GEMM's first call on a stream allocates one
# and keeps it for the process's life, which must not happen inside borrowed storage.
_WARM_STREAMS: set[tuple[int, int]] = set()


def torch_block_size(nbytes: int) -> int:
    return max(_MIN_BLOCK, -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK)


def torch_segment_size(nbytes: int) -> int:
    """The segment torch asks a pool's allocator for, to serve ``nbytes`` with no cached
    block to reuse."""
    size = torch_block_size(nbytes)
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


class _Block:
    """A raw borrowed block; given back when the last view of it goes."""

    __slots__ = ("pool", "address", "nbytes", "__weakref__")

    def __init__(self, pool: BorrowPool, address: int, nbytes: int) -> None:
        self.pool, self.address, self.nbytes = pool, address, nbytes

    def __del__(self) -> None:
        self.pool.raw_free(self.address, self.nbytes)


class BorrowPool:
    """This process's allocator over one graph pool's free runs (see the module doc)."""

    def __init__(self, core: SessionCore, pool: GraphPool, stream: int) -> None:
        self.pool_id = pool.id
        self.label = pool.label
        self.arena = pool.arena.name
        self.device = core.device_ordinal if core.device_ordinal is not None else 0
        self.stream = stream
        self.slot = Slot(device=self.device, alignment=ALIGNMENT)
        self.slot.bind_stream(stream)
        self.runs_key: tuple[int, tuple[tuple[int, int], ...]] | None = None
        # The pool's epoch and free-run list when runs_key was taken: while both are the
        # same objects, the key is too (the daemon bumps the epoch on every change of
        # the runs, and a refresh replaces the list), so a scope's entry skips rebuilding it.
        self.seen_epoch = -1
        self.seen_runs: object = None
        self.capacity = 0
        self.torch_pool: Any = None
        self.route: PoolRoute | None = None  # a thread's torch allocations into torch_pool
        self.raw_live: dict[int, int] = {}
        self.escaped_scope: str | None = None  # the scope whose tensors outlived it
        self.builds = 0
        _LIVE_POOLS.add(self)

    # ------------------------------------------------------------------ lifecycle

    def ensure(self, pool: GraphPool, use_torch: bool) -> int:
        """Ready to serve from ``pool``'s current runs: rebuild when they changed, when
        torch gave segments back, or when the cursor passed half of them. Returns the
        slot's failure count as the scope starts."""
        ready = self.runs_key is not None and (self.torch_pool is not None or not use_torch)
        if ready and self.seen_runs is pool.free_runs and self.seen_epoch == pool.epoch:
            # The steady step: the same runs, nothing given back, room left.
            failures, cursor, freed = self.slot.counters()
            if not freed and cursor <= self.capacity // 2:
                return failures
        key = (pool.epoch, tuple((r.offset, r.size) for r in pool.free_runs[:MAX_EXTENTS]))
        if ready:
            failures, cursor, freed = self.slot.counters()
            if key == self.runs_key and not freed and cursor <= self.capacity // 2:
                self.seen_epoch, self.seen_runs = pool.epoch, pool.free_runs
                return failures
            live = self.live_bytes()
            if live:
                if key == self.runs_key:
                    return failures  # blocks are live: keep serving around them, rebuild once they are gone
                raise BorrowEscaped(
                    f"graph pool {pool.id} ('{pool.label}') has new free runs (epoch {pool.epoch}), but {live} bytes "
                    f"borrowed from its old runs in scope '{self.escaped_scope or '?'}' are still alive: free them first"
                )
        self._build(pool, key, use_torch)
        self.seen_epoch, self.seen_runs = pool.epoch, pool.free_runs
        return self.slot.counters()[0]

    def _build(self, pool: GraphPool, key: tuple[int, tuple[tuple[int, int], ...]], use_torch: bool) -> None:
        base = pool.arena.address
        extents = []
        for offset, size in key[1]:
            start = -(-(base + offset) // ALIGNMENT) * ALIGNMENT
            end = (base + offset + size) // ALIGNMENT * ALIGNMENT
            if end > start:
                extents.append((start, end - start))
        # A torch pool holding segments goes first: its cached blocks lie on the addresses
        # the new extents hand out again. One that holds none is kept: scopes of raw views
        # rebuild at every entry, and an engine borrowing so in a loop on the H200 (torch
        # 2.11) died of SIGSEGV in this drop after a few rebuilds (creating and dropping
        # pools alone did not reproduce it). A pool per rebuild was also a pool too many.
        if self.torch_pool is not None and (not use_torch or _pool_segments(self.torch_pool)):
            self.torch_pool = self.route = None
        self.slot.set_extents(extents)
        self.capacity = sum(size for _, size in extents)
        self.runs_key = key
        if use_torch and self.torch_pool is None:
            self.torch_pool = _new_torch_pool(self)
            self.route = PoolRoute(sys.modules["torch"], self.torch_pool, self.device)
        self.builds += 1

    def retire(self) -> None:
        """Before a capture: the runs are about to be re-carved."""
        self.torch_pool = self.route = None
        self.slot.set_extents([])
        self.runs_key = None
        self.seen_runs = None
        self.capacity = 0

    def close(self) -> None:
        self.retire()
        self.slot.release()

    # ------------------------------------------------------------------ accounting

    def holds_nothing(self) -> bool:
        """No borrowed block is alive (the scope-exit check; ``live_bytes`` counts them)."""
        if self.raw_live:
            return False
        return self.route is None or _pool_is_empty(self.route)

    def live_bytes(self) -> int:
        """Bytes of borrowed blocks still in use: raw views, and torch tensors in the pool."""
        total = sum(self.raw_live.values())
        if self.torch_pool is not None:
            total += sum(segment["allocated_size"] for segment in _pool_segments(self.torch_pool))
        return total

    def raw_free(self, address: int, nbytes: int) -> None:
        if self.raw_live.pop(address, None) is not None:
            self.slot.free(address, nbytes, self.stream)

    def failure(self, nbytes: int, scope: str) -> GpuMemError:
        """The error for the request the slot refused last, by its reason."""
        stats = self.slot.stats()
        if stats.last_fail_reason == FAIL_STREAM:
            return BorrowStreamMismatch(
                f"borrow scope '{scope}' on graph pool {self.pool_id} ('{self.label}'): an allocation ran on another "
                f"stream than the borrow pool's ({self.stream:#x}); borrow on one stream, and allocate on it"
            )
        return BorrowOutOfMemory(
            f"borrow scope '{scope}' on graph pool {self.pool_id} ('{self.label}'): no free run holds "
            f"{stats.last_failed or nbytes} bytes ({stats.largest_free} left in the largest run of {self.capacity} "
            "borrowable bytes); borrowing never falls back to other memory: allocate it outside the scope",
            {"requested": stats.last_failed or nbytes, "available": stats.largest_free},
        )


def memory_reserved(device: int | None = None) -> int:
    """``torch.cuda.memory_reserved(device)`` without the borrow pools' segments. torch
    counts every segment of every pool, but a borrow pool's segments alias a graph
    pool's free runs: memory torch already counts in the graph pool (or that another
    process owns). This is the figure that says what borrowing saved."""
    from gpumem.torch_support import import_torch

    torch = import_torch("memory_reserved")
    aliases: int = sum(
        segment["total_size"]
        for pool in list(_LIVE_POOLS)
        if pool.torch_pool is not None and (device is None or pool.device == device)
        for segment in _pool_segments(pool.torch_pool)
    )
    return int(torch.cuda.memory_reserved(device)) - aliases


# torch's check of a pool's live allocations, once looked up: None where torch lacks it.
_LIVE_CHECK: list[Any] = []


def _pool_is_empty(route: PoolRoute) -> bool:
    """Whether the MemPool ``route`` leads to holds no allocated block. torch's check of a
    pool's live allocations against an expected set (the one its CUDA-graph trees use),
    with none expected; a torch without it counts the snapshot's bytes instead."""
    if not _LIVE_CHECK:
        _LIVE_CHECK.append(getattr(sys.modules["torch"]._C, "_cuda_checkPoolLiveAllocations", None))
    check = _LIVE_CHECK[0]
    if check is None:
        return not any(segment["allocated_size"] for segment in _pool_segments(route.pool))
    return bool(check(route.device, route.pool_id, set()))


def _pool_segments(pool: Any) -> list[dict[str, Any]]:
    import torch

    try:
        return list(torch.cuda.memory_snapshot(pool.id, include_traces=False))
    except TypeError:  # a torch without the include_traces switch
        return list(torch.cuda.memory_snapshot(pool.id))


def _new_torch_pool(bp: BorrowPool) -> Any:
    from gpumem.allocator import library_path
    from gpumem.torch_support import _KEEP, import_torch

    torch = import_torch("borrowing into torch tensors")
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), bp.slot.alloc_symbol, bp.slot.free_symbol)
    with torch.cuda.device(bp.device):
        pool = torch.cuda.MemPool(allocator.allocator())
    _KEEP.append(allocator)  # torch keeps raw pointers to its functions (see torch_support)
    return pool


# torch with CUDA available, once looked up (None: not installed, or no CUDA).
_TORCH_CUDA: list[Any] = []


def _torch_for(core: SessionCore) -> Any:
    """torch, where this borrow can route its allocations (the CUDA backend, torch with
    CUDA installed); None leaves raw ``allocate`` only."""
    if core.backend != "cuda":
        return None
    if not _TORCH_CUDA:
        try:
            import torch
        except ImportError:
            return None
        # Whether CUDA is available cannot change in a process once it is known.
        _TORCH_CUDA.append(torch if torch.cuda.is_available() else None)
    return _TORCH_CUDA[0]


def _warm_cublas(torch: Any, device: int, stream: int) -> None:
    if (device, stream) in _WARM_STREAMS:
        return
    # torch keys the workspaces by its stream object, not the raw handle: warm on the
    # very stream torch will be running (an ExternalStream over the same handle would
    # be another key).
    current = torch.cuda.current_stream(device)
    if int(current.cuda_stream) == stream:
        target = current
    elif stream == int(torch.cuda.default_stream(device).cuda_stream):
        target = torch.cuda.default_stream(device)
    else:
        target = torch.cuda.ExternalStream(stream, device=device)
    with torch.cuda.device(device), torch.cuda.stream(target):
        a = torch.ones((16, 16), device=f"cuda:{device}")
        torch.nn.functional.linear(a, a, a[0])  # cublasLt, with its own workspace
        a @ a
    _WARM_STREAMS.add((device, stream))


class Borrow:
    """A borrow of a graph pool's free runs (``session.borrow``): holds the borrow lease
    and routes this thread's torch allocations into the runs until ``release()`` or the
    end of its ``with`` block."""

    def __init__(self, core: SessionCore, pool: GraphPool, user: str, wait: float, stream: int | None) -> None:
        if not user:
            raise InvalidArgument("a borrow needs a user label (named to anyone it conflicts with)")
        self.core = core
        self.pool = pool
        self.user = user
        self._route: PoolRoute | None = None
        self._torch = _torch_for(core)
        self.stream = current_stream(core.device_ordinal) if stream is None else stream
        existing = core.borrow_pools.get(pool.id)
        if existing is not None and existing.stream != self.stream:
            raise BorrowStreamMismatch(
                f"graph pool {pool.id} ('{pool.label}') is borrowed on stream {existing.stream:#x} in this process "
                f"(where its first borrow ran); this borrow runs on stream {self.stream:#x}: torch caches a pool's "
                "blocks per stream, so borrow from one stream"
            )
        if self._torch is not None:
            _warm_cublas(self._torch, core.device_ordinal or 0, self.stream)
        self.lease = Lease.acquire(core.leasing, pool, LeaseKind.BORROW, user, wait, self.stream)
        try:
            if existing is None:
                existing = BorrowPool(core, pool, self.stream)
                core.add_borrow_pool(existing)
            self.borrow_pool = existing
            self._failures_before = existing.ensure(pool, self._torch is not None)
            # Blocks an earlier scope let escape are that scope's fault, not this one's.
            self._live_before = existing.live_bytes() if existing.escaped_scope else 0
            if existing.route is not None:
                existing.route.enter()
                self._route = existing.route
        except BaseException:
            self.lease.release()
            raise

    def allocate(self, nbytes: int) -> RawView:
        """``nbytes`` of the runs as a raw view (DLPack, array interfaces), on any backend;
        given back when the last reference to the view goes."""
        if not self.lease.held:
            raise InvalidArgument(f"borrow '{self.user}' on graph pool {self.pool.id} has ended")
        bp = self.borrow_pool
        address = bp.slot.alloc(nbytes, bp.stream)
        if not address:
            raise bp.failure(nbytes, self.user)
        bp.raw_live[address] = nbytes
        block = _Block(bp, address, nbytes)
        if self.core.backend == "cuda":
            return RawView(address, nbytes, "cuda", bp.device, owner=block)
        return RawView(address, nbytes, "cpu", owner=block)

    def can_fit(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` would be served now, with the allocator's
        rounding: a cached block of the pool (torch), or fresh space in a run."""
        bp = self.borrow_pool
        need = torch_segment_size(nbytes) if bp.torch_pool is not None else bp.slot.rounded(nbytes)
        if bp.slot.stats().largest_free >= need:
            return True
        if bp.torch_pool is None:
            return False
        block = torch_block_size(nbytes)
        kind = "small" if block <= _SMALL_SIZE else "large"  # torch serves each size class from its own segments
        return any(
            b["state"] == "inactive" and b["size"] >= block
            for segment in _pool_segments(bp.torch_pool)
            if segment.get("segment_type", kind) == kind
            for b in segment["blocks"]
        )

    def stop_routing(self) -> None:
        """Stop routing this thread's torch allocations into the runs; the lease stays
        held. What is allocated from now on lands where it would outside the borrow:
        the place to copy a borrowed result out before the scope ends."""
        if self._route is not None:
            self._route.exit()
            self._route = None

    def release(self, error: BaseException | None = None) -> None:
        """End the borrow: stop routing, check that nothing borrowed is still alive, give
        the lease back. Raises BorrowEscaped (after giving it back) if something is."""
        if not self.lease.held:
            return
        bp = self.borrow_pool
        live = 0
        try:
            if self._route is not None:
                self._route.exit()
                self._route = None
            live = 0 if not self._live_before and bp.holds_nothing() else bp.live_bytes() - self._live_before
            if live > 0 and self.pool.id not in self.core.leasing.escapes:
                # Marked while the lease is still ours: no replay can slip in between.
                self.core.leasing.report_escape(self.pool, bp, self.user)
            elif live > 0:
                bp.escaped_scope = self.user
        finally:
            self.lease.release()
        if live > 0 and error is None:
            raise BorrowEscaped(
                f"borrow scope '{self.user}' on graph pool {self.pool.id} ('{self.pool.label}') ended with {live} "
                "bytes of borrowed tensors still alive: the next replay would overwrite them; free them (del) inside "
                "the scope. Replay and capture of the pool are refused until they are gone",
                {"scope": self.user, "bytes": live},
            )

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        translated = None
        if isinstance(exc, RuntimeError) and not isinstance(exc, GpuMemError):
            # torch's out-of-memory error, when our allocator refused a request in this scope
            if self.borrow_pool.slot.stats().failures > self._failures_before:
                translated = self.borrow_pool.failure(0, self.user)
        self.release(error=exc)
        if translated is not None:
            raise translated from exc

    def __repr__(self) -> str:
        state = "held" if self.lease.held else "ended"
        return f"<gpumem.Borrow '{self.user}' on graph pool {self.pool.id} ({state})>"
