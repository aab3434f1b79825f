"""Tenants by token (memory_caps.py): sessions of one uid that present different tenant tokens at
HELLO are held to separate caps, one that presents none to its uid's rule, and one whose
token no rule names is refused at HELLO; the daemon keeps the token's SHA-256 only, and
no refusal, status, metric or log line carries the token or its digest."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode
from gpumemd.memory_caps import PolicyError, read_policy, token_digest
from gpumemd.metrics import Metrics

from .harness import Harness, MiB
from .store_kit import restarted
from .test_memory_caps import capped, policy, refusal, sha, token_rules
from .test_metrics import fresh, labelled, number

UID = 1000  # every engine pod runs as this uid
ALPHA, BETA, GAMMA = "alpha-4f1b0c9e2d7a8b63f5e1d0c2", "beta-9a8b7c6d5e4f3a2b1c0d9e8f", "gamma-0d1c2b3a4f5e6d7c8b9a"


POLICY = token_rules((ALPHA, "team-a", "64MiB"), (BETA, "team-b", "32MiB")) + f'[[tenant]]\nuid = {UID}\nmax = "16MiB"\n'


@pytest.fixture
def h(make_harness: Callable[..., Harness], tmp_path: Path) -> Harness:
    return capped(make_harness, tmp_path, POLICY)


def leaks(text: str) -> list[str]:
    """The secrets (and their digests) ``text`` carries."""
    return [s for t in (ALPHA, BETA, GAMMA, "wrong-token-0123456789") for s in (t, sha(t)) if s in text]


# --------------------------------------------------------------------------- the policy


def test_a_token_rule_is_named_by_its_digest_and_a_name_in_toml_json_and_claims(tmp_path: Path) -> None:
    doc = {"tenant": [{"token_sha256": sha(ALPHA), "name": "team-a", "max": "64MiB", "min": "8MiB"}]}
    claims = tmp_path / "claims"
    (claims / "7d0e-claim").mkdir(parents=True)
    (claims / "7d0e-claim" / "tenant.json").write_text(json.dumps({"token_sha256": sha(GAMMA), "bytes": 32 * MiB}))
    for path in (policy(tmp_path, POLICY), policy(tmp_path, json.dumps(doc), "tenants.json")):
        pol = read_policy(path, str(claims))
        name, rule = pol.tokens[token_digest(ALPHA)]
        assert (name, rule.max_bytes) == ("team-a", 64 * MiB)
        # A claim's token tenant is named after its claim unless it says a name.
        assert pol.tokens[token_digest(GAMMA)][0] == "7d0e-claim"
        assert pol.account(UID, UID, token_digest(ALPHA)) == ("token team-a", rule)
        assert pol.account(UID, UID, token_digest(GAMMA))[0] == "token 7d0e-claim"  # type: ignore[index]
        assert pol.knows(token_digest(ALPHA)) and not pol.knows(token_digest("wrong-token-0123456789"))


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (f'[[tenant]]\ntoken_sha256 = "{sha(ALPHA)}"\nmax = 1\n', "has a 'name'"),
        (f'[[tenant]]\ntoken_sha256 = "{sha(ALPHA)}"\nname = "a b"\nmax = 1\n', "has a 'name'"),
        ('[[tenant]]\nuid = 5\nname = "x"\nmax = 1\n', "'name' names a token's tenant"),
        (f'[[tenant]]\ntoken_sha256 = "{sha(ALPHA)}"\nuid = 5\nname = "x"\nmax = 1\n', "exactly one of"),
        (f'[[tenant]]\ntoken_sha256 = "{sha(ALPHA)}"\nname = "a"\nmax = 1\n[[tenant]]\ntoken_sha256 = "{sha(ALPHA)}"\nname = "b"\nmax = 1\n',
         "token b .* has the same token as token a"),
        (f'[[tenant]]\ntoken_sha256 = "{sha(ALPHA)}"\nname = "a"\nmax = 1\n[[tenant]]\ntoken_sha256 = "{sha(BETA)}"\nname = "a"\nmax = 1\n',
         "token a has a cap in"),
    ],
)
def test_a_bad_token_rule_is_refused_naming_the_entry(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(PolicyError, match=named):
        read_policy(policy(tmp_path, text), "")


def test_a_token_put_where_its_digest_goes_is_not_echoed_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        read_policy(policy(tmp_path, f'[[tenant]]\ntoken_sha256 = "{ALPHA}"\nname = "a"\nmax = 1\n'), "")
    assert "64 lowercase hex digits" in str(info.value) and not leaks(str(info.value))


# --------------------------------------------------------------------------- sessions


def test_one_uid_with_two_tokens_is_two_tenants_and_without_one_its_uids(h: Harness) -> None:
    a, b, plain = h.connect("a", uid=UID, tenant_token=ALPHA), h.connect("b", uid=UID, tenant_token=BETA), h.connect("plain", uid=UID)
    for s, name in ((a, "x"), (b, "y"), (plain, "z")):
        h.create(s, name, 128 * MiB)
    h.commit(a, "x", 64 * MiB)
    err = refusal(h, a, p.CommitArena(name="x", nbytes=66 * MiB))
    assert err.detail == {"limit": "device memory", "tenant": "token team-a", "used": 64 * MiB, "cap": 64 * MiB}
    # team-a's 64 MiB are not team-b's, nor the uid's.
    h.commit(b, "y", 32 * MiB)
    assert refusal(h, b, p.CommitArena(name="y", nbytes=34 * MiB)).detail["tenant"] == "token team-b"
    h.commit(plain, "z", 16 * MiB)
    assert refusal(h, plain, p.CommitArena(name="z", nbytes=18 * MiB)).detail["tenant"] == f"uid {UID}"
    assert h.state.arenas.caps.usage() == {"token team-a": 64 * MiB, "token team-b": 32 * MiB, f"uid {UID}": 16 * MiB}


def test_an_unknown_token_is_refused_at_hello_naming_no_secret(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    before = dict(h.state.sessions)
    with pytest.raises(p.ProtocolError) as info:
        h.connect("intruder", uid=UID, tenant_token="wrong-token-0123456789")
    assert info.value.code == ErrorCode.PERMISSION_DENIED
    assert "names no tenant" in info.value.message and "--tenant-policy" in info.value.message
    assert not leaks(info.value.message + json.dumps(info.value.detail))
    assert h.state.sessions == before, "a refused HELLO left a session"
    # The name is free again: nothing of the refused session stays.
    assert h.connect("intruder", uid=UID).name == "intruder"
    assert "HELLO of client 'intruder' (pid" in caplog.text and "refused" in caplog.text
    assert not leaks(caplog.text)


def test_a_token_without_any_policy_is_refused(make_harness: Callable[..., Harness]) -> None:
    with pytest.raises(p.ProtocolError) as info:
        make_harness().connect("a", tenant_token=ALPHA)
    assert info.value.code == ErrorCode.PERMISSION_DENIED


def test_the_session_keeps_the_digest_and_status_metrics_and_logs_show_the_name(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    a = h.connect("a", uid=UID, tenant_token=ALPHA)
    h.connect("plain", uid=UID)
    assert a.tenant_key == token_digest(ALPHA) and ALPHA not in repr(a)
    h.create(a, "x", 128 * MiB)
    h.commit(a, "x", 8 * MiB)
    status = h.state.status()
    assert {c.name: c.tenant for c in status.clients} == {"a": "token team-a", "plain": f"uid {UID}"}
    rows = {t.tenant: (t.used_bytes, t.max_bytes) for t in status.tenants}
    assert rows == {"token team-a": (8 * MiB, 64 * MiB), "token team-b": (0, 32 * MiB), f"uid {UID}": (0, 16 * MiB)}
    snap = fresh(Metrics(h.state))
    assert number(snap, "gpumemd_tenant_used_bytes", tenant="token team-a") == 8 * MiB
    wire = msgspec.json.encode(p.to_wire(status)).decode()
    assert not leaks(wire) and not leaks(repr(labelled(snap, "gpumemd_tenant_cap_bytes")))
    assert "tenant token team-a" in caplog.text and not leaks(caplog.text)


def test_a_token_the_reload_takes_out_counts_as_none_and_its_session_goes_on(h: Harness) -> None:
    a = h.connect("a", uid=UID, tenant_token=ALPHA)
    h.create(a, "x", 128 * MiB)
    h.commit(a, "x", 8 * MiB)
    Path(h.config.tenant_policy).write_text(f'[[tenant]]\nuid = {UID}\nmax = "16MiB"\n')
    assert h.state.arenas.caps.reload() is None
    # Its arena counts against the uid's rule now; the session was admitted and stays.
    assert h.state.arenas.caps.usage() == {f"uid {UID}": 8 * MiB}
    assert refusal(h, a, p.CommitArena(name="x", nbytes=18 * MiB)).detail["tenant"] == f"uid {UID}"
    # A new session presenting it is refused.
    with pytest.raises(p.ProtocolError) as info:
        h.connect("b", uid=UID, tenant_token=ALPHA)
    assert info.value.code == ErrorCode.PERMISSION_DENIED


def test_a_shared_arena_counts_against_its_owners_token_tenant_not_the_attacher(h: Harness) -> None:
    a, b = h.connect("a", uid=UID, tenant_token=ALPHA), h.connect("b", uid=UID, tenant_token=BETA)
    h.create(a, "x", 128 * MiB)
    h.share(a, "x", "b")
    h.attach(b, "x")
    h.commit(a, "x", 48 * MiB)
    assert h.state.arenas.caps.usage()["token team-a"] == 48 * MiB
    assert h.state.arenas.caps.usage()["token team-b"] == 0


def test_a_session_kept_across_a_restart_counts_against_its_token_tenant_still(h: Harness) -> None:
    a = h.connect("a", uid=UID, tenant_token=ALPHA)
    h.create(a, "x", 128 * MiB)
    h.commit(a, "x", 48 * MiB)
    with restarted(h) as again:
        assert again.sessions[a.id].tenant_key == token_digest(ALPHA)
        assert again.arenas.caps.usage()["token team-a"] == 48 * MiB
        assert {c.name: c.tenant for c in again.status().clients} == {"a": "token team-a"}
