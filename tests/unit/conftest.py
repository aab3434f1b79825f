"""Fixtures for the unit tier: a ``DaemonState`` on the real host driver, no zmq, no daemon.

The host driver is cheap (a chunk is a memfd that is only ftruncated, a window is a
PROT_NONE mapping), so every test gets a fresh state. At teardown the state drops
everything and the fixture checks that the process got all its descriptors and
address space back: a leaked memfd or window fails the test that leaked it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpumem_shared.driver.host import HostDriver
from gpumem_shared.lease_table import LeaseSegment
from gpumemd.config import StateConfig
from gpumemd.state import DaemonState

from .harness import BULK, CAPACITY, WATCHED_SPAN, Clock, Harness, mapped_ranges, open_fds
from .lease_kit import EPOCH, fresh_segment


@pytest.fixture
def make_harness() -> Iterator[Callable[..., Harness]]:
    """``make_harness(capacity=..., driver=..., **StateConfig fields)``; each one is torn down and
    checked for leaked descriptors and windows."""
    made: list[tuple[Harness, int, list[tuple[int, int]]]] = []

    def make(capacity: int = CAPACITY, driver: HostDriver | None = None, **config: Any) -> Harness:
        baseline = open_fds()
        va_base = config.get("va_base", StateConfig.va_base)
        windows = mapped_ranges(va_base, va_base + WATCHED_SPAN)
        config.setdefault("bulk_chunk", BULK)
        config.setdefault("kv_chunk", BULK)
        clock, wall_clock = Clock(1000.0), Clock(1_700_000_000.0)
        driver = driver or HostDriver(index=0, capacity=capacity)
        state = DaemonState(driver, StateConfig(index=0, **config), clock, wall_clock)
        harness = Harness(state, clock, wall_clock)
        made.append((harness, baseline, windows))
        return harness

    yield make
    for harness, baseline, windows in reversed(made):
        va_base = harness.state.config.va_base
        harness.state.drop_all()
        assert open_fds() == baseline, "the daemon state leaked descriptors (memfd chunks)"
        assert mapped_ranges(va_base, va_base + WATCHED_SPAN) == windows, "the daemon state leaked address-space windows"


@pytest.fixture
def h(make_harness: Callable[..., Harness]) -> Harness:
    return make_harness()


@pytest.fixture
def table() -> Iterator[LeaseSegment]:
    """One lease segment as the daemon creates one, its epoch set; closed after the test."""
    seg = fresh_segment()
    seg.set_epoch(EPOCH)
    yield seg
    seg.close()
