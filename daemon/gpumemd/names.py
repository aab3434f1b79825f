"""Arena names: each uid has its own (KV pools are arenas), so no uid can take a name
another uid's engine needs.

Inside the daemon an arena is known by its key: its name, or "UID/NAME" when another
uid's arena holds the bare name already ("/" is in no name). A client says a name of its
own uid, or "UID/NAME" for another uid's arena (its grants still decide the attach);
replies carry the key, which the client says from then on. The dispatcher reads every
request's arena name through ``resolve`` before any book sees it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gpumem_shared import protocol as p

from gpumemd.checks import check_name
from gpumemd.records import ArenaRecord, SessionRecord

# A uid is at most ten digits; the name after it is checked as any name is.
_QUALIFIED = re.compile(r"([0-9]{1,10})/(.*)", re.ASCII | re.DOTALL)


def plain_name(key: str) -> str:
    """The name an arena's key holds, without the owner's uid."""
    qualified = _QUALIFIED.fullmatch(key)
    return key if qualified is None else qualified[2]


def key_uid(key: str, owners: Mapping[str, int]) -> int:
    """The uid the arena ``key`` belongs to (``owners``: each arena's owner's uid, where
    a session still tells it); -1 where neither tells it."""
    qualified = _QUALIFIED.fullmatch(key)
    return owners.get(key, -1 if qualified is None else int(qualified[1]))  # a key "UID/NAME" says it too


def resolve(s: SessionRecord, name: str, arenas: Mapping[str, ArenaRecord], owners: Mapping[str, int], *, create: str = "") -> str:
    """The key of the arena ``s`` means by ``name`` (a name it has no arena of: the
    name itself, which the book then finds nothing under); for a create (``create``
    says what the name is called in a refusal), the key the new arena gets. Another
    uid's arena is never reached by its bare name: a process that asks for its own
    uid's ``kv`` before it exists must not be handed another user's."""
    if not create:
        named = arenas.get(name)
        if named is not None and s.id in named.attached:
            return name  # the key the daemon gave this session
    qualified = _QUALIFIED.fullmatch(name)
    uid, plain = (int(qualified[1]), qualified[2]) if qualified else (s.uid, name)
    if create:
        check_name(plain, create)
        if uid != s.uid:
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"arena name '{name}' is one of uid {uid}'s; uid {s.uid} creates arenas under its own names",
                uid=s.uid,
            )
    for key in (plain, f"{uid}/{plain}"):
        if key in arenas and key_uid(key, owners) == uid:
            return key
    if create:
        return plain if plain not in arenas else f"{uid}/{plain}"
    if qualified is None and plain in arenas:
        holder = key_uid(plain, owners)
        whose = f"uid {holder}, as '{holder}/{plain}'" if holder >= 0 else "a uid no session names since a restart"
        raise p.ProtocolError(
            p.ErrorCode.NOT_FOUND,
            f"uid {s.uid} has no arena named '{plain}'; the one of that name belongs to {whose}: another uid's arena "
            "is named with its owner's uid, and attached through a grant of its owner's",
            arena=plain,
            owner_uid=holder,
        )
    return name
