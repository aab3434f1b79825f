"""gpumemd/kv_math.py on its own: KV layout validation and offsets, the rounded cost of a token
prefix, the most tokens within a byte budget, and split()'s water-filling. No state, no
driver: every expected figure below is worked out by hand in the comments."""

from __future__ import annotations

import random

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode
from gpumemd import kv_math as kv
from gpumemd.records import KvPoolRecord, MemberRecord, RoundRecord, align_up

MiB = 1 << 20
G = 2 * MiB  # the granularity, as on the GPUs and the host backend


def make_pool(rows: list[int], max_tokens: int, name: str = "kv") -> KvPoolRecord:
    buffers = [p.KvBuffer(name=f"b{i}", row_bytes=r) for i, r in enumerate(rows)]
    layouts, _ = kv.layout(buffers, max_tokens, G)
    return KvPoolRecord(name=name, owner_id=1, buffers=layouts, max_tokens=max_tokens, granularity=G)


def member(pool: KvPoolRecord, min_tokens: int = 0, max_tokens: int | None = None, weight: float = 1.0) -> MemberRecord:
    return MemberRecord(
        pool=pool,
        session_id=1,
        client="engine",
        reported=True,
        report=p.CaptureDone(
            pool=pool.name, min_tokens=min_tokens, max_tokens=pool.max_tokens if max_tokens is None else max_tokens, weight=weight
        ),
    )


def refused_layout(buffers: list[p.KvBuffer], max_tokens: int = 1024) -> str:
    with pytest.raises(p.ProtocolError) as info:
        kv.layout(buffers, max_tokens, G)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    return info.value.message


# --------------------------------------------------------------------------- layout


def test_align_up() -> None:
    assert [align_up(v, G) for v in (0, 1, G - 1, G, G + 1, 3 * G)] == [0, G, G, G, 2 * G, 3 * G]
    assert align_up(100, 64) == 128


def test_layout_places_regions_back_to_back_at_granularity_aligned_offsets() -> None:
    # K and V rows of 6 KiB, 32768 tokens: 6144 * 32768 = 192 MiB exactly, per buffer.
    layouts, window = kv.layout([p.KvBuffer("k", 6144), p.KvBuffer("v", 6144)], 32768, G)
    assert [(b.name, b.row_bytes, b.offset, b.region) for b in layouts] == [
        ("k", 6144, 0, 192 * MiB),
        ("v", 6144, 192 * MiB, 192 * MiB),
    ]
    assert window == 384 * MiB


def test_layout_rounds_each_region_up_to_the_granularity() -> None:
    # 3000 * 1000 = 3,000,000 bytes -> 2 granules (4 MiB); 64 * 1000 = 64,000 -> 1 granule;
    # 5 * 1000 = 5,000 -> 1 granule. Regions never overlap: each starts where the last ended.
    layouts, window = kv.layout([p.KvBuffer("a", 3000, align=8), p.KvBuffer("b", 64, align=64), p.KvBuffer("c", 5)], 1000, G)
    assert [(b.offset, b.region) for b in layouts] == [(0, 4 * MiB), (4 * MiB, 2 * MiB), (6 * MiB, 2 * MiB)]
    assert window == 8 * MiB
    for first, second in zip(layouts, layouts[1:]):
        assert first.offset + first.region == second.offset
    assert all(b.offset % G == 0 and b.region % G == 0 for b in layouts)


@pytest.mark.parametrize("align", [0, 1, 2, 64, 4096, G])
def test_layout_accepts_power_of_two_alignments_up_to_the_granularity(align: int) -> None:
    row = max(align, 1) * 3
    layouts, window = kv.layout([p.KvBuffer("k", row, align=align)], 10, G)
    assert layouts[0].region == align_up(row * 10, G) == window


def test_layout_refuses_no_buffers() -> None:
    assert "at least one buffer" in refused_layout([])


def test_layout_refuses_duplicate_buffer_names() -> None:
    message = refused_layout([p.KvBuffer("k", 64), p.KvBuffer("v", 64), p.KvBuffer("k", 128)])
    assert "'k'" in message and "twice" in message


@pytest.mark.parametrize("row", [0, -1, -4096])
def test_layout_refuses_non_positive_rows(row: int) -> None:
    message = refused_layout([p.KvBuffer("k", 64), p.KvBuffer("v", row)])
    assert "'v'" in message and str(row) in message


@pytest.mark.parametrize("align", [3, 6, 48, 1000, 2 * G, 4 * G, -2])
def test_layout_refuses_alignments_that_are_not_powers_of_two_up_to_the_granularity(align: int) -> None:
    message = refused_layout([p.KvBuffer("k", 4 * G, align=align)])
    assert "alignment" in message and str(align) in message


@pytest.mark.parametrize(("row", "align"), [(100, 64), (4097, 4096), (6, 4), (3, 2)])
def test_layout_refuses_rows_that_break_their_alignment(row: int, align: int) -> None:
    message = refused_layout([p.KvBuffer("k", row, align=align)])
    assert f"{row} bytes" in message and f"{align}-byte" in message


# --------------------------------------------------------------------------- cost, prefix, ranges


def test_bytes_per_token_is_the_sum_of_the_rows() -> None:
    assert make_pool([6144, 6144], 32768).bytes_per_token == 12288
    assert make_pool([3000, 64, 5], 1000).bytes_per_token == 3069


def test_cost_rounds_every_buffer_prefix_up_to_the_granularity() -> None:
    pool = make_pool([6144, 6144], 32768)
    # 341 rows of 6 KiB = 2,095,104 bytes: one granule per buffer; 342 rows = 2,101,248: two.
    assert pool.cost(0) == 0
    assert pool.cost(1) == 2 * G
    assert pool.cost(341) == 2 * G
    assert pool.cost(342) == 4 * G
    assert pool.cost(32768) == 384 * MiB
    assert pool.prefix(pool.buffers[1], 342) == 2 * G


def test_cost_of_unequal_buffers_rounds_each_separately() -> None:
    pool = make_pool([3000, 64], 100000)
    # 1000 tokens: 3,000,000 bytes -> 4 MiB, and 64,000 bytes -> 2 MiB: 6 MiB, not
    # align_up(3,064,000) = 4 MiB.
    assert pool.cost(1000) == 6 * MiB
    # 32768 rows of 64 bytes are exactly one granule.
    assert pool.prefix(pool.buffers[1], 32768) == G
    assert pool.prefix(pool.buffers[1], 32769) == 2 * G


def test_tokens_within_a_reserve_counts_each_regions_rounding() -> None:
    buffers = [p.KvBuffer("k", 6144), p.KvBuffer("v", 6144)]
    # 384 MiB holds 32768 rows of both buffers exactly (192 MiB each, granule-aligned).
    assert kv.tokens_within(buffers, 384 * MiB, G) == 32768
    # 1 byte less: 32767 rows still need 192 MiB per region after rounding; the most
    # that fit is the last count whose rounded regions sum to at most 384 MiB - 1.
    fit = kv.tokens_within(buffers, 384 * MiB - 1, G)
    assert kv.layout(buffers, fit, G)[1] <= 384 * MiB - 1 < kv.layout(buffers, fit + 1, G)[1]
    assert kv.tokens_within(buffers, G - 1, G) == 0


def test_most_tokens_within_at_the_rounding_boundaries() -> None:
    pool = make_pool([6144, 6144], 32768)
    assert pool.most_tokens_within(0, 32768) == 0
    assert pool.most_tokens_within(2 * G - 1, 32768) == 0  # one token already costs a granule per buffer
    assert pool.most_tokens_within(2 * G, 32768) == 341  # 341 * 6144 <= 2 MiB < 342 * 6144
    assert pool.most_tokens_within(4 * G - 1, 32768) == 341
    assert pool.most_tokens_within(4 * G, 32768) == 682  # 682 * 6144 = 4,190,208 <= 4 MiB
    assert pool.most_tokens_within(384 * MiB, 32768) == 32768
    assert pool.most_tokens_within(1 << 50, 32768) == 32768
    assert pool.most_tokens_within(1 << 50, 100) == 100  # the cap holds
    assert pool.most_tokens_within(4 * G, 500) == 500


def test_most_tokens_within_matches_a_linear_scan() -> None:
    for rows in ([6144, 6144], [3000, 64, 5], [G + 8], [1]):
        pool = make_pool(rows, 5000)
        costs = [pool.cost(t) for t in range(5001)]
        for nbytes in sorted({0, 1, G - 1, G, G + 1, 3 * G, 7 * G + 5, 50 * G, *costs[::97]}):
            for cap in (0, 1, 777, 5000):
                expected = max(t for t in range(cap + 1) if costs[t] <= nbytes)
                assert pool.most_tokens_within(nbytes, cap) == expected, (rows, nbytes, cap)


# --------------------------------------------------------------------------- split


def test_split_of_no_members_is_empty() -> None:
    assert kv.split([], 10 * G) == {}


def test_split_gives_minimums_first_even_against_the_weights() -> None:
    a = member(make_pool([4096], 65536, "a"), min_tokens=5000, weight=100.0)  # 20,480,000 B -> 10 granules
    b = member(make_pool([4096], 65536, "b"), min_tokens=2048, weight=1.0)  # exactly 8 MiB
    # The budget covers exactly the minimums: nothing is left to share by weight.
    tokens = kv.split([a, b], 20 * MiB + 8 * MiB)
    assert tokens == {a: 5000, b: 2048}


def test_split_raises_budget_short_with_figures_when_minimums_do_not_fit() -> None:
    a = member(make_pool([4096], 65536, "a"), min_tokens=5000)  # 20 MiB
    b = member(make_pool([4096], 65536, "b"), min_tokens=2048)  # 8 MiB
    with pytest.raises(kv.BudgetShort) as info:
        kv.split([a, b], 28 * MiB - 1)
    assert (info.value.needed, info.value.budget) == (28 * MiB, 28 * MiB - 1)
    assert str(28 * MiB) in str(info.value) and str(28 * MiB - 1) in str(info.value)


def test_split_shares_the_rest_by_weight() -> None:
    # a: one 4 KiB row (512 tokens per granule), min 1000 (4,096,000 B -> 4 MiB), weight 1.
    # b: two 2 KiB rows (1024 tokens per granule each), no minimum, weight 3.
    # Budget 240 MiB: spare 236 MiB, a's share 59 MiB and b's 177 MiB.
    # a: 4 + 59 = 63 MiB -> 31 granules = 62 MiB -> 62 MiB / 4096 = 15872 tokens.
    # b: 177 MiB over two buffers -> 88.5 MiB each -> 44 granules = 88 MiB -> 45056 tokens.
    a = member(make_pool([4096], 131072, "a"), min_tokens=1000, weight=1.0)
    b = member(make_pool([2048, 2048], 131072, "b"), weight=3.0)
    tokens = kv.split([a, b], 240 * MiB)
    assert tokens == {a: 15872, b: 45056}
    assert a.pool.cost(15872) + b.pool.cost(45056) == 238 * MiB  # rounding leaves 2 MiB unused


def test_split_caps_at_max_tokens_and_gives_the_rest_back_to_the_others() -> None:
    # Budget 384 MiB. Minimums: b's 1024 rows of 8 KiB = 8 MiB; spare 376 MiB, weights 1:2:1:4.
    # Pass 1 (376 / 8 = 47 MiB a weight): a wants 8 MiB (2048 rows of 4 KiB) <= 47: capped.
    #   c wants 32 MiB (4096 rows, two 4 KiB buffers) > 47? no, 32 <= 47: capped too.
    #   b wants 512 - 8 > 94, d wants 512 > 188: not capped. Spare 376 - 8 - 32 = 336 MiB.
    # Pass 2 (336 / 6 = 56 MiB a weight): b 112 MiB, d 224 MiB, neither capped.
    #   b: 8 + 112 = 120 MiB / 8192 = 15360 tokens; d: 224 MiB / 2048 = 114688 tokens.
    a = member(make_pool([4096], 131072, "a"), max_tokens=2048, weight=1.0)
    b = member(make_pool([8192], 65536, "b"), min_tokens=1024, weight=2.0)
    c = member(make_pool([4096, 4096], 32768, "c"), max_tokens=4096, weight=1.0)
    d = member(make_pool([2048], 262144, "d"), weight=4.0)
    tokens = kv.split([a, b, c, d], 384 * MiB)
    assert tokens == {a: 2048, b: 15360, c: 4096, d: 114688}
    assert sum(m.pool.cost(tokens[m]) for m in (a, b, c, d)) == 384 * MiB


def test_split_caps_in_a_later_pass_redistribute_again() -> None:
    # Same pools, c may take 8192 tokens (64 MiB) now.
    # Pass 1: a capped (8 <= 47), c not (64 > 47). Spare 368 MiB, weights b 2, c 1, d 4.
    # Pass 2 (368 / 7 MiB a weight = 55,125,138.28 B): c's share 52.57 MiB < 64: no cap.
    #   b: floor(2 * 385,875,968 / 7) = 110,250,276 + 8 MiB = 118,638,884 B -> 56 granules
    #      = 112 MiB -> 14336 tokens.
    #   c: 55,125,138 B over two buffers -> 13 granules each = 26 MiB -> 6656 tokens.
    #   d: floor(4 * 385,875,968 / 7) = 220,500,553 B -> 105 granules = 210 MiB -> 107520.
    a = member(make_pool([4096], 131072, "a"), max_tokens=2048, weight=1.0)
    b = member(make_pool([8192], 65536, "b"), min_tokens=1024, weight=2.0)
    c = member(make_pool([4096, 4096], 32768, "c"), max_tokens=8192, weight=1.0)
    d = member(make_pool([2048], 262144, "d"), weight=4.0)
    tokens = kv.split([a, b, c, d], 384 * MiB)
    assert tokens == {a: 2048, b: 14336, c: 6656, d: 107520}
    assert sum(m.pool.cost(tokens[m]) for m in (a, b, c, d)) == 382 * MiB


def test_split_when_everyone_is_capped_leaves_the_rest_unused() -> None:
    a = member(make_pool([4096], 65536, "a"), max_tokens=1000)
    b = member(make_pool([4096, 4096], 65536, "b"), min_tokens=10, max_tokens=3000)
    tokens = kv.split([a, b], 1 << 40)
    assert tokens == {a: 1000, b: 3000}


def test_split_member_with_min_equal_max_gets_exactly_that() -> None:
    a = member(make_pool([4096], 65536, "a"), min_tokens=700, max_tokens=700, weight=1000.0)
    b = member(make_pool([4096], 65536, "b"))
    # a: 700 rows = 2,867,200 B -> 4 MiB. b takes all of the other 96 MiB: 24576 rows.
    assert kv.split([a, b], 100 * MiB) == {a: 700, b: 24576}


def test_split_with_a_zero_budget_gives_zero_minimums() -> None:
    a = member(make_pool([4096], 65536, "a"))
    b = member(make_pool([4096], 65536, "b"), weight=5.0)
    assert kv.split([a, b], 0) == {a: 0, b: 0}


def test_split_with_equal_pools_is_proportional_to_weight() -> None:
    pools = [make_pool([4096], 1 << 20, name) for name in "abc"]
    a, b, c = member(pools[0], weight=1.0), member(pools[1], weight=2.0), member(pools[2], weight=5.0)
    # 256 MiB by 1:2:5 -> 32, 64 and 160 MiB: 8192, 16384 and 40960 rows of 4 KiB.
    assert kv.split([a, b, c], 256 * MiB) == {a: 8192, b: 16384, c: 40960}


def test_split_never_exceeds_the_budget_and_stays_within_min_and_max() -> None:
    rng = random.Random(20240601)
    checked = 0
    for _ in range(3000):
        members = []
        for i in range(rng.randint(1, 5)):
            rows = [rng.choice([1, 2, 64, 3000, 4096, 6144, 131072, rng.randint(1, 300000)]) for _ in range(rng.randint(1, 3))]
            declared = rng.randint(1, 100000)
            pool = make_pool(rows, declared, f"p{i}")
            low = rng.randint(0, declared) if rng.random() < 0.4 else 0
            high = rng.randint(low, declared)
            members.append(member(pool, low, high, rng.choice([1.0, 0.1, 0.3, 0.7, 3.0, 1e-6, 1e6, rng.random() + 1e-3])))
        needed = sum(m.pool.cost(m.report.min_tokens) for m in members)
        most = sum(m.pool.cost(m.report.max_tokens) for m in members)
        budget = rng.randint(0, most + 3 * G)
        if needed > budget:
            with pytest.raises(kv.BudgetShort):
                kv.split(members, budget)
            continue
        tokens = kv.split(members, budget)
        assert set(tokens) == set(members)
        assert sum(m.pool.cost(tokens[m]) for m in members) <= budget
        for m in members:
            assert m.report.min_tokens <= tokens[m] <= m.report.max_tokens
        if budget >= most:
            assert all(tokens[m] == m.report.max_tokens for m in members)
        checked += 1
    assert checked > 1000


def test_split_single_member_takes_the_most_that_fits() -> None:
    pool = make_pool([6144, 6144], 32768)
    for budget in (0, 2 * G - 1, 2 * G, 214 * MiB, 384 * MiB, 1 << 40):
        m = member(pool)
        t = kv.split([m], budget)[m]
        assert pool.cost(t) <= budget
        assert t == pool.max_tokens or pool.cost(t + 1) > budget
    m = member(pool)
    # 214 MiB: 107 MiB a buffer -> 53 granules = 106 MiB; 106 MiB / 6144 = 18090.67 -> 18090.
    assert kv.split([m], 214 * MiB)[m] == 18090


def test_round_pending_and_member_lookup() -> None:
    a, b = member(make_pool([64], 10, "a")), member(make_pool([64], 10, "b"))
    b.reported = False
    round_ = RoundRecord(id=1, created=0.0, deadline=5.0, policy="fail", members=[a, b])
    assert round_.pending == [b]
    assert round_.member("a") is a and round_.member("b") is b and round_.member("c") is None
