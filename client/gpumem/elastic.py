"""An arena's allocator: the native slot over the arena's window, the bytes it may hand
out, elastic growth, and the usage figures an engine reads.

    arena = session.create_arena("model", 64 << 30)      # virtual only
    arena.set_elastic(step=256 << 20)                    # commit on demand, in 256 MiB steps
    with arena.allocating():
        model = build_model()                            # the arena grows as torch asks
    arena.trim()                                         # give back whole chunks above the peak
    arena.usage()                                        # committed, in use, peak, free

The slot bump-allocates over the window and serves a request only on backed space. When
an elastic arena's request meets unbacked space, the native allocator calls back here
(with the GIL taken, in whatever thread torch allocated from) before failing: the arena
commits up to the request's end rounded up to ``step``, at most ``cap``, and the request
is tried once more. Where the commit cannot be made (the device is full, the cap is
reached) the request fails as before, and the routing scope's ``ArenaOutOfMemory`` says
why. torch's free callback is only counted (see gpumem.allocator): the high-water mark
is the peak, and ``trim`` gives back what lies above it.

No torch here: on the host backend the slot serves callers that play torch's part.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from gpumem.allocator import FAIL_DEVICE, FAIL_UNBACKED, Slot, SlotStats
from gpumem.errors import GpuMemError, InvalidArgument
from gpumem_shared import _native

if TYPE_CHECKING:
    from gpumem.arena import Arena

ALIGNMENT = 512
DEFAULT_STEP = 256 << 20


@dataclasses.dataclass(frozen=True)
class ArenaUsage:
    """An arena's figures, in bytes. ``peak`` is the allocator's high-water mark: what it
    handed out since it started (virtual-only layouts included), which frees never lower
    because freed space is not reused until the arena is released."""

    committed: int  # real memory the arena holds
    in_use: int  # handed out to torch (or the slot's caller) and not given back
    peak: int  # the high-water mark above
    free: int  # committed bytes above the peak: served without a commit
    cap: int  # the most an elastic arena commits (its reservation when not elastic)
    grows: int  # commits made on demand


class ArenaAllocator:
    """One arena's native slot (see the module doc); ``Arena.allocator()`` makes it."""

    def __init__(self, arena: Arena, device: int) -> None:
        self.arena = arena
        self.slot = Slot(device=device, alignment=ALIGNMENT)
        self.slot.set_extents([(arena.address, arena.reserved)])
        self.cap = arena.reserved
        self.step = 0  # 0: not elastic
        self.grows = 0
        self.grow_error: str | None = None  # why the last growth did not happen
        self.update_backing()

    def update_backing(self) -> None:
        base = self.arena.address
        self.slot.set_backing([(base + start, end - start) for start, end in self.arena.backed_ranges()])

    def set_elastic(self, step: int, cap: int | None) -> None:
        g = self.arena.granularity
        cap = self.arena.reserved if cap is None else cap
        if step <= 0 or step % g:
            raise InvalidArgument(f"growth step {step} of arena '{self.arena.name}' must be a positive multiple of {g}")
        if cap % g or not 0 < cap <= self.arena.reserved:
            raise InvalidArgument(
                f"cap {cap} of arena '{self.arena.name}' must be a multiple of {g} within its reservation of {self.arena.reserved}"
            )
        self.step, self.cap = step, cap
        if _native.slot_set_grow(self.slot.index, self._grow) != 0:
            raise InvalidArgument(f"arena '{self.arena.name}' has no allocator slot any more (released?)")

    def _grow(self, end: int) -> bool:
        """The native allocator's call: back the window up to ``end`` (an address). Runs
        inside torch's allocator, so it never raises: a failure is kept for the error."""
        arena = self.arena
        need = end - arena.address
        target = min(-(-need // self.step) * self.step, self.cap)
        if need > self.cap:
            self.grow_error = f"the request would end at offset {need}, past the arena's cap of {self.cap} bytes"
            return False
        try:
            arena.commit(max(target, arena.committed))
        except GpuMemError as exc:
            self.grow_error = f"committing {target - arena.committed} more bytes failed: {exc}"
            return False
        self.grows += 1
        self.grow_error = None
        return True

    def stats(self) -> SlotStats:
        return self.slot.stats()

    def usage(self) -> ArenaUsage:
        stats = self.slot.stats()
        committed = self.arena.committed
        return ArenaUsage(
            committed=committed,
            in_use=stats.cursor_bytes - stats.freed_bytes,
            peak=stats.cursor_bytes,
            free=max(0, committed - stats.cursor_bytes),
            cap=self.cap,
            grows=self.grows,
        )

    def refusal(self, stats: SlotStats) -> str:
        """Why the slot refused its last request (``stats`` read after the failure), in
        the words an ``ArenaOutOfMemory`` carries to torch's or CuPy's caller."""
        arena = self.arena
        cursor = stats.cursor_bytes
        if stats.last_fail_reason == FAIL_UNBACKED and self.step:
            return (
                f"arena '{arena.name}' could not grow for a request of {stats.last_failed} bytes at offset {cursor}: "
                f"{self.grow_error or 'the commit did not back it'} (committed {arena.committed}, cap {self.cap})"
            )
        if stats.last_fail_reason == FAIL_UNBACKED:
            return (
                f"arena '{arena.name}' cannot place a request of {stats.last_failed} bytes: the space at offset {cursor} "
                "is not backed; commit it, make the arena elastic (arena.set_elastic()), back it with arena.placeholder(), "
                "or lay out virtual-only torch tensors inside arena.allocating(virtual=True)"
            )
        if stats.last_fail_reason == FAIL_DEVICE:
            return f"arena '{arena.name}' (cuda:{self.slot.device}) was asked for memory on another device"
        return (
            f"arena '{arena.name}' cannot hold a request of {stats.last_failed} bytes: {stats.largest_free} bytes are "
            f"left of its {arena.reserved}-byte window ({cursor} handed out)"
        )

    def trim_target(self) -> int:
        """The committed size that keeps everything up to the peak."""
        g = self.arena.granularity
        return -(-self.slot.stats().cursor_bytes // g) * g

    def retire(self, *, keep_slot: bool) -> None:
        """The arena is going away: nothing more is served, growth stops. torch keeps raw
        pointers to a slot's entry points, so a slot torch used stays taken
        (``keep_slot``) and refuses every request."""
        _native.slot_set_grow(self.slot.index, None)
        self.slot.set_extents([])
        if not keep_slot:
            self.slot.release()
