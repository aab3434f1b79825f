"""The control channel's connections, on the sockets: the ROUTER's monitor, which names
each connection libzmq accepts and closes; the listener the daemon owns, so that it can
shut the door and reopen the channel; the hang-ups. Which connections to hang up, and
when the door shuts or the channel reopens, is decided without sockets in
control_door.py; this module counts what happens and carries out what it decides.

The server creates the ROUTER, reads requests from it and sends replies on it; it tells
this module which routing id spoke on which connection, and when an fd-channel
connection takes a descriptor (descriptors near the open-file limit shut the door too).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Container, Sized
from pathlib import Path
from typing import Any

import zmq

from gpumem_shared import fdchannel
from gpumem_shared.paths import Endpoints
from gpumemd.admission import ACCEPT_BATCH
from gpumemd.control_door import ControlDoor, ControlPeer
from gpumemd.runtime import FdBudget

_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_SRCFD = int(zmq.SRCFD)

# What the ROUTER's monitor reports: each connection's descriptor as it comes and goes.
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_MONITOR_URL = "inproc://gpumemd.control-monitor"
# A monitor event's first frame (zmq_socket_monitor(3)): the event, then its value (the
# descriptor), native order, no padding. Read here rather than by
# zmq.utils.monitor.parse_monitor_message, whose module imports asyncio: a sixth of the
# daemon's imports, paid on every restart.
_MONITOR_EVENT = struct.Struct("=HI")
_ACCEPTED = int(zmq.EVENT_ACCEPTED)
# A short backlog: what libzmq can take in one burst, before the daemon sees the count
# and shuts the door, when it opens again.
CONTROL_BACKLOG = 16
# A descriptor numbered this close to the open-file limit (the kernel hands out the lowest
# free number, so it tells how many are open) shuts the door until the count is twice as
# far from it again.
FD_MARGIN = 16


class ControlChannel:
    def __init__(self, endpoints: Endpoints, budget: FdBudget, hello_timeout: float, poller: zmq.Poller,
                 sessions: Sized, fd_channel: Container[int]) -> None:
        self.endpoints = endpoints
        self.door = ControlDoor(budget, hello_timeout)
        self._poller = poller
        self._sessions = sessions  # the open sessions: with none, reopening the channel disturbs no one
        self._fd_channel = fd_channel  # the fd channel's descriptors: never one of the control channel's
        self._router: zmq.Socket[Any] | None = None
        self.monitor: zmq.Socket[Any] | None = None
        # What the loop polls for the monitor: its descriptor, not the socket. zmq_poll
        # asks a socket for its events (a syscall each) before and after every wait, on
        # every request; the descriptor costs nothing until libzmq signals it, and each
        # wake-up reads the monitor dry (the edge comes again with the next event).
        self.monitor_fd = -1
        self.listener: socket.socket | None = None  # the ROUTER listens on copies of it
        self._zmq_fd = -1  # the ROUTER's copy (libzmq's to close)
        self._shut_door: socket.socket | None = None  # what the ROUTER's copy is while the door is shut

    def open(self, ctx: zmq.Context[Any], router: zmq.Socket[Any]) -> None:
        """Monitor ``router`` and bind it on a listener the daemon owns (the caller turns
        OSError and ZMQError into a startup error, and calls ``close``)."""
        self._router = router
        router.monitor(_MONITOR_URL, _MONITOR_EVENTS)
        self.monitor = ctx.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # a lost event would leave a connection uncounted
        self.monitor.connect(_MONITOR_URL)
        self.monitor_fd = self.monitor.fileno()
        # Reopening the channel closes the ROUTER's copy and every connection it
        # accepted, while clients connecting meanwhile wait in the backlog of this one
        # instead of finding no socket.
        ep = self.endpoints
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.bind(str(ep.zmq_path))
        self.listener.listen(CONTROL_BACKLOG)
        self.listener.setblocking(False)
        self._shut_door = unreachable_listener(ep.runtime_dir / f"{ep.zmq_path.name}.shut")
        self._bind()

    def close(self) -> None:
        """Before the ROUTER closes: libzmq lets go of the listener it polls."""
        if self.door.door_shut:
            self._shut(False)
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor, self.monitor_fd = None, -1
        for sock in (self.listener, self._shut_door):
            if sock is not None:
                sock.close()
        self.listener = self._shut_door = None

    # ------------------------------------------------------------------ what the server tells

    def spoke(self, frame: zmq.Frame, identity: bytes, session: bool) -> None:
        """A request came in ``frame`` under ``identity`` (``session``: a live session's
        token): a routing id that moved to a newer connection hangs the old one up."""
        door = self.door
        fd = frame.get(_SRCFD)
        if fd not in door.peers:
            self.on_monitor()  # its accept not counted yet: the hand-over must not go unseen
        cut_off = door.spoke(fd, identity, session, time.monotonic())
        if cut_off is not None:
            self._hang_up(door.peers[cut_off], time.monotonic())

    def hang_up(self, identity: bytes, why: str) -> None:
        """Hang up the connection ``identity``'s requests came on last (``why``: for the log)."""
        peer = self.door.connection_of(identity, why)
        if peer is not None:
            self._hang_up(peer, time.monotonic())

    def unread(self, identity: bytes) -> bool:
        """Whether the connection ``identity``'s requests came on last takes no more
        bytes (not writable: as much waits unread in the kernel as it lets a writer
        queue): its peer does not read. The socket is libzmq's: asked through a copy of
        its descriptor, checked to be the control channel's still."""
        fd = self.door.newest(identity)
        if fd is None or fd in self._fd_channel:
            return False
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family != socket.AF_UNIX or sock.getsockname() != str(self.endpoints.zmq_path):
                    return False
                ready = select.poll()
                ready.register(sock.fileno(), select.POLLOUT)
                return not ready.poll(0)
        except OSError:
            return False

    def fd_opened(self, fd: int, now: float) -> None:
        """The daemon took descriptor ``fd`` (a control or an fd-channel connection)."""
        if fd >= self.door.budget.limit - FD_MARGIN:
            self.door.fd_pressure = True
        if self.door.shut_door(now):
            self._shut(True)  # at once: libzmq goes on accepting meanwhile

    def on_monitor(self) -> None:
        """Connections as libzmq accepts and closes them; past the budget, hang up the
        excess at once (a burst must not reach the open-file limit)."""
        now = time.monotonic()
        self._read_monitor(now)
        self._guard(now, self.door.excess(now))

    def _read_monitor(self, now: float) -> None:
        assert self.monitor is not None
        while True:
            try:
                head, _endpoint = self.monitor.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            event, fd = _MONITOR_EVENT.unpack(head)
            if event == _ACCEPTED:
                pid, uid = peer_of(fd)
                self.door.accepted(fd, uid, pid, now)
                self.fd_opened(fd, now)
            else:
                self.door.closed(fd)

    def turn_away(self) -> None:
        """The door is shut: connections off the listener's backlog are closed."""
        assert self.listener is not None
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self.listener.accept()
            except OSError:  # BlockingIOError: none left; EMFILE: none can be taken now either
                break
            sock.close()
            self.door.turned_away += 1

    def tick(self, now: float) -> None:
        """Silent connections and the excess hung up, the door and the channel seen to."""
        door = self.door
        self._read_monitor(now)  # should a wake-up have gone amiss, the count is right within a tick
        if door.fd_pressure:
            door.fd_pressure = open_fds() >= door.budget.limit - 2 * FD_MARGIN
        self._guard(now, [*door.silent(now), *door.excess(now)])
        door.log_flood(now)

    # ------------------------------------------------------------------ carrying it out

    def _bind(self) -> None:
        assert self._router is not None and self.listener is not None
        self._zmq_fd = os.dup(self.listener.fileno())
        self._router.setsockopt(zmq.USE_FD, self._zmq_fd)
        self._router.bind(self.endpoints.zmq_url)
        self.door.door_shut = False

    def _guard(self, now: float, victims: list[ControlPeer]) -> None:
        for peer in victims:
            self._hang_up(peer, now)
        if self.door.stalled(now, len(self._sessions)):
            self._reopen()
        shut = self.door.shut_door(now)
        if shut is not None:
            self._shut(shut)

    def _shut(self, shut: bool) -> None:
        """libzmq accepts every connection the moment it comes, faster than the daemon can
        count and hang up: a burst would reach the open-file limit first. Past the budget
        the ROUTER's copy of the listener becomes a listener no one can reach (dup2: its
        poll registration stays on the real one, its accept finds nothing), and the daemon
        takes the connections that come off the backlog itself and closes them; their
        DEALERs try again later."""
        assert self.listener is not None and self._shut_door is not None
        os.dup2((self._shut_door if shut else self.listener).fileno(), self._zmq_fd)
        self.door.door_shut = shut
        if shut:
            self._poller.register(self.listener.fileno(), _POLLIN)
        else:
            self._poller.unregister(self.listener.fileno())

    def _hang_up(self, peer: ControlPeer, now: float) -> None:
        """shutdown(2) on a connection libzmq holds: it sees the hang-up and closes it. The
        descriptor must still be that connection: the monitor may not have told its close
        yet, and the number may be the daemon's own again."""
        self.door.hang_up(peer, now)
        if peer.fd in self._fd_channel:
            return
        try:
            with socket.socket(fileno=os.dup(peer.fd)) as sock:
                if sock.family == socket.AF_UNIX and sock.getsockname() == str(self.endpoints.zmq_path):
                    sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed meanwhile

    def _reopen(self) -> None:
        """Close the ROUTER's listener, and with it every connection it accepted (the only
        way to free a stalled one, control_door.py), then listen again on the same socket."""
        assert self._router is not None
        if self.door.door_shut:  # libzmq's copy must be the listener it polls when it lets go of it
            self._shut(False)
        self._router.unbind(self.endpoints.zmq_url)  # libzmq closes its copy
        self.door.reopened()
        self._bind()


def open_fds() -> int:
    """Descriptors open in this process (past any limit when listing them fails: EMFILE)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 1 << 30


def unreachable_listener(path: Path) -> socket.socket:
    """A listening socket no one can connect to (bound at ``path``, unlinked at once)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    try:
        sock.bind(str(path))
        os.unlink(path)
        sock.listen(1)
    except OSError:
        sock.close()
        raise
    return sock


def peer_of(fd: int) -> tuple[int, int]:
    """The pid and uid of the peer on a connection's descriptor ((-1, -1) if it is gone
    already)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            pid, uid, _ = fdchannel.peer_credentials(sock)
    except OSError:
        return -1, -1
    return pid, uid
