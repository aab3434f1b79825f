"""The wire codec: envelopes, typed messages, refusals with stable error codes.

Frames here are built by hand with msgpack where a test needs something the encoder
would never produce; everything else goes through the real encode/decode pair.
"""

from __future__ import annotations

import ast
import importlib
import logging
import pkgutil
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest

from gpumem_shared import protocol as p
from gpumem_shared.protocol import PROTOCOL_VERSION, ErrorCode, MsgType

GiB = 1 << 30

# One instance of every request the daemon serves, with non-default values throughout.
SAMPLES: list[Any] = [
    p.Hello(name="engine-a", client_version="0.1.0"),
    p.Resume(session_id=3, credential=b"\x01" * 32, holdings=[p.Holding(arena="kv", chunks=[1, 2])], client_version="0.1.0"),
    p.Ping(),
    p.Status(),
    p.CreateArena(name="kv", reserve_bytes=64 * GiB),
    p.AttachArena(name="kv", token="cd" * 32),
    p.ShareArena(name="kv", client="engine-b", uid=1001, gid=50),
    p.UnshareArena(name="kv", token="ab" * 32),
    p.CommitArena(name="kv", nbytes=GiB + (6 << 20)),
    p.DecommitArena(name="kv", to_nbytes=0),
    p.SyncArena(name="kv"),
    p.ReleaseArena(name="kv"),
    p.ChunksUnmapped(name="kv", chunk_ids=[7, 3, 12]),
    p.PlaceholderArena(name="kv", slot_bytes=64 << 20),
    p.KvDeclare(name="kv", buffers=[p.KvBuffer(name="k0", row_bytes=4096, align=256)], max_tokens=1024),
    p.RoundJoin(pool="kv"),
    p.CaptureDone(pool="kv", headroom_bytes=1 << 30, graph_pool_bytes=64 << 20, min_tokens=1, max_tokens=2, weight=0.5),
    p.KvGrow(pool="kv", tokens=10),
    p.KvShrink(pool="kv", tokens=5, in_use=3),
    p.KvDemand(pool="kv", in_use=0),
    p.RegisterGraphPool(arena="g", label="decode bs=8", extents=[p.Extent(offset=0, size=1 << 21)], free_runs=[p.Extent(offset=0, size=512)]),
    p.UpdateGraphPool(pool_id=1, extents=[p.Extent(offset=0, size=1 << 21)], free_runs=[], recaptured=True),
    p.RetireGraphPool(pool_id=1),
    p.OpenGraphPool(owner="engine-a", label="decode"),
    p.PublishLeaseEvent(pool_id=1, handle=bytes(range(64))),
    p.LookupLeaseEvent(pool_id=1, session=3),
    p.ReportEscape(pool_id=1, escaped=True),
    p.SleepBuffer(arena="kv", nbytes=2 << 20),
    p.FreeSleepBuffer(arena="kv"),
    p.SleepArena(name="kv", kept_bytes=2 << 20),
    p.WakeArena(name="kv"),
    p.RetainGroup(group="engine-a"),
    p.Retain(group="engine-a", name="kv", retained=False),
    p.Adopt(group="engine-a", secret="ef" * 32),
    p.AdoptDone(group="engine-a"),
    p.RetainReserve(group="engine-a", secret="ab" * 32),
]


def raw(envelope: Any) -> bytes:
    return msgpack.packb(envelope, use_bin_type=True)


def envelope(t: Any = MsgType.ARENA_COMMIT, **over: Any) -> dict:
    """A well-formed CommitArena request envelope, with ``over`` replacing its keys."""
    env: dict[str, Any] = {"v": [1, 0], "id": 41, "t": t, "b": {"name": "kv", "nbytes": 2 << 20}}
    env.update(over)
    return env


def refused(frame: bytes, code: ErrorCode) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(frame)
    assert info.value.code == code, f"expected {code.name}, got {info.value.code.name}: {info.value.message}"
    return info.value


# --------------------------------------------------------------------------- stable numbers


def test_error_code_numbers_never_change() -> None:
    assert {c.name: c.value for c in ErrorCode} == {
        "OK": 0,
        "BAD_MESSAGE": 1,
        "UNKNOWN_MESSAGE": 2,
        "PROTOCOL_MISMATCH": 3,
        "INVALID_ARGUMENT": 4,
        "NO_SESSION": 5,
        "NOT_FOUND": 6,
        "ALREADY_EXISTS": 7,
        "PERMISSION_DENIED": 8,
        "OUT_OF_MEMORY": 9,
        "UNEXPECTED_FDS": 10,
        "SHUTTING_DOWN": 11,
        "DRIVER_ERROR": 12,
        "INTERNAL": 13,
        "ROUND_FAILED": 14,
        "SESSION_LOST": 15,
        "RESOURCE_EXHAUSTED": 16,
        "ARENA_ASLEEP": 17,
        "HOST_LIMIT": 18,
        "GROUP_HELD": 20,
        "NOT_FENCED": 21,
    }


def test_message_type_numbers_never_change() -> None:
    assert {t.name: t.value for t in MsgType} == {
        "HELLO": 1,
        "PING": 2,
        "STATUS": 3,
        "RESUME": 4,
        "ARENA_CREATE": 10,
        "ARENA_ATTACH": 11,
        "ARENA_SHARE": 12,
        "ARENA_COMMIT": 13,
        "ARENA_DECOMMIT": 14,
        "ARENA_SYNC": 15,
        "ARENA_RELEASE": 16,
        "CHUNKS_UNMAPPED": 17,
        "ARENA_PLACEHOLDER": 18,
        "ARENA_UNSHARE": 19,
        "KV_DECLARE": 20,
        "ROUND_JOIN": 21,
        "CAPTURE_DONE": 22,
        "KV_GROW": 23,
        "KV_SHRINK": 24,
        "KV_DEMAND": 25,
        "GRAPH_POOL_REGISTER": 30,
        "GRAPH_POOL_UPDATE": 31,
        "GRAPH_POOL_RETIRE": 32,
        "GRAPH_POOL_OPEN": 33,
        "LEASE_EVENT_PUBLISH": 34,
        "LEASE_EVENT_LOOKUP": 35,
        "GRAPH_POOL_ESCAPE": 36,
        "SLEEP_BUFFER": 40,
        "SLEEP_BUFFER_FREE": 41,
        "ARENA_SLEEP": 42,
        "ARENA_WAKE": 43,
        "RETAIN_GROUP": 50,
        "RETAIN": 51,
        "ADOPT": 52,
        "ADOPT_DONE": 53,
        "RETAIN_RESERVE": 54,
        "FD_BATCH": 100,
        "NOTICE": 101,
    }


def test_every_request_type_is_registered_under_its_number() -> None:
    assert {type(m) for m in SAMPLES} == set(p.REQUESTS.values()), "a request type has no sample here"
    for number, cls in p.REQUESTS.items():
        assert cls.TYPE == number
        assert number < MsgType.FD_BATCH, "fd-channel events are not requests"
        assert issubclass(cls.REPLY, p.Message) and cls.REPLY is not p.Message


def test_the_package_exports_every_name_and_registers_every_request() -> None:
    """Peers read the protocol's modules as one (``p.X``): a name defined in one of them
    and left out of the package would be a message a peer cannot name, and a request
    class left out of REQUESTS one the daemon refuses as unknown."""
    defined: dict[str, Any] = {}
    for info in pkgutil.iter_modules(p.__path__):
        module = importlib.import_module(f"{p.__name__}.{info.name}")
        for node in ast.parse(Path(str(module.__file__)).read_text()).body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets if isinstance(node, ast.Assign) else []
            names = [node.name] if isinstance(node, (ast.ClassDef, ast.FunctionDef)) else [t.id for t in targets if isinstance(t, ast.Name)]
            for name in names:
                value = getattr(module, name)
                if not name.startswith("_") and not isinstance(value, logging.Logger):
                    assert name not in defined, f"{name} is defined twice in the protocol package"
                    defined[name] = value
    assert sorted(p.__all__) == sorted(defined)
    assert all(getattr(p, name) is value for name, value in defined.items())
    requests = {v for v in defined.values() if isinstance(v, type) and issubclass(v, p.RequestMessage) and v is not p.RequestMessage}
    assert requests == set(p.REQUESTS.values())


def test_admission_flags_of_every_request() -> None:
    """The dispatcher reads these: an anonymous peer may only look; a stopping daemon
    still serves looking and giving memory back."""
    anonymous = {t.__name__ for t in p.REQUESTS.values() if not t.NEEDS_SESSION}
    stopping = {t.__name__ for t in p.REQUESTS.values() if t.WHILE_STOPPING}
    assert anonymous == {"Ping", "Status"}
    assert stopping == {"Ping", "Status", "ChunksUnmapped", "ReleaseArena"}


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_request_round_trip(message: Any) -> None:
    frame = p.encode_request(123456, message)
    wire = msgpack.unpackb(frame, raw=False)
    assert wire["v"] == list(p.PROTOCOL_VERSION)
    assert wire["t"] == int(message.TYPE)
    decoded = p.decode_request(frame)
    assert decoded == p.Request(123456, message)
    assert type(decoded.message) is type(message)


def test_optional_field_takes_its_default() -> None:
    frame = raw(envelope(MsgType.HELLO, b={"name": "engine-a"}))
    assert p.decode_request(frame).message == p.Hello(name="engine-a", client_version="")


def test_body_may_be_absent_for_messages_without_fields() -> None:
    env = envelope(MsgType.PING)
    del env["b"]
    assert p.decode_request(raw(env)) == p.Request(41, p.Ping(), (1, 0))


def test_unknown_fields_are_ignored_in_body_and_envelope() -> None:
    env = envelope(b={"name": "kv", "nbytes": 4 << 20, "hint": "from a newer minor", "flags": [1, 2]}, extra={"x": 1})
    assert p.decode_request(raw(env)) == p.Request(41, p.CommitArena(name="kv", nbytes=4 << 20), (1, 0))


def test_newer_minor_version_is_accepted() -> None:
    assert p.decode_request(raw(envelope(v=[1, 99]))).message == p.CommitArena(name="kv", nbytes=2 << 20)


@pytest.mark.parametrize(
    "frame",
    [b"\xc1", b"\x83\xa1v", b"", raw(envelope()) + b"\x00"],
    ids=["reserved-byte", "truncated-map", "empty", "trailing-bytes"],
)
def test_malformed_msgpack_is_bad_message(frame: bytes) -> None:
    assert "not valid msgpack" in refused(frame, ErrorCode.BAD_MESSAGE).message


DEEP = b"\x91" * 100_000 + b"\xc0"  # a list in a list ... 100,000 deep: more than the decoder recurses


def test_deep_nesting_is_bad_message_never_a_recursion_error() -> None:
    assert refused(DEEP, ErrorCode.BAD_MESSAGE).message == "request is not a map"
    # the same depth inside the body of a valid envelope
    head = {"v": [1, 0], "id": 41, "t": int(MsgType.PING)}
    frame = b"\x84" + b"".join(raw(k) + raw(v) for k, v in head.items()) + raw("b") + DEEP
    error = refused(frame, ErrorCode.BAD_MESSAGE)
    assert "nests deeper" in error.message


def test_truncated_array_is_bad_message() -> None:
    refused(b"\x92\x01", ErrorCode.BAD_MESSAGE)


@pytest.mark.parametrize("payload", [[1, 0, 41], 5, "hello", None], ids=["list", "int", "str", "nil"])
def test_non_map_frame_is_bad_message(payload: Any) -> None:
    assert refused(raw(payload), ErrorCode.BAD_MESSAGE).message == "request is not a map"


def test_non_string_map_keys_are_bad_message() -> None:
    # an otherwise valid request: only the integer key is wrong
    error = refused(raw({**envelope(), 1: 2}), ErrorCode.BAD_MESSAGE)
    assert error.message == "request map has keys that are not strings"


@pytest.mark.parametrize("bad_id", [None, "41", True, 4.0, [41]], ids=["missing", "str", "bool", "float", "list"])
def test_request_without_integer_id_is_bad_message(bad_id: Any) -> None:
    env = envelope()
    if bad_id is None:
        del env["id"]
    else:
        env["id"] = bad_id
    error = refused(raw(env), ErrorCode.BAD_MESSAGE)
    assert "request_id" not in error.detail  # no id to answer to


@pytest.mark.parametrize("version", [None, [1], [1, 0, 0], "1.0", [True, 0], [1, "0"]])
def test_missing_or_malformed_version_is_bad_message(version: Any) -> None:
    env = envelope(v=version)
    if version is None:
        del env["v"]
    error = refused(raw(env), ErrorCode.BAD_MESSAGE)
    assert error.detail["request_id"] == 41


@pytest.mark.parametrize("major", [0, 2])
def test_other_major_version_is_protocol_mismatch(major: int) -> None:
    error = refused(raw(envelope(v=[major, 3])), ErrorCode.PROTOCOL_MISMATCH)
    assert error.detail == {"peer": f"{major}.3", "ours": "%d.%d" % PROTOCOL_VERSION, "request_id": 41}
    assert "upgrade" in error.message


@pytest.mark.parametrize("t", [999, 0, int(MsgType.FD_BATCH), int(MsgType.NOTICE), "13", None, True, 13.0])
def test_unknown_message_type(t: Any) -> None:
    env = envelope(t=t)
    if t is None:
        del env["t"]
    error = refused(raw(env), ErrorCode.UNKNOWN_MESSAGE)
    assert error.detail["request_id"] == 41


@pytest.mark.parametrize(
    "frame, expected",
    [
        (raw(envelope()), 41),
        (raw(envelope(v=[9, 0])), 41),  # another major: refused, but the id is read
        (raw({"id": 41}), 41),
        (raw(envelope(t="nonsense", b=[1])), 41),
        (raw(envelope(id=True)), 0),
        (raw({**envelope(), 1: 2}), 0),
        (b"\xc1", 0),
        (raw(envelope()) + b"\x00", 0),  # trailing bytes: not one msgpack value
        (raw(envelope(b="x" * p.MAX_FRAME_BYTES)), 0),
    ],
    ids=["good", "other-major", "id-only", "bad-type-and-body", "bool-id", "non-str-key", "not-msgpack", "trailing", "too-large"],
)
def test_request_id_of_reads_the_id_whatever_the_rest(frame: bytes, expected: int) -> None:
    assert p.request_id_of(frame) == expected


@pytest.mark.parametrize("credential", [b"", bytes(31), bytes(33)], ids=["empty", "short", "long"])
def test_a_resume_credential_of_another_length_is_refused(credential: bytes) -> None:
    body = {"session_id": 3, "credential": credential}
    error = refused(raw(envelope(MsgType.RESUME, b=body)), ErrorCode.INVALID_ARGUMENT)
    assert error.message.startswith("Resume.credential: expected `bytes` of length")
    assert p.decode_request(raw(envelope(MsgType.RESUME, b={**body, "credential": bytes(p.RESUME_CREDENTIAL_BYTES)}))).message.credential


def test_missing_field_is_invalid_argument_naming_it() -> None:
    error = refused(raw(envelope(b={"name": "kv"})), ErrorCode.INVALID_ARGUMENT)
    assert error.message == "CommitArena.nbytes is missing"
    assert error.detail == {"request_id": 41}


def test_body_that_is_not_a_map_is_invalid_argument() -> None:
    error = refused(raw(envelope(b=["kv", 2 << 20])), ErrorCode.INVALID_ARGUMENT)
    assert error.message == "CommitArena: expected `map`, got `array`"
    assert error.detail == {"request_id": 41}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "kv", "nbytes": True}, "CommitArena.nbytes"),  # bool is not an int on the wire
        ({"name": "kv", "nbytes": "4194304"}, "CommitArena.nbytes"),
        ({"name": "kv", "nbytes": 4194304.0}, "CommitArena.nbytes"),
        ({"name": "kv", "nbytes": None}, "CommitArena.nbytes"),
        ({"name": 7, "nbytes": 4194304}, "CommitArena.name"),
        ({"name": b"kv", "nbytes": 4194304}, "CommitArena.name"),
        ({"name": ["kv"], "nbytes": 4194304}, "CommitArena.name"),
    ],
)
def test_wrongly_typed_field_is_invalid_argument(body: dict, field: str) -> None:
    error = refused(raw(envelope(b=body)), ErrorCode.INVALID_ARGUMENT)
    assert error.message.startswith(f"{field}: expected `")
    assert error.detail == {"request_id": 41}


@pytest.mark.parametrize(
    ("t", "body", "field", "limit"),
    [
        (MsgType.GRAPH_POOL_REGISTER, {"arena": "g", "label": "l", "extents": "many", "free_runs": []}, "extents", p.MAX_POOL_EXTENTS),
        (MsgType.GRAPH_POOL_UPDATE, {"pool_id": 1, "extents": [], "free_runs": "many"}, "free_runs", p.MAX_POOL_EXTENTS),
        (MsgType.KV_DECLARE, {"name": "kv", "buffers": "many", "max_tokens": 16}, "buffers", p.MAX_KV_BUFFERS),
    ],
)
def test_lists_a_client_makes_the_daemon_keep_are_bounded(t: MsgType, body: dict, field: str, limit: int) -> None:
    item = {"offset": 0, "size": 4096} if field != "buffers" else {"name": "k", "row_bytes": 64}
    at_limit = {**body, field: [item] * limit}
    assert len(getattr(p.decode_request(raw(envelope(t, b=at_limit))).message, field)) == limit
    error = refused(raw(envelope(t, b={**body, field: [item] * (limit + 1)})), ErrorCode.INVALID_ARGUMENT)
    assert error.message == f"{p.REQUESTS[t].__name__}.{field}: expected `array` of length <= {limit}"


@pytest.mark.parametrize(
    ("chunk_ids", "where"),
    [([[1]], "chunk_ids[0]"), ([1, 2, True], "chunk_ids[2]"), ([1, "2"], "chunk_ids[1]"), ("123", "chunk_ids"), (5, "chunk_ids")],
)
def test_list_fields_check_every_item(chunk_ids: Any, where: str) -> None:
    env = envelope(MsgType.CHUNKS_UNMAPPED, b={"name": "kv", "chunk_ids": chunk_ids})
    error = refused(raw(env), ErrorCode.INVALID_ARGUMENT)
    assert error.message.startswith(f"ChunksUnmapped.{where}: expected `")


def test_oversize_frame_is_refused_before_unpacking() -> None:
    frame = raw(envelope(b={"name": "kv", "nbytes": 2 << 20, "pad": "x" * p.MAX_FRAME_BYTES}))
    error = refused(frame, ErrorCode.BAD_MESSAGE)
    assert str(p.MAX_FRAME_BYTES) in error.message and str(len(frame)) in error.message


def test_frame_of_exactly_the_limit_is_decoded() -> None:
    def padded(n: int) -> bytes:
        return raw(envelope(b={"name": "kv", "nbytes": 2 << 20, "pad": "x" * n}))

    overhead = len(padded(100_000)) - 100_000  # constant once the str needs a 32-bit length
    frame = padded(p.MAX_FRAME_BYTES - overhead)
    assert len(frame) == p.MAX_FRAME_BYTES
    assert p.decode_request(frame).message == p.CommitArena(name="kv", nbytes=2 << 20)
    refused(padded(p.MAX_FRAME_BYTES - overhead + 1), ErrorCode.BAD_MESSAGE)


# --------------------------------------------------------------------------- replies


def test_ok_reply_round_trip_with_nested_body() -> None:
    body = p.MapReply(
        arena=p.ArenaView(
            name="kv", owner="engine-a", address=0x2000_0000_0000, reserved=64 * GiB, committed=6 << 20, granularity=2 << 20
        ),
        chunks=[p.ChunkView(id=1, offset=0, size=4 << 20), p.ChunkView(id=2, offset=4 << 20, size=2 << 20)],
        retired=[],
        fd_batches=1,
    )
    frame = p.encode_reply(9, body)
    reply = p.decode_reply(frame)
    assert (reply.request_id, reply.ok, reply.code, reply.message, reply.detail) == (9, True, ErrorCode.OK, "", {})
    assert msgpack.unpackb(frame, raw=False)["b"] == p.to_wire(body)
    assert p.decode_body(p.MapReply, reply.body) == p.from_wire(p.MapReply, reply.body) == body


def test_hello_reply_round_trip_keeps_bytes_token() -> None:
    hello = p.HelloReply(
        protocol=[1, 0],
        daemon_version="0.1.0",
        daemon_pid=321,
        session_id=5,
        token=b"\x00\xffrouting-id\x01",
        backend="host",
        device=p.DeviceInfo(index=0, uuid="HOST-1", name="host", total_bytes=4 * GiB, granularity=2 << 20),
    )
    assert p.from_wire(p.HelloReply, p.decode_reply(p.encode_reply(1, hello)).body) == hello


def test_empty_ack_reply() -> None:
    reply = p.decode_reply(p.encode_reply(3, p.Ack()))
    assert reply.ok and bytes(reply.body) == raw({}) and p.decode_body(p.Ack, reply.body) == p.Ack()


def test_error_reply_carries_code_message_and_detail_but_not_request_id() -> None:
    error = p.ProtocolError(ErrorCode.OUT_OF_MEMORY, "committing 8 bytes needs more", requested=8 << 30, available=1 << 30)
    error.detail["request_id"] = 77  # as decode_request or the server leaves it
    reply = p.decode_reply(p.encode_error(77, error))
    assert reply.request_id == 77
    assert reply.ok is False
    assert reply.code is ErrorCode.OUT_OF_MEMORY
    assert reply.message == "committing 8 bytes needs more"
    assert reply.detail == {"requested": 8 << 30, "available": 1 << 30}
    assert bytes(reply.body) == raw({})
    assert error.detail["request_id"] == 77, "encoding must not strip the caller's exception"


def test_reply_with_unknown_code_decodes_as_internal() -> None:
    reply = p.decode_reply(raw({"v": [1, 0], "id": 1, "ok": False, "code": 9999, "msg": "new", "detail": {}, "b": {}}))
    assert reply.code is ErrorCode.INTERNAL and reply.message == "new"


def test_reply_fields_of_the_wrong_shape_are_defaulted_not_trusted() -> None:
    reply = p.decode_reply(raw({"v": [1, 0], "id": 1, "ok": 1, "detail": [1], "b": "x"}))
    assert reply.ok is False  # only a real true is success
    assert reply.code is ErrorCode.INTERNAL  # no code at all
    assert (reply.message, reply.detail, bytes(reply.body)) == ("", {}, raw({}))


def test_reply_refusals() -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_reply(raw([1, 2]))
    assert info.value.code is ErrorCode.BAD_MESSAGE
    with pytest.raises(p.ProtocolError) as info:
        p.decode_reply(raw({"v": [2, 0], "id": 1, "ok": True}))
    assert info.value.code is ErrorCode.PROTOCOL_MISMATCH
    with pytest.raises(p.ProtocolError) as info:
        p.decode_reply(raw({"v": [1, 0], "ok": True}))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and "reply.id" in info.value.message
    with pytest.raises(p.ProtocolError) as info:
        p.decode_reply(b"\xc1")
    assert info.value.code is ErrorCode.BAD_MESSAGE


def test_nested_type_error_names_the_path() -> None:
    body = {
        "arena": {"name": "kv", "owner": "a", "address": 1, "reserved": 2, "committed": 0, "granularity": 2},
        "chunks": [{"id": 1, "offset": 0, "size": 2}, {"id": 2, "offset": "2", "size": 2}],
        "retired": [],
        "fd_batches": 1,
    }
    with pytest.raises(p.ProtocolError) as info:
        p.from_wire(p.MapReply, body)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.message == "MapReply.chunks[1].offset: expected `int`, got `str`"
    with pytest.raises(p.ProtocolError) as info:
        p.from_wire(p.MapReply, {**body, "chunks": [{"id": 1, "offset": 0}]})
    assert info.value.message == "MapReply.chunks[0].size is missing"


def test_float_fields_accept_ints_but_not_bools() -> None:
    status = {"version": "0.1.0", "protocol": "1.0", "pid": 1, "backend": "host", "runtime_dir": "/r", "state": "serving"}
    decoded = p.from_wire(p.DaemonStatus, {**status, "uptime_s": 3})
    assert decoded.uptime_s == 3.0 and isinstance(decoded.uptime_s, float)
    with pytest.raises(p.ProtocolError):
        p.from_wire(p.DaemonStatus, {**status, "uptime_s": True})


# --------------------------------------------------------------------------- encoding never raises out of the daemon


@pytest.mark.parametrize("huge", [1 << 64, (1 << 70) + 3, -(1 << 63) - 1], ids=["2**64", "2**70+3", "-2**63-1"])
def test_error_detail_msgpack_cannot_carry_travels_as_text(huge: int) -> None:
    error = p.ProtocolError(ErrorCode.INVALID_ARGUMENT, "too big", requested=huge, limit=1 << 40, what="kv", flag=True)
    reply = p.decode_reply(p.encode_error(5, error))
    assert (reply.request_id, reply.code, reply.message) == (5, ErrorCode.INVALID_ARGUMENT, "too big")
    assert reply.detail == {"requested": str(huge), "limit": 1 << 40, "what": "kv", "flag": "True"}  # a bool is no int here


def test_error_detail_at_the_edges_of_msgpack_stays_a_number() -> None:
    error = p.ProtocolError(ErrorCode.INVALID_ARGUMENT, "edges", top=(1 << 64) - 1, bottom=-(1 << 63))
    assert p.decode_reply(p.encode_error(1, error)).detail == {"top": (1 << 64) - 1, "bottom": -(1 << 63)}


def test_a_reply_body_msgpack_cannot_carry_becomes_an_internal_error(caplog: pytest.LogCaptureFixture) -> None:
    body = p.ArenaReply(arena=p.ArenaView(name="kv", owner="a", address=1 << 64, reserved=0, committed=0, granularity=1))
    with caplog.at_level(logging.ERROR, logger="gpumem_shared.protocol"):
        reply = p.decode_reply(p.encode_reply(12, body))
    assert (reply.request_id, reply.ok, reply.code) == (12, False, ErrorCode.INTERNAL)
    assert "ArenaReply" in reply.message and "gpumemd bug" in reply.message
    assert any("request 12" in r.getMessage() for r in caplog.records), "the daemon's log names the request"


def test_a_request_msgpack_cannot_carry_is_the_callers_invalid_argument() -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.encode_request(1, p.CommitArena(name="kv", nbytes=1 << 64))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and "CommitArena" in info.value.message


def test_ints_up_to_the_msgpack_limits_round_trip() -> None:
    for nbytes in ((1 << 64) - 1, 1 << 62, -(1 << 63)):
        assert p.decode_request(p.encode_request(1, p.CommitArena(name="kv", nbytes=nbytes))).message.nbytes == nbytes


# --------------------------------------------------------------------------- typed fields


def _round_status(budget: Any) -> p.RoundStatus:
    return p.RoundStatus(
        id=1, state="open", expect=2, policy="fail", deadline_in_s=3.0, members=[], dropped=[], budget=budget, error=""
    )


def test_round_budget_travels_as_the_same_keys_whether_built_as_a_dict_or_a_struct() -> None:
    figures = {"free": 10, "staged": 1, "reserve": 2, "headroom": 3, "graph_pools": 4, "budget": 5, "minimums": 6, "committed": 7}
    from_dict = p.decode_reply(p.encode_reply(1, _round_status(dict(figures))))
    from_struct = p.decode_reply(p.encode_reply(1, _round_status(p.RoundBudget(**figures))))
    assert bytes(from_dict.body) == bytes(from_struct.body)
    decoded = p.decode_body(p.RoundStatus, from_dict.body)
    assert decoded.budget == p.RoundBudget(**figures) and decoded.budget.committed == 7
    assert p.to_wire(decoded)["budget"] == figures


def test_round_budget_keys_a_daemon_left_out_are_zero() -> None:
    partial = {"free": 10, "reserve": 2, "headroom": 3, "budget": 5, "minimums": 6}  # before the round commits
    decoded = p.decode_body(p.RoundStatus, p.decode_reply(p.encode_reply(1, _round_status(partial))).body)
    assert decoded.budget == p.RoundBudget(free=10, reserve=2, headroom=3, budget=5, minimums=6)
    reply = p.KvCommitReply(
        pool=p.KvPoolView(name="kv", arena=SAMPLE_ARENA, buffers=[], max_tokens=1, tokens=0, bytes_per_token=1),
        arena=SAMPLE_ARENA,
        chunks=[],
        retired=[],
        fd_batches=0,
    )
    assert reply.budget == p.RoundBudget(), "a grow outside any round carries no figures"


def test_string_enums_travel_compare_and_print_as_their_values() -> None:
    status = p.decode_body(p.RoundStatus, p.decode_reply(p.encode_reply(1, _round_status({}))).body)
    assert status.state is p.RoundState.OPEN and status.policy is p.RoundPolicy.FAIL
    assert status.state == "open" and f"{status.state} {status.policy}" == "open fail"
    notice = p.decode_event(p.encode_event(p.Notice(kind="kv-shrink", arena="kv", tokens=64)))
    assert isinstance(notice, p.Notice) and notice.kind is p.NoticeKind.KV_SHRINK and notice.kind == "kv-shrink"
    assert msgpack.unpackb(p.encode_event(p.Notice(kind=p.NoticeKind.STOPPING)), raw=False)["b"]["kind"] == "stopping"
    assert {b.value for b in p.Backend} == {"cuda", "host"}
    assert [s.value for s in p.RoundState] == ["open", "awaiting-shrink", "committed", "failed"]
    assert {k.value for k in p.NoticeKind} == {"stopping", "arena-grown", "arena-retired", "kv-shrink"}


def test_an_enum_value_this_side_does_not_know_is_invalid_argument() -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.from_wire(p.RoundView, {"round_id": 1, "state": "pondering", "deadline_in_s": 1.0, "members": []})
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and info.value.message.startswith("RoundView.state: ")


SAMPLE_ARENA = p.ArenaView(name="kv", owner="a", address=0x2000_0000_0000, reserved=GiB, committed=0, granularity=2 << 20)


def _status(**pools: Any) -> p.StatusReply:
    return p.StatusReply(
        daemon=p.DaemonStatus(version="0", protocol="1.2", pid=1, backend="host", uptime_s=0.0, runtime_dir="/r", state="serving"),
        device=p.DeviceStatus(
            index=0, uuid="HOST-1", name="host", total_bytes=GiB, free_bytes=GiB, granularity=2 << 20, accounted_bytes=0, reserve_bytes=0
        ),
        clients=[],
        arenas=[],
        leases=[],
        **pools,
    )


GRAPH_POOL = p.GraphPoolStatus(id=1, owner="a", arena="g", label="decode", epoch=1, extents=[], free_runs=[], free_bytes=0)


def test_status_carries_the_graph_pools_under_both_names() -> None:
    for built in (_status(extents=[GRAPH_POOL]), _status(extents=[], graph_pools=[GRAPH_POOL])):
        assert built.graph_pools == built.extents == [GRAPH_POOL]
        wire = msgpack.unpackb(p.encode_reply(1, built), raw=False)["b"]
        assert wire["graph_pools"] == wire["extents"] == [p.to_wire(GRAPH_POOL)]


def test_status_from_a_1_1_daemon_fills_graph_pools() -> None:
    old = p.to_wire(_status(extents=[GRAPH_POOL]))
    del old["graph_pools"]
    decoded = p.from_wire(p.StatusReply, old)
    assert decoded.graph_pools == decoded.extents == [GRAPH_POOL]


def test_grants_between_1_2_and_1_3_peers() -> None:
    """A 1.2 daemon answers a share with an empty Ack (no token) and lists no grants; a
    1.2 client reads a ShareReply as its Ack and a 1.2 attach carries no token."""
    assert p.decode_body(p.ShareReply, p.decode_reply(p.encode_reply(1, p.Ack())).body) == p.ShareReply(token="")
    reply = p.ShareReply(token="ab" * 32, grant=p.GrantStatus(id=3, client="engine-b", uid=1000, uid_implied=True))
    assert p.decode_body(p.Ack, p.decode_reply(p.encode_reply(1, reply)).body) == p.Ack()
    arena = p.ArenaStatus(
        name="kv", owner="a", owner_pid=1, owner_alive=True, address=0, reserved=GiB, committed=0, chunks=0,
        shared_with=["engine-b"], attached=["a"], retiring_bytes=0, grants=[reply.grant],
    )
    old = p.to_wire(arena)
    del old["grants"], old["placeholder_bytes"]
    assert p.from_wire(p.ArenaStatus, old).grants == []
    attach_1_2 = raw(envelope(t=int(MsgType.ARENA_ATTACH), v=[1, 2], b={"name": "kv"}))
    assert p.decode_request(attach_1_2).message == p.AttachArena(name="kv", token="")
    share_1_2 = raw(envelope(t=int(MsgType.ARENA_SHARE), v=[1, 2], b={"name": "kv", "client": "engine-b"}))
    assert p.decode_request(share_1_2).message == p.ShareArena(name="kv", client="engine-b", uid=-1, gid=-1)


def test_to_wire_keeps_bytes_and_from_wire_reads_a_raw_body() -> None:
    reply = p.LeaseEventReply(handle=b"\x00\x01ipc")
    assert p.to_wire(reply) == {"handle": b"\x00\x01ipc"}
    assert p.from_wire(p.LeaseEventReply, p.decode_reply(p.encode_reply(1, reply)).body) == reply
    assert p.from_wire(p.LeaseEventReply, msgspec.Raw(raw({"handle": b"x"}))) == p.LeaseEventReply(handle=b"x")


# --------------------------------------------------------------------------- fd-channel events


def test_events_round_trip() -> None:
    batch = p.FdBatch(request_id=12, chunk_ids=[4, 5, 6])
    notice = p.Notice(kind="arena-retired", message="sync to unmap", arena="kv")
    assert p.decode_event(p.encode_event(batch)) == batch
    assert p.decode_event(p.encode_event(notice)) == notice


def test_event_refusals() -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_event(raw({"v": [1, 0], "id": 0, "t": int(MsgType.ARENA_COMMIT), "b": {}}))
    assert info.value.code is ErrorCode.UNKNOWN_MESSAGE
    with pytest.raises(p.ProtocolError) as info:
        p.decode_event(raw({"v": [3, 0], "id": 0, "t": int(MsgType.NOTICE), "b": {}}))
    assert info.value.code is ErrorCode.PROTOCOL_MISMATCH
    with pytest.raises(p.ProtocolError) as info:
        p.decode_event(raw({"v": [1, 0], "id": 0, "t": int(MsgType.FD_BATCH), "b": {"request_id": 1, "chunk_ids": ["a"]}}))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT


@pytest.mark.parametrize("pid", [-1, 1 << 22, 1 << 40])
def test_a_hello_pid_no_process_can_have_is_invalid_argument(pid: int) -> None:
    assert p.decode_request(raw(envelope(MsgType.HELLO, b={"name": "eng", "pid": (1 << 22) - 1}))).message.pid == (1 << 22) - 1
    error = refused(raw(envelope(MsgType.HELLO, b={"name": "eng", "pid": pid})), ErrorCode.INVALID_ARGUMENT)
    assert error.message.startswith("Hello.pid: expected `int` "), error.message
