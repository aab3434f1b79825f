"""Session.close() while another thread of the client waits in a call: the call ends
at once with SessionClosed, and close() returns without waiting for that call's
deadline (a KV round's report waits up to the round's, 300 s by default). The call
then puts back the placeholder it had unmapped while close() unmaps the arena: the two
never change the arena's mappings at once, and nothing of it stays mapped."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import gpumem
from gpumemd_testkit import wait_status

# Far beyond what the test waits: a close() that waited for it would fail the test.
CALL_TIMEOUT_S = 120.0
CLOSE_WITHIN_S = 10.0
# How long each side waits, inside the driver, for the other to come in too: with the
# two serialized, one waits it out once (the other is held back until it leaves).
MEET_S = 2.0


class MeetingInDriver:
    """The first session's driver from close() on: the interrupted call's putting back
    of its placeholder (map_aliased) and close()'s unmapping (unmap_many) each wait,
    inside the driver and bounded, for the other to come in. Unserialized they always
    meet there (what a loaded machine hit now and then: close() closed the placeholder's
    descriptor under the call's mapping, or missed a mapping made after it listed them);
    ``met`` names each meeting. Like the CUDA driver, map_aliased takes its descriptor
    (a dup here: cuMemImportFromShareableHandle there) before it maps."""

    def __init__(self, driver: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.met: list[str] = []
        self._inside: set[str] = set()
        self._came = {"map_aliased": threading.Event(), "unmap_many": threading.Event()}
        self._guard = threading.Lock()
        map_aliased, unmap_many = driver.map_aliased, driver.unmap_many

        def aliased(address: int, fd: int, size: int, offsets: list[int]) -> None:
            taken = os.dup(fd)
            try:
                self._meet("map_aliased", "unmap_many", lambda: map_aliased(address, taken, size, offsets))
            finally:
                os.close(taken)

        def unmapped(address: int, ranges: list[tuple[int, int]]) -> None:
            self._meet("unmap_many", "map_aliased", lambda: unmap_many(address, ranges))

        monkeypatch.setattr(driver, "map_aliased", aliased)
        monkeypatch.setattr(driver, "unmap_many", unmapped)

    def _meet(self, mine: str, other: str, real: Any) -> None:
        me = threading.current_thread().name
        with self._guard:
            self._inside.add(me)
        self._came[mine].set()
        self._came[other].wait(MEET_S)
        with self._guard:
            if self._inside - {me}:
                self.met.append(f"{mine} in thread '{me}' while {sorted(self._inside - {me})} changed the mappings too")
        try:
            real()
        finally:
            with self._guard:
                self._inside.discard(me)


def mapped_over(address: int, size: int) -> list[str]:
    """This process's mappings over ``[address, address + size)`` that are not bare
    reservations (/proc/self/maps; host backend)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo < address + size and address < hi and not line.split()[1].startswith("---"):
                out.append(line.strip())
    return out


def test_close_ends_a_call_blocked_in_another_thread(daemon: object, runtime_dir: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = gpumem.connect(0, "first", runtime_dir=runtime_dir, timeout=CALL_TIMEOUT_S)
    second = gpumem.connect(0, "second", runtime_dir=runtime_dir, timeout=CALL_TIMEOUT_S)
    try:
        pools = [s.declare_kv_pool(f"kv-{s.name}", [gpumem.KvBuffer("k", 4096)], max_tokens=4096) for s in (first, second)]
        for pool in pools:
            pool.placeholder()
            pool.join_round(expect=2)  # the round waits for the second report, which never comes
        outcome: list[BaseException | int] = []
        sent = threading.Event()

        def report() -> None:
            try:
                waiting = pools[0].send_capture_done(min_tokens=16, timeout=CALL_TIMEOUT_S)
                sent.set()
                outcome.append(waiting.wait())
            except BaseException as exc:  # noqa: BLE001 - what the waiting thread got is the result
                outcome.append(exc)

        thread = threading.Thread(target=report, name="reporter", daemon=True)
        thread.start()
        assert sent.wait(CLOSE_WITHIN_S)
        lock = first.core.channel._lock
        deadline = time.monotonic() + CLOSE_WITHIN_S
        while lock.acquire(blocking=False):  # until the report waits for its round, holding the session
            lock.release()
            assert time.monotonic() < deadline, "the report never waited"
            time.sleep(0.01)
        meeting = MeetingInDriver(first.driver, monkeypatch)
        closer = threading.Thread(target=first.close, name="closer", daemon=True)
        closer.start()
        closer.join(CLOSE_WITHIN_S)
        assert not closer.is_alive(), f"close() still waits for the call in progress after {CLOSE_WITHIN_S:g}s"
        thread.join(CLOSE_WITHIN_S)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], gpumem.SessionClosed), outcome
        assert "closed by another thread while this call waited" in str(outcome[0])
        assert meeting.met == []
        if backend == "host":  # on CUDA, second.close() below cannot free the slice then (cuMemAddressFree)
            arena = pools[0].arena
            assert mapped_over(arena.address, arena.reserved) == [], "the first session's arena is still mapped after close()"
        wait_status(runtime_dir, lambda s: [c["name"] for c in s["clients"]] == ["second"], 10, "the first session gone")
    finally:
        second.close()
        if not first.closed:
            first.channel.timeout = 1.0
            threading.Thread(target=first.close, daemon=True).start()  # a failed test's close may hang: not here
