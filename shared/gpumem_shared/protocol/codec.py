"""The envelopes, and the codec: a message to a frame and back.

Every message is a ``msgspec.Struct``: msgspec checks types while it decodes (a bool
is not an int, a float is not an int), so a frame becomes a typed message in one pass.
The envelope is decoded first with the body left raw, then the body with the decoder
of the type the envelope names; only a frame the strict envelope refuses goes through
the slower path that works out which error code it earns. Hand-written checks against
the annotations cost about 20 times more per request, and dict-of-dict messages were
refused for having no schema at all.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import msgspec

from gpumem_shared.protocol.base import Message, RequestMessage
from gpumem_shared.protocol.catalog import EVENTS, REQUESTS
from gpumem_shared.protocol.codes import MAX_FRAME_BYTES, MIN_HELLO_VERSION, PROTOCOL_VERSION, ErrorCode, ProtocolError
from gpumem_shared.protocol.session import FdBatch, Notice

# msgpack's integer range: what lies outside cannot be encoded at all.
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1

log = logging.getLogger("gpumem_shared.protocol")


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
    """Refuse a peer of this major older than MIN_HELLO_VERSION (see the package doc)."""
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
