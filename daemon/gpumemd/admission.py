"""Who gets in, and in what order they are served: the fd channel's connections (the
ones the open-file limit allows, and those that have not said HELLO yet, which anyone
who may open the socket can make), and the control requests read but not yet served.

The server owns the sockets and the poller; this object owns the policy. Past the limit
of connections waiting for their HELLO, a new connection takes the place of the oldest
silent one; while none may be accepted, or after accept failed for want of descriptors
or memory, the listener rests (unpolled, its connections waiting in the kernel's
backlog) instead of waking the loop for nothing. Floods are summed up in the log.

Service: control requests wait in one queue per peer (``FairQueue``), served one uid at
a time in turn and one peer of that uid at a time in turn, so a peer that floods
(however many connections or sessions it opens) waits behind itself rather than putting
every other tenant behind its backlog.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections import deque

from gpumem_shared import protocol as p
from gpumem_shared.units import format_size

from gpumemd.config import MiB
from gpumemd.records import SessionRecord
from gpumemd.runtime import FdBudget

log = logging.getLogger("gpumemd.admission")

# Once the pending cap is reached, a new connection takes the place of the oldest silent
# one, if that one has been silent this long: a client says HELLO as soon as it connects,
# so a connection this old is not one about to speak. Younger ones are not evicted: the
# listener rests, new connections wait in the kernel's backlog, and a flood costs the
# daemon one accept per evicted connection, at most MAX_PENDING per this many seconds.
EVICT_AFTER = 0.5
# After accept fails for want of descriptors (EMFILE, ENFILE) or memory, the listener
# rests this long instead of being polled, readable and unaccepted, in a tight loop.
ACCEPT_BACKOFF = 0.5
# Connections accepted per wake-up: the control channel and live sessions get their turn
# in between.
ACCEPT_BATCH = 32
# Repeated warnings about a flood (evictions, peers that never said HELLO) are summed up
# at most this often.
FLOOD_LOG_EVERY = 5.0


@dataclasses.dataclass(eq=False)
class Connection:
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    accepted: float  # monotonic
    deadline: float  # HELLO must arrive before this (monotonic)
    session: SessionRecord | None = None


class Admission:
    def __init__(self, budget: FdBudget, hello_timeout: float) -> None:
        self.budget = budget
        self.hello_timeout = hello_timeout
        self.connections: dict[int, Connection] = {}  # by socket fd
        self.pending: dict[int, Connection] = {}  # those without a session, oldest first
        self.listening = False  # whether the poller watches the listener
        self._rest_until = 0.0
        self._full_logged = False  # "not accepting: budget spent" said for this stretch
        self._evicted: list[int] = []  # pids of silent connections evicted since the last log
        self._silent: list[int] = []  # pids of peers dropped for no HELLO since the last log
        self._flood_logged = 0.0

    def may_accept(self, now: float) -> bool:
        if now < self._rest_until:
            return False
        if len(self.pending) < self.budget.pending and len(self.connections) < self.budget.connections:
            return True
        oldest = next(iter(self.pending.values()), None)
        return oldest is not None and now - oldest.accepted >= EVICT_AFTER

    def full(self) -> bool:
        """Accepting one more means evicting the oldest silent connection first."""
        return len(self.pending) >= self.budget.pending or len(self.connections) >= self.budget.connections

    def evictee(self) -> Connection:
        oldest = next(iter(self.pending.values()))
        self._evicted.append(oldest.pid)
        return oldest

    def accept_failed(self, now: float, error: OSError, exhausted: str) -> None:
        """EMFILE, ENFILE, ENOBUFS, ENOMEM: the connection stays in the backlog and the
        listener readable; polling it now would spin."""
        self._rest_until = now + ACCEPT_BACKOFF
        log.warning(
            "accept on the fd channel failed: %s (out of %s; open-file limit %d, %d fd-channel connections, %d "
            "before HELLO); not accepting for %.1fs, serving the sessions already open",
            error.strerror, exhausted, self.budget.limit, len(self.connections), len(self.pending), ACCEPT_BACKOFF,
        )

    def admit(self, conn: Connection) -> None:
        fd = conn.sock.fileno()
        self.connections[fd] = conn
        self.pending[fd] = conn

    def opened(self, conn: Connection) -> None:
        """It said HELLO: a session now, no longer a stranger."""
        self.pending.pop(conn.sock.fileno(), None)

    def forget(self, fd: int) -> Connection | None:
        self.pending.pop(fd, None)
        return self.connections.pop(fd, None)

    def silent(self, now: float) -> list[Connection]:
        """Pending connections past their HELLO deadline (to drop), oldest first."""
        out = []
        for conn in self.pending.values():
            if now <= conn.deadline:
                break
            self._silent.append(conn.pid)
            out.append(conn)
        return out

    def listen_change(self, now: float) -> bool | None:
        """Whether the listener should now be polled (True) or not (False); None: as it is."""
        wanted = self.may_accept(now)
        if wanted == self.listening:
            return None
        self.listening = wanted
        if wanted:
            self._full_logged = False
        elif now >= self._rest_until and not self.pending and not self._full_logged:
            self._full_logged = True
            log.warning(
                "not accepting fd-channel connections: %d sessions, the most the open-file limit %d allows "
                "(raise LimitNOFILE); new clients wait in the listen backlog",
                len(self.connections), self.budget.limit,
            )
        return wanted

    def log_flood(self, now: float) -> None:
        if not (self._evicted or self._silent) or now - self._flood_logged < FLOOD_LOG_EVERY:
            return
        self._flood_logged = now
        for pids, what in (
            (self._silent, f"connected but sent no HELLO within {self.hello_timeout:.1f}s"),
            (self._evicted, f"evicted for newer connections once {self.budget.pending} were waiting for their HELLO"),
        ):
            if pids:
                shown = ", ".join(str(pid) for pid in sorted(set(pids))[:8])
                log.warning("dropped %d fd-channel peer(s) (pid %s): %s", len(pids), shown, what)
        self._evicted, self._silent = [], []


# Anonymous control peers (gpumemctl, pings) share one queue: a connection costs nothing
# to open, so they are served as one peer, however many there are, in a turn of their own
# (ANONYMOUS_UID: no uid is -1).
ANONYMOUS = 0
ANONYMOUS_UID = -1
# Read ahead of service: enough for every anonymous peer a few requests deep, and bytes
# for a thousand average requests many times over (a frame may be 2 MiB; real ones are
# hundreds of bytes). The bytes are a budget per uid, its sessions' requests together:
# one uid's backlog, however many sessions it opens, cannot refuse another uid's
# requests. Anonymous peers, who need no session (gpumemctl, pings), get a small one: a
# few of them must not fill what the sessions need.
ANONYMOUS_QUEUED = 1024
QUEUED_BYTES = 64 * MiB
ANONYMOUS_BYTES = 4 * MiB


class FairQueue:
    """Control requests read, not yet served: a FIFO per peer (a session id, or
    ANONYMOUS), the ring of its peers with requests waiting per uid, and the ring of
    uids with requests waiting. ``pop`` takes the next uid's next peer's oldest request,
    so each peer's requests keep their order, one uid's backlog delays another uid by one
    request per turn at most however many sessions it opens, and a uid's sessions take
    turns among themselves."""

    def __init__(self, per_session: int) -> None:
        self.per_session = per_session
        self._queues: dict[int, deque[tuple[bytes, bytes]]] = {}
        self._rings: dict[int, deque[int]] = {}  # uid -> its peers with requests waiting, in turn
        self._bytes: dict[int, int] = {}  # uid -> bytes of its requests waiting
        # The uids with requests waiting, in turn: empty while nothing is queued (the
        # server's loop asks on every turn, so it asks the deque, not a method).
        self.turns: deque[int] = deque()

    def push(self, peer: int, uid: int, identity: bytes, frame: bytes) -> p.ProtocolError | None:
        """Queue ``frame`` from ``peer`` of ``uid`` (ANONYMOUS, ANONYMOUS_UID: no
        session), or the refusal to answer it with at once."""
        queue = self._queues.get(peer)
        held = 0 if queue is None else len(queue)
        cap = ANONYMOUS_QUEUED if peer == ANONYMOUS else self.per_session
        if held >= cap:
            who = "anonymous control peers" if peer == ANONYMOUS else f"session {peer}"
            flag = "" if peer == ANONYMOUS else " (--tenant-requests)"
            return p.ProtocolError(
                p.ErrorCode.RESOURCE_EXHAUSTED,
                f"{who} already have {held} requests waiting for the daemon, the limit{flag}; wait for their replies",
                limit="requests",
                used=held,
                cap=cap,
            )
        used = self._bytes.get(uid, 0)
        budget = ANONYMOUS_BYTES if peer == ANONYMOUS else QUEUED_BYTES
        if used + len(frame) > budget:
            who = "anonymous control peers hold" if peer == ANONYMOUS else f"the sessions of uid {uid} hold"
            return p.ProtocolError(
                p.ErrorCode.RESOURCE_EXHAUSTED,
                f"{who} {format_size(used)} of requests waiting for the daemon, their limit; send again once they are served",
                limit="request bytes",
                used=used,
                cap=budget,
            )
        if queue is None:
            queue = self._queues[peer] = deque()
            ring = self._rings.get(uid)
            if ring is None:
                ring = self._rings[uid] = deque()
                self.turns.append(uid)
            ring.append(peer)
        queue.append((identity, frame))
        self._bytes[uid] = used + len(frame)
        return None

    def pop(self) -> tuple[bytes, bytes]:
        uid = self.turns.popleft()
        ring = self._rings[uid]
        peer = ring.popleft()
        queue = self._queues[peer]
        identity, frame = queue.popleft()
        self._bytes[uid] -= len(frame)
        if queue:
            ring.append(peer)
        else:
            del self._queues[peer]
        if ring:
            self.turns.append(uid)
        else:
            del self._rings[uid], self._bytes[uid]
        return identity, frame
