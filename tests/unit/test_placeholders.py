"""ARENA_PLACEHOLDER in DaemonState: the chunks an owner aliases over uncommitted space,
their sizes, their accounting, the per-arena limit, and who may ask."""

from __future__ import annotations

from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode
from gpumemd.arenas import MAX_PLACEHOLDER_SLOT
from gpumemd.records import PLACEHOLDER_SCRATCH

from .harness import G, GiB, Harness, MiB


def placeholder(h: Harness, s, name: str, slot: int) -> p.PlaceholderReply:  # type: ignore[no-untyped-def]
    reply = h.ok(s, p.PlaceholderArena(name=name, slot_bytes=slot)).reply
    assert isinstance(reply, p.PlaceholderReply)
    return reply


def test_a_slot_chunk_and_a_granule_chunk_accounted_and_idempotent(h: Harness) -> None:
    a = h.connect("engine-a")
    h.create(a, "kv", GiB)
    first = placeholder(h, a, "kv", 64 * MiB)
    assert sorted(c.size for c in first.chunks) == [G, 64 * MiB] and first.fd_batches == 1
    assert h.state.arenas.accounted_bytes() == 64 * MiB + G
    again = placeholder(h, a, "kv", 64 * MiB)  # the same chunks, no new fds
    assert [c.id for c in again.chunks] == [c.id for c in first.chunks] and again.fd_batches == 0
    assert h.state.arenas.accounted_bytes() == 64 * MiB + G
    h.release(a, "kv")
    assert h.state.arenas.accounted_bytes() == 0


def test_placeholders_per_arena_are_bounded_by_the_scratch_it_reserves(make_harness) -> None:  # type: ignore[no-untyped-def]
    h = make_harness(capacity=2 * GiB)
    a = h.connect("engine-a")
    h.create(a, "kv", GiB)
    placeholder(h, a, "kv", MAX_PLACEHOLDER_SLOT)  # 256 MiB + 2 MiB
    placeholder(h, a, "kv", 128 * MiB)  # + 128 MiB: 386 MiB of 512
    before = h.state.arenas.accounted_bytes()
    error = h.refused(a, p.PlaceholderArena(name="kv", slot_bytes=254 * MiB), ErrorCode.INVALID_ARGUMENT)
    assert str(PLACEHOLDER_SCRATCH) in error.message
    assert h.state.arenas.accounted_bytes() == before, "a refused placeholder created memory"
    h.refused(a, p.PlaceholderArena(name="kv", slot_bytes=MAX_PLACEHOLDER_SLOT + G), ErrorCode.INVALID_ARGUMENT)
    h.refused(a, p.PlaceholderArena(name="kv", slot_bytes=G + 1), ErrorCode.INVALID_ARGUMENT)


def test_only_the_owner_asks_and_a_dead_owner_takes_them_along(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv", GiB)
    h.commit(a, "kv", 4 * MiB)
    h.share(a, "kv", "engine-b")
    h.attach(b, "kv")
    h.refused(b, p.PlaceholderArena(name="kv", slot_bytes=64 * MiB), ErrorCode.PERMISSION_DENIED)
    placeholder(h, a, "kv", 64 * MiB)
    h.state.close_session(a.id)
    # b still maps the committed chunks; the placeholders were the owner's alone.
    assert h.state.arenas.by_name["kv"].placeholders == []
    assert h.state.arenas.accounted_bytes() == 4 * MiB
    h.state.close_session(b.id)
    assert h.state.arenas.accounted_bytes() == 0
