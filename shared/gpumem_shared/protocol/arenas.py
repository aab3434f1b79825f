"""Arenas: create one, share it and attach to it, commit and decommit, sync a mapping,
release; placeholder chunks for capture over uncommitted space."""

from __future__ import annotations

import msgspec

from gpumem_shared.protocol.base import Ack, ArenaView, ChunkView, Message, RequestMessage
from gpumem_shared.protocol.codes import MsgType
from gpumem_shared.protocol.status import GrantStatus


class ArenaReply(Message):
    arena: ArenaView


class MapReply(Message):
    """Chunks to map (their fds follow on the fd channel in ``fd_batches`` FD_BATCH
    messages tagged with this request's id) and chunks to unmap (then CHUNKS_UNMAPPED)."""

    arena: ArenaView
    chunks: list[ChunkView]
    retired: list[ChunkView]
    fd_batches: int
    # since 1.9: this session attached through a read-only grant: the fds map read-only
    # (on the host backend nothing else; on CUDA the client maps with read access only).
    read_only: bool = False


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
    # since 1.9: sessions it admits map the arena read-only (a standby mapping the weights).
    read_only: bool = False


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
