"""Sleep and wake: an arena hands its chunks back to the device and gets them again at
the same addresses; what it keeps goes to a host buffer the daemon creates, accounts
and keeps (a sealed memfd per arena, granted like a lease segment, kept in the fd store
across a restart). The engine does the copies itself: it maps both sides."""

from __future__ import annotations

from gpumem_shared.protocol.arenas import MapReply
from gpumem_shared.protocol.base import Ack, Message, RequestMessage
from gpumem_shared.protocol.codes import MsgType


class HostBufferView(Message):
    id: int  # the FD_BATCH that follows carries this id and the buffer's memfd
    size: int


class HostBufferReply(Message):
    """The arena's host buffer; its memfd follows in ``fd_batches`` (1) FD_BATCH tagged
    with the request id, its one id the buffer's."""

    arena: str
    buffer: HostBufferView
    fd_batches: int


class SleepBuffer(RequestMessage, kw_only=True):
    """Owner only: a host buffer of at least ``nbytes`` for arena ``arena``'s contents.
    The one the arena has is handed out again when it is large enough; else a new one
    replaces it (the client unmapped the old one first). Counted against the daemon's
    host limit (HOST_LIMIT names the limit, the use and the largest users). Sealed: it
    cannot grow or shrink, so the accounting is exact."""

    TYPE = MsgType.SLEEP_BUFFER
    REPLY = HostBufferReply
    arena: str
    nbytes: int


class FreeSleepBuffer(RequestMessage, kw_only=True):
    """Owner only: the arena's host buffer goes (the client unmapped it)."""

    TYPE = MsgType.SLEEP_BUFFER_FREE
    REPLY = Ack
    arena: str


class SleepArena(RequestMessage, kw_only=True):
    """Owner only: hand every chunk of the arena back (the reply's ``retired``: unmap
    them, then CHUNKS_UNMAPPED); the window, its graph pools and their leases stay. The
    daemon remembers the committed size; ``kept_bytes``: what the client copied to the
    host buffer first (shown in status). Refused while another session has the arena
    attached. Commit, decommit and attach are ARENA_ASLEEP until WAKE."""

    TYPE = MsgType.ARENA_SLEEP
    REPLY = MapReply
    name: str
    kept_bytes: int = 0


class WakeArena(RequestMessage, kw_only=True):
    """Owner only: commit the arena again to the size it had when it fell asleep, at the
    same offsets (fresh chunks, zeroed); the reply's ``chunks`` are to map. When the
    device lacks the memory, KV pools above their fair share are asked to give back and
    the answer waits (deferred, since 1.12) until it fits, or ``wait`` seconds; then
    OUT_OF_MEMORY names the figures and who holds the device's memory. ``wait`` 0 (and a
    daemon before 1.12): answered at once."""

    TYPE = MsgType.ARENA_WAKE
    REPLY = MapReply
    name: str
    wait: float = 0.0
