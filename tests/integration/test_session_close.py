"""Session.close() while another thread of the client waits in a call: the call ends
at once with SessionClosed, and close() returns without waiting for that call's
deadline (a KV round's report waits up to the round's, 300 s by default)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import gpumem
from gpumem_shared.driver import DriverError
from gpumemd_testkit import wait_status

# Far beyond what the test waits: a close() that waited for it would fail the test.
CALL_TIMEOUT_S = 120.0
CLOSE_WITHIN_S = 10.0


def test_close_ends_a_call_blocked_in_another_thread(daemon: object, runtime_dir: Path, backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "cuda":
        # Seen on the H200 (2026-12-01): the interrupted call ends as it should, then the
        # second session's close() cannot free the process's address slice (cuMemAddressFree:
        # CUDA_ERROR_INVALID_VALUE), so something of the first session's arena stays mapped
        # there. Open in issue 22; strict, so the fix must remove this mark.
        request.applymarker(pytest.mark.xfail(strict=True, raises=DriverError, reason="slice not freed after an interrupted close (CUDA)"))
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

        thread = threading.Thread(target=report, daemon=True)
        thread.start()
        assert sent.wait(CLOSE_WITHIN_S)
        lock = first.core.channel._lock
        deadline = time.monotonic() + CLOSE_WITHIN_S
        while lock.acquire(blocking=False):  # until the report waits for its round, holding the session
            lock.release()
            assert time.monotonic() < deadline, "the report never waited"
            time.sleep(0.01)
        closer = threading.Thread(target=first.close, daemon=True)
        closer.start()
        closer.join(CLOSE_WITHIN_S)
        assert not closer.is_alive(), f"close() still waits for the call in progress after {CLOSE_WITHIN_S:g}s"
        thread.join(CLOSE_WITHIN_S)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], gpumem.SessionClosed), outcome
        assert "closed by another thread while this call waited" in str(outcome[0])
        wait_status(runtime_dir, lambda s: [c["name"] for c in s["clients"]] == ["second"], 10, "the first session gone")
    finally:
        second.close()
        if not first.closed:
            first.channel.timeout = 1.0
            threading.Thread(target=first.close, daemon=True).start()  # a failed test's close may hang: not here
