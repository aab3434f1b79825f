"""Tenant memory caps (memory_caps.py): the policy files, and every path that creates chunks
(commit, KV grow, KV round, staged minimums) held to each tenant's maximum and to the
other tenants' guaranteed minimums, on the real host driver (256 MiB)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode
from gpumemd.memory_caps import Caps, PolicyError, read_policy
from gpumemd.metrics import Metrics
from gpumemd.records import SessionRecord as Session

from .harness import Harness, MiB
from .test_kv_rounds import capture, commit_reply, declare, done, join
from .test_metrics import fresh, number

A, B, C = 1000, 2000, 3000  # uids
GROUP = 500


def policy(tmp_path: Path, text: str, name: str = "tenants.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def sha(token: str) -> str:
    """A tenant token's digest, as a policy's token rule and a DRA claim name it."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_rules(*rules: tuple[str, str, str]) -> str:
    """A policy's ``[[tenant]]`` rules, one for each (token, name, max) given."""
    return "".join(f'[[tenant]]\ntoken_sha256 = "{sha(token)}"\nname = "{name}"\nmax = "{cap}"\n' for token, name, cap in rules)


def capped(make_harness: Callable[..., Harness], tmp_path: Path, text: str) -> Harness:
    return make_harness(tenant_policy=policy(tmp_path, text))


def refusal(h: Harness, s: Session, message: object) -> p.ProtocolError:
    return h.refused(s, message, ErrorCode.RESOURCE_EXHAUSTED)


# --------------------------------------------------------------------------- the policy


def test_toml_and_json_policies_say_the_same_caps(tmp_path: Path) -> None:
    toml = policy(tmp_path, '[[tenant]]\nuid = 1000\nmax = "64MiB"\nmin = "16MiB"\n\n[[tenant]]\ngid = 500\nmax = 1048576\n\n[default]\nmax = "1GiB"\n')
    doc = {"tenant": [{"uid": 1000, "max": "64MiB", "min": "16MiB"}, {"gid": 500, "max": 1048576}], "default": {"max": "1GiB"}}
    js = policy(tmp_path, json.dumps(doc), "tenants.json")
    for path in (toml, js):
        pol = read_policy(path, "")
        assert (pol.uids[1000].max_bytes, pol.uids[1000].min_bytes) == (64 * MiB, 16 * MiB)
        assert (pol.gids[500].max_bytes, pol.gids[500].min_bytes) == (MiB, 0)
        assert pol.default is not None and pol.default.max_bytes == 1 << 30
        # A uid's own rule first, then its group's, then the default (each uid on its own).
        assert pol.account(1000, 500) == ("uid 1000", pol.uids[1000])
        assert pol.account(1001, 500) == ("gid 500", pol.gids[500])
        assert pol.account(1002, 7) == ("uid 1002", pol.default)
    assert read_policy("", "").account(1000, 1000) is None


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[[tenant]]\nuid = 1\nmax = "1MiB"\n[[tenant]]\nuid = 1\nmax = "2MiB"\n', "uid 1 has a cap in"),
        ('[[tenant]]\nuid = 1\nmax = "1MiB"\nmin = "2MiB"\n', "minimum 2 MiB is above its maximum 1 MiB"),
        ('[[tenant]]\nuid = 1\ngid = 2\nmax = 1\n', "exactly one of 'uid' or 'gid'"),
        ('[[tenant]]\nuid = -1\nmax = 1\n', "exactly one of 'uid' or 'gid'"),
        ('[[tenant]]\nuid = 1\nmax = "lots"\n', "'lots' is not a size"),
        ('[[tenant]]\nuid = 1\nmax = -5\n', "cannot be negative"),
        ('[[tenant]]\nuid = 1\nmaximum = 5\n', "unknown keys ['maximum']"),
        ("[[tenant]]\nuid = 1\nmax = true\n", "a size is a number of bytes"),
        ("caps = 1\n", "nothing else"),
        ("[[tenant]\n", "cannot read the tenant policy"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_file_and_the_entry(tmp_path: Path, text: str, named: str) -> None:
    path = policy(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        read_policy(path, "")
    assert named in str(info.value) and path in str(info.value)


def test_dra_claims_are_caps_and_a_claim_being_prepared_is_skipped(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    (claims / "claim-a").mkdir(parents=True)
    (claims / "claim-a" / "tenant.json").write_text(json.dumps({"uid": A, "bytes": 32 * MiB}))
    (claims / "claim-b").mkdir()
    (claims / "claim-b" / "tenant.json").write_text(json.dumps({"gid": GROUP, "bytes": "8GiB", "min_bytes": 0}))
    (claims / "claim-c").mkdir()  # the driver has not written its file yet
    pol = read_policy("", str(claims))
    # A claim's consumed bytes are its maximum and, unless it says otherwise, its guarantee.
    assert (pol.uids[A].max_bytes, pol.uids[A].min_bytes, pol.uids[A].source) == (32 * MiB, 32 * MiB, "claim claim-a")
    assert (pol.gids[GROUP].max_bytes, pol.gids[GROUP].min_bytes) == (8 << 30, 0)
    (claims / "claim-c" / "tenant.json").write_text(json.dumps({"uid": A, "bytes": 1}))
    with pytest.raises(PolicyError, match="uid 1000 has a cap in claim claim-a and again in claim claim-c"):
        read_policy("", str(claims))
    (claims / "claim-c" / "tenant.json").write_text("{not json")
    with pytest.raises(PolicyError, match="claim-c/tenant.json"):
        read_policy("", str(claims))


def test_the_claims_are_read_again_when_a_claim_comes_changes_or_goes(tmp_path: Path) -> None:
    """No signal from the driver (its pod cannot reach the daemon's pid): the loop asks
    claims_changed on its tick and reloads. A tenant.json replaced by one of the same
    size is a change (a new inode); a bad one is logged once, not read again every tick."""
    claims = tmp_path / "claims"
    claims.mkdir()
    caps = Caps("", str(claims), {}, {}, {}, {}, {})
    assert not caps.claims_changed() and not caps.policy.uids

    def put(claim: str, entry: object) -> None:
        (claims / claim).mkdir(exist_ok=True)
        tmp = claims / claim / ".tenant.json.tmp"
        tmp.write_text(json.dumps(entry) if not isinstance(entry, str) else entry)
        tmp.rename(claims / claim / "tenant.json")

    (claims / "claim-a").mkdir()  # being prepared: a change, with no cap yet
    assert caps.claims_changed()
    assert caps.reload() is None and not caps.policy.uids and not caps.claims_changed()
    put("claim-a", {"uid": A, "bytes": 32 * MiB})
    assert caps.claims_changed()
    assert caps.reload() is None and caps.policy.uids[A].max_bytes == 32 * MiB and not caps.claims_changed()
    put("claim-a", {"uid": A, "bytes": 16 * MiB})  # the same size of file
    assert caps.claims_changed()
    assert caps.reload() is None and caps.policy.uids[A].max_bytes == 16 * MiB
    put("claim-b", "{not json")
    assert caps.claims_changed() and caps.reload() is not None
    assert not caps.claims_changed() and caps.policy.uids[A].max_bytes == 16 * MiB  # the caps in force stay
    shutil.rmtree(claims / "claim-b")
    shutil.rmtree(claims / "claim-a")
    assert caps.claims_changed()
    assert caps.reload() is None and not caps.policy.uids
    assert not Caps("", "", {}, {}, {}, {}, {}).claims_changed()  # no claims directory: nothing to watch


def test_a_default_of_nothing_leaves_memory_to_claims_alone(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    """The operator's choice docs/architecture.md offers (Kubernetes DRA): with
    ``[default] max = 0``, a session of the same uid that presents no claim's token gets
    no memory; the claim's token gets what the claim consumed."""
    claims = tmp_path / "claims"
    (claims / "claim-a").mkdir(parents=True)
    token = "f" * 64
    (claims / "claim-a" / "tenant.json").write_text(json.dumps({"token_sha256": sha(token), "bytes": 32 * MiB}))
    h = make_harness(tenant_policy=policy(tmp_path, "[default]\nmax = 0\n"), tenant_claims=str(claims))
    pod, stray = h.connect("pod", uid=A, tenant_token=token), h.connect("stray", uid=A)
    h.create(pod, "x", 64 * MiB)
    h.create(stray, "y", 64 * MiB)
    h.commit(pod, "x", 32 * MiB)
    assert "uid 1000" in refusal(h, stray, p.CommitArena(name="y", nbytes=2 * MiB)).message
    assert "token claim-a" in refusal(h, pod, p.CommitArena(name="x", nbytes=34 * MiB)).message


# --------------------------------------------------------------------------- commits


def test_a_commit_past_the_tenants_cap_is_refused_naming_the_cap_and_its_use(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 1000\nmax = "64MiB"\n')
    a1, a2, b = h.connect("a1", uid=A), h.connect("a2", uid=A), h.connect("b", uid=B)
    h.create(a1, "x", 128 * MiB)
    h.create(a2, "y", 128 * MiB)
    h.commit(a1, "x", 48 * MiB)
    # Two sessions of one uid are one tenant: the second arena gets what the cap leaves.
    err = refusal(h, a2, p.CommitArena(name="y", nbytes=32 * MiB))
    assert err.detail == {"limit": "device memory", "tenant": "uid 1000", "used": 48 * MiB, "cap": 64 * MiB}
    assert "uid 1000 holds 48 MiB" in err.message and "cap of 64 MiB" in err.message and "tenants.toml" in err.message
    assert h.state.arenas.by_name["y"].committed == 0, "a refused commit left chunks behind"
    h.commit(a2, "y", 16 * MiB)
    refusal(h, a1, p.CommitArena(name="x", nbytes=50 * MiB))
    # Another uid is not capped by it.
    h.create(b, "z", 128 * MiB)
    h.commit(b, "z", 128 * MiB)
    # Giving back makes room again.
    h.decommit(a1, "x", 32 * MiB)
    h.unmapped(a1, "x", [c.id for c in h.state.arenas.retiring.values()])
    h.commit(a2, "y", 32 * MiB)


def test_a_group_cap_is_shared_by_its_uids_and_the_default_is_each_uids_own(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\ngid = 500\nmax = "32MiB"\n[default]\nmax = "16MiB"\n')
    a, b = h.connect("a", uid=A, gid=GROUP), h.connect("b", uid=B, gid=GROUP)
    c, d = h.connect("c", uid=C, gid=C), h.connect("d", uid=C + 1, gid=C)
    for s, name in ((a, "a"), (b, "b"), (c, "c"), (d, "d")):
        h.create(s, name, 64 * MiB)
    h.commit(a, "a", 16 * MiB)
    h.commit(b, "b", 16 * MiB)
    assert refusal(h, b, p.CommitArena(name="b", nbytes=18 * MiB)).detail["tenant"] == "gid 500"
    h.commit(c, "c", 16 * MiB)
    h.commit(d, "d", 16 * MiB)  # the default is per uid, not one pool for all of them
    assert refusal(h, d, p.CommitArena(name="d", nbytes=18 * MiB)).detail["tenant"] == f"uid {C + 1}"


def test_memory_retired_but_still_mapped_counts_until_unmapped(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 1000\nmax = "32MiB"\n')
    a = h.connect("a", uid=A)
    h.create(a, "x", 64 * MiB)
    h.commit(a, "x", 32 * MiB)
    h.decommit(a, "x", 0)  # the client still maps the chunks: they are on the device
    refusal(h, a, p.CommitArena(name="x", nbytes=2 * MiB))
    h.unmapped(a, "x", list(h.state.arenas.retiring))
    h.commit(a, "x", 32 * MiB)


def test_no_tenant_commits_what_another_is_guaranteed(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 2000\nmin = "64MiB"\n')
    a, b = h.connect("a", uid=A), h.connect("b", uid=B)
    h.create(a, "x", 256 * MiB)
    h.create(b, "y", 256 * MiB)
    h.commit(a, "x", 192 * MiB)
    err = refusal(h, a, p.CommitArena(name="x", nbytes=194 * MiB))
    assert (err.detail["limit"], err.detail["held_back"]) == ("guaranteed minimums", 64 * MiB)
    assert "held back for their minimums" in err.message
    h.commit(b, "y", 64 * MiB)  # the guaranteed tenant gets all of it
    # Held, the guarantee holds nothing back any more.
    assert h.state.arenas.caps.held_back() == 0


# --------------------------------------------------------------------------- KV grows and rounds
# Rows of 4 KiB: 256 tokens a MiB.


def test_a_kv_grow_gets_what_the_cap_leaves_and_none_is_refused(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 1000\nmax = "64MiB"\n')
    a = h.connect("a", uid=A)
    declare(h, a, "kv")
    join(h, a, "kv")
    capture(h, a, "kv", 1, min_tokens=1024, max_tokens=4096)  # 16 MiB
    assert commit_reply(done(h)[1]).pool.tokens == 4096
    reply = h.ok(a, p.KvGrow(pool="kv", tokens=65536)).reply
    assert isinstance(reply, p.KvCommitReply)
    assert (reply.pool.tokens, reply.asked_tokens) == (64 * 256, 65536)
    assert h.state.arenas.by_name["kv"].committed == 64 * MiB
    err = refusal(h, a, p.KvGrow(pool="kv", tokens=20000))
    assert err.detail["tenant"] == "uid 1000" and err.detail["cap"] == 64 * MiB


def test_a_round_splits_within_each_tenants_cap(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 1000\nmax = "48MiB"\n')
    a1, a2, b = h.connect("a1", uid=A), h.connect("a2", uid=A), h.connect("b", uid=B)
    for s, name in ((a1, "ka1"), (a2, "ka2"), (b, "kb")):
        declare(h, s, name)
        join(h, s, name)
    capture(h, a1, "ka1", 1, min_tokens=1024)
    capture(h, a2, "ka2", 2, min_tokens=1024, weight=3.0)
    capture(h, b, "kb", 3, min_tokens=1024)
    tokens = {rid: commit_reply(c).pool.tokens for rid, c in done(h).items()}
    # uid 1000's two pools share 48 MiB: minimums (4 MiB each) first, the rest 1:3.
    assert tokens[1] + tokens[2] <= 48 * 256 and tokens[2] > 2 * tokens[1]
    assert tokens[1] >= 1024 and tokens[2] >= 1024
    assert h.state.arenas.caps.usage()["uid 1000"] <= 48 * MiB
    # What uid 1000 could not take went to the uncapped tenant: the device is full.
    assert tokens[3] == (256 - 48) * 256, tokens


def test_a_round_member_whose_minimum_passes_its_cap_is_refused_and_the_others_commit(
    make_harness: Callable[..., Harness], tmp_path: Path
) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 1000\nmax = "8MiB"\n')
    a, b = h.connect("a", uid=A), h.connect("b", uid=B)
    declare(h, a, "ka")
    declare(h, b, "kb")
    join(h, a, "ka")
    join(h, b, "kb")
    capture(h, a, "ka", 1, min_tokens=4096)  # 16 MiB
    capture(h, b, "kb", 2, min_tokens=1024)
    out = done(h)
    assert isinstance(out[1].reply, p.ProtocolError) and out[1].reply.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "uid 1000's cap" in out[1].reply.message and out[1].handout == []
    assert commit_reply(out[2]).pool.tokens > 1024
    assert h.state.arenas.by_name["ka"].committed == 0


# --------------------------------------------------------------------------- reload, status, metrics


def test_a_lowered_cap_refuses_new_commits_and_takes_nothing_away(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 1000\nmax = "64MiB"\n')
    a = h.connect("a", uid=A)
    h.create(a, "x", 128 * MiB)
    h.commit(a, "x", 64 * MiB)
    Path(h.config.tenant_policy).write_text('[[tenant]]\nuid = 1000\nmax = "32MiB"\n')
    assert h.state.arenas.caps.reload() is None
    assert h.state.arenas.by_name["x"].committed == 64 * MiB
    err = refusal(h, a, p.CommitArena(name="x", nbytes=66 * MiB))
    assert (err.detail["used"], err.detail["cap"]) == (64 * MiB, 32 * MiB)
    [row] = h.state.status().tenants
    assert (row.tenant, row.used_bytes, row.max_bytes, row.min_bytes) == ("uid 1000", 64 * MiB, 32 * MiB, 0)
    # A policy that does not parse leaves the one in force.
    Path(h.config.tenant_policy).write_text('[[tenant]]\nuid = 1000\nmax = "lots"\n')
    assert "'lots' is not a size" in (h.state.arenas.caps.reload() or "")
    refusal(h, a, p.CommitArena(name="x", nbytes=66 * MiB))
    Path(h.config.tenant_policy).write_text('[[tenant]]\nuid = 1000\nmax = "128MiB"\n')
    h.state.arenas.caps.reload()
    h.commit(a, "x", 128 * MiB)


def test_status_and_metrics_show_each_tenants_cap_and_use(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\ngid = 500\nmax = "64MiB"\nmin = "8MiB"\n[default]\nmax = "32MiB"\n')
    a, c = h.connect("a", uid=A, gid=GROUP), h.connect("c", uid=C, gid=C)
    h.create(a, "x", 64 * MiB)
    h.commit(a, "x", 16 * MiB)
    h.create(c, "y", 64 * MiB)
    h.commit(c, "y", 2 * MiB)
    rows = {t.tenant: (t.used_bytes, t.max_bytes, t.min_bytes) for t in h.state.status().tenants}
    assert rows == {"gid 500": (16 * MiB, 64 * MiB, 8 * MiB), "uid 3000": (2 * MiB, 32 * MiB, 0)}
    snap = fresh(Metrics(h.state))
    assert number(snap, "gpumemd_tenant_used_bytes", tenant="gid 500") == 16 * MiB
    assert number(snap, "gpumemd_tenant_cap_bytes", tenant="uid 3000") == 32 * MiB
    assert number(snap, "gpumemd_tenant_min_bytes", tenant="gid 500") == 8 * MiB


def test_a_wake_is_held_to_the_cap_in_force_then(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    """Sleeping gives the bytes back; waking takes them again, under the cap as it is now."""
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 1000\nmax = "128MiB"\n')
    a = h.connect("a", uid=A)
    h.create(a, "weights", 256 * MiB)
    h.commit(a, "weights", 100 * MiB)
    out = h.ok(a, p.SleepArena(name="weights", kept_bytes=0))
    assert isinstance(out.reply, p.MapReply)
    h.unmapped(a, "weights", [c.id for c in out.reply.retired])
    assert h.state.arenas.caps.usage()["uid 1000"] == 0
    Path(h.config.tenant_policy).write_text('[[tenant]]\nuid = 1000\nmax = "64MiB"\n')
    h.state.arenas.caps.reload()
    err = refusal(h, a, p.WakeArena(name="weights"))
    assert (err.detail["used"], err.detail["cap"]) == (0, 64 * MiB)
    Path(h.config.tenant_policy).write_text('[[tenant]]\nuid = 1000\nmax = "128MiB"\n')
    h.state.arenas.caps.reload()
    assert h.ok(a, p.WakeArena(name="weights")).reply.arena.committed == 100 * MiB


def test_a_round_leaves_what_other_tenants_are_guaranteed(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 2000\nmin = "96MiB"\n')
    a, b = h.connect("a", uid=A), h.connect("b", uid=B)
    declare(h, a, "kv")
    join(h, a, "kv")
    capture(h, a, "kv", 1, min_tokens=1024)
    assert commit_reply(done(h)[1]).pool.tokens == (256 - 96) * 256
    h.create(b, "y", 128 * MiB)
    h.commit(b, "y", 96 * MiB)  # there for it when it comes


# --------------------------------------------------------------------------- placeholders


def test_placeholders_count_in_the_cap_and_leave_what_others_are_guaranteed(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    # A placeholder is device memory like a commit's: once it counted nowhere, and arenas
    # of placeholders alone took a capped tenant past its cap and another's minimum away.
    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 1000\nmax = "64MiB"\n[[tenant]]\nuid = 2000\nmin = "64MiB"\n')
    a, b = h.connect("a", uid=A), h.connect("b", uid=B)
    h.create(a, "x", 64 * MiB)
    h.ok(a, p.PlaceholderArena(name="x", slot_bytes=32 * MiB))  # 32 MiB + a granule
    assert h.state.arenas.caps.usage()["uid 1000"] == 32 * MiB + 2 * MiB
    h.create(a, "y", 64 * MiB)
    err = refusal(h, a, p.PlaceholderArena(name="y", slot_bytes=32 * MiB))
    assert (err.detail["tenant"], err.detail["used"]) == ("uid 1000", 34 * MiB)
    assert h.state.arenas.by_name["y"].placeholders == [], "a refused placeholder left chunks behind"
    # Another uid, uncapped, still may not take what uid 2000 is guaranteed.
    c = h.connect("c", uid=C)
    h.create(c, "z", 256 * MiB)
    h.commit(c, "z", 128 * MiB)
    free = h.state.arenas.available_bytes()
    err = refusal(h, c, p.PlaceholderArena(name="z", slot_bytes=32 * MiB))
    assert err.detail["limit"] == "guaranteed minimums" and free - 64 * MiB < 34 * MiB
    h.create(b, "w", 128 * MiB)
    h.commit(b, "w", 64 * MiB)  # the guaranteed tenant still gets all of it


def test_a_kv_ask_leaves_a_tenant_its_guaranteed_minimum(make_harness: Callable[..., Harness], tmp_path: Path) -> None:
    """A pool above its fair share gives back for another tenant's grow only what its
    tenant holds above its guaranteed minimum: memory given back from under it is held
    back for that tenant, and the grower could not have it. Before, b gave 64 MiB, 48 of
    them from under its 112 MiB minimum, and a's grow got nothing of them."""
    from .test_kv_moves import grow_waits, shrink_notices

    h = capped(make_harness, tmp_path, '[[tenant]]\nuid = 2000\nmin = "112MiB"\n')
    a, b = h.connect("a", uid=A), h.connect("b", uid=B)
    declare(h, a, "kva")
    declare(h, b, "kvb")
    join(h, a, "kva")
    join(h, b, "kvb")
    capture(h, a, "kva", 1, min_tokens=1024)
    capture(h, b, "kvb", 2, min_tokens=1024)
    assert {rid: commit_reply(c).pool.tokens for rid, c in done(h).items()} == {1: 32768, 2: 32768}  # 128 MiB each, the device full
    h.ok(b, p.KvDemand(pool="kvb", in_use=0))  # idle: far above its fair share
    grow_waits(h, a, "kva", 49152, 7)  # 64 MiB short
    assert shrink_notices(h) == [(b.id, "kvb", 28672)]  # 16 MiB: b keeps its 112 MiB
    from .test_kv_moves import give_back

    give_back(h, b, "kvb", 28672)
    assert commit_reply(done(h)[7]).pool.tokens == 32768 + 4096  # what b gave: a has it
