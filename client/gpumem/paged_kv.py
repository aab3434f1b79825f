"""Paged KV caches as blocks: per-layer K and V (or one combined) cache, laid out in a KV
pool whose rows are blocks, committed by a round after capture.

    cache = session.declare_paged_kv("engine-a-kv", layers=28, block_shape=(256, 8, 128), itemsize=2)
    for layer, (k, v) in enumerate(cache.tensors(torch.bfloat16)):   # (max_blocks, 256, 8, 128) each
        attention[layer].k_cache, attention[layer].v_cache = k, v
    ... capture the decode graphs (the placeholder is under every block) ...
    blocks = cache.capture_done(headroom_bytes=1 << 30)              # blocks [0, blocks) are real now

A block is one row of every buffer: ``k<i>`` and ``v<i>`` for each layer, or ``kv<i>``
(K then V in one row) with ``combined=True``. The tensors cover ``max_blocks`` blocks
from the start; only the first ``blocks`` are real memory after the round, the rest stay
placeholder (captured copies land in scratch), so the engine must hand out block ids
below ``blocks`` only. ``max_blocks`` defaults to what the whole device could hold.
``views()`` gives the same regions as raw views (DLPack, NumPy on the host backend).
Runtime moves go through ``cache.pool`` in blocks (a block is a row):
``pool.report_demand(blocks_in_use)``, ``pool.grow_ahead(...)`` and
``pool.answer_shrinks(move_live)``, whose ``move_live(bound)`` copies live blocks at or
past ``bound`` into free blocks below it and updates the block tables.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gpumem_shared import protocol as p
from gpumem.errors import InvalidArgument
from gpumem.kv_pool import CaptureFigures, KvPool, RoundWait, waited
from gpumem.views import RawView

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from gpumem.core import SessionCore


class PagedKvCache:
    def __init__(self, pool: KvPool, layers: int, block_shape: tuple[int, ...], itemsize: int, combined: bool) -> None:
        self.pool = pool
        self.layers = layers
        self.block_shape = block_shape
        self.itemsize = itemsize
        self.combined = combined

    @classmethod
    def declare(
        cls,
        core: SessionCore,
        name: str,
        *,
        layers: int,
        block_shape: tuple[int, ...],
        itemsize: int,
        combined: bool = False,
        max_blocks: int = 0,
        expect: int = 0,
    ) -> PagedKvCache:
        """Declare the cache's KV pool (virtual only), alias the placeholder over all of
        it and join the device's round; ``expect``: how many pools the round gathers
        (``KvPool.join_round``)."""
        if layers <= 0 or itemsize <= 0 or not block_shape or min(block_shape) <= 0:
            raise InvalidArgument(
                f"paged KV cache '{name}': layers ({layers}), itemsize ({itemsize}) and every block dimension "
                f"({block_shape}) must be positive"
            )
        block_bytes = math.prod(block_shape) * itemsize
        if combined:
            buffers = [p.KvBuffer(f"kv{i}", 2 * block_bytes) for i in range(layers)]
        else:
            buffers = [p.KvBuffer(f"{kind}{i}", block_bytes) for i in range(layers) for kind in "kv"]
        if not max_blocks:
            max_blocks = max(1, core.device.total_bytes // (2 * layers * block_bytes))
        pool = KvPool.declare(core, name, buffers, max_tokens=max_blocks)
        cache = cls(pool, layers, block_shape, itemsize, combined)
        try:
            pool.placeholder()
            pool.join_round(expect)
        except BaseException:
            pool.release()
            raise
        return cache

    # ------------------------------------------------------------------ layout

    @property
    def max_blocks(self) -> int:
        return self.pool.max_tokens

    @property
    def blocks(self) -> int:
        """Blocks backed by real memory in every buffer (0 before the round)."""
        return self.pool.tokens

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        return self.pool.bytes_per_token

    def _names(self, layer: int) -> list[str]:
        if not 0 <= layer < self.layers:
            raise InvalidArgument(f"paged KV cache '{self.pool.name}' has layers 0..{self.layers - 1}, not {layer}")
        return [f"kv{layer}"] if self.combined else [f"k{layer}", f"v{layer}"]

    def views(self, layer: int) -> list[RawView]:
        """Layer ``layer``'s buffers as raw views of ``max_blocks`` blocks each: [K, V], or
        [KV] combined (each block K then V)."""
        return [self.pool.view(name) for name in self._names(layer)]

    def layer_tensors(self, layer: int, dtype: Any) -> list[Any]:
        """Layer ``layer``'s caches as torch tensors: [K, V], each (max_blocks, *block_shape),
        or [KV] of (max_blocks, 2, *block_shape) combined. Outside any torch pool."""
        row = (2, *self.block_shape) if self.combined else self.block_shape
        return [self.pool.tensor(name, dtype, row) for name in self._names(layer)]

    def tensors(self, dtype: Any) -> list[list[Any]]:
        """``layer_tensors`` for every layer, in order."""
        return [self.layer_tensors(layer, dtype) for layer in range(self.layers)]

    # ------------------------------------------------------------------ commit round

    def send_capture_done(
        self, *, min_blocks: int = 0, max_blocks: int = 0, timeout: float | None = None, **figures: Unpack[CaptureFigures]
    ) -> RoundWait:
        """The round's report (``KvPool.send_capture_done``) in blocks, without waiting:
        the ``RoundWait``'s ``wait()`` returns the blocks committed. ``capture_done`` is
        the same report, waited for."""
        return self.pool.send_capture_done(min_tokens=min_blocks, max_tokens=max_blocks, timeout=timeout, **figures)

    capture_done = waited(send_capture_done)

    def release(self) -> None:
        self.pool.release()

    def __repr__(self) -> str:
        kind = "combined" if self.combined else "K and V"
        return f"<gpumem.PagedKvCache '{self.pool.name}' {self.layers} layers ({kind}), {self.blocks}/{self.max_blocks} blocks>"
