"""Address slices in a client process, scenario by scenario, each in its own process
(host and CUDA alike: the driver is the session's own).

    python tests/slice_scenarios.py SCENARIO BACKEND [RUNTIME_DIR...]

The daemons are found in the runtime directories given (the first is also
$GPUMEMD_RUNTIME_DIR). Whether a range is reserved in this process is probed with the
driver itself: a reservation asked at an address that is taken lands elsewhere. A
scenario prints "PASS <name>" and exits 0, or fails with a traceback. Used by
tests/integration/test_address_slices.py.
"""

from __future__ import annotations

import re
import sys

import gpumem
from gpumem_shared.address_plan import plan_range
from gpumem_shared.driver import Driver

MiB = 1 << 20
GiB = 1 << 30
# The CUDA driver places small reservations (16 MiB and less, seen on an H200) wherever it
# likes: probes ask for more, so that only a taken address moves them.
PROBE = GiB


def probe_driver(backend: str) -> Driver:
    if backend == "cuda":
        from gpumem_shared.driver.cuda import CudaDriver

        return CudaDriver(0)
    from gpumem_shared.driver.host import HostDriver

    return HostDriver(0)


def taken(driver: Driver, address: int) -> bool:
    """Whether this process holds part of ``[address, address + PROBE)`` reserved."""
    got: int = driver.reserve(PROBE, address)
    driver.free_reservation(got, PROBE)
    return got != address


def round_trip(arena: gpumem.Arena, pattern: bytes) -> None:
    arena.write(arena.committed - len(pattern), pattern)
    assert arena.read(arena.committed - len(pattern), len(pattern)) == pattern


def shared_slice(backend: str, runtime_dir: str) -> None:
    """Two sessions of one daemon: one reservation, from the first arena until the
    last session closes."""
    probe = probe_driver(backend)
    base, end = plan_range(0)
    first = gpumem.connect(0, name="first", runtime_dir=runtime_dir)
    second = gpumem.connect(0, name="second", runtime_dir=runtime_dir)
    assert not taken(probe, base) and not taken(probe, end - PROBE), "a session without arenas reserves nothing"
    a = first.create_arena("a", GiB)
    a.commit(8 * MiB)
    assert first.address_slice().base == base and taken(probe, base) and taken(probe, end - PROBE)
    b = second.create_arena("b", 2 * GiB)
    b.commit(4 * MiB)
    assert second.address_slice() is first.address_slice() and first.address_slice().holders == 2
    round_trip(a, b"first")
    round_trip(b, b"second")
    a.release()
    first.close()
    assert taken(probe, base), "the slice went while another session maps an arena in it"
    round_trip(b, b"still there")
    c = second.create_arena("c", GiB)  # the window a left, in the slice still held
    c.commit(2 * MiB)
    round_trip(c, b"reused")
    second.close()
    assert not taken(probe, base) and not taken(probe, end - PROBE), "the last session left the slice reserved"
    again = gpumem.connect(0, name="again", runtime_dir=runtime_dir)  # reserved again from scratch
    d = again.create_arena("d", GiB)
    d.commit(2 * MiB)
    round_trip(d, b"again")
    again.close()
    assert not taken(probe, base)
    print("PASS shared_slice")


def collision(backend: str, runtime_dir: str) -> None:
    """Something else holds part of the slice: the first arena is a VaCollision naming
    the slice, and the daemon keeps no arena for it."""
    probe = probe_driver(backend)
    base, end = plan_range(0)
    squat = base + (1 << 40)
    assert probe.reserve(PROBE, squat) == squat, "could not set up the squatter"
    with gpumem.connect(0, name="collider", runtime_dir=runtime_dir) as s:
        try:
            s.create_arena("kv", GiB)
        except gpumem.VaCollision as exc:
            message = str(exc)
            assert f"[{base:#x}, {end:#x})" in message and f"gpumemd pid {s.daemon_pid}" in message, message
            assert "is taken in this process" in message, message
            offered = re.search(r"the driver offered (0x[0-9a-f]+)", message)
            assert offered is not None, message
        else:
            raise AssertionError("an arena was placed in a slice this process had partly taken")
        assert s.status().arenas == [], "the daemon kept the arena the client could not place"
        assert not taken(probe, int(offered.group(1), 16)), "the misplaced reservation was kept"
        probe.free_reservation(squat, PROBE)
        arena = s.create_arena("kv", GiB)  # once the range is free, it works
        arena.commit(2 * MiB)
        round_trip(arena, b"placed")
    print("PASS collision")


def other_daemon_same_slice(backend: str, first_dir: str, second_dir: str) -> None:
    """Two daemons of one device index (two runtime directories) plan the same slice:
    a process may map the arenas of one of them at a time."""
    with gpumem.connect(0, name="one", runtime_dir=first_dir) as one:
        with gpumem.connect(0, name="two", runtime_dir=second_dir) as two:
            arena = one.create_arena("kv", GiB)
            arena.commit(2 * MiB)
            try:
                two.create_arena("kv", GiB)
            except gpumem.VaCollision as exc:
                message = str(exc)
                assert f"gpumemd pid {one.daemon_pid}" in message and f"gpumemd pid {two.daemon_pid}" in message, message
            else:
                raise AssertionError("two daemons' arenas were placed in one slice of this process")
            assert two.status().arenas == []
            round_trip(arena, b"undisturbed")
            arena.release()
            one.close()
            moved = two.create_arena("kv", GiB)  # the first daemon's sessions are gone
            moved.commit(2 * MiB)
            round_trip(moved, b"second daemon")
    print("PASS other_daemon_same_slice")


def peers(backend: str, runtime_dir: str) -> None:
    """Sessions of devices 0 and 1 in one process: two slices side by side, each freed
    with its own last session."""
    probe = probe_driver(backend)
    (base0, _), (base1, _) = plan_range(0), plan_range(1)
    zero = gpumem.connect(0, name="rank-on-0", runtime_dir=runtime_dir)
    one = gpumem.connect(1, name="rank-on-1", runtime_dir=runtime_dir)
    a, b = zero.create_arena("shard", GiB), one.create_arena("shard", GiB)
    a.commit(2 * MiB)
    b.commit(2 * MiB)
    assert a.address == base0 and b.address == base1 and taken(probe, base0) and taken(probe, base1)
    round_trip(a, b"zero")
    round_trip(b, b"one")
    one.close()
    assert taken(probe, base0) and not taken(probe, base1)
    round_trip(a, b"zero again")
    zero.close()
    assert not taken(probe, base0)
    print("PASS peers")


SCENARIOS = {f.__name__: f for f in (shared_slice, collision, other_daemon_same_slice, peers)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
