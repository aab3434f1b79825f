"""Sockets around the daemon state: one thread, one poll loop.

The loop polls the ZeroMQ ROUTER (control requests), the fd-channel listener, every
fd-channel connection and a wake-up pipe fed by signals; it decodes each message,
hands it to the outbox (outbox.py), and sends the mail it gets back: what the state
answered, with the durable record already written. ``tick`` drops peers that connected
but never said HELLO and feeds the systemd watchdog, so a wedged loop is noticed by
systemd rather than hidden by a free-running timer thread.

Liveness comes from the fd channel alone: ZeroMQ hides disconnects, but the kernel
closes a dead client's SEQPACKET connection, and the loop sees EOF at once.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import zmq

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumemd import runtime
from gpumemd.notify import SystemdNotifier
from gpumemd.records import SessionRecord
from gpumemd.admission import ACCEPT_BATCH, ANONYMOUS, ANONYMOUS_UID, Admission, Connection, FairQueue
from gpumemd.control_channel import ControlChannel
from gpumemd.logs import log_request
from gpumemd.outbox import Batch, Letter, Mail, Outbox
from gpumemd.runtime import FD_HEADROOM_MIN, FdBudget, StartupError
from gpumemd.state import DaemonState

log = logging.getLogger("gpumemd.server")

# One control request served per poll wake-up, so the fd channel (deaths, HELLOs) gets in
# between any two. What the ROUTER holds is read ahead into a queue per peer
# (admission.FairQueue) and served in turn: ZeroMQ is fair per connection only, and
# connections cost a flooder nothing. At most this many are read per wake-up.
CONTROL_READ_AHEAD = 256

# pyzmq's flags are IntFlag members, built anew by every | or test: plain ints here.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


# libzmq buffers a message whole before the daemon sees it: unbounded, a peer's gigabyte
# frame costs the daemon a gigabyte. A bigger one closes its connection unread; up to this
# size it is refused with BAD_MESSAGE like any frame over MAX_FRAME_BYTES.
MAX_CONTROL_MESSAGE = 2 * p.MAX_FRAME_BYTES
# While an adoption waits for a dead holder's fence (nothing announces it: /proc and, on
# CUDA, NVML are read), the loop looks again this often: a failover waits at most this
# long past the moment the group became adoptable (the client polled at this pace before).
_FENCE_POLL_MS = 10
# Replies waiting in ZeroMQ for one connection's peer to read them (its send high-water
# mark; the kernel's socket buffer holds more before them). A client's DEALER reads its
# replies on its own I/O thread whatever the application does, so only a peer that does
# not read gets here; past it, the daemon would hold every reply it asks for (a STATUS
# reply is tens of KiB: 30 such peers grew the daemon ~28 MiB/s), so the peer is dropped
# instead (ROUTER_MANDATORY makes the send say the queue is full).
REPLY_QUEUE = 32
# How long a reply waits for room behind a peer whose socket takes more (ZeroMQ's I/O
# thread behind the daemon's, not the peer), in ms.
REPLY_WAIT = 200


class Server:
    def __init__(
        self,
        state: DaemonState,
        endpoints: Endpoints,
        *,
        socket_group: str | None = None,
        hello_timeout: float = 5.0,
        notifier: SystemdNotifier | None = None,
        tick_interval: float = 0.2,
        on_tick: Callable[[], None] | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        self.state = state
        self.outbox = outbox or Outbox(state, None)  # None: no fd store, nothing kept for a restart
        self.endpoints = endpoints
        self.socket_group = socket_group
        self.hello_timeout = hello_timeout
        self.notifier = notifier or SystemdNotifier({})
        self.tick_interval = tick_interval
        self._on_tick = on_tick  # after each tick's work, on this thread (the metrics snapshot)
        self._stop_requested = False
        self._reload_requested = False  # SIGHUP: read the tenant caps again
        self._door = Admission(FdBudget.of(FD_HEADROOM_MIN * 4), hello_timeout)  # the real budget from bind()
        self._connections = self._door.connections  # by socket fd
        self._by_session: dict[int, Connection] = {}
        self._poller = zmq.Poller()
        # Its connections, counted and hung up (control_channel.py, control_door.py).
        self._control = ControlChannel(endpoints, self._door.budget, hello_timeout, self._poller, self._by_session, self._connections)
        self._by_token: dict[bytes, SessionRecord] = {}
        self._waiting = FairQueue(state.config.tenants.requests)  # control requests read, not yet served
        self._lock_fds: list[int] = []
        self._ctx: zmq.Context[Any] | None = None
        self._router: zmq.Socket[Any] | None = None
        self._listener: socket.socket | None = None
        self._wake_r = self._wake_w = -1
        self._last_watchdog = 0.0
        self._next_tick = 0.0
        # Chosen once, when the loop starts: at info the control path pays nothing for
        # the debug line it does not write.
        self._serve_request = self._serve

    # ------------------------------------------------------------------ startup

    def bind(self) -> None:
        """Take the device's lock, clear stale sockets, bind both channels."""
        ep = self.endpoints
        try:
            ep.runtime_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create runtime directory {ep.runtime_dir}: {exc.strerror}") from None
        gid = runtime.group_id(self.socket_group)
        # The host backend's device is the daemon's own memory: nothing another daemon shares.
        device_uuid = self.state.device.uuid if self.state.driver.kind == "cuda" else None
        self._lock_fds = runtime.take_lock(ep, device_uuid)
        budget = self._door.budget = self._control.door.budget = FdBudget.of(runtime.raise_fd_limit())
        log.info(
            "fd channel: up to %d connections, %d of them before HELLO; control channel: up to %d connections",
            budget.connections, budget.pending, budget.control,
        )
        runtime.remove_stale_sockets(ep)
        old_umask = os.umask(0o117)  # sockets are born 0660; no window at a wider mode
        try:
            self._ctx = zmq.Context()
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
            self._router.setsockopt(zmq.SNDHWM, REPLY_QUEUE)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.SNDTIMEO, REPLY_WAIT)  # only a send without NOBLOCK waits
            # A session resumed after a restart comes back on a new DEALER with its old
            # routing id: the newest connection under an id is the one that answers.
            self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._control.open(self._ctx, self._router)  # on a listener the daemon owns
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._listener.bind(str(ep.fd_path))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except (OSError, zmq.ZMQError) as exc:
            self._close_sockets()
            raise StartupError(f"cannot bind gpumemd sockets in {ep.runtime_dir}: {exc}") from None
        finally:
            os.umask(old_umask)
        runtime.set_socket_modes(ep, gid)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Handlers go in before the daemon announces itself: a SIGTERM from then on
        # means a clean stop, even before the loop runs.
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        runtime.write_info(ep, self.state.device.uuid, self.state.driver.kind)

    # ------------------------------------------------------------------ loop

    def request_stop(self, *_: Any) -> None:
        # Runs in a signal handler: set a flag only; the wake-up fd breaks the poll.
        self._stop_requested = True

    def request_reload(self, *_: Any) -> None:
        self._reload_requested = True  # as request_stop: the loop does the work

    def serve_forever(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serve until stopped; ``on_ready`` runs once READY=1 is sent."""
        assert self._router is not None and self._listener is not None
        poller = self._poller
        poller.register(self._router, _POLLIN)
        poller.register(self._control.monitor_fd, _POLLIN)
        poller.register(self._wake_r, _POLLIN)
        self._update_listener(time.monotonic())
        if log.isEnabledFor(logging.DEBUG):
            self._serve_request = self._serve_traced
        self.notifier.send("READY=1", f"STATUS=serving device {self.endpoints.index} ({self.state.driver.kind})")
        if on_ready is not None:
            on_ready()
        log.info(
            "serving device %d (%s, %s) at %s", self.endpoints.index, self.state.device.name, self.state.device.uuid, self.endpoints.runtime_dir
        )
        # An idle loop ticks once per poll timeout; wake often enough to feed a short watchdog.
        wait_ms = self.tick_interval * 1000
        if self.notifier.watchdog_interval is not None:
            wait_ms = min(wait_ms, self.notifier.watchdog_interval * 500)
        wait_ms = max(int(wait_ms), 1)  # the poller would convert a float on every call
        router, listener, wake = self._router, self._listener.fileno(), self._wake_r
        control = self._control
        monitor = control.monitor_fd
        control_listener = control.listener.fileno() if control.listener is not None else -1
        connections = self._connections
        waiting = self._waiting
        queued = waiting.turns
        retained = self.state.retained
        try:
            while not self._stop_requested:
                fencing = bool(retained.adopts) and retained.fencing()  # one lookup when none waits
                for ready, _ in poller.poll(0 if queued else _FENCE_POLL_MS if fencing else wait_ms):
                    if ready is router:
                        self._on_control()
                    elif ready == listener:
                        self._on_accept()
                    elif ready == wake:
                        self._drain_wake()
                    elif ready == monitor:
                        control.on_monitor()
                    elif ready == control_listener:
                        control.turn_away()  # the door is shut
                    else:
                        conn = connections.get(ready)
                        if conn is not None:  # not dropped by what ran before it in this round
                            self._on_fd_channel(conn)
                if queued:
                    identity, frame = waiting.pop()
                    self._serve_request(identity, frame)
                if fencing:
                    self._post(self.outbox.poll_waits())
                self._tick()
        finally:
            self._shutdown()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _tick(self) -> None:
        if self._reload_requested:  # every turn, not on the tick: a lowered cap applies at once
            self._reload_requested = False
            self.state.arenas.caps.reload()
        now = time.monotonic()
        if now >= self._next_tick:  # the HELLO-deadline scan, not on every request
            self._next_tick = now + self.tick_interval
            if self.state.arenas.caps.claims_changed():  # a DRA claim prepared or unprepared
                self.state.arenas.caps.reload()
            for conn in self._door.silent(now):
                self._drop(conn)
            self._door.log_flood(now)
            self._control.tick(now)
            self._update_listener(now)
            self._post(self.outbox.tick())  # round deadlines, lease repairs, the grace period
            if self._on_tick is not None:
                try:
                    self._on_tick()
                except Exception:  # the metrics must never take the memory daemon down
                    log.exception("the tick hook failed; it is off from now on (the metrics stop moving), the daemon goes on")
                    self._on_tick = None
        interval = self.notifier.watchdog_interval
        if interval is not None and now - self._last_watchdog >= interval:
            self.notifier.send("WATCHDOG=1")
            self._last_watchdog = now

    # ------------------------------------------------------------------ control channel

    def _on_control(self) -> None:
        """Serve the request the ROUTER holds, and read what else it holds into its peers'
        queues, which the loop serves in turn. With none waiting, the first is answered
        before more is read: a quiet daemon pays no copy."""
        router = self._router
        assert router is not None
        try:
            identity = router.recv(_NOBLOCK)
        except zmq.Again:
            return  # the poll's readiness went stale; it reports it again
        # The request frame without a copy; its ``more`` says whether frames follow,
        # without asking the socket.
        frame = router.recv(_NOBLOCK, copy=False)
        if frame.more or self._waiting.turns:
            self._read_ahead(identity, frame)
        else:  # no peer waits, so none is passed over
            self._serve_request(identity, frame.buffer)
            self._control.spoke(frame, identity, identity in self._by_token)  # after the reply: the door's books are not on its path
        for _ in range(CONTROL_READ_AHEAD - 1):
            # Asked, not found out by a recv that fails: pyzmq builds an exception for
            # that (about 9 µs on the 2-core VM, asking about 3.5).
            if not cast(int, router.getsockopt(_EVENTS)) & _POLLIN:
                return
            try:
                identity = router.recv(_NOBLOCK)
            except zmq.Again:
                return
            self._read_ahead(identity, router.recv(_NOBLOCK, copy=False))

    def _read_ahead(self, identity: bytes, frame: zmq.Frame) -> None:
        """Queue a request for its peer's turn (or refuse it at once)."""
        assert self._router is not None
        router = self._router
        self._control.spoke(frame, identity, identity in self._by_token)
        if frame.more:
            parts = 2
            while frame.more:  # a multipart message arrives whole: the rest is there
                frame = router.recv(_NOBLOCK, copy=False)
                parts += 1
            log.warning("control message with %d frames dropped (expected identity + one frame)", parts)
            err = p.ProtocolError(p.ErrorCode.BAD_MESSAGE, "a request is exactly one frame")
            self._send(identity, p.encode_error(0, err))
            return
        data = frame.bytes
        session = self._by_token.get(identity)
        if session is None:
            refusal = self._waiting.push(ANONYMOUS, ANONYMOUS_UID, identity, data)
        else:
            refusal = self._waiting.push(session.id, session.uid, identity, data)
        if refusal is not None:
            self._send(identity, p.encode_error(p.request_id_of(data), refusal))

    def _serve(self, identity: bytes, frame: bytes | memoryview) -> None:
        self._answer(identity, self.outbox.request(identity, self._by_token.get(identity), frame))

    def _answer(self, identity: bytes, out: Mail | bytes) -> None:
        """Send what the outbox made of a request: its reply alone (most requests), or mail."""
        if isinstance(out, bytes):
            self._send(identity, out)
        else:
            self._post(out)

    def _send(self, to: bytes, frame: bytes) -> None:
        """A reply to routing id ``to``. Past REPLY_QUEUE replies waiting for its peer to
        read them, the peer is a slow reader (see REPLY_QUEUE): the reply is dropped, and
        the peer with it. No connection under ``to`` (gone, or not connected yet): the
        reply is dropped, as ZeroMQ drops it without ROUTER_MANDATORY."""
        router = self._router
        if router is None:
            return
        try:
            router.send(to, _SNDMORE_NOBLOCK)
        except zmq.Again:
            if not self._wait_for_room(router, to):
                return
        except zmq.ZMQError:  # EHOSTUNREACH
            return
        router.send(frame, _NOBLOCK)

    def _wait_for_room(self, router: zmq.Socket[Any], to: bytes) -> bool:
        """``to``'s queue is full: behind a peer that does not read (its socket takes no
        more either), dropped at once; or behind ZeroMQ's I/O thread, not run yet since a
        burst of replies (a pipelining client's), which makes room within REPLY_WAIT.
        Whether the reply's routing frame went (its body goes next)."""
        if not self._control.unread(to):
            try:
                router.send(to, _SNDMORE)  # waits up to REPLY_WAIT (SNDTIMEO)
                return True
            except zmq.Again:
                pass
            except zmq.ZMQError:  # gone meanwhile
                return False
        self._slow_reader(to)
        return False

    def _slow_reader(self, to: bytes) -> None:
        """Its connection hung up (ZeroMQ frees what waits for it), and a session's
        closed: every request it sends adds a reply the daemon would hold for good."""
        self._control.hang_up(to, f"did not read its replies ({REPLY_QUEUE} waiting)")
        session = self._by_token.get(to)
        conn = None if session is None else self._by_session.get(session.id)
        if session is None or conn is None:
            return
        log.warning(
            "dropped client %r (session %d, pid %d, uid %d): it does not read its replies; %d of them waited, the most a "
            "connection may leave unread (the daemon would hold every reply it asks for without end)",
            session.name, session.id, session.pid, session.uid, REPLY_QUEUE,
        )
        self._drop(conn)

    def _serve_traced(self, identity: bytes, frame: bytes | memoryview) -> None:
        """``_serve``, and a debug line for the request (logs.log_request)."""
        started = time.perf_counter_ns()
        out = self.outbox.request(identity, self._by_token.get(identity), frame)
        micros = (time.perf_counter_ns() - started) / 1e3
        session = self._by_token.get(identity)
        client = f"client {session.name!r} (session {session.id})" if session is not None else "an anonymous peer"
        reply = out if isinstance(out, bytes) else out.reply_to(identity)
        log_request(log, frame, reply, client, session.name if session else "", micros)
        self._answer(identity, out)

    def _post(self, mail: Mail) -> None:
        """Send what the outbox put together (the record holds it already)."""
        if mail.notices:
            self._deliver(mail.notices)
        for letter in mail.letters:
            self._send(letter.to, self._hand_over(letter) if letter.batches else letter.frame)
        for session_id in mail.closing:
            conn = self._by_session.get(session_id)
            if conn is not None:
                self._drop(conn)

    def _hand_over(self, letter: Letter) -> bytes:
        """The letter's fd batches, on its session's fd channel; the reply to send after
        them (an error if they could not go)."""
        try:
            conn = self._by_session.get(letter.session_id)
            for batch in letter.batches:
                if conn is None or conn.session is None:
                    raise p.ProtocolError(p.ErrorCode.INTERNAL, "the session's fd channel closed before its descriptors went")
                self._send_fds(conn, conn.session, batch)
        except p.ProtocolError as exc:
            return p.encode_error(letter.batches[0].request_id, exc)
        finally:
            for batch in letter.batches:
                if batch.owned:
                    fdchannel.close_all(batch.fds)  # the peer holds its own copies now
        return letter.frame

    def _send_fds(self, conn: Connection, session: SessionRecord, batch: Batch) -> None:
        try:
            payload = p.encode_event(p.FdBatch(request_id=batch.request_id, chunk_ids=batch.ids))
            socket.send_fds(conn.sock, [payload], batch.fds, socket.MSG_DONTWAIT)
        except OSError as exc:
            # A client that does not read its fd channel would block the daemon's only
            # thread; it loses its session instead.
            log.warning("fd channel of client %r (%s) is not draining (%s); closing its session", session.name, session.pids, exc)
            self._drop(conn)
            raise p.ProtocolError(p.ErrorCode.INTERNAL, "the fd channel is not accepting descriptors; session closed") from None

    def _deliver(self, notices: Sequence[tuple[int, p.Notice]]) -> None:
        for session_id, notice in notices:
            conn = self._by_session.get(session_id)
            if conn is None:
                continue
            try:
                conn.sock.send(p.encode_event(notice), socket.MSG_DONTWAIT)
            except OSError as exc:
                log.info("notice %r to session %d not delivered: %s", notice.kind, session_id, exc)
            except p.ProtocolError as exc:
                log.error("notice %r to session %d not delivered: %s", notice, session_id, exc.message)

    # ------------------------------------------------------------------ fd channel

    def _on_accept(self) -> None:
        assert self._listener is not None
        now = time.monotonic()
        for _ in range(ACCEPT_BATCH):
            if not self._door.may_accept(now):
                break
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                self._door.accept_failed(now, exc, "descriptors" if exc.errno in (errno.EMFILE, errno.ENFILE) else "resources")
                break
            if self._door.full():
                self._drop(self._door.evictee())
            try:
                sock.setblocking(False)
                pid, uid, gid = fdchannel.peer_credentials(sock)
            except OSError as exc:
                log.warning("fd-channel connection dropped at once: %s", exc)
                sock.close()
                continue
            self._door.admit(Connection(sock=sock, pid=pid, uid=uid, gid=gid, accepted=now, deadline=now + self.hello_timeout))
            self._control.fd_opened(sock.fileno(), now)
            self._poller.register(sock.fileno(), _POLLIN)
        self._update_listener(now)

    def _update_listener(self, now: float) -> None:
        """Poll the listener only while a connection may be accepted (see admission.py):
        one left readable and unaccepted would wake the loop for nothing."""
        assert self._listener is not None
        change = self._door.listen_change(now)
        if change is True:
            self._poller.register(self._listener.fileno(), _POLLIN)
        elif change is False:
            self._poller.unregister(self._listener.fileno())

    def _on_fd_channel(self, conn: Connection) -> None:
        try:
            payload, fds = fdchannel.recv(conn.sock)
        except BlockingIOError:
            return
        except p.ProtocolError as exc:
            self._send_on(conn, p.encode_error(0, exc))
            return
        except OSError:
            self._drop(conn)
            return
        if not payload and not fds:
            self._drop(conn)  # EOF: the client is gone
            return
        if fds:
            fdchannel.close_all(fds)
            err = p.ProtocolError(p.ErrorCode.UNEXPECTED_FDS, f"the daemon takes no descriptors from clients; closed {len(fds)}")
            self._send_on(conn, p.encode_error(p.request_id_of(payload), err))
            return
        request_id = 0
        try:
            request = p.decode_request(payload)
            request_id = request.request_id
            if conn.session is not None:
                raise p.ProtocolError(p.ErrorCode.UNKNOWN_MESSAGE, "requests after HELLO go on the control channel")
            session, reply = self.outbox.greet(request, conn.pid, conn.uid, conn.gid)
        except p.ProtocolError as exc:
            rid = exc.detail.get("request_id", request_id)
            self._send_on(conn, p.encode_error(rid if isinstance(rid, int) else 0, exc))
            return
        conn.session = session
        self._door.opened(conn)
        self._by_session[session.id] = conn
        self._by_token[session.token] = session
        self._send_on(conn, reply)

    def _send_on(self, conn: Connection, payload: bytes) -> None:
        try:
            conn.sock.send(payload, socket.MSG_DONTWAIT)
        except OSError:
            self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        fd = conn.sock.fileno()
        if self._door.forget(fd) is None:
            return
        self._poller.unregister(fd)
        conn.sock.close()
        self._update_listener(time.monotonic())
        if conn.session is not None:
            self._by_session.pop(conn.session.id, None)
            self._by_token.pop(conn.session.token, None)
            self._control.door.ended(conn.session.token)
            self._post(self.outbox.session_closed(conn.session.id))

    # ------------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        log.info("stopping: telling %d client(s)", len(self._by_session))
        self.notifier.send("STOPPING=1", "STATUS=stopping")
        self._post(self.outbox.stopping())
        for conn in list(self._connections.values()):
            conn.sock.close()
        self._door.connections.clear()
        self._door.pending.clear()
        self._close_sockets()
        runtime.remove_files(self.endpoints)
        self.outbox.close()
        signal.set_wakeup_fd(-1)
        for fd in (self._wake_r, self._wake_w, *self._lock_fds):
            if fd >= 0:
                os.close(fd)
        log.info("stopped")

    def _close_sockets(self) -> None:
        self._control.close()
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
