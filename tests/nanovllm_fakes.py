"""nano-vllm's block manager, blocks and sequences as far as its adapter
(gpumem.integrations.nanovllm.adapter) reads and writes them for the engine port's block
follower (their fields, nano-vllm's names), and a model's tensors as far as
gpumem.port.weights describes them, for tests without nano-vllm or torch. ``engine``
gives the adapter over them, its copies recorded instead of made."""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumem.integrations.nanovllm.adapter import NanoVllm

BLOCK = 4  # tokens a block


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


class Manager:
    """nano-vllm's BlockManager, as far as the follower reads and writes it."""

    def __init__(self, blocks: int) -> None:
        self.block_size = BLOCK
        self.blocks = [Block(i) for i in range(blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: collections.deque[int] = collections.deque(range(blocks))
        self.used_block_ids: set[int] = set()

    def take(self, block_id: int) -> int:
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        self.blocks[block_id].ref_count = 1
        return block_id


class Seq:
    def __init__(self, tokens: int, table: list[int] | None = None) -> None:
        self.tokens = tokens
        self.block_table = table or []

    def __len__(self) -> int:
        return self.tokens

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // BLOCK)


@dataclass
class FakeTensor:
    """What ``gpumem.port.weights.describe`` reads of a torch tensor."""

    ptr: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, ...]:
        return self.strides


@dataclass
class FakeModel:
    """A module's named parameters and buffers, every name of a shared tensor included."""

    params: dict[str, FakeTensor]
    buffers: dict[str, FakeTensor] = field(default_factory=dict)

    def named_parameters(self, remove_duplicate: bool = True) -> list[tuple[str, FakeTensor]]:
        assert not remove_duplicate  # a tied weight's every name must be in the map
        return list(self.params.items())

    def named_buffers(self, remove_duplicate: bool = True) -> list[tuple[str, FakeTensor]]:
        assert not remove_duplicate
        return list(self.buffers.items())


class Engine(NanoVllm):
    """nano-vllm's adapter over a stand-in scheduler (``manager``, ``running``,
    ``waiting``); ``copy_blocks`` records (from, to) or calls ``copy``."""

    def __init__(self, manager: Any, running: list[Any] | None = None, waiting: list[Any] | None = None,
                 copy: Callable[[list[int], list[int]], None] | None = None) -> None:
        super().__init__(None, Block, lambda n: n)
        self.scheduler = types.SimpleNamespace(block_manager=manager, running=[] if running is None else running,
                                               waiting=[] if waiting is None else waiting)
        self.copied: list[tuple[list[int], list[int]]] = []
        self.copy = copy

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if self.copy is not None:
            self.copy(src, dst)
        else:
            self.copied.append((src, dst))
