"""The sequence chunk of memops lease ordering (``gpumemd --lease-ordering memops``;
gpumem_shared/lease_order.py describes the protocol).

One chunk per daemon, of the device's granularity: created like any other chunk (device
memory on CUDA, which a stream can write and wait on; a memfd on the host backend) and
granted with every shared graph pool's lease segment, so each user session maps it. The
daemon maps a view of its own, through which it zeroes the chunk at start (a fresh CUDA
chunk's bytes are not promised to be zero, and a stale word could reach a first value)
and writes a swept lane's value when its session may no longer use the pool: at once,
so a taker's stream goes on, and again once the session's process is fenced (it can no
longer write what it mapped: fencing.py). A write its stream had queued may land between
the two and lower the word; after the second, nothing of it can, and only then is the
lane handed to a new session, whose values must never meet a late write of the last one.
"""

from __future__ import annotations

import logging

from gpumem_shared.driver import Driver, DriverError
from gpumem_shared.lease_order import WORD_BYTES, LaneBook

from gpumemd.fencing import Fence
from gpumemd.records import SessionRecord

log = logging.getLogger("gpumemd.lease_order_lanes")


class SequenceChunk:
    def __init__(self, driver: Driver, fence: Fence) -> None:
        self.driver = driver
        self.fence = fence
        # The process (pid, HELLO time) behind each lane held, for its fence; and the
        # lanes swept whose process may still write, with their swept value.
        self._writers: dict[int, tuple[int, float]] = {}
        self.draining: dict[int, tuple[int, int, float]] = {}  # lane -> (value, pid, since)
        self.size = driver.granularity
        self.address = driver.reserve(self.size, 0)  # where create_chunks places it (CUDA maps it there)
        try:
            (self.handle,) = driver.create_chunks([(self.address, self.size)])
        except BaseException:
            driver.free_reservation(self.address, self.size)
            raise
        self.fd = driver.chunk_fd(self.handle)
        # The daemon's own view, mapped from the fd as a client maps it: both backends
        # map that way (the host backend does not map at creation).
        self.view = 0
        try:
            view = driver.reserve(self.size, 0)
            try:
                driver.map_fds(view, [(self.fd, 0, self.size)])
            except BaseException:
                driver.free_reservation(view, self.size)
                raise
            self.view = view
            driver.write(self.view, bytes(self.size))
        except BaseException:
            self.close()
            raise
        self.lanes = LaneBook(self.size // WORD_BYTES)

    def grant(self, pool_id: int, s: SessionRecord) -> tuple[int, int]:
        """(lane, base) of session ``s``'s releases of ``pool_id`` (lease_order.LaneBook)."""
        lane, base = self.lanes.grant(pool_id, s.id)
        self._writers[lane] = (s.pid, s.since)
        return lane, base

    def sweep(self, pool_id: int, session_id: int) -> None:
        """``session_id`` may no longer use ``pool_id``: its lane is topped off, so no taker's
        stream waits past now on a value it took and never wrote (it died, or its context
        went with the write queued), and the lane goes to the next user a generation up."""
        freed = self.lanes.release(pool_id, session_id)
        if freed is None:
            return
        lane, value = freed
        pid, since = self._writers.pop(lane)
        self.draining[lane] = (value, pid, since)
        self._write(lane, value)

    def settle(self) -> None:
        """Each tick: the swept lanes whose process is fenced get their value again and go
        back to the book."""
        for lane, (value, pid, since) in list(self.draining.items()):
            if not self.fence(pid, since) and self._write(lane, value):
                del self.draining[lane]
                self.lanes.settle(lane)

    def _write(self, lane: int, value: int) -> bool:
        try:
            self.driver.write(self.view + lane * WORD_BYTES, value.to_bytes(WORD_BYTES, "little"))
            return True
        except DriverError as exc:
            # The lane stays out of the book: the next tick tries again.
            log.error("topping off lease ordering lane %d failed (%s); streams that wait on it stay held", lane, exc)
            return False

    def close(self) -> None:
        if self.view:
            self.driver.unmap(self.view, self.size)
            self.driver.free_reservation(self.view, self.size)
            self.view = 0
        if self.address:
            self.driver.destroy_chunks([(self.address, self.size)], [self.handle])
            self.driver.free_reservation(self.address, self.size)
            self.address = 0
