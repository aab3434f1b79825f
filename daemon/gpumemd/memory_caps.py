"""Memory caps: the most device bytes an account may hold, and the least it is
guaranteed, from an operator's policy.

An account is what a policy entry names, and what the policy file, status, metrics and
refusals call a tenant ("token NAME", "uid N", "gid N"; not tenants.py's tenant, which is
always a uid): a tenant token (every session that presented it at HELLO, whatever its
uid: pods that all run as one uid are accounts apart), a uid, a gid (every uid whose
sessions say that group shares one cap), or, for a uid named by no rule, the policy's
default (each uid on its own). The policy names a token by its SHA-256 and a name of its
own, and the daemon keeps no more than that: a session's token is hashed at HELLO,
compared in constant time against the policy's, and refused (PERMISSION_DENIED, naming
no secret) when no rule names it; the session then keeps only the hash. An account's use
is counted from the arena book itself (the chunks of the arenas its sessions own,
retiring ones and placeholders included: a client still maps them), so nothing here can
drift from what the device holds. Every chunk the daemon creates for a client (commit,
KV grow, KV round, a round's staged minimum, a wake, a placeholder) passes ``check``
first, all of a request's chunks at once: an account's use never passes its maximum,
and no commit of one account eats into what another is guaranteed and does not hold
yet. Refusals are RESOURCE_EXHAUSTED and name the cap, the account and its use.

Caps change at run time (``reload``: SIGHUP). A lowered maximum refuses new chunks from
then on; memory already held is not taken away: an account above its new maximum keeps what
it holds (KV pools included: no shrink is asked for) and commits nothing until its use is
under the maximum again.

Where the rules come from: a policy file (``--tenant-policy``, TOML or JSON) and a
directory of claims (``--tenant-claims``) that a Kubernetes DRA driver writes, one
subdirectory per ResourceClaim with a ``tenant.json`` naming the account and the bytes
the claim consumed (docs/architecture.md, "Kubernetes DRA"). The claims are read again
when the directory's listing changes (``claims_changed``, asked on the loop's tick): a
driver in another pod has no way to signal the daemon.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from gpumem_shared import protocol as p
from gpumem_shared.units import format_size, parse_size

from gpumemd.records import ArenaRecord, ChunkRecord

log = logging.getLogger("gpumemd.memory_caps")

CLAIM_FILE = "tenant.json"
# A token rule's name: what status, metrics and refusals call the account ("token NAME").
_TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII)
_SHA256_HEX = re.compile(r"[0-9a-f]{64}", re.ASCII)


def token_digest(token: str) -> bytes:
    """What the daemon keeps of a tenant token: its SHA-256 (a token is a random secret,
    so its hash names it and cannot be turned back into it)."""
    return hashlib.sha256(token.encode()).digest()


class PolicyError(Exception):
    """A policy that cannot be applied; the message names the file and the entry."""


@dataclasses.dataclass(frozen=True)
class Rule:
    max_bytes: int | None  # None: no maximum
    min_bytes: int
    source: str  # the file (and entry) that said it


@dataclasses.dataclass(frozen=True)
class Policy:
    uids: Mapping[int, Rule] = dataclasses.field(default_factory=dict)
    gids: Mapping[int, Rule] = dataclasses.field(default_factory=dict)
    default: Rule | None = None
    tokens: Mapping[bytes, tuple[str, Rule]] = dataclasses.field(default_factory=dict)  # digest -> (name, rule)

    def knows(self, digest: bytes) -> bool:
        """Whether a rule names the token of ``digest``: every digest compared, each in
        constant time, so the time taken tells nothing of how near a guess came."""
        found = False
        for known in self.tokens:
            found |= hmac.compare_digest(known, digest)
        return found

    def account(self, uid: int, gid: int, token: bytes = b"") -> tuple[str, Rule] | None:
        """The account a session of ``uid``/``gid`` (and the tenant token of digest
        ``token``) counts against, and its rule: its token's rule first, then its uid's,
        its group's, the default last; None: no cap. A token no rule names any more (a
        reload took it out) counts as no token."""
        named = self.tokens.get(token) if token else None
        if named is not None:
            return f"token {named[0]}", named[1]
        rule = self.uids.get(uid)
        if rule is not None:
            return f"uid {uid}", rule
        rule = self.gids.get(gid)
        if rule is not None:
            return f"gid {gid}", rule
        if self.default is not None and uid >= 0:
            return f"uid {uid}", self.default
        return None


def _size(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PolicyError(f"{where}: a size is a number of bytes or a string such as '40GiB', not {value!r}")
    try:
        n = value if isinstance(value, int) else parse_size(value)
    except ValueError as exc:
        raise PolicyError(f"{where}: {exc}") from None
    if n < 0:
        raise PolicyError(f"{where}: a size cannot be negative ({value!r})")
    return n


def _rule(entry: Mapping[str, Any], where: str, max_key: str = "max", min_key: str = "min") -> Rule:
    max_bytes = _size(entry[max_key], f"{where} '{max_key}'") if max_key in entry else None
    min_bytes = _size(entry[min_key], f"{where} '{min_key}'") if min_key in entry else 0
    if max_bytes is not None and min_bytes > max_bytes:
        raise PolicyError(f"{where}: its minimum {format_size(min_bytes)} is above its maximum {format_size(max_bytes)}")
    return Rule(max_bytes, min_bytes, where)


def _who(entry: Mapping[str, Any], where: str, default_name: str = "") -> tuple[str, int | tuple[bytes, str]]:
    """Whom ``entry`` caps: ("uid" or "gid", the number), or ("token", (digest, name))."""
    named = [key for key in ("uid", "gid", "token_sha256") if key in entry]
    if len(named) != 1:
        raise PolicyError(f"{where}: a tenant is named by exactly one of 'uid' or 'gid' (a number) or 'token_sha256'")
    if named == ["token_sha256"]:
        # The value is never echoed: an operator who put the token itself here must not
        # find it in the daemon's log.
        digest = entry["token_sha256"]
        if not isinstance(digest, str) or _SHA256_HEX.fullmatch(digest) is None:
            raise PolicyError(f"{where}: 'token_sha256' is the token's SHA-256, 64 lowercase hex digits (printf %s TOKEN | sha256sum)")
        name = entry.get("name", default_name)
        if not isinstance(name, str) or _TOKEN_NAME.fullmatch(name) is None:
            raise PolicyError(f"{where}: a token's tenant has a 'name' (letters, digits, '.', '_', '-'; at most 63), what status shows")
        return "token", (bytes.fromhex(digest), name)
    if "name" in entry:
        raise PolicyError(f"{where}: 'name' names a token's tenant; a uid or gid is its own name")
    if isinstance(entry[named[0]], bool) or not isinstance(entry[named[0]], int) or entry[named[0]] < 0:
        raise PolicyError(f"{where}: a tenant is named by exactly one of 'uid' or 'gid' (a number) or 'token_sha256'")
    return named[0], entry[named[0]]


class _Builder:
    def __init__(self) -> None:
        self.rules: dict[str, dict[int, Rule]] = {"uid": {}, "gid": {}}
        self.tokens: dict[bytes, tuple[str, Rule]] = {}
        self.default: Rule | None = None

    def add(self, kind: str, ident: int | tuple[bytes, str], rule: Rule) -> None:
        if isinstance(ident, tuple):
            self._add_token(*ident, rule)
            return
        held = self.rules[kind].get(ident)
        if held is not None:
            raise PolicyError(f"{kind} {ident} has a cap in {held.source} and again in {rule.source}; name each tenant once")
        self.rules[kind][ident] = rule

    def _add_token(self, digest: bytes, name: str, rule: Rule) -> None:
        held = self.tokens.get(digest)
        if held is not None:
            raise PolicyError(
                f"token {name} ({rule.source}) has the same token as token {held[0]} ({held[1].source}); give each tenant its own token"
            )
        same = next((r for n, r in self.tokens.values() if n == name), None)
        if same is not None:
            raise PolicyError(f"token {name} has a cap in {same.source} and again in {rule.source}; name each tenant once")
        self.tokens[digest] = (name, rule)

    def policy(self) -> Policy:
        return Policy(self.rules["uid"], self.rules["gid"], self.default, self.tokens)


def _read_file(path: Path, into: _Builder) -> None:
    try:
        text = path.read_text()
        doc: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError and json's are ValueErrors
        raise PolicyError(f"cannot read the tenant policy {path}: {exc}") from None
    if not isinstance(doc, dict) or set(doc) - {"tenant", "default"}:
        raise PolicyError(f"{path}: the policy holds 'tenant' (a list of caps) and 'default' (one cap), nothing else")
    entries = doc.get("tenant", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise PolicyError(f"{path}: 'tenant' is a list of tables ([[tenant]] in TOML)")
    for i, entry in enumerate(entries):
        where = f"{path} tenant #{i + 1}"
        keys = {"uid", "gid", "token_sha256", "name", "max", "min"}
        if set(entry) - keys:
            raise PolicyError(f"{where}: unknown keys {sorted(set(entry) - keys)}")
        kind, ident = _who(entry, where)
        into.add(kind, ident, _rule(entry, where))
    default = doc.get("default")
    if default is not None:
        if not isinstance(default, dict) or set(default) - {"max", "min"}:
            raise PolicyError(f"{path} default: a table of 'max' and 'min'")
        into.default = _rule(default, f"{path} default")


def _read_claims(root: Path, into: _Builder) -> None:
    """One subdirectory per DRA ResourceClaim; its tenant.json says
    {"uid": N or "gid": N or "token_sha256": HEX (and "name", default: the claim's),
    "bytes": consumed, "min_bytes": guaranteed (default: bytes)}.
    A subdirectory without the file is a claim the driver is still preparing."""
    try:
        claims = sorted(d for d in root.iterdir() if d.is_dir())
    except OSError as exc:
        raise PolicyError(f"cannot read the claims directory {root}: {exc}") from None
    for claim in claims:
        path = claim / CLAIM_FILE
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise PolicyError(f"cannot read the claim {path}: {exc}") from None
        if not isinstance(entry, dict) or "bytes" not in entry or set(entry) - {"uid", "gid", "token_sha256", "name", "bytes", "min_bytes"}:
            raise PolicyError(f"{path}: a claim holds 'uid', 'gid' or 'token_sha256' (and 'name'), 'bytes' and optionally 'min_bytes'")
        kind, ident = _who(entry, str(path), claim.name)
        rule = _rule(entry, f"claim {claim.name}", "bytes", "min_bytes" if "min_bytes" in entry else "bytes")
        into.add(kind, ident, rule)


def _claims_listing(claims_dir: str) -> tuple[tuple[str, int, int, int], ...]:
    """What the claims directory holds, cheap enough to take every tick: each claim's
    name and its tenant.json's inode, change time and size (-1: not written yet). A driver
    puts the file in place by rename, so a new one is a new inode, even within one tick of
    the file system's clock. An unreadable directory lists as empty (the read says why)."""
    if not claims_dir:
        return ()
    out = []
    try:
        with os.scandir(claims_dir) as entries:
            claims = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return ()
    for name in sorted(claims):
        try:
            st = os.stat(os.path.join(claims_dir, name, CLAIM_FILE))
            out.append((name, st.st_ino, st.st_ctime_ns, st.st_size))
        except OSError:
            out.append((name, -1, -1, -1))
    return tuple(out)


def read_policy(policy_file: str, claims_dir: str) -> Policy:
    """The caps the files say now (no file named: no caps). Raises PolicyError."""
    builder = _Builder()
    if policy_file:
        _read_file(Path(policy_file), builder)
    if claims_dir:
        _read_claims(Path(claims_dir), builder)
    return builder.policy()


def _refuse(account: str, rule: Rule, detail: str, used: int, cap: int) -> p.ProtocolError:
    return p.ProtocolError(
        p.ErrorCode.RESOURCE_EXHAUSTED,
        f"{account} {detail} (its cap from {rule.source}); release some first, or ask the operator to raise the cap",
        limit="device memory",
        tenant=account,
        used=used,
        cap=cap,
    )


class Caps:
    """The policy in force and the checks against it. ``arenas`` and ``retiring`` are the
    arena book's own dicts; ``owners``/``groups``/``tokens`` the uid, gid and tenant
    token digest each arena counts against (tenants.Tenants)."""

    def __init__(
        self,
        policy_file: str,
        claims_dir: str,
        arenas: Mapping[str, ArenaRecord],
        retiring: Mapping[int, ChunkRecord],
        owners: Mapping[str, int],
        groups: Mapping[str, int],
        tokens: Mapping[str, bytes],
    ) -> None:
        self.policy_file, self.claims_dir = policy_file, claims_dir
        self._arenas, self._retiring, self._owners, self._groups = arenas, retiring, owners, groups
        self._tokens = tokens
        self._claims_seen = _claims_listing(claims_dir)  # before the read: a change during it is seen next time
        self.policy = read_policy(policy_file, claims_dir)  # at start, an error stops the daemon

    def admit(self, token: str, who: str) -> bytes:
        """The digest a session that presented ``token`` at HELLO keeps (b"": none), or
        PERMISSION_DENIED when no rule names it (logged, naming ``who``: a stream of them is
        someone guessing). The refusal names neither the token nor its digest: whoever
        holds a wrong one learns nothing from it."""
        if not token:
            return b""
        digest = token_digest(token)
        if not self.policy.knows(digest):
            log.warning("HELLO of %s refused: its tenant token names no tenant in the caps", who)
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                "the tenant token this client presented names no tenant in gpumemd's caps (--tenant-policy, "
                "--tenant-claims); check the token file the engine reads, and that its claim is prepared on this GPU's daemon",
            )
        return digest

    def session_account(self, uid: int, gid: int, token: bytes) -> str:
        """The capped account a session counts against, as status names it ("": none)."""
        found = self.policy.account(uid, gid, token)
        return "" if found is None else found[0]

    def claims_changed(self) -> bool:
        """Whether a claim came, went or had its tenant.json replaced since the caps were
        last read (the loop then reloads): a DRA driver's node plugin runs in a pod of its
        own, in a pid namespace that cannot signal the daemon."""
        return bool(self.claims_dir) and _claims_listing(self.claims_dir) != self._claims_seen

    def reload(self) -> str | None:
        """Read the files again; on an error the policy in force stays (and is not read
        again for the claims until they change). Returns the error."""
        self._claims_seen = _claims_listing(self.claims_dir)
        try:
            self.policy = read_policy(self.policy_file, self.claims_dir)
        except PolicyError as exc:
            log.error("tenant caps not reloaded, the previous ones stay in force: %s", exc)
            return str(exc)
        log.info("tenant caps reloaded: %s", "; ".join(self.describe()) or "none")
        return None

    def describe(self) -> list[str]:
        out = []
        for account, rule in self.rules():
            top = "no maximum" if rule.max_bytes is None else f"max {format_size(rule.max_bytes)}"
            out.append(f"{account}: {top}, min {format_size(rule.min_bytes)}")
        return out

    def rules(self) -> list[tuple[str, Rule]]:
        pol = self.policy
        named = [(f"token {n}", r) for n, r in sorted(pol.tokens.values(), key=lambda t: t[0])]
        named += [(f"uid {u}", r) for u, r in sorted(pol.uids.items())] + [(f"gid {g}", r) for g, r in sorted(pol.gids.items())]
        return named + ([("default", pol.default)] if pol.default is not None else [])

    def status(self) -> list[p.TenantCapStatus]:
        """Every account the policy names, and each uid under the default that holds memory."""
        used = self.usage()
        rules = {t: r for t, r in self.rules() if t != "default"}
        out = []
        for account in {**rules, **used}:
            rule = rules.get(account, self.policy.default)
            if rule is not None:
                out.append(
                    p.TenantCapStatus(
                        tenant=account,
                        max_bytes=-1 if rule.max_bytes is None else rule.max_bytes,
                        min_bytes=rule.min_bytes,
                        used_bytes=used.get(account, 0),
                        source=rule.source,
                    )
                )
        return out

    def account_of(self, arena: str) -> tuple[str, Rule] | None:
        uid = self._owners.get(arena)
        return None if uid is None else self.policy.account(uid, self._groups.get(arena, -1), self._tokens.get(arena, b""))

    def tenant(self, arena: str) -> str:
        """Whom ``arena`` counts against, for what is shared out among tenants (KV weights
        and minimums): its capped account, else its owner's uid."""
        found = self.account_of(arena)
        return found[0] if found is not None else f"uid {self._owners.get(arena, -1)}"

    def usage(self) -> dict[str, int]:
        """Device bytes each capped account holds now (every account the policy names, and
        each uid under the default that holds any)."""
        used = {account: 0 for account, _ in self.rules() if account != "default"}
        found: tuple[str, Rule] | None
        for arena in self._arenas.values():
            found = self.account_of(arena.name)
            if found is not None:
                used[found[0]] = used.get(found[0], 0) + sum(c.size for c in arena.chunks + arena.placeholders)
        for chunk in self._retiring.values():  # an arena is destroyed once no one maps any of it
            found = self.account_of(chunk.arena)
            if found is not None:
                used[found[0]] = used.get(found[0], 0) + chunk.size
        return used

    def check_move(self, arenas: list[ArenaRecord], uid: int, gid: int, token: bytes, what: str) -> None:
        """Before ``arenas`` change owner to a session of ``uid``/``gid``/``token`` (an
        adoption): what they hold (placeholders and retiring chunks included) counts
        against the new owner's account from then on, so a move past its maximum is
        refused as a commit would be. Nothing is created: no minimum is at stake."""
        found = self.policy.account(uid, gid, token)
        cap = None if found is None else found[1].max_bytes
        if found is None or cap is None:
            return
        account, rule = found
        names = {a.name for a in arenas if (self.account_of(a.name) or ("",))[0] != account}
        moving = sum(c.size for a in arenas if a.name in names for c in a.chunks + a.placeholders)
        moving += sum(c.size for c in self._retiring.values() if c.arena in names)
        held = self.usage().get(account, 0) if moving else 0
        if moving and held + moving > cap:
            detail = (
                f"holds {format_size(held)} of device memory; {what} would add the {format_size(moving)} it holds and pass "
                f"its cap of {format_size(cap)}"
            )
            raise _refuse(account, rule, detail, held, cap)

    def room(self, arena: ArenaRecord) -> int | None:
        """What the account of ``arena`` may still commit under its maximum; None: no maximum."""
        found = self.account_of(arena.name)
        if found is None or found[1].max_bytes is None:
            return None
        return max(0, found[1].max_bytes - self.usage().get(found[0], 0))

    def held_back(self, takers: Iterable[str] = ()) -> int:
        """What accounts other than ``takers`` are guaranteed and do not hold yet: no one
        else may commit it."""
        skip = set(takers)
        owed = [(t, r) for t, r in self._guaranteed() if t not in skip]
        if not owed:  # no book walk on the common path: no minimums at all
            return 0
        used = self.usage()
        return sum(max(0, rule.min_bytes - used.get(account, 0)) for account, rule in owed)

    def _guaranteed(self) -> list[tuple[str, Rule]]:
        # The default's minimum is each uid's that holds something under it; a uid with
        # no session has nothing to keep memory back for.
        named = [(t, r) for t, r in self.rules() if t != "default" and r.min_bytes]
        default = self.policy.default
        if default is not None and default.min_bytes:
            seen = {t for t, _ in named}
            for arena in self._arenas:
                found = self.account_of(arena)
                if found is not None and found[1] is default and found[0] not in seen:
                    seen.add(found[0])
                    named.append((found[0], default))
        return named

    def accounts_of(self, work: Iterable[tuple[ArenaRecord, int, int]]) -> dict[str, tuple[Rule, int]]:
        """The bytes ``work`` (arena, offset, size) would add per capped account."""
        out: dict[str, tuple[Rule, int]] = {}
        for arena, _, size in work:
            found = self.account_of(arena.name)
            if found is not None:
                account, rule = found
                out[account] = (rule, out.get(account, (rule, 0))[1] + size)
        return out

    def check(self, work: list[tuple[ArenaRecord, int, int]], available: Callable[[], int]) -> None:
        """Before chunks for ``work`` are created: no account past its maximum, and no
        other account's guaranteed minimum taken (``available``: what the device has free
        for commits now, the reserve taken off; measured only where a minimum is owed)."""
        adding = self.accounts_of(work)
        used = self.usage() if adding else {}
        for account, (rule, size) in adding.items():
            held = used.get(account, 0)
            if rule.max_bytes is not None and held + size > rule.max_bytes:
                detail = (
                    f"holds {format_size(held)} of device memory; {format_size(size)} more would pass its cap of "
                    f"{format_size(rule.max_bytes)}"
                )
                raise _refuse(account, rule, detail, held, rule.max_bytes)
        held_back = self.held_back(adding)
        need = sum(size for _, _, size in work)
        free = available() if held_back else 0
        if held_back and need + held_back > free:
            raise p.ProtocolError(
                p.ErrorCode.RESOURCE_EXHAUSTED,
                f"{format_size(need)} more would take memory other tenants are guaranteed: {format_size(free)} is free "
                f"for commits and {format_size(held_back)} of it is held back for their minimums (--tenant-policy)",
                limit="guaranteed minimums",
                requested=need,
                available=free,
                held_back=held_back,
            )
