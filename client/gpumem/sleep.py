"""Sleep and wake: an arena (or a KV pool) hands its memory back to the device and gets
it again at the same virtual addresses, its contents restored where they were kept.

What is kept goes to the arena's host buffer: a memfd the daemon creates, accounts
against its host limit and keeps in its fd store (so it outlives an engine's or the
daemon's restart), mapped here and registered with the driver once (on CUDA
page-locked, so every later sleep and wake copies at pinned bandwidth; the buffer stays
between cycles for that reason, until ``free_host``). This process does the copies:
it maps both sides, and on CUDA holds the context and the streams.

    sleeper = ArenaSleep(arena)
    sleeper.prepare()            # optional: the host buffer made and registered ahead
    sleeper.sleep(keep=True)     # copied out, chunks back to the device
    ...another process commits the memory meanwhile...
    sleeper.wake()               # same addresses, contents back

A KV pool sleeps by the KV book's own moves: shrunk to nothing (a shrink that says it
sleeps: the daemon shows it asleep and asks nothing of it meanwhile), grown back to its
rows on wake (a grow that does not fit asks pools above their fair share to give back).
Both kinds of wake are one request the daemon answers when the memory is there, or at
the end of the wake's ``wait``.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import TYPE_CHECKING

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem.errors import DaemonTimeout, InvalidArgument, OutOfMemory

if TYPE_CHECKING:
    from gpumem.arena import Arena
    from gpumem.kv_pool import KvPool

# How long a wake waits, by default, for memory others hold to come free.
DEFAULT_WAKE_WAIT_S = 30.0
# Past the wait the daemon was given, how long its answer may take to come.
_ANSWER_S = 10.0


class HostBuffer:
    """An arena's host buffer mapped in this process and registered with the driver."""

    def __init__(self, arena: Arena, buffer_id: int, fd: int, size: int) -> None:
        self.driver = arena.core.driver
        self.id = buffer_id
        self.size = size
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._anchor = ctypes.c_char.from_buffer(self._map)  # the mapping's address; released before it closes
        self.address = ctypes.addressof(self._anchor)
        try:
            self.driver.host_register(self.address, size)
        except BaseException:
            self._unmap()
            raise

    def read(self, offset: int, size: int) -> bytes:
        return ctypes.string_at(self.address + offset, size)

    def close(self) -> None:
        if self._map.closed:
            return
        try:
            self.driver.host_unregister(self.address)
        finally:
            self._unmap()

    def _unmap(self) -> None:
        del self._anchor
        self._map.close()


class ArenaSleep:
    """One arena's sleep and wake (a KV pool's, given ``kv``), with its host buffer."""

    def __init__(self, arena: Arena, kv: KvPool | None = None) -> None:
        if not arena.is_owner:
            raise InvalidArgument(f"arena '{arena.name}' belongs to '{arena.owner_name}': only its owner puts it to sleep")
        self.arena = arena
        self.kv = kv
        self.asleep = False
        self.host: HostBuffer | None = None
        self._kept: list[tuple[int, int]] = []  # (offset, size) of the arena, packed into the buffer in order
        self._tokens = 0  # a KV pool's rows at its sleep

    @property
    def kept_bytes(self) -> int:
        return sum(size for _, size in self._kept)

    def sleep(self, keep: bool) -> None:
        """Copy what is committed to the host buffer (``keep``), then hand every chunk
        back. The arena's window, its graph pools and their leases stay; its memory must
        not be touched until ``wake``."""
        if self.asleep:
            raise InvalidArgument(f"arena '{self.arena.name}' is asleep already")
        arena = self.arena
        kept = [(start, end - start) for start, end in arena.committed_ranges()] if keep else []
        nbytes = sum(size for _, size in kept)
        if nbytes:
            host = self._buffer(nbytes)
            arena.core.driver.copy_to_host(self._copies(kept, host, arena.committed_ranges()))
        if self.kv is not None:
            self._tokens = self.kv.tokens
            if self._tokens:
                self.kv.shrink(0, sleep=True, kept_bytes=nbytes)
        else:
            reply, fds = arena.core.channel.call(p.SleepArena(name=arena.name, kept_bytes=nbytes))
            arena.apply(reply, fds)
        self._kept = kept
        self.asleep = True

    def prepare(self, nbytes: int = 0) -> None:
        """Make the host buffer now, at least ``nbytes`` large (0: what is committed), so
        that the first ``sleep(keep=True)`` only copies. A buffer's first use maps it and
        registers it with the driver, which pins every page: on the H200 about 0.6 s a GiB
        of the daemon's shared memory (21 s for 32 GiB), a cost to pay where it is not in
        anyone's way, e.g. once the engine is built. The daemon accounts the buffer from
        now on, against its host limit."""
        if self.asleep:
            raise InvalidArgument(f"arena '{self.arena.name}' is asleep: its host buffer is in use")
        nbytes = nbytes or sum(end - start for start, end in self.arena.committed_ranges())
        if nbytes:
            self._buffer(nbytes)

    def wake(self, *, wait: float = DEFAULT_WAKE_WAIT_S) -> None:
        """Commit the arena again at the same offsets and copy back what was kept. Memory
        others hold is waited for up to ``wait`` seconds; then OutOfMemory names the
        figures and who holds it."""
        if not self.asleep:
            raise InvalidArgument(f"arena '{self.arena.name}' is not asleep")
        arena = self.arena
        if self.kv is not None:
            if self._tokens:
                self._wake_kv(wait)
        else:
            reply, fds = self._wake_call(wait)
            arena.apply(reply, fds)
        if self._kept:
            assert self.host is not None
            arena.core.driver.copy_to_device(self._copies(self._kept, self.host, arena.committed_ranges()))
        self.asleep = False

    def _copies(self, kept: list[tuple[int, int]], host: HostBuffer, mapped: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """(device address, host address, size) of each kept range, packed in the buffer
        in order, clipped to what is mapped now: a KV pool woken to its rows may map less
        than it did (a shrink may have left a chunk past its rows), and rows past them hold
        nothing the engine reads."""
        copies, at = [], 0
        for offset, size in kept:
            for start, end in mapped:
                lo, hi = max(start, offset), min(end, offset + size)
                if lo < hi:
                    copies.append((self.arena.address + lo, host.address + at + lo - offset, hi - lo))
            at += size
        return copies

    def _wake_call(self, wait: float) -> tuple[p.MapReply, dict[int, int]]:
        """ARENA_WAKE, sent once: the daemon answers when the memory is free (it asks KV
        pools above their fair share to give back meanwhile), or after ``wait`` s with
        OutOfMemory naming who holds it."""
        try:
            reply: p.MapReply
            reply, fds = self.arena.core.channel.call(p.WakeArena(name=self.arena.name, wait=wait), timeout=wait + _ANSWER_S)
        except DaemonTimeout as exc:
            raise DaemonTimeout(
                f"gpumemd did not answer the wake of arena '{self.arena.name}' within the {wait:g}s it may wait and "
                f"{_ANSWER_S:g}s more: check that gpumemd runs and answers (gpumemctl status) and its log ({exc})"
            ) from None
        return reply, fds

    def _wake_kv(self, wait: float) -> None:
        """Grow the KV pool back to all its rows (its blocks are the engine's: a part will
        not do), one KV_GROW that waits for them up to ``wait`` s: the daemon asks pools
        above their fair share to give back, again as they answer, and takes memory others
        free as it comes."""
        kv = self.kv
        assert kv is not None
        try:
            reply: p.KvCommitReply
            reply, fds = kv.core.channel.call(p.KvGrow(pool=kv.name, tokens=self._tokens, wait=wait), timeout=wait + _ANSWER_S)
        except OutOfMemory as exc:
            raise OutOfMemory(f"KV pool '{kv.name}' cannot wake within {wait:g}s: {exc.message}", {"tokens": self._tokens}) from None
        except DaemonTimeout as exc:
            raise DaemonTimeout(
                f"gpumemd did not answer the wake of KV pool '{kv.name}' within the {wait:g}s it may wait and {_ANSWER_S:g}s "
                f"more: check that gpumemd runs and answers (gpumemctl status) and its log ({exc})"
            ) from None
        kv.apply(reply, fds)
        if kv.tokens < self._tokens:
            raise OutOfMemory(
                f"KV pool '{kv.name}' cannot wake within {wait:g}s: it got {kv.tokens} of its {self._tokens} rows "
                f"(not answered: {', '.join(reply.unanswered) or 'none'}; gone: {', '.join(reply.gone) or 'none'})",
                {"tokens": self._tokens},
            )

    def _buffer(self, nbytes: int) -> HostBuffer:
        """The host buffer, at least ``nbytes`` large (a larger one replaces it)."""
        if self.host is not None and self.host.size >= nbytes:
            return self.host
        if self.host is not None:  # unmapped before the daemon lets go of it
            self.host.close()
            self.host = None
        core = self.arena.core
        reply: p.HostBufferReply
        reply, fds = core.channel.call(p.SleepBuffer(arena=self.arena.name, nbytes=nbytes))
        try:
            self.host = HostBuffer(self.arena, reply.buffer.id, fds[reply.buffer.id], reply.buffer.size)
        finally:
            fdchannel.close_all(list(fds.values()))  # the mapping holds the buffer now
        return self.host

    def free_host(self) -> None:
        """Give the host buffer back (not while asleep with contents in it)."""
        if self.asleep and self._kept:
            raise InvalidArgument(f"arena '{self.arena.name}' sleeps with its contents in its host buffer: wake it first")
        if self.host is not None:
            self.host.close()
            self.host = None
            self.arena.core.call(p.FreeSleepBuffer(arena=self.arena.name))

    def close(self) -> None:
        """Unmap the host buffer (the arena's release or the session's end frees it in the daemon)."""
        if self.host is not None:
            self.host.close()
            self.host = None

    def __repr__(self) -> str:
        state = f"asleep, {self.kept_bytes} bytes kept" if self.asleep else "awake"
        return f"<gpumem.ArenaSleep '{self.arena.name}' {state}, host buffer {self.host.size if self.host else 0}>"
