"""The placeholder a standby aliases over a retained group's windows (standby.Reservation),
without a daemon: the big slots and the granules under each window, none past its end."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gpumem.standby import Reservation

MiB = 1 << 20
SLOT, GRANULE = 64 * MiB, 2 * MiB


class Driver:
    def __init__(self) -> None:
        self.mapped: list[tuple[int, int]] = []  # (address, size) of each placeholder mapping

    def map_aliased(self, start: int, fd: int, size: int, offsets: list[int]) -> None:
        self.mapped += [(start + o, size) for o in offsets]


def window(name: str, address: int, reserved: int) -> Any:
    return SimpleNamespace(arena=SimpleNamespace(name=name, address=address, reserved=reserved), kv=None)


def test_the_placeholder_covers_each_window_to_its_end_and_not_past_it() -> None:
    driver = Driver()
    core: Any = SimpleNamespace(driver=driver, claim_standby=lambda group, standby, windows: None)
    windows = [window("kv", 1 << 40, 2 * SLOT + 3 * GRANULE), window("w", (1 << 40) + 4 * SLOT, SLOT), window("g", 1 << 41, GRANULE)]
    reply: Any = SimpleNamespace(group="engine-a", objects=windows)
    scratch: Any = SimpleNamespace(placeholder_fds={SLOT: 10, GRANULE: 11})
    Reservation(core, reply, scratch, SLOT)._cover_all()
    for w in windows:
        start, end = w.arena.address, w.arena.address + w.arena.reserved
        pieces = sorted((a, s) for a, s in driver.mapped if start <= a < end)
        assert all(a + s <= end for a, s in pieces), f"a placeholder piece past the end of '{w.arena.name}': {pieces}"
        assert [a for a, _ in pieces] == [start, *(a + s for a, s in pieces[:-1])] and pieces[-1][0] + pieces[-1][1] == end
    assert sorted(driver.mapped)[:3] == [(1 << 40, SLOT), ((1 << 40) + SLOT, SLOT), ((1 << 40) + 2 * SLOT, GRANULE)]
