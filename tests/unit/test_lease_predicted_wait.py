"""The adaptive wait on a lease slot: each holder's release folds its hold into the
segment's estimate (lease_hold), and a waiter that finds the slot held sleeps on the
futex only until shortly before the holder is predicted to let go, then watches the word
(leases.c's gpumem_lease_acquire). Threads stand in for other processes (the native
calls drop the GIL).

What is observed is the slot's waiters count, which counts a waiter only while it is
asleep on the futex: a waiter with a prediction stops being counted, by itself, while the
holder still holds, and is awake when the holder lets go. The watch lasts a few hundred
microseconds, so the tests that look for it poll the count without sleeping and try a
few times: a poller descheduled for the whole watch on a loaded machine sees nothing,
and that attempt says nothing either way."""

from __future__ import annotations

import time

import pytest

from gpumem_shared.lease_table import HOLD_MAX_NS, LeaseKind, LeaseSegment, LeaseStatus

from .lease_kit import EPOCH, Waiter, fresh_segment, word

# leases.c's LEASE_WAKE_EARLY_NS: a predicted waiter stops sleeping this long before the
# predicted release.
WAKE_EARLY_NS = 150_000
ATTEMPTS = 5


HOLDER, TAKER = word(LeaseKind.CAPTURE, 1, 11), word(LeaseKind.REPLAY, 2, 22)


def hold_with(table: LeaseSegment, typical_ns: int, since_shift_ns: int = 0) -> int:
    """The holder takes the slot; the estimate is set as earlier releases (or a hostile
    process) left it, and the take's since_ns moved by ``since_shift_ns``. Returns since_ns."""
    assert table.acquire(HOLDER, EPOCH, 0) == (LeaseStatus.OK, 0)
    table._hold.typical_ns = typical_ns
    table._slot.since_ns += since_shift_ns
    return int(table._slot.since_ns)


def until_counted(table: LeaseSegment, timeout: float = 5.0) -> None:
    """Until the waiter is asleep on the futex (counted). Sleeps between looks: the waiter
    thread needs the GIL until its native call."""
    deadline = time.monotonic() + timeout
    while table._slot.waiters == 0:
        assert time.monotonic() < deadline, f"the waiter was not counted asleep within {timeout}s"
        time.sleep(0.0001)


def until_uncounted(table: LeaseSegment, until_ns: int) -> int | None:
    """Poll, without sleeping, until the slot's waiters count drops to 0 while the
    holder still holds it: the realtime ns then, or None if it stays counted until
    ``until_ns`` (realtime)."""
    while time.time_ns() < until_ns:
        if table._slot.waiters == 0:
            return time.time_ns()
    return None


def hold_ends(table: LeaseSegment, waiter: Waiter) -> None:
    assert table.release(HOLDER) == LeaseStatus.OK
    assert waiter.finish()[0] == LeaseStatus.OK
    assert table.release(TAKER) == LeaseStatus.OK


# ===================================================================== the estimate


def released_hold(table: LeaseSegment, held_ns: int) -> tuple[int, int]:
    """A hold of about ``held_ns``, its since_ns set back that far: the bounds (ns) of the
    hold the release measured."""
    assert table.acquire(HOLDER, EPOCH, 0) == (LeaseStatus.OK, 0)
    table._slot.since_ns = since = time.time_ns() - held_ns
    before = time.time_ns()
    assert table.release(HOLDER) == LeaseStatus.OK
    return before - since, time.time_ns() - since


def test_each_release_folds_its_hold_into_the_estimate_a_quarter_of_the_way(table: LeaseSegment) -> None:
    assert table._hold.typical_ns == 0, "a new segment predicts nothing"
    low, high = released_hold(table, 4_000_000)
    first = table._hold.typical_ns
    if high <= HOLD_MAX_NS:  # (a stall of the whole machine past the cap leaves 0: below)
        assert low <= first <= high, "the first hold is the estimate"
    low, high = released_hold(table, 1_000_000)
    if first and high <= HOLD_MAX_NS:
        assert first + (low - first) // 4 - 1 <= table._hold.typical_ns <= first + (high - first) // 4 + 1


def test_a_hold_past_the_cap_or_from_a_since_in_the_future_leaves_no_estimate(table: LeaseSegment) -> None:
    for past_the_cap in (HOLD_MAX_NS + 5_000_000, -1_000_000_000):  # the second: a since_ns written a second ahead
        _, high = released_hold(table, 2_000_000)
        assert high > HOLD_MAX_NS or table._hold.typical_ns > 0
        released_hold(table, past_the_cap)
        assert table._hold.typical_ns == 0, "a hold past the cap predicts nothing"


@pytest.mark.parametrize("garbage", [HOLD_MAX_NS + 1, 1 << 63, (1 << 64) - 1])
def test_a_garbage_estimate_starts_afresh_from_the_next_hold(table: LeaseSegment, garbage: int) -> None:
    table._hold.typical_ns = garbage
    low, high = released_hold(table, 3_000_000)
    if high <= HOLD_MAX_NS:
        assert low <= table._hold.typical_ns <= high


def test_the_daemons_clear_leaves_the_estimate(table: LeaseSegment) -> None:
    """A holder swept by the daemon (it died) held for no telling how long."""
    table._hold.typical_ns = 2_000_000
    assert table.acquire(HOLDER, EPOCH, 0) == (LeaseStatus.OK, 0)
    table._slot.since_ns = time.time_ns() - 50_000_000
    assert table.clear(HOLDER) == LeaseStatus.OK
    assert table._hold.typical_ns == 2_000_000


def test_a_moved_segment_keeps_the_estimate() -> None:
    old, new = fresh_segment(1), fresh_segment(2)
    try:
        old._hold.typical_ns = 1_234_567
        new.adopt(old, 0, 0)
        assert new._hold.typical_ns == 1_234_567
    finally:
        old.close()
        new.close()


# ===================================================================== the waits


def test_a_waiter_is_awake_before_the_predicted_release_and_takes_the_slot_while_watching(table: LeaseSegment) -> None:
    typical = 8_000_000
    for _ in range(ATTEMPTS):
        since = hold_with(table, typical)
        waiter = Waiter(table, TAKER, EPOCH, 10.0)
        waiter.start()
        until_counted(table)
        awake = until_uncounted(table, since + typical + 20_000_000)
        asleep_at_release = table._slot.waiters
        hold_ends(table, waiter)
        if awake is not None and asleep_at_release == 0:
            assert awake - since >= typical - WAKE_EARLY_NS - 100_000, "woke no earlier than the margin before the predicted release"
            assert waiter.elapsed < 5.0
            return
    pytest.fail(f"in {ATTEMPTS} attempts, no waiter stopped sleeping before a release predicted {typical / 1e6} ms after the take")


def test_a_holder_that_overruns_the_prediction_finds_the_waiter_asleep_again_and_wakes_it(table: LeaseSegment) -> None:
    """At most one predicted wake in an acquire: after its watch the waiter sleeps on the
    futex until the release (or its deadline), and the release wakes it as before."""
    typical = 5_000_000
    for _ in range(ATTEMPTS):
        since = hold_with(table, typical)
        waiter = Waiter(table, TAKER, EPOCH, 10.0)
        waiter.start()
        until_counted(table)
        awake = until_uncounted(table, since + typical + 20_000_000)
        if awake is None:
            hold_ends(table, waiter)
            continue
        until_counted(table)  # back asleep after the watch
        stays_counted = until_uncounted(table, time.time_ns() + 50_000_000) is None
        released = time.monotonic()
        hold_ends(table, waiter)
        assert stays_counted, "the waiter predicted a second release in the same acquire"
        assert time.monotonic() - released < 1.0 and waiter.elapsed < 5.0, "the release woke the sleeper"
        return
    pytest.fail(f"in {ATTEMPTS} attempts, no waiter stopped sleeping before a release predicted {typical / 1e6} ms after the take")


@pytest.mark.parametrize(
    ("typical", "since_shift_ns"),
    [(0, 0), (HOLD_MAX_NS + 1, 0), ((1 << 64) - 1, 0), (5_000_000, 1_000_000_000), (5_000_000, -1_000_000_000)],
    ids=["none", "past-the-cap", "huge", "since-in-the-future", "release-in-the-past"],
)
def test_garbage_predicts_nothing_and_the_waiter_sleeps_until_the_release(table: LeaseSegment, typical: int, since_shift_ns: int) -> None:
    """Any process that maps the segment may write the estimate and since_ns: garbage
    means no prediction (no wake of the waiter's own before the release)."""
    hold_with(table, typical, since_shift_ns)
    waiter = Waiter(table, TAKER, EPOCH, 10.0)
    waiter.start()
    until_counted(table)
    woke = until_uncounted(table, time.time_ns() + (HOLD_MAX_NS + 30_000_000))
    hold_ends(table, waiter)
    assert woke is None, "the waiter stopped sleeping on a prediction from garbage"


@pytest.mark.parametrize("timeout_ns", [3_000_000, 9_950_000], ids=["before-the-watch", "inside-the-watch"])
def test_a_predicted_wait_ends_at_the_callers_deadline(table: LeaseSegment, timeout_ns: int) -> None:
    """A release predicted 10 ms after the take: a wait of 3 ms ends before the waiter
    would have woken to watch, one of 9.95 ms while it watches; both at their deadline."""
    hold_with(table, HOLD_MAX_NS)
    start = time.monotonic()
    assert table.acquire(TAKER, EPOCH, timeout_ns / 1e9) == (LeaseStatus.HELD, HOLDER)
    elapsed = time.monotonic() - start
    assert timeout_ns / 1e9 - 0.002 <= elapsed < timeout_ns / 1e9 + 1.0, f"waited {elapsed * 1e3:.2f} ms for {timeout_ns / 1e6} ms"
    assert table._slot.waiters == 0
    assert table.release(HOLDER) == LeaseStatus.OK

