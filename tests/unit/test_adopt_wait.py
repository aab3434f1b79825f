"""How long ``Session.adopt`` waits: the daemon holds its answer while the group's holder
lives or is not fenced yet (ADOPT's ``wait``, deferred), so the client sends one request
and raises what the daemon answers; its own bound is the wait and a margin for the
answer, past which it says what to check. (The daemon's side: test_retained.py.) The
client polled before; under load, the loser of two racing adopters once waited out its
whole ``wait``: the daemon now ends that wait as soon as the winner holds the group."""

from __future__ import annotations

from typing import Any

import pytest

from gpumem import retain
from gpumem.errors import DaemonTimeout, GroupHeld


class Channel:
    def __init__(self, answer: Exception) -> None:
        self.answer = answer
        self.sent: list[tuple[Any, float | None]] = []

    def call(self, message: Any, timeout: float | None = None) -> Any:
        self.sent.append((message, timeout))
        raise self.answer


class Core:
    def __init__(self, answer: Exception) -> None:
        self.channel = Channel(answer)


def test_one_adopt_carries_the_wait_and_its_answer_is_raised() -> None:
    core = Core(GroupHeld("held", {"holder_session": 9, "holder": "s9", "adopting": 1}))
    with pytest.raises(GroupHeld) as caught:
        retain.adopt(core, "g", "ab" * 32, wait=600.0)  # type: ignore[arg-type]
    assert caught.value.detail["holder_session"] == 9
    ((message, timeout),) = core.channel.sent
    assert (message.group, message.wait) == ("g", 600.0) and timeout is not None and timeout > 600.0


def test_no_wait_is_the_sessions_timeout_and_a_silent_daemon_is_named() -> None:
    core = Core(GroupHeld("held", {}))
    with pytest.raises(GroupHeld):
        retain.adopt(core, "g", "ab" * 32)  # type: ignore[arg-type]
    assert [(m.wait, t) for m, t in core.channel.sent] == [(0.0, None)]
    core = Core(DaemonTimeout("no answer within 40s"))
    with pytest.raises(DaemonTimeout) as silent:
        retain.adopt(core, "g", "ab" * 32, wait=30.0)  # type: ignore[arg-type]
    assert "retain group 'g'" in str(silent.value) and "gpumemctl status" in str(silent.value)
