"""The gpumemd wire protocol: every message, the envelopes, the error codes.

Both the daemon and its clients import this package; it depends on the standard
library and msgspec only, so nothing here can drag torch, zmq or CUDA into a peer.

Transport (see docs/protocol.md):
- control channel, ZeroMQ DEALER -> ROUTER at ``<runtime>/gpu<N>.zmq``: one frame
  per request and per reply, each a msgpack map (the envelope below);
- fd channel, AF_UNIX SOCK_SEQPACKET at ``<runtime>/gpu<N>.fd``: the HELLO that opens
  a session, then daemon -> client FD_BATCH messages (file descriptors ride as
  SCM_RIGHTS) and NOTICE messages. The connection *is* the session: when it closes,
  the daemon releases everything the client alone held.

Request envelope: ``{"v": [major, minor], "id": int, "t": MsgType, "b": {fields}}``.
Reply envelope:   ``{"v": [major, minor], "id": int, "ok": bool, "code": ErrorCode,
                     "msg": str, "detail": {str: int|str}, "b": {fields}}``.

The protocol version moves apart from the package version: the major is bumped by
any incompatible change, the minor by compatible ones (new optional fields, new
message types). Peers with different majors refuse each other at HELLO. Messages are
maps with named fields, so a newer minor can add fields that an older peer ignores;
every field is sent, defaults included, because an older minor may require it.
Error codes are append-only: a number, once shipped, never changes meaning.

A minor may raise the oldest minor HELLO accepts (``MIN_HELLO_VERSION``), only where
serving an older peer would be unsafe; both sides then refuse each other at HELLO with
PROTOCOL_MISMATCH. 1.3 does: leases moved from one table every session mapped to a
segment per graph pool, which a 1.2 client would not know to map, and a 1.2 daemon
hands every session the whole table.

Where each part lives: ``codes`` (the version, the bounds, the error codes, the message
type numbers, the string enums, ``ProtocolError``), ``base`` (the message bases and
the value types several messages share), one module per area for the messages
(``session``, ``status``, ``arenas``, ``kv``, ``graph_pools``, ``sleep``, ``retain``), ``catalog`` (the
tables from wire numbers to message types) and ``codec`` (the envelopes, encoding and
decoding). Peers use the names from here: ``from gpumem_shared import protocol as p``,
then ``p.CommitArena``, ``p.encode_request``.
"""

from __future__ import annotations

from gpumem_shared.protocol.codes import (
    PROTOCOL_VERSION,
    MIN_HELLO_VERSION,
    MAX_FRAME_BYTES,
    MAX_FDS_PER_MESSAGE,
    MAX_POOL_EXTENTS,
    MAX_KV_BUFFERS,
    MAX_HOLDINGS,
    MAX_HELD_CHUNKS,
    MAX_PENDING,
    MAX_TENANT_TOKEN,
    MAX_WAIT_S,
    RESUME_CREDENTIAL_BYTES,
    ErrorCode,
    MsgType,
    WireEnum,
    Backend,
    RoundState,
    RoundPolicy,
    NoticeKind,
    ProtocolError,
)
from gpumem_shared.protocol.base import (
    Message,
    RequestMessage,
    DeviceInfo,
    ChunkView,
    ArenaView,
    Extent,
    PoolExtents,
    RoundBudget,
    Ack,
)
from gpumem_shared.protocol.session import HelloReply, Hello, Holding, Resume, Ping, FdBatch, Notice
from gpumem_shared.protocol.status import (
    DaemonStatus,
    DeviceStatus,
    ClientStatus,
    GrantStatus,
    ArenaStatus,
    RoundMemberStatus,
    RoundStatus,
    KvPoolStatus,
    GraphPoolStatus,
    LeaseStatus,
    SleeperStatus,
    TenantCapStatus,
    StatusReply,
    Status,
)
from gpumem_shared.protocol.arenas import (
    ArenaReply,
    MapReply,
    CreateArena,
    AttachArena,
    ShareReply,
    ShareArena,
    UnshareArena,
    CommitArena,
    DecommitArena,
    SyncArena,
    ReleaseArena,
    ChunksUnmapped,
    PlaceholderReply,
    PlaceholderArena,
)
from gpumem_shared.protocol.kv import (
    KvBuffer,
    KvBufferView,
    KvPoolView,
    KvDeclareReply,
    KvDeclare,
    RoundView,
    RoundJoin,
    KvCommitReply,
    CaptureDone,
    KvGrow,
    KvShrink,
    KvDemand,
)
from gpumem_shared.protocol.graph_pools import (
    GraphPoolReply,
    RegisterGraphPool,
    UpdateGraphPool,
    RetireGraphPool,
    OpenGraphPool,
    PublishLeaseEvent,
    LeaseEventReply,
    LookupLeaseEvent,
    ReportEscape,
)
from gpumem_shared.protocol.sleep import HostBufferView, HostBufferReply, SleepBuffer, FreeSleepBuffer, SleepArena, WakeArena
from gpumem_shared.protocol.retain import (
    RetainState,
    RetainGroupReply,
    RetainGroup,
    Retain,
    AdoptedObject,
    AdoptReply,
    Adopt,
    AdoptDone,
    ReserveReply,
    RetainReserve,
    RetainedStatus,
)
from gpumem_shared.protocol.catalog import REQUESTS, EVENTS
from gpumem_shared.protocol.codec import (
    Request,
    Reply,
    check_version,
    check_hello_version,
    encode_request,
    decode_request,
    request_id_of,
    encode_reply,
    encode_error,
    decode_reply,
    decode_body,
    encode_event,
    decode_event,
    to_wire,
    from_wire,
)

__all__ = [
    "PROTOCOL_VERSION", "MIN_HELLO_VERSION", "MAX_FRAME_BYTES", "MAX_FDS_PER_MESSAGE", "MAX_POOL_EXTENTS", "MAX_KV_BUFFERS", "MAX_WAIT_S",
    "MAX_HOLDINGS", "MAX_HELD_CHUNKS", "MAX_PENDING", "MAX_TENANT_TOKEN", "RESUME_CREDENTIAL_BYTES", "ErrorCode", "MsgType", "WireEnum", "Backend", "RoundState",
    "RoundPolicy", "NoticeKind", "ProtocolError", "Message", "RequestMessage", "DeviceInfo", "ChunkView", "ArenaView",
    "Extent", "PoolExtents", "RoundBudget", "Ack", "HelloReply", "Hello", "Holding", "Resume", "Ping", "FdBatch", "Notice",
    "DaemonStatus", "DeviceStatus", "ClientStatus", "GrantStatus", "ArenaStatus", "RoundMemberStatus", "RoundStatus",
    "KvPoolStatus", "GraphPoolStatus", "LeaseStatus", "StatusReply", "Status", "ArenaReply", "MapReply", "CreateArena",
    "AttachArena", "ShareReply", "ShareArena", "UnshareArena", "CommitArena", "DecommitArena", "SyncArena", "ReleaseArena",
    "ChunksUnmapped", "PlaceholderReply", "PlaceholderArena", "KvBuffer", "KvBufferView", "KvPoolView", "KvDeclareReply",
    "KvDeclare", "RoundView", "RoundJoin", "KvCommitReply", "CaptureDone", "KvGrow", "KvShrink", "KvDemand", "GraphPoolReply",
    "RegisterGraphPool", "UpdateGraphPool", "RetireGraphPool", "OpenGraphPool", "PublishLeaseEvent", "LeaseEventReply",
    "LookupLeaseEvent", "ReportEscape", "SleeperStatus", "TenantCapStatus", "HostBufferView", "HostBufferReply", "SleepBuffer",
    "FreeSleepBuffer", "SleepArena", "WakeArena",
    "RetainState", "RetainGroupReply", "RetainGroup", "Retain", "AdoptedObject", "AdoptReply", "Adopt", "AdoptDone", "ReserveReply", "RetainReserve", "RetainedStatus",
    "REQUESTS", "EVENTS", "Request", "Reply", "check_version", "check_hello_version",
    "encode_request", "decode_request", "request_id_of", "encode_reply", "encode_error", "decode_reply", "decode_body",
    "encode_event", "decode_event", "to_wire", "from_wire",
]
