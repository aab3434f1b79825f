"""The control channel's door (daemon/gpumemd/control_door.py), without zmq: which
connections a handover cuts off, which ones the budget hangs up, when the door shuts and
opens, and when only reopening the channel frees what is stalled."""

from __future__ import annotations

from gpumemd.control_door import SHUT_PATIENCE, STALL_AFTER, ControlDoor
from gpumemd.runtime import FdBudget

BUDGET = FdBudget.of(256)  # control: 96


def door() -> ControlDoor:
    return ControlDoor(BUDGET, hello_timeout=5.0)


def test_a_routing_id_taken_over_cuts_the_old_connection_off() -> None:
    d = door()
    d.accepted(10, uid=0, pid=1, now=0.0)
    d.accepted(11, uid=0, pid=2, now=0.0)
    assert d.spoke(10, b"id", session=False, now=1.0) is None
    assert d.spoke(10, b"id", session=False, now=1.1) is None  # the same connection again
    assert d.spoke(11, b"id", session=False, now=1.2) == 10  # the newer one took it over
    d.hang_up(d.peers[10], 1.2)
    assert d.spoke(11, b"id", session=False, now=1.3) is None
    d.closed(10)
    assert list(d.peers) == [11]


def test_past_the_budget_the_biggest_holder_loses_its_longest_idle_first() -> None:
    d = door()
    fd = 0
    for uid, count in ((1, 70), (2, 20), (3, 6)):
        for _ in range(count):
            d.accepted(fd, uid, pid=uid, now=float(fd))
            fd += 1
    d.spoke(90, b"session", session=True, now=200.0)  # uid 3's first: a session's
    d.accepted(fd, uid=3, pid=3, now=300.0)
    victims = d.excess(300.0)
    assert [v.fd for v in victims] == [0]  # one over: uid 1's oldest
    assert all(v.uid == 1 for v in victims)
    assert 90 not in {v.fd for v in d.excess(300.0)}


def test_the_door_shuts_at_the_budget_and_opens_at_three_quarters() -> None:
    d = door()
    for fd in range(BUDGET.control):
        d.accepted(fd, 0, 0, 0.0)
    assert d.shut_door(1.0) is True
    d.door_shut = True
    for fd in range(BUDGET.control // 4 - 1):
        d.closed(fd)
    assert d.shut_door(2.0) is None  # not yet
    d.closed(BUDGET.control // 4)
    assert d.shut_door(3.0) is False
    d.door_shut = False
    d.fd_pressure = True  # descriptors near the limit, whatever holds them
    assert d.shut_door(4.0) is True


def test_a_door_shut_a_while_hangs_up_down_to_where_it_opens() -> None:
    d = door()
    for fd in range(BUDGET.control):
        d.accepted(fd, 0, 0, 0.0)
    assert d.shut_door(1.0)
    d.door_shut = True
    assert d.excess(1.5) == []
    assert len(d.excess(1.0 + SHUT_PATIENCE)) == BUDGET.control - BUDGET.control * 3 // 4


def test_stalled_connections_reopen_the_channel_only_when_no_session_notices_or_the_budget_is_spent() -> None:
    d = door()
    d.accepted(5, 0, 0, 0.0)
    d.hang_up(d.peers[5], 1.0)
    assert not d.stalled(1.0 + STALL_AFTER / 2, sessions=0)
    assert d.stalled(1.0 + STALL_AFTER, sessions=0)
    assert not d.stalled(1.0 + STALL_AFTER, sessions=1)
    for fd in range(6, 6 + BUDGET.control):
        d.accepted(fd, 0, 0, 2.0)
    assert d.stalled(1.0 + STALL_AFTER, sessions=1)
    d.reopened()
    assert not d.peers


def test_a_door_shut_by_stalled_connections_reopens_the_channel() -> None:
    """Stalled connections short of the budget, the door shut: without the reopen nothing
    would ever let a connection in again."""
    d = door()
    for fd in range(BUDGET.control - 2):
        d.accepted(fd, 0, 0, 0.0)
        d.hang_up(d.peers[fd], 1.0)
    assert not d.stalled(1.0 + STALL_AFTER, sessions=1)
    d.door_shut = True
    assert d.stalled(1.0 + STALL_AFTER, sessions=1)


def test_only_connections_that_sent_nothing_are_hung_up_at_the_hello_timeout() -> None:
    d = door()
    for fd in (10, 11, 12):
        d.accepted(fd, uid=0, pid=fd, now=0.0)
    d.spoke(11, b"ctl", session=False, now=1.0)  # an anonymous peer (gpumemctl) that spoke once
    d.spoke(12, b"tok", session=True, now=2.0)
    assert [p.fd for p in d.silent(6.0)] == [10]


def test_past_the_budget_a_sessions_connection_is_never_hung_up() -> None:
    """The biggest holder's longest idle connection is its session's: the others go."""
    d = door()
    d.accepted(0, uid=1, pid=1, now=0.0)
    d.spoke(0, b"session", session=True, now=0.5)
    for fd in range(1, BUDGET.control + 4):
        d.accepted(fd, uid=1, pid=1, now=1.0 + fd)
    victims = [v.fd for v in d.excess(200.0)]
    assert victims == [1, 2, 3, 4]
