"""The plan of address windows: the device's address slice, reserved once at start, and
every arena's window placed inside it.

Nothing is reserved per arena: clients reserve the same slice, so a window means the
same addresses in every process (gpumem_shared.address_plan), and planning one is
arithmetic over the windows that are live. The slice is this plan's only I/O (reserved
at start, freed at exit); the arena book keeps the windows themselves, on its records.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gpumem_shared import protocol as p
from gpumem_shared.driver import Driver, DriverError
from gpumem_shared.units import format_size

from gpumemd.config import GiB, StateConfig

log = logging.getLogger("gpumemd.arenas")  # the arena book's lines, its slice's included, under one name


class SliceUnavailable(Exception):
    """The slice cannot be reserved at its planned address; the message is what an operator sees."""


class WindowPlan:
    def __init__(self, driver: Driver, config: StateConfig, device: p.DeviceInfo) -> None:
        self.driver = driver
        self.base, self.limit = config.va_base, config.va_limit
        self.align = max(device.granularity, GiB)
        self._slice: tuple[int, int] | None = self._reserve(device.index)

    @property
    def size(self) -> int:
        return self.limit - self.base

    def _reserve(self, device_index: int) -> tuple[int, int]:
        base, size = self.base, self.size
        where = f"device {device_index}'s address slice [{base:#x}, {base + size:#x}) ({format_size(size)})"
        try:
            got = self.driver.reserve(size, base)
        except DriverError as exc:
            raise SliceUnavailable(
                f"cannot reserve {where}: {exc} (address space only, no memory: a 'ulimit -v' below it refuses it)"
            ) from None
        if got != base:
            self.driver.free_reservation(got, size)
            raise SliceUnavailable(
                f"cannot reserve {where} at its planned address: the driver placed it at {got:#x}, so something in "
                "the gpumemd process holds part of that range already (a preloaded library, a sanitizer's shadow memory)"
            )
        log.debug("reserved %s", where)
        return base, size

    def close(self) -> None:
        """Give the address slice back (at exit, once every arena is destroyed)."""
        if self._slice is None:
            return
        try:
            self.driver.free_reservation(*self._slice)
        except DriverError as exc:  # a chunk whose unmap failed at destroy: exit frees it all anyway
            log.warning("freeing the address slice at exit failed: %s", exc)
        self._slice = None

    def place(self, size: int, live: Iterable[tuple[int, int]]) -> int:
        """First fit between the ``live`` windows (address, size), inside the slice (no
        driver call: the slice is reserved whole in this process and in every client)."""
        align = self.align
        taken = sorted((address, address + window) for address, window in live)
        hint = self.base
        for start, end in taken:
            if (hint + size + align - 1) // align * align + align <= start:  # a guard step before it too
                break
            hint = max(hint, (end + align - 1) // align * align + align)  # one guard step between windows
        if hint + size > self.limit:
            raise p.ProtocolError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"no free virtual window of {size} bytes left in the daemon's plan range; release arenas first",
                requested=size,
            )
        return hint
