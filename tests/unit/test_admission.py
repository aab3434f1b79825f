"""Fair service (admission.FairQueue): control requests read ahead are served one peer
at a time in turn, each peer's queue and all of them together bounded."""

from __future__ import annotations

from gpumem_shared import protocol as p
from gpumemd.admission import ANONYMOUS, ANONYMOUS_QUEUED, QUEUED_BYTES, FairQueue


def drain(q: FairQueue) -> list[bytes]:
    out = []
    while q.peers:
        out.append(q.pop()[1])
    return out


def test_a_flooding_peer_delays_another_by_one_request_per_turn() -> None:
    q = FairQueue(per_session=64)
    for i in range(50):  # a backlog from the anonymous peers, read before the session's request
        assert q.push(ANONYMOUS, b"anon", b"flood%d" % i) is None
    assert q.push(7, b"probe", b"ping") is None
    assert q.push(7, b"probe", b"ping2") is None
    order = drain(q)
    assert order.index(b"ping") == 1 and order.index(b"ping2") == 3, order[:6]
    assert [f for f in order if f.startswith(b"flood")] == [b"flood%d" % i for i in range(50)], "a peer's requests keep their order"


def test_a_peer_over_its_queue_limit_is_refused_at_once() -> None:
    q = FairQueue(per_session=3)
    assert all(q.push(7, b"s", b"r") is None for _ in range(3))
    refusal = q.push(7, b"s", b"r")
    assert refusal is not None and refusal.code is p.ErrorCode.RESOURCE_EXHAUSTED
    assert (refusal.detail["limit"], refusal.detail["used"], refusal.detail["cap"]) == ("requests", 3, 3)
    assert q.push(8, b"t", b"r") is None, "another session's requests still queue"
    q.pop()
    assert q.push(7, b"s", b"r") is None, "served requests make room"
    for _ in range(ANONYMOUS_QUEUED):
        assert q.push(ANONYMOUS, b"a", b"x") is None
    assert q.push(ANONYMOUS, b"a", b"x") is not None


def test_queued_bytes_are_bounded() -> None:
    q = FairQueue(per_session=64)
    big = bytes(QUEUED_BYTES // 4)
    assert all(q.push(peer, b"s", big) is None for peer in (1, 2, 3, 4))
    refusal = q.push(5, b"s", b"x")
    assert refusal is not None and refusal.detail["limit"] == "request bytes"
    q.pop()
    assert q.push(5, b"s", b"x") is None
