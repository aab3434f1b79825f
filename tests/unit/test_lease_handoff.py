"""Leases on shared graph pools: the IPC-event handoff (RECORD, release_recorded,
OK_ORDER; the ordered calls that record and wait in the same call, OK_WAITED), escape marks, and the daemon's side of both: the slot's flags, opening another
client's pool, publishing and looking up IPC event handles, and what a session's end,
a pool's drop and a tick do to the fields that name sessions.

Threads stand in for other processes (the native calls drop the GIL); every wait is
bounded."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import gpumem
from gpumem.errors import DeviceDriverError
from gpumem.handoffs import SessionLeases
from gpumem.leases import Lease
from gpumem_shared import _native, lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import KIND_NAMES, LeaseFlag, LeaseKind, LeaseSegment, LeaseStatus
from gpumem_shared.driver.base import DriverError
from gpumem_shared.driver.host import HostDriver
from gpumem_shared.protocol import ErrorCode
from gpumemd.records import SessionRecord as Session

from .harness import BULK, GiB, Harness, MiB
from .lease_kit import Pool, Waiter, follow, fresh_segment, granted, repairs, wait_until_sleeping

EPOCH = lease_table.lease_epoch(3, 1)
ARENA = "graphs"
# An IPC event handle is opaque to the daemon; the driver's are 64 bytes.
HANDLE = bytes(range(64))


@pytest.fixture
def table() -> Iterator[LeaseSegment]:
    seg = fresh_segment(3)
    seg.set_epoch(EPOCH)
    yield seg
    seg.close()


@pytest.fixture
def shared(table: LeaseSegment) -> LeaseSegment:
    """The segment flagged as a shared pool's, as the daemon registers one."""
    table.set_flags(LeaseFlag.SHARED)
    return table


def word(kind: int = LeaseKind.REPLAY, session: int = 1, pid: int = 1001) -> int:
    return lease_table.encode(kind, session, pid)


def word_session(session_id: int) -> int:
    """A session id as lease words, handoff and escaped carry it (24 bits)."""
    return lease_table.decode(lease_table.encode(0, session_id, 0))[1]


Take = Callable[[LeaseSegment, int], int]

# The three ways a client takes a free slot; each must report the handoff the same way.
TAKES: dict[str, Take] = {
    "try": lambda t, w: t.try_acquire(w, EPOCH, b"taker"),
    "acquire": lambda t, w: t.acquire(w, EPOCH, 0)[0],
    "acquire-wait": lambda t, w: t.acquire(w, EPOCH, 1.0)[0],
}


def handed_over(t: LeaseSegment, held: int) -> None:
    """``held`` gives the slot back the way a shared pool's holder must."""
    assert t.release(held) == LeaseStatus.RECORD
    assert t.release_recorded(held) == LeaseStatus.OK


# =========================================================================== the handoff


def test_a_shared_release_frees_nothing_until_the_event_is_recorded(shared: LeaseSegment) -> None:
    held = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    futex = shared._slot.futex
    assert shared.release(held) == LeaseStatus.RECORD
    # Freed here, a taker from another process could run on the pool before the
    # releaser's GPU work is done.
    assert shared.peek() == held and shared.handoff() == 0
    assert shared._slot.futex == futex, "nothing was released: nobody is woken"
    assert shared.try_acquire(word(LeaseKind.REPLAY, session=2), EPOCH, b"x") == LeaseStatus.HELD
    assert shared.release_recorded(held) == LeaseStatus.OK
    assert shared.peek() == 0 and shared.handoff() == 1
    assert shared._slot.futex == futex + 1


@pytest.mark.parametrize("take", TAKES.values(), ids=TAKES.keys())
def test_a_taker_of_another_session_orders_after_the_recorded_release(shared: LeaseSegment, take: Take) -> None:
    first = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0), "no release recorded yet: nothing to order after"
    handed_over(shared, first)
    other = word(LeaseKind.REPLAY, session=2, pid=2002)
    assert take(shared, other) == LeaseStatus.OK_ORDER
    assert shared.peek() == other, "OK_ORDER is a taken lease"
    handed_over(shared, other)
    assert shared.handoff() == 2
    assert take(shared, word(LeaseKind.BORROW, session=1)) == LeaseStatus.OK_ORDER, "the first releaser now orders after the second"
    assert shared.release_recorded(word(LeaseKind.BORROW, session=1)) == LeaseStatus.OK


@pytest.mark.parametrize("take", TAKES.values(), ids=TAKES.keys())
@pytest.mark.parametrize("kind", list(LeaseKind), ids=KIND_NAMES.get)
def test_a_taker_of_the_same_session_needs_no_ordering(shared: LeaseSegment, take: Take, kind: int) -> None:
    """Within one process stream order suffices: another pid or kind of the same session
    takes with plain OK."""
    first = word(LeaseKind.REPLAY, session=1, pid=1001)
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0)
    handed_over(shared, first)
    again = word(kind, session=1, pid=1002)
    assert take(shared, again) == LeaseStatus.OK
    assert shared.peek() == again


def test_a_sleeping_waiter_wakes_on_the_recorded_release_only(shared: LeaseSegment) -> None:
    held, mine = word(LeaseKind.CAPTURE, session=1), word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    waiter = Waiter(shared, mine, EPOCH, 10.0)
    waiter.start()
    wait_until_sleeping(shared)
    assert shared.release(held) == LeaseStatus.RECORD
    time.sleep(0.05)
    assert waiter.is_alive(), "a release that freed nothing woke the waiter"
    assert shared.release_recorded(held) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.OK_ORDER
    assert waiter.elapsed < 5.0 and shared.peek() == mine


def test_without_the_flag_release_frees_at_once_and_leaves_handoff_alone(shared: LeaseSegment) -> None:
    first = word(LeaseKind.REPLAY, session=1)
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0)
    handed_over(shared, first)
    shared.set_flags(0)  # the pool is private now: handoff 1 is a leftover
    other = word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(other, EPOCH, 0) == (LeaseStatus.OK, 0), "a private pool never asks for ordering"
    assert shared.release(other) == LeaseStatus.OK
    assert shared.peek() == 0 and shared.handoff() == 1


def test_releasing_a_word_that_does_not_hold_the_slot_is_not_holder(shared: LeaseSegment) -> None:
    held, stranger = word(LeaseKind.REPLAY, session=1), word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert shared.release(stranger) == LeaseStatus.NOT_HOLDER
    assert shared.release_recorded(stranger) == LeaseStatus.NOT_HOLDER
    assert shared.release_recorded(word(LeaseKind.CAPTURE, session=1)) == LeaseStatus.NOT_HOLDER  # the holder's session, another kind
    assert shared.peek() == held
    assert shared.handoff() == 0, "a refused release named itself as the one to order after"
    handed_over(shared, held)
    assert shared.release(held) == LeaseStatus.NOT_HOLDER
    assert shared.release_recorded(stranger) == LeaseStatus.NOT_HOLDER  # of a free slot
    assert shared.handoff() == 1


def test_clear_frees_a_shared_slot_and_keeps_the_handoff(shared: LeaseSegment) -> None:
    first = word(LeaseKind.REPLAY, session=1)
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0)
    handed_over(shared, first)
    other = word(LeaseKind.BORROW, session=2, pid=2002)
    assert shared.acquire(other, EPOCH, 0) == (LeaseStatus.OK_ORDER, 0)
    assert shared.clear(first) == LeaseStatus.NOT_HOLDER
    assert shared.clear(other) == LeaseStatus.OK
    # Session 2 recorded nothing: the next taker must still order after session 1.
    assert shared.peek() == 0 and shared.handoff() == 1
    assert shared.acquire(word(LeaseKind.REPLAY, session=3), EPOCH, 0) == (LeaseStatus.OK_ORDER, 0)


# =========================================================================== the ordered calls: GPU order in the same call

# The host backend's context: the ordered calls make no driver call, and answer as they would
# on CUDA once the wait or record is queued. Event handles are opaque to the lease logic.
NO_CONTEXT, STREAM, EVENT = 0, 0, 0

OrderedTake = Callable[[LeaseSegment, int, dict[int, int]], int]

# The ordered forms of the three takes: each must wait on a known releaser's event itself.
ORDERED_TAKES: dict[str, OrderedTake] = {
    "try": lambda t, w, events: t.try_acquire_ordered(w, EPOCH, b"taker", NO_CONTEXT, STREAM, events),
    "acquire": lambda t, w, events: t.acquire_ordered(w, EPOCH, 0, None, NO_CONTEXT, STREAM, events)[0],
    "acquire-wait": lambda t, w, events: t.acquire_ordered(w, EPOCH, 1.0, b"taker", NO_CONTEXT, STREAM, events)[0],
}


def ordered_release(t: LeaseSegment, held: int) -> int:
    return t.release_ordered(held, NO_CONTEXT, EVENT, STREAM)


def test_the_ordered_release_records_names_itself_and_frees_in_one_call(shared: LeaseSegment) -> None:
    held = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    futex = shared._slot.futex
    assert ordered_release(shared, held) == LeaseStatus.OK, "never RECORD: the event is recorded in the same call"
    assert shared.peek() == 0 and shared.handoff() == 1
    assert shared._slot.futex == futex + 1
    assert ordered_release(shared, held) == LeaseStatus.NOT_HOLDER


def test_the_ordered_release_of_a_private_slot_frees_without_naming_itself(table: LeaseSegment) -> None:
    held = word(LeaseKind.REPLAY, session=1)
    assert table.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert ordered_release(table, held) == LeaseStatus.OK
    assert table.peek() == 0 and table.handoff() == 0


def test_an_ordered_release_by_a_stranger_records_nothing(shared: LeaseSegment) -> None:
    held, stranger = word(LeaseKind.REPLAY, session=1), word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert ordered_release(shared, stranger) == LeaseStatus.NOT_HOLDER
    assert shared.peek() == held and shared.handoff() == 0


@pytest.mark.parametrize("take", ORDERED_TAKES.values(), ids=ORDERED_TAKES.keys())
def test_an_ordered_take_waits_on_a_known_releasers_event_itself(shared: LeaseSegment, take: OrderedTake) -> None:
    first = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert ordered_release(shared, first) == LeaseStatus.OK
    other = word(LeaseKind.REPLAY, session=2, pid=2002)
    assert take(shared, other, {3: EVENT, 1: EVENT}) == LeaseStatus.OK_WAITED
    assert shared.peek() == other, "OK_WAITED is a taken lease"
    assert ordered_release(shared, other) == LeaseStatus.OK and shared.handoff() == 2
    # The releaser's event not known here: taken, and the caller must look it up and wait.
    assert take(shared, first, {1: EVENT}) == LeaseStatus.OK_ORDER
    assert shared.peek() == first
    assert ordered_release(shared, first) == LeaseStatus.OK


@pytest.mark.parametrize("take", ORDERED_TAKES.values(), ids=ORDERED_TAKES.keys())
def test_an_ordered_take_waits_on_nothing_within_a_session_or_on_a_private_slot(shared: LeaseSegment, take: OrderedTake) -> None:
    first = word(LeaseKind.REPLAY, session=1, pid=1001)
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert ordered_release(shared, first) == LeaseStatus.OK
    again = word(LeaseKind.BORROW, session=1, pid=1002)
    assert take(shared, again, {1: EVENT}) == LeaseStatus.OK
    assert ordered_release(shared, again) == LeaseStatus.OK
    shared.set_flags(0)
    assert take(shared, word(LeaseKind.REPLAY, session=2, pid=2002), {1: EVENT}) == LeaseStatus.OK


@pytest.mark.parametrize("take", ORDERED_TAKES.values(), ids=ORDERED_TAKES.keys())
def test_an_ordered_take_refuses_as_the_plain_one_does(shared: LeaseSegment, take: OrderedTake) -> None:
    held = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    started = time.monotonic()
    assert take(shared, word(LeaseKind.REPLAY, session=2, pid=2002), {1: EVENT}) == LeaseStatus.HELD
    assert time.monotonic() - started < 5.0
    assert ordered_release(shared, held) == LeaseStatus.OK
    shared.set_epoch(EPOCH + 1)
    assert take(shared, word(LeaseKind.REPLAY, session=2, pid=2002), {1: EVENT}) == LeaseStatus.STALE
    assert shared.peek() == 0


def test_a_sleeping_ordered_waiter_wakes_on_the_ordered_release_and_waits_in_the_same_call(shared: LeaseSegment) -> None:
    held, mine = word(LeaseKind.CAPTURE, session=1), word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    result: list[tuple[int, int]] = []
    waiter = threading.Thread(
        target=lambda: result.append(shared.acquire_ordered(mine, EPOCH, 10.0, b"waiter", NO_CONTEXT, STREAM, {1: EVENT})),
        daemon=True,
    )
    waiter.start()
    wait_until_sleeping(shared)
    assert ordered_release(shared, held) == LeaseStatus.OK
    waiter.join(10.0)
    assert not waiter.is_alive(), "the ordered waiter did not return within 10 s of the release"
    assert result == [(LeaseStatus.OK_WAITED, held)]
    assert shared.peek() == mine and shared.holder() is not None and shared.holder().label == "waiter"  # type: ignore[union-attr]


def mid_record(t: LeaseSegment, session: int) -> None:
    """The slot as an ordered release of ``session`` leaves it between freeing it and its
    event record landing (the release does both in one call; this holds the moment)."""
    t._slot.handoff = word_session(session) | lease_table.HANDOFF_RECORDING


def land_record(t: LeaseSegment, value: int, after: float) -> threading.Thread:
    """The releaser's record ends ``after`` seconds from now, leaving ``value`` in handoff
    (its session: recorded; 0: the record failed)."""

    def land() -> None:
        time.sleep(after)
        t._slot.handoff = value

    thread = threading.Thread(target=land, daemon=True)
    thread.start()
    return thread


def waiting_take(t: LeaseSegment, w: int, events: dict[int, int]) -> int:
    """An ordered take with time to wait for a record (a loaded machine's 0.2 s sleep may
    last a while)."""
    return t.acquire_ordered(w, EPOCH, 10.0, b"taker", NO_CONTEXT, STREAM, events)[0]


def test_a_take_after_a_release_still_recording_waits_for_the_record_before_the_event(shared: LeaseSegment) -> None:
    """The ordered release frees the slot before its record lands, so that the waiter's
    wake-up overlaps the record; a taker must not wait on the event before the record is
    in it (its stream would be ordered after the releaser's previous work only)."""
    mid_record(shared, 1)
    landing = land_record(shared, word_session(1), 0.2)
    started = time.monotonic()
    assert waiting_take(shared, word(LeaseKind.REPLAY, session=2, pid=2002), {1: EVENT}) == LeaseStatus.OK_WAITED
    assert time.monotonic() - started >= 0.15, "the taker waited on the event before the record landed"
    landing.join(5)
    assert shared.peek() == word(LeaseKind.REPLAY, session=2, pid=2002)


def test_a_take_after_a_failed_record_waits_on_nothing(shared: LeaseSegment) -> None:
    mid_record(shared, 1)
    landing = land_record(shared, 0, 0.05)
    assert waiting_take(shared, word(LeaseKind.REPLAY, session=2, pid=2002), {1: EVENT}) == LeaseStatus.OK
    landing.join(5)


# The takes with no time to wait: each must look at the record once, not wait for it.
TRIES = {name: ORDERED_TAKES[name] for name in ("try", "acquire")}


@pytest.mark.parametrize("take", TRIES.values(), ids=TRIES.keys())
def test_a_try_gives_the_slot_back_at_once_while_the_record_is_in_flight(shared: LeaseSegment, take: OrderedTake) -> None:
    """A try has no bound to wait in: a record in flight refuses it as a slot held a
    moment longer would (it waited up to 1 s, whatever the caller's wait)."""
    mid_record(shared, 1)
    futex = shared._slot.futex
    mine = word(LeaseKind.REPLAY, session=2, pid=2002)
    started = time.monotonic()
    assert take(shared, mine, {1: EVENT}) == LeaseStatus.RECORDING
    assert time.monotonic() - started < 0.25, "a try waited for the record"
    assert shared.peek() == 0 and shared._slot.futex == futex + 1, "taken, then given back (waking its waiters)"
    shared._slot.handoff = word_session(1)  # the record lands
    assert take(shared, mine, {1: EVENT}) == LeaseStatus.OK_WAITED


def test_a_take_of_the_same_session_waits_for_its_own_record_too(shared: LeaseSegment) -> None:
    """Another thread of the releasing session records into the same event next: the
    first record must land before, or the event would mark the earlier work only."""
    mid_record(shared, 1)
    landing = land_record(shared, word_session(1), 0.2)
    started = time.monotonic()
    assert shared.try_acquire(word(LeaseKind.BORROW, session=1, pid=1002), EPOCH, b"x") == LeaseStatus.OK_ORDER
    assert shared.await_record(10.0) == (LeaseStatus.OK, 1)
    assert time.monotonic() - started >= 0.15
    landing.join(5)
    assert shared.release_ordered(word(LeaseKind.BORROW, session=1, pid=1002), NO_CONTEXT, EVENT, STREAM) == LeaseStatus.OK
    assert ORDERED_TAKES["try"](shared, word(LeaseKind.REPLAY, session=1, pid=1003), {1: EVENT}) == LeaseStatus.OK


# On a loaded machine a thread may be scheduled late: the slack a bound is allowed. The
# bound the takes had before was 1 s past the caller's, whatever it was.
SLACK_S = 0.25


@pytest.mark.parametrize("timeout", [0.0, 0.4])
def test_a_record_that_never_lands_refuses_the_take_within_its_own_bound(shared: LeaseSegment, timeout: float) -> None:
    """A releaser stopped between freeing the slot and recording: the taker gives the
    slot back once its own timeout is spent, instead of waiting forever (or a bound of
    its own), or ordering after nothing."""
    mid_record(shared, 1)
    futex = shared._slot.futex
    started = time.monotonic()
    status, _ = shared.acquire_ordered(word(LeaseKind.REPLAY, session=2, pid=2002), EPOCH, timeout, b"x", NO_CONTEXT, STREAM, {1: EVENT})
    waited = time.monotonic() - started
    assert status == LeaseStatus.RECORDING
    assert timeout <= waited < timeout + SLACK_S, f"refused after {waited:.2f}s with a {timeout}s timeout"
    assert shared.peek() == 0 and shared._slot.futex == futex + 1, "taken, then given back (waking its waiters)"
    assert shared.await_record(0.05) == (LeaseStatus.RECORDING, 1)


# A taker's bound, and how much of it the holder keeps the slot in the tests where the
# holder's release then stops mid-record: the record must get only the rest.
BOUND_S, HOLD_S = 1.0, 0.4


def release_mid_record_after(t: LeaseSegment, held: int, started: list[float]) -> None:
    """Once the taker (which put its start time in ``started``) has waited HOLD_S for
    ``held``: ``held``'s ordered release, stopped between its free and its record."""
    wait_until_sleeping(t)
    time.sleep(max(0.0, started[0] + HOLD_S - time.monotonic()))
    mid_record(t, 1)
    assert t.clear(held) == LeaseStatus.OK


def test_the_wait_for_the_holder_and_for_the_record_share_one_bound(shared: LeaseSegment) -> None:
    """A taker that waited for the holder has only the rest of its timeout for the
    record (it had the record bound on top of its timeout)."""
    held = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    started: list[float] = []
    result: list[tuple[int, float]] = []

    def take() -> None:
        started.append(time.monotonic())
        status, _ = shared.acquire_ordered(word(LeaseKind.REPLAY, session=2, pid=2002), EPOCH, BOUND_S, b"x", NO_CONTEXT, STREAM, {1: EVENT})
        result.append((status, time.monotonic() - started[0]))

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    release_mid_record_after(shared, held, started)
    taker.join(10)
    [(status, waited)] = result
    assert status == LeaseStatus.RECORDING
    assert BOUND_S <= waited < BOUND_S + SLACK_S, f"refused after {waited:.2f}s with a {BOUND_S}s timeout"
    assert shared.peek() == 0


# =========================================================================== the client's acquire: one bound for every wait

POOL_ID, RELEASER = 3, "stuck-releaser"


class _Daemon:
    """The daemon as a taker's slow paths ask it: a status naming the releaser (session
    1), session 1's event handle, and taking the taker's own at its first release."""

    def call(self, message: p.RequestMessage) -> tuple[Any, list[int]]:
        if isinstance(message, p.Status):
            client = types.SimpleNamespace(session_id=1, name=RELEASER, pid=1001, own_pid=1001)
            return types.SimpleNamespace(clients=[client], leases=[]), []
        if isinstance(message, p.PublishLeaseEvent):
            return None, []
        assert isinstance(message, p.LookupLeaseEvent) and message.session == 1, message
        return p.LeaseEventReply(handle=HostDriver(0).event_create()[1]), []


def taker_session(driver: HostDriver | None = None, session_id: int = 2) -> SessionLeases:
    """Session 2's side of its leases (host backend: no driver call at a handoff)."""
    return SessionLeases(_Daemon(), driver or HostDriver(0), session_id=session_id, device_ordinal=None, daemon_key="unit")  # type: ignore[arg-type]


# How a session sees the pool: as a shared pool (the ordered calls), or through a view
# that says private while the slot is flagged shared (the plain calls, then the wait
# for the record in Python).
VIEWS = {"shared": True, "private view": False}


def pool_view(t: LeaseSegment, shared: bool) -> Any:
    return types.SimpleNamespace(id=POOL_ID, epoch=1, segment=t, shared=shared)


@pytest.mark.parametrize("wait", [0.0, 0.4])
@pytest.mark.parametrize("view", VIEWS.values(), ids=VIEWS.keys())
def test_an_acquire_refused_by_a_record_that_never_lands_returns_within_its_wait(shared: LeaseSegment, view: bool, wait: float) -> None:
    """A releaser stopped mid-record: the caller's wait is the bound (replay(wait=0)
    took 1 s, wait=0.5 took 2 s), and the error names the releaser. wait=0 is a try: a
    record in flight refuses it at once, as a slot held a moment longer would."""
    mid_record(shared, 1)
    started = time.monotonic()
    with pytest.raises(gpumem.LeaseConflict) as refused:
        Lease.acquire(taker_session(), pool_view(shared, view), LeaseKind.REPLAY, "decode", wait)
    waited = time.monotonic() - started
    assert wait <= waited < wait + SLACK_S, f"refused after {waited:.2f}s with wait={wait}"
    assert refused.value.detail == {"holder": RELEASER, "pid": 1001}
    message = refused.value.message
    assert f"replay lease 'decode' on graph pool {POOL_ID} refused" in message and f"client '{RELEASER}' (pid 1001)" in message
    assert ("at once (wait=0)" if wait == 0 else f"after waiting {wait:g}s") in message, message
    assert shared.peek() == 0, "the refused take was given back"


@pytest.mark.parametrize("view", VIEWS.values(), ids=VIEWS.keys())
def test_a_record_landing_within_the_wait_lets_the_acquire_take(shared: LeaseSegment, view: bool) -> None:
    """A taker that finds the record in flight with wait left keeps waiting for it: giving
    up at the first "still recording" answer would refuse a handoff that completes in time."""
    mid_record(shared, 1)
    futex = shared._slot.futex
    session = taker_session()
    mine = session.words[LeaseKind.REPLAY]

    done = threading.Event()

    def land() -> None:
        # Once the taker holds the slot waiting for the record; on a shared pool after the
        # first try gave it back (the "still recording" answer).
        while not (shared.peek() == mine and (not view or shared._slot.futex != futex)):
            if done.wait(0.001):
                return
        shared._slot.handoff = word_session(1)

    landing = threading.Thread(target=land, daemon=True)
    landing.start()
    try:
        lease = Lease.acquire(session, pool_view(shared, view), LeaseKind.REPLAY, "decode", 10.0)
    finally:
        done.set()
        landing.join(10)
    assert lease.held and shared.peek() == mine
    assert session.handoff_waits == 1, "the taker's stream waits on the releaser's event"
    lease.release()


@pytest.mark.parametrize("view", VIEWS.values(), ids=VIEWS.keys())
def test_an_acquire_that_waited_for_the_holder_has_only_the_rest_of_its_wait_for_the_record(shared: LeaseSegment, view: bool) -> None:
    held = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    started: list[float] = []
    outcome: list[tuple[BaseException | None, float]] = []

    def take() -> None:
        started.append(time.monotonic())
        try:
            Lease.acquire(taker_session(), pool_view(shared, view), LeaseKind.REPLAY, "decode", BOUND_S)
            error = None
        except gpumem.LeaseConflict as e:
            error = e
        outcome.append((error, time.monotonic() - started[0]))

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    release_mid_record_after(shared, held, started)
    taker.join(10)
    [(error, waited)] = outcome
    assert isinstance(error, gpumem.LeaseConflict) and RELEASER in error.message, error
    assert BOUND_S <= waited < BOUND_S + SLACK_S, f"refused after {waited:.2f}s with wait={BOUND_S}"


class _EventOpenFails(HostDriver):
    """CUDA between engines in pid namespaces of their own: both are pid 1, and a legacy
    IPC handle names its creator by pid."""

    def event_open(self, handle: bytes) -> Any:
        raise DriverError("cuIpcOpenEventHandle failed: CUDA_ERROR_INVALID_CONTEXT")


class _StreamWaitFails(HostDriver):
    def stream_wait(self, event: Any, stream: int) -> None:
        raise DriverError("cuStreamWaitEvent failed: CUDA_ERROR_INVALID_HANDLE")


FAILING_DRIVERS = {"event_open": (_EventOpenFails, "cuIpcOpenEventHandle"), "stream_wait": (_StreamWaitFails, "cuStreamWaitEvent")}


@pytest.mark.parametrize("contended", [False, True], ids=["free", "waited-for"])
@pytest.mark.parametrize("view", VIEWS.values(), ids=VIEWS.keys())
@pytest.mark.parametrize("failing", FAILING_DRIVERS.values(), ids=FAILING_DRIVERS.keys())
def test_a_handoff_whose_event_fails_here_refuses_the_take_saying_why_and_holds_nothing(
    shared: LeaseSegment, failing: tuple[type[HostDriver], str], view: bool, contended: bool
) -> None:
    """The H200's namespaced handoff: a taker that cannot order after the releaser's event
    gets a typed error naming the pool, the releaser, the driver's error and the fix, and
    gives the slot back: a later taker (any session) takes it and still orders after the
    releaser."""
    driver, call = failing
    released = word(LeaseKind.CAPTURE, session=1)
    assert shared.acquire(released, EPOCH, 0) == (LeaseStatus.OK, 0)
    releaser = None
    if contended:  # the taker sleeps on the held slot, and wakes taking it with OK_ORDER
        releaser = threading.Thread(target=lambda: (wait_until_sleeping(shared), ordered_release(shared, released)), daemon=True)
        releaser.start()
    else:
        assert ordered_release(shared, released) == LeaseStatus.OK
    session = taker_session(driver(0))
    with pytest.raises(DeviceDriverError) as refused:
        Lease.acquire(session, pool_view(shared, view), LeaseKind.REPLAY, "decode", 10.0)
    if releaser is not None:
        releaser.join(10)
    message = refused.value.message
    assert f"replay lease 'decode' on graph pool {POOL_ID} refused, nothing taken" in message, message
    assert f"client '{RELEASER}' (pid 1001)" in message and f"{call} failed" in message, message
    assert "pid namespaces" in message and "--lease-ordering memops" in message, message
    assert refused.value.detail == {"releaser": RELEASER, "pid": 1001, "pool": POOL_ID}
    assert shared.peek() == 0, "the refused take was given back"
    assert shared.handoff() == 1, "the next taker still orders after the releaser"
    with pytest.raises(DeviceDriverError):  # the refused session again: refused the same way, not stuck
        Lease.acquire(session, pool_view(shared, view), LeaseKind.REPLAY, "decode", 0)
    assert shared.peek() == 0
    later = taker_session(session_id=3)
    lease = Lease.acquire(later, pool_view(shared, view), LeaseKind.REPLAY, "next", 0)
    assert lease.held and shared.peek() == later.words[LeaseKind.REPLAY] and later.handoff_waits == 1
    lease.release()
    later.close()  # its event leaves the process's table: no other test orders after it


# Handoffs with bits outside a 24-bit session and the recording mark: what a user that
# writes garbage leaves there. 0xFF000001 is the report's: the mark, plus bits 24-30.
GARBAGE_HANDOFFS = (0xFF000001, 0x7F000001, 0x01000000, 0x81000000 | 5)


@pytest.mark.parametrize("garbage", GARBAGE_HANDOFFS, ids=hex)
@pytest.mark.parametrize("take", ORDERED_TAKES.values(), ids=ORDERED_TAKES.keys())
def test_a_garbage_handoff_names_no_releaser_and_no_taker_waits_for_it(shared: LeaseSegment, take: OrderedTake, garbage: int) -> None:
    """Its recording mark is set by nobody who will ever clear it: a taker that waited
    for it would wait out the record bound and be refused, every time."""
    shared._slot.handoff = garbage
    started = time.monotonic()
    assert take(shared, word(LeaseKind.REPLAY, session=2, pid=2002), {1: EVENT, 5: EVENT}) == LeaseStatus.OK
    assert time.monotonic() - started < 0.5, "the taker waited for a mark nobody can clear"
    assert shared.await_record(5.0) == (LeaseStatus.OK, 0)
    assert shared.release_ordered(word(LeaseKind.REPLAY, session=2, pid=2002), NO_CONTEXT, EVENT, STREAM) == LeaseStatus.OK
    assert shared.handoff() == 2, "the next release names itself again"
    shared._slot.handoff = garbage
    assert shared.try_acquire(word(LeaseKind.BORROW, session=3), EPOCH, b"plain") == LeaseStatus.OK


def test_the_ordered_release_leaves_no_recording_mark(shared: LeaseSegment) -> None:
    held = word(LeaseKind.CAPTURE, session=1)
    for _ in range(3):
        assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
        assert ordered_release(shared, held) == LeaseStatus.OK
        assert shared.handoff() == 1 and shared.await_record(0) == (LeaseStatus.OK, 1)
    shared.set_flags(0)
    assert shared.acquire(held, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert ordered_release(shared, held) == LeaseStatus.OK and shared.handoff() == 1, "a private slot's release names nobody"


def test_the_ordered_calls_check_their_arguments(shared: LeaseSegment) -> None:
    mine = word(LeaseKind.REPLAY, session=2)
    with pytest.raises(TypeError, match="a dict of"):
        shared.try_acquire_ordered(mine, EPOCH, b"x", NO_CONTEXT, STREAM, [(1, EVENT)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a dict of"):
        shared.acquire_ordered(mine, EPOCH, 0, None, NO_CONTEXT, STREAM, None)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        shared.try_acquire_ordered(mine, EPOCH, b"x", NO_CONTEXT, -1, {})
    with pytest.raises(TypeError, match=r"lease_release_ordered\(segment_address, word, context, event, stream\)"):
        _native.lease_release_ordered(shared.address, mine, NO_CONTEXT, EVENT)  # type: ignore[call-arg]
    assert shared.peek() == 0, "a refused call took nothing"


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_libcuda_loads(), reason="a context handle that is not one would reach the real driver")
def test_a_failed_driver_call_leaves_the_lease_not_held_and_raises_the_drivers_error(shared: LeaseSegment) -> None:
    """Where no driver loads, any context fails the call: the take is undone (the waiters
    woken), the release frees the slot without naming itself, as the Python calls did."""
    first, other = word(LeaseKind.CAPTURE, session=1), word(LeaseKind.REPLAY, session=2, pid=2002)
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0)
    with pytest.raises(DriverError, match="cuEventRecord failed: libcuda could not be loaded"):
        shared.release_ordered(first, 1, EVENT, STREAM)
    assert shared.peek() == 0 and shared.handoff() == 0
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0)
    assert ordered_release(shared, first) == LeaseStatus.OK
    futex = shared._slot.futex
    with pytest.raises(DriverError, match="cuStreamWaitEvent failed: libcuda could not be loaded"):
        shared.try_acquire_ordered(other, EPOCH, b"x", 1, STREAM, {1: EVENT})
    with pytest.raises(DriverError, match="cuStreamWaitEvent failed"):
        shared.acquire_ordered(other, EPOCH, 1.0, None, 1, STREAM, {1: EVENT})
    assert shared.peek() == 0 and shared._slot.futex == futex + 2, "each undone take freed the slot and woke its waiters"


# =========================================================================== escape marks


@pytest.mark.parametrize("kind", [LeaseKind.REPLAY, LeaseKind.CAPTURE], ids=KIND_NAMES.get)
def test_an_escape_mark_refuses_replay_and_capture_at_once(table: LeaseSegment, kind: int) -> None:
    table.set_escaped(5)
    assert table.escaped() == 5
    for session in (5, 6):  # the marker's own replay would overwrite its tensors too
        mine = word(kind, session=session)
        assert table.try_acquire(mine, EPOCH, b"x") == LeaseStatus.ESCAPED
        assert table.acquire(mine, EPOCH, 0) == (LeaseStatus.ESCAPED, 0)
        start = time.monotonic()
        assert table.acquire(mine, EPOCH, 2.0) == (LeaseStatus.ESCAPED, 0)
        assert time.monotonic() - start < 0.5, "a mark only its owner clears is answered, not waited on"
    assert table.peek() == 0


@pytest.mark.parametrize("take", TAKES.values(), ids=TAKES.keys())
def test_borrowers_still_take_an_escaped_slot(table: LeaseSegment, take: Take) -> None:
    table.set_escaped(5)
    borrower = word(LeaseKind.BORROW, session=6)
    assert take(table, borrower) == LeaseStatus.OK
    assert table.peek() == borrower
    assert table.release(borrower) == LeaseStatus.OK


def test_the_escape_mark_keeps_24_bits_and_clears_to_nobody(table: LeaseSegment) -> None:
    table.set_escaped((1 << 24) + 6)
    assert table.escaped() == 6
    assert table.try_acquire(word(LeaseKind.REPLAY, session=6), EPOCH, b"x") == LeaseStatus.ESCAPED
    table.set_escaped(0)
    assert table.try_acquire(word(LeaseKind.REPLAY, session=6), EPOCH, b"x") == LeaseStatus.OK
    assert table.release(word(LeaseKind.REPLAY, session=6)) == LeaseStatus.OK


def test_forget_handoff_clears_only_the_session_it_names(shared: LeaseSegment) -> None:
    first = word(LeaseKind.REPLAY, session=1)
    assert shared.acquire(first, EPOCH, 0) == (LeaseStatus.OK, 0)
    handed_over(shared, first)
    shared.forget_handoff(3)
    assert shared.handoff() == 1
    shared.forget_handoff(1)
    assert shared.handoff() == 0
    assert shared.acquire(word(LeaseKind.REPLAY, session=5), EPOCH, 0) == (LeaseStatus.OK, 0), "no order once forgotten"
    assert shared.release_recorded(word(LeaseKind.REPLAY, session=5)) == LeaseStatus.OK
    mid_record(shared, 5)  # the releaser ended mid-record: its takers must not wait out the bound
    shared.forget_handoff(3)
    assert shared.handoff() == word_session(5) | lease_table.HANDOFF_RECORDING
    shared.forget_handoff(5)
    assert shared.handoff() == 0


# =========================================================================== the daemon: flags and drops


def owner(h: Harness, name: str = "engine", arena: str = ARENA) -> Session:
    s = h.connect(name)
    h.create(s, arena, GiB)
    h.commit(s, arena, 2 * BULK)
    return s


def register(h: Harness, s: Session, offset: int, label: str, shared: bool, arena: str = ARENA) -> Pool:
    m = p.RegisterGraphPool(arena=arena, label=label, extents=[p.Extent(offset=offset, size=4 * MiB)], free_runs=[], shared=shared)
    outcome = h.ok(s, m)
    return Pool(outcome.reply.pool, granted(outcome))


def sharer(h: Harness, s: Session, name: str) -> Session:
    """A client that ``s`` shares its arena with, attached."""
    h.share(s, ARENA, name)
    other = h.connect(name)
    h.attach(other, ARENA)
    return other


def opens(h: Harness, who: Session, *pools: Pool) -> None:
    """``who`` opens the pools (its client maps their segments: the same memory as ``pool.segment``)."""
    for pool in pools:
        granted(h.ok(who, p.OpenGraphPool(pool_id=pool.id))).close()


def hand_over(pool: Pool, s: Session) -> None:
    """``s`` takes the pool's lease and gives it back with its event recorded, as its client would."""
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert pool.segment.acquire(w, pool.epoch, 0)[0] in (LeaseStatus.OK, LeaseStatus.OK_ORDER)
    assert pool.segment.release(w) == LeaseStatus.RECORD
    assert pool.segment.release_recorded(w) == LeaseStatus.OK


def fields(pool: Pool) -> tuple[int, int, int]:
    return pool.segment.flags(), pool.segment.handoff(), pool.segment.escaped()


def test_registration_writes_the_shared_flag_and_status_shows_it(h: Harness) -> None:
    s = owner(h)
    shared, private = register(h, s, 0, "shared", True), register(h, s, 4 * MiB, "private", False)
    assert (shared.view.shared, private.view.shared) == (True, False)
    assert (shared.segment.flags(), private.segment.flags()) == (LeaseFlag.SHARED, 0)
    assert {g.label: g.shared for g in h.state.status().extents} == {"shared": True, "private": False}
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert shared.segment.acquire(w, shared.epoch, 0) == (LeaseStatus.OK, 0)
    assert shared.segment.release(w) == LeaseStatus.RECORD
    assert private.segment.acquire(w, private.epoch, 0) == (LeaseStatus.OK, 0)
    assert private.segment.release(w) == LeaseStatus.OK, "a private pool's lease is released without an event"


def test_status_names_the_client_whose_escape_mark_blocks_replays(h: Harness) -> None:
    s = owner(h)
    h.state.session_desk.next_session = (1 << 24) + 5  # the mark holds 24 bits of the id
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)

    def escaped_by() -> str:
        return {g.id: g.escaped_by for g in h.state.status().extents}[pool.id]

    assert escaped_by() == ""
    h.ok(b, p.ReportEscape(pool_id=pool.id, escaped=True))
    assert escaped_by() == "client 'b'" and pool.segment.escaped() == word_session(b.id)
    h.ok(s, p.ReportEscape(pool_id=pool.id, escaped=True))  # the owner's own borrows escape too
    assert escaped_by() == "client 'engine', client 'b'"
    h.ok(b, p.ReportEscape(pool_id=pool.id, escaped=False))
    assert escaped_by() == "client 'engine'" and pool.segment.escaped() == word_session(s.id), "the other escaper still blocks"
    h.ok(s, p.ReportEscape(pool_id=pool.id, escaped=False))
    assert escaped_by() == "" and pool.segment.escaped() == 0


def test_new_free_runs_move_the_slot_epoch_and_keep_the_handoff(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)
    hand_over(pool, b)
    runs = [p.Extent(offset=0, size=1 * MiB)]
    moved = h.ok(s, p.UpdateGraphPool(pool_id=pool.id, extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=runs)).reply.pool
    assert moved.epoch == 2 and moved.shared
    assert pool.segment.epoch() == lease_table.lease_epoch(pool.id, 2)
    # b's GPU work may still be running on the pool whatever its runs are now.
    assert fields(pool) == (LeaseFlag.SHARED, word_session(b.id), 0)
    w = lease_table.encode(LeaseKind.BORROW, s.id, s.pid)
    assert pool.segment.acquire(w, lease_table.lease_epoch(pool.id, 1), 0)[0] == LeaseStatus.STALE, "a borrower's view of the old runs"
    assert pool.segment.acquire(w, lease_table.lease_epoch(pool.id, 2), 0) == (LeaseStatus.OK_ORDER, 0)


def drop_pool(h: Harness, s: Session, pool: Pool, how: str) -> None:
    if how == "retire":
        h.ok(s, p.RetireGraphPool(pool_id=pool.id))
    elif how == "arena released":
        h.release(s, ARENA)
    else:
        h.state.close_session(s.id)


@pytest.mark.parametrize("how", ["retire", "arena released", "owner left"])
def test_dropping_a_pool_retires_its_segment_and_the_next_pool_starts_clean(h: Harness, how: str) -> None:
    s = owner(h)
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    elsewhere = owner(h, "elsewhere", arena="spare")
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)
    opens(h, c, pool)
    hand_over(pool, b)
    h.ok(c, p.ReportEscape(pool_id=pool.id, escaped=True))
    assert fields(pool) == (LeaseFlag.SHARED, word_session(b.id), word_session(c.id))
    drop_pool(h, s, pool, how)
    assert pool.id not in h.state.graph_pools.by_id
    assert pool.segment.epoch() == 0 and pool.segment.peek() == 0, "its clients' views of it are stale"
    # What the old segment still holds would make the next pool refuse replays, or order
    # them after a client that never used it: the next pool has a segment of its own.
    again = register(h, elsewhere, 0, "again", True, arena="spare")
    assert fields(again) == (LeaseFlag.SHARED, 0, 0)
    w = lease_table.encode(LeaseKind.REPLAY, elsewhere.id, elsewhere.pid)
    assert again.segment.acquire(w, again.epoch, 0) == (LeaseStatus.OK, 0)


# =========================================================================== the daemon: opening another client's pool


def test_open_by_id_and_by_owner_and_label_grants_the_segment_every_time(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    register(h, s, 0, "prefill", True)
    pool = register(h, s, 4 * MiB, "decode", True)
    for message in (p.OpenGraphPool(pool_id=pool.id), p.OpenGraphPool(owner="engine", label="decode")):
        outcome = h.ok(b, message)
        assert outcome.reply.pool == pool.view
        assert outcome.reply.fd_batches == 1 and outcome.grants == [(pool.id, h.state.graph_pools.by_id[pool.id].segment_fd)]
    h.refused(b, p.OpenGraphPool(pool_id=pool.id + 100), ErrorCode.NOT_FOUND)
    h.refused(b, p.OpenGraphPool(owner="engine", label="nope"), ErrorCode.NOT_FOUND)
    h.refused(b, p.OpenGraphPool(owner="b", label="decode"), ErrorCode.NOT_FOUND)
    h.ok(s, p.RetireGraphPool(pool_id=pool.id))
    h.refused(b, p.OpenGraphPool(pool_id=pool.id), ErrorCode.NOT_FOUND)
    h.refused(b, p.OpenGraphPool(owner="engine", label="decode"), ErrorCode.NOT_FOUND)


def test_open_refuses_a_private_pool_and_a_client_that_has_not_attached(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    private, shared = register(h, s, 0, "private", False), register(h, s, 4 * MiB, "shared", True)
    error = h.refused(b, p.OpenGraphPool(pool_id=private.id), ErrorCode.PERMISSION_DENIED)
    assert "shared=True" in error.message
    h.refused(b, p.OpenGraphPool(owner="engine", label="private"), ErrorCode.PERMISSION_DENIED)
    c = h.connect("c")
    h.refused(c, p.OpenGraphPool(pool_id=shared.id), ErrorCode.PERMISSION_DENIED)  # not even shared with it
    h.share(s, ARENA, "c")
    error = h.refused(c, p.OpenGraphPool(pool_id=shared.id), ErrorCode.PERMISSION_DENIED)  # shared, not attached
    assert "attach" in error.message
    h.attach(c, ARENA)
    assert h.ok(c, p.OpenGraphPool(pool_id=shared.id)).reply.pool == shared.view
    # Its owner opens its own pool, private or not.
    assert h.ok(s, p.OpenGraphPool(pool_id=private.id)).reply.pool == private.view
    assert h.ok(s, p.OpenGraphPool(owner="engine", label="private")).reply.pool == private.view
    assert h.state.graph_pools.by_id[private.id].users == {s.id}, "the private pool's segment went to its owner only"
    assert h.state.graph_pools.by_id[shared.id].users == {s.id, c.id}


# =========================================================================== the daemon: IPC event handles


def lookup(h: Harness, s: Session, pool: Pool, of: Session) -> bytes:
    return h.ok(s, p.LookupLeaseEvent(pool_id=pool.id, session=word_session(of.id))).reply.handle


def test_publish_is_for_shared_pools_and_handles_of_1_to_256_bytes(h: Harness) -> None:
    s = owner(h)
    private, shared = register(h, s, 0, "private", False), register(h, s, 4 * MiB, "shared", True)
    h.refused(s, p.PublishLeaseEvent(pool_id=private.id, handle=HANDLE), ErrorCode.INVALID_ARGUMENT)
    h.refused(s, p.PublishLeaseEvent(pool_id=shared.id, handle=b""), ErrorCode.INVALID_ARGUMENT)
    h.refused(s, p.PublishLeaseEvent(pool_id=shared.id, handle=bytes(257)), ErrorCode.INVALID_ARGUMENT)
    h.refused(s, p.PublishLeaseEvent(pool_id=shared.id + 100, handle=HANDLE), ErrorCode.NOT_FOUND)
    h.refused(s, p.LookupLeaseEvent(pool_id=shared.id, session=word_session(s.id)), ErrorCode.NOT_FOUND)
    h.refused(s, p.LookupLeaseEvent(pool_id=private.id, session=word_session(s.id)), ErrorCode.NOT_FOUND)
    for handle in (b"\x01", bytes(256)):  # both bounds
        h.ok(s, p.PublishLeaseEvent(pool_id=shared.id, handle=handle))
        assert lookup(h, s, shared, s) == handle, "a new handle replaces the session's old one"


def test_publish_lookup_and_escapes_need_the_pool_opened(h: Harness) -> None:
    s = owner(h)
    pool = register(h, s, 0, "shared", True)
    private = register(h, s, 4 * MiB, "private", False)
    h.ok(s, p.PublishLeaseEvent(pool_id=pool.id, handle=HANDLE))
    h.share(s, ARENA, "b")
    b = h.connect("b")
    refusals = [
        p.PublishLeaseEvent(pool_id=pool.id, handle=HANDLE),
        p.PublishLeaseEvent(pool_id=private.id, handle=HANDLE),  # before "not shared"
        p.LookupLeaseEvent(pool_id=pool.id, session=word_session(s.id)),
        p.ReportEscape(pool_id=pool.id, escaped=True),
    ]
    for message in refusals:
        h.refused(b, message, ErrorCode.PERMISSION_DENIED)
    h.attach(b, ARENA)
    for message in refusals:  # attached, but the pool not opened: it holds no segment to lease in
        assert "open" in h.refused(b, message, ErrorCode.PERMISSION_DENIED).message
    opens(h, b, pool)
    h.refused(b, p.LookupLeaseEvent(pool_id=pool.id, session=word_session(b.id)), ErrorCode.NOT_FOUND)
    h.ok(b, p.PublishLeaseEvent(pool_id=pool.id, handle=HANDLE))
    assert lookup(h, s, pool, b) == HANDLE
    h.refused(b, p.PublishLeaseEvent(pool_id=private.id, handle=HANDLE), ErrorCode.PERMISSION_DENIED)


def test_lookup_finds_each_sessions_handle_by_its_word_session_until_it_closes(h: Harness) -> None:
    s = owner(h)
    # Ids beyond 24 bits: a lookup names the session as the slot's handoff does.
    h.state.session_desk.next_session = (1 << 24) + 5
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    assert b.id > 0xFFFFFF and word_session(b.id) != b.id
    pool, other = register(h, s, 0, "shared", True), register(h, s, 4 * MiB, "other", True)
    opens(h, b, pool, other)
    opens(h, c, pool, other)
    h.ok(b, p.PublishLeaseEvent(pool_id=pool.id, handle=b"b" * 64))
    h.ok(c, p.PublishLeaseEvent(pool_id=pool.id, handle=b"c" * 64))
    h.ok(b, p.PublishLeaseEvent(pool_id=other.id, handle=b"B" * 64))
    hand_over(pool, b)
    # What a taker does on OK_ORDER: look up the handle of the session the slot names.
    assert h.ok(c, p.LookupLeaseEvent(pool_id=pool.id, session=pool.segment.handoff())).reply.handle == b"b" * 64
    assert (lookup(h, c, pool, c), lookup(h, c, other, b)) == (b"c" * 64, b"B" * 64)
    h.refused(c, p.LookupLeaseEvent(pool_id=other.id, session=word_session(c.id)), ErrorCode.NOT_FOUND)
    h.state.close_session(b.id)
    for gone in (pool, other):
        h.refused(c, p.LookupLeaseEvent(pool_id=gone.id, session=word_session(b.id)), ErrorCode.NOT_FOUND)
    assert lookup(h, s, pool, c) == b"c" * 64, "another session's handle outlives b"


# =========================================================================== the daemon: session ends and ticks


def test_close_session_forgets_the_fields_naming_it(h: Harness) -> None:
    s = owner(h)
    b, c = sharer(h, s, "b"), sharer(h, s, "c")
    one, two = register(h, s, 0, "one", True), register(h, s, 4 * MiB, "two", True)
    opens(h, b, one, two)
    opens(h, c, one, two)
    hand_over(one, b)
    h.ok(c, p.ReportEscape(pool_id=one.id, escaped=True))
    hand_over(two, c)
    h.ok(b, p.ReportEscape(pool_id=two.id, escaped=True))
    h.state.close_session(b.id)
    assert fields(one)[1:] == (0, word_session(c.id)) and fields(two)[1:] == (word_session(c.id), 0), "forgotten before the move"
    follow(h, s, one)
    follow(h, s, two)
    assert fields(one) == (LeaseFlag.SHARED, 0, word_session(c.id))
    assert fields(two) == (LeaseFlag.SHARED, word_session(c.id), 0)
    # b's event died with it: nobody is told to wait on it, and its mark guards nothing.
    borrow, replay = lease_table.encode(LeaseKind.BORROW, s.id, s.pid), lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert one.segment.acquire(borrow, one.epoch, 0) == (LeaseStatus.OK, 0)
    assert one.segment.clear(borrow) == LeaseStatus.OK
    assert two.segment.acquire(replay, two.epoch, 0) == (LeaseStatus.OK_ORDER, 0)  # after c, which lives
    assert two.segment.release_recorded(replay) == LeaseStatus.OK
    h.state.close_session(c.id)
    follow(h, s, one)
    follow(h, s, two)
    assert fields(one) == (LeaseFlag.SHARED, 0, 0)
    assert fields(two) == (LeaseFlag.SHARED, word_session(s.id), 0)
    assert one.segment.acquire(replay, one.epoch, 0) == (LeaseStatus.OK, 0)


def test_tick_repairs_flags_and_fields_naming_a_session_that_may_not_use_the_pool(h: Harness) -> None:
    s = owner(h)
    h.state.session_desk.next_session = (1 << 24) + 5  # live sessions are compared as the fields hold them
    b = sharer(h, s, "b")
    shared, private = register(h, s, 0, "shared", True), register(h, s, 4 * MiB, "private", False)
    opens(h, b, shared)
    dead = word_session(b.id) + 1  # no session has it
    # What a buggy client may scribble: the daemon's flags, sessions that never were, and
    # (the owner, in its private pool) a session that may not use the pool.
    shared.segment.set_flags(0)
    private.segment.set_flags(LeaseFlag.SHARED | 0x80)
    h.ok(b, p.ReportEscape(pool_id=shared.id, escaped=True))
    shared.segment._slot.handoff = dead
    private.segment._slot.handoff, private.segment._slot.escaped = word_session(b.id), word_session(b.id)
    h.state.tick()
    assert fields(shared) == (LeaseFlag.SHARED, 0, word_session(b.id)), "a reported escape stays"
    assert fields(private) == (0, 0, 0), "b may not use the private pool: neither its handoff nor a mark stays"
    shared.segment._slot.escaped = 0  # a client erasing a mark the daemon holds
    hand_over(shared, b)
    h.state.tick()
    assert fields(shared) == (LeaseFlag.SHARED, word_session(b.id), word_session(b.id)), "the daemon's set of escapers is the truth"
    h.state.tick()  # idempotent
    assert fields(private) == (0, 0, 0)
    assert {g.label: g.lease_repairs for g in h.state.status().graph_pools} == {"shared": 3, "private": 3}


def test_tick_keeps_a_users_recording_mark_and_clears_anyone_elses(h: Harness) -> None:
    """A user of the pool between freeing the slot and its record landing is left alone;
    the same mark naming a session that may not use the pool (or nobody) would hold
    every taker for the record bound, so the tick clears it."""
    s = owner(h)
    b = sharer(h, s, "b")
    shared = register(h, s, 0, "shared", True)
    opens(h, b, shared)
    mid_record(shared.segment, b.id)
    h.state.tick()
    assert shared.segment.handoff() == word_session(b.id) | lease_table.HANDOFF_RECORDING
    for stray in (word_session(b.id) + 1, 0):
        shared.segment._slot.handoff = stray | lease_table.HANDOFF_RECORDING
        h.state.tick()
        assert shared.segment.handoff() == 0
    mid_record(shared.segment, b.id)
    h.state.close_session(b.id)  # b exits mid-record: its takers must not wait out the bound
    assert shared.segment.handoff() == 0


@pytest.mark.parametrize("garbage", GARBAGE_HANDOFFS, ids=hex)
def test_tick_clears_a_handoff_with_bits_outside_the_encoding_once(h: Harness, garbage: int, caplog: pytest.LogCaptureFixture) -> None:
    """Masked, 0xFF000001 read as session 0x7F000001, which no user is, and clearing
    that session's mark missed it: it stayed for good, and every tick warned again."""
    s = owner(h)
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "shared", True)
    opens(h, b, pool)
    pool.segment._slot.handoff = garbage  # b writes it through its mapping
    with caplog.at_level(logging.WARNING, logger="gpumemd.graph_pools"):
        for _ in range(3):
            h.state.tick()
    assert pool.segment.handoff() == 0
    assert repairs(h, pool) == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert f"its lease slot's handoff held {garbage:#x}, which is no session; repaired" in line, line
    w = lease_table.encode(LeaseKind.REPLAY, s.id, s.pid)
    assert pool.segment.try_acquire(w, pool.epoch, b"owner") == LeaseStatus.OK


def test_a_session_never_gets_the_lease_session_that_means_nobody(h: Harness) -> None:
    # 0 in a slot's handoff or escape field means nobody: a session whose id wraps to 0
    # in 24 bits would get neither ordering nor escape marks.
    h.state.session_desk.next_session = 1 << 24
    s = h.connect("wraps")
    assert word_session(s.id) != 0


def test_open_by_owner_and_label_refuses_an_ambiguous_match(h: Harness) -> None:
    s = owner(h)
    h.ok(s, p.CreateArena(name="twin", reserve_bytes=GiB))  # one owner, one label, two arenas
    h.ok(s, p.CommitArena(name="twin", nbytes=8 * MiB))
    register(h, s, 0, "decode", True)
    h.ok(s, p.RegisterGraphPool(arena="twin", label="decode", extents=[p.Extent(offset=0, size=4 * MiB)], free_runs=[], shared=True))
    h.refused(s, p.OpenGraphPool(owner=s.name, label="decode"), ErrorCode.INVALID_ARGUMENT)


def test_a_sharer_letting_go_of_the_arena_takes_its_escape_event_and_lease_along(h: Harness) -> None:
    s = owner(h)
    b = sharer(h, s, "b")
    pool = register(h, s, 0, "p", True)
    stranger = h.connect("stranger")
    h.refused(stranger, p.ReportEscape(pool_id=pool.id, escaped=True), ErrorCode.PERMISSION_DENIED)
    h.refused(b, p.ReportEscape(pool_id=pool.id + 100, escaped=True), ErrorCode.NOT_FOUND)
    opens(h, b, pool)
    h.ok(b, p.PublishLeaseEvent(pool_id=pool.id, handle=HANDLE))
    hand_over(pool, b)
    h.ok(b, p.ReportEscape(pool_id=pool.id, escaped=True))
    held = lease_table.encode(LeaseKind.BORROW, b.id, b.pid)
    assert pool.segment.acquire(held, pool.epoch, 0) == (LeaseStatus.OK, 0)
    assert fields(pool) == (LeaseFlag.SHARED, word_session(b.id), word_session(b.id))
    h.ok(b, p.ReleaseArena(name=ARENA))
    # It can no longer report its tensors gone (its mapping is), so the mark goes with it;
    # and its lease, as at its end.
    assert fields(pool) == (LeaseFlag.SHARED, 0, 0) and pool.segment.peek() == 0
    h.refused(s, p.LookupLeaseEvent(pool_id=pool.id, session=word_session(b.id)), ErrorCode.NOT_FOUND)
    h.refused(b, p.ReportEscape(pool_id=pool.id, escaped=False), ErrorCode.PERMISSION_DENIED)
    assert h.state.graph_pools.by_id[pool.id].users == {s.id}
    h.state.tick()
    assert [g.lease_repairs for g in h.state.status().graph_pools] == [0], "letting go is no repair"
