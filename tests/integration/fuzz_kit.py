"""The protocol fuzzer: what tests/integration/test_fuzz.py and bench/fuzz.py run.

``operations()`` is a hypothesis strategy of one operation against a running daemon;
``fuzz`` runs them in programs of four. Typed requests come from the protocol itself:
every class in ``protocol.REQUESTS`` is walked with ``msgspec.inspect``, and each field
gets a value of its type (edge integers from -2**63 to 2**64-1, inf and nan, any text or
bytes, nested structs, short lists and lists of 20,000), a value of another type, or
nothing at all; two requests in five are clean, every field plausible. A field whose name
says what it refers to (an arena, a chunk, a graph pool, a client) mostly gets something
that exists, resolved when the operation runs (an arena now and then as UID/NAME), and
each session starts with an arena (128 MiB committed) and a KV pool, so requests get
past validation into the books.
Beside them: garbage frames, envelopes of the wrong shape, frames around the protocol's
and libzmq's size bounds and multi-frame messages on the control channel, sent by session
peers, an anonymous peer, a peer with a forged token and one with the token of a closed
session; on the fd channel, garbage before and after HELLO, stray descriptors, empty
messages; bytes scribbled into the shared lease table; sessions that close and reopen.

``World`` runs operations against one daemon and checks, for each:
- the daemon process is alive, and the operation cost it under SLOW_OPERATION of CPU;
- every request gets exactly one reply, carrying its id when the id is readable (the
  frame is a msgpack map of string keys with an integer ``id``), else id 0; a deferred
  CAPTURE_DONE gets its one reply when its round ends; a frame past libzmq's bound gets
  none (its connection is closed) and its peer reconnects;
- an error reply has a numbered ErrorCode other than INTERNAL (which means a daemon bug),
  a message without a traceback, and a detail map of strings to ints or strings; a
  success reply's body decodes as the request's reply type;
- descriptors handed out arrive in FD_BATCH messages that match their reply, and stray
  descriptors sent to the daemon are closed by it;
- every AUDIT_EVERY cases, the accounting agrees with the arenas it lists.
``World.finish`` closes every session and checks that the accounting is back to
baseline (nothing accounted, no client, arena, graph pool, KV pool or open round), and
that the daemon's RSS (after WARMUP cases) and descriptor count stayed bounded.

The world persists across hypothesis examples (a daemon is too slow to start per case),
so a failing operation depends on what ran before it: the failure names the operation,
the reply and the operations before it. Nothing is shrunk: a replay against a daemon
that has moved on proves little.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import mmap
import os
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import msgspec.inspect as mi
import zmq
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from gpumem_shared import lease_table
from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumemd.server import MAX_CONTROL_MESSAGE
from gpumemd_testkit import Probe

E = p.ErrorCode
T = p.MsgType
G = 2 << 20  # the host backend's granularity, and every current NVIDIA GPU's
MiB = 1 << 20

# How long one reply may take. Generous: a CUDA commit of a few GiB zeroes its chunks
# before the reply, and a 2-core CI machine runs the daemon beside the fuzzer.
REPLY_TIMEOUT = 10.0
# Integer edges: int32, int64 and uint64 bounds, around the granularity, past a double's
# precision; msgpack carries them all.
EDGE_INTS = (
    -(1 << 63), -(1 << 31) - 1, -G, -1, 0, 1, 2, 255, 256, 4096, G - 1, G, G + 1,
    (1 << 31) - 1, 1 << 31, 1 << 32, (1 << 53) + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
)
EDGE_FLOATS = (0.0, -0.0, 1.0, -1.0, 1e-300, 5e-324, 1e308, math.inf, -math.inf, math.nan)
EDGE_TEXT = ("", " ", "x" * 129, "x" * 300, "a\x00b", "..", "../etc", "a b", "kv\n", "é", "☃", "a/b")
# Arena and KV pool names a session uses, by its index: a request names one of its own
# most of the time (only the owner may commit, share, decommit), else anyone's.
ARENA_NAMES = ("a{}", "b{}", "kv{}")
OTHER_UID = 4242  # a uid no session of the fuzzer has: its names reach nothing
LABELS = ("g0", "g1", "")
# No operation may cost the daemon's one thread this much CPU time: every tenant waits
# behind it. CPU time, not wall time: a loaded machine slows both sides alike.
SLOW_OPERATION = 1.0
AUDIT_EVERY = 250  # cases between two checks of the daemon's figures
PROGRAM = 4  # operations per hypothesis example
WARMUP = 500  # cases before the daemon's RSS is taken as its baseline
SEED_COMMIT = 128 * MiB  # committed in each session's first arena when it opens
SESSIONS = 3  # session peers kept open (reopened under a new name after they close)
FD_RECV_BYTES = 1 << 16  # what the daemon reads of one fd-channel message
MAX_FD_PAYLOAD = 100_000  # SEQPACKET: larger sends fail in the sender (SO_SNDBUF)
# Around the protocol's bound (refused with BAD_MESSAGE) and past libzmq's (connection closed).
HUGE_SIZES = (p.MAX_FRAME_BYTES - 64, p.MAX_FRAME_BYTES, p.MAX_FRAME_BYTES + 1, MAX_CONTROL_MESSAGE + 1, 16 * MiB)


class FuzzFailure(AssertionError):
    """An invariant broke: the message names the operation and what the daemon did."""


# ---------------------------------------------------------------------------
# Operations
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ref:
    """Something that exists in the world when the operation runs (a chunk id, a graph
    pool id, a session's lease word, a client name), picked by ``index``; a small
    integer when there is none yet."""

    kind: str
    index: int


@dataclasses.dataclass(frozen=True)
class Long:
    """A long list, ``count`` items cycling through ``items``; with ``stride``, each
    item's "offset" moves on by that much; ``numbered``, each item's "name" ends in its
    index (KV buffers must be named apart). Spelled out when the operation runs: a
    20,000-item example would cost hypothesis more to keep than the daemon to refuse."""

    items: tuple[Any, ...]
    count: int
    stride: int = 0
    numbered: bool = False

    def spell(self) -> list[Any]:
        out = [self.items[i % len(self.items)] for i in range(self.count)]
        if self.stride:
            out = [{**item, "offset": item["offset"] + i * self.stride} for i, item in enumerate(out)]
        if self.numbered:
            out = [{**item, "name": f"{item['name']}{i}"} if isinstance(item, dict) and isinstance(item.get("name"), str) else item for i, item in enumerate(out)]
        return out


@dataclasses.dataclass(frozen=True)
class Blob:
    """Bytes made when the operation runs: ``size`` bytes of "x", or (``nested``) a
    msgpack value nested ``size`` arrays deep."""

    size: int
    nested: bool = False

    def spell(self) -> bytes:
        return b"\x91" * self.size + b"\xc0" if self.nested else b"x" * self.size


def spelled(value: bytes | Blob) -> bytes:
    return value.spell() if isinstance(value, Blob) else value


@dataclasses.dataclass(frozen=True)
class Typed:
    """A request built from a protocol type, on a correct envelope."""

    peer: int  # 0..SESSIONS-1: a session; then anonymous, forged token, stale token
    msg_type: int
    body: Any


@dataclasses.dataclass(frozen=True)
class Frames:
    """Raw frames on the control channel: one (garbage, an odd envelope) or several."""

    peer: int
    frames: tuple[bytes | Blob, ...]


@dataclasses.dataclass(frozen=True)
class Huge:
    """One frame of ``size`` bytes: a valid PING envelope padded out, or zeros."""

    peer: int
    size: int
    envelope: bool


@dataclasses.dataclass(frozen=True)
class FdMessage:
    """A message on the fd channel: on a new connection (``session`` None), then maybe a
    proper HELLO on the same connection; or on a session's own channel."""

    session: int | None
    payload: bytes | Blob
    stray_fds: int
    then_hello: bool


@dataclasses.dataclass(frozen=True)
class Scribble:
    """Bytes written into a lease segment the session was granted (its users map it
    read-write, so the daemon trusts nothing in it); a session granted none has nothing
    to scribble on."""

    session: int
    offset: int
    data: bytes


@dataclasses.dataclass(frozen=True)
class Reconnect:
    """Close a session (both sockets, as a client that exits does); it reopens."""

    session: int


@dataclasses.dataclass(frozen=True)
class Handover:
    """Two DEALERs under one routing id: the second takes the id over (ROUTER_HANDOVER)
    and leaves, the first, cut off, speaks again. The id is a fresh one, or a session's
    token (an impostor's DEALER: the session's own is the one cut off, and a new one takes
    its place). Each round used to leave a connection open in the daemon for good."""

    session: int | None
    speak_again: bool


@dataclasses.dataclass(frozen=True)
class Crowd:
    """DEALERs that connect, never say a word, and leave."""

    size: int


Operation = Typed | Frames | Huge | FdMessage | Scribble | Reconnect | Handover | Crowd

PEERS = SESSIONS + 3
ANONYMOUS, FORGED, STALE = SESSIONS, SESSIONS + 1, SESSIONS + 2


def _weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    # A uniform integer picks the branch: one_of leans towards its first branches.
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(table.__getitem__)


# Strategies are built once: hypothesis validates each new one, which costs more than
# drawing from it.
_INTS = st.sampled_from(EDGE_INTS) | st.integers(-(1 << 63), (1 << 64) - 1) | st.integers(-4, 4096)
_LEAVES = (
    st.none()
    | st.booleans()
    | _INTS
    | st.sampled_from(EDGE_FLOATS)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
# Any msgpack value: what a field of the wrong type gets.
ANY = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)
_LONG = (100, 1000, 20_000)


def _by_type(info: mi.Type, clean: bool = False) -> st.SearchStrategy[Any]:
    """Values of a field's declared type: edges included, or (``clean``) ordinary ones."""
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.IntType):
        return st.integers(0, 4096) if clean else _INTS
    if isinstance(info, mi.FloatType):
        return st.floats(0.1, 10.0) if clean else st.sampled_from(EDGE_FLOATS) | st.floats(allow_nan=True, allow_infinity=True)
    if isinstance(info, mi.StrType):
        return st.sampled_from(LABELS) if clean else st.sampled_from(EDGE_TEXT) | st.text(max_size=40)
    if isinstance(info, mi.BytesType):
        return st.binary(min_size=1, max_size=64) if clean else st.binary(max_size=300)
    if isinstance(info, mi.ListType):
        item = _by_type(info.item_type, clean)
        return st.lists(item, max_size=4) if clean else st.lists(item, max_size=5) | _long_list(item)
    if isinstance(info, mi.StructType):
        return _struct(info.cls, clean)
    return ANY


def _long_list(item: st.SearchStrategy[Any]) -> st.SearchStrategy[Long]:
    """A list long enough to cost the daemon something per element."""
    return st.builds(Long, st.lists(item, min_size=1, max_size=3).map(tuple), st.sampled_from(_LONG), st.just(0), st.booleans())


# Hypothesis leans towards the first item of sampled_from and towards 0: the first here is
# a size the daemon takes.
_SIZES = st.sampled_from((4 * G, G, 2 * G, 8 * G, 32 * G, 64 * G, 3 * G, 1 << 30, 0, G - 1, G + 1, 4096, 3 << 30))


def _refs(kind: str) -> st.SearchStrategy[Ref]:
    return st.integers(0, 63).map(lambda i: Ref(kind, i))


# Extents and runs mostly inside the first 16 MiB of an arena, granule-aligned; sometimes
# many of them, each a page apart (80 MiB for 20,000 of them): the costliest shape to check.
_EXTENTS = st.lists(
    st.fixed_dictionaries({"offset": st.integers(0, 7).map(lambda k: k * G), "size": st.sampled_from((G, 2 * G, 4096))}), min_size=1, max_size=4
) | st.builds(Long, st.just(({"offset": 0, "size": 2048},)), st.sampled_from(_LONG), st.just(4096))

# Fields whose name (or struct and name) says what they refer to: mostly something that
# exists, or a value the daemon may well accept.
_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "name": _refs("arena"),
    "KvBuffer.name": st.sampled_from(("k", "v", "k0", "v0")),
    "arena": _refs("arena"),
    "pool": _refs("arena"),
    "client": _refs("client"),
    "owner": _refs("client"),
    "label": st.sampled_from(LABELS),
    "reserve_bytes": _SIZES,
    "KvDeclare.reserve_bytes": st.sampled_from((0, 0, 64 * MiB, 1 << 30)),
    "nbytes": _SIZES,
    "to_nbytes": _SIZES,
    "slot_bytes": _SIZES,
    "headroom_bytes": _SIZES,
    "graph_pool_bytes": _SIZES,
    "chunk_ids": st.lists(_refs("chunk"), max_size=4),
    "Holding.chunks": st.lists(_refs("chunk"), max_size=4),
    "pool_id": _refs("pool"),
    "session": _refs("session"),
    "tokens": st.sampled_from((64, 1, 16, 256, 2048, 0)),
    "min_tokens": st.sampled_from((16, 0, 1, 256)),
    "max_tokens": st.sampled_from((256, 0, 16, 4096)),
    "expect": st.sampled_from((0, 1, 2, 3)),
    "row_bytes": st.sampled_from((4096, 1, 64, 65536, G)),
    "align": st.sampled_from((256, 0, 1, 4096, G, 3)),
    "weight": st.sampled_from((1.0, 0.5, 3.0)),
    "handle": st.binary(min_size=1, max_size=64),
    "extents": _EXTENTS,
    "free_runs": _EXTENTS,
}


@functools.cache
def _struct(cls: type[msgspec.Struct], clean: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """A struct as a msgpack map. ``clean``: every field present, with a plausible value
    of its type, to get past validation. Otherwise each field may be well typed, of
    another type or missing, and now and then a key no version of the protocol has."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields = [
        (f.encode_name, _by_type(f.type, clean), _PLAUSIBLE.get(f"{cls.__name__}.{f.name}", _PLAUSIBLE.get(f.name)))
        for f in info.fields
    ]
    modes = st.integers(0, 99)

    @st.composite
    def body(draw: st.DrawFn) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, typed, plausible in fields:
            if clean:
                out[key] = draw(typed if plausible is None else plausible)
                continue
            mode = draw(modes)
            if mode < 6:
                continue  # missing
            out[key] = draw(ANY if mode < 14 else typed if plausible is None or mode < 30 else plausible)
        if not clean and draw(modes) < 5:
            out[draw(st.text(max_size=8))] = draw(ANY)
        return out

    return body()


def _request(cls: type[msgspec.Struct]) -> st.SearchStrategy[dict[str, Any]]:
    """Two in five requests clean: the daemon's state has to grow for the rest to reach it."""
    return _weighted((2, _struct(cls, True)), (3, _struct(cls)))


def _envelope(msg_type: Any, body: Any, request_id: Any, version: Any = p.PROTOCOL_VERSION) -> dict[str, Any]:
    return {"v": list(version) if isinstance(version, tuple) else version, "id": request_id, "t": msg_type, "b": body}


def _least_packed_bytes(value: Any, seen: dict[int, int]) -> int:
    """A lower bound of ``value``'s msgpack size, each list counted once however often it
    is repeated (a spelled Long repeats one list)."""
    if isinstance(value, list):
        if id(value) not in seen:
            seen[id(value)] = 1 + sum(_least_packed_bytes(item, seen) for item in value)
        return seen[id(value)]
    if isinstance(value, dict):
        return 1 + sum(_least_packed_bytes(k, seen) + _least_packed_bytes(v, seen) for k, v in value.items())
    if isinstance(value, (bytes, str)):
        return 1 + len(value)
    return 1


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def _garbage_frames() -> st.SearchStrategy[bytes | Blob]:
    """Frames no correct peer sends: random bytes, cut-off messages, odd envelopes."""
    versions = st.sampled_from(([1, 2], [1, 99], [2, 0], [0, 9], [1], [1, 2, 3], "1.2", None, [1, (1 << 64) - 1], [-1, 0], [True, 2]))
    types = st.sampled_from(sorted(p.REQUESTS)) | st.sampled_from((0, 99, 100, 101, -1, 1 << 40)) | ANY
    odd_envelope = st.builds(lambda v, i, t, b: _pack(_envelope(t, b, i, v)), versions, _INTS | ANY, types, ANY)
    missing_key = st.builds(
        lambda env, drop: _pack({k: v for k, v in env.items() if k != drop}),
        st.builds(lambda i, t: _envelope(t, {}, i), _INTS, st.sampled_from(sorted(p.REQUESTS))),
        st.sampled_from(("v", "id", "t", "b")),
    )
    truncated = st.builds(
        lambda frame, cut: frame[: max(0, len(frame) - 1 - cut)],
        st.builds(lambda i, t: _pack(_envelope(t, {"name": "a0", "nbytes": G}, i)), _INTS, st.sampled_from(sorted(p.REQUESTS))),
        st.integers(0, 40),
    )
    non_str_keys = st.builds(lambda i: _pack({1: 2, "id": i, "v": [1, 2], "t": 2, "b": {}}), _INTS)
    trailing = st.builds(lambda i, junk: _pack(_envelope(int(T.PING), {}, i)) + junk, _INTS, st.binary(min_size=1, max_size=8))
    deep = st.builds(Blob, st.sampled_from((10, 1000, 100_000)), st.just(True))
    return st.one_of(st.binary(max_size=64), truncated, odd_envelope, missing_key, non_str_keys, trailing, deep, ANY.map(_pack), st.just(b""))


GARBAGE = _garbage_frames()


def operations() -> st.SearchStrategy[Operation]:
    # Six in seven typed requests come from a session: most of what the daemon does needs one.
    session_heavy = st.integers(0, 7 * SESSIONS - 1).map(lambda i: i % SESSIONS if i < 6 * SESSIONS else i - 5 * SESSIONS)
    typed = _weighted(*[(1, st.builds(Typed, session_heavy, st.just(number), _request(cls))) for number, cls in p.REQUESTS.items()])
    peers = st.integers(0, PEERS - 1)
    frames = st.builds(Frames, peers, st.lists(GARBAGE, min_size=1, max_size=3).map(tuple))
    huge = st.builds(Huge, peers, st.sampled_from(HUGE_SIZES), st.booleans())
    fd_payload = st.one_of(
        GARBAGE.filter(lambda f: len(spelled(f)) <= MAX_FD_PAYLOAD),
        st.builds(lambda t, b, i: _pack(_envelope(t, b, i)), st.sampled_from(sorted(p.REQUESTS)), ANY, _INTS),
        st.just(Blob(70_000)),  # past what the daemon reads of one message: truncated
    )
    fd_message = st.builds(
        FdMessage, st.none() | st.integers(0, SESSIONS - 1), fd_payload, _weighted((3, st.just(0)), (1, st.integers(1, 4))), st.booleans()
    )
    scribble = st.builds(
        Scribble, st.integers(0, SESSIONS - 1), st.integers(0, 16 * lease_table.SEGMENT_BYTES - 1), st.binary(min_size=1, max_size=64)
    )
    reconnect = st.builds(Reconnect, st.integers(0, SESSIONS - 1))
    handover = st.builds(Handover, st.none() | st.integers(0, SESSIONS - 1), st.booleans())
    crowd = st.builds(Crowd, st.integers(1, 32))
    # Few reconnects: a session's arenas, pools and rounds go with it.
    return _weighted((30, typed), (5, frames), (1, huge), (5, fd_message), (2, scribble), (1, reconnect), (1, handover), (1, crowd))


# ---------------------------------------------------------------------------
# Checking replies
# ---------------------------------------------------------------------------


def readable_id(frame: bytes) -> int:
    """The id a reply must carry: the frame's ``id`` when the frame is a msgpack map of
    string keys with an integer id, else 0."""
    if len(frame) > p.MAX_FRAME_BYTES:
        return 0
    try:
        data = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return 0
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        return 0
    rid = data.get("id")
    return rid if type(rid) is int else 0


def check_reply(frame: bytes, what: str) -> dict[str, Any]:
    """A reply frame as a map, if it has the envelope every reply must have."""
    try:
        reply = msgpack.unpackb(frame, raw=False)
    except Exception as exc:
        raise FuzzFailure(f"{what}: the reply is not msgpack ({exc}): {frame[:200]!r}") from None
    if not isinstance(reply, dict) or set(reply) != {"v", "id", "ok", "code", "msg", "detail", "b"}:
        raise FuzzFailure(f"{what}: the reply is not a reply envelope: {reply!r:.300}")
    if reply["v"] != list(p.PROTOCOL_VERSION) or type(reply["id"]) is not int or type(reply["ok"]) is not bool:
        raise FuzzFailure(f"{what}: malformed reply envelope: {reply!r:.300}")
    if reply["ok"]:
        if reply["code"] != 0 or not isinstance(reply["b"], dict):
            raise FuzzFailure(f"{what}: a success reply with code {reply['code']} or a body that is not a map: {reply!r:.300}")
        return reply
    code, message, detail = reply["code"], reply["msg"], reply["detail"]
    if code not in set(E) - {E.OK}:
        raise FuzzFailure(f"{what}: error reply with code {code!r}, not a numbered error: {reply!r:.300}")
    if code == E.INTERNAL:
        raise FuzzFailure(f"{what}: the daemon failed inside (INTERNAL): {message}")
    if not isinstance(message, str) or not message or "Traceback" in message:
        raise FuzzFailure(f"{what}: error reply without a proper message: {reply!r:.300}")
    if not isinstance(detail, dict) or not all(isinstance(k, str) and type(v) in (int, str) for k, v in detail.items()):
        raise FuzzFailure(f"{what}: error detail is not a map of strings to ints or strings: {detail!r:.300}")
    return reply


# ---------------------------------------------------------------------------
# The world
# ---------------------------------------------------------------------------


def _check_body(frame: bytes, reply: dict[str, Any], reply_type: type[p.Message] | None, what: str) -> None:
    """A success reply's body is what its request promises."""
    if not reply["ok"] or reply_type is None:
        return
    try:
        p.decode_body(reply_type, p.decode_reply(frame).body)
    except p.ProtocolError as exc:
        raise FuzzFailure(f"{what}: the success reply is not a {reply_type.__name__}: {exc.message}") from None


def _check_fd_reply_id(reply: dict[str, Any], payload: bytes, what: str) -> None:
    # The daemon reads at most 64 KiB of an fd-channel message: past that it cannot know the id.
    expected = 0 if len(payload) > FD_RECV_BYTES else readable_id(payload)
    if reply["id"] != expected:
        raise FuzzFailure(f"{what}: the error reply carries id {reply['id']}, the message's readable id is {expected}")


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class Peer:
    """A DEALER on the control channel; a session's, or one with no session behind it."""

    def __init__(self, endpoints: Endpoints, routing_id: bytes | None) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self.sock.connect(endpoints.zmq_url)
        self.deferred: collections.Counter[int] = collections.Counter()  # CAPTURE_DONE ids awaiting their round
        # Deferred ids sent on an earlier connection of this routing id, which closed
        # before their reply: ZeroMQ drops what is routed to a peer not connected, so that
        # reply may never come (a real client resumes with the ids it waits for, and the
        # daemon's record answers them). Accepted if it comes, not waited for.
        self.unsure: collections.Counter[int] = collections.Counter()

    def take_deferred(self, rid: int) -> bool:
        """Whether a reply with id ``rid`` answers a deferred request of this peer."""
        for pending in (self.deferred, self.unsure):
            if pending[rid] > 0:
                pending[rid] -= 1
                return True
        return False

    def close(self) -> None:
        self.sock.close(linger=0)


class FuzzSession:
    """A session opened by hand, its descriptors taken and closed, its chunks tracked; the
    lease segments it is granted stay mapped, for scribbling on."""

    def __init__(self, endpoints: Endpoints, name: str) -> None:
        self.name = name
        self.fd_sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.fd_sock.settimeout(REPLY_TIMEOUT)
        self.peer: Peer | None = None
        self.segments: list[mmap.mmap] = []  # the last few lease segments granted to it
        self.batches: list[tuple[int, list[int]]] = []  # (request id, chunk ids) not yet claimed by a reply
        try:
            self.fd_sock.connect(str(endpoints.fd_path))
            self.fd_sock.send(_pack(_envelope(int(T.HELLO), {"name": name, "client_version": "fuzz"}, 1)))
            payload, fds = _recv(self.fd_sock)
            _close_fds(fds)
            if fds:
                raise FuzzFailure(f"HELLO of session {name} brought {len(fds)} descriptor(s): lease segments come with their pools")
            reply = check_reply(payload, f"HELLO of {name}")
            _check_body(payload, reply, p.HelloReply, f"HELLO of {name}")
            if not reply["ok"]:
                raise FuzzFailure(f"HELLO of session {name} refused: {reply['msg']}")
            self.session_id: int = reply["b"]["session_id"]
            self.token: bytes = reply["b"]["token"]
            self.peer = Peer(endpoints, self.token)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        for segment in self.segments:
            segment.close()
        self.segments.clear()
        self.fd_sock.close()


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    payload, fds, _flags, _ = socket.recv_fds(sock, 1 << 17, p.MAX_FDS_PER_MESSAGE)
    return payload, fds


@dataclasses.dataclass
class Bounds:
    """How far the daemon may drift from its baseline over a run."""

    rss_growth: int = 16 * MiB
    fds_growth: int = 4


class World:
    """One daemon and the fuzzer's peers on it; runs operations and checks invariants."""

    def __init__(self, runtime_dir: Path, daemon_pid: int, device: int = 0, log: Callable[[], str] | None = None) -> None:
        self.endpoints = Endpoints(runtime_dir, device)
        self.probe = Probe(daemon_pid)
        self.daemon_log = log or (lambda: "")
        self.baseline_fds = self.probe.fds()  # before any peer of ours connects
        self.cases = 0
        self.slowest = (0.0, "")
        # What ran last: a deferred request or a round's deadline may act after its operation.
        self.history: collections.deque[str] = collections.deque(maxlen=6)
        self.errors: collections.Counter[str] = collections.Counter()
        self.chunks: list[int] = []
        self.pools: list[int] = []
        self.session_words: list[int] = []
        self._opened = 0
        self._ids = iter(range(1 << 20, 1 << 62))  # apart from the small ids garbage frames carry
        self.sessions: list[FuzzSession | None] = [None] * SESSIONS
        self.anonymous = Peer(self.endpoints, None)
        self.forged = Peer(self.endpoints, os.urandom(16))
        self.stale: Peer | None = None  # made when first used: see _stale_peer
        self.stale_token: bytes | None = None
        for i in range(SESSIONS):
            self._reopen(i)
        self.baseline_rss = self.probe.rss()  # taken again after WARMUP cases

    # ------------------------------------------------------------------ running

    def run(self, op: Operation) -> None:
        self.cases += 1
        self.history.append(f"{op!r:.200}")
        cpu = self.probe.cpu_seconds()
        try:
            if isinstance(op, Typed):
                self._typed(op)
            elif isinstance(op, Frames):
                self._frames(op.peer, [spelled(f) for f in op.frames], f"{op!r:.300}")
            elif isinstance(op, Huge):
                self._huge(op)
            elif isinstance(op, FdMessage):
                self._fd_message(op)
            elif isinstance(op, Scribble):
                self._scribble(op)
            elif isinstance(op, Handover):
                self._handover(op)
            elif isinstance(op, Crowd):
                self._crowd(op.size)
            else:
                self._reconnect(op.session)
        except FuzzFailure:
            raise
        except Exception:
            self.alive(f"{op!r:.400}")
            raise
        self.alive(f"{op!r:.400}")
        if self.cases == WARMUP:
            # Past the first requests of each kind the daemon's memory should stay flat:
            # decoders, caches and the allocator's arenas are in place by then.
            self.baseline_rss = self.probe.rss()
        took = self.probe.cpu_seconds() - cpu
        if took > self.slowest[0]:
            self.slowest = (took, f"{op!r:.300}")
        if took > SLOW_OPERATION:
            raise FuzzFailure(f"one operation cost the daemon {took:.1f}s of CPU (bound {SLOW_OPERATION}s): {op!r:.400}")
        self._drain_events(f"after {op!r:.300}")
        if self.cases % AUDIT_EVERY == 0:
            self.audit()

    def _drain_events(self, what: str) -> None:
        """Read what the sessions' fd channels hold (notices, mostly), as a client does:
        one that stops reading loses its session."""
        live = {s.fd_sock: i for i, s in enumerate(self.sessions) if s is not None}
        while live:
            ready, _, _ = select.select(list(live), [], [], 0)
            if not ready:
                return
            for sock in ready:
                index = live[sock]
                session = self.sessions[index]
                assert session is not None
                event = self._fd_event(session, what, REPLY_TIMEOUT)
                if event is None:
                    raise FuzzFailure(f"{what}: the daemon ended session {session.name}")
                if "ok" in event:
                    raise FuzzFailure(f"{what}: a reply on the fd channel of {session.name} nobody asked for: {event!r:.300}")
                if event.get("t") == T.FD_BATCH:
                    session.batches.append((event["b"]["request_id"], list(event["b"]["chunk_ids"])))

    def audit(self) -> None:
        """The daemon's figures agree with each other."""
        s = self.status()
        device = s.device
        in_arenas = sum(a.committed + a.placeholder_bytes for a in s.arenas)
        if not in_arenas <= device.accounted_bytes <= device.total_bytes:
            raise FuzzFailure(
                f"accounting is off after {self.cases} cases: {device.accounted_bytes} bytes accounted, "
                f"{in_arenas} in live arenas, {device.total_bytes} in all"
            )

    def alive(self, after: str) -> None:
        if not self.probe.alive():
            raise FuzzFailure(f"gpumemd died after {after}; its log ends:\n{self.daemon_log()[-3000:]}")

    def _peer(self, index: int) -> Peer:
        if index < SESSIONS:
            session = self.sessions[index]
            if session is None or session.peer is None:
                session = self._reopen(index)
            assert session.peer is not None
            return session.peer
        if index == ANONYMOUS:
            return self.anonymous
        if index == FORGED or self.stale_token is None:
            return self.forged
        if self.stale is None:
            self.stale = self._stale_peer(self.stale_token)
        return self.stale

    def _resolve(self, value: Any, peer: int) -> Any:
        if isinstance(value, Ref):
            if value.kind == "arena":
                owner = peer if value.index < 40 and peer < SESSIONS else value.index // len(ARENA_NAMES) % SESSIONS
                name = ARENA_NAMES[value.index % len(ARENA_NAMES)].format(owner)
                if value.index >= 56:  # named with a uid: the fuzzer's own (the same arena), or another's (none)
                    return f"{os.getuid() if value.index % 2 else OTHER_UID}/{name}"
                return name
            if value.kind == "client":
                names = [s.name for s in self.sessions if s is not None] or ["nobody"]
                return names[value.index % len(names)]
            pick = {"chunk": self.chunks, "pool": self.pools, "session": self.session_words}[value.kind]
            return pick[-1 - value.index % len(pick)] if pick and value.index < 48 else value.index
        if isinstance(value, Long):
            # Each distinct item is resolved once and then repeated, so a long list of
            # long lists is spelled as references to one list: 100 holdings of 20,000
            # chunks each cost what 20,100 items do, not 2,000,000 resolutions (7-15 s a
            # case on a loaded machine, and hypothesis mutates such a case many times).
            items = tuple(self._resolve(item, peer) for item in value.items)
            return dataclasses.replace(value, items=items).spell()
        if isinstance(value, dict):
            return {k: self._resolve(v, peer) for k, v in value.items()}
        if isinstance(value, list):
            return [self._resolve(v, peer) for v in value]
        return value

    def _typed(self, op: Typed) -> None:
        rid = next(self._ids)
        body = self._resolve(op.body, op.peer)
        if _least_packed_bytes(body, {}) > MAX_CONTROL_MESSAGE:
            # libzmq drops a frame past the daemon's bound unread, whatever it holds; packing
            # the 100 million items a long list of long lists spells takes seconds a case.
            body = {"pad": b"x" * MAX_CONTROL_MESSAGE}
        frame = _pack(_envelope(op.msg_type, body, rid))
        if len(frame) > p.MAX_FRAME_BYTES:
            rid = 0  # refused unread
        self._send(op.peer, [frame], rid, f"{p.REQUESTS[op.msg_type].__name__} ({len(frame)} bytes) {frame[:300]!r}", op.msg_type)

    def _frames(self, peer_index: int, frames: list[bytes], what: str) -> None:
        if len(frames) > 1:
            self._send(peer_index, frames, 0, what, None)
            return
        frame = frames[0]
        head = msgpack.unpackb(frame, raw=False) if readable_id(frame) else {}
        msg_type = head.get("t") if type(head.get("t")) is int else None
        self._send(peer_index, frames, readable_id(frame), what, msg_type)

    def _huge(self, op: Huge) -> None:
        if op.envelope:
            rid = next(self._ids)
            head = _pack(_envelope(int(T.PING), {"pad": ""}, rid))
            frame = _pack(_envelope(int(T.PING), {"pad": "x" * max(0, op.size - len(head) - 4)}, rid))
        else:
            frame = bytes(op.size)
        self._frames(op.peer, [frame], f"a frame of {len(frame)} bytes")

    def _send(self, peer_index: int, frames: list[bytes], rid: int, what: str, msg_type: int | None) -> None:
        peer = self._peer(peer_index)
        peer.sock.send_multipart(frames)
        if max(len(frame) for frame in frames) > MAX_CONTROL_MESSAGE:
            # Past the daemon's bound libzmq closes the connection unread: no reply comes.
            self._replace_peer(peer_index)
            return
        if msg_type == T.CAPTURE_DONE and len(frames) == 1 and peer_index < SESSIONS:
            # Its reply may wait for its round: matched when it comes, or at the end.
            peer.deferred[rid] += 1
            self._collect(peer_index, peer, None, what, wait=0.0)
            return
        request = p.REQUESTS.get(msg_type) if msg_type is not None and len(frames) == 1 else None
        self._collect(peer_index, peer, rid, what, wait=REPLY_TIMEOUT, reply_type=request.REPLY if request else None)

    def _collect(
        self, peer_index: int, peer: Peer, rid: int | None, what: str, wait: float, reply_type: type[p.Message] | None = None
    ) -> dict[str, Any] | None:
        """Read replies until the one for ``rid`` came (None: only what is there now); its
        body, on success, must decode as ``reply_type``. Every other reply must answer a
        deferred request (a CAPTURE_DONE: a KvCommitReply)."""
        deadline = time.monotonic() + wait
        while True:
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not peer.sock.poll(timeout_ms, zmq.POLLIN):
                if rid is None:
                    return None
                self.alive(what)
                raise FuzzFailure(
                    f"{what}: no reply within {wait}s; the operations before it:\n" + "\n".join(self.history)
                    + f"\nthe daemon's log ends:\n{self.daemon_log()[-3000:]}"
                )
            frames = peer.sock.recv_multipart()
            if len(frames) != 1:
                raise FuzzFailure(f"{what}: a reply of {len(frames)} frames")
            reply = check_reply(frames[0], what)
            self._count(reply)
            if rid is not None and reply["id"] == rid:
                _check_body(frames[0], reply, reply_type, what)
                self._after_reply(peer_index, reply, what)
                return reply
            if peer.take_deferred(reply["id"]):
                _check_body(frames[0], reply, p.KvCommitReply, f"deferred reply {reply['id']}")
                self._after_reply(peer_index, reply, f"deferred reply {reply['id']}")
                continue
            raise FuzzFailure(f"{what}: a reply nobody asked for (id {reply['id']}, expected {rid}): {reply!r:.400}")

    def _count(self, reply: dict[str, Any]) -> None:
        self.errors["OK" if reply["ok"] else E(reply["code"]).name] += 1

    def _after_reply(self, peer_index: int, reply: dict[str, Any], what: str) -> None:
        """Take the descriptors a successful reply hands out; learn ids worth reusing."""
        if not reply["ok"]:
            return
        body = reply["b"]
        pool = body.get("pool")
        if isinstance(pool, dict) and type(pool.get("id")) is int:
            self.pools.append(pool["id"])
            del self.pools[:-64]
        batches = body.get("fd_batches", 0)
        if not batches:
            return
        if peer_index >= SESSIONS:
            raise FuzzFailure(f"{what}: descriptors promised to a peer without a session: {body!r:.300}")
        session = self.sessions[peer_index]
        assert session is not None
        # A map reply's batches carry its chunks; a graph pool reply's one batch, the pool's
        # lease segment, under the pool's id; a host buffer reply's, the buffer under its id.
        promised = {c["id"] for c in body.get("chunks", [])} | ({pool["id"]} if "chunks" not in body and isinstance(pool, dict) else set())
        if isinstance(body.get("buffer"), dict):
            promised.add(body["buffer"]["id"])
        got: list[int] = []
        for _ in range(batches):
            got += self._batch(session, reply["id"], what)
        if not set(got) <= promised:
            raise FuzzFailure(f"{what}: FD_BATCH chunk ids {sorted(got)} are not the reply's {sorted(promised)}")
        self.chunks += got
        del self.chunks[:-256]

    def _batch(self, session: FuzzSession, rid: int, what: str) -> list[int]:
        for i, (batch_rid, chunk_ids) in enumerate(session.batches):
            if batch_rid == rid:
                del session.batches[i]
                return chunk_ids
        while True:
            event = self._fd_event(session, what, REPLY_TIMEOUT)
            if event is None:
                raise FuzzFailure(f"{what}: the fd channel closed before the promised FD_BATCH")
            if event.get("t") == T.FD_BATCH:
                batch_rid, chunk_ids = event["b"]["request_id"], event["b"]["chunk_ids"]
                if batch_rid == rid:
                    return list(chunk_ids)
                session.batches.append((batch_rid, list(chunk_ids)))

    def _fd_event(self, session: FuzzSession, what: str, timeout: float) -> dict[str, Any] | None:
        """One fd-channel message (its descriptors closed, checked against its chunk ids),
        or None at EOF. Notices are read and dropped."""
        session.fd_sock.settimeout(timeout)
        try:
            payload, fds = _recv(session.fd_sock)
        except TimeoutError:
            self.alive(what)
            raise FuzzFailure(f"{what}: nothing on the fd channel within {timeout}s") from None
        for fd in fds:  # a lease segment (chunks are granules or more): kept mapped to scribble on
            if os.fstat(fd).st_size == lease_table.SEGMENT_BYTES:
                session.segments.append(mmap.mmap(fd, lease_table.SEGMENT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
                if len(session.segments) > 8:
                    session.segments.pop(0).close()
        _close_fds(fds)
        if not payload and not fds:
            return None
        data = msgpack.unpackb(payload, raw=False)
        if "ok" in data:
            return data
        try:
            event = p.decode_event(payload)
        except p.ProtocolError as exc:
            raise FuzzFailure(f"{what}: an fd-channel event that does not decode: {exc.message}") from None
        if isinstance(event, p.FdBatch) and len(fds) != len(event.chunk_ids):
            raise FuzzFailure(f"{what}: FD_BATCH with {len(fds)} descriptors for {len(event.chunk_ids)} chunks")
        return data  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ the fd channel

    def _fd_message(self, op: FdMessage) -> None:
        what = f"fd channel: {op!r:.300}"
        payload = spelled(op.payload)
        pipes = [os.pipe() for _ in range(op.stray_fds)]
        # Each descriptor is closed exactly once: a number closed twice may by then be one
        # ZeroMQ's I/O thread opened, and closing it under ZeroMQ aborts the process
        # ("File exists (src/epoll.cpp)").
        opened = {fd for pair in pipes for fd in pair}
        try:
            if op.session is None:
                self._fd_fresh(payload, op.then_hello, what, [w for _, w in pipes])
            else:
                self._fd_session(op.session, payload, what, [w for _, w in pipes])
            for _, w in pipes:
                opened.discard(w)
                os.close(w)
            for r, _ in pipes:
                if not select.select([r], [], [], REPLY_TIMEOUT)[0] or os.read(r, 1) != b"":
                    raise FuzzFailure(f"{what}: the daemon kept a stray descriptor")
        finally:
            for fd in opened:
                os.close(fd)

    def _fd_fresh(self, payload: bytes, then_hello: bool, what: str, fds: list[int]) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(REPLY_TIMEOUT)
        try:
            sock.connect(str(self.endpoints.fd_path))
            socket.send_fds(sock, [payload], fds)
            opened = self._fd_answer(sock, payload, fds, what)
            if then_hello and not opened:
                self._opened += 1
                sock.send(_pack(_envelope(int(T.HELLO), {"name": f"late-{self._opened}"}, 77)))
                payload, got = _recv(sock)
                _close_fds(got)
                reply = check_reply(payload, f"{what}, then HELLO")
                _check_body(payload, reply, p.HelloReply, f"{what}, then HELLO")
                self._count(reply)
                if not reply["ok"] or reply["id"] != 77:
                    raise FuzzFailure(f"{what}: a proper HELLO after it was refused: {reply!r:.300}")
        finally:
            sock.close()

    def _fd_answer(self, sock: socket.socket, payload: bytes, fds: list[int], what: str) -> bool:
        """The daemon's answer to a message on a connection without a session: one error
        reply, a session (the message was a HELLO after all), or EOF for an empty one.
        Returns whether a session opened."""
        if not payload and not fds:
            data, got = _recv(sock)
            _close_fds(got)
            if data or got:
                raise FuzzFailure(f"{what}: an empty message should end the connection, got {data[:200]!r}")
            return True  # closed: nothing more to send on it
        data, got = _recv(sock)
        if not data:
            _close_fds(got)
            raise FuzzFailure(f"{what}: the daemon closed the connection instead of answering")
        reply = check_reply(data, what)
        self._count(reply)
        _close_fds(got)
        if reply["ok"]:
            if fds or got:
                raise FuzzFailure(f"{what}: HELLO accepted with stray descriptors, or it brought some")
            return True
        if got:
            raise FuzzFailure(f"{what}: descriptors came with an error reply")
        _check_fd_reply_id(reply, payload, what)
        return False

    def _fd_session(self, index: int, payload: bytes, what: str, fds: list[int]) -> None:
        session = self.sessions[index] or self._reopen(index)
        socket.send_fds(session.fd_sock, [payload], fds)
        if not payload and not fds:
            # A zero-length SEQPACKET message reads as EOF: the daemon ends the session.
            while self._fd_event(session, what, REPLY_TIMEOUT) is not None:
                pass
            self._closed(index)
            return
        while True:
            event = self._fd_event(session, what, REPLY_TIMEOUT)
            if event is None:
                raise FuzzFailure(f"{what}: the daemon ended a session over a bad fd-channel message")
            if "ok" in event:
                break
            if event.get("t") == T.FD_BATCH:
                session.batches.append((event["b"]["request_id"], list(event["b"]["chunk_ids"])))
        reply = check_reply(_pack(event), what)
        self._count(reply)
        if reply["ok"]:
            raise FuzzFailure(f"{what}: a message after HELLO on the fd channel was accepted: {reply!r:.300}")
        _check_fd_reply_id(reply, payload, what)

    def _scribble(self, op: Scribble) -> None:
        session = self.sessions[op.session] or self._reopen(op.session)
        if not session.segments:
            return  # granted no pool's lease words: nothing it can reach
        segment = session.segments[op.offset // lease_table.SEGMENT_BYTES % len(session.segments)]
        at = op.offset % lease_table.SEGMENT_BYTES
        data = op.data[: lease_table.SEGMENT_BYTES - at]
        segment[at : at + len(data)] = data

    # ------------------------------------------------------------------ sessions

    def _reopen(self, index: int) -> FuzzSession:
        self._opened += 1
        session = FuzzSession(self.endpoints, f"s{index}-{self._opened}")
        self.sessions[index] = session
        self.session_words.append(lease_table.word_session(session.session_id))
        del self.session_words[:-16]
        # An arena with a shared graph pool (its lease segment mapped here, to scribble on)
        # and a KV pool to start from: generated requests rarely build both the thing and
        # the request that finds it, and most of the daemon lies past that.
        seed_pool = p.Extent(offset=0, size=SEED_COMMIT // 2)
        for message in (
            p.CreateArena(name=ARENA_NAMES[0].format(index), reserve_bytes=1 << 30),
            p.CommitArena(name=ARENA_NAMES[0].format(index), nbytes=SEED_COMMIT),
            p.RegisterGraphPool(arena=ARENA_NAMES[0].format(index), label="seed", extents=[seed_pool], free_runs=[seed_pool], shared=True),
            p.KvDeclare(name=ARENA_NAMES[2].format(index), buffers=[p.KvBuffer(name="k", row_bytes=4096), p.KvBuffer(name="v", row_bytes=4096)], max_tokens=4096),
        ):
            rid = next(self._ids)
            assert session.peer is not None
            session.peer.sock.send(p.encode_request(rid, message))
            # Best effort: other sessions may hold the memory or the name. A refusal is
            # still checked like any reply.
            self._collect(index, session.peer, rid, f"seeding session {session.name}: {message!r}", REPLY_TIMEOUT)
        return session

    def _reconnect(self, index: int) -> None:
        session = self.sessions[index]
        if session is not None:
            token = session.token
            self._closed(index)
            if self.stale is not None:
                self.stale.close()
                self.stale = None
            self.stale_token = token
        self._reopen(index)

    def _handover(self, op: Handover) -> None:
        session = self.sessions[op.session] if op.session is not None else None
        if session is not None and session.peer is not None:
            first, routing_id = session.peer, session.token
        else:
            routing_id = os.urandom(8)
            first = self._connected_peer(routing_id, collections.Counter())
        second = self._connected_peer(routing_id, collections.Counter())
        second.close()
        if op.speak_again:
            first.sock.send(_pack(_envelope(int(T.PING), {}, next(self._ids))))  # unanswered: the ROUTER reads it no more
        if first is not (session.peer if session is not None else None):
            first.close()
        else:
            assert op.session is not None
            self._replace_peer(op.session)

    def _crowd(self, size: int) -> None:
        crowd = [Peer(self.endpoints, None) for _ in range(size)]
        for peer in crowd:
            peer.close()

    def _stale_peer(self, token: bytes) -> Peer:
        return self._connected_peer(token, collections.Counter())

    def _connected_peer(self, routing_id: bytes | None, unsure: collections.Counter[int]) -> Peer:
        """A new DEALER with ``routing_id``, once the daemon answers it. Until ZeroMQ has
        torn down an earlier connection with that id (a closed session's, or one the daemon
        closed over a frame past its bound) the ROUTER refuses the new one and drops what it
        sends: ping until one answers. Replies to the ``unsure`` requests may come first."""
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            peer = Peer(self.endpoints, routing_id)
            peer.unsure = unsure
            rid = next(self._ids)
            peer.sock.send(_pack(_envelope(int(T.PING), {}, rid)))
            while peer.sock.poll(50, zmq.POLLIN):
                reply = check_reply(peer.sock.recv(), "PING from a reconnected peer")
                if reply["id"] == rid:
                    return peer
                if not peer.take_deferred(reply["id"]):
                    raise FuzzFailure(f"a reconnected peer got a reply nobody asked for: {reply!r:.300}")
            peer.close()
            if time.monotonic() > deadline:
                raise FuzzFailure(f"a reconnected peer got no answer to PING within {REPLY_TIMEOUT}s")

    def _replace_peer(self, index: int) -> None:
        """The daemon closed this peer's connection: a DEALER with the same routing id
        takes its place."""
        if index < SESSIONS:
            session = self.sessions[index]
            assert session is not None and session.peer is not None
            old = session.peer
            session.peer = self._connected_peer(session.token, old.deferred + old.unsure)
        elif index == ANONYMOUS:
            old, self.anonymous = self.anonymous, Peer(self.endpoints, None)
        elif index == FORGED or self.stale is None:
            old, self.forged = self.forged, Peer(self.endpoints, os.urandom(16))
        else:
            assert self.stale_token is not None
            old, self.stale = self.stale, self._stale_peer(self.stale_token)
        old.close()

    def _closed(self, index: int) -> None:
        session = self.sessions[index]
        if session is not None:
            session.close()
        self.sessions[index] = None

    # ------------------------------------------------------------------ the end

    def settle(self, round_wait: float) -> None:
        """Wait for every deferred reply (their rounds end by their deadline)."""
        for index, session in enumerate(self.sessions):
            if session is None or session.peer is None:
                continue
            deadline = time.monotonic() + round_wait
            while sum(session.peer.deferred.values()) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    pending = sorted(k for k, v in session.peer.deferred.items() if v)
                    raise FuzzFailure(f"session {session.name}: deferred requests {pending} got no reply within {round_wait}s")
                self._collect(index, session.peer, None, f"settling session {session.name}", wait=min(left, 0.5))

    def finish(self, round_wait: float, bounds: Bounds) -> dict[str, Any]:
        """Close everything, then check the accounting, RSS and descriptors."""
        self.settle(round_wait)
        unsure = sum(sum(s.peer.unsure.values()) for s in self.sessions if s is not None and s.peer is not None)
        for i in range(SESSIONS):
            self._closed(i)
        for peer in (self.anonymous, self.forged, self.stale):
            if peer is not None:
                peer.close()
        self.alive("the run")
        deadline = time.monotonic() + round_wait + 5.0
        while True:
            s = self.status()
            left = {
                "accounted_bytes": s.device.accounted_bytes,
                "clients": [c.name for c in s.clients],
                "arenas": [a.name for a in s.arenas],
                "graph_pools": [g.id for g in s.graph_pools],
                "kv": [k.name for k in s.kv],
                "open rounds": [r.id for r in s.rounds if r.state in (p.RoundState.OPEN, p.RoundState.AWAITING_SHRINK)],
            }
            if not any(left.values()):
                break
            if time.monotonic() > deadline:
                raise FuzzFailure(f"after the run, with every session closed, the daemon still holds {left}")
            time.sleep(0.05)
        fds = self._settled_fds(deadline)
        figures = {
            "cases": self.cases,
            "daemon_alive": self.probe.alive(),
            "rss_growth_bytes": self.probe.rss() - self.baseline_rss,
            "fds_growth": fds - self.baseline_fds,
            "errors_by_code": dict(sorted(self.errors.items())),
            "deferred_dropped_with_a_connection": unsure,
        }
        if figures["rss_growth_bytes"] > bounds.rss_growth:
            raise FuzzFailure(f"the daemon's RSS grew by {figures['rss_growth_bytes']} bytes over the run (bound {bounds.rss_growth})")
        if figures["fds_growth"] > bounds.fds_growth:
            kinds = collections.Counter(_fd_kind(d.split(" -> ", 1)[1]) for d in self.probe.descriptors())
            raise FuzzFailure(
                f"the daemon holds {figures['fds_growth']} more descriptors than at the start (bound {bounds.fds_growth}); "
                f"by kind: {dict(kinds)}; the operations before the end:\n" + "\n".join(self.history)
                + f"\nthe daemon's log ends:\n{self.daemon_log()[-3000:]}"
            )
        return figures

    def _settled_fds(self, deadline: float) -> int:
        # ZeroMQ closes a departed peer's connection on its own thread, a moment later.
        while True:
            fds = self.probe.fds()
            if fds <= self.baseline_fds or time.monotonic() > deadline:
                return fds
            time.sleep(0.05)

    def status(self) -> p.StatusReply:
        """STATUS, asked again once: with the last session closed the daemon reopens its
        control channel if connections stalled (control_door.py), and a request on the
        wire at that moment gets no reply."""
        for _ in range(2):
            peer = Peer(self.endpoints, None)
            try:
                rid = next(self._ids)
                peer.sock.send(p.encode_request(rid, p.Status()))
                if peer.sock.poll(int(REPLY_TIMEOUT * 1000 / 2), zmq.POLLIN):
                    reply = msgpack.unpackb(peer.sock.recv(), raw=False)
                    return msgspec.convert(reply["b"], p.StatusReply)
            finally:
                peer.close()
        raise FuzzFailure(f"STATUS, asked twice, got no reply within {REPLY_TIMEOUT}s")


def fuzz(world: World, cases: int) -> None:
    """Run at least ``cases`` generated operations against ``world``, in programs of
    PROGRAM operations: hypothesis never generates the same example twice, and an
    operation with few variants (closing a session) is worth repeating in new contexts."""

    @settings(
        max_examples=-(-cases // PROGRAM),
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        # Replaying an example against a daemon that has moved on proves little, and a
        # stalled daemon would make every replay wait out REPLY_TIMEOUT: no shrinking.
        phases=(Phase.generate,),
        report_multiple_bugs=False,
        # The failure names the operation and the ones before it; hypothesis's report of
        # the example would add a long repr of the same.
        verbosity=Verbosity.quiet,
    )
    @given(st.lists(operations(), min_size=PROGRAM, max_size=PROGRAM))
    def program(ops: list[Operation]) -> None:
        for op in ops:
            world.run(op)

    program()


def _fd_kind(target: str) -> str:
    """What a descriptor is, for a leak's report: a memfd by its name (the daemon names
    each kind it makes: chunks, lease segments, sleep buffers, its records)."""
    if target.startswith("/memfd:"):
        return target.removesuffix(" (deleted)")
    return target.split(":", 1)[0]
