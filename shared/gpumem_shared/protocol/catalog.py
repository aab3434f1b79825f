"""Every message by its wire number: the requests the daemon serves, and what it sends
on the fd channel. The codec decodes by these tables; docs/protocol.md lists the same
(tests/unit/test_docs.py keeps the two in step)."""

from __future__ import annotations

from gpumem_shared.protocol.arenas import (
    AttachArena,
    ChunksUnmapped,
    CommitArena,
    CreateArena,
    DecommitArena,
    PlaceholderArena,
    ReleaseArena,
    ShareArena,
    SyncArena,
    UnshareArena,
)
from gpumem_shared.protocol.base import RequestMessage
from gpumem_shared.protocol.codes import MsgType
from gpumem_shared.protocol.graph_pools import (
    LookupLeaseEvent,
    OpenGraphPool,
    PublishLeaseEvent,
    RegisterGraphPool,
    ReportEscape,
    RetireGraphPool,
    UpdateGraphPool,
)
from gpumem_shared.protocol.kv import CaptureDone, KvDeclare, KvDemand, KvGrow, KvShrink, RoundJoin
from gpumem_shared.protocol.retain import Adopt, AdoptDone, Retain, RetainGroup, RetainReserve
from gpumem_shared.protocol.session import FdBatch, Hello, Notice, Ping, Resume
from gpumem_shared.protocol.sleep import FreeSleepBuffer, SleepArena, SleepBuffer, WakeArena
from gpumem_shared.protocol.status import Status

# One entry per request type the daemon serves, by wire number.
REQUESTS: dict[int, type[RequestMessage]] = {
    int(cls.TYPE): cls
    for cls in (
        Hello,
        Resume,
        Ping,
        Status,
        CreateArena,
        AttachArena,
        ShareArena,
        UnshareArena,
        CommitArena,
        DecommitArena,
        SyncArena,
        ReleaseArena,
        ChunksUnmapped,
        PlaceholderArena,
        KvDeclare,
        RoundJoin,
        CaptureDone,
        KvGrow,
        KvShrink,
        KvDemand,
        RegisterGraphPool,
        UpdateGraphPool,
        RetireGraphPool,
        OpenGraphPool,
        PublishLeaseEvent,
        LookupLeaseEvent,
        ReportEscape,
        SleepBuffer,
        FreeSleepBuffer,
        SleepArena,
        WakeArena,
        RetainGroup,
        Retain,
        Adopt,
        AdoptDone,
        RetainReserve,
    )
}

# fd channel, daemon -> client. Not requests: they carry no reply.
EVENTS: dict[int, type[FdBatch] | type[Notice]] = {int(MsgType.FD_BATCH): FdBatch, int(MsgType.NOTICE): Notice}
