"""The gpumemd wire protocol: every message, the envelopes, the error codes.

Both the daemon and its clients import this module; it depends on the standard
library and msgpack only, so nothing here can drag torch, zmq or CUDA into a peer.

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
maps with named fields, so a newer minor can add fields that an older peer ignores.
Error codes are append-only: a number, once shipped, never changes meaning.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, ClassVar, Union

import msgpack

PROTOCOL_VERSION: tuple[int, int] = (1, 1)

# A control frame is a few hundred bytes; anything near this bound is an attack or
# a bug, and unpacking it would let one peer make the daemon allocate freely.
MAX_FRAME_BYTES = 1 << 20

# SCM_MAX_FD: Linux refuses more than 253 descriptors in one sendmsg.
MAX_FDS_PER_MESSAGE = 253


class ErrorCode(enum.IntEnum):
    """Stable numbered error codes. Append only; never renumber."""

    OK = 0
    BAD_MESSAGE = 1  # not msgpack, not a map, no envelope, frame too large
    UNKNOWN_MESSAGE = 2  # message type this daemon does not know
    PROTOCOL_MISMATCH = 3  # major protocol versions differ
    INVALID_ARGUMENT = 4  # missing or wrongly typed field, bad size, bad name
    NO_SESSION = 5  # request needs a session (HELLO on the fd channel first)
    NOT_FOUND = 6  # no such arena or chunk
    ALREADY_EXISTS = 7  # duplicate arena name
    PERMISSION_DENIED = 8  # acting on what another client owns
    OUT_OF_MEMORY = 9  # commit beyond the device's free memory
    UNEXPECTED_FDS = 10  # the client sent descriptors nobody asked for
    SHUTTING_DOWN = 11  # the daemon is stopping
    DRIVER_ERROR = 12  # the CUDA driver (or the host backend) failed
    INTERNAL = 13  # a daemon bug; details are in the daemon's log
    ROUND_FAILED = 14  # a KV commit round failed: deadline passed, or the budget is short


class MsgType(enum.IntEnum):
    HELLO = 1
    PING = 2
    STATUS = 3
    ARENA_CREATE = 10
    ARENA_ATTACH = 11
    ARENA_SHARE = 12
    ARENA_COMMIT = 13
    ARENA_DECOMMIT = 14
    ARENA_SYNC = 15
    ARENA_RELEASE = 16
    CHUNKS_UNMAPPED = 17
    ARENA_PLACEHOLDER = 18
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


class RoundState(str, enum.Enum):
    OPEN = "open"
    AWAITING_SHRINK = "awaiting-shrink"
    COMMITTED = "committed"
    FAILED = "failed"


class RoundPolicy(str, enum.Enum):
    PARTIAL = "partial"  # at the deadline, commit for the members that reported
    FAIL = "fail"  # at the deadline, fail the round


class NoticeKind(str, enum.Enum):
    STOPPING = "stopping"
    ARENA_GROWN = "arena-grown"
    ARENA_RETIRED = "arena-retired"
    KV_SHRINK = "kv-shrink"


class ProtocolError(Exception):
    """A request the daemon refuses; becomes an error reply, never a traceback."""

    def __init__(self, code: ErrorCode, message: str, **detail: int | str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


# ---------------------------------------------------------------------------
# Typed codec: dataclasses <-> msgpack maps, checked against the annotations.
# ---------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        hints = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
        _HINTS[cls] = hints
    return hints


# Per-class caches of what the codec needs: the hot path must not walk dataclass
# fields and type hints on every message.
_WIRE_NAMES: dict[type, tuple[str, ...]] = {}
_FIELDS: dict[type, list[tuple[str, Any, bool]]] = {}
_SCALARS = (int, str, bytes, float, bool, type(None))


def to_wire(value: Any) -> Any:
    """A message (or nested value) as plain msgpack-able data."""
    cls = type(value)
    if cls in _SCALARS:
        return value
    names = _WIRE_NAMES.get(cls)
    if names is not None:
        return {name: to_wire(getattr(value, name)) for name in names} if names else {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _WIRE_NAMES[cls] = tuple(_hints(cls))
        return {name: to_wire(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def _check(value: Any, hint: Any, where: str) -> Any:
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        for option in typing.get_args(hint):
            try:
                return _check(value, option, where)
            except ProtocolError:
                continue
        raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"{where} has the wrong type ({type(value).__name__})")
    if hint is type(None):
        if value is None:
            return None
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(hint)
            return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            key_hint, value_hint = typing.get_args(hint)
            return {_check(k, key_hint, where): _check(v, value_hint, f"{where}.{k}") for k, v in value.items()}
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return from_wire(hint, value, where)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(hint, type) and isinstance(value, hint):
        return value
    expected = getattr(hint, "__name__", str(hint))
    raise ProtocolError(
        ErrorCode.INVALID_ARGUMENT, f"{where} must be {expected}, not {type(value).__name__}"
    )


def from_wire(cls: type[_M], data: Any, where: str | None = None) -> _M:
    """Build ``cls`` from a decoded map, refusing missing or wrongly typed fields.

    Unknown keys are ignored: a peer speaking a newer minor version may add fields.
    """
    if not isinstance(data, dict):
        where = where or getattr(cls, "__name__", "message")
        raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"{where} must be a map")
    table = _FIELDS.get(cls)
    if table is None:
        hints = _hints(cls)
        table = _FIELDS[cls] = [
            (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        ]
    if not table:
        return cls()
    where = where or getattr(cls, "__name__", "message")
    kwargs: dict[str, Any] = {}
    for name, hint, required in table:
        if name in data:
            kwargs[name] = _check(data[name], hint, f"{where}.{name}")
        elif required:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"{where}.{name} is missing")
    return cls(**kwargs)


_M = typing.TypeVar("_M")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"frame is not valid msgpack ({type(exc).__name__})") from None


# ---------------------------------------------------------------------------
# Envelopes
# ---------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Request:
    request_id: int
    message: Any  # one of the request dataclasses registered below


@dataclasses.dataclass(slots=True)
class Reply:
    request_id: int
    ok: bool
    code: ErrorCode
    message: str
    detail: dict[str, int | str]
    body: dict[str, Any]


def encode_request(request_id: int, message: Any) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": request_id, "t": message.TYPE, "b": to_wire(message)})


def decode_request(frame: bytes) -> Request:
    """Decode a request, raising ProtocolError with the request id when it is known."""
    data = unpack(frame)
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "request is not a map")
    request_id = data.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "request has no integer 'id'")
    try:
        check_version(data.get("v"))
        msg_type = data.get("t")
        cls = REQUESTS.get(msg_type) if isinstance(msg_type, int) and not isinstance(msg_type, bool) else None
        if cls is None:
            raise ProtocolError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {msg_type!r}")
        return Request(request_id, from_wire(cls, data.get("b", {})))
    except ProtocolError as exc:
        exc.detail.setdefault("request_id", request_id)
        raise


def check_version(version: Any) -> None:
    # Fast path: exactly what every current peer sends.
    if type(version) is list and len(version) == 2 and type(version[0]) is int and type(version[1]) is int and version[0] == PROTOCOL_VERSION[0]:
        return
    if (
        not isinstance(version, (list, tuple))
        or len(version) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in version)
    ):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "envelope has no protocol version 'v' = [major, minor]")
    if version[0] != PROTOCOL_VERSION[0]:
        raise ProtocolError(
            ErrorCode.PROTOCOL_MISMATCH,
            f"peer speaks protocol {version[0]}.{version[1]}, this side "
            f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}; upgrade the older of the client and gpumemd",
            peer=f"{version[0]}.{version[1]}",
            ours=f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}",
        )


def encode_reply(request_id: int, body: Any) -> bytes:
    return pack(
        {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "code": 0, "msg": "", "detail": {}, "b": to_wire(body)}
    )


def encode_error(request_id: int, error: ProtocolError) -> bytes:
    detail = {k: v for k, v in error.detail.items() if k != "request_id"}
    return pack(
        {
            "v": PROTOCOL_VERSION,
            "id": request_id,
            "ok": False,
            "code": int(error.code),
            "msg": error.message,
            "detail": detail,
            "b": {},
        }
    )


def decode_reply(frame: bytes) -> Reply:
    data = unpack(frame)
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "reply is not a map")
    check_version(data.get("v"))
    raw_code = data.get("code", ErrorCode.INTERNAL)
    if raw_code == 0 and type(raw_code) is int:
        code = ErrorCode.OK
    else:
        try:
            code = ErrorCode(raw_code)
        except ValueError:
            code = ErrorCode.INTERNAL
    rid = data.get("id")
    return Reply(
        request_id=rid if type(rid) is int else _check(rid, int, "reply.id"),
        ok=data.get("ok") is True,
        code=code,
        message=str(data.get("msg", "")),
        detail=data.get("detail") if isinstance(data.get("detail"), dict) else {},
        body=data.get("b") if isinstance(data.get("b"), dict) else {},
    )


# ---------------------------------------------------------------------------
# Shared value types
# ---------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class DeviceInfo:
    index: int  # the daemon's device index (nvidia-smi order)
    uuid: str  # "GPU-..." for CUDA, "HOST-..." for the host backend
    name: str
    total_bytes: int
    granularity: int  # every size on the wire is a multiple of this


@dataclasses.dataclass(slots=True)
class ChunkView:
    id: int
    offset: int  # from the arena's base address
    size: int


@dataclasses.dataclass(slots=True)
class ArenaView:
    name: str
    owner: str
    address: int  # the planned base; every client maps the arena here
    reserved: int
    committed: int
    granularity: int


# ---------------------------------------------------------------------------
# Messages. Each request names its reply type; docs/protocol.md lists them.
# ---------------------------------------------------------------------------

REQUESTS: dict[int, type] = {}


def request(msg_type: MsgType, reply: type, *, needs_session: bool = True, while_stopping: bool = False) -> Any:
    def register(cls: type) -> type:
        cls = dataclasses.dataclass(slots=True)(cls)
        cls.TYPE = msg_type  # type: ignore[attr-defined]
        cls.REPLY = reply  # type: ignore[attr-defined]
        cls.NEEDS_SESSION = needs_session  # type: ignore[attr-defined]
        cls.WHILE_STOPPING = while_stopping  # type: ignore[attr-defined]
        REQUESTS[int(msg_type)] = cls
        return cls

    return register


@dataclasses.dataclass(slots=True)
class HelloReply:
    protocol: list[int]
    daemon_version: str
    daemon_pid: int
    session_id: int
    token: bytes  # the session's ZeroMQ routing id; proves the session on the control channel
    backend: str  # "cuda" | "host"
    device: DeviceInfo
    # The lease table's fd rides with this reply (SCM_RIGHTS); the client maps it.
    lease_slots: int = 0


@request(MsgType.HELLO, HelloReply)
class Hello:
    """First message on the fd channel; opens the session. Credentials come from SO_PEERCRED."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str
    client_version: str = ""


@dataclasses.dataclass(slots=True)
class Ack:
    pass


@request(MsgType.PING, Ack, needs_session=False, while_stopping=True)
class Ping:
    """No-op round trip; needs no session."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]


@dataclasses.dataclass(slots=True)
class DaemonStatus:
    version: str
    protocol: str
    pid: int
    backend: str
    uptime_s: float
    runtime_dir: str
    state: str  # "serving" | "stopping"


@dataclasses.dataclass(slots=True)
class DeviceStatus:
    index: int
    uuid: str
    name: str
    total_bytes: int
    free_bytes: int  # measured (cuMemGetInfo) on CUDA; capacity minus accounted on host
    granularity: int
    accounted_bytes: int  # chunks the daemon created that are still held by someone
    reserve_bytes: int  # kept free, never committed


@dataclasses.dataclass(slots=True)
class ClientStatus:
    session_id: int
    name: str
    pid: int
    uid: int
    gid: int
    since: float  # unix time
    arenas: list[str]


@dataclasses.dataclass(slots=True)
class ArenaStatus:
    name: str
    owner: str
    owner_pid: int
    owner_alive: bool
    address: int
    reserved: int
    committed: int
    chunks: int
    shared_with: list[str]
    attached: list[str]
    retiring_bytes: int  # decommitted, still mapped by some client
    placeholder_bytes: int = 0  # small chunks the owner aliases over uncommitted space


@dataclasses.dataclass(slots=True)
class RoundMemberStatus:
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


@dataclasses.dataclass(slots=True)
class RoundStatus:
    id: int
    state: str  # open | awaiting-shrink | committed | failed
    expect: int  # pools the round waits for (0: whoever joined)
    policy: str  # what a passed deadline does: "fail" the round, or commit the "partial" set
    deadline_in_s: float  # negative once passed
    members: list[RoundMemberStatus]
    dropped: list[str]
    budget: dict[str, int]  # free, reserve, headroom, budget, minimums, committed
    error: str


@dataclasses.dataclass(slots=True)
class KvPoolStatus:
    name: str
    owner: str
    buffers: int
    bytes_per_token: int
    max_tokens: int  # declared bound
    tokens: int  # committed
    committed_bytes: int
    min_tokens: int
    shrink_request: int  # tokens the daemon asked for; -1 when none


@dataclasses.dataclass(slots=True)
class Extent:
    offset: int  # from the arena's base
    size: int


@dataclasses.dataclass(slots=True)
class GraphPoolStatus:
    id: int
    owner: str
    arena: str
    label: str
    epoch: int  # bumped by every capture into the pool and every change of its runs
    extents: list[Extent]  # the pool's segments
    free_runs: list[Extent]  # idle space between replays, largest first
    free_bytes: int
    slot: int = 0  # its lease slot in the shared lease table
    shared: bool = False  # other processes may take leases on it (and borrow its free runs)
    escaped_by: str = ""  # clients whose borrowed tensors outlived their scope: replays are refused


@dataclasses.dataclass(slots=True)
class LeaseStatus:
    pool_id: int
    slot: int
    kind: str  # capture | replay | borrow
    holder: str  # client name
    pid: int
    label: str
    since: float  # unix time

@dataclasses.dataclass(slots=True)
class StatusReply:
    daemon: DaemonStatus
    device: DeviceStatus
    clients: list[ClientStatus]
    arenas: list[ArenaStatus]
    extents: list[GraphPoolStatus]  # the graph-pool registry
    leases: list[LeaseStatus]
    rounds: list[RoundStatus] = dataclasses.field(default_factory=list)
    kv: list[KvPoolStatus] = dataclasses.field(default_factory=list)


@request(MsgType.STATUS, StatusReply, needs_session=False, while_stopping=True)
class Status:
    """Everything gpumemctl shows; needs no session."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]


@dataclasses.dataclass(slots=True)
class ArenaReply:
    arena: ArenaView


@dataclasses.dataclass(slots=True)
class MapReply:
    """Chunks to map (their fds follow on the fd channel in ``fd_batches`` FD_BATCH
    messages tagged with this request's id) and chunks to unmap (then CHUNKS_UNMAPPED)."""

    arena: ArenaView
    chunks: list[ChunkView]
    retired: list[ChunkView]
    fd_batches: int


@request(MsgType.ARENA_CREATE, ArenaReply)
class CreateArena:
    """Reserve a virtual window; no physical memory yet."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str
    reserve_bytes: int


@request(MsgType.ARENA_ATTACH, MapReply)
class AttachArena:
    """Join an arena its owner shared with this client's name; maps what is committed."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str


@request(MsgType.ARENA_SHARE, Ack)
class ShareArena:
    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str
    client: str  # a client name (as given to HELLO) allowed to attach


@request(MsgType.ARENA_COMMIT, MapReply)
class CommitArena:
    """Grow physical backing so the first ``nbytes`` of the arena are committed."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str
    nbytes: int


@request(MsgType.ARENA_DECOMMIT, MapReply)
class DecommitArena:
    """Shrink to the smallest chunk boundary >= ``to_nbytes``; the reply's ``retired``
    chunks must be unmapped and reported with CHUNKS_UNMAPPED."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str
    to_nbytes: int


@request(MsgType.ARENA_SYNC, MapReply)
class SyncArena:
    """Bring a client's mapping up to date: chunks committed since, chunks retired since."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str


@request(MsgType.ARENA_RELEASE, Ack, while_stopping=True)
class ReleaseArena:
    """Owner: destroy the arena. Sharer: detach. The client has unmapped everything first."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str


@dataclasses.dataclass(slots=True)
class PlaceholderReply:
    """The placeholder chunks (``offset`` is meaningless: 0), largest first; their fds
    follow in ``fd_batches`` FD_BATCH messages as for MapReply."""

    arena: ArenaView
    chunks: list[ChunkView]
    fd_batches: int


@request(MsgType.ARENA_PLACEHOLDER, PlaceholderReply)
class PlaceholderArena:
    """Owner only: small chunks of ``slot_bytes`` and of the granularity, for the client
    to alias over space it has not committed, so graph capture works there (capture of
    a memcpy on unmapped space fails). Idempotent per size."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str
    slot_bytes: int


@dataclasses.dataclass(slots=True)
class KvBuffer:
    name: str
    row_bytes: int  # bytes of one token row
    align: int = 0  # power of two; rows and the buffer start honour it (0: none)


@dataclasses.dataclass(slots=True)
class KvBufferView:
    name: str
    offset: int  # of the buffer's region from the arena base
    row_bytes: int
    region_bytes: int  # max_tokens rows, rounded up to the granularity


@dataclasses.dataclass(slots=True)
class KvPoolView:
    name: str
    arena: ArenaView
    buffers: list[KvBufferView]
    max_tokens: int  # the declared bound
    tokens: int  # rows committed in every buffer
    bytes_per_token: int


@dataclasses.dataclass(slots=True)
class KvDeclareReply:
    pool: KvPoolView


@request(MsgType.KV_DECLARE, KvDeclareReply)
class KvDeclare:
    """Declare a KV pool: an arena laid out as ``buffers``, each with room for
    ``max_tokens`` rows (or as many as ``reserve_bytes`` allows). Nothing is committed."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str
    buffers: list[KvBuffer]
    max_tokens: int = 0
    reserve_bytes: int = 0


@dataclasses.dataclass(slots=True)
class RoundView:
    round_id: int
    state: str
    deadline_in_s: float
    members: list[str]  # "client/pool"


@request(MsgType.ROUND_JOIN, RoundView)
class RoundJoin:
    """Join the device's open commit round (opening one if none is) with a pool."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool: str
    # How many pools the round should gather before it may commit (the largest value any
    # member gives wins): engines that start at different times then still share one
    # round. 0: commit once every member that joined has reported.
    expect: int = 0


@dataclasses.dataclass(slots=True)
class KvCommitReply:
    """The pool after a commit, grow or shrink: chunks to map (fds follow as for
    MapReply), chunks to unmap, and the budget figures of the round that decided it."""

    pool: KvPoolView
    arena: ArenaView
    chunks: list[ChunkView]
    retired: list[ChunkView]
    fd_batches: int
    round_id: int = 0
    budget: dict[str, int] = dataclasses.field(default_factory=dict)


@request(MsgType.CAPTURE_DONE, KvCommitReply)
class CaptureDone:
    """The pool's graphs are captured. The reply comes when the round commits (or fails):
    wait for it with a timeout beyond the round's deadline."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool: str
    headroom_bytes: int = 0  # activations and other memory the engine needs besides KV
    graph_pool_bytes: int = 0  # what its captured graph pools hold (already in use)
    min_tokens: int = 0
    max_tokens: int = 0  # 0: the declared bound
    weight: float = 1.0


@request(MsgType.KV_GROW, KvCommitReply)
class KvGrow:
    """Commit more rows (up to ``tokens``) if the device has the memory."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool: str
    tokens: int


@request(MsgType.KV_SHRINK, KvCommitReply)
class KvShrink:
    """The owner confirms rows from ``tokens`` on are free: the daemon decommits them
    (whole chunks: the pool may keep a few more rows) and the reply lists the chunks to
    unmap."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool: str
    tokens: int


@dataclasses.dataclass(slots=True)
class GraphPoolReply:
    pool: GraphPoolStatus


@request(MsgType.GRAPH_POOL_REGISTER, GraphPoolReply)
class RegisterGraphPool:
    """After capture: a CUDA-graph pool that lives in ``arena`` (owner only), with its
    segments and its free runs (inactive blocks, coalesced). Extents lie in committed
    memory of the arena and overlap no other registered pool."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    arena: str
    label: str
    extents: list[Extent]
    free_runs: list[Extent]
    shared: bool = False  # clients the arena is shared with may open it and borrow


@request(MsgType.GRAPH_POOL_UPDATE, GraphPoolReply)
class UpdateGraphPool:
    """New extents and free runs. The epoch goes up when they change or ``recaptured``:
    a borrower's view of the runs must never outlive them."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool_id: int
    extents: list[Extent]
    free_runs: list[Extent]
    recaptured: bool = False


@request(MsgType.GRAPH_POOL_RETIRE, Ack)
class RetireGraphPool:
    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool_id: int


@request(MsgType.GRAPH_POOL_OPEN, GraphPoolReply)
class OpenGraphPool:
    """Another client's shared graph pool, by id or by (owner, label), for a session that
    has attached its arena: to take leases on it and borrow its free runs."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool_id: int = 0
    owner: str = ""
    label: str = ""


@request(MsgType.LEASE_EVENT_PUBLISH, Ack)
class PublishLeaseEvent:
    """This session's IPC event for a shared pool (the driver's opaque handle): the
    next holder from another process waits on it."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool_id: int
    handle: bytes


@dataclasses.dataclass(slots=True)
class LeaseEventReply:
    handle: bytes


@request(MsgType.LEASE_EVENT_LOOKUP, LeaseEventReply)
class LookupLeaseEvent:
    """The IPC event that session ``session`` (as a lease word names it) published for
    the pool."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool_id: int
    session: int


@request(MsgType.GRAPH_POOL_ESCAPE, Ack)
class ReportEscape:
    """This session's tensors borrowed from the pool outlived their scope (``escaped``),
    or are gone again: while any session has such tensors, the pool's slot refuses
    replay and capture."""

    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    pool_id: int
    escaped: bool


@request(MsgType.CHUNKS_UNMAPPED, Ack, while_stopping=True)
class ChunksUnmapped:
    TYPE: ClassVar[MsgType]
    REPLY: ClassVar[type]
    name: str
    chunk_ids: list[int]


# fd channel, daemon -> client. Not requests: they carry no reply.


@dataclasses.dataclass(slots=True)
class FdBatch:
    """One descriptor per chunk id, in order, as SCM_RIGHTS."""

    TYPE: ClassVar[MsgType] = MsgType.FD_BATCH
    request_id: int = 0
    chunk_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class Notice:
    """Unsolicited news for a session: "stopping", "arena-grown", "arena-retired",
    "kv-shrink" (the daemon asks a KV pool to give back rows; see KvShrink)."""

    TYPE: ClassVar[MsgType] = MsgType.NOTICE
    kind: str = ""
    message: str = ""
    arena: str = ""
    tokens: int = 0  # "kv-shrink": the bound the daemon asks the pool to shrink to


def encode_event(message: FdBatch | Notice) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "id": 0, "t": int(message.TYPE), "b": to_wire(message)})


def decode_event(frame: bytes) -> FdBatch | Notice:
    data = unpack(frame)
    if not isinstance(data, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "fd-channel message is not a map")
    check_version(data.get("v"))
    kind = data.get("t")
    if kind == MsgType.FD_BATCH:
        return from_wire(FdBatch, data.get("b"))
    if kind == MsgType.NOTICE:
        return from_wire(Notice, data.get("b"))
    raise ProtocolError(ErrorCode.UNKNOWN_MESSAGE, f"unknown fd-channel message type {kind!r}")
