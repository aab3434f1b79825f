"""A stand-in for the service manager's fd store, for the unit tier."""

from __future__ import annotations

import os


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
