"""The sockets a client speaks to one daemon over.

``ControlChannel``: a ZeroMQ DEALER speaking request/reply to the daemon's ROUTER.
gpumemctl uses one anonymously, for the requests that need no session (PING, STATUS).

``SessionChannel``: both sockets of a session. The fd channel (AF_UNIX SEQPACKET) says
HELLO, stays open for the session's life (the daemon sees EOF when this process dies),
brings chunk descriptors (FD_BATCH) and notices, and tells us the daemon went away. The
DEALER, bound to the session by the token HELLO returned as its routing id, carries
every request. ``call`` returns the typed reply body and the descriptors that came with
it (chunks, a graph pool's lease segment), so arenas and pools never touch the sockets.

One lock per session: a request's FD_BATCH messages and its reply pair up because no
other request of this session is in flight. Every wait is bounded.

A session the daemon keeps across a restart (HELLO gave it a resume credential) has a
watcher thread: it notices the daemon going away and resumes the session once a new one
runs, between calls, so an engine that only takes leases through the shared table (no
call at all) still comes back before the new daemon's grace period ends.
"""

from __future__ import annotations

import collections
import grp
import itertools
import os
import pwd
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from gpumem_shared import __version__, fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumem.errors import (
    BadMessage,
    DaemonStopped,
    DaemonTimeout,
    DaemonUnavailable,
    GpuMemError,
    PermissionDenied,
    SessionClosed,
    SessionLost,
    ShuttingDown,
    SocketPermissionDenied,
    error_from_protocol,
    error_from_reply,
)

# While waiting for a reply, wake this often to let the caller check whether the
# daemon is still there (its fd channel) instead of sleeping out the whole timeout.
_SLICE_MS = 250

# How long a request may wait to be queued: only a daemon that stopped reading while
# a thousand requests piled up (ZeroMQ's high-water mark) makes a send wait at all.
_SEND_TIMEOUT_MS = 5000

# After the daemon went away, a resumable session tries to resume after these pauses,
# doubling, until the call's timeout: a restart takes the new daemon some 100 ms.
_RESUME_RETRY_FIRST = 0.005
_RESUME_RETRY_MOST = 0.05

# Notices nobody took yet; the oldest go first.
_NOTICES_KEPT = 1024

# The watcher looks at the fd channel this often between calls (and whether its session
# closed); a resume it starts tries this long before it lets calls in again.
_WATCH_S = 0.25
_WATCH_RESUME_S = 2.0

# connect() on the fd channel fails at once (EAGAIN) while the daemon's listen backlog is
# full: it is not accepting (stopped, busy, at its connection limit) or is flooded. Try
# again after these pauses, doubling, until the timeout.
_CONNECT_RETRY_FIRST = 0.005
_CONNECT_RETRY_MOST = 0.2


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


class _DaemonAway(Exception):
    """The daemon's fd channel closed, or it said it is stopping: a session with a resume
    credential resumes (with the new daemon) before the call goes on."""


def _watch(ref: weakref.ref[SessionChannel]) -> None:
    """The watcher thread's loop; it holds its channel only while it looks."""
    while True:
        channel = ref()
        if channel is None or not channel.watch_once():
            return
        del channel


class _Sockets:
    """What must be closed even if the channel is dropped without close()."""

    def __init__(self) -> None:
        self.fd_sock: socket.socket | None = None
        # Whether the fd channel has something to read, without building fd sets per
        # call: every request asks it first.
        self.fd_ready: select.epoll | None = None
        self.control: ControlChannel | None = None
        self.early: list[tuple[p.FdBatch, list[int]]] = []  # fd batches that came before their reply

    def __call__(self, keep: Callable[[int], bool] | None = None) -> None:
        """Close everything; ``keep(request_id)``: the fd batches to keep (a reset for a
        resume keeps those of replies that came before the daemon went away)."""
        kept = []
        for batch, fds in self.early:
            if keep is not None and keep(batch.request_id):
                kept.append((batch, fds))
            else:
                fdchannel.close_all(fds)
        self.early = kept
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.fd_ready is not None:
            self.fd_ready.close()
            self.fd_ready = None
        if self.fd_sock is not None:
            self.fd_sock.close()
            self.fd_sock = None


class SessionChannel:
    """Both sockets of one session (see the module doc). Opening it says HELLO:
    ``hello`` is the daemon's answer."""

    def __init__(self, endpoints: Endpoints, name: str, timeout: float) -> None:
        self.endpoints = endpoints
        self.name = name
        self.timeout = timeout
        self._lock = threading.RLock()
        self._notices: collections.deque[p.Notice] = collections.deque(maxlen=_NOTICES_KEPT)
        self._stopped: str | None = None
        self._away: str | None = None  # why the daemon is gone, while a resume is due
        self._lost: str | None = None  # why the session cannot come back
        self._closed = False
        # What RESUME reports this session maps (set by the Session, which knows its arenas).
        self.holdings: Callable[[], list[p.Holding]] = list
        self._sockets = _Sockets()
        # Registered before anything opens, so a half-built channel still cleans up.
        self._finalizer = weakref.finalize(self, self._sockets)
        ok = False
        try:
            self.hello = self._say_hello(p.Hello(name=self.name, client_version=__version__), self.timeout)
            self._control = self._sockets.control = ControlChannel(endpoints, routing_id=self.hello.token)
            ok = True
        finally:
            if not ok:
                self._finalizer()
        if self.hello.credential:
            threading.Thread(target=_watch, args=(weakref.ref(self),), name=f"gpumem-watch-{name}", daemon=True).start()

    # ------------------------------------------------------------------ HELLO

    def _say_hello(self, message: p.Hello | p.Resume, timeout: float) -> p.HelloReply:
        ep = self.endpoints
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sockets.fd_sock = sock
        deadline = time.monotonic() + timeout
        sock.settimeout(timeout)
        try:
            self._connect(sock, deadline)
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonUnavailable(
                f"no gpumemd serves device {ep.index}: nothing listens at {ep.fd_path}; start it with "
                f"'systemctl start gpumemd@{ep.index}' (or 'gpumemd --device {ep.index}'), or point "
                "runtime_dir / $GPUMEMD_RUNTIME_DIR at the daemon's directory"
            ) from None
        except PermissionError:
            raise permission_denied(ep.fd_path) from None
        self._sockets.fd_ready = select.epoll(1, select.EPOLL_CLOEXEC)
        self._sockets.fd_ready.register(sock.fileno(), select.EPOLLIN)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            fdchannel.send(sock, p.encode_request(1, message))
            # Nothing rides with HELLO since 1.3: an older daemon's lease table is received
            # only to be closed (the version check below refuses that daemon).
            payload, fds = fdchannel.recv(sock, max_fds=1)
        except TimeoutError:
            raise DaemonTimeout(
                f"gpumemd for device {ep.index} accepted but did not answer HELLO within {timeout:g}s ({ep.fd_path})"
            ) from None
        except p.ProtocolError as exc:
            raise BadMessage(exc.message) from None
        except (ConnectionResetError, BrokenPipeError):
            payload, fds = b"", []
        try:
            if not payload:  # a resume tries again: the daemon may be restarting once more
                raise DaemonUnavailable(
                    f"gpumemd for device {ep.index} closed the connection during {type(message).__name__.upper()} "
                    f"(it stopped or restarted); check 'systemctl status gpumemd@{ep.index}'"
                )
            try:
                reply = p.decode_reply(payload)
                if not reply.ok:
                    raise error_from_reply(reply)
                p.check_hello_version(reply.version)
                return p.decode_body(p.HelloReply, reply.body)
            except p.ProtocolError as exc:
                raise error_from_protocol(exc, f"gpumemd for device {ep.index}: HELLO reply refused") from None
        finally:
            fdchannel.close_all(fds)

    def _connect(self, sock: socket.socket, deadline: float) -> None:
        """connect(), tried again with backoff while the listen backlog is full."""
        pause = _CONNECT_RETRY_FIRST
        while True:
            try:
                sock.connect(str(self.endpoints.fd_path))
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonTimeout(self._backlog_full_message()) from None
                time.sleep(min(pause, left))
                pause = min(2 * pause, _CONNECT_RETRY_MOST)

    def _backlog_full_message(self) -> str:
        ep = self.endpoints
        return (
            f"gpumemd for device {ep.index} took no new connection within {self.timeout:g}s: the listen backlog of "
            f"{ep.fd_path} stayed full. The daemon is stopped or hung (check 'systemctl status gpumemd@{ep.index}'), "
            "serves as many clients as its open-file limit allows (its log says; raise LimitNOFILE), or something "
            "floods it with connections (its log names the pids)"
        )

    # ------------------------------------------------------------------ calls

    def call(
        self, message: p.RequestMessage, timeout: float | None = None, meanwhile: Callable[[], None] | None = None
    ) -> tuple[Any, dict[int, int]]:
        """One request: (typed reply body, {chunk id: fd} for the chunks it hands out).
        The caller owns the descriptors. ``timeout`` defaults to the session's. A daemon
        that restarts meanwhile (with this session kept) is waited for within the
        timeout: the session resumes and the request goes again under its id.
        ``meanwhile`` runs once, as soon as the request is out: work of the caller's that
        hides behind the daemon's (an exception from it ends the call)."""
        in_flight = self._keep_batches
        if meanwhile is not None:
            pending = [meanwhile]

            def in_flight(request_id: int) -> None:
                if pending:
                    pending.pop()()
                self._keep_batches(request_id)

        with self._lock:
            self._check_open()
            limit = self.timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            left = limit
            request_id = 0
            while True:
                if self._away is not None:
                    self._resume(deadline, limit, resending=request_id)
                    left = max(deadline - time.monotonic(), 0.001)
                try:
                    request_id = request_id or next(self._control.ids)
                    # The fd channel is read while the request is out: a daemon that stopped
                    # or died never serves it (it handles no request once it has said
                    # "stopping"), and looking costs nothing while the reply is on its way.
                    _, body = self._control.exchange(message, left, in_flight, request_id)
                    batches = getattr(body, "fd_batches", 0)
                    if not batches:
                        return body, {}
                    return body, self._receive_fds(request_id, batches, max(deadline - time.monotonic(), 0.001))
                except _DaemonAway:
                    left = max(deadline - time.monotonic(), 0.001)
                    continue  # resume, then send it again under its id

    def _resume(self, deadline: float, limit: float, resending: int = 0) -> None:
        """The daemon went away: reconnect with backoff until ``deadline`` and resume the
        session with its credential; a new DEALER under the same token then carries
        requests. What the old daemon sent before it died is taken first: replies to
        deferred requests, with their descriptors, need not come again. The resume names
        what goes again (``resending``, a call without its reply, and the deferred
        requests without theirs): the new daemon answers those the old one had answered
        from its record."""
        reason = self._away
        self._take_what_came()
        keep = (self._control.deferred_ids() - self._control.unanswered_ids()).__contains__
        self._sockets(keep)  # the old sockets, and fd batches of replies that never came
        pause = _RESUME_RETRY_FIRST
        ep = self.endpoints
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonTimeout(
                    f"gpumemd for device {ep.index} went away ({reason}) and no daemon took session {self.hello.session_id} "
                    f"back within {limit:g}s; check 'systemctl status gpumemd@{ep.index}' (or that 'gpumemd --device "
                    f"{ep.index}' runs again under its fd store). The session resumes at a later call if the daemon is back "
                    "within its grace period"
                )
            pending = sorted(self._control.unanswered_ids() | ({resending} if resending else set()))
            resume = p.Resume(
                session_id=self.hello.session_id, credential=self.hello.credential, holdings=self.holdings(),
                client_version=__version__, pending=pending,
            )
            try:
                hello = self._say_hello(resume, left)
                break
            except (DaemonUnavailable, ShuttingDown):
                self._sockets(keep)
                time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
                pause = min(2 * pause, _RESUME_RETRY_MOST)
            except (SessionLost, PermissionDenied) as exc:
                self._sockets()
                self._lost = f"{exc}; memory this process mapped stays valid, new requests need a new session"
                raise
        self.hello = hello
        self._away = None
        control = ControlChannel(ep, routing_id=hello.token)
        control.take_over(self._control)
        self._control = self._sockets.control = control

    def watch_once(self) -> bool:
        """One look of the watcher (see the module doc): take what the fd channel holds,
        and resume when the daemon went away. False once there is nothing left to watch."""
        sock = self._sockets.fd_sock
        if self._away is not None:
            time.sleep(_RESUME_RETRY_MOST)
        elif sock is None:
            time.sleep(_WATCH_S)
            return not self._closed
        else:
            try:
                readable = select.select([sock], [], [], _WATCH_S)[0]
            except (OSError, ValueError):  # closed meanwhile by a call's resume
                readable = []
            if not readable:
                return not self._closed
        with self._lock:  # a call in progress watches for itself: this waits for it
            if self._closed or self._stopped is not None or self._lost is not None:
                return False
            try:
                if self._away is None:
                    self._poll_events()
                if self._away is not None:
                    self._resume(time.monotonic() + _WATCH_RESUME_S, _WATCH_RESUME_S)
            except (_DaemonAway, DaemonTimeout):
                pass  # again at the next look
            except GpuMemError:
                return False  # lost, stopped, refused: the next call raises it
        return True

    def _take_what_came(self) -> None:
        """Before the sockets of a daemon that went away close: the fd batches and the
        replies it sent before it died."""
        away, self._away = self._away, None  # read on past notices, up to the end
        try:
            self._poll_events()
        except (_DaemonAway, BadMessage):
            pass
        finally:
            self._away = away
        self._control.take_replies()

    def start(self, message: p.RequestMessage) -> int:
        """Send a request whose reply the daemon defers (a KV round's CAPTURE_DONE) and
        return its id at once: other calls go on meanwhile, and ``finish`` waits for it."""
        with self._lock:
            self._check_open()
            if self._away is not None:
                self._resume(time.monotonic() + self.timeout, self.timeout)
            return self._control.send(message, deferred=True)

    def finish(self, request_id: int, message: p.RequestMessage, timeout: float) -> tuple[Any, dict[int, int]]:
        """The reply to a request ``start`` sent, as ``call`` returns it; a daemon that
        restarts meanwhile is waited for as ``call`` does."""
        with self._lock:
            self._check_open()
            deadline = time.monotonic() + timeout
            while True:
                if self._away is not None:
                    # Still deferred: sent again by the resume if its reply has not come
                    # (kept, with its descriptors, if it has); not: answered, and its
                    # descriptors lost on the way.
                    lost = request_id not in self._control.deferred_ids()
                    self._resume(deadline, timeout, resending=request_id if lost else 0)
                    if lost:
                        self._control.send(message, deferred=True, request_id=request_id)
                try:
                    left = max(deadline - time.monotonic(), 0.001)
                    body = self._control.receive(request_id, message, left, self._keep_batches)
                    batches = getattr(body, "fd_batches", 0)
                    return body, (self._receive_fds(request_id, batches, left) if batches else {})
                except _DaemonAway:
                    continue

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosed(f"session '{self.name}' is closed")
        if self._stopped is not None:
            raise DaemonStopped(self._stopped)
        if self._lost is not None:
            raise SessionLost(self._lost)

    def _kept(self, request_id: int, keep: int) -> bool:
        """Whether descriptors for ``request_id`` belong to a request still waited for."""
        return request_id == keep or request_id in self._control.deferred_ids()

    def _poll_events(self, keep: int = 0) -> None:
        """Take pending fd-channel messages without blocking; raise if the daemon has gone.
        Notices are queued; fd batches for request ``keep`` (in flight: the daemon sends
        them just before the reply) are kept for it, others belong to calls that timed
        out and are closed."""
        sock, ready = self._sockets.fd_sock, self._sockets.fd_ready
        while sock is not None and ready is not None and self._stopped is None and self._away is None and ready.poll(0):
            batch, fds = self._read_event(sock)
            if batch is not None and self._kept(batch.request_id, keep):
                self._sockets.early.append((batch, fds))
            else:
                fdchannel.close_all(fds)
        if self._stopped is not None:
            raise DaemonStopped(self._stopped)
        if self._away is not None:
            raise _DaemonAway(self._away)

    def _keep_batches(self, request_id: int) -> None:
        """While ``request_id`` is out: notices, stale batches, the daemon's going away."""
        self._poll_events(keep=request_id)

    def _read_event(self, sock: socket.socket) -> tuple[p.FdBatch | None, list[int]]:
        """Read one fd-channel message: notices are queued here; an FdBatch is returned
        with its descriptors, which the caller keeps or closes."""
        try:
            payload, fds = fdchannel.recv(sock)
        except p.ProtocolError as exc:
            raise BadMessage(f"fd channel: {exc.message}") from None
        except TimeoutError:
            raise
        except OSError as exc:
            self._mark_stopped(f"the fd channel to gpumemd failed ({exc})")
            return None, []
        if not payload and not fds:
            self._mark_stopped(f"gpumemd for device {self.endpoints.index} went away")
            return None, []
        try:
            event = p.decode_event(payload)
        except p.ProtocolError as exc:
            fdchannel.close_all(fds)
            raise BadMessage(f"fd channel: {exc.message}") from None
        if isinstance(event, p.Notice):
            fdchannel.close_all(fds)
            self._notices.append(event)
            if event.kind == p.NoticeKind.STOPPING:
                self._mark_stopped(event.message)
            return None, []
        if len(fds) != len(event.chunk_ids):
            fdchannel.close_all(fds)
            raise BadMessage(f"fd batch carries {len(fds)} descriptors for {len(event.chunk_ids)} chunks")
        return event, fds

    def _mark_stopped(self, reason: str) -> None:
        if self.hello.credential:  # the daemon keeps this session across a restart
            self._away = reason
        elif self._stopped is None:
            self._stopped = f"{reason}; memory this process mapped stays valid, new requests need a new session"

    def _receive_fds(self, request_id: int, batches: int, timeout: float) -> dict[int, int]:
        sock = self._sockets.fd_sock
        assert sock is not None
        received: dict[int, int] = {}
        early, self._sockets.early = self._sockets.early, []
        for kept, fds in early:
            # A request answered twice across a resume (its answer, sent as the new sockets
            # came up, then the record's to the resend) has its batches twice: the first
            # serve, the rest are closed.
            if kept.request_id == request_id and batches > 0:
                received.update(zip(kept.chunk_ids, fds))
                batches -= 1
            elif self._kept(kept.request_id, 0):
                self._sockets.early.append((kept, fds))
            else:
                fdchannel.close_all(fds)
        sock.settimeout(timeout)
        try:
            while batches:
                try:
                    batch, fds = self._read_event(sock)
                except TimeoutError:
                    raise DaemonTimeout(
                        f"gpumemd for device {self.endpoints.index} replied but sent no descriptors within {timeout:g}s"
                    ) from None
                if self._stopped is not None:
                    raise DaemonStopped(self._stopped)
                if self._away is not None:
                    raise _DaemonAway(self._away)
                if batch is not None and batch.request_id == request_id:
                    received.update(zip(batch.chunk_ids, fds))
                    batches -= 1
                elif batch is not None and self._kept(batch.request_id, 0):
                    self._sockets.early.append((batch, fds))
                else:
                    fdchannel.close_all(fds)
        except BaseException:
            fdchannel.close_all(list(received.values()))
            raise
        return received

    # ------------------------------------------------------------------ notices

    def notices(self, kind: str | None = None, arena: str | None = None) -> list[p.Notice]:
        """Take the notices received so far, optionally only those of one kind and arena."""
        with self._lock:
            if self._sockets.fd_sock is not None:
                try:
                    self._poll_events()
                except (DaemonStopped, _DaemonAway):
                    pass
            wanted = [n for n in self._notices if (kind is None or n.kind == kind) and (arena is None or n.arena == arena)]
            for notice in wanted:
                self._notices.remove(notice)
            return wanted

    # ------------------------------------------------------------------ lifecycle

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close both sockets; the daemon releases what this session alone held."""
        with self._lock:
            self._closed = True
            self._finalizer()
