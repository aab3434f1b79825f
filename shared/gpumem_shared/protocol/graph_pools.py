"""Graph pools: register one after capture, update and retire it, open another client's
shared one; the IPC events lease holders wait on, and borrowed tensors that escaped."""

from __future__ import annotations

from gpumem_shared.protocol.base import Ack, Message, PoolExtents, RequestMessage
from gpumem_shared.protocol.codes import MsgType
from gpumem_shared.protocol.status import GraphPoolStatus


class GraphPoolReply(Message):
    """A graph pool. ``fd_batches`` 1: the reply grants the pool's lease segment, whose
    memfd follows in one FD_BATCH whose one id is the pool's (REGISTER and OPEN)."""

    pool: GraphPoolStatus
    fd_batches: int = 0
    # Under memops lease ordering (gpumemd --lease-ordering memops), on a shared pool:
    # this session's sequence lane for the pool and its generation's base, and the lanes
    # of the daemon's sequence chunk, whose fd comes in the same batch under id 0
    # (lease_order.CHUNK_GRANT_ID). order_lane -1: the pool is ordered by IPC events.
    order_lane: int = -1
    order_base: int = 0
    order_lanes: int = 0


class RegisterGraphPool(RequestMessage, kw_only=True):
    """After capture: a CUDA-graph pool that lives in ``arena`` (owner only), with its
    segments and its free runs (inactive blocks, coalesced). Extents lie in committed
    memory of the arena and overlap no other registered pool."""

    TYPE = MsgType.GRAPH_POOL_REGISTER
    REPLY = GraphPoolReply
    arena: str
    label: str
    extents: PoolExtents
    free_runs: PoolExtents
    shared: bool = False  # clients the arena is shared with may open it and borrow


class UpdateGraphPool(RequestMessage, kw_only=True):
    """New extents and free runs. The epoch goes up when they change or ``recaptured``:
    a borrower's view of the runs must never outlive them."""

    TYPE = MsgType.GRAPH_POOL_UPDATE
    REPLY = GraphPoolReply
    pool_id: int
    extents: PoolExtents
    free_runs: PoolExtents
    recaptured: bool = False


class RetireGraphPool(RequestMessage, kw_only=True):
    TYPE = MsgType.GRAPH_POOL_RETIRE
    REPLY = Ack
    pool_id: int


class OpenGraphPool(RequestMessage, kw_only=True):
    """Another client's shared graph pool, by id or by (owner, label), for a session that
    has attached its arena: to take leases on it and borrow its free runs."""

    TYPE = MsgType.GRAPH_POOL_OPEN
    REPLY = GraphPoolReply
    pool_id: int = 0
    owner: str = ""
    label: str = ""


class PublishLeaseEvent(RequestMessage, kw_only=True):
    """This session's IPC event for a shared pool (the driver's opaque handle): the
    next holder from another process waits on it."""

    TYPE = MsgType.LEASE_EVENT_PUBLISH
    REPLY = Ack
    pool_id: int
    handle: bytes


class LeaseEventReply(Message):
    handle: bytes


class LookupLeaseEvent(RequestMessage, kw_only=True):
    """The IPC event that session ``session`` (as a lease word names it) published for
    the pool."""

    TYPE = MsgType.LEASE_EVENT_LOOKUP
    REPLY = LeaseEventReply
    pool_id: int
    session: int


class ReportEscape(RequestMessage, kw_only=True):
    """This session's tensors borrowed from the pool outlived their scope (``escaped``),
    or are gone again: while any session has such tensors, the pool's slot refuses
    replay and capture."""

    TYPE = MsgType.GRAPH_POOL_ESCAPE
    REPLY = Ack
    pool_id: int
    escaped: bool
