"""Refused ADOPTs in the log (issue 37 B11): any session may send them at will, so each
session's are written at most once per window and summed up in its next line
(logs.SessionThrottle), not one warning each."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from gpumem_shared import protocol as p
from gpumemd.logs import SessionThrottle

from .harness import Harness
from .test_retained import die, primary_with_arena


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpumemd.retained" and r.levelno == logging.WARNING]


def test_a_flood_of_refused_adopts_logs_a_line_per_window_and_one_summary(
    make_harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    h = make_harness(retain_grace=60.0)
    s, secret, _ = primary_with_arena(h)
    die(h, s)
    guess, thief = h.connect("guess"), h.connect("thief", uid=2000, gid=2000)
    caplog.set_level(logging.WARNING, logger="gpumemd.retained")
    caplog.clear()  # the orphaning's line
    for _ in range(500):
        h.refused(guess, p.Adopt(group="g", secret="0" * 64), p.ErrorCode.PERMISSION_DENIED)
        h.refused(thief, p.Adopt(group="g", secret=secret), p.ErrorCode.PERMISSION_DENIED)
    first = lines(caplog)
    assert len(first) == 2, first  # one per session
    assert "wrong secret" in first[0] and "belongs to uid" in first[1] and secret not in " ".join(first)
    caplog.clear()
    h.clock.now += SessionThrottle(logging.getLogger()).every
    h.refused(guess, p.Adopt(group="g", secret="1" * 64), p.ErrorCode.PERMISSION_DENIED)
    (summary,) = lines(caplog)
    assert "wrong secret" in summary and f"499 more like it from session {guess.id}" in summary


def test_sessions_quiet_for_a_window_are_summed_up_and_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("gpumemd.retained")
    throttle = SessionThrottle(log, every=5.0)
    caplog.set_level(logging.WARNING, logger="gpumemd.retained")
    throttle.warning(1, 0.0, "refused %s", "a")
    throttle.warning(1, 1.0, "refused %s", "a")
    for session in range(2, SessionThrottle.REMEMBERED + 2):
        throttle.warning(session, 10.0, "refused %s", "b")
    assert "1 more like it from session 1, not logged" in lines(caplog)
    assert len(lines(caplog)) == SessionThrottle.REMEMBERED + 2
