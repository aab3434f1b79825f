"""DaemonState with several clients: sharing, attaching, syncing, releasing, clients
going away, and which session hears about what."""

from __future__ import annotations

import msgspec
import pytest

from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode
from gpumemd.records import SessionRecord as Session

from .harness import BULK, G, GiB, Harness, MiB, open_fds, planned


def ids(views_or_chunks: list) -> list[int]:
    return [c.id for c in views_or_chunks]


def recipients(notices: list[tuple[int, p.Notice]], kind: str) -> list[int]:
    return sorted(sid for sid, n in notices if n.kind == kind)


def shared_arena(h: Harness, commit: int = 6 * MiB) -> tuple[Session, Session, list[int]]:
    """engine-a owns 'kv' (``commit`` bytes committed) and engine-b has attached it."""
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv", GiB)
    chunk_ids = ids(h.commit(a, "kv", commit).handout) if commit else []
    h.share(a, "kv", "engine-b")
    h.attach(b, "kv")
    return a, b, chunk_ids


# --------------------------------------------------------------------------- share and attach


def test_attach_maps_what_is_committed_without_new_memory(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    view = h.create(a, "kv", GiB)
    committed = ids(h.commit(a, "kv", 6 * MiB).handout)
    h.share(a, "kv", "engine-b")
    fds = open_fds()
    out = h.attach(b, "kv")
    assert out.reply.arena == msgspec.structs.replace(view, committed=6 * MiB)
    assert ids(out.reply.chunks) == ids(out.handout) == committed
    assert out.reply.fd_batches == 1 and out.reply.retired == []
    arena = h.state.arenas.by_name["kv"]
    assert arena.attached == {a.id, b.id}
    assert all(c.holders == {a.id, b.id} for c in arena.chunks)
    assert h.state.arenas.accounted_bytes() == 6 * MiB and open_fds() == fds


def test_attach_to_an_empty_arena_hands_out_nothing(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv")
    h.share(a, "kv", "engine-b")
    out = h.attach(b, "kv")
    assert (out.handout, out.reply.chunks, out.reply.retired, out.reply.fd_batches) == ([], [], [], 0)
    assert out.reply.arena.committed == 0
    assert h.state.arenas.by_name["kv"].attached == {a.id, b.id}
    # what the owner commits later reaches b through sync
    committed = ids(h.commit(a, "kv", 4 * MiB).handout)
    assert ids(h.sync(b, "kv").handout) == committed


def test_attach_without_share_is_permission_denied_naming_the_owner(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv")
    h.share(a, "kv", "engine-c")
    error = h.refused(b, p.AttachArena(name="kv"), ErrorCode.PERMISSION_DENIED)
    assert f"client 'engine-a' (pid {a.pid})" in error.message
    assert "client 'engine-b'" in error.message
    assert h.state.arenas.by_name["kv"].attached == {a.id}


def test_attach_refusals(h: Harness) -> None:
    a, b, _ = shared_arena(h)
    h.refused(b, p.AttachArena(name="nope"), ErrorCode.NOT_FOUND)
    h.refused(b, p.AttachArena(name="kv"), ErrorCode.ALREADY_EXISTS)  # attached already
    h.refused(a, p.AttachArena(name="kv"), ErrorCode.ALREADY_EXISTS)  # the owner is attached from the start
    assert h.state.arenas.by_name["kv"].attached == {a.id, b.id}


def test_sharing_twice_makes_two_grants_each_with_its_own_token(h: Harness) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv")
    first, second = h.share(a, "kv", "engine-b"), h.share(a, "kv", "engine-b")
    assert first != second
    arena = h.state.arenas.by_name["kv"]
    assert [(g.client, g.uid, g.gid, g.uid_implied) for g in arena.grants] == [("engine-b", 1000, -1, True)] * 2
    h.attach(b, "kv")
    assert arena.attached == {a.id, b.id}


def test_share_with_an_invalid_client_name_is_refused(h: Harness) -> None:
    a = h.connect("engine-a")
    h.create(a, "kv")
    h.refused(a, p.ShareArena(name="kv", client="engine b"), ErrorCode.INVALID_ARGUMENT)
    assert h.state.arenas.by_name["kv"].grants == []


@pytest.mark.parametrize(
    "message",
    [
        p.ShareArena(name="kv", client="engine-c"),
        p.CommitArena(name="kv", nbytes=16 * MiB),
        p.DecommitArena(name="kv", to_nbytes=0),
    ],
    ids=["share", "commit", "decommit"],
)
@pytest.mark.parametrize("attached", [True, False], ids=["sharer", "stranger"])
def test_only_the_owner_may_change_an_arena(h: Harness, message: object, attached: bool) -> None:
    a, b = h.connect("engine-a"), h.connect("engine-b")
    h.create(a, "kv")
    h.commit(a, "kv", 6 * MiB)
    if attached:
        h.share(a, "kv", "engine-b")
        h.attach(b, "kv")
    error = h.refused(b, message, ErrorCode.PERMISSION_DENIED)
    assert f"belongs to client 'engine-a' (pid {a.pid})" in error.message
    arena = h.state.arenas.by_name["kv"]
    assert arena.committed == 6 * MiB and h.state.arenas.retiring == {}
    assert [g.client for g in arena.grants] == (["engine-b"] if attached else [])


def test_arena_requests_on_a_missing_arena_are_not_found(h: Harness) -> None:
    a = h.connect("engine-a")
    for message in (
        p.ShareArena(name="kv", client="engine-b"),
        p.CommitArena(name="kv", nbytes=G),
        p.DecommitArena(name="kv", to_nbytes=0),
        p.SyncArena(name="kv"),
        p.ReleaseArena(name="kv"),
        p.ChunksUnmapped(name="kv", chunk_ids=[1]),
    ):
        error = h.refused(a, message, ErrorCode.NOT_FOUND)
        assert "no arena named 'kv'" in error.message


# --------------------------------------------------------------------------- grants

OWNER_UID, OTHER_UID = 1000, 2000
OWNERS_KV = f"{OWNER_UID}/kv"  # how a session of another uid names it (names are per uid)


def kv_for(s: Session) -> str:
    return "kv" if s.uid == OWNER_UID else OWNERS_KV


def owned_arena(h: Harness, commit: int = 6 * MiB) -> Session:
    """engine-a (uid 1000) owns 'kv' with ``commit`` bytes committed and no grants yet."""
    a = h.connect("engine-a", uid=OWNER_UID, gid=OWNER_UID)
    h.create(a, "kv", GiB)
    if commit:
        h.commit(a, "kv", commit)
    return a


def assert_not_admitted(h: Harness, s: Session, token: str = "", *why: str) -> p.ProtocolError:
    """The attach is refused, says why, and changes nothing: ``s`` is not attached and
    holds no chunk (so the server has nothing to send it)."""
    arena = h.state.arenas.by_name["kv"]
    attached, holders = set(arena.attached), [set(c.holders) for c in arena.chunks]
    error = h.refused(s, p.AttachArena(name=kv_for(s), token=token), ErrorCode.PERMISSION_DENIED)
    assert f"arena 'kv' belongs to client 'engine-a' (pid {arena.owner_pid})" in error.message
    assert f"client '{s.name}' (uid {s.uid}, gid {s.gid})" in error.message
    for part in why:
        assert part in error.message, error.message
    assert error.detail == {"arena": "kv", "owner": "engine-a", "owner_pid": arena.owner_pid, "uid": s.uid, "gid": s.gid}
    assert arena.attached == attached and [c.holders for c in arena.chunks] == holders
    assert s.id not in arena.attached and all(s.id not in c.holders for c in arena.chunks)
    return error


def test_a_share_by_name_alone_admits_that_name_under_the_owners_uid_only(h: Harness) -> None:
    a = owned_arena(h)
    h.share(a, "kv", "engine-b")
    impostor = h.connect("engine-b", uid=OTHER_UID, gid=OTHER_UID)
    assert_not_admitted(h, impostor, "", "its grant to client 'engine-b' under the owner's uid 1000", "admits uid 1000 only")
    h.state.close_session(impostor.id)
    stranger = h.connect("engine-c")  # the owner's uid, another name
    assert_not_admitted(h, stranger, "", "is not shared with", "no grant names this client")
    b = h.connect("engine-b")
    assert ids(h.attach(b, "kv").handout) == ids(h.state.arenas.by_name["kv"].chunks)


def test_the_token_lifts_the_implied_uid_and_nothing_the_share_named(h: Harness) -> None:
    a = owned_arena(h)
    token = h.share(a, "kv", "engine-b")
    c = h.connect("engine-c")
    assert_not_admitted(h, c, token, "names client 'engine-b'")
    b = h.connect("engine-b", uid=OTHER_UID, gid=OTHER_UID)
    assert_not_admitted(h, b, "", "admits uid 1000 only")
    out = h.attach(b, OWNERS_KV, token)
    assert ids(out.handout) == ids(out.reply.chunks) == ids(h.state.arenas.by_name["kv"].chunks)


def test_a_share_by_uid_admits_that_uid_under_any_name(h: Harness) -> None:
    a = owned_arena(h)
    token = h.share(a, "kv", uid=OTHER_UID)
    h.attach(h.connect("anything", uid=OTHER_UID, gid=77), OWNERS_KV)
    third = h.connect("third", uid=3000, gid=3000)
    assert_not_admitted(h, third, "", "is not shared with")
    assert_not_admitted(h, third, token, "it admits uid 2000 only")  # named explicitly: the token does not lift it
    owners_uid = h.connect("same-user")
    assert_not_admitted(h, owners_uid, "", "is not shared with")


def test_a_share_by_client_and_uid_needs_both(h: Harness) -> None:
    a = owned_arena(h)
    h.share(a, "kv", "engine-b", uid=OTHER_UID)
    (grant,) = h.state.arenas.by_name["kv"].grants
    assert (grant.uid, grant.uid_implied) == (OTHER_UID, False)
    same_uid_as_owner = h.connect("engine-b")
    assert_not_admitted(h, same_uid_as_owner, "", "admits uid 2000 only")
    h.state.close_session(same_uid_as_owner.id)
    h.attach(h.connect("engine-b", uid=OTHER_UID), OWNERS_KV)


def test_a_share_by_gid_admits_the_group_under_any_uid(h: Harness) -> None:
    a = owned_arena(h)
    token = h.share(a, "kv", gid=50)
    h.attach(h.connect("in-group", uid=3000, gid=50), OWNERS_KV)
    outside = h.connect("outside", uid=3001, gid=51)
    assert_not_admitted(h, outside, "", "is not shared with")
    assert_not_admitted(h, outside, token, "it admits gid 50 only")


def test_a_share_that_names_nobody_admits_by_token_alone(h: Harness) -> None:
    a = owned_arena(h)
    token = h.share(a, "kv")
    (grant,) = h.state.arenas.by_name["kv"].grants
    assert (grant.client, grant.uid, grant.gid, grant.uid_implied) == ("", -1, -1, False)
    same_user = h.connect("same-user")
    assert_not_admitted(h, same_user, "", "is not shared with")
    assert_not_admitted(h, same_user, "0" * 64, "the token given matches none of its grants")
    assert_not_admitted(h, same_user, token[:-1], "matches none")
    h.attach(h.connect("far-away", uid=4242, gid=4242), OWNERS_KV, token)
    h.attach(same_user, "kv", token)


def test_tokens_are_long_random_and_of_their_own_arena(h: Harness) -> None:
    a = owned_arena(h)
    h.create(a, "other", GiB)
    tokens = {h.share(a, "kv") for _ in range(8)}
    assert len(tokens) == 8 and all(len(t) == 64 and int(t, 16) >= 0 for t in tokens), "256 bits, hex"
    other = h.share(a, "other")
    assert_not_admitted(h, h.connect("b", uid=OTHER_UID), other, "matches none")


def test_every_grant_is_compared_in_constant_time(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that stopped at the first match, or compared with ==, would tell a guesser
    by its timing how close it came."""
    import gpumemd.grants

    a = owned_arena(h)
    tokens = [h.share(a, "kv") for _ in range(3)]
    compared: list[tuple[bytes, bytes]] = []
    real = gpumemd.grants.hmac.compare_digest

    def recording(x: bytes, y: bytes) -> bool:
        compared.append((x, y))
        return real(x, y)

    monkeypatch.setattr(gpumemd.grants.hmac, "compare_digest", recording)
    h.attach(h.connect("b", uid=OTHER_UID), OWNERS_KV, tokens[0])
    assert sorted(x for x, _ in compared) == sorted(t.encode() for t in tokens)
    assert {y for _, y in compared} == {tokens[0].encode()}


def test_an_identity_grant_admits_whatever_token_comes_along(h: Harness) -> None:
    a = owned_arena(h)
    h.share(a, "kv", "engine-b")
    h.attach(h.connect("engine-b"), "kv", "f" * 64)  # a stale token takes nothing away


def test_share_refusals(h: Harness) -> None:
    a = owned_arena(h)
    for message in (
        p.ShareArena(name="kv", uid=-2),
        p.ShareArena(name="kv", gid=-2),
        p.ShareArena(name="kv", uid=0xFFFF_FFFF),
        p.ShareArena(name="kv", gid=1 << 40),
        p.ShareArena(name="kv", client="../x"),
    ):
        h.refused(a, message, ErrorCode.INVALID_ARGUMENT)
    assert h.state.arenas.by_name["kv"].grants == []
    h.share(a, "kv", uid=0)  # root is an id like any other
    h.share(a, "kv", uid=0xFFFF_FFFE, gid=0xFFFF_FFFE)
    for _ in range(62):
        h.share(a, "kv")
    error = h.refused(a, p.ShareArena(name="kv"), ErrorCode.INVALID_ARGUMENT)
    assert "64 grants" in error.message and "unshare" in error.message
    assert len(h.state.arenas.by_name["kv"].grants) == 64


def test_revoking_refuses_new_attaches_and_takes_nothing_from_attached_sharers(h: Harness) -> None:
    a = owned_arena(h)
    token = h.share(a, "kv", "engine-b")
    keep = h.share(a, "kv", "engine-c")
    b = h.connect("engine-b", uid=OTHER_UID)
    first = ids(h.attach(b, OWNERS_KV, token).handout)
    h.ok(a, p.UnshareArena(name="kv", token=token))
    arena = h.state.arenas.by_name["kv"]
    assert [g.client for g in arena.grants] == ["engine-c"]
    assert b.id in arena.attached and all(b.id in c.holders for c in arena.chunks), "b keeps what it maps"
    grown = ids(h.commit(a, "kv", 10 * MiB).handout)
    assert ids(h.sync(b, "kv").handout) == grown, "an attached sharer stays attached"
    h.release(b, "kv")
    assert_not_admitted(h, b, token, "matches none")
    b2 = h.connect("engine-b2")
    assert_not_admitted(h, b2, "", "is not shared with")
    h.attach(h.connect("engine-c"), "kv")  # the other grant stands
    h.refused(a, p.UnshareArena(name="kv", token=token), ErrorCode.NOT_FOUND)  # once only
    h.refused(b, p.UnshareArena(name=OWNERS_KV, token=keep), ErrorCode.PERMISSION_DENIED)
    assert [g.client for g in arena.grants] == ["engine-c"]
    assert first and set(first).isdisjoint(grown)


def test_status_shows_grants_and_never_their_tokens(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    a = owned_arena(h)
    tokens = [
        h.share(a, "kv", "engine-b"),
        h.share(a, "kv", uid=OTHER_UID),
        h.share(a, "kv", "engine-c", gid=50),
        h.share(a, "kv"),
    ]
    h.attach(h.connect("engine-b", uid=OTHER_UID), OWNERS_KV, tokens[0])
    # one hex digit off; a fixed "0" would be the token itself when it ends in 0 (1 run in 16)
    near = tokens[3][:-1] + ("1" if tokens[3].endswith("0") else "0")
    assert_not_admitted(h, h.connect("x", uid=3000), near, "matches none")
    h.ok(a, p.UnshareArena(name="kv", token=tokens[3]))
    (arena,) = h.state.status().arenas
    assert [p.to_wire(g) for g in arena.grants] == [
        {"id": 1, "client": "engine-b", "uid": OWNER_UID, "gid": -1, "uid_implied": True, "read_only": False},
        {"id": 2, "client": "", "uid": OTHER_UID, "gid": -1, "uid_implied": False, "read_only": False},
        {"id": 3, "client": "engine-c", "uid": -1, "gid": 50, "uid_implied": False, "read_only": False},
    ]
    assert arena.shared_with == ["engine-b", "engine-c"]
    seen = p.encode_reply(1, h.state.status()) + caplog.text.encode() + repr(h.state.arenas.by_name["kv"]).encode()
    for token in tokens:
        assert token.encode() not in seen and token[:-1].encode() not in seen
    assert "refused" in caplog.text and "grant 4" in caplog.text and "revoked" in caplog.text


# --------------------------------------------------------------------------- growth, sync, notices


def test_commit_tells_attached_sharers_and_sync_hands_out_only_new_chunks(h: Harness) -> None:
    a, b, first = shared_arena(h)
    c = h.connect("engine-c")  # not attached: hears nothing
    grown = h.commit(a, "kv", 6 * MiB + BULK + 2 * MiB)
    assert recipients(grown.notices, "arena-grown") == [b.id]
    assert len(grown.notices) == 1
    notice = grown.notices[0][1]
    assert notice.arena == "kv" and str(6 * MiB + BULK + 2 * MiB) in notice.message
    new = ids(grown.handout)
    assert all(sid != c.id for sid, _ in grown.notices)

    out = h.sync(b, "kv")
    assert ids(out.handout) == ids(out.reply.chunks) == new
    assert [(ch.offset, ch.size) for ch in out.reply.chunks] == [(6 * MiB, BULK), (6 * MiB + BULK, 2 * MiB)]
    assert out.reply.arena.committed == 6 * MiB + BULK + 2 * MiB
    assert h.sync(b, "kv").handout == [], "a second sync has nothing new"
    assert all(ch.holders == {a.id, b.id} for ch in h.state.arenas.by_name["kv"].chunks)
    assert set(first).isdisjoint(new)


def test_decommit_tells_holders_and_memory_returns_after_the_last_unmap(h: Harness) -> None:
    a, b, chunk_ids = shared_arena(h, commit=BULK + 6 * MiB)  # chunks [0,16) [16,20) [20,22) MiB
    out = h.decommit(a, "kv", 16 * MiB)
    assert ids(out.reply.retired) == chunk_ids[1:]
    assert recipients(out.notices, "arena-retired") == [b.id], "the owner learns from its reply"
    assert out.notices[0][1].arena == "kv"

    synced = h.sync(b, "kv")
    assert synced.handout == [] and ids(synced.reply.retired) == chunk_ids[1:]
    assert synced.reply.arena.committed == 16 * MiB

    h.unmapped(a, "kv", chunk_ids[1:])
    assert h.state.arenas.accounted_bytes() == BULK + 6 * MiB, "engine-b still maps them"
    assert h.state.status().arenas[0].retiring_bytes == 6 * MiB
    h.unmapped(b, "kv", chunk_ids[1:])
    assert h.state.arenas.accounted_bytes() == BULK and h.state.arenas.retiring == {}


def test_decommit_of_chunks_a_sharer_never_mapped_does_not_involve_it(h: Harness) -> None:
    a, b, _ = shared_arena(h)  # engine-b maps the first 6 MiB only
    late = ids(h.commit(a, "kv", 10 * MiB).handout)
    out = h.decommit(a, "kv", 6 * MiB)
    assert ids(out.reply.retired) == late
    assert out.notices == []
    assert h.sync(b, "kv").reply.retired == []
    h.unmapped(a, "kv", late)
    assert h.state.arenas.accounted_bytes() == 6 * MiB


def test_sync_needs_an_attached_session(h: Harness) -> None:
    a, _, _ = shared_arena(h)
    c = h.connect("engine-c")
    h.refused(c, p.SyncArena(name="kv"), ErrorCode.PERMISSION_DENIED)
    assert all(c.id not in ch.holders for ch in h.state.arenas.by_name["kv"].chunks)


def test_unmapped_report_from_a_session_that_does_not_hold_the_chunk(h: Harness) -> None:
    a, b, chunk_ids = shared_arena(h)
    c = h.connect("engine-c")
    h.refused(c, p.ChunksUnmapped(name="kv", chunk_ids=chunk_ids[:1]), ErrorCode.NOT_FOUND)
    assert h.state.arenas.by_name["kv"].chunks[0].holders == {a.id, b.id}


# --------------------------------------------------------------------------- release


def test_owner_release_without_sharers_frees_everything(h: Harness) -> None:
    a = h.connect("engine-a")
    fds = open_fds()
    h.create(a, "kv", GiB)
    chunk_ids = ids(h.commit(a, "kv", 38 * MiB).handout)
    h.decommit(a, "kv", 16 * MiB)  # leaves retiring chunks the owner never reported
    assert h.state.arenas.retiring
    out = h.release(a, "kv")
    assert out.reply == p.Ack() and out.notices == []
    assert h.state.arenas.by_name == {} and h.state.arenas.retiring == {}
    assert h.state.arenas.accounted_bytes() == 0
    assert open_fds() == fds
    assert planned(h) == [], "the window is free again"
    assert h.state.status().clients[0].arenas == []
    h.refused(a, p.ChunksUnmapped(name="kv", chunk_ids=chunk_ids), ErrorCode.NOT_FOUND)


def test_owner_release_with_a_sharer_retires_the_arena_until_the_sharer_leaves(h: Harness) -> None:
    a, b, chunk_ids = shared_arena(h)
    view_address = h.state.arenas.by_name["kv"].address
    fds = open_fds()
    out = h.release(a, "kv")
    assert recipients(out.notices, "arena-retired") == [b.id]
    assert "released by its owner" in out.notices[0][1].message

    arena = h.state.arenas.by_name["kv"]
    assert arena.released and not arena.owner_alive
    assert arena.attached == {b.id} and arena.chunks == []
    assert sorted(h.state.arenas.retiring) == chunk_ids
    assert h.state.arenas.accounted_bytes() == 6 * MiB, "engine-b still maps the memory"
    assert open_fds() == fds - len(chunk_ids), "the daemon dropped its own references"
    assert [start for start, _ in planned(h)] == [view_address], "the window stays taken while b maps the arena"

    # nobody can use a released arena; its name stays taken until it is gone
    c = h.connect("engine-c")
    h.refused(a, p.CreateArena(name="kv", reserve_bytes=GiB), ErrorCode.ALREADY_EXISTS)
    h.refused(c, p.AttachArena(name="kv"), ErrorCode.NOT_FOUND)

    synced = h.sync(b, "kv")
    assert synced.handout == [] and ids(synced.reply.retired) == chunk_ids
    h.unmapped(b, "kv", chunk_ids)
    assert h.state.arenas.accounted_bytes() == 0
    h.release(b, "kv")
    assert h.state.arenas.by_name == {} and planned(h) == []
    assert h.create(a, "kv", GiB).address == view_address


def test_owner_commands_on_its_released_arena_are_not_found(h: Harness) -> None:
    a, b, _ = shared_arena(h)
    h.release(a, "kv")
    arena = h.state.arenas.by_name["kv"]
    assert arena.owner_id == a.id
    for message in (
        p.CommitArena(name="kv", nbytes=8 * MiB),
        p.DecommitArena(name="kv", to_nbytes=0),
        p.ShareArena(name="kv", client="x"),
    ):
        error = h.refused(a, message, ErrorCode.NOT_FOUND)
        assert "was released" in error.message
    h.refused(a, p.ReleaseArena(name="kv"), ErrorCode.PERMISSION_DENIED)  # not attached any more


def test_sharer_release_detaches_only_the_sharer(h: Harness) -> None:
    a, b, chunk_ids = shared_arena(h)
    out = h.release(b, "kv")
    assert out.notices == []
    arena = h.state.arenas.by_name["kv"]
    assert arena.attached == {a.id} and not arena.released and arena.owner_alive
    assert all(ch.holders == {a.id} for ch in arena.chunks)
    assert h.state.arenas.accounted_bytes() == 6 * MiB
    h.refused(b, p.SyncArena(name="kv"), ErrorCode.PERMISSION_DENIED)
    h.refused(b, p.ReleaseArena(name="kv"), ErrorCode.PERMISSION_DENIED)
    assert ids(h.attach(b, "kv").handout) == chunk_ids, "the share still stands: b may come back"


def test_release_by_a_session_not_attached_is_permission_denied(h: Harness) -> None:
    a = h.connect("engine-a")
    c = h.connect("engine-c")
    h.create(a, "kv")
    h.refused(c, p.ReleaseArena(name="kv"), ErrorCode.PERMISSION_DENIED)
    assert "kv" in h.state.arenas.by_name


# --------------------------------------------------------------------------- clients going away


def test_owner_death_leaves_the_arena_to_its_sharer(h: Harness) -> None:
    a, b, chunk_ids = shared_arena(h)
    only_owner = ids(h.commit(a, "kv", 10 * MiB).handout)
    h.decommit(a, "kv", 6 * MiB)  # owner's retiring chunks, unreported
    fds = open_fds()
    notices = h.state.close_session(a.id)
    assert notices == []
    arena = h.state.arenas.by_name["kv"]
    assert not arena.owner_alive and not arena.released
    assert arena.attached == {b.id}
    assert ids(arena.chunks) == chunk_ids and all(ch.holders == {b.id} for ch in arena.chunks)
    assert h.state.arenas.retiring == {}, "the dead owner's unmap is implied"
    assert h.state.arenas.accounted_bytes() == 6 * MiB
    assert open_fds() == fds, "live chunks keep their memfds"
    (status,) = h.state.status().arenas
    assert (status.owner, status.owner_alive, status.attached) == ("engine-a", False, ["engine-b"])
    assert set(only_owner).isdisjoint(ids(arena.chunks))

    h.refused(b, p.CommitArena(name="kv", nbytes=8 * MiB), ErrorCode.PERMISSION_DENIED)
    assert h.sync(b, "kv").handout == []

    address = arena.address
    h.state.close_session(b.id)
    assert h.state.arenas.by_name == {} and h.state.arenas.accounted_bytes() == 0
    assert open_fds() == fds - len(chunk_ids)
    assert planned(h) == [] and h.create(h.connect("engine-c"), "next", GiB).address == address


def test_last_holder_leaving_frees_everything(h: Harness) -> None:
    fds = open_fds()
    a = h.connect("engine-a")
    h.create(a, "kv-1", GiB)
    h.create(a, "kv-2", 2 * GiB)
    h.commit(a, "kv-1", 40 * MiB)
    h.commit(a, "kv-2", 20 * MiB)
    h.decommit(a, "kv-2", 0)
    assert h.state.arenas.accounted_bytes() == 60 * MiB
    assert h.state.close_session(a.id) == []
    assert h.state.sessions == {} and h.state.arenas.by_name == {} and h.state.arenas.retiring == {}
    assert h.state.arenas.accounted_bytes() == 0
    assert h.state.arenas.free_bytes() == h.state.device.total_bytes
    assert open_fds() == fds
    assert planned(h) == []


def test_sharer_death_forgets_what_it_held(h: Harness) -> None:
    a, b, chunk_ids = shared_arena(h)
    h.decommit(a, "kv", 0)
    h.unmapped(a, "kv", chunk_ids)
    assert h.state.arenas.accounted_bytes() == 6 * MiB, "engine-b has not reported"
    h.state.close_session(b.id)
    assert h.state.arenas.accounted_bytes() == 0 and h.state.arenas.retiring == {}
    assert h.state.arenas.by_name["kv"].attached == {a.id}


def test_owner_released_and_sharer_dies(h: Harness) -> None:
    a, b, _ = shared_arena(h)
    address = h.state.arenas.by_name["kv"].address
    h.release(a, "kv")
    h.state.close_session(b.id)
    assert h.state.arenas.by_name == {} and h.state.arenas.retiring == {} and h.state.arenas.accounted_bytes() == 0
    assert planned(h) == [] and h.create(h.connect("engine-c"), "next", GiB).address == address
