"""Fair service (admission.FairQueue): control requests read ahead are served one uid at
a time in turn and one peer of that uid at a time in turn, each peer's queue and each
uid's bytes bounded, anonymous peers on a small budget of their own."""

from __future__ import annotations

from gpumem_shared import protocol as p
from gpumemd.admission import ANONYMOUS, ANONYMOUS_BYTES, ANONYMOUS_QUEUED, ANONYMOUS_UID, QUEUED_BYTES, FairQueue


def drain(q: FairQueue) -> list[bytes]:
    out = []
    while q.turns:
        out.append(q.pop()[1])
    return out


def test_a_flooding_peer_delays_another_by_one_request_per_turn() -> None:
    q = FairQueue(per_session=64)
    for i in range(50):  # a backlog from the anonymous peers, read before the session's request
        assert q.push(ANONYMOUS, ANONYMOUS_UID, b"anon", b"flood%d" % i) is None
    assert q.push(7, 1000, b"probe", b"ping") is None
    assert q.push(7, 1000, b"probe", b"ping2") is None
    order = drain(q)
    assert order.index(b"ping") == 1 and order.index(b"ping2") == 3, order[:6]
    assert [f for f in order if f.startswith(b"flood")] == [b"flood%d" % i for i in range(50)], "a peer's requests keep their order"


def test_a_peer_over_its_queue_limit_is_refused_at_once() -> None:
    q = FairQueue(per_session=3)
    assert all(q.push(7, 1000, b"s", b"r") is None for _ in range(3))
    refusal = q.push(7, 1000, b"s", b"r")
    assert refusal is not None and refusal.code is p.ErrorCode.RESOURCE_EXHAUSTED
    assert (refusal.detail["limit"], refusal.detail["used"], refusal.detail["cap"]) == ("requests", 3, 3)
    assert q.push(8, 1000, b"t", b"r") is None, "another session's requests still queue"
    q.pop()
    assert q.push(7, 1000, b"s", b"r") is None, "served requests make room"
    for _ in range(ANONYMOUS_QUEUED):
        assert q.push(ANONYMOUS, ANONYMOUS_UID, b"a", b"x") is None
    assert q.push(ANONYMOUS, ANONYMOUS_UID, b"a", b"x") is not None


def test_queued_bytes_are_bounded_per_uid() -> None:
    q = FairQueue(per_session=64)
    big = bytes(QUEUED_BYTES // 4)
    assert all(q.push(peer, 1000, b"s", big) is None for peer in (1, 2, 3, 4))
    refusal = q.push(5, 1000, b"s", b"x")
    assert refusal is not None and refusal.detail["limit"] == "request bytes"
    assert q.push(6, 0, b"root", b"x") is None, "another uid's budget is its own"
    q.pop()
    assert q.push(5, 1000, b"s", b"x") is None


def test_anonymous_peers_cannot_fill_the_sessions_budget() -> None:
    """B13: anonymous peers sending 2 MiB frames stop at their own small budget; a
    session's request still queues."""
    q = FairQueue(per_session=64)
    frame = bytes(2 << 20)
    taken = 0
    while q.push(ANONYMOUS, ANONYMOUS_UID, b"anon", frame) is None:
        taken += 1
    assert taken * (2 << 20) <= ANONYMOUS_BYTES < QUEUED_BYTES
    for i in range(8):
        assert q.push(1 + i, 0, b"s%d" % i, frame) is None, "uid 0's sessions refused after anonymous peers filled theirs"


def test_a_uid_with_many_sessions_gets_one_turn_among_all() -> None:
    """B14: 200 sessions of one uid, each with requests waiting, delay another uid's
    session by one request per turn, not one per session."""
    q = FairQueue(per_session=64)
    for session in range(1, 201):
        for i in range(3):
            assert q.push(session, 65534, b"f", b"flood-%d-%d" % (session, i)) is None
    assert q.push(500, 0, b"probe", b"ping") is None
    assert q.push(500, 0, b"probe", b"ping2") is None
    order = drain(q)
    assert order.index(b"ping") == 1 and order.index(b"ping2") == 3, order[:6]
    flood = [f for f in order if f.startswith(b"flood")]
    assert flood[:3] == [b"flood-1-0", b"flood-2-0", b"flood-3-0"], "a uid's sessions take turns among themselves"
    assert [f for f in flood if f.startswith(b"flood-7-")] == [b"flood-7-%d" % i for i in range(3)], "a session's requests keep their order"
