"""Who holds the control channel's connections, and which ones the daemon hangs up.

libzmq accepts every control-channel connection on its own thread and aborts the
process when accept fails for want of descriptors, so the daemon counts them itself
(the ROUTER's socket monitor names each accepted and each closed descriptor) and keeps
them within the open-file limit's share for them (runtime.FdBudget.control).

Two ways a connection costs a descriptor for nothing: a peer that connects and never
sends (anyone who may open the socket can make thousands), and the connection a
routing id was handed over from (ROUTER_HANDOVER: the newest connection under an id
answers). libzmq cuts the old connection off from the socket but leaves it open; once
its peer sends again, its reader stalls for good and no hang-up reaches it, so it stays
open until the listener closes, one per handover, without limit.

The daemon hangs up (shutdown(2) on the descriptor the monitor named; libzmq sees the
hang-up and closes it) the connections a routing id left for a newer one, those that
sent nothing within the HELLO timeout, and, past the budget, connections no session
speaks through: first of the uid holding the most of them, the longest idle first.
Hanging up comes after the accept, and libzmq accepts faster than the daemon counts:
with the budget spent, or descriptors near the open-file limit, the door shuts (the
server makes libzmq's copy of the listener one no one reaches, and closes what comes off
the backlog itself) until a quarter of the budget is free again.

Connections hung up that stay open (stalled) are freed only by closing the listener: the
daemon reopens the control channel on the same listening socket when the budget is spent
or no session is open to notice (every client's DEALER reconnects on its own; a request
on the wire at that moment gets no reply).
"""

from __future__ import annotations

import collections
import dataclasses
import logging

from gpumemd.runtime import FdBudget

log = logging.getLogger("gpumemd.control_door")

# A connection hung up and still open this long later is stalled (see above): only
# reopening the channel frees it.
STALL_AFTER = 2.0
# The door shut this long, connections no session speaks through are hung up to open it.
SHUT_PATIENCE = 2.0
# Repeated warnings are summed up at most this often.
LOG_EVERY = 5.0


@dataclasses.dataclass(eq=False)
class ControlPeer:
    fd: int
    uid: int
    pid: int
    accepted: float  # monotonic
    spoke: float = 0.0  # its last request (monotonic); 0: none yet
    identity: bytes | None = None  # the routing id its requests come under, while it is that id's newest connection
    session: bool = False  # the identity is a live session's token
    hung_up: float = 0.0  # when the daemon shut it down (monotonic); 0: not


class ControlDoor:
    def __init__(self, budget: FdBudget, hello_timeout: float) -> None:
        self.budget = budget
        self.hello_timeout = hello_timeout
        self.peers: dict[int, ControlPeer] = {}  # by descriptor, oldest first
        self._newest: dict[bytes, int] = {}  # routing id -> the descriptor its requests came on last
        self._hung_up: collections.Counter[str] = collections.Counter()  # why, since the last log line
        self.door_shut = False  # past the budget: the daemon turns new connections away itself
        # Descriptors near the open-file limit, whatever holds them (chunks, the fd
        # channel): libzmq must not be the one that finds none left.
        self.fd_pressure = False
        self._shut_since = 0.0
        self.turned_away = 0  # since the last log line
        self._logged = 0.0

    def accepted(self, fd: int, uid: int, pid: int, now: float) -> None:
        self.closed(fd)  # a number reused before its close was read
        self.peers[fd] = ControlPeer(fd, uid, pid, now)

    def closed(self, fd: int) -> None:
        peer = self.peers.pop(fd, None)
        if peer is not None and peer.identity is not None and self._newest.get(peer.identity) == fd:
            del self._newest[peer.identity]

    def spoke(self, fd: int, identity: bytes, session: bool, now: float) -> int | None:
        """A request came on ``fd`` under ``identity`` (``session``: a live session's token).
        Returns the descriptor the identity came on before, now cut off (to hang up)."""
        peer = self.peers.get(fd)
        if peer is None:
            return None  # its accept not read from the monitor yet
        peer.spoke = now
        peer.session = session
        if peer.identity == identity:
            return None
        peer.identity = identity
        old = self._newest.get(identity)
        self._newest[identity] = fd
        cut = self.peers.get(old) if old is not None and old != fd else None
        if cut is None or cut.hung_up:
            return None
        cut.identity, cut.session = None, False
        self._hung_up["a newer connection took its routing id"] += 1
        return cut.fd

    def ended(self, token: bytes) -> None:
        """The session closed: its connection is anyone's now."""
        fd = self._newest.get(token)
        if fd is not None and fd in self.peers:
            self.peers[fd].session = False

    def newest(self, identity: bytes) -> int | None:
        """The descriptor ``identity``'s requests came on last."""
        return self._newest.get(identity)

    def connection_of(self, identity: bytes, why: str) -> ControlPeer | None:
        """The connection ``identity``'s requests came on last, to hang up for ``why``."""
        fd = self._newest.get(identity)
        peer = None if fd is None else self.peers.get(fd)
        if peer is None or peer.hung_up:
            return None
        self._hung_up[why] += 1
        return peer

    def hang_up(self, peer: ControlPeer, now: float) -> None:
        peer.hung_up = now

    def silent(self, now: float) -> list[ControlPeer]:
        """Connections that sent nothing within the HELLO timeout (to hang up)."""
        out = []
        for peer in self.peers.values():
            if now - peer.accepted <= self.hello_timeout:
                break
            if not peer.spoke and not peer.hung_up:
                out.append(peer)
        if out:
            self._hung_up[f"sent nothing within {self.hello_timeout:.1f}s"] += len(out)
        return out

    def excess(self, now: float) -> list[ControlPeer]:
        """Past the budget (or the door shut): the connections to hang up (none a session
        speaks through), of the uid holding the most first, the longest idle first."""
        # The door shut a while: down to where it opens again, so that a stalled
        # connection is found out (hung up and still open) instead of keeping it shut for
        # good. Not at once: each opening lets a burst in before the door shuts again.
        keep = self.budget.control
        if self.door_shut and now - self._shut_since >= SHUT_PATIENCE:
            keep, self._shut_since = keep * 3 // 4, now
        over = len(self.peers) - keep
        if over <= 0:
            return []
        loose = [p for p in self.peers.values() if not p.session and not p.hung_up]
        held = collections.Counter(p.uid for p in loose)
        loose.sort(key=lambda p: (-held[p.uid], p.spoke or p.accepted))
        out = loose[:over]
        if out:
            self._hung_up[f"the budget of {self.budget.control} control connections spent"] += len(out)
        return out

    def shut_door(self, now: float) -> bool | None:
        """Whether new connections must now be turned away (True) or let in (False); None:
        as it is. The door opens again once a quarter of the budget is free, so that a
        crowd that reconnects as it is hung up is not let in one at a time."""
        if not self.door_shut and (len(self.peers) >= self.budget.control or self.fd_pressure):
            self._shut_since = now
            return True
        if self.door_shut and len(self.peers) <= self.budget.control * 3 // 4 and not self.fd_pressure:
            return False
        return None

    def stalled(self, now: float, sessions: int) -> bool:
        """Connections hung up and still open, with the budget spent (the door shut) or
        while no session would notice the channel reopen: only reopening it frees them."""
        if sessions and not self.door_shut and len(self.peers) < self.budget.control:
            return False
        return any(p.hung_up and now - p.hung_up >= STALL_AFTER for p in self.peers.values())

    def reopened(self) -> None:
        """The listener closed, and every connection with it."""
        uids = collections.Counter(p.uid for p in self.peers.values() if p.hung_up)
        log.warning(
            "reopened the control channel: %d connections open, %d of them hung up and stalled (by uid: %s); the budget is %d "
            "(raise LimitNOFILE for more). Clients reconnect on their own; a request on the wire just now gets no reply",
            len(self.peers), sum(uids.values()), dict(uids.most_common(4)), self.budget.control,
        )
        self.peers.clear()
        self._newest.clear()

    def log_flood(self, now: float) -> None:
        if not (self._hung_up or self.turned_away) or now - self._logged < LOG_EVERY:
            return
        self._logged = now
        if self.turned_away:
            log.warning(
                "turned %d control-channel connection(s) away: %d open, the budget is %d (raise LimitNOFILE for more)",
                self.turned_away, len(self.peers), self.budget.control,
            )
            self.turned_away = 0
        for why, n in self._hung_up.items():
            if n:
                log.warning("hung up %d control-channel connection(s): %s", n, why)
        self._hung_up.clear()
