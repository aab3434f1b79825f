"""A session's sockets to its daemon.

``SessionChannel``: both sockets of a session. The fd channel (AF_UNIX SEQPACKET) says
HELLO (gpumem.handshake), stays open for the session's life (the daemon sees EOF when this process dies),
brings chunk descriptors (FD_BATCH) and notices, and tells us the daemon went away. The
DEALER (gpumem.control.ControlChannel), bound to the session by the token HELLO
returned as its routing id, carries every request. ``call`` returns the typed reply body and the descriptors that came with
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
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from gpumem_shared import __version__, fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumem import handshake
from gpumem.control import ControlChannel
from gpumem.errors import (
    BadMessage,
    DaemonStopped,
    DaemonTimeout,
    DaemonUnavailable,
    GpuMemError,
    PermissionDenied,
    ProtocolMismatch,
    SessionClosed,
    SessionLost,
    ShuttingDown,
)

# After the daemon went away, a resumable session tries to resume after these pauses,
# doubling, until the call's timeout. A restart takes the new daemon a few hundred ms
# (its startup log line says where they go); a try before it listens costs tens of µs
# (a connect refused), and once it listens the try waits in its backlog, answered as soon
# as it serves: the last pause is what a resume can lose past the daemon's bind.
_RESUME_RETRY_FIRST = 0.001
_RESUME_RETRY_MOST = 0.005

# The protocol that knows Hello.tenant_token.
_TENANT_TOKENS = (1, 11)

# Notices nobody took yet; the oldest go first.
_NOTICES_KEPT = 1024

# The watcher looks at the fd channel this often between calls (and whether its session
# closed); a resume it starts tries this long before it lets calls in again.
_WATCH_S = 0.25
_WATCH_RESUME_S = 2.0

# close() waits this long at most for the daemon to drop the session (a hung daemon).
_GOODBYE_S = 1.0


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

    def __init__(self, endpoints: Endpoints, name: str, timeout: float, tenant_token: str = "") -> None:
        self.endpoints = endpoints
        self.name = name
        self.timeout = timeout
        self._lock = threading.RLock()
        self._notices: collections.deque[p.Notice] = collections.deque(maxlen=_NOTICES_KEPT)
        self._stopped: str | None = None
        self._away: str | None = None  # why the daemon is gone, while a resume is due
        self._lost: str | None = None  # why the session cannot come back
        self._closed = False
        # Set, without the lock, by a close() on another thread while a call holds it: the
        # call ends with SessionClosed at its next slice of waiting instead of its deadline.
        self._interrupted = False
        # What RESUME reports this session maps (set by the Session, which knows its arenas).
        self.holdings: Callable[[], list[p.Holding]] = list
        self._sockets = _Sockets()
        # Registered before anything opens, so a half-built channel still cleans up.
        self._finalizer = weakref.finalize(self, self._sockets)
        ok = False
        try:
            hello = p.Hello(name=self.name, client_version=__version__, pid=os.getpid(), tenant_token=tenant_token)
            self.hello = self._say_hello(hello, self.timeout)
            if tenant_token and tuple(self.hello.protocol) < _TENANT_TOKENS:
                # That daemon ignored the token: the session would count against the uid's cap.
                raise ProtocolMismatch(
                    f"gpumemd for device {endpoints.index} speaks protocol {self.hello.protocol[0]}.{self.hello.protocol[1]}, "
                    f"which knows no tenant tokens (since {_TENANT_TOKENS[0]}.{_TENANT_TOKENS[1]}); upgrade gpumemd, or "
                    "connect without one"
                )
            self._control = self._sockets.control = ControlChannel(endpoints, routing_id=self.hello.token)
            ok = True
        finally:
            if not ok:
                self._finalizer()
        if self.hello.credential:
            threading.Thread(target=_watch, args=(weakref.ref(self),), name=f"gpumem-watch-{name}", daemon=True).start()

    # ------------------------------------------------------------------ HELLO

    def _say_hello(self, message: p.Hello | p.Resume, timeout: float) -> p.HelloReply:
        """HELLO or RESUME on a new fd channel (gpumem.handshake). Its socket is in
        ``_sockets`` from its creation on, so a failure leaves it to their cleanup."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sockets.fd_sock = sock
        deadline = handshake.connect(sock, self.endpoints, timeout, session_timeout=self.timeout)
        self._sockets.fd_ready = select.epoll(1, select.EPOLL_CLOEXEC)
        self._sockets.fd_ready.register(sock.fileno(), select.EPOLLIN)
        return handshake.hello(sock, self.endpoints, message, deadline, timeout)

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
            self._check_interrupted()
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
        """While ``request_id`` is out: notices, stale batches, the daemon's going away, a close."""
        self._check_interrupted()
        self._poll_events(keep=request_id)

    def _check_interrupted(self) -> None:
        if self._interrupted:
            raise SessionClosed(f"session '{self.name}' was closed by another thread while this call waited")

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
                # The notice's text says mapped memory stays valid too: the clause is added once, below.
                self._mark_stopped(f"gpumemd for device {self.endpoints.index} is stopping")
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

    def interrupt(self) -> None:
        """End a call another thread has in progress (SessionClosed, within one slice of
        its wait) and return once it has let go of the channel: close() must not wait for
        a call's deadline (a KV round's report waits up to the round's). Calls made
        after this one returns go on as usual (close releases arenas through them)."""
        self._interrupted = True
        try:
            with self._lock:
                pass
        finally:
            self._interrupted = False

    def close(self) -> None:
        """Close both sockets; the daemon releases what this session alone held. Returns
        once the daemon has dropped the session (within _GOODBYE_S): its name is free for
        the next HELLO, from this process or another. A call in progress on another
        thread ends with SessionClosed first."""
        self.interrupt()
        with self._lock:
            self._closed = True
            self._goodbye()
            self._finalizer()

    def _goodbye(self) -> None:
        """Say EOF on the fd channel and wait for the daemon's: it closes its end once it
        has dropped the session. A shutdown, not only a close: the watcher thread's select
        keeps the socket open in the kernel until it returns, and the daemon would see EOF
        only then."""
        sock, ready = self._sockets.fd_sock, self._sockets.fd_ready
        if sock is None or ready is None:
            return
        deadline = time.monotonic() + min(self.timeout, _GOODBYE_S)
        try:
            sock.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0 and ready.poll(left):
                payload, fds = fdchannel.recv(sock)  # notices and batches nobody takes any more
                fdchannel.close_all(fds)
                if not payload and not fds:
                    return
        except (OSError, ValueError, p.ProtocolError):
            pass  # gone already, or its last words were garbled: closing is all that is left
