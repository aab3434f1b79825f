"""plan_chunk_sizes: bulk chunks while they fit, then a descending power-of-two ladder."""

from __future__ import annotations

import pytest

from gpumemd.arenas import plan_chunk_sizes

MiB = 1 << 20
G = 2 * MiB
BULK = 512 * MiB


def test_whole_bulk_multiples_are_only_bulk_chunks() -> None:
    assert plan_chunk_sizes(3 * BULK, BULK, G) == [BULK, BULK, BULK]


def test_tail_is_a_descending_power_of_two_ladder() -> None:
    # 2 bulk + 6 MiB: the tail 6 MiB = 3 granules = 2 + 1 granules
    assert plan_chunk_sizes(2 * BULK + 6 * MiB, BULK, G) == [BULK, BULK, 4 * MiB, 2 * MiB]
    # 254 MiB = 127 granules = 64 + 32 + 16 + 8 + 4 + 2 + 1
    assert plan_chunk_sizes(254 * MiB, BULK, G) == [g * G for g in (64, 32, 16, 8, 4, 2, 1)]


def test_small_requests() -> None:
    assert plan_chunk_sizes(0, BULK, G) == []
    assert plan_chunk_sizes(G, BULK, G) == [G]
    assert plan_chunk_sizes(BULK - G, BULK, G) == [g * G for g in (128, 64, 32, 16, 8, 4, 2, 1)]


def test_bulk_equal_to_granularity() -> None:
    assert plan_chunk_sizes(5 * G, G, G) == [G] * 5


@pytest.mark.parametrize("granules", [1, 2, 3, 7, 100, 255, 256, 257, 1000, 4097])
def test_plan_sums_to_request_in_granules(granules: int) -> None:
    nbytes = granules * G
    sizes = plan_chunk_sizes(nbytes, 16 * MiB, G)
    assert sum(sizes) == nbytes
    assert all(s > 0 and s % G == 0 for s in sizes)
    bulk, tail = [s for s in sizes if s == 16 * MiB], [s for s in sizes if s != 16 * MiB]
    assert sizes == bulk + tail, "bulk chunks come first"
    assert len(bulk) == nbytes // (16 * MiB)
    # the tail: strictly descending, each a power-of-two number of granules, each used once
    assert tail == sorted(set(tail), reverse=True)
    assert all(((s // G) & (s // G - 1)) == 0 for s in tail)
    assert len(tail) == bin(nbytes % (16 * MiB) // G).count("1")
