"""Ordering by stream memory operations (lease_order.py): the sequence values of a lane,
the daemon's lane book, and the handoff protocol on real lease segments with the host
backend's words (plain shared memory), a releaser in another process included.

On the host backend work is synchronous: a write lands at once and a taker's wait is a
bounded poll of the word, so what these tests check is the protocol of values (which
value a release publishes, which value satisfies a wait). The same scenario with GPU
work in flight is tests/integration/test_lease_memops_gpu.py."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpumem_shared import lease_order, lease_table
from gpumem_shared.driver import DriverError
from gpumem_shared.driver.host import HostDriver
from gpumem_shared.lease_order import SEQ_BITS, SEQ_MASK, LaneBook, ReleaserLane, reached, swept
from gpumem_shared.lease_table import LeaseFlag, LeaseKind, LeaseSegment, LeaseStatus

EPOCH = lease_table.lease_epoch(1, 1)
LANES = 16
RELEASER = lease_table.encode(LeaseKind.REPLAY, 5, 1000)
TAKER = lease_table.encode(LeaseKind.REPLAY, 6, 1001)


# ---------------------------------------------------------------------- values


def test_reached_is_the_cyclic_greater_or_equal() -> None:
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    # Across the wrap, as cuStreamWaitValue64's default compare: (int64)(word - value) >= 0.
    assert reached(2, (1 << 64) - 3) and not reached((1 << 64) - 3, 2)


def test_lane_book_keeps_a_sessions_lane_and_starts_the_next_holder_above_the_sweep() -> None:
    book = LaneBook(2)
    lane, base = book.grant(pool_id=1, session_id=5)
    assert book.grant(1, 5) == (lane, base)
    other, _ = book.grant(2, 5)  # another pool of the same session: its own lane
    assert other != lane
    with pytest.raises(LookupError, match="all 2 lease ordering lanes"):
        book.grant(3, 5)
    last_written = base | 1000
    freed = book.release(1, 5)
    assert freed == (lane, swept(base))
    assert reached(swept(base), last_written)  # every value the dead holder could have published
    with pytest.raises(LookupError):
        book.grant(1, 6)  # a write of the holder's may still land: not handed out until settled
    book.settle(lane)
    again, new_base = book.grant(1, 6)
    assert again == lane
    # A stale value never satisfies a wait of the new holder: the sweep's, nor any before.
    assert not reached(swept(base), new_base | 1)
    assert book.release(1, 5) is None


def test_generations_wrap_without_a_stale_value_reaching_a_new_one() -> None:
    book = LaneBook(1)
    book._generation[0] = lease_order.GENERATIONS - 2  # the grant moves it to the last generation
    lane, base = book.grant(1, 5)
    assert base == (lease_order.GENERATIONS - 1) << SEQ_BITS
    _, top = book.release(1, 5) or (0, 0)
    book.settle(lane)
    _, wrapped = book.grant(1, 6)
    assert wrapped == 0 and not reached(top, wrapped | 1)


# ---------------------------------------------------------------------- the handoff on segments


class Words:
    """A sequence chunk as the host backend has it: a memfd page of lanes, mapped."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("gpumemd-test-lanes", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, LANES * lease_order.WORD_BYTES)
        self.map = mmap.mmap(self.fd, LANES * lease_order.WORD_BYTES)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def __getitem__(self, lane: int) -> int:
        return ctypes.c_uint64.from_address(self.address + lane * lease_order.WORD_BYTES).value

    def sweep(self, lane: int, value: int) -> None:
        """The daemon's write at a sweep (HostDriver.write on its mapping)."""
        HostDriver(0).write(self.address + lane * lease_order.WORD_BYTES, value.to_bytes(8, "little"))


@pytest.fixture
def shared_pool() -> Iterator[tuple[LeaseSegment, int]]:
    segment, fd = LeaseSegment.create(1)
    segment.set_epoch(EPOCH)
    segment.set_flags(LeaseFlag.SHARED)
    yield segment, fd
    segment.close()
    os.close(fd)


@pytest.fixture
def words() -> Iterator[Words]:
    w = Words()
    yield w
    w.map.close()
    os.close(w.fd)


def test_a_lane_counts_up_from_its_generation_and_commits_only_written_values(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    segment, _ = shared_pool
    lane = ReleaserLane(3, base=7 << SEQ_BITS, lanes_address=words.address)
    for n in (1, 2):
        assert segment.try_acquire(RELEASER, EPOCH, b"r") in (LeaseStatus.OK, LeaseStatus.OK_ORDER)
        assert lane.release(0, segment.address, RELEASER, stream=11) == LeaseStatus.OK
        assert words[3] == (7 << SEQ_BITS) | n and segment.order() == (3, (7 << SEQ_BITS) | n)
        # Not the holder's release (the slot is free): nothing written, nothing counted.
        assert lane.release(0, segment.address, RELEASER, stream=11) == LeaseStatus.NOT_HOLDER
        assert lane.state.last == (7 << SEQ_BITS) | n and words[3] == (7 << SEQ_BITS) | n


def test_taker_waits_for_the_value_its_releaser_wrote(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    segment, _ = shared_pool
    lane = ReleaserLane(2, base=1 << SEQ_BITS, lanes_address=words.address)
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    assert lane.release(0, segment.address, RELEASER, stream=0) == LeaseStatus.OK
    assert segment.order() == (2, (1 << SEQ_BITS) | 1)
    assert words[2] == (1 << SEQ_BITS) | 1
    assert segment.try_acquire(TAKER, EPOCH, b"t") == LeaseStatus.OK_ORDER
    assert lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=1.0) == (1 << SEQ_BITS) | 1


def test_a_dead_releasers_unwritten_value_holds_the_taker_until_the_daemon_sweeps_its_lane(
    shared_pool: tuple[LeaseSegment, int], words: Words
) -> None:
    segment, _ = shared_pool
    book = LaneBook(LANES)
    index, base = book.grant(1, 5)
    releaser = ReleaserLane(index, base, words.address)
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    assert releaser.release(0, segment.address, RELEASER, stream=0) == LeaseStatus.OK
    # Its next release, as a releaser killed with the write queued leaves it: published, never written.
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    segment.publish_order(index, base | 2)
    assert segment.release_recorded(RELEASER) == LeaseStatus.OK
    assert segment.try_acquire(TAKER, EPOCH, b"t") == LeaseStatus.OK_ORDER
    with pytest.raises(DriverError, match="never wrote it"):
        lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=0.05)
    swept_lane = book.release(1, 5)
    assert swept_lane is not None
    words.sweep(*swept_lane)
    assert lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=1.0) == base | 2


def test_releases_from_two_streams_write_the_lanes_values_in_order(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    """The lane's state in native memory (lease_table.h's lease_lane): each release
    writes the next value and notes its stream, which the next release compares with its
    own (on CUDA a release from another stream first waits for the lane's last value;
    here every write lands at once)."""
    segment, _ = shared_pool
    lane = ReleaserLane(1, base=1 << SEQ_BITS, lanes_address=words.address)
    for n, stream in enumerate((11, 11, 22), start=1):
        assert segment.try_acquire(RELEASER, EPOCH, b"r") in (LeaseStatus.OK, LeaseStatus.OK_ORDER)
        assert lane.release(0, segment.address, RELEASER, stream) == LeaseStatus.OK
        assert (lane.state.last, lane.state.stream) == ((1 << SEQ_BITS) | n, stream)
        assert words[1] == (1 << SEQ_BITS) | n and segment.order() == (1, (1 << SEQ_BITS) | n)


def test_a_lane_out_of_values_frees_the_slot_and_orders_nobody_after_it(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    segment, _ = shared_pool
    lane = ReleaserLane(1, base=1 << SEQ_BITS, lanes_address=words.address)
    lane.state.last = (1 << SEQ_BITS) | SEQ_MASK  # every value of its generation written
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    with pytest.raises(OverflowError, match="used all"):
        lane.release(0, segment.address, RELEASER, 0)
    assert segment.peek() == 0 and segment.handoff() == 0, "freed, naming nobody: no taker waits for that value"
    assert lane.state.last == (1 << SEQ_BITS) | SEQ_MASK and words[1] == 0, "nothing counted"


def test_a_release_that_is_not_the_holders_writes_and_counts_nothing(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    segment, _ = shared_pool
    lane = ReleaserLane(1, base=1 << SEQ_BITS, lanes_address=words.address)
    assert segment.try_acquire(TAKER, EPOCH, b"t") == LeaseStatus.OK
    assert lane.release(0, segment.address, RELEASER, 0) == LeaseStatus.NOT_HOLDER
    assert lane.state.last == 1 << SEQ_BITS and words[1] == 0 and segment.order() == (0, 0) and segment.peek() == TAKER


def test_a_forged_lane_outside_the_chunk_is_not_waited_on(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    segment, _ = shared_pool
    segment.publish_order(LANES + 100, 1)
    assert lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=0.0) is None


# ---------------------------------------------------------------------- the take and its order in one call


def take(segment: LeaseSegment, words: Words, word: int = TAKER) -> int:
    """The fused memops try on context 0 (the host backend's), as Lease.acquire makes it."""
    return segment.try_acquire_memops(word, EPOCH, b"t", 0, 0, words.address, LANES)


def test_the_take_orders_after_the_releasers_value_in_the_same_call(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    segment, _ = shared_pool
    lane = ReleaserLane(2, base=1 << SEQ_BITS, lanes_address=words.address)
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    assert lane.release(0, segment.address, RELEASER, 0) == LeaseStatus.OK
    assert segment.handoff() == lease_table.word_session(5), "the release ended its mark, naming itself"
    assert take(segment, words) == LeaseStatus.OK_WAITED, "the value was written: waited for in the take"
    assert segment.clear(TAKER) == LeaseStatus.OK
    # Its next release published and never written (killed with the write queued).
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    segment.publish_order(2, (1 << SEQ_BITS) | 2)
    assert segment.release_recorded(RELEASER) == LeaseStatus.OK
    assert take(segment, words) == LeaseStatus.OK_ORDER, "not reached: the caller polls the word"
    assert segment.peek() == TAKER, "taken: the caller polls within its bound, and gives it back if it is late"
    with pytest.raises(DriverError, match="never wrote it"):
        lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=0.05)
    segment.clear(TAKER)
    words.sweep(2, swept(1 << SEQ_BITS))
    assert take(segment, words) == LeaseStatus.OK_WAITED


@pytest.mark.parametrize("lane", [LANES, LANES + 100], ids=["one past the chunk", "far past it"])
def test_the_take_waits_on_nothing_for_a_forged_lane(shared_pool: tuple[LeaseSegment, int], words: Words, lane: int) -> None:
    segment, _ = shared_pool
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    segment.publish_order(lane, 1)  # a lane outside the chunk, with a value nobody writes
    assert segment.release_recorded(RELEASER) == LeaseStatus.OK
    assert take(segment, words) == LeaseStatus.OK and segment.peek() == TAKER
    assert lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=0.0) is None


@pytest.mark.parametrize(
    ("written", "published", "status"),
    [
        pytest.param(3, (1 << 64) - 2, LeaseStatus.OK_WAITED, id="written past the wrap: reached"),
        pytest.param((1 << 63) + 5, 2, LeaseStatus.OK_ORDER, id="half the cycle behind: not reached"),
    ],
)
def test_the_take_compares_the_lanes_word_cyclically(
    shared_pool: tuple[LeaseSegment, int], words: Words, written: int, published: int, status: LeaseStatus
) -> None:
    """On context 0 the take reads the lane's word itself: reached is the cyclic
    greater-or-equal (lease_order.reached), as a GPU's wait compares, not the plain one."""
    segment, _ = shared_pool
    words.sweep(2, written)
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    segment.publish_order(2, published)
    assert segment.release_recorded(RELEASER) == LeaseStatus.OK
    assert take(segment, words) == status


def test_the_take_waits_for_a_release_in_flight_within_its_bound(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    """A releaser between freeing the slot and queuing its write (the slot marked
    recording): a try gives the slot back at once, an acquire waits for the mark within
    its timeout, then for the value."""
    segment, _ = shared_pool
    lane = ReleaserLane(2, base=1 << SEQ_BITS, lanes_address=words.address)
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    assert lane.release(0, segment.address, RELEASER, 0) == LeaseStatus.OK
    segment._slot.handoff = lease_table.word_session(5) | lease_table.HANDOFF_RECORDING
    assert take(segment, words) == LeaseStatus.RECORDING and segment.peek() == 0
    late = segment.acquire_memops(TAKER, EPOCH, 0.05, None, 0, 0, words.address, LANES)
    assert late[0] == LeaseStatus.RECORDING and segment.peek() == 0
    ended = threading.Timer(0.05, setattr, (segment._slot, "handoff", lease_table.word_session(5)))
    ended.start()
    try:
        assert segment.acquire_memops(TAKER, EPOCH, 10.0, None, 0, 0, words.address, LANES)[0] == LeaseStatus.OK_WAITED
    finally:
        ended.cancel()


def test_a_waiting_take_is_woken_by_the_release_and_orders_in_the_same_call(shared_pool: tuple[LeaseSegment, int], words: Words) -> None:
    segment, _ = shared_pool
    lane = ReleaserLane(2, base=1 << SEQ_BITS, lanes_address=words.address)
    assert segment.try_acquire(RELEASER, EPOCH, b"r") == LeaseStatus.OK
    results: list[tuple[int, int]] = []
    taker = threading.Thread(target=lambda: results.append(segment.acquire_memops(TAKER, EPOCH, 10.0, b"t", 0, 0, words.address, LANES)))
    taker.start()
    while not segment._slot.waiters and taker.is_alive():  # asleep on the futex, or about to be
        time.sleep(0.001)
    assert lane.release(0, segment.address, RELEASER, 0) == LeaseStatus.OK
    taker.join(10)
    assert results == [(LeaseStatus.OK_WAITED, RELEASER)]
    assert segment.peek() == TAKER and words[2] == (1 << SEQ_BITS) | 1


_RELEASER_PROCESS = """
import os, sys, mmap, ctypes
from gpumem_shared import lease_order
from gpumem_shared.driver.host import HostDriver
from gpumem_shared.lease_table import LeaseSegment, LeaseStatus
seg_fd, words_fd, word, epoch, base, write = (int(a) for a in sys.argv[1:7])
words = mmap.mmap(words_fd, {size})
address = ctypes.addressof(ctypes.c_char.from_buffer(words))
segment = LeaseSegment(seg_fd)
assert segment.try_acquire(word, epoch, b"releaser") == LeaseStatus.OK
if write:
    status = lease_order.ReleaserLane(4, base, address).release(0, segment.address, word, 0)
else:  # killed with its write queued: the value published, never written
    segment.publish_order(4, base | 1)
    status = segment.release_recorded(word)
print(status, flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("write", [True, False], ids=["writes", "dies-before-its-write"])
def test_a_releaser_in_another_process(shared_pool: tuple[LeaseSegment, int], words: Words, write: bool) -> None:
    segment, fd = shared_pool
    book = LaneBook(LANES)
    book._free.remove(4), book._free.append(4)  # the lane the child writes
    lane, base = book.grant(1, 5)
    assert lane == 4
    code = _RELEASER_PROCESS.format(size=LANES * lease_order.WORD_BYTES)
    done = subprocess.run(
        [sys.executable, "-c", code, str(fd), str(words.fd), str(RELEASER), str(EPOCH), str(base), str(int(write))],
        pass_fds=(fd, words.fd), capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(int(LeaseStatus.OK))
    assert segment.try_acquire(TAKER, EPOCH, b"t") == LeaseStatus.OK_ORDER
    if write:
        assert words[4] == base | 1
        assert lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=5.0) == base | 1
        return
    assert words[4] == 0
    with pytest.raises(DriverError):
        lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=0.05)
    swept_lane: Any = book.release(1, 5)
    words.sweep(*swept_lane)
    assert lease_order.order_after(0, segment, words.address, LANES, 0, timeout_s=5.0) == base | 1
    assert SEQ_MASK & swept_lane[1] == SEQ_MASK
