"""nano-vllm's prefix cache kept in a prefix directory (gpumem.port.prefix over
gpumem.integrations.nanovllm.adapter's prefix events), without nano-vllm: the block manager is nano-vllm's algorithm in miniature (allocate with
its chained hashes and hit check, may_append, deallocate as the fork does it), the
directory a dict that records every write in order."""

from __future__ import annotations

from typing import Any

from gpumem.port.prefix import DirectoryKeeper
from nanovllm_fakes import Engine
from nanovllm_miniature import Manager, Seq

class Directory:
    def __init__(self) -> None:
        self.entries: dict[int, int] = {}
        self.writes: list[tuple[str, int]] = []

    def publish(self, block: int, content_hash: int) -> None:
        self.entries[block] = content_hash
        self.writes.append(("publish", block))

    def invalidate(self, block: int) -> None:
        self.entries.pop(block, None)
        self.writes.append(("invalidate", block))


def step(keeper: DirectoryKeeper, schedule: Any) -> None:
    """One engine step: the scheduler's work, the check before the step writes, the step
    (nothing to do here), the publication after it."""
    schedule()
    keeper.before_step()
    keeper.after_step()


def test_full_blocks_are_published_after_their_step_and_invalidated_before_a_rewrite() -> None:
    m, d = Manager(8), Directory()
    keeper = DirectoryKeeper(Engine(m), d)
    a = Seq(list(range(9)))  # two full blocks and one token
    m.allocate(a)
    assert d.entries == {}  # hashed by the scheduler, not written yet: nothing published
    keeper.before_step()
    assert d.entries == {}
    keeper.after_step()
    assert d.entries == {0: m.blocks[0].hash, 1: m.blocks[1].hash}
    for token in (9, 10, 11):  # decode fills block 2 on its last slot
        a.tokens.append(token)
        step(keeper, lambda: m.may_append(a))
    assert d.entries[2] == m.blocks[2].hash != -1
    m.deallocate(a)
    assert set(d.entries) == {0, 1, 2}  # freed, rows intact: the entries stay for an adopter
    d.writes.clear()
    b = Seq([50 + i for i in range(5)])  # other tokens: takes block 3 then the freed ones, block 0 first in line
    m.free_block_ids.rotate(-(list(m.free_block_ids).index(0)))
    m.allocate(b)
    keeper.before_step()
    assert d.writes[0] == ("invalidate", 0) and 0 not in d.entries  # before the step writes block 0's rows anew
    keeper.after_step()
    assert d.entries[0] == m.blocks[0].hash  # and it vouches for the new content after


def test_a_prefix_hit_keeps_the_entry_of_the_block_it_takes_back() -> None:
    m, d = Manager(8), Directory()
    keeper = DirectoryKeeper(Engine(m), d)
    a = Seq(list(range(9)))
    step(keeper, lambda: m.allocate(a))
    b = Seq(list(range(8)) + [99])  # the same two full blocks, still in use by a: shared
    d.writes.clear()
    step(keeper, lambda: m.allocate(b))
    assert b.num_cached_tokens == 8 and not [w for w in d.writes if w[0] == "invalidate"]


def test_an_adopter_seeded_from_the_directory_hits_the_prompts_served_before() -> None:
    m, d = Manager(16), Directory()
    keeper = DirectoryKeeper(Engine(m), d)
    served = [Seq(list(range(12)) + [100 + i]) for i in range(2)]  # a 3-block shared prefix
    for s in served:
        step(keeper, lambda s=s: m.allocate(s))
    tables = [list(s.block_table) for s in served]
    for s in served:
        m.deallocate(s)
    trusted = {h: block for block, h in d.entries.items()}

    adopter, d2 = Manager(16), Directory()
    keeper2 = DirectoryKeeper(Engine(adopter), d2)
    assert keeper2.seed(trusted) == 3
    again = Seq(served[1].tokens)
    step(keeper2, lambda: adopter.allocate(again))
    assert again.num_cached_tokens == 12 and again.block_table[:3] == tables[1][:3]
    assert not [w for w in d2.writes if w[0] == "invalidate"]  # the seeded entries hold: nothing rewritten
    other = Seq([7] * 13)
    step(keeper2, lambda: adopter.allocate(other))
    assert other.num_cached_tokens == 0 and not set(other.block_table) & set(again.block_table)


def test_a_seed_skips_blocks_in_use_or_past_the_block_manager() -> None:
    m = Manager(4)
    keeper = DirectoryKeeper(Engine(m), Directory())
    m._allocate_block(1)
    assert keeper.seed({11: 1, 12: 9, 13: 2}) == 1
    assert m.hash_to_block_id == {13: 2}


def test_blocks_moved_by_the_follower_are_invalidated_at_their_old_ids_and_published_at_their_new() -> None:
    m, d = Manager(8), Directory()
    keeper = DirectoryKeeper(Engine(m), d)
    m.free_block_ids.rotate(-6)  # the sequence lands on blocks 6 and 7
    a = Seq(list(range(5)))
    step(keeper, lambda: m.allocate(a))
    assert set(d.entries) == {6}
    # What the adapter's relocate_blocks and resize_blocks do: block 6 moved to 0, the manager cut to 4 blocks.
    h = m.blocks[6].hash
    m.blocks[0].hash, m.blocks[0].token_ids, m.blocks[0].ref_count = h, m.blocks[6].token_ids, 1
    m.hash_to_block_id[h] = 0
    a.block_table = [0, 1]
    del m.blocks[4:]
    step(keeper, lambda: None)
    assert d.entries == {0: h}
