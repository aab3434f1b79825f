"""nano-vllm's prefix-caching block manager in miniature, for tests without nano-vllm:
its algorithm (allocate with chained content hashes and the hit check, may_append,
deallocate) over blocks and sequences of token ids, hashlib for xxhash. ``Manager`` is
nano-vllm-fork's (a freed block leaves ``hash_to_block_id`` and keeps its hash);
``UpstreamManager`` upstream nano-vllm's (the entry stays until the block is reused).
tests/nanovllm_fakes.py has the plainer stand-ins the block follower needs."""

from __future__ import annotations

import collections
import hashlib

BS = 4  # tokens a block


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.ref_count, self.hash = block_id, 0, -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash, self.token_ids = h, token_ids

    def reset(self) -> None:
        self.ref_count, self.hash, self.token_ids = 1, -1, []


class Seq:
    def __init__(self, tokens: list[int], max_tokens: int = 0) -> None:
        self.tokens, self.prompt_len, self.max_tokens = list(tokens), len(tokens), max_tokens
        self.block_table: list[int] = []
        self.num_cached_tokens = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        return -(-len(self.tokens) // BS)

    def block(self, i: int) -> list[int]:
        return self.tokens[i * BS : (i + 1) * BS]


class Manager:
    keeps_freed = False

    def __init__(self, n: int, block_size: int = BS) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(n)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids = collections.deque(range(n))
        self.used_block_ids: set[int] = set()

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1) -> int:
        data = (prefix.to_bytes(8, "little") if prefix != -1 else b"") + bytes(str(token_ids), "ascii")
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def allocate(self, seq: Seq) -> None:
        h, miss = -1, False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h) if len(token_ids) == self.block_size else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                miss = True
            if miss:
                block = self._allocate_block(self.free_block_ids[0])
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, token_ids)
                self.hash_to_block_id[h] = block.block_id
            seq.block_table.append(block.block_id)

    def deallocate(self, seq: Seq) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if not self.keeps_freed and self.hash_to_block_id.get(block.hash) == block_id:
                    del self.hash_to_block_id[block.hash]
                self.used_block_ids.remove(block_id)
                self.free_block_ids.append(block_id)
        seq.block_table.clear()

    def may_append(self, seq: Seq) -> None:
        table = seq.block_table
        if len(seq) % self.block_size == 1:
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            table.append(block_id)
        elif len(seq) % self.block_size == 0:
            prefix = self.blocks[table[-2]].hash if len(table) > 1 else -1
            self.blocks[table[-1]].update(self.compute_hash(seq.block(seq.num_blocks - 1), prefix), seq.block(seq.num_blocks - 1))
            self.hash_to_block_id[self.blocks[table[-1]].hash] = table[-1]


class UpstreamManager(Manager):
    keeps_freed = True
