"""A client's session with the daemon of one GPU.

``connect()`` opens the fd channel (SEQPACKET; the daemon learns our pid/uid/gid
from SO_PEERCRED), says HELLO, and gets a token that it then uses as its ZeroMQ
routing id, so control requests are tied to the session without a login message.
The fd channel stays open for the session's life: it is how the daemon knows we are
alive, how it hands us chunk descriptors, and how it tells us it is stopping.
"""

from __future__ import annotations

import collections
import os
import re
import select
import socket
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumem_shared import __version__, fdchannel, lease_table
from gpumem_shared import protocol as p
from gpumem_shared.driver import Driver, DriverError, DriverUnavailable, PeerAccessError
from gpumem_shared.lease_table import LeaseKind, LeaseTable
from gpumem_shared.paths import Endpoints, discover, resolve_runtime_dir
from gpumem.arena import Arena
from gpumem.channel import ControlChannel
from gpumem.kv import KvPool
from gpumem.borrow import Borrow, BorrowPool
from gpumem.graph_pools import GraphPool
from gpumem.leases import Lease
from gpumem.errors import (
    BadMessage,
    BorrowEscaped,
    DaemonStopped,
    DaemonTimeout,
    DaemonUnavailable,
    GpuMemError,
    InvalidArgument,
    NotFound,
    SessionClosed,
    error_from_protocol,
    error_from_reply,
)

DEFAULT_TIMEOUT = 10.0
# replay() runs on every step: a module global, because before Python 3.12 reading an enum
# member off its class costs about 60 ns (EnumType.__getattr__).
_REPLAY = LeaseKind.REPLAY

# IPC events this process's sessions record at lease handoffs, by (daemon, pool id,
# 24-bit session): a taker from another session of this process waits on them directly.
_PROCESS_EVENTS: dict[tuple[str, int, int], Any] = {}


def resolve_device(device: int | str, runtime_dir: Path) -> Endpoints:
    """Find the daemon for ``device``: an index, or a UUID (or unique prefix) such as
    "GPU-8932f937". An index is this process's CUDA ordinal where CUDA is present,
    matched to its daemon by UUID, so CUDA_VISIBLE_DEVICES remapping is honoured."""
    daemons = discover(runtime_dir)
    if isinstance(device, str) and not device.isdigit():
        wanted = device.lower()
        matches = [d for d in daemons if str(d.get("uuid", "")).lower().startswith(wanted)]
        if len(matches) != 1:
            known = ", ".join(f"{d['index']}={d.get('uuid')}" for d in daemons) or "none"
            what = "no daemon serves" if not matches else "several daemons match"
            raise DaemonUnavailable(f"{what} device {device!r} in {runtime_dir} (daemons there: {known})")
        return Endpoints(runtime_dir, matches[0]["index"])
    ordinal = int(device)
    if any(d.get("backend") == "cuda" for d in daemons):
        from gpumem_shared.driver.cuda import visible_device_uuids

        try:
            uuids = visible_device_uuids()
        except DriverUnavailable:
            uuids = []
        if ordinal < len(uuids):
            for d in daemons:
                if d.get("uuid") == uuids[ordinal]:
                    return Endpoints(runtime_dir, d["index"])
    return Endpoints(runtime_dir, ordinal)


def connect(
    device: int | str = 0,
    name: str | None = None,
    *,
    runtime_dir: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    peers: Sequence[int] = (),
) -> Session:
    """Open a session with the daemon of ``device``.

    ``name`` identifies this client in ``gpumemctl status`` and in arena shares
    (default: the program name and pid). ``runtime_dir`` defaults to
    $GPUMEMD_RUNTIME_DIR, /run/gpumemd for root, else $XDG_RUNTIME_DIR/gpumemd.
    ``timeout`` bounds every call of this session unless a call gives its own.
    ``peers``: this process's CUDA ordinals of other GPUs whose kernels must reach the
    memory this session maps (peer access; refused where the hardware has no path).
    """
    endpoints = resolve_device(device, resolve_runtime_dir(runtime_dir))
    return Session(endpoints, name or _default_name(), timeout, peers)


def _default_name() -> str:
    program = re.sub(r"[^A-Za-z0-9._-]", "", Path(sys.argv[0] if sys.argv else "").stem)
    if not program[:1].isalnum():
        program = "client" + program
    return f"{program}-{os.getpid()}"


class _Resources:
    """What must be closed even if the Session object is dropped without close()."""

    def __init__(self) -> None:
        self.fd_sock: socket.socket | None = None
        self.control: ControlChannel | None = None

    def __call__(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.fd_sock is not None:
            self.fd_sock.close()
            self.fd_sock = None


class Session:
    def __init__(self, endpoints: Endpoints, name: str, timeout: float, peers: Sequence[int] = ()) -> None:
        self.endpoints = endpoints
        self.peers = list(peers)
        self.name = name
        self.timeout = timeout
        self._lock = threading.RLock()
        self._notices: collections.deque[p.Notice] = collections.deque(maxlen=1024)
        self._early_batches: list[tuple[p.FdBatch, list[int]]] = []
        self._stopped: str | None = None
        self._resources = _Resources()
        # Registered before anything opens, so a half-built session still cleans up.
        self._finalizer = weakref.finalize(self, self._resources)
        self.arenas: dict[str, Arena] = {}
        # Borrowing, per graph pool id: this process's borrow pools; lease slots this
        # session marked because borrowed tensors outlived their scope.
        self.borrow_pools: dict[int, BorrowPool] = {}
        self.borrow_escapes: dict[int, BorrowPool] = {}
        # Lease handoffs on shared pools: our IPC event per pool id, and peers' events
        # by (pool id, session) once opened. ``handoff_waits`` counts the waits.
        self._lease_events: dict[int, Any] = {}
        self._peer_events: dict[tuple[int, int], Any] = {}
        self.handoff_waits = 0
        ok = False
        try:
            hello = self._hello()
            self.session_id = hello.session_id
            # This session's lease words, one per kind (the hot path must not rebuild them).
            self.lease_words = {kind: lease_table.encode(kind, hello.session_id, os.getpid()) for kind in lease_table.KIND_NAMES}
            self._word_session = lease_table.word_session(hello.session_id)
            self._daemon_key = f"{endpoints.runtime_dir}:{endpoints.index}"
            self.backend = hello.backend
            self.device = hello.device
            self.daemon_version = hello.daemon_version
            self.daemon_pid = hello.daemon_pid
            self._resources.control = ControlChannel(endpoints, routing_id=hello.token)
            # This process's CUDA ordinal for the daemon's device (None on the host backend).
            self.device_ordinal: int | None = None
            self.driver = self._make_driver()
            ok = True
        finally:
            if not ok:
                self._finalizer()

    # ------------------------------------------------------------------ setup

    def _hello(self) -> p.HelloReply:
        ep = self.endpoints
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._resources.fd_sock = sock
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(ep.fd_path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise DaemonUnavailable(
                f"no gpumemd serves device {ep.index}: nothing listens at {ep.fd_path}; start it with "
                f"'systemctl start gpumemd@{ep.index}' (or 'gpumemd --device {ep.index}'), or point "
                "runtime_dir / $GPUMEMD_RUNTIME_DIR at the daemon's directory"
            ) from None
        except PermissionError:
            raise DaemonUnavailable(
                f"no permission to connect to {ep.fd_path}: join the daemon's socket group (gpumemd --socket-group)"
            ) from None
        try:
            fdchannel.send(sock, p.encode_request(1, p.Hello(name=self.name, client_version=__version__)))
            payload, fds = fdchannel.recv(sock, max_fds=1)
        except TimeoutError:
            raise DaemonTimeout(
                f"gpumemd for device {ep.index} accepted but did not answer HELLO within {self.timeout:g}s ({ep.fd_path})"
            ) from None
        except p.ProtocolError as exc:
            raise BadMessage(exc.message) from None
        try:
            if not payload:
                raise DaemonStopped(f"gpumemd for device {ep.index} closed the connection during HELLO")
            try:
                reply = p.decode_reply(payload)
                if not reply.ok:
                    raise error_from_reply(reply)
                hello = p.decode_body(p.HelloReply, reply.body)
            except p.ProtocolError as exc:
                raise error_from_protocol(exc, "HELLO reply refused") from None
            if len(fds) != 1:
                raise BadMessage(f"gpumemd's HELLO reply carried {len(fds)} descriptors, not the lease table")
            self.leases = LeaseTable(fds[0])
            return hello
        finally:
            fdchannel.close_all(fds)

    def _make_driver(self) -> Driver:
        if self.backend == "host":
            from gpumem_shared.driver.host import HostDriver

            try:
                return HostDriver(self.device.index, peers=self.peers)
            except PeerAccessError as exc:
                raise InvalidArgument(str(exc)) from None
        from gpumem_shared.driver.cuda import CudaDriver, visible_device_uuids

        try:
            uuids = visible_device_uuids()
        except DriverUnavailable as exc:
            raise DaemonUnavailable(f"gpumemd serves CUDA device {self.device.uuid}, but this process cannot use CUDA: {exc}") from None
        if self.device.uuid not in uuids:
            raise DaemonUnavailable(
                f"gpumemd@{self.device.index} serves {self.device.uuid}, which this process does not see "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
            )
        self.device_ordinal = uuids.index(self.device.uuid)
        try:
            return CudaDriver(self.device_ordinal, peers=self.peers)
        except PeerAccessError as exc:
            raise InvalidArgument(f"peer access for gpumemd@{self.device.index} ({self.device.uuid}): {exc}") from None
        except DriverUnavailable as exc:
            raise DaemonUnavailable(f"gpumemd serves CUDA device {self.device.uuid}, which this process cannot use: {exc}") from None

    # ------------------------------------------------------------------ calls

    def call(self, message: Any, timeout: float | None = None) -> Any:
        """One request; returns the typed reply body. Used by Arena and tools."""
        return self._call(message, timeout)[0]

    def _call(self, message: Any, timeout: float | None = None) -> tuple[Any, dict[int, int]]:
        """Returns (reply body, {chunk id: fd}) for requests that hand out chunks."""
        with self._lock:
            control = self._resources.control
            if control is None:
                raise SessionClosed(f"session '{self.name}' is closed")
            self._poll_fd_channel()
            limit = self.timeout if timeout is None else timeout
            request_id, body = control.call(message, limit, lambda rid: self._poll_fd_channel(keep=rid))
            fds: dict[int, int] = {}
            if getattr(body, "fd_batches", 0):
                fds = self._receive_fds(request_id, body.fd_batches, limit)
            return body, fds

    def _poll_fd_channel(self, keep: int = 0) -> None:
        """Take pending notices without blocking; raise if the daemon has gone. Fd batches
        for request ``keep`` (in flight: the daemon sends them just before the reply) are
        kept for it; others belong to calls that timed out and are closed."""
        sock = self._resources.fd_sock
        while sock is not None and self._stopped is None and select.select([sock], [], [], 0)[0]:
            batch, fds = self._read_event(sock)
            if batch is not None and keep and batch.request_id == keep:
                self._early_batches.append((batch, fds))
            else:
                fdchannel.close_all(fds)
        if self._stopped is not None:
            raise DaemonStopped(self._stopped)

    def _read_event(self, sock: socket.socket) -> tuple[p.FdBatch | None, list[int]]:
        """Read one fd-channel message: notices are queued here; an FdBatch is returned
        with its descriptors, which the caller keeps or closes."""
        try:
            payload, fds = fdchannel.recv(sock)
        except p.ProtocolError as exc:
            raise BadMessage(f"fd channel: {exc.message}") from None
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, TimeoutError):
                raise
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
        if self._stopped is None:
            self._stopped = f"{reason}; memory this process mapped stays valid, new requests need a new session"

    def _receive_fds(self, request_id: int, batches: int, timeout: float) -> dict[int, int]:
        sock = self._resources.fd_sock
        assert sock is not None
        received: dict[int, int] = {}
        early, self._early_batches = self._early_batches, []
        for batch, fds in early:
            if batch.request_id == request_id:
                received.update(zip(batch.chunk_ids, fds))
                batches -= 1
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
                if batch is not None and batch.request_id == request_id:
                    received.update(zip(batch.chunk_ids, fds))
                    batches -= 1
                else:
                    fdchannel.close_all(fds)
        except BaseException:
            fdchannel.close_all(list(received.values()))
            raise
        return received

    # ------------------------------------------------------------------ API

    def ping(self, timeout: float | None = None) -> None:
        self.call(p.Ping(), timeout)

    def status(self, timeout: float | None = None) -> p.StatusReply:
        body: p.StatusReply = self.call(p.Status(), timeout)
        return body

    def notices(self, kind: str | None = None, arena: str | None = None) -> list[p.Notice]:
        """Take the notices received so far (daemon stopping, arenas changed by their
        owner, KV shrink requests), optionally only those of one kind and arena."""
        with self._lock:
            if self._resources.fd_sock is not None:
                try:
                    self._poll_fd_channel()
                except DaemonStopped:
                    pass
            wanted = [n for n in self._notices if (kind is None or n.kind == kind) and (arena is None or n.arena == arena)]
            for notice in wanted:
                self._notices.remove(notice)
            return wanted

    def create_arena(self, name: str, reserve_bytes: int) -> Arena:
        """Reserve ``reserve_bytes`` of address space (a multiple of the device
        granularity) under ``name``; nothing is committed until ``Arena.commit``."""
        reply: p.ArenaReply = self.call(p.CreateArena(name=name, reserve_bytes=reserve_bytes))
        arena = Arena(self, reply.arena, owner=True)
        try:
            arena._reserve()
        except BaseException:
            self.call(p.ReleaseArena(name=name))
            raise
        self.arenas[name] = arena
        return arena

    def attach_arena(self, name: str) -> Arena:
        """Map an arena another client shared with this client's name."""
        reply, fds = self._call(p.AttachArena(name=name))
        arena = Arena(self, reply.arena, owner=False)
        try:
            arena._reserve()
        except BaseException:
            fdchannel.close_all(list(fds.values()))
            self.call(p.ReleaseArena(name=name))
            raise
        self.arenas[name] = arena
        arena._apply(reply, fds)
        return arena

    def open_graph_pool(self, pool_id: int = 0, *, owner: str = "", label: str = "") -> GraphPool:
        """Another client's shared graph pool (by id, or by owner and label), to take
        leases on and borrow from. Its arena must be attached in this session first."""
        reply: p.GraphPoolReply = self.call(p.OpenGraphPool(pool_id=pool_id, owner=owner, label=label))
        arena = self.arenas.get(reply.pool.arena)
        if arena is None:
            raise NotFound(f"graph pool {reply.pool.id} lives in arena '{reply.pool.arena}': attach it first (attach_arena)")
        return GraphPool(arena, reply.pool)

    def capture(self, pool: Any, *, wait: float = 0.0, label: str = "capture", stream: int | None = None) -> Lease:
        """The capture lease on a graph pool: excludes every other lease, retires this
        process's borrow pool on it and, for the pool's owner, empties its registered runs
        under a new epoch (capture re-carves them: no borrower may use the old ones once
        the lease is given back). ``refresh(recaptured=True)`` after the capture reports the
        new runs. ``wait`` bounds how long to wait for a holder (0: fail at once)."""
        lease = Lease.acquire(self, pool, LeaseKind.CAPTURE, label, wait, stream)
        try:
            borrowed = self.borrow_pools.get(pool.id)
            if borrowed is not None:
                borrowed.retire()
            if isinstance(pool, GraphPool) and pool.arena.is_owner:
                pool.begin_capture()
        except BaseException:
            lease.release()
            raise
        return lease

    def replay(self, pool: Any, *, wait: float = 0.0, label: str = "replay", stream: int | None = None) -> Lease:
        """The replay lease: excludes capture and borrow (and other replays)."""
        return Lease.acquire(self, pool, _REPLAY, label, wait, stream)

    def borrow(self, pool: Any, *, user: str, wait: float = 0.0, stream: int | None = None) -> Borrow:
        """Borrow the pool's free runs for ``user`` (named to anyone who conflicts): holds
        the borrow lease (excludes capture and replay) and routes this thread's torch
        allocations into the runs until the borrow ends. See gpumem.borrow."""
        return Borrow(self, pool, user, wait, stream)

    # ------------------------------------------------------------------ lease plumbing

    def record_handoff(self, pool_id: int, stream: int) -> None:
        """Before releasing a lease on a shared pool: mark our stream's work so far."""
        event = self._lease_events.get(pool_id)
        if event is None:
            event, handle = self.driver.event_create()
            self.call(p.PublishLeaseEvent(pool_id=pool_id, handle=handle))
            self._lease_events[pool_id] = event
            _PROCESS_EVENTS[(self._daemon_key, pool_id, self._word_session)] = event
        self.driver.event_record(event, stream)

    def wait_for_handoff(self, pool_id: int, slot: int, stream: int) -> None:
        """After taking a lease another session released: our stream waits for its work.
        The releaser may be another session of this process: its event is used as is (a
        process cannot open its own IPC handle)."""
        peer = self.leases.handoff(slot)
        if not peer:
            return
        event = _PROCESS_EVENTS.get((self._daemon_key, pool_id, peer))
        if event is None:
            event = self._peer_events.get((pool_id, peer))
        if event is None:
            try:
                reply: p.LeaseEventReply = self.call(p.LookupLeaseEvent(pool_id=pool_id, session=peer))
            except NotFound:
                return  # the releaser ended: its context, and its queued work, went with it
            event = self._peer_events[(pool_id, peer)] = self.driver.event_open(reply.handle)
        self.driver.stream_wait(event, stream)
        self.handoff_waits += 1

    def report_escape(self, pool: Any, borrowed: BorrowPool, scope: str) -> None:
        """Borrowed tensors outlived ``scope``: the daemon marks the pool's slot, refusing
        replay and capture in every process until we report them gone."""
        self.call(p.ReportEscape(pool_id=pool.id, escaped=True))
        borrowed.escaped_scope = scope
        self.borrow_escapes[pool.slot] = borrowed

    def clear_escape(self, slot: int) -> bool:
        """Report this session's escaped tensors on ``slot`` gone, if they are."""
        borrowed = self.borrow_escapes.get(slot)
        if borrowed is None or borrowed.live_bytes():
            return False
        self.call(p.ReportEscape(pool_id=borrowed.pool_id, escaped=False))
        del self.borrow_escapes[slot]
        borrowed.escaped_scope = None
        return True

    def escape_error(self, pool: Any, kind: str, label: str) -> BorrowEscaped | None:
        """Why the slot refused: our own tensors, or another client's. None when the mark
        is gone already (the caller tries again)."""
        marker = self.leases.escaped(pool.slot)
        if not marker:
            return None
        mine = self.borrow_escapes.get(pool.slot)
        if mine is not None:
            return BorrowEscaped(
                f"{kind} lease '{label}' on graph pool {pool.id} refused: {mine.live_bytes()} bytes borrowed in scope "
                f"'{mine.escaped_scope}' of this process are still alive and a {kind} would overwrite them; free them first",
                {"scope": mine.escaped_scope or "", "pid": os.getpid()},
            )
        status = self.status()
        client = next((c for c in status.clients if lease_table.word_session(c.session_id) == marker), None)
        name, pid = (client.name, client.pid) if client else (f"session {marker}", 0)
        who = next((g.escaped_by for g in status.graph_pools if g.id == pool.id and g.escaped_by), f"client '{name}'")
        return BorrowEscaped(
            f"{kind} lease '{label}' on graph pool {pool.id} refused: {who} (pid {pid}) holds tensors borrowed from it "
            "past their borrow scope; the mark goes once they are freed (at the borrower's next lease on the pool) or "
            "when the borrower exits",
            {"holder": name, "pid": pid},
        )

    def declare_kv_pool(
        self, name: str, buffers: list[p.KvBuffer], *, max_tokens: int = 0, reserve_bytes: int = 0
    ) -> KvPool:
        """Declare a KV pool: ``buffers`` (name, bytes per token row, alignment) laid out
        in one arena, each with room for ``max_tokens`` rows (or as many as
        ``reserve_bytes`` holds). Virtual only until a commit round or ``grow``."""
        reply: p.KvDeclareReply = self.call(p.KvDeclare(name=name, buffers=buffers, max_tokens=max_tokens, reserve_bytes=reserve_bytes))
        pool = KvPool(self, reply.pool)
        try:
            pool.arena._reserve()
        except BaseException:
            self.call(p.ReleaseArena(name=name))
            raise
        self.arenas[name] = pool.arena
        return pool

    def close(self) -> None:
        """Release this session's arenas (unmapping them) and close both channels."""
        with self._lock:
            for arena in list(self.arenas.values()):
                try:
                    arena.release()
                except (GpuMemError, DriverError):
                    pass  # the daemon releases on EOF anyway; the mapping is gone locally
            for _, fds in self._early_batches:
                fdchannel.close_all(fds)
            self._early_batches = []
            for borrowed in self.borrow_pools.values():
                borrowed.close()
            self.borrow_pools.clear()
            for event in self._peer_events.values():
                try:
                    self.driver.event_destroy(event)
                except DriverError:
                    pass  # a broken context: the process's teardown frees it
            self._peer_events.clear()
            for key in [k for k in _PROCESS_EVENTS if k[0] == self._daemon_key and k[2] == self._word_session]:
                del _PROCESS_EVENTS[key]  # stays alive for importers; no new taker finds it
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._resources.control is None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpumem.Session '{self.name}' device {self.device.index} ({self.backend}) id {self.session_id}>"


