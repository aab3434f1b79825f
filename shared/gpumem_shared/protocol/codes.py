"""The numbers both peers agree on: the protocol version, the bounds on what one frame
may make the other side keep, the error codes, the message type numbers and the string
enums; and ``ProtocolError``, which carries a code to the error reply."""

from __future__ import annotations

import enum

PROTOCOL_VERSION: tuple[int, int] = (1, 13)

# The oldest protocol HELLO accepts, on either side (see the package doc, __init__.py).
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
# The longest a request may have the daemon hold its answer (ARENA_WAKE's and ADOPT's
# ``wait``): each waiting request is a record the daemon keeps and looks at again.
MAX_WAIT_S = 3600.0
# A tenant token (Hello.tenant_token): a random secret, tens of characters; the bound
# keeps what the daemon hashes at HELLO small.
MAX_TENANT_TOKEN = 256
# A resume credential (HelloReply.credential, Resume.credential): random bytes the daemon
# issues, this many. A RESUME with another length (an empty one above all) is refused
# when decoded, before any session is looked at.
RESUME_CREDENTIAL_BYTES = 32


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
    RESOURCE_EXHAUSTED = 16  # a tenant's (uid's) limit: sessions, arenas, address space, graph pools
    ARENA_ASLEEP = 17  # the arena sleeps: wake it before committing, decommitting or attaching
    HOST_LIMIT = 18  # host memory for sleepers' buffers is at the daemon's limit (--sleep-host-limit)
    GROUP_HELD = 20  # a retain group another live session holds (its owner, or the adopter that won)
    NOT_FENCED = 21  # a retain group's last holder may still write its memory: adoption waits


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
    KV_DEMAND = 25
    GRAPH_POOL_REGISTER = 30
    GRAPH_POOL_UPDATE = 31
    GRAPH_POOL_RETIRE = 32
    GRAPH_POOL_OPEN = 33
    LEASE_EVENT_PUBLISH = 34
    LEASE_EVENT_LOOKUP = 35
    GRAPH_POOL_ESCAPE = 36
    SLEEP_BUFFER = 40
    SLEEP_BUFFER_FREE = 41
    ARENA_SLEEP = 42
    ARENA_WAKE = 43
    RETAIN_GROUP = 50
    RETAIN = 51
    ADOPT = 52
    ADOPT_DONE = 53
    RETAIN_RESERVE = 54
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
