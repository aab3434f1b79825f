"""An engine's prefix cache kept in a retained prefix directory (gpumem.prefix_directory),
so that an engine adopting the KV pool after this one died seeds its prefix cache from
it. No torch or engine here: the engine's adapter reports which blocks its scheduler
takes and which a step fills (``hook_prefix_events``), says the hash its prefix cache
holds for a block (``block_hash``) and takes seeded blocks (``seed_block``).

The engine's part of the directory's bargain, at the port's step hook:
- a block is written anew only once the scheduler took it (``taken``): at the end of
  scheduling, before the step runs (``before_step``), every block taken in it whose hash
  is not the one published is invalidated (a prefix-cache hit takes a block back with
  its hash and rows unchanged: its entry stays);
- a block's rows are complete once the step that filled it ran (a prompt's full blocks,
  a decode block whose last slot the step writes: ``filled``): ``after_step``, called
  once the step's outputs reached the host (which waits for the step's device work),
  publishes them;
- blocks moved or dropped by the follower (gpumem.port.blocks) change ids: when the
  block count changed, every entry is checked against the engine's hashes.

The adopter: ``seed`` gives the directory's trusted entries to the engine as free cached
blocks (``seed_block``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gpumem.port.adapter import EngineAdapter


class Directory(Protocol):
    """What the keeper needs of the directory (``gpumem.PrefixDirectory``)."""

    def publish(self, block: int, content_hash: int) -> None: ...

    def invalidate(self, block: int) -> None: ...


class DirectoryKeeper:
    def __init__(self, engine: EngineAdapter, directory: Directory, published: Mapping[int, int] | None = None) -> None:
        self.engine = engine
        self.directory = directory
        self.published: dict[int, int] = dict(published or {})  # block id -> the hash its entry holds
        self._taken: set[int] = set()  # blocks the scheduler took this step
        self._filled: set[int] = set()  # blocks whose last slot this step writes
        self._blocks = engine.block_count()
        engine.hook_prefix_events(self._taken.add, self._filled.add)

    def seed(self, trusted: Mapping[int, int]) -> int:
        """The adopted directory's trusted entries (hash -> block) as free cached blocks;
        returns how many the engine took (a block in use, or past its blocks, is not)."""
        seeded = 0
        for h, block in trusted.items():
            if self.engine.seed_block(block, h):
                self.published[block] = h
                seeded += 1
        return seeded

    def before_step(self) -> None:
        """After scheduling, before the step writes: no entry vouches for a block the
        step may rewrite."""
        engine = self.engine
        count = engine.block_count()
        if count != self._blocks:  # the follower moved blocks and resized
            self._blocks = count
            for block, h in list(self.published.items()):
                if block >= count or engine.block_hash(block) != h:
                    self._forget(block)
            hashes = {b: engine.block_hash(b) for b in range(count)}
            self._filled |= {b for b, h in hashes.items() if h != -1 and self.published.get(b) != h}
        for block in self._taken:
            if block in self.published and (block >= count or engine.block_hash(block) != self.published[block]):
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
        engine = self.engine
        count = engine.block_count()
        for block in self._taken | self._filled:
            h = engine.block_hash(block) if block < count else -1
            if h != -1 and self.published.get(block) != h:
                self.directory.publish(block, h)
                self.published[block] = h
        self._taken.clear()
        self._filled.clear()
