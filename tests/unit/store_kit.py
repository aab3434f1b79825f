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


@contextlib.contextmanager
def restarted(h: Harness) -> Iterator[DaemonState]:
    """``h``'s state persisted to a store of its own, the daemon gone (its address slice
    freed), and a fresh state rebuilt from what the store passes on, as a restart does;
    all of it closed afterwards."""
    store = FakeStore()
    first = Durable(store)  # type: ignore[arg-type]
    first.start(h.state, {})
    first.persist(h.state)
    h.state.arenas.close()
    again = DaemonState(HostDriver(index=0, capacity=CAPACITY), h.config, Clock(h.clock.now), Clock(h.wall_clock.now))
    second = Durable(store)  # type: ignore[arg-type]
    second.start(again, store.passed())
    try:
        yield again
    finally:
        again.drop_all()
        first.close()
        second.close()
        store.drop()
