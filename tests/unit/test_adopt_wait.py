"""How long ``Session.adopt`` waits: while the group's holder lives or is not fenced yet,
up to its ``wait``; never once another adopter took the group first. The full suite
under load once saw the loser of two racing adopters wait out its whole ``wait``: its
first answer was NOT_FENCED (the dead holder not fenced yet), and the winner's GROUP_HELD
that followed looked like a first holder to wait for."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gpumem import retain
from gpumem.errors import GroupHeld, NotFenced


class Channel:
    def __init__(self, answers: list[Exception]) -> None:
        self.answers = answers
        self.calls = 0

    def call(self, message: Any) -> Any:
        self.calls += 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        raise answer


class Core:
    def __init__(self, answers: list[Exception]) -> None:
        self.channel = Channel(answers)


def held(session: int, adopting: bool = False) -> GroupHeld:
    return GroupHeld("held", {"holder_session": session, "holder": f"s{session}", "adopting": int(adopting)})


def adopt(answers: list[Exception], wait: float) -> tuple[Exception, int, float]:
    core = Core(answers)
    started = time.monotonic()
    with pytest.raises((GroupHeld, NotFenced)) as caught:
        retain.adopt(core, "g", "ab" * 32, wait=wait)  # type: ignore[arg-type]
    return caught.value, core.channel.calls, time.monotonic() - started


def test_an_adopter_that_saw_the_group_orphaned_stops_at_the_winner() -> None:
    error, calls, _ = adopt([NotFenced("not fenced", {"pid": 7}), held(9)], wait=600.0)
    assert isinstance(error, GroupHeld) and error.detail["holder_session"] == 9 and calls == 2


def test_a_new_holder_ends_the_wait_and_an_unconfirmed_adoption_too() -> None:
    error, calls, _ = adopt([held(3), held(9)], wait=600.0)
    assert error.detail["holder_session"] == 9 and calls == 2
    error, calls, _ = adopt([held(9, adopting=True)], wait=600.0)
    assert calls == 1


def test_the_first_holder_is_waited_for_until_the_wait_ends() -> None:
    error, calls, seconds = adopt([held(3)], wait=0.3)
    assert error.detail["holder_session"] == 3 and calls > 2 and seconds >= 0.3
    error, calls, seconds = adopt([NotFenced("not fenced", {"pid": 7})], wait=0.3)
    assert isinstance(error, NotFenced) and calls > 2 and seconds >= 0.3
