"""The control channel: a ZeroMQ DEALER speaking request/reply to the daemon's ROUTER.

A session's requests go on it (gpumem.channel.SessionChannel owns one, under the token
HELLO returned as its routing id); gpumemctl uses one anonymously, for the requests that
need no session (PING, STATUS). Replies to deferred requests (a KV round's CAPTURE_DONE)
that come while another request is waited for are kept for their own ``receive``.
"""

from __future__ import annotations

import grp
import itertools
import os
import pwd
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumem.errors import DaemonTimeout, SocketPermissionDenied, error_from_protocol, error_from_reply

# While waiting for a reply, wake this often to let the caller check whether the
# daemon is still there (its fd channel) instead of sleeping out the whole timeout. A
# call out when the daemon died sees it at the next wake: a daemon restarted in 150 ms
# (host backend) was resumed with only at the 250 ms that this was. A wake with nothing
# to do costs microseconds; the first wait of a call sets no option (RCVTIMEO stays).
_SLICE_MS = 25

# How long a request may wait to be queued: only a daemon that stopped reading while
# a thousand requests piled up (ZeroMQ's high-water mark) makes a send wait at all.
_SEND_TIMEOUT_MS = 5000


def permission_denied(path: Path) -> SocketPermissionDenied:
    """The error for a daemon socket this user may not open: it names the socket, or the
    directory on the way to it, and the group that owns it."""
    try:
        st = os.stat(path)
        closed = path
    except PermissionError:
        # A directory on the way is not searchable: name the first one.
        closed = next(d for d in reversed(path.parents) if not os.access(d, os.X_OK, effective_ids=True))
        st = os.stat(closed)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = str(os.geteuid())
    mode = st.st_mode & 0o7777
    where = "" if closed == path else f": the directory {closed} is closed to this user"
    facts = f"{closed} is {owner}:{group}, mode {mode:04o}"
    if not mode & (0o020 if closed == path else 0o010):
        # The group may not pass either: joining it would not help.
        return SocketPermissionDenied(
            f"permission denied: gpumemd's socket {path} is closed to this user{where} ({facts}); gpumemd's runtime "
            "directory must be searchable and its sockets open to a group (gpumemd --socket-group)"
        )
    if st.st_gid == 0 or group == owner:
        # The daemon's own group (root, or the owner's private one): joining it would hand
        # this user far more than the socket. The sockets want a group of their own.
        return SocketPermissionDenied(
            f"permission denied: gpumemd's socket {path}{where} ({facts}) belongs to {owner}'s own group, which no "
            "user should join for it; start gpumemd with --socket-group gpumem (after 'groupadd --system gpumem'; "
            f"the systemd unit does so), then 'usermod -aG gpumem {user}' and log in again"
        )
    return SocketPermissionDenied(
        f"permission denied: join group {group} to use gpumemd's socket {path}{where} ({facts}); "
        f"after 'usermod -aG {group} {user}', log in again"
    )


def check_access(path: Path) -> None:
    """Raise SocketPermissionDenied if this user may not connect to the socket at ``path``
    (a missing one is left to the caller). ZeroMQ would not say: it retries a refused
    connect quietly until the request times out."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return
    except PermissionError:
        raise permission_denied(path) from None
    if not os.access(path, os.W_OK, effective_ids=True):
        raise permission_denied(path)


class ControlChannel:
    """A DEALER on the daemon's control socket; ``routing_id`` binds it to a session."""

    def __init__(self, endpoints: Endpoints, routing_id: bytes | None = None) -> None:
        self.endpoints = endpoints
        check_access(endpoints.zmq_path)
        self._sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A blocking recv bounded by RCVTIMEO: cheaper than a poller per call.
        self._sock.setsockopt(zmq.RCVTIMEO, _SLICE_MS)
        self._rcvtimeo = _SLICE_MS
        # A send waits only while the daemon leaves a full queue of requests unread.
        self._sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        if routing_id is not None:
            self._sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self._sock.connect(endpoints.zmq_url)
        self._send: Callable[[bytes], Any] = self._sock.send
        self._recv: Callable[[], bytes] = self._sock.recv
        # A session's request ids go on across a daemon restart (take_over): a resent
        # request keeps its id, and no later one reuses it.
        self.ids: Iterator[int] = itertools.count(1)
        # Deferred requests (a KV round's CAPTURE_DONE) by id: their frame, sent again
        # under its id after a daemon restart, and their reply once it came.
        self._deferred: dict[int, tuple[bytes, p.Reply | None]] = {}

    def call(self, message: p.RequestMessage, timeout: float) -> Any:
        """One request: the typed reply body, or the typed error."""
        return self.exchange(message, timeout)[1]

    def exchange(
        self, message: p.RequestMessage, timeout: float, in_flight: Callable[[int], None] | None = None, request_id: int = 0
    ) -> tuple[int, Any]:
        """One request: (its id, the typed reply body), or the typed error.
        ``in_flight(request_id)`` runs once the request is out, while the daemon works on
        it (what it costs hides behind the wait), and again after every slice of the wait
        that passes unanswered; it may raise to end the wait. ``request_id``: the id of a
        request sent again (0: the next one)."""
        request_id = self.send(message, request_id=request_id)
        if in_flight is not None:
            in_flight(request_id)
        return request_id, self.receive(request_id, message, timeout, in_flight)

    def send(self, message: p.RequestMessage, *, deferred: bool = False, request_id: int = 0) -> int:
        """Send a request (``request_id``: one sent again; 0: the next id); returns its id.
        A ``deferred`` one's reply, when it comes while other requests are waited for, is
        kept for ``receive``."""
        request_id = request_id or next(self.ids)
        try:
            frame = p.encode_request(request_id, message)
        except p.ProtocolError as exc:
            raise error_from_protocol(exc, "request refused before sending") from None
        try:
            self._send(frame)
        except zmq.Again:
            raise DaemonTimeout(self._timeout_message(message, _SEND_TIMEOUT_MS / 1000, "take")) from None
        if deferred:
            self._deferred[request_id] = (frame, None)
        return request_id

    def take_over(self, old: ControlChannel) -> None:
        """Go on from ``old`` (a session's DEALER before the daemon restarted): its ids, and
        its deferred requests, those still unanswered sent again under their ids."""
        self.ids, self._deferred = old.ids, old._deferred
        for frame, reply in self._deferred.values():
            if reply is None:
                try:
                    self._send(frame)
                except zmq.Again:
                    raise DaemonTimeout(f"gpumemd for device {self.endpoints.index} took no request for {_SEND_TIMEOUT_MS / 1000:g}s after a restart") from None

    def receive(
        self, request_id: int, message: p.RequestMessage, timeout: float, in_flight: Callable[[int], None] | None = None
    ) -> Any:
        """The typed reply body to request ``request_id`` (``message``), or its error."""
        remaining_ms = max(int(timeout * 1000), 1)
        held = self._deferred.get(request_id) if self._deferred else None  # the common case: none out
        # A deferred request stays listed until its reply is taken: a wait that ends
        # without it leaves it for a later receive (or a resend after a restart).
        reply = self._await(request_id, message, timeout, in_flight, None if held is None else held[1], remaining_ms)
        if held is not None:
            del self._deferred[request_id]
        if not reply.ok:
            raise error_from_reply(reply)
        try:
            return p.decode_body(message.REPLY, reply.body)
        except p.ProtocolError as exc:
            raise error_from_protocol(exc, f"malformed {type(message).__name__} reply from gpumemd") from None

    def _await(
        self, request_id: int, message: p.RequestMessage, timeout: float, in_flight: Callable[[int], None] | None,
        reply: p.Reply | None, remaining_ms: int,
    ) -> p.Reply:
        while reply is None:
            wait = remaining_ms if remaining_ms < _SLICE_MS else _SLICE_MS
            if wait != self._rcvtimeo:
                self._sock.setsockopt(zmq.RCVTIMEO, wait)
                self._rcvtimeo = wait
            try:
                frame = self._recv()
            except zmq.Again:
                remaining_ms -= wait
                if in_flight is not None:
                    in_flight(request_id)
                if remaining_ms <= 0:
                    raise DaemonTimeout(self._timeout_message(message, timeout, "answer")) from None
                continue
            try:
                got = p.decode_reply(frame)
            except p.ProtocolError as exc:
                raise error_from_protocol(exc, "reply from gpumemd refused") from None
            if got.request_id == request_id:
                reply = got
            elif got.request_id in self._deferred:  # a deferred request's answer, while waiting for another
                self._deferred[got.request_id] = (self._deferred[got.request_id][0], got)
            # else: the late answer to an earlier call that timed out
        return reply

    def deferred_ids(self) -> set[int]:
        """Deferred requests whose reply no ``receive`` took yet."""
        return set(self._deferred)

    def unanswered_ids(self) -> set[int]:
        """Deferred requests whose reply has not come."""
        return {rid for rid, (_, reply) in self._deferred.items() if reply is None}

    def take_replies(self) -> None:
        """Keep the replies to deferred requests that came and were not read yet (the
        daemon went away: this socket closes next)."""
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            try:
                got = p.decode_reply(frame)
            except p.ProtocolError:
                continue
            held = self._deferred.get(got.request_id)
            if held is not None and held[1] is None:
                self._deferred[got.request_id] = (held[0], got)

    def _timeout_message(self, message: p.RequestMessage, timeout: float, what: str) -> str:
        index = self.endpoints.index
        return (
            f"gpumemd for device {index} did not {what} {type(message).__name__} within {timeout:g}s "
            f"(control socket {self.endpoints.zmq_path}); check 'systemctl status gpumemd@{index}' or that "
            f"'gpumemd --device {index}' runs with this runtime directory, and raise the timeout if the "
            "daemon is only busy"
        )

    def close(self) -> None:
        self._sock.close(linger=0)
