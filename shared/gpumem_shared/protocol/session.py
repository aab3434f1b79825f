"""A session: HELLO opens it, RESUME brings it back after a daemon restart, PING needs
none; and what the daemon sends it on the fd channel (FD_BATCH, NOTICE)."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from gpumem_shared.protocol.base import Ack, DeviceInfo, Message, RequestMessage
from gpumem_shared.protocol.codes import (
    MAX_HELD_CHUNKS, MAX_HOLDINGS, MAX_PENDING, MAX_TENANT_TOKEN, RESUME_CREDENTIAL_BYTES, Backend, MsgType, NoticeKind,
)


class HelloReply(Message):
    protocol: list[int]
    daemon_version: str
    daemon_pid: int
    session_id: int
    token: bytes  # the session's ZeroMQ routing id; proves the session on the control channel
    backend: Backend
    device: DeviceInfo
    # Deprecated since 1.3, always 0: the size of the lease table that rode with HELLO.
    # Lease slots now come one per graph pool, in a segment granted with the pool.
    lease_slots: int = 0
    # Since 1.4. What RESUME proves the session with after a daemon restart (with
    # SO_PEERCRED: the same process); empty where the daemon keeps nothing across one
    # (no fd store), and the session then ends with the daemon.
    credential: bytes = b""
    generation: int = 0  # the daemon's restarts with its state kept (0: a fresh start)


class Hello(RequestMessage, kw_only=True):
    """First message on the fd channel; opens the session. Credentials come from SO_PEERCRED.
    On the control channel it is refused like an unknown type, so the admission rules
    there keep their defaults."""

    TYPE = MsgType.HELLO
    REPLY = HelloReply
    # Unique among live sessions (ALREADY_EXISTS names the holder): arena shares name it.
    name: str
    client_version: str = ""
    # Since 1.9: its own pid, as its pid namespace numbers it. SO_PEERCRED gives the
    # daemon's view of it instead (0 from outside the daemon's namespace): this one is
    # shown beside it, and is the pid its lease words carry. Linux's pids stay below 2**22
    # (PID_MAX_LIMIT): a larger one is no pid, and would not fit a lease word's field.
    pid: Annotated[int, msgspec.Meta(ge=0, lt=1 << 22)] = 0
    # Since 1.11: the secret that names this session's tenant in the daemon's cap policy
    # ("" : none; the tenant is its uid's or gid's). A daemon before 1.11 ignores it, so
    # the client refuses such a daemon when it has a token to present.
    tenant_token: Annotated[str, msgspec.Meta(max_length=MAX_TENANT_TOKEN)] = ""


class Holding(Message):
    """An arena's chunks a resuming client maps (placeholders and retired ones included)."""

    arena: str
    chunks: Annotated[list[int], msgspec.Meta(max_length=MAX_HELD_CHUNKS)]


class Resume(RequestMessage, kw_only=True):
    """Since 1.4: first message on a new fd channel, instead of HELLO, from a client whose
    daemon restarted: the session comes back with its ids, token and objects. The
    credential HELLO returned, from the uid and gid that opened the session (SO_PEERCRED;
    and its pid, where the daemon saw one both times). ``holdings``
    say which chunks the client maps. Since 1.5, ``pending`` names the requests it sends
    again (no reply, or one whose descriptors were lost): those the daemon before had
    answered get that answer again, with the chunks of it the client does not map."""

    TYPE = MsgType.RESUME
    REPLY = HelloReply
    session_id: int
    credential: Annotated[bytes, msgspec.Meta(min_length=RESUME_CREDENTIAL_BYTES, max_length=RESUME_CREDENTIAL_BYTES)]
    holdings: Annotated[list[Holding], msgspec.Meta(max_length=MAX_HOLDINGS)] = msgspec.field(default_factory=list)
    client_version: str = ""
    pending: Annotated[list[int], msgspec.Meta(max_length=MAX_PENDING)] = msgspec.field(default_factory=list)


class Ping(RequestMessage, kw_only=True):
    """No-op round trip; needs no session."""

    TYPE = MsgType.PING
    REPLY = Ack
    NEEDS_SESSION = False
    WHILE_STOPPING = True


# fd channel, daemon -> client. Not requests: they carry no reply.


class FdBatch(Message):
    """One descriptor per id, in order, as SCM_RIGHTS: chunk ids, or, for a graph pool's
    lease segment (GraphPoolReply), the pool's id."""

    TYPE: ClassVar[MsgType] = MsgType.FD_BATCH
    request_id: int = 0
    chunk_ids: list[int] = msgspec.field(default_factory=list)


class Notice(Message):
    """Unsolicited news for a session (see NoticeKind)."""

    TYPE: ClassVar[MsgType] = MsgType.NOTICE
    kind: NoticeKind
    message: str = ""
    arena: str = ""
    tokens: int = 0  # kv-shrink: the bound the daemon asks the pool to shrink to
