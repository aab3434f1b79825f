"""The prefix directory's entries on a stand-in for its arena: what an adopter trusts,
and every way an entry the dead engine left can be wrong (cut short, in another block's
slot, flipped bits, past the adopter's blocks, an old duplicate, a bad header)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import pytest

from gpumem.errors import InvalidArgument
from gpumem.prefix_directory import ENTRY_BYTES, HEADER_BYTES, MAGIC, SEQUENCE_END, PrefixDirectory, bytes_for

BLOCKS = 16


class Memory:
    """An arena's committed bytes, as the directory reads and writes them."""

    name = "engine-prefix"

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.committed = size

    def write(self, offset: int, data: bytes) -> None:
        self.data[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self.data[offset : offset + size])


@pytest.fixture
def memory() -> Memory:
    m = Memory(bytes_for(BLOCKS))
    m.write(0, struct.pack("<QIIQ", MAGIC, 1, ENTRY_BYTES, BLOCKS))
    return m


def slot(block: int) -> int:
    return HEADER_BYTES + block * ENTRY_BYTES


def test_published_blocks_are_read_back_by_hash(memory: Memory) -> None:
    d = PrefixDirectory.open(memory)
    for block, h in ((0, 101), (3, 303), (7, (1 << 64) - 1)):
        d.publish(block, h)
    scan = PrefixDirectory.open(memory).scan()
    assert scan.blocks == {101: 0, 303: 3, (1 << 64) - 1: 7}
    assert (scan.empty, scan.corrupt, scan.beyond, scan.last_sequence) == (BLOCKS - 3, 0, 0, 3)


def test_an_invalidated_block_is_not_trusted(memory: Memory) -> None:
    d = PrefixDirectory.open(memory)
    d.publish(2, 22)
    d.invalidate(2)
    assert d.scan().blocks == {}


def _moved(d: PrefixDirectory, m: Memory) -> None:
    """Block 4's entry found in slot 5 (slot 4 empty): a stray write, not block 5's."""
    entry = m.read(slot(4), ENTRY_BYTES)
    d.invalidate(4)
    m.write(slot(5), entry)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d, m: m.write(slot(4) + 16, bytes(8)), id="cut short (block id and crc not written)"),
        pytest.param(lambda d, m: m.write(slot(4) + 8, struct.pack("<Q", 999)), id="hash changed after the crc"),
        pytest.param(lambda d, m: m.write(slot(4) + 20, b"\x01"), id="a flipped crc byte"),
        pytest.param(_moved, id="another block's entry in this slot"),
    ],
)
def test_a_corrupt_entry_is_counted_and_not_trusted(memory: Memory, damage: Callable[[PrefixDirectory, Memory], None]) -> None:
    d = PrefixDirectory.open(memory)
    d.publish(4, 44)
    d.publish(9, 99)
    damage(d, memory)
    scan = d.scan()
    assert scan.blocks == {99: 9}
    assert scan.corrupt == 1


def test_blocks_past_the_adopters_are_not_trusted(memory: Memory) -> None:
    d = PrefixDirectory.open(memory)
    d.publish(1, 11)
    d.publish(12, 1212)
    d.publish(8, 88)  # the first block past the adopter's
    d.publish(7, 77)  # its last
    scan = d.scan(blocks=8)
    assert scan.blocks == {11: 1, 77: 7} and scan.beyond == 2


@pytest.mark.parametrize("sequence", [(1 << 64) - 1, SEQUENCE_END])
def test_an_entry_with_a_sequence_out_of_range_is_corrupt_and_publishing_goes_on(memory: Memory, sequence: int) -> None:
    """An entry with a valid checksum and a sequence no publish writes: ignored, and the
    sequences after it stay ones an entry holds (2^64-1 made every later publish raise
    struct.error)."""
    PrefixDirectory.open(memory).publish(2, 22)
    memory.write(slot(5), struct.pack("<QQII8x", sequence, 55, 5, zlib.crc32(struct.pack("<QQI", sequence, 55, 5))))
    d = PrefixDirectory.open(memory)
    scan = d.scan()
    assert scan.blocks == {22: 2} and scan.corrupt == 1 and scan.last_sequence == 1
    d.publish(3, 33)
    assert d.scan().blocks == {22: 2, 33: 3}


def test_the_later_of_two_entries_for_one_hash_wins_and_sequences_go_on_after_reopen(memory: Memory) -> None:
    d = PrefixDirectory.open(memory)
    d.publish(6, 66)
    d.publish(2, 66)  # the same content cached again, later
    assert d.scan().blocks == {66: 2}
    again = PrefixDirectory.open(memory)  # an adopter publishing on
    again.publish(6, 66)
    assert again.scan().blocks == {66: 6} and again.scan().last_sequence == 3


def test_an_adopter_reads_the_entries_once_its_scan_and_its_sequences_from_one_read(memory: Memory) -> None:
    """On a failover's path every entry is read once: open checks the header alone, and
    the adopter's scan also finds where its own sequences go on."""
    PrefixDirectory.open(memory).publish(3, 33)
    reads: list[int] = []
    read = memory.read
    memory.read = lambda offset, size: reads.append(size) or read(offset, size)  # type: ignore[method-assign]
    adopter = PrefixDirectory.open(memory)
    assert reads == [struct.calcsize("<QIIQ")], "open reads the header, no entry"
    assert adopter.scan(blocks=BLOCKS).blocks == {33: 3}
    adopter.publish(4, 44)
    assert len(reads) == 2, "publish after the scan reads nothing more"
    assert adopter.scan().last_sequence == 2


def test_a_bad_header_or_block_is_refused(memory: Memory) -> None:
    memory.write(0, b"\x00" * 8)
    with pytest.raises(InvalidArgument, match="holds no prefix directory"):
        PrefixDirectory.open(memory)
    memory.write(0, struct.pack("<QIIQ", MAGIC, 1, ENTRY_BYTES, BLOCKS * 100))  # more blocks than it has room for
    with pytest.raises(InvalidArgument, match="holds no prefix directory"):
        PrefixDirectory.open(memory)
    d = PrefixDirectory(memory, BLOCKS)
    with pytest.raises(InvalidArgument, match="not 16"):
        d.publish(BLOCKS, 1)
