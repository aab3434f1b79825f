"""KV pools, and the commit rounds that size them after capture."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gpumem_shared.protocol.base import Ack, ArenaView, ChunkView, Message, RequestMessage, RoundBudget
from gpumem_shared.protocol.codes import MAX_KV_BUFFERS, MsgType, RoundState


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
    # A grow's answer: the tokens it asked for (the pool's ``tokens`` are what it got,
    # fewer when other pools did not give back enough by the move deadline), and the
    # pools asked to give back that had not confirmed by then ("client/pool").
    asked_tokens: int = 0
    unanswered: list[str] = msgspec.field(default_factory=list)
    # since 1.9: the pools asked that went away before they answered ("client/pool"):
    # their client died (or closed) or released them, and what they held came back whole.
    gone: list[str] = msgspec.field(default_factory=list)


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
    """Commit more rows (up to ``tokens``). When the device lacks the memory, the daemon
    asks pools above their fair share to give back (KV_SHRINK notices) and answers once
    they did, or at the move deadline with what it could get (``asked_tokens`` and
    ``unanswered`` and ``gone`` in the reply); OUT_OF_MEMORY when it could get nothing.
    Given ``wait`` (since 1.12; a sleeping pool's wake), it waits for all its rows up to
    ``wait`` seconds (pools that answered and could give more are asked again, and memory
    others free is taken as it comes), then answers with what fits."""

    TYPE = MsgType.KV_GROW
    REPLY = KvCommitReply
    pool: str
    tokens: int
    in_use: int = -1  # rows the engine uses now (-1: not said); 0 marks the pool idle
    wait: float = 0.0


class KvShrink(RequestMessage, kw_only=True):
    """The owner confirms rows from ``tokens`` on are free: the daemon decommits them
    (whole chunks: the pool may keep a few more rows) and the reply lists the chunks to
    unmap."""

    TYPE = MsgType.KV_SHRINK
    REPLY = KvCommitReply
    pool: str
    tokens: int
    in_use: int = -1  # rows the engine uses now (-1: not said); 0 marks the pool idle
    # since 1.9: the pool falls asleep (``tokens`` 0): shown asleep (STATUS ``sleepers``),
    # no share and never asked to give back until its owner's next grow, which wakes it;
    # ``kept_bytes``: what the owner copied to its host buffer first.
    sleep: bool = False
    kept_bytes: int = 0


class KvDemand(RequestMessage, kw_only=True):
    """What the engine uses of its pool now, sent when that changes much (a burst
    starts, the pool goes idle), not per step: a pool that uses less than it holds may
    be asked to give the rest back to a pool that needs it; 0 marks it idle."""

    TYPE = MsgType.KV_DEMAND
    REPLY = Ack
    pool: str
    in_use: int
