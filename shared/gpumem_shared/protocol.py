"""The gpumemd wire protocol: every message, the envelopes, the error codes.

Both the daemon and its clients import this module; it depends on the standard
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

Every message is a ``msgspec.Struct``: msgspec checks types while it decodes (a bool
is not an int, a float is not an int), so a frame becomes a typed message in one pass.
The envelope is decoded first with the body left raw, then the body with the decoder
of the type the envelope names; only a frame the strict envelope refuses goes through
the slower path that works out which error code it earns. Hand-written checks against
the annotations cost about 20 times more per request, and dict-of-dict messages were
refused for having no schema at all.
"""

from __future__ import annotations

import enum
import logging
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

PROTOCOL_VERSION: tuple[int, int] = (1, 5)

# The oldest protocol HELLO accepts, on either side (see the module doc).
MIN_HELLO_VERSION: tuple[int, int] = (1, 3)

# A control frame is a few hundred bytes; anything near this bound is an attack or
# a bug, and unpacking it would let one peer make the daemon allocate freely.
MAX_FRAME_BYTES = 1 << 20

# SCM_MAX_FD: Linux refuses more than 253 descriptors in one sendmsg.
MAX_FDS_PER_MESSAGE = 253

# What one client may make the daemon keep and walk per request: a graph pool's extents
# and free runs (each list), a KV pool's buffers. Real pools have hundreds at most; a
# frame has room for some 20,000, and every STATUS would carry them all.
MAX_POOL_EXTENTS = 4096
MAX_KV_BUFFERS = 4096
# A resuming client's holdings: arenas, and chunks in each (a 4 TiB window in 2 MiB
# chunks at most; bulk chunks make real counts hundreds).
MAX_HOLDINGS = 4096
MAX_HELD_CHUNKS = 1 << 21
# The requests a resuming client sends again: one call and its deferred ones.
MAX_PENDING = 4096

# msgpack's integer range: what lies outside cannot be encoded at all.
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1

log = logging.getLogger("gpumem_shared.protocol")


class ErrorCode(enum.IntEnum):
    """Stable numbered error codes. Append only; never renumber."""

    OK = 0
    BAD_MESSAGE = 1  # not msgpack, not a map, no envelope, frame too large
    UNKNOWN_MESSAGE = 2  # message type this daemon does not know
    PROTOCOL_MISMATCH = 3  # major protocol versions differ
    INVALID_ARGUMENT = 4  # missing or wrongly typed field, bad size, bad name
    NO_SESSION = 5  # request needs a session (HELLO on the fd channel first)
    NOT_FOUND = 6  # no such arena or chunk
    ALREADY_EXISTS = 7  # duplicate arena name; a client name a live session holds
    PERMISSION_DENIED = 8  # acting on what another client owns
    OUT_OF_MEMORY = 9  # commit beyond the device's free memory
    UNEXPECTED_FDS = 10  # the client sent descriptors nobody asked for
    SHUTTING_DOWN = 11  # the daemon is stopping
    DRIVER_ERROR = 12  # the CUDA driver (or the host backend) failed
    INTERNAL = 13  # a daemon bug; details are in the daemon's log
    ROUND_FAILED = 14  # a KV commit round failed: deadline passed, or the budget is short
    SESSION_LOST = 15  # RESUME of a session the restarted daemon does not hold (grace period over, no record)


class MsgType(enum.IntEnum):
    HELLO = 1
    PING = 2
    STATUS = 3
    RESUME = 4
    ARENA_CREATE = 10
    ARENA_ATTACH = 11
    ARENA_SHARE = 12
    ARENA_COMMIT = 13
    ARENA_DECOMMIT = 14
    ARENA_SYNC = 15
    ARENA_RELEASE = 16
    CHUNKS_UNMAPPED = 17
    ARENA_PLACEHOLDER = 18
    ARENA_UNSHARE = 19
    KV_DECLARE = 20
    ROUND_JOIN = 21
    CAPTURE_DONE = 22
    KV_GROW = 23
    KV_SHRINK = 24
    GRAPH_POOL_REGISTER = 30
    GRAPH_POOL_UPDATE = 31
    GRAPH_POOL_RETIRE = 32
    GRAPH_POOL_OPEN = 33
    LEASE_EVENT_PUBLISH = 34
    LEASE_EVENT_LOOKUP = 35
    GRAPH_POOL_ESCAPE = 36
    # fd channel, daemon -> client
    FD_BATCH = 100
    NOTICE = 101


class WireEnum(str, enum.Enum):
    """A string enum: travels, compares and prints as its value, so code comparing with
    the literal strings keeps working. A peer refuses a value it does not know: adding
    one is an incompatible change (a new major), or it goes in a new field."""

    def __str__(self) -> str:
        return str(self.value)


class Backend(WireEnum):
    CUDA = "cuda"
    HOST = "host"


class RoundState(WireEnum):
    OPEN = "open"
    AWAITING_SHRINK = "awaiting-shrink"  # the budget is short; pools committed earlier were asked to shrink
    COMMITTED = "committed"
    FAILED = "failed"


class RoundPolicy(WireEnum):
    """What a KV commit round does when its deadline passes with members missing."""

    PARTIAL = "partial"  # commit for the members that reported
    FAIL = "fail"  # answer the reported ones with ROUND_FAILED


class NoticeKind(WireEnum):
    STOPPING = "stopping"  # the daemon is stopping; mapped memory stays valid
    ARENA_GROWN = "arena-grown"  # the owner committed more: sharers sync()
    ARENA_RETIRED = "arena-retired"  # chunks left the arena: holders sync() and unmap them
    KV_SHRINK = "kv-shrink"  # the daemon asks a KV pool to give back rows (see KvShrink)


class ProtocolError(Exception):
    """A request the daemon refuses; becomes an error reply, never a traceback."""

    def __init__(self, code: ErrorCode, message: str, **detail: int | str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


# ---------------------------------------------------------------------------
# Message bases
# ---------------------------------------------------------------------------


class Message(msgspec.Struct):
    """A struct on the wire: a msgpack map with one key per field. Unknown keys are
    skipped when decoding (a newer minor may add fields)."""


class RequestMessage(Message, kw_only=True):
    """A request: its message type, its reply type and how the daemon admits it are
    class constants, read by the codec and the daemon's dispatcher."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type[Message]]
    # False only for what an anonymous control-channel peer (gpumemctl) may ask.
    NEEDS_SESSION: ClassVar[bool] = True
    # True for what a stopping daemon still serves: looking, and giving memory back.
    WHILE_STOPPING: ClassVar[bool] = False


# ---------------------------------------------------------------------------
# Shared value types
# ---------------------------------------------------------------------------


class DeviceInfo(Message):
    index: int  # the daemon's device index (nvidia-smi order)
    uuid: str  # "GPU-..." for CUDA, "HOST-..." for the host backend
    name: str
    total_bytes: int
    granularity: int  # every size on the wire is a multiple of this


class ChunkView(Message):
    id: int
    offset: int  # from the arena's base address
    size: int


class ArenaView(Message):
    name: str
    owner: str
    address: int  # the planned base; every client maps the arena here
    reserved: int
    committed: int
    granularity: int


class Extent(Message):
    offset: int  # from the arena's base
    size: int


# A graph pool's extents or free runs, as a request may carry them.
PoolExtents = Annotated[list[Extent], msgspec.Meta(max_length=MAX_POOL_EXTENTS)]


class RoundBudget(Message):
    """How a KV commit round split the device (bytes): ``budget`` = ``free`` -
    ``reserve`` - ``headroom``; ``minimums`` go first, the rest by weight; ``committed``
    is what the round created (0 until it commits). All 0: not measured yet."""

    free: int = 0  # measured free memory, plus the members' staged minimums
    staged: int = 0  # minimums created while the round waited for other members
    reserve: int = 0
    headroom: int = 0
    graph_pools: int = 0  # what the members' graph pools hold: already in use, not deducted
    budget: int = 0
    minimums: int = 0
    committed: int = 0


# ---------------------------------------------------------------------------
# Messages. Each request names its reply type; docs/protocol.md lists them.
# ---------------------------------------------------------------------------


class Ack(Message):
    pass


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


class Holding(Message):
    """An arena's chunks a resuming client maps (placeholders and retired ones included)."""

    arena: str
    chunks: Annotated[list[int], msgspec.Meta(max_length=MAX_HELD_CHUNKS)]


class Resume(RequestMessage, kw_only=True):
    """Since 1.4: first message on a new fd channel, instead of HELLO, from a client whose
    daemon restarted: the session comes back with its ids, token and objects. The
    credential HELLO returned, checked with SO_PEERCRED (same pid and uid). ``holdings``
    say which chunks the client maps. Since 1.5, ``pending`` names the requests it sends
    again (no reply, or one whose descriptors were lost): those the daemon before had
    answered get that answer again, with the chunks of it the client does not map."""

    TYPE = MsgType.RESUME
    REPLY = HelloReply
    session_id: int
    credential: bytes
    holdings: Annotated[list[Holding], msgspec.Meta(max_length=MAX_HOLDINGS)] = msgspec.field(default_factory=list)
    client_version: str = ""
    pending: Annotated[list[int], msgspec.Meta(max_length=MAX_PENDING)] = msgspec.field(default_factory=list)


class Ping(RequestMessage, kw_only=True):
    """No-op round trip; needs no session."""

    TYPE = MsgType.PING
    REPLY = Ack
    NEEDS_SESSION = False
    WHILE_STOPPING = True


class DaemonStatus(Message):
    version: str
    protocol: str
    pid: int
    backend: Backend
    uptime_s: float
    runtime_dir: str
    state: str  # "serving" | "stopping"
    generation: int = 0  # since 1.4: restarts with the state kept (0: a fresh start)
    waiting: int = 0  # since 1.4: sessions kept across a restart whose client has not resumed yet
    waiting_objects: int = 0  # since 1.4: arenas and graph pools those sessions hold
    grace_left_s: float = 0.0  # since 1.4: until waiting sessions are released like dead clients'


class DeviceStatus(Message):
    index: int
    uuid: str
    name: str
    total_bytes: int
    free_bytes: int  # measured (cuMemGetInfo) on CUDA; capacity minus accounted on host
    granularity: int
    accounted_bytes: int  # chunks the daemon created that are still held by someone
    reserve_bytes: int  # kept free, never committed


class ClientStatus(Message):
    session_id: int
    name: str
    pid: int
    uid: int
    gid: int
    since: float  # unix time
    arenas: list[str]
    waiting: bool = False  # since 1.4: kept across a restart, its client not back yet


class GrantStatus(Message):
    """One grant on an arena, as status shows it (its token never travels here): a
    session may attach when every field the grant names matches it (-1 and "" name
    nothing), or when it gives the grant's token and every field the share named
    explicitly matches."""

    id: int
    client: str = ""  # the client name it admits ("": any name)
    uid: int = -1  # the uid it admits (-1: any)
    gid: int = -1  # the primary gid it admits (-1: any)
    # ``uid`` is the owner's, implied by a share that named a client alone: a session
    # that gives the token is admitted under any uid.
    uid_implied: bool = False


class ArenaStatus(Message):
    name: str
    owner: str
    owner_pid: int
    owner_alive: bool
    address: int
    reserved: int
    committed: int
    chunks: int
    shared_with: list[str]  # the client names its grants name (1.2's view of them)
    attached: list[str]
    retiring_bytes: int  # decommitted, still mapped by some client
    placeholder_bytes: int = 0  # small chunks the owner aliases over uncommitted space
    grants: list[GrantStatus] = msgspec.field(default_factory=list)


class RoundMemberStatus(Message):
    client: str
    pool: str
    reported: bool
    headroom_bytes: int
    graph_pool_bytes: int
    min_tokens: int
    max_tokens: int
    weight: float
    tokens: int  # the result, once committed
    bytes: int


class RoundStatus(Message):
    id: int
    state: RoundState
    expect: int  # pools the round waits for (0: whoever joined)
    policy: RoundPolicy
    deadline_in_s: float  # negative once passed
    members: list[RoundMemberStatus]
    dropped: list[str]
    # The daemon may still build this as a dict with the same keys: it encodes alike,
    # and a peer decoding the reply always gets a RoundBudget.
    budget: RoundBudget
    error: str


class KvPoolStatus(Message):
    name: str
    owner: str
    buffers: int
    bytes_per_token: int
    max_tokens: int  # declared bound
    tokens: int  # committed
    committed_bytes: int
    min_tokens: int
    shrink_request: int  # tokens the daemon asked for; -1 when none


class GraphPoolStatus(Message):
    id: int
    owner: str
    arena: str
    label: str
    epoch: int  # bumped by every capture into the pool and every change of its runs
    extents: list[Extent]  # the pool's segments
    free_runs: list[Extent]  # idle space between replays, largest first
    free_bytes: int
    slot: int = 0  # deprecated since 1.3, always 0: the pool's lease slot is in its own segment
    shared: bool = False  # other processes may take leases on it (and borrow its free runs)
    escaped_by: str = ""  # clients whose borrowed tensors outlived their scope: replays are refused
    # Times gpumemd repaired its lease slot: a word or field no client could rightly have
    # written (a session that may not use the pool, an impossible value). See its log.
    lease_repairs: int = 0


class LeaseStatus(Message):
    pool_id: int
    slot: int  # deprecated since 1.3, always 0 (see GraphPoolStatus.slot)
    kind: str  # capture | replay | borrow
    holder: str  # client name
    pid: int
    label: str
    since: float  # unix time


class StatusReply(Message):
    daemon: DaemonStatus
    device: DeviceStatus
    clients: list[ClientStatus]
    arenas: list[ArenaStatus]
    # The graph-pool registry under its 1.0 name. Deprecated since 1.2: read
    # ``graph_pools``; ``extents`` (the same list) goes at the next major.
    extents: list[GraphPoolStatus]
    leases: list[LeaseStatus]
    rounds: list[RoundStatus] = msgspec.field(default_factory=list)
    kv: list[KvPoolStatus] = msgspec.field(default_factory=list)
    graph_pools: list[GraphPoolStatus] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        # Either name may be the one filled: a 1.1 daemon sends ``extents`` only, a
        # builder may give only one of them. Both always carry the same pools.
        if self.extents and not self.graph_pools:
            self.graph_pools = self.extents
        elif self.graph_pools and not self.extents:
            self.extents = self.graph_pools


class Status(RequestMessage, kw_only=True):
    """Everything gpumemctl shows; needs no session."""

    TYPE = MsgType.STATUS
    REPLY = StatusReply
    NEEDS_SESSION = False
    WHILE_STOPPING = True


class ArenaReply(Message):
    arena: ArenaView


class MapReply(Message):
    """Chunks to map (their fds follow on the fd channel in ``fd_batches`` FD_BATCH
    messages tagged with this request's id) and chunks to unmap (then CHUNKS_UNMAPPED)."""

    arena: ArenaView
    chunks: list[ChunkView]
    retired: list[ChunkView]
    fd_batches: int


class CreateArena(RequestMessage, kw_only=True):
    """Reserve a virtual window; no physical memory yet."""

    TYPE = MsgType.ARENA_CREATE
    REPLY = ArenaReply
    name: str
    reserve_bytes: int


class AttachArena(RequestMessage, kw_only=True):
    """Join an arena a grant of its owner admits this session to; maps what is committed."""

    TYPE = MsgType.ARENA_ATTACH
    REPLY = MapReply
    name: str
    # A token from the owner's ARENA_SHARE, handed over out of band: admits a session
    # the grant's identity alone does not (another uid, where the share named a client
    # alone; anyone, where it named nobody). "": none.
    token: str = ""


class ShareReply(Message):
    """The new grant's token (give it to the engine that attaches) and the grant as
    status shows it. A 1.2 daemon answers with an empty body: no token."""

    token: str = ""
    grant: GrantStatus = msgspec.field(default_factory=lambda: GrantStatus(id=0))


class ShareArena(RequestMessage, kw_only=True):
    """Owner only: a new grant on the arena. It admits sessions by what the kernel
    vouches for (SO_PEERCRED) and the name they said HELLO with: ``client`` alone means
    that name under the owner's uid; ``uid`` and ``gid`` admit another user's engine.
    Its token admits whoever gives it, subject to what the share named explicitly."""

    TYPE = MsgType.ARENA_SHARE
    REPLY = ShareReply
    name: str
    client: str = ""  # a client name (as given to HELLO); "": any name
    uid: int = -1  # -1: any uid (the owner's, where only ``client`` is named)
    gid: int = -1  # a primary gid; -1: any


class UnshareArena(RequestMessage, kw_only=True):
    """Owner only: revoke the grant ``token`` came with. New attaches it would admit are
    refused; sessions attached already stay attached and keep what they map."""

    TYPE = MsgType.ARENA_UNSHARE
    REPLY = Ack
    name: str
    token: str


class CommitArena(RequestMessage, kw_only=True):
    """Grow physical backing so the first ``nbytes`` of the arena are committed."""

    TYPE = MsgType.ARENA_COMMIT
    REPLY = MapReply
    name: str
    nbytes: int


class DecommitArena(RequestMessage, kw_only=True):
    """Shrink to the smallest chunk boundary >= ``to_nbytes``; the reply's ``retired``
    chunks must be unmapped and reported with CHUNKS_UNMAPPED."""

    TYPE = MsgType.ARENA_DECOMMIT
    REPLY = MapReply
    name: str
    to_nbytes: int


class SyncArena(RequestMessage, kw_only=True):
    """Bring a client's mapping up to date: chunks committed since, chunks retired since."""

    TYPE = MsgType.ARENA_SYNC
    REPLY = MapReply
    name: str


class ReleaseArena(RequestMessage, kw_only=True):
    """Owner: destroy the arena. Sharer: detach. The client has unmapped everything first."""

    TYPE = MsgType.ARENA_RELEASE
    REPLY = Ack
    WHILE_STOPPING = True
    name: str


class ChunksUnmapped(RequestMessage, kw_only=True):
    """The client unmapped these chunks (retired by a decommit, a shrink or a sync)."""

    TYPE = MsgType.CHUNKS_UNMAPPED
    REPLY = Ack
    WHILE_STOPPING = True
    name: str
    chunk_ids: list[int]


class PlaceholderReply(Message):
    """The placeholder chunks (``offset`` is meaningless: 0), largest first; their fds
    follow in ``fd_batches`` FD_BATCH messages as for MapReply."""

    arena: ArenaView
    chunks: list[ChunkView]
    fd_batches: int


class PlaceholderArena(RequestMessage, kw_only=True):
    """Owner only: small chunks of ``slot_bytes`` and of the granularity, for the client
    to alias over space it has not committed, so graph capture works there (capture of
    a memcpy on unmapped space fails). Idempotent per size."""

    TYPE = MsgType.ARENA_PLACEHOLDER
    REPLY = PlaceholderReply
    name: str
    slot_bytes: int


class KvBuffer(Message):
    name: str
    row_bytes: int  # bytes of one token row
    align: int = 0  # power of two; rows and the buffer start honour it (0: none)


class KvBufferView(Message):
    name: str
    offset: int  # of the buffer's region from the arena base
    row_bytes: int
    region_bytes: int  # max_tokens rows, rounded up to the granularity


class KvPoolView(Message):
    name: str
    arena: ArenaView
    buffers: list[KvBufferView]
    max_tokens: int  # the declared bound
    tokens: int  # rows committed in every buffer
    bytes_per_token: int


class KvDeclareReply(Message):
    pool: KvPoolView


class KvDeclare(RequestMessage, kw_only=True):
    """Declare a KV pool: an arena laid out as ``buffers``, each with room for
    ``max_tokens`` rows (or as many as ``reserve_bytes`` allows). Nothing is committed."""

    TYPE = MsgType.KV_DECLARE
    REPLY = KvDeclareReply
    name: str
    buffers: Annotated[list[KvBuffer], msgspec.Meta(max_length=MAX_KV_BUFFERS)]
    max_tokens: int = 0
    reserve_bytes: int = 0


class RoundView(Message):
    round_id: int
    state: RoundState
    deadline_in_s: float
    members: list[str]  # "client/pool"


class RoundJoin(RequestMessage, kw_only=True):
    """Join the device's open commit round (opening one if none is) with a pool."""

    TYPE = MsgType.ROUND_JOIN
    REPLY = RoundView
    pool: str
    # How many pools the round should gather before it may commit (the largest value any
    # member gives wins): engines that start at different times then still share one
    # round. 0: commit once every member that joined has reported.
    expect: int = 0


class KvCommitReply(Message):
    """The pool after a commit, grow or shrink: chunks to map (fds follow as for
    MapReply), chunks to unmap, and the budget figures of the round that decided it."""

    pool: KvPoolView
    arena: ArenaView
    chunks: list[ChunkView]
    retired: list[ChunkView]
    fd_batches: int
    round_id: int = 0
    # As in RoundStatus: the daemon may give a dict with the same keys.
    budget: RoundBudget = msgspec.field(default_factory=RoundBudget)


class CaptureDone(RequestMessage, kw_only=True):
    """The pool's graphs are captured. The reply comes when the round commits (or fails):
    wait for it with a timeout beyond the round's deadline."""

    TYPE = MsgType.CAPTURE_DONE
    REPLY = KvCommitReply
    pool: str
    headroom_bytes: int = 0  # activations and other memory the engine needs besides KV
    graph_pool_bytes: int = 0  # what its captured graph pools hold (already in use)
    min_tokens: int = 0
    max_tokens: int = 0  # 0: the declared bound
    weight: float = 1.0


class KvGrow(RequestMessage, kw_only=True):
    """Commit more rows (up to ``tokens``) if the device has the memory."""

    TYPE = MsgType.KV_GROW
    REPLY = KvCommitReply
    pool: str
    tokens: int


class KvShrink(RequestMessage, kw_only=True):
    """The owner confirms rows from ``tokens`` on are free: the daemon decommits them
    (whole chunks: the pool may keep a few more rows) and the reply lists the chunks to
    unmap."""

    TYPE = MsgType.KV_SHRINK
    REPLY = KvCommitReply
    pool: str
    tokens: int


class GraphPoolReply(Message):
    """A graph pool. ``fd_batches`` 1: the reply grants the pool's lease segment, whose
    memfd follows in one FD_BATCH whose one id is the pool's (REGISTER and OPEN)."""

    pool: GraphPoolStatus
    fd_batches: int = 0


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
        RegisterGraphPool,
        UpdateGraphPool,
        RetireGraphPool,
        OpenGraphPool,
        PublishLeaseEvent,
        LookupLeaseEvent,
        ReportEscape,
    )
}


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


EVENTS: dict[int, type[FdBatch] | type[Notice]] = {int(MsgType.FD_BATCH): FdBatch, int(MsgType.NOTICE): Notice}


# ---------------------------------------------------------------------------
# Envelopes
# ---------------------------------------------------------------------------

_EMPTY_MAP = msgspec.Raw(b"\x80")


class Request(msgspec.Struct, frozen=True):
    """A decoded request: its id, its typed message and the protocol its sender speaks."""

    request_id: int
    message: RequestMessage
    version: tuple[int, int] = PROTOCOL_VERSION


class Reply(msgspec.Struct, frozen=True):
    """A decoded reply envelope (the wire's short keys renamed); ``body`` stays raw until
    ``decode_body`` gives it the type the request names (an error reply has an empty one)."""

    version: tuple[int, int] = msgspec.field(name="v")
    request_id: int = msgspec.field(name="id")
    ok: bool
    code: ErrorCode
    message: str = msgspec.field(default="", name="msg")
    detail: dict[str, int | str] = msgspec.field(default_factory=dict)
    body: msgspec.Raw = msgspec.field(default=_EMPTY_MAP, name="b")


class _RequestFrame(msgspec.Struct):
    v: tuple[int, int]
    id: int
    t: int
    b: Any


class _ReplyFrame(msgspec.Struct):
    v: tuple[int, int]
    id: int
    ok: bool
    code: int
    msg: str
    detail: dict[str, Any]
    b: Any


class _Head(msgspec.Struct):
    """Request and fd-channel envelopes as every current peer sends them."""

    v: tuple[int, int]
    id: int
    t: int
    b: msgspec.Raw = _EMPTY_MAP


class _LooseHead(msgspec.Struct):
    v: Any = None
    id: Any = None
    t: Any = None
    b: msgspec.Raw = _EMPTY_MAP


class _LooseReplyHead(msgspec.Struct):
    v: Any = None
    id: Any = None
    ok: Any = None
    code: Any = None
    msg: Any = None
    detail: Any = None
    b: msgspec.Raw = _EMPTY_MAP


_ENCODER = msgspec.msgpack.Encoder()
_HEAD = msgspec.msgpack.Decoder(_Head)
_LOOSE_HEAD = msgspec.msgpack.Decoder(_LooseHead)
_REPLY = msgspec.msgpack.Decoder(Reply)
_LOOSE_REPLY_HEAD = msgspec.msgpack.Decoder(_LooseReplyHead)
_DECODERS: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}
_REQUEST_DECODERS = {number: msgspec.msgpack.Decoder(cls) for number, cls in REQUESTS.items()}
_VERSION = PROTOCOL_VERSION
_MAJOR = PROTOCOL_VERSION[0]

_M = TypeVar("_M")


def _decoder(cls: type[_M]) -> msgspec.msgpack.Decoder[_M]:
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
    return decoder


def _field_error(where: str, exc: msgspec.ValidationError) -> str:
    """msgspec's message with the type name in place of its ``$`` root:
    "CommitArena.nbytes: expected `int`, got `bool`", "CommitArena.nbytes is missing"."""
    text, _, path = str(exc).partition(" - at `")
    path = path.rstrip("`")
    if "` in `" in path:  # a map key: "key` in `$.detail"
        path = "a key of " + path.partition("` in `")[2]
    location = path.replace("$", where) if path else where
    missing = "Object missing required field `"
    if text.startswith(missing):
        return f"{location}.{text[len(missing):].rstrip('`')} is missing"
    text = text.replace("`object`", "`map`")
    return f"{location}: {text[:1].lower()}{text[1:]}"


# What msgspec raises on bytes that are not msgpack, or nest deeper than it recurses.
_UNDECODABLE = (msgspec.DecodeError, RecursionError)
# The first byte of a msgpack map: fixmap, map 16, map 32.
_MAP_MARKERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def _not_msgpack(exc: Exception) -> ProtocolError:
    if isinstance(exc, RecursionError):
        return ProtocolError(ErrorCode.BAD_MESSAGE, "frame is not valid msgpack here: it nests deeper than any message")
    return ProtocolError(ErrorCode.BAD_MESSAGE, f"frame is not valid msgpack ({exc})")


def _is_map(data: Any) -> bool:
    first = bytes(memoryview(data)[:1])
    return bool(first) and first[0] in _MAP_MARKERS


def _not_a_map(frame: Any, what: str) -> ProtocolError:
    """For a frame that no envelope struct accepts even loosely."""
    if _is_map(frame):
        return ProtocolError(ErrorCode.BAD_MESSAGE, f"{what} map has keys that are not strings")
    return ProtocolError(ErrorCode.BAD_MESSAGE, f"{what} is not a map")


def _too_large(frame: bytes | memoryview) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_MESSAGE, f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")


def _mismatch(version: Any, **detail: int) -> ProtocolError:
    return ProtocolError(
        ErrorCode.PROTOCOL_MISMATCH,
        f"peer speaks protocol {version[0]}.{version[1]}, this side "
        f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}; upgrade the older of the client and gpumemd",
        peer=f"{version[0]}.{version[1]}",
        ours=f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}",
        **detail,
    )


def check_version(version: Any) -> None:
    if not isinstance(version, (list, tuple)) or len(version) != 2 or not all(type(v) is int for v in version):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "envelope has no protocol version 'v' = [major, minor]")
    if version[0] != _MAJOR:
        raise _mismatch(version)


def check_hello_version(version: tuple[int, int]) -> None:
    """Refuse a peer of this major older than MIN_HELLO_VERSION (see the module doc)."""
    if tuple(version) < MIN_HELLO_VERSION:
        peer, ours = f"{version[0]}.{version[1]}", f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}"
        raise ProtocolError(
            ErrorCode.PROTOCOL_MISMATCH,
            f"peer speaks protocol {peer}, this side {ours}, which opens sessions only with "
            f"{MIN_HELLO_VERSION[0]}.{MIN_HELLO_VERSION[1]} or later (lease slots come one per graph pool since 1.3); "
            "upgrade the older of the client and gpumemd",
            peer=peer,
            ours=ours,
        )


def _head(frame: bytes | memoryview, what: str) -> _Head:
    """The envelope of a request or an fd-channel event. A frame the strict decoder
    refuses is decoded again loosely, to name what is wrong (with the request id
    attached wherever it could be read)."""
    if len(frame) > MAX_FRAME_BYTES:
        raise _too_large(frame)
    try:
        head = _HEAD.decode(frame)
    except msgspec.ValidationError:
        head = _loose_head(frame, what)
    except _UNDECODABLE as exc:
        raise _not_msgpack(exc) from None
    if head.v[0] != _MAJOR:
        raise _mismatch(head.v, request_id=head.id)
    return head


def _loose_head(frame: bytes | memoryview, what: str) -> _Head:
    try:
        loose = _LOOSE_HEAD.decode(frame)
    except msgspec.ValidationError:
        raise _not_a_map(frame, what) from None
    except _UNDECODABLE as exc:
        raise _not_msgpack(exc) from None
    if type(loose.id) is not int:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{what} has no integer 'id'")
    try:
        check_version(loose.v)
        if type(loose.t) is not int:
            raise ProtocolError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {loose.t!r}")
    except ProtocolError as exc:
        exc.detail["request_id"] = loose.id
        raise
    return _Head(v=loose.v, id=loose.id, t=loose.t, b=loose.b)


def encode_request(request_id: int, message: RequestMessage) -> bytes:
    """A request frame. A field msgpack cannot carry (an integer beyond 64 bits) is the
    caller's INVALID_ARGUMENT."""
    try:
        return _ENCODER.encode(_RequestFrame(_VERSION, request_id, message.TYPE, message))
    except (OverflowError, TypeError, msgspec.EncodeError) as exc:
        raise ProtocolError(
            ErrorCode.INVALID_ARGUMENT, f"{type(message).__name__} cannot be encoded: {exc} (msgpack carries 64-bit integers)"
        ) from None


def decode_request(frame: bytes | memoryview) -> Request:
    """Decode a request, raising ProtocolError with the request id when it is known."""
    head = _head(frame, "request")
    decoder = _REQUEST_DECODERS.get(head.t)
    if decoder is None:
        raise ProtocolError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {head.t!r}", request_id=head.id)
    try:
        return Request(head.id, decoder.decode(head.b), head.v)
    except msgspec.ValidationError as exc:
        raise ProtocolError(ErrorCode.INVALID_ARGUMENT, _field_error(REQUESTS[head.t].__name__, exc), request_id=head.id) from None
    except _UNDECODABLE as exc:
        error = _not_msgpack(exc)
        error.detail["request_id"] = head.id
        raise error from None


def request_id_of(frame: bytes | memoryview) -> int:
    """The id of a request frame as far as it can be read, else 0: for refusing a frame
    whatever its body holds (one that came with descriptors, say) under its own id."""
    try:
        return _head(frame, "request").id
    except ProtocolError as exc:
        rid = exc.detail.get("request_id", 0)
        return rid if isinstance(rid, int) else 0


def encode_reply(request_id: int, body: Message) -> bytes:
    """A success reply. Never raises: a body msgpack cannot carry (a daemon bug, such as
    an integer beyond 64 bits) is logged and answered with INTERNAL, so the request
    still gets its answer and the daemon goes on."""
    try:
        return _ENCODER.encode(_ReplyFrame(_VERSION, request_id, True, 0, "", {}, body))
    except (OverflowError, TypeError, msgspec.EncodeError) as exc:
        log.error("the %s reply to request %d cannot be encoded (%s): %r", type(body).__name__, request_id, exc, body)
        return encode_error(
            request_id,
            ProtocolError(
                ErrorCode.INTERNAL,
                f"gpumemd built a {type(body).__name__} reply it cannot encode ({exc}); this is a gpumemd bug, see its log",
            ),
        )


def _packable(value: Any) -> int | str:
    """A detail value as the wire takes it: an int msgpack can carry, else text."""
    if isinstance(value, int) and not isinstance(value, bool) and _INT_MIN <= value <= _INT_MAX:
        return int(value)
    return value if type(value) is str else str(value)


def encode_error(request_id: int, error: ProtocolError) -> bytes:
    """An error reply. Never raises: detail values msgpack cannot carry (a client's huge
    number echoed back) travel as text."""
    detail = {str(k): _packable(v) for k, v in error.detail.items() if k != "request_id"}
    return _ENCODER.encode(_ReplyFrame(_VERSION, request_id, False, int(error.code), str(error.message), detail, {}))


def decode_reply(frame: bytes) -> Reply:
    """Decode a reply envelope (the body stays raw: ``decode_body``). Fields of the wrong
    shape are not trusted: success needs a real ``true``, an unknown code is INTERNAL."""
    if len(frame) > MAX_FRAME_BYTES:
        raise _too_large(frame)
    try:
        reply = _REPLY.decode(frame)
    except msgspec.ValidationError:
        return _loose_reply(frame)
    except _UNDECODABLE as exc:
        raise _not_msgpack(exc) from None
    if reply.version[0] != _MAJOR:
        raise _mismatch(reply.version)
    return reply


def _loose_reply(frame: bytes) -> Reply:
    try:
        head = _LOOSE_REPLY_HEAD.decode(frame)
    except msgspec.ValidationError:
        raise _not_a_map(frame, "reply") from None
    except _UNDECODABLE as exc:
        raise _not_msgpack(exc) from None
    check_version(head.v)
    if type(head.id) is not int:
        raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"reply.id must be an int, not {type(head.id).__name__}")
    try:
        code = ErrorCode(head.code) if type(head.code) is int else ErrorCode.INTERNAL
    except ValueError:
        code = ErrorCode.INTERNAL
    detail = head.detail if isinstance(head.detail, dict) else {}
    body = head.b if _is_map(head.b) else _EMPTY_MAP
    message = head.msg if isinstance(head.msg, str) else ""
    return Reply(version=tuple(head.v), request_id=head.id, ok=head.ok is True, code=code, message=message, detail=detail, body=body)


def decode_body(cls: type[_M], body: msgspec.Raw | bytes) -> _M:
    """A reply body as ``cls``; a missing or wrongly typed field is INVALID_ARGUMENT
    naming its path."""
    try:
        return _decoder(cls).decode(body)
    except msgspec.ValidationError as exc:
        raise ProtocolError(ErrorCode.INVALID_ARGUMENT, _field_error(cls.__name__, exc)) from None
    except _UNDECODABLE as exc:
        raise _not_msgpack(exc) from None


def encode_event(message: FdBatch | Notice) -> bytes:
    """An fd-channel message; one msgpack cannot carry is the daemon's INTERNAL error."""
    try:
        return _ENCODER.encode(_RequestFrame(_VERSION, 0, message.TYPE, message))
    except (OverflowError, TypeError, msgspec.EncodeError) as exc:
        raise ProtocolError(ErrorCode.INTERNAL, f"{type(message).__name__} cannot be encoded: {exc}") from None


def decode_event(frame: bytes) -> FdBatch | Notice:
    head = _head(frame, "fd-channel message")
    cls = EVENTS.get(head.t)
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_MESSAGE, f"unknown fd-channel message type {head.t!r}")
    return decode_body(cls, head.b)


# ---------------------------------------------------------------------------
# Plain data, for tools and tests
# ---------------------------------------------------------------------------


def to_wire(value: Any) -> Any:
    """A message (or nested value) as plain data: maps, lists, numbers, strings, bytes;
    enums as their values. What ``json.dumps`` takes, bytes aside."""
    return msgspec.to_builtins(value, builtin_types=(bytes,))


def from_wire(cls: type[_M], data: Any) -> _M:
    """Build ``cls`` from plain data (or a reply's raw body), refusing missing or
    wrongly typed fields with INVALID_ARGUMENT naming the path. Unknown keys are
    ignored: a peer speaking a newer minor version may add fields."""
    if isinstance(data, msgspec.Raw):
        return decode_body(cls, data)
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise ProtocolError(ErrorCode.INVALID_ARGUMENT, _field_error(getattr(cls, "__name__", "message"), exc)) from None
