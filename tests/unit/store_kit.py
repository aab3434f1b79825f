"""A stand-in for the service manager's fd store, for the unit tier, and a restart of a
harness's state through it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from gpumem_shared.driver.host import HostDriver
from gpumemd.durable import Durable
from gpumemd.state import DaemonState

from .harness import CAPACITY, Clock, Harness


class FakeStore:
    """The notifier's fd-store side, keeping dups by name as the manager would."""

    store_max = 1024

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def store(self, name: str, fd: int) -> None:
        self.held[name] = os.dup(fd)

    def unstore(self, name: str) -> None:
        os.close(self.held.pop(name))

    def barrier(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass

    def passed(self) -> dict[str, list[int]]:
        """What a start gets: dups, the store keeps its own."""
        return {name: [os.dup(fd)] for name, fd in self.held.items()}

    def drop(self) -> None:
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()


class StoredDaemon:
    """``h``'s daemon with a store of its own (``stored``): ``stop`` persists its state and
    ends it, ``restart`` rebuilds a fresh state from what the store passes on."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.store = FakeStore()
        self.first = Durable(self.store)  # type: ignore[arg-type]
        self.first.start(h.state, {})
        self.again: Harness | None = None
        self.second: Durable | None = None

    def stop(self) -> dict[str, list[int]]:
        """The state persisted and the daemon gone (its address slice freed, as with its
        death; the next state takes it): what the store passes to the next start."""
        self.first.persist(self.h.state)
        self.h.state.arenas.close()
        return self.store.passed()

    def restart(self, passed: dict[str, list[int]]) -> Harness:
        """A fresh state started from ``passed`` (what ``stop`` returned, or a test's changed copy)."""
        clock, wall = Clock(self.h.clock.now), Clock(self.h.wall_clock.now)
        self.again = Harness(DaemonState(HostDriver(index=0, capacity=CAPACITY), self.h.config, clock, wall), clock, wall)
        self.second = Durable(self.store)  # type: ignore[arg-type]
        self.second.start(self.again.state, passed)
        return self.again

    def close(self) -> None:
        if self.again is not None:
            self.again.state.drop_all()
        self.first.close()
        if self.second is not None:
            self.second.close()
        self.store.drop()


@contextlib.contextmanager
def stored(h: Harness) -> Iterator[StoredDaemon]:
    """``h``'s daemon with a store from here on, and all of it closed afterwards."""
    daemon = StoredDaemon(h)
    try:
        yield daemon
    finally:
        daemon.close()


@contextlib.contextmanager
def restarted(h: Harness) -> Iterator[DaemonState]:
    """``h``'s state persisted to a store of its own, the daemon gone, and a fresh state
    rebuilt from what the store passes on, as a restart does; all of it closed afterwards."""
    with stored(h) as daemon:
        yield daemon.restart(daemon.stop()).state
