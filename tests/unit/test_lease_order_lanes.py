"""The daemon's sequence chunk (memops lease ordering) on the host backend: zeroed at
start, a swept lane's value written at once and again once its writer is fenced, and a
lane handed to a new session only after that (a late write of the last holder's must not
meet the new holder's values)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from gpumem_shared.driver.host import HostDriver
from gpumem_shared.lease_order import SEQ_BITS, WORD_BYTES, reached
from gpumemd.lease_order_lanes import SequenceChunk
from gpumemd.records import SessionRecord


def session(sid: int, pid: int) -> SessionRecord:
    return SessionRecord(id=sid, name=f"client-{sid}", pid=pid, uid=0, gid=0, since=1.0, token=b"t")


class Fences:
    """The fence, played by the test: the pids whose processes can no longer write."""

    def __init__(self) -> None:
        self.gone: set[int] = set()

    def __call__(self, pid: int, since: float) -> str:
        return "" if pid in self.gone else f"pid {pid} is alive"


@pytest.fixture
def chunk() -> Iterator[tuple[SequenceChunk, Fences]]:
    fences = Fences()
    c = SequenceChunk(HostDriver(0), fences)
    yield c, fences
    c.close()


def word(c: SequenceChunk, lane: int) -> int:
    return ctypes.c_uint64.from_address(c.view + lane * WORD_BYTES).value


def test_the_chunk_starts_zeroed_with_a_lane_per_word(chunk: tuple[SequenceChunk, Fences]) -> None:
    c, _ = chunk
    assert c.lanes.lanes == HostDriver(0).granularity // WORD_BYTES
    assert all(word(c, lane) == 0 for lane in (0, 1, c.lanes.lanes - 1))


def test_a_swept_lane_is_written_now_and_again_once_fenced_and_only_then_handed_out(chunk: tuple[SequenceChunk, Fences]) -> None:
    c, fences = chunk
    c.lanes = type(c.lanes)(1)  # one lane: a new session can only get the swept one
    lane, base = c.grant(1, session(5, pid=500))
    c.sweep(1, 5)
    top = word(c, lane)
    assert reached(top, base | 1000), "at once: every value the session could have published is reached"
    # A write its stream had queued lands after the sweep and lowers the word.
    HostDriver(0).write(c.view + lane * WORD_BYTES, (base | 3).to_bytes(WORD_BYTES, "little"))
    c.settle()
    assert word(c, lane) == base | 3, "not fenced yet: nothing is written again"
    with pytest.raises(LookupError):
        c.grant(1, session(6, pid=600))
    fences.gone.add(500)
    c.settle()
    assert word(c, lane) == top and not c.draining
    again, new_base = c.grant(1, session(6, pid=600))
    assert again == lane and new_base == (base >> SEQ_BITS) + 1 << SEQ_BITS
    assert not reached(word(c, lane), new_base | 1)
