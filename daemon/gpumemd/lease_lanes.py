"""The sequence chunk of memops lease ordering (``gpumemd --lease-ordering memops``;
gpumem_shared/lease_order.py describes the protocol).

One chunk per daemon, of the device's granularity: created like any other chunk (device
memory on CUDA, which a stream can write and wait on; a memfd on the host backend) and
granted with every shared graph pool's lease segment, so each user session maps it. The
daemon maps a view of its own, through which it zeroes the chunk at start (a fresh CUDA
chunk's bytes are not promised to be zero, and a stale word could reach a first value)
and writes a swept lane's value when its session may no longer use the pool.
"""

from __future__ import annotations

import logging

from gpumem_shared.driver import Driver, DriverError
from gpumem_shared.lease_order import WORD_BYTES, LaneBook

log = logging.getLogger("gpumemd.lease_lanes")


class SequenceChunk:
    def __init__(self, driver: Driver) -> None:
        self.driver = driver
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

    def grant(self, pool_id: int, session_id: int) -> tuple[int, int]:
        """(lane, base) of ``session_id``'s releases of ``pool_id`` (lease_order.LaneBook)."""
        return self.lanes.grant(pool_id, session_id)

    def sweep(self, pool_id: int, session_id: int) -> None:
        """``session_id`` may no longer use ``pool_id``: its lane is topped off, so no taker's
        stream waits past now on a value it took and never wrote (it died, or its context
        went with the write queued), and the lane goes to the next user a generation up."""
        freed = self.lanes.release(pool_id, session_id)
        if freed is None:
            return
        lane, value = freed
        try:
            self.driver.write(self.view + lane * WORD_BYTES, value.to_bytes(WORD_BYTES, "little"))
        except DriverError as exc:
            # The lane stays free in the book: its next holder starts a generation up, so
            # only takers already waiting on this lane are held (named in the log).
            log.error("graph pool %d: topping off session %d's lease ordering lane %d failed (%s); streams that "
                      "wait on it stay held", pool_id, session_id, lane, exc)

    def close(self) -> None:
        if self.view:
            self.driver.unmap(self.view, self.size)
            self.driver.free_reservation(self.view, self.size)
            self.view = 0
        if self.address:
            self.driver.destroy_chunks([(self.address, self.size)], [self.handle])
            self.driver.free_reservation(self.address, self.size)
            self.address = 0
