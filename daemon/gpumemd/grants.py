"""Who may attach an arena besides its owner: the grant rules, pure functions over the
records.

A grant admits by identity (the uid and gid the kernel reports for the session's fd
channel, SO_PEERCRED, and the client name it said HELLO with, which no live session can
share with another) or by its token, a random capability the owner hands over out of
band. A client name alone stands for that name under the owner's uid, so a name is never
enough to reach another user's memory; the token lifts that implied uid and nothing the
share named itself.
"""

from __future__ import annotations

import hmac
import secrets

from gpumem_shared import protocol as p

from gpumemd.checks import check_name
from gpumemd.records import ArenaRecord, GrantRecord, SessionRecord

# Every share is a new grant: the bound keeps an owner sharing in a loop from growing
# the daemon without end.
MAX_GRANTS = 64
TOKEN_BYTES = 32
# uid_t and gid_t are 32 bits, and (uid_t) -1 means "no id" to the kernel.
_MAX_ID = 0xFFFF_FFFE


def _check_id(value: int, what: str) -> None:
    if not -1 <= value <= _MAX_ID:
        raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"{what} {value} is not valid: 0-{_MAX_ID}, or -1 for any", **{what: value})


def describe(grant: GrantRecord) -> str:
    parts = [f"client '{grant.client}'"] if grant.client else []
    if grant.uid != -1:
        parts.append(f"the owner's uid {grant.uid}" if grant.uid_implied else f"uid {grant.uid}")
    if grant.gid != -1:
        parts.append(f"gid {grant.gid}")
    return " under ".join(parts) if parts else "whoever gives its token"


def _mismatch(grant: GrantRecord, s: SessionRecord, *, by_token: bool) -> str:
    """Why ``grant`` does not admit ``s`` ("" when it does). A token lifts an implied
    uid, never what the share named."""
    if grant.client and grant.client != s.name:
        return f"it names client '{grant.client}'"
    if grant.uid not in (-1, s.uid) and not (by_token and grant.uid_implied):
        return f"it admits uid {grant.uid} only" + (" (the owner's; the owner's token for it admits any uid)" if grant.uid_implied else "")
    if grant.gid not in (-1, s.gid):
        return f"it admits gid {grant.gid} only"
    return ""


def _admits_by_identity(grant: GrantRecord, s: SessionRecord) -> bool:
    names_someone = bool(grant.client) or grant.uid != -1 or grant.gid != -1
    return names_someone and not _mismatch(grant, s, by_token=False)


def by_token(arena: ArenaRecord, token: str) -> GrantRecord | None:
    """Every grant's token is compared, each in constant time: how long the lookup takes
    says nothing about how close a guess came."""
    given = token.encode()
    found = None
    for grant in arena.grants:
        if hmac.compare_digest(grant.token, given):
            found = grant
    return found


def new_grant(arena: ArenaRecord, s: SessionRecord, m: p.ShareArena, grant_id: int) -> GrantRecord:
    """The grant a share by the owner ``s`` makes (checked, not yet added)."""
    if m.client:
        check_name(m.client, "client name")
    _check_id(m.uid, "uid")
    _check_id(m.gid, "gid")
    if len(arena.grants) >= MAX_GRANTS:
        raise p.ProtocolError(
            p.ErrorCode.INVALID_ARGUMENT,
            f"arena '{arena.name}' has {len(arena.grants)} grants, the most it may have; revoke some (unshare) first",
            limit=MAX_GRANTS,
        )
    implied = bool(m.client) and m.uid == -1 and m.gid == -1
    return GrantRecord(
        id=grant_id,
        token=secrets.token_hex(TOKEN_BYTES).encode(),
        client=m.client,
        uid=s.uid if implied else m.uid,
        gid=m.gid,
        uid_implied=implied,
        read_only=m.read_only,
    )


def admit(arena: ArenaRecord, s: SessionRecord, token: str) -> tuple[str, bool]:
    """Why no grant of ``arena`` admits ``s`` ("" when one does: by identity, or the
    grant ``token`` belongs to), and whether every grant that admits it is read-only (one
    that admits it read-write is enough for a writable mapping). The reason never
    repeats the token."""
    grant = by_token(arena, token) if token else None
    admitting = [g for g in arena.grants if _admits_by_identity(g, s)]
    if grant is not None and not _mismatch(grant, s, by_token=True):
        admitting.append(grant)
    if admitting:
        return "", all(g.read_only for g in admitting)
    who = f"client '{s.name}' (uid {s.uid}, gid {s.gid})"
    if token:
        if grant is None:
            return f"the token given matches none of its grants (revoked, or never issued for it); no grant admits {who}", False
        return f"the grant the token belongs to ({describe(grant)}) does not admit {who}: {_mismatch(grant, s, by_token=True)}", False
    named = [g for g in arena.grants if g.client == s.name]
    if named:
        return f"its grant to {describe(named[0])} does not admit {who}: {_mismatch(named[0], s, by_token=False)}", False
    return f"is not shared with {who}: no grant names this client, uid or gid" + ("" if arena.grants else " (it has no grants)"), False
