"""Retained memory: arenas and KV pools that outlive their engine's death, kept for a
named group and adopted by the next session that gives the group's secret.

A session opens a group (RETAIN_GROUP: the daemon grants its secret) and marks what it
owns as retained for it (RETAIN). If the session ends without releasing them (its
process died, or it did not resume after a daemon restart), they are orphaned instead
of reclaimed: kept and accounted until ``--retain-grace`` runs out. ADOPT, with the
group's name and secret, from a process of the group's uid, hands every object to the
adopter at the same addresses once the dead holder can no longer write (fenced);
ADOPT_DONE confirms it. An adopter that dies before confirming gives them back to the
orphaned state, deadline unchanged. docs/architecture.md, "Retained memory".
"""

from __future__ import annotations

from gpumem_shared.protocol.base import Ack, ArenaView, ChunkView, Message, RequestMessage
from gpumem_shared.protocol.codes import MsgType, WireEnum
from gpumem_shared.protocol.kv import KvPoolView


class RetainState(WireEnum):
    HELD = "held"  # a live session holds the group
    ORPHANED = "orphaned"  # its holder ended without releasing: adoptable once fenced, until the deadline
    ADOPTING = "adopting"  # an adopter took it and has not confirmed (ADOPT_DONE) yet


class RetainGroupReply(Message):
    group: str
    secret: str  # 64 hex characters: give it to the process that may adopt the group


class RetainGroup(RequestMessage, kw_only=True):
    """Open retain group ``group`` for this session (or get the secret again of one it
    holds). Group names are each uid's own, like arena names; a group belongs to
    the uid that opened it."""

    TYPE = MsgType.RETAIN_GROUP
    REPLY = RetainGroupReply
    group: str


class Retain(RequestMessage, kw_only=True):
    """Mark arena or KV pool ``name`` (this session owns it) as retained for ``group``
    (this session holds it), or unmark it (``retained`` false)."""

    TYPE = MsgType.RETAIN
    REPLY = Ack
    group: str
    name: str
    retained: bool = True


class AdoptedObject(Message):
    """One retained object as the adopter maps it: every committed chunk (their fds
    follow), and the KV pool's layout where it is one."""

    arena: ArenaView
    chunks: list[ChunkView]
    kv: KvPoolView | None = None


class AdoptReply(Message):
    group: str
    objects: list[AdoptedObject]
    fd_batches: int  # FD_BATCH messages tagged with the request id, before this reply
    previous: str  # the client that held the group before: "client 'x' (pid N)"
    # Until the objects are released if this adoption is not confirmed and the adopter
    # dies meanwhile (the orphan's deadline, unchanged by the adoption).
    deadline_in_s: float
    # (1.13) Every writer the adoption waited to be fenced: the last holder, then each
    # other session that mapped the group's memory and ended (a sharer). No other live
    # session maps it: an ADOPT is NOT_FENCED while one does, naming it.
    waited_for: list[str] = []


class Adopt(RequestMessage, kw_only=True):
    """Take over an orphaned group: its objects become this session's, at the same
    addresses. GROUP_HELD while a live session holds it (naming the holder: the owner,
    or the adopter that came first); NOT_FENCED while its last holder's process, or that
    of a sharer that ended, may still write, or a live sharer maps its memory (since
    1.13); PERMISSION_DENIED for a wrong secret or another uid. Given ``wait`` (since
    1.12), the answer waits (deferred) while the holder lives or is not fenced yet, up to
    ``wait`` seconds, and comes once the group is adopted; at once if another adopter
    takes it first. ``wait`` 0 (and a daemon before 1.12): answered at once."""

    TYPE = MsgType.ADOPT
    REPLY = AdoptReply
    group: str
    secret: str
    wait: float = 0.0


class AdoptDone(RequestMessage, kw_only=True):
    """The adopter mapped what it adopted: the group is its own from now on (a later
    death orphans it with a fresh deadline)."""

    TYPE = MsgType.ADOPT_DONE
    REPLY = Ack
    group: str


class ReserveReply(Message):
    """Where the group's objects lie: each arena's window and the KV pool's layout
    (``chunks`` empty: a reservation maps no byte of them)."""

    group: str
    objects: list[AdoptedObject]


class RetainReserve(RequestMessage, kw_only=True):
    """The windows of a group's objects, for a standby that will adopt it: it backs them
    with its own placeholder and captures its graphs there before the holder dies.
    Any state of the group; the same checks of uid and secret as ADOPT. No fds, no
    contents, nothing changes in the daemon."""

    TYPE = MsgType.RETAIN_RESERVE
    REPLY = ReserveReply
    group: str
    secret: str


class RetainedStatus(Message):
    """A retain group as status shows it (never its secret)."""

    group: str
    uid: int
    state: RetainState
    objects: list[str]  # arena and KV pool names
    committed_bytes: int  # what its objects hold (accounted)
    holder: str = ""  # the client holding it ("" while orphaned)
    holder_pid: int = 0
    previous: str = ""  # the client that held it last (the dead one, while orphaned)
    previous_pid: int = 0
    fenced: bool = False  # the previous holder's process can no longer write (orphaned only)
    deadline_in_s: float = -1.0  # until an orphaned (or unconfirmed) group is released; -1: held
