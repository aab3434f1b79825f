"""Driver backends: ``cuda`` (cuda.bindings.driver) and ``host`` (memfd + mmap)."""

from gpumem_shared.driver.base import Driver, DriverError, DriverUnavailable, PeerAccessError, align_up

__all__ = ["Driver", "DriverError", "DriverUnavailable", "PeerAccessError", "align_up"]
