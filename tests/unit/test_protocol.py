"""The wire codec: envelopes, typed messages, refusals with stable error codes.

Frames here are built by hand with msgpack where a test needs something the encoder
would never produce; everything else goes through the real encode/decode pair.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from gpumem_shared import protocol as p
from gpumem_shared.protocol import PROTOCOL_VERSION, ErrorCode, MsgType

GiB = 1 << 30

# One instance of every request the daemon serves, with non-default values throughout.
SAMPLES: list[Any] = [
    p.Hello(name="engine-a", client_version="0.1.0"),
    p.Ping(),
    p.Status(),
    p.CreateArena(name="kv", reserve_bytes=64 * GiB),
    p.AttachArena(name="kv"),
    p.ShareArena(name="kv", client="engine-b"),
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
    p.KvShrink(pool="kv", tokens=5),
    p.RegisterGraphPool(arena="g", label="decode bs=8", extents=[p.Extent(offset=0, size=1 << 21)], free_runs=[p.Extent(offset=0, size=512)]),
    p.UpdateGraphPool(pool_id=1, extents=[p.Extent(offset=0, size=1 << 21)], free_runs=[], recaptured=True),
    p.RetireGraphPool(pool_id=1),
    p.OpenGraphPool(owner="engine-a", label="decode"),
    p.PublishLeaseEvent(pool_id=1, handle=bytes(range(64))),
    p.LookupLeaseEvent(pool_id=1, session=3),
    p.ReportEscape(pool_id=1, escaped=True),
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
    }


def test_message_type_numbers_never_change() -> None:
    assert {t.name: t.value for t in MsgType} == {
        "HELLO": 1,
        "PING": 2,
        "STATUS": 3,
        "ARENA_CREATE": 10,
        "ARENA_ATTACH": 11,
        "ARENA_SHARE": 12,
        "ARENA_COMMIT": 13,
        "ARENA_DECOMMIT": 14,
        "ARENA_SYNC": 15,
        "ARENA_RELEASE": 16,
        "CHUNKS_UNMAPPED": 17,
        "ARENA_PLACEHOLDER": 18,
        "KV_DECLARE": 20,
        "ROUND_JOIN": 21,
        "CAPTURE_DONE": 22,
        "KV_GROW": 23,
        "KV_SHRINK": 24,
        "GRAPH_POOL_REGISTER": 30,
        "GRAPH_POOL_UPDATE": 31,
        "GRAPH_POOL_RETIRE": 32,
        "GRAPH_POOL_OPEN": 33,
        "LEASE_EVENT_PUBLISH": 34,
        "LEASE_EVENT_LOOKUP": 35,
        "GRAPH_POOL_ESCAPE": 36,
        "FD_BATCH": 100,
        "NOTICE": 101,
    }


def test_every_request_type_is_registered_under_its_number() -> None:
    assert {type(m) for m in SAMPLES} == set(p.REQUESTS.values()), "a request type has no sample here"
    for number, cls in p.REQUESTS.items():
        assert cls.TYPE == number
        assert number < MsgType.FD_BATCH, "fd-channel events are not requests"


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
    assert p.decode_request(raw(env)) == p.Request(41, p.Ping())


def test_unknown_fields_are_ignored_in_body_and_envelope() -> None:
    env = envelope(b={"name": "kv", "nbytes": 4 << 20, "hint": "from a newer minor", "flags": [1, 2]}, extra={"x": 1})
    assert p.decode_request(raw(env)) == p.Request(41, p.CommitArena(name="kv", nbytes=4 << 20))


def test_newer_minor_version_is_accepted() -> None:
    assert p.decode_request(raw(envelope(v=[1, 99]))).message == p.CommitArena(name="kv", nbytes=2 << 20)


@pytest.mark.parametrize(
    "frame",
    [b"\xc1", b"\x83\xa1v", b"", b"\x92\x01"],
    ids=["reserved-byte", "truncated-map", "empty", "truncated-array"],
)
def test_malformed_msgpack_is_bad_message(frame: bytes) -> None:
    assert "not valid msgpack" in refused(frame, ErrorCode.BAD_MESSAGE).message


@pytest.mark.parametrize("payload", [[1, 0, 41], 5, "hello", None], ids=["list", "int", "str", "nil"])
def test_non_map_frame_is_bad_message(payload: Any) -> None:
    assert refused(raw(payload), ErrorCode.BAD_MESSAGE).message == "request is not a map"


def test_non_string_map_keys_are_bad_message() -> None:
    # an otherwise valid request: only the integer key is wrong
    error = refused(raw({**envelope(), 1: 2}), ErrorCode.BAD_MESSAGE)
    assert "not valid msgpack" in error.message


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


def test_missing_field_is_invalid_argument_naming_it() -> None:
    error = refused(raw(envelope(b={"name": "kv"})), ErrorCode.INVALID_ARGUMENT)
    assert error.message == "CommitArena.nbytes is missing"
    assert error.detail == {"request_id": 41}


def test_body_that_is_not_a_map_is_invalid_argument() -> None:
    error = refused(raw(envelope(b=["kv", 2 << 20])), ErrorCode.INVALID_ARGUMENT)
    assert "must be a map" in error.message


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
    assert error.message.startswith(f"{field} must be ")


@pytest.mark.parametrize(
    ("chunk_ids", "where"),
    [([[1]], "chunk_ids[0]"), ([1, 2, True], "chunk_ids[2]"), ([1, "2"], "chunk_ids[1]"), ("123", "chunk_ids"), (5, "chunk_ids")],
)
def test_list_fields_check_every_item(chunk_ids: Any, where: str) -> None:
    env = envelope(MsgType.CHUNKS_UNMAPPED, b={"name": "kv", "chunk_ids": chunk_ids})
    error = refused(raw(env), ErrorCode.INVALID_ARGUMENT)
    assert error.message.startswith(f"ChunksUnmapped.{where} must be ")


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
    reply = p.decode_reply(p.encode_reply(9, body))
    assert (reply.request_id, reply.ok, reply.code, reply.message, reply.detail) == (9, True, ErrorCode.OK, "", {})
    assert reply.body == p.to_wire(body)
    assert p.from_wire(p.MapReply, reply.body) == body


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
    assert reply.ok and reply.body == {}


def test_error_reply_carries_code_message_and_detail_but_not_request_id() -> None:
    error = p.ProtocolError(ErrorCode.OUT_OF_MEMORY, "committing 8 bytes needs more", requested=8 << 30, available=1 << 30)
    error.detail["request_id"] = 77  # as decode_request or the server leaves it
    reply = p.decode_reply(p.encode_error(77, error))
    assert reply.request_id == 77
    assert reply.ok is False
    assert reply.code is ErrorCode.OUT_OF_MEMORY
    assert reply.message == "committing 8 bytes needs more"
    assert reply.detail == {"requested": 8 << 30, "available": 1 << 30}
    assert reply.body == {}
    assert error.detail["request_id"] == 77, "encoding must not strip the caller's exception"


def test_reply_with_unknown_code_decodes_as_internal() -> None:
    reply = p.decode_reply(raw({"v": [1, 0], "id": 1, "ok": False, "code": 9999, "msg": "new", "detail": {}, "b": {}}))
    assert reply.code is ErrorCode.INTERNAL and reply.message == "new"


def test_reply_fields_of_the_wrong_shape_are_defaulted_not_trusted() -> None:
    reply = p.decode_reply(raw({"v": [1, 0], "id": 1, "ok": 1, "detail": [1], "b": "x"}))
    assert reply.ok is False  # only a real true is success
    assert reply.code is ErrorCode.INTERNAL  # no code at all
    assert (reply.message, reply.detail, reply.body) == ("", {}, {})


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
    assert info.value.message.startswith("MapReply.chunks[1].offset must be int")


def test_float_fields_accept_ints_but_not_bools() -> None:
    status = {"version": "0.1.0", "protocol": "1.0", "pid": 1, "backend": "host", "runtime_dir": "/r", "state": "serving"}
    decoded = p.from_wire(p.DaemonStatus, {**status, "uptime_s": 3})
    assert decoded.uptime_s == 3.0 and isinstance(decoded.uptime_s, float)
    with pytest.raises(p.ProtocolError):
        p.from_wire(p.DaemonStatus, {**status, "uptime_s": True})


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
