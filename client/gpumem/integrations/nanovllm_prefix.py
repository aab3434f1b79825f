"""nano-vllm's prefix cache kept in a retained prefix directory (gpumem.prefix_directory),
so that an engine adopting the KV pool after this one died seeds its block manager
from it. No torch or nano-vllm here: the block manager is reached through its fields and
three of its methods (nano-vllm's names), wrapped on the instance.

The engine's part of the directory's bargain, at nano-vllm's seams:
- a block is written anew only once the scheduler took it (``_allocate_block``): at
  the end of ``schedule``, before the step runs, every block taken in it whose hash is
  not the one published is invalidated (a prefix-cache hit takes a block back with its
  hash and rows unchanged: its entry stays);
- a block's rows are complete once the step that filled it ran (the prompt's full
  blocks, hashed by ``allocate``; a decode block, hashed by ``may_append`` when its last
  slot is scheduled): ``after_step``, called once the step's tokens are on the host
  (nano-vllm's sampler copies them, which waits for the step's stream work), publishes
  them;
- blocks moved or dropped by the follower (gpumem.integrations.nanovllm_blocks) change
  ids: when the block count changed, every entry is checked against the block manager.

The adopter: ``seed`` puts the directory's trusted entries in the block manager as free
cached blocks (nano-vllm's hit path takes a free block with a matching hash), and since
the directory keeps hashes and not tokens, the first prompt that hits a seeded block
gives it its token ids (the 64-bit chained hash vouches for them, as nano-vllm's own
cache does for a block whose tokens it kept).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Directory(Protocol):
    """What the keeper needs of the directory (``gpumem.PrefixDirectory``)."""

    def publish(self, block: int, content_hash: int) -> None: ...

    def invalidate(self, block: int) -> None: ...


class DirectoryKeeper:
    def __init__(self, manager: Any, directory: Directory, published: Mapping[int, int] | None = None) -> None:
        self.manager = manager
        self.directory = directory
        self.published: dict[int, int] = dict(published or {})  # block id -> the hash its entry holds
        self._taken: set[int] = set()  # blocks the scheduler took this step
        self._filled: set[int] = set()  # blocks whose last slot this step writes
        self._unverified: set[int] = set()  # seeded blocks whose token ids no prompt gave yet
        self._blocks = len(manager.blocks)
        take, allocate, may_append = manager._allocate_block, manager.allocate, manager.may_append

        def _allocate_block(block_id: int) -> Any:
            self._taken.add(block_id)
            self._unverified.discard(block_id)
            return take(block_id)

        def allocate_(seq: Any) -> None:
            if self._unverified:
                self._vouch(seq)
            allocate(seq)

        def may_append_(seq: Any) -> None:
            may_append(seq)
            if len(seq) % manager.block_size == 0:
                self._filled.add(seq.block_table[-1])

        manager._allocate_block, manager.allocate, manager.may_append = _allocate_block, allocate_, may_append_

    def seed(self, trusted: Mapping[int, int]) -> int:
        """The adopted directory's trusted entries (hash -> block) as free cached blocks;
        returns how many were taken (a block in use, or past the block manager's, is not)."""
        m = self.manager
        seeded = 0
        for h, block in trusted.items():
            if block >= len(m.blocks) or m.blocks[block].ref_count or h in m.hash_to_block_id:
                continue
            m.blocks[block].hash, m.blocks[block].token_ids = h, []
            m.hash_to_block_id[h] = block
            self.published[block] = h
            self._unverified.add(block)
            seeded += 1
        return seeded

    def _vouch(self, seq: Any) -> None:
        """Give the seeded blocks this prompt hits its token ids, so that nano-vllm's
        hit check (the block's tokens equal the prompt's) passes."""
        m = self.manager
        h = -1
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            if len(tokens) != m.block_size:
                return
            h = m.compute_hash(tokens, h)
            block = m.hash_to_block_id.get(h, -1)
            if block == -1:
                return
            if block in self._unverified:
                m.blocks[block].token_ids = list(tokens)
                self._unverified.discard(block)

    def before_step(self) -> None:
        """After ``schedule``, before the step writes: no entry vouches for a block the
        step may rewrite."""
        m = self.manager
        if len(m.blocks) != self._blocks:  # the follower moved blocks and resized
            self._blocks = len(m.blocks)
            for block, h in list(self.published.items()):
                if block >= len(m.blocks) or m.blocks[block].hash != h:
                    self._forget(block)
            self._filled |= {b.block_id for b in m.blocks if b.hash != -1 and self.published.get(b.block_id) != b.hash}
        for block in self._taken:
            if block in self.published and (block >= len(m.blocks) or m.blocks[block].hash != self.published[block]):
                self._forget(block)

    def forget_all(self) -> None:
        """The KV rows are gone (a dropped sleep): no entry vouches for any block."""
        for block in list(self.published):
            self._forget(block)

    def _forget(self, block: int) -> None:
        self.directory.invalidate(block)
        del self.published[block]

    def after_step(self) -> None:
        """The step's writes are done: publish the blocks it filled."""
        m = self.manager
        for block in self._taken | self._filled:
            if block < len(m.blocks) and m.blocks[block].hash != -1 and self.published.get(block) != m.blocks[block].hash:
                self.directory.publish(block, m.blocks[block].hash)
                self.published[block] = m.blocks[block].hash
        self._taken.clear()
        self._filled.clear()
