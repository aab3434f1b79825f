"""The host backend's descriptors: a chunk holds one for its life, so creating chunks
stops short of the open-file limit (the daemon's sockets need the rest), and every
failure is a DriverError that leaves no descriptor behind."""

from __future__ import annotations

import errno
import os
import resource

import pytest

from gpumem_shared.driver import DriverError
from gpumem_shared.driver import host
from gpumem_shared.driver.host import HOST_GRANULARITY as G, HostDriver

from .harness import open_fds


def lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


def test_chunks_stop_short_of_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = HostDriver(index=0, capacity=1 << 30)
    # A limit that leaves room for two more descriptors past the 64 kept free.
    limit = lowest_free_fd() + 64 + 2
    monkeypatch.setattr(host.resource, "getrlimit", lambda which: (limit, limit) if which == resource.RLIMIT_NOFILE else (0, 0))
    before = open_fds()
    with pytest.raises(DriverError, match="open-file limit") as info:
        driver.create_chunks([(0, G)] * 10)
    assert info.value.out_of_memory
    assert open_fds() == before, "a refused batch left descriptors open"
    handles = driver.create_chunks([(0, G)])
    driver.destroy_chunks([(0, G)], handles)
    assert open_fds() == before


def test_export_failure_is_a_driver_error_and_closes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = HostDriver(index=0, capacity=1 << 30)
    handles = driver.create_chunks([(0, G)] * 3)
    before = open_fds()
    real_dup = os.dup
    calls = iter(range(100))

    def dup(fd: int) -> int:
        if next(calls) == 2:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_dup(fd)

    monkeypatch.setattr(host.os, "dup", dup)
    try:
        with pytest.raises(DriverError) as info:
            driver.export_fds([(0, G, handle, False) for handle in handles])
        assert info.value.out_of_memory
    finally:
        monkeypatch.undo()
        assert open_fds() == before, "a failed export left duplicates open"
        driver.destroy_chunks([(0, G)] * 3, handles)


def _mappings_in(start: int, size: int) -> list[str]:
    """This process's mappings overlapping [start, start + size), from /proc/self/maps."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo < start + size and hi > start:
                found.append(line.split()[1] + (" " + line.split()[5] if len(line.split()) > 5 else ""))
    return found


def test_unmap_many_leaves_each_contiguous_run_reserved_and_nothing_else_touched() -> None:
    driver = HostDriver(index=0, capacity=1 << 30)
    window = driver.reserve(16 * G, 0x1000_0000_0000)
    handles = driver.create_chunks([(0, G)])
    fd = driver.export_fds([(0, G, handles[0], False)])[0]
    try:
        # A placeholder's shape: one chunk aliased over slots 0-3 and 6-7, slots 4-5 and
        # 8-15 left reserved; then slots 0-2 and 6 unmapped (two runs, one call each).
        driver.map_aliased(window, fd, G, [i * G for i in (0, 1, 2, 3, 6, 7)])
        driver.write(window + 3 * G, b"kept")
        driver.unmap_many(window, [(2 * G, G), (0, G), (G, G), (6 * G, G)])
        assert all(m.startswith("---p") for m in _mappings_in(window, 3 * G)), "slots 0-2 are reserved again"
        assert all(m.startswith("---p") for m in _mappings_in(window + 6 * G, G))
        assert all(m.startswith("rw-s") for m in _mappings_in(window + 3 * G, G)), "a slot between the runs stays mapped"
        assert driver.read(window + 3 * G, 4) == b"kept"
        assert all(m.startswith("rw-s") for m in _mappings_in(window + 7 * G, G))
        driver.unmap_many(window, [(3 * G, G), (7 * G, G)])
        assert all(m.startswith("---p") for m in _mappings_in(window, 16 * G))
    finally:
        os.close(fd)
        driver.destroy_chunks([(0, G)], handles)
        driver.free_reservation(window, 16 * G)
