"""Per-tenant limits (tenants.py): one uid cannot take all of what every uid shares.

Each test fills one resource from one uid and checks that the refusal is typed and
named, that another uid still gets its share, and that giving back makes room again.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.driver.host import HostDriver
from gpumemd.config import StateConfig, TenantLimits
from gpumemd.durable import Durable
from gpumemd.records import SessionRecord as Session
from gpumemd.state import DaemonState

from .harness import BULK, CAPACITY, Clock, G, GiB, Harness, MiB
from .store_kit import FakeStore, restarted

A, B = 1000, 2000  # two tenants' uids


def fill(h: Harness, s: Session, prefix: str, reserve: int = G) -> tuple[list[str], p.ProtocolError]:
    """Arenas for ``s`` until one is refused: their names, and the refusal."""
    names: list[str] = []
    for i in range(10_000):
        try:
            h.create(s, f"{prefix}{i}", reserve)
        except p.ProtocolError as exc:
            return names, exc
        names.append(f"{prefix}{i}")
    raise AssertionError("10,000 arenas and no refusal")


def test_one_uid_takes_at_most_its_share_of_the_address_plan(make_harness: Callable[..., Harness]) -> None:
    # Arenas of 2 MiB, no memory committed: each still costs a window, a scratch and a guard step of the plan.
    h = make_harness(va_limit=StateConfig.va_base + 32 * GiB)
    greedy, other = h.connect("greedy", uid=A), h.connect("other", uid=B)
    taken, refusal = fill(h, greedy, "g")
    assert refusal.code is p.ErrorCode.RESOURCE_EXHAUSTED, refusal.message
    assert (refusal.detail["limit"], refusal.detail["uid"]) == ("address space", A)
    assert "uid 1000" in refusal.message and "--tenant-address-share" in refusal.message
    assert refusal.detail["used"] <= refusal.detail["cap"] == 16 * GiB
    assert 4 <= len(taken) <= 8
    # The other tenant gets arenas too: the plan was not filled by the first.
    theirs, _ = fill(h, other, "o")
    assert len(theirs) >= 4, f"uid {B} got {len(theirs)} arenas after uid {A} took {len(taken)}"
    # Giving one back makes room for one more.
    h.release(greedy, taken[0])
    h.create(greedy, "again", G)


def test_arena_count_per_uid(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(tenants=TenantLimits(arenas=3))
    a, b = h.connect("a", uid=A), h.connect("b", uid=B)
    taken, refusal = fill(h, a, "a", 2 * MiB)
    assert len(taken) == 3
    assert refusal.code is p.ErrorCode.RESOURCE_EXHAUSTED and refusal.detail["limit"] == "arenas"
    assert "owns 3 arenas of 3" in refusal.message
    # A second session of the same uid counts against the same tenant.
    assert fill(h, h.connect("a2", uid=A), "x")[0] == []
    assert len(fill(h, b, "b", 2 * MiB)[0]) == 3
    h.release(a, taken[0])
    assert taken[0] not in h.state.tenants.owners, "a destroyed arena's name stays counted (and kept) forever"
    h.create(a, "again", 2 * MiB)


def test_an_arena_counts_against_its_owners_uid_after_the_owner_left(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(tenants=TenantLimits(arenas=1))
    owner, sharer = h.connect("owner", uid=A), h.connect("sharer", uid=A)
    h.create(owner, "kept", GiB)
    h.ok(owner, p.ShareArena(name="kept", client="sharer"))
    h.ok(sharer, p.AttachArena(name="kept"))
    h.state.close_session(owner.id)  # the arena stays while the sharer maps it
    assert "kept" in h.state.arenas.by_name
    h.refused(h.connect("later", uid=A), p.CreateArena(name="more", reserve_bytes=GiB), p.ErrorCode.RESOURCE_EXHAUSTED)


def test_sessions_per_uid(h: Harness) -> None:
    h.state.tenants.limits = TenantLimits(sessions=3)
    mine = [h.connect(f"a{i}", uid=A) for i in range(3)]
    with pytest.raises(p.ProtocolError) as info:
        h.connect("a3", uid=A)
    assert info.value.code is p.ErrorCode.RESOURCE_EXHAUSTED
    assert (info.value.detail["limit"], info.value.detail["used"], info.value.detail["cap"]) == ("sessions", 3, 3)
    assert "a3" not in {s.name for s in h.state.sessions.values()}
    h.connect("b", uid=B)  # another tenant still gets in
    h.state.close_session(mine[0].id)
    h.connect("a3", uid=A)


def test_graph_pool_share_per_uid(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpumemd.graph_pools.MAX_POOLS", 4)  # a share of 2 each, to keep the test small
    a, b = h.connect("a", uid=A), h.connect("b", uid=B)
    for s, arena in ((a, "ga"), (b, "gb")):
        h.create(s, arena, GiB)
        h.commit(s, arena, 2 * BULK)

    def register(s: Session, arena: str, i: int) -> p.RegisterGraphPool:
        return p.RegisterGraphPool(arena=arena, label=f"p{i}", extents=[p.Extent(offset=i * 4 * MiB, size=4 * MiB)], free_runs=[])

    first = [h.ok(a, register(a, "ga", i)).reply.pool.id for i in range(2)]
    refusal = h.refused(a, register(a, "ga", 2), p.ErrorCode.RESOURCE_EXHAUSTED)
    assert refusal.detail["limit"] == "graph pools" and "keep 2 graph pools of its share of 2" in refusal.message
    for i in range(2):  # the other tenant's share is still there
        h.ok(b, register(b, "gb", i))
    h.ok(a, p.RetireGraphPool(pool_id=first[0]))
    h.ok(a, register(a, "ga", 2))


def test_a_name_another_uid_squats_is_still_the_victims_own(h: Harness) -> None:
    """Names are per uid: a squatter's 'kv' neither blocks the victim's nor stands in for it."""
    squatter, engine = h.connect("squatter", uid=B), h.connect("engine", uid=A)
    h.create(squatter, "kv", GiB)
    h.share(squatter, "kv", uid=A)  # the bait: its memory for whoever of uid A asks for 'kv'
    sibling = h.connect("sibling", uid=A)
    refusal = h.refused(sibling, p.AttachArena(name="kv"), p.ErrorCode.NOT_FOUND)  # before the engine's exists
    assert refusal.detail == {"arena": "kv", "owner_uid": B} and f"'{B}/kv'" in refusal.message, refusal.message
    view = h.create(engine, "kv", GiB)
    assert view.name == f"{A}/kv" and view.address != h.state.arenas.by_name["kv"].address
    h.share(engine, "kv", "sibling")
    attached = h.attach(sibling, "kv").reply.arena
    assert (attached.name, attached.owner) == (f"{A}/kv", "engine")
    h.commit(engine, "kv", 4 * MiB)  # its bare name, as before
    assert h.sync(sibling, f"{A}/kv").reply.arena.committed == 4 * MiB  # or the key the daemon answered with
    assert h.state.arenas.by_name["kv"].committed == 0 and h.state.arenas.by_name["kv"].attached == {squatter.id}
    # Another uid's arena is reached by naming its owner; its grants still decide.
    h.refused(squatter, p.AttachArena(name=f"{A}/kv"), p.ErrorCode.PERMISSION_DENIED)
    h.refused(squatter, p.CreateArena(name=f"{A}/other", reserve_bytes=GiB), p.ErrorCode.PERMISSION_DENIED)
    h.refused(engine, p.CreateArena(name="kv", reserve_bytes=GiB), p.ErrorCode.ALREADY_EXISTS)
    arenas = {(a.name, a.owner_uid) for a in h.state.status().arenas}
    assert arenas == {("kv", B), (f"{A}/kv", A)}
    # KV pools are arenas: the same holds for them.
    buffers = [p.KvBuffer(name="k", row_bytes=4096)]
    h.ok(squatter, p.KvDeclare(name="cache", buffers=buffers, max_tokens=4096))
    pool = h.ok(engine, p.KvDeclare(name="cache", buffers=buffers, max_tokens=4096)).reply.pool
    assert pool.name == f"{A}/cache"
    assert h.ok(engine, p.RoundJoin(pool="cache")).reply.members == [f"engine/{A}/cache"]


def test_a_free_name_stays_bare_and_is_reached_by_its_owners_uid_too(h: Harness) -> None:
    engine, other = h.connect("engine", uid=A), h.connect("other", uid=B)
    assert h.create(engine, "kv", GiB).name == "kv"
    h.share(engine, "kv", uid=B)
    assert h.attach(other, f"{A}/kv").reply.arena.name == "kv"
    assert h.create(other, "kv", GiB).name == f"{B}/kv"  # its own, beside the one it attached
    assert h.sync(other, "kv").reply.arena.owner == "engine", "the key the daemon answered with is the attached one"
    assert h.sync(other, f"{B}/kv").reply.arena.owner == "other"
    h.refused(other, p.CreateArena(name="bad/", reserve_bytes=GiB), p.ErrorCode.INVALID_ARGUMENT)
    h.refused(other, p.CreateArena(name=f"{B}/{A}/x", reserve_bytes=GiB), p.ErrorCode.INVALID_ARGUMENT)


def test_arenas_count_against_their_tenant_after_a_restart(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(tenants=TenantLimits(arenas=2))
    a = h.connect("a", uid=A)
    h.create(a, "x", GiB)
    h.create(a, "y", GiB)
    store = FakeStore()
    first = Durable(store)  # type: ignore[arg-type]
    first.start(h.state, {})
    first.persist(h.state)
    h.state.arenas.close()  # the slice goes, as with the daemon's death
    again = DaemonState(HostDriver(index=0, capacity=CAPACITY), h.config, Clock(h.clock.now), Clock(h.wall_clock.now))
    second = Durable(store)  # type: ignore[arg-type]
    second.start(again, store.passed())
    try:
        assert again.tenants.owners == {"x": A, "y": A}
        with pytest.raises(p.ProtocolError) as info:
            again.handle(again.sessions[a.id], p.CreateArena(name="z", reserve_bytes=GiB))
        assert info.value.code is p.ErrorCode.RESOURCE_EXHAUSTED
    finally:
        again.drop_all()
        first.close()
        second.close()
        store.drop()


def test_each_uids_name_is_its_own_after_a_restart(make_harness: Callable[..., Harness]) -> None:
    h = make_harness()
    squatter, engine = h.connect("squatter", uid=B), h.connect("engine", uid=A)
    h.create(squatter, "kv", GiB)
    h.create(engine, "kv", GiB)
    with restarted(h) as again:
        for session, owner in ((again.sessions[engine.id], "engine"), (again.sessions[squatter.id], "squatter")):
            reply = again.handle(session, p.SyncArena(name="kv")).reply
            assert isinstance(reply, p.MapReply) and reply.arena.owner == owner
        late = again.open_session(p.Hello(name="sibling"), pid=99, uid=A, gid=A)[0]
        with pytest.raises(p.ProtocolError) as info:  # its engine's, not the squatter's: no grant admits it
            again.handle(late, p.AttachArena(name="kv"))
        assert info.value.code is p.ErrorCode.PERMISSION_DENIED and "client 'engine'" in info.value.message
