"""A KV pool's prefix directory: for each full cached block, its content hash, written
in place by the engine into a small arena retained with the pool, so that an engine that
adopts the pool after the first one died seeds its prefix cache from it.

    directory = session.create_prefix_directory("engine-a-prefix", blocks=cache.max_blocks)
    group.retain(cache, directory)
    ...
    directory.invalidate(block)          # before the block's rows are written anew
    ... the step writes the block; once its writes are done (on CUDA: the stream synced) ...
    directory.publish(block, content_hash)

    # the adopter:
    directory = PrefixDirectory.open(adopted.arenas["engine-a-prefix"])
    scan = directory.scan(blocks=pool.tokens)    # scan.blocks: hash -> block id, trusted ones only

Layout: a 64-byte header (magic, layout version, entry size, capacity in blocks), then one
32-byte entry per block id: sequence (u64), content hash (u64), block id (u32), CRC-32 of
the three (u32), 8 bytes unused. An all-zero entry is empty. One write per publish and
per invalidation, no daemon round trip (a memcpy on the host backend, a small
host-to-device copy on CUDA).

What is trusted: an entry whose checksum holds, whose sequence is in range, whose block
id is its own slot and lies below the blocks the adopter has committed. A write the dead engine had not finished
fails its checksum; a block it was rewriting was invalidated before the rewrite began,
so it is empty; a block whose entry it had not published yet is simply absent. The
engine's part of the bargain is the order: invalidate before writing a block's rows,
publish only once they are written. Where two entries carry one hash, the later one
(higher sequence) wins.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import TYPE_CHECKING, Protocol

from gpumem.arena import Arena
from gpumem.errors import InvalidArgument

if TYPE_CHECKING:
    from gpumem.core import SessionCore

MAGIC = 0x31524944504D5047  # "GPMPDIR1", little-endian
LAYOUT_VERSION = 1
HEADER_BYTES = 64
ENTRY_BYTES = 32
_HEADER = struct.Struct("<QIIQ")  # magic, layout version, entry size, capacity
_ENTRY = struct.Struct("<QQII8x")  # sequence, hash, block id, crc
_SIGNED = struct.Struct("<QQI")  # what the crc covers
_EMPTY = bytes(ENTRY_BYTES)
_HASH_MASK = (1 << 64) - 1
# Sequences a directory's entries may carry: one per publish, so no engine comes near the
# end; an entry past it is corrupt (written by no publish), and trusting it would put the
# next sequence past what an entry holds.
SEQUENCE_END = 1 << 63


class Memory(Protocol):
    """What the directory needs of its arena (``gpumem.Arena``)."""

    name: str

    @property
    def committed(self) -> int: ...

    def write(self, offset: int, data: bytes) -> None: ...

    def read(self, offset: int, size: int) -> bytes: ...


def bytes_for(blocks: int) -> int:
    return HEADER_BYTES + blocks * ENTRY_BYTES


def _crc(sequence: int, content_hash: int, block: int) -> int:
    return zlib.crc32(_SIGNED.pack(sequence, content_hash, block))


@dataclasses.dataclass
class Scan:
    """What a directory holds: ``blocks`` maps each trusted content hash to its block id;
    the rest is counted by why it was not trusted."""

    blocks: dict[int, int]
    empty: int = 0
    corrupt: int = 0  # checksum failed, an entry in another block's slot (a write cut short), or a sequence out of range
    beyond: int = 0  # a block past what the adopter has committed
    last_sequence: int = 0


class PrefixDirectory:
    def __init__(self, arena: Memory, capacity: int, next_sequence: int | None = 1) -> None:
        self.arena = arena
        self.capacity = capacity
        # None: an opened directory's sequences go on after the highest one found, which
        # the adopter's scan finds (one read of every entry on a failover's path, not two)
        self._next = next_sequence

    @classmethod
    def create(cls, core: SessionCore, name: str, *, blocks: int) -> PrefixDirectory:
        """``Session.create_prefix_directory``: a directory for ``blocks`` block ids in a
        new arena ``name`` of the session whose core is ``core``, committed whole
        (zero-filled by the daemon: every entry empty)."""
        if blocks <= 0:
            raise InvalidArgument(f"prefix directory '{name}' needs at least one block, not {blocks}")
        g = core.device.granularity
        size = -(-bytes_for(blocks) // g) * g
        arena = Arena.create(core, name, size)
        try:
            arena.commit(size)
            arena.write(0, _HEADER.pack(MAGIC, LAYOUT_VERSION, ENTRY_BYTES, blocks))
        except BaseException:
            arena.release()
            raise
        return cls(arena, blocks)

    @classmethod
    def open(cls, arena: Memory) -> PrefixDirectory:
        """The directory in ``arena`` (adopted, or any mapping of one), its header checked;
        publishing goes on after the highest sequence found (by the first ``scan``, or
        before the first ``publish`` if no scan came first)."""
        if arena.committed < HEADER_BYTES:
            raise InvalidArgument(f"arena '{arena.name}' holds no prefix directory: {arena.committed} bytes committed")
        magic, version, entry, capacity = _HEADER.unpack(arena.read(0, _HEADER.size))
        if (magic, version, entry) != (MAGIC, LAYOUT_VERSION, ENTRY_BYTES) or bytes_for(capacity) > arena.committed:
            raise InvalidArgument(
                f"arena '{arena.name}' holds no prefix directory of layout {LAYOUT_VERSION} (magic {magic:#x}, layout "
                f"{version}, entry {entry} bytes, {capacity} blocks in {arena.committed} bytes committed)"
            )
        return cls(arena, capacity, next_sequence=None)

    def _slot(self, block: int) -> int:
        if not 0 <= block < self.capacity:
            raise InvalidArgument(f"prefix directory '{self.arena.name}' holds blocks 0..{self.capacity - 1}, not {block}")
        return HEADER_BYTES + block * ENTRY_BYTES

    def publish(self, block: int, content_hash: int) -> None:
        """Block ``block`` is full and its rows are written: it holds ``content_hash``."""
        offset = self._slot(block)
        h = content_hash & _HASH_MASK
        sequence = self._next if self._next is not None else self.scan().last_sequence + 1
        self._next = sequence + 1
        self.arena.write(offset, _ENTRY.pack(sequence, h, block, _crc(sequence, h, block)))

    def invalidate(self, block: int) -> None:
        """Block ``block`` is about to be written anew (or freed): no adopter may trust it."""
        self.arena.write(self._slot(block), _EMPTY)

    def scan(self, blocks: int | None = None) -> Scan:
        """Every entry read once; ``blocks``: how many blocks the reader has committed (an
        entry at or past it is not trusted)."""
        limit = self.capacity if blocks is None else min(blocks, self.capacity)
        raw = self.arena.read(HEADER_BYTES, self.capacity * ENTRY_BYTES)
        scan = Scan(blocks={})
        best: dict[int, int] = {}  # hash -> sequence of the entry kept
        for slot, (sequence, h, block, crc) in enumerate(_ENTRY.iter_unpack(raw)):
            if not (sequence or h or block or crc):
                scan.empty += 1
                continue
            if crc != _crc(sequence, h, block) or block != slot or not 0 < sequence < SEQUENCE_END:
                scan.corrupt += 1
                continue
            scan.last_sequence = max(scan.last_sequence, sequence)
            if block >= limit:
                scan.beyond += 1
                continue
            if sequence > best.get(h, 0):
                best[h] = sequence
                scan.blocks[h] = block
        if self._next is None:
            self._next = scan.last_sequence + 1
        return scan

    def __repr__(self) -> str:
        return f"<gpumem.PrefixDirectory '{self.arena.name}' {self.capacity} blocks>"
