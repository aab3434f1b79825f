"""The server's tick hook (the metrics snapshot) cannot take the daemon down: a hook that
raises is logged once and switched off, and the loop goes on serving."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from gpumem_shared.driver.host import HostDriver
from gpumem_shared.paths import Endpoints
from gpumemd.config import StateConfig
from gpumemd.server import Server
from gpumemd.state import DaemonState

from .harness import CAPACITY


def test_a_failing_tick_hook_is_switched_off_and_the_loop_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[float] = []
    ticks = 0

    def hook() -> None:
        calls.append(0.0)
        raise RuntimeError("a bug in the metrics")

    state = DaemonState(HostDriver(0, CAPACITY), StateConfig(index=0))
    real_tick = state.tick

    def counted_tick() -> None:
        nonlocal ticks
        ticks += 1
        real_tick()

    state.tick = counted_tick  # type: ignore[method-assign]
    server = Server(state, Endpoints(tmp_path, 0), tick_interval=0.01, on_tick=hook)
    server.bind()
    stopper = threading.Timer(0.5, server.request_stop)
    stopper.start()
    with caplog.at_level(logging.ERROR, logger="gpumemd.server"):
        server.serve_forever()  # returns once stopped; a hook's exception would end it at once
    stopper.join(5)
    assert calls == [0.0], "called once, then off"
    assert ticks > 5, "the loop kept ticking after the hook failed"
    assert [r.message for r in caplog.records if "tick hook failed" in r.message], caplog.text
