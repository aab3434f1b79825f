"""The session desk: who gets a session (HELLO, and a name taken over from a session
whose process is gone), who gets one back after a restart (RESUME), the grace period the
sessions kept across a restart wait out for their clients, and the sessions' part of the
durable record.

The desk decides and closes nothing. A session that must end (a dead holder whose name
a new client takes over; a client that died before it resumed, or did not resume in
time) comes back to the dispatcher as its id, and the dispatcher (state.py) closes it:
what a session's end means for the books is decided there, once.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from gpumem_shared import __version__, lease_table
from gpumem_shared import protocol as p

from gpumemd.arenas import ArenaBook
from gpumemd.checks import check_name
from gpumemd.config import StateConfig
from gpumemd.fencing import process_gone
from gpumemd.image import Image, Imager
from gpumemd.records import SessionRecord
from gpumemd.tally import Tally
from gpumemd.tenants import Tenants

log = logging.getLogger("gpumemd.sessions")

# Both about its connection: a rebuilt session waits for its client, whose RESUME says what it sends again.
_SESSION = Imager(SessionRecord, "waiting", "resending")


class SessionsImage(msgspec.Struct):
    sessions: list[Image]
    next_session: int


class SessionDesk:
    def __init__(
        self,
        sessions: dict[int, SessionRecord],
        backend: p.Backend,
        device: p.DeviceInfo,
        config: StateConfig,
        arenas: ArenaBook,
        tenants: Tenants,
        tally: Tally,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        gone: Callable[[int, float], bool] | None,
    ) -> None:
        self.sessions = sessions
        self.next_session = 1
        self.backend = backend
        self.device = device
        self.config = config
        self.arenas = arenas
        self.tenants = tenants
        self.tally = tally
        self.clock = clock
        self.wall_clock = wall_clock
        # Whether a session's process (pid, HELLO's unix time) is provably gone, for
        # sessions kept across a restart (fencing.process_gone); None: the grace decides.
        self.gone = gone
        # Restarts survived with the state kept; whether sessions get a resume credential
        # (the daemon keeps its state in systemd's fd store); when sessions kept across the
        # last restart stop waiting for their clients.
        self.generation = 0
        self.resumable = False
        self.grace_deadline: float | None = None

    # ------------------------------------------------------------------ HELLO

    def admit(self, hello: p.Hello, pid: int, uid: int) -> tuple[bytes, int | None]:
        """Before a session opens: its tenant token's digest (b"": none), and the session
        to close first, whose name it takes over (None: no such session)."""
        check_name(hello.name, "client name")
        # A token no cap names is refused before anything changes.
        tenant_key = self.arenas.caps.admit(hello.tenant_token, f"client {hello.name!r} (pid {pid}, uid {uid})")
        # Shares name clients: a name a session holds cannot be said again, so no second
        # process can pass for the first one.
        holder = next((x for x in self.sessions.values() if x.name == hello.name), None)
        return tenant_key, None if holder is None else self._take_name(holder, pid, uid)

    def open(self, hello: p.Hello, pid: int, uid: int, gid: int, tenant_key: bytes) -> tuple[SessionRecord, p.HelloReply]:
        self.tenants.check_session(uid)
        live = {lease_table.word_session(i) for i in self.sessions}
        # Lease words must tell live sessions apart, and 0 in a slot's fields means nobody.
        while lease_table.word_session(self.next_session) in live or lease_table.word_session(self.next_session) == 0:
            self.next_session += 1
        session = SessionRecord(
            id=self.next_session,
            name=hello.name,
            pid=pid,
            uid=uid,
            gid=gid,
            since=self.wall_clock(),
            token=os.urandom(16),
            own_pid=hello.pid or pid,  # a client before 1.9 says none: the kernel's is its own then
            credential=os.urandom(p.RESUME_CREDENTIAL_BYTES) if self.resumable else b"",
            tenant_key=tenant_key,
        )
        self.next_session += 1
        self.sessions[session.id] = session
        self.tally.sessions_opened += 1
        account = self.arenas.caps.session_account(uid, gid, tenant_key)
        log.info("session %d opened: client %r %s uid %d%s", session.id, session.name, session.pids, uid, f", tenant {account}" if account else "")
        return session, self._hello_reply(session)

    def _take_name(self, holder: SessionRecord, pid: int, uid: int) -> int:
        """A session kept across a restart whose process is gone cannot resume: a process
        of its uid (its supervisor's restarted engine) takes the name over at once, and
        what the dead one held is released as a dead client's (the id returned, to close).
        Any other holder keeps it."""
        name, who = holder.name, f"session {holder.id}, {holder.pids}, uid {holder.uid}"
        if not holder.waiting:
            raise p.ProtocolError(
                p.ErrorCode.ALREADY_EXISTS,
                f"client name '{name}' is held by a live session ({who}); connect under another name, or once that process "
                "has closed its session",
                holder_pid=holder.own_pid,
                holder_session=holder.id,
            )
        gone = uid == holder.uid and process_gone(holder.pid, holder.since)
        if not gone:
            left = 0.0 if self.grace_deadline is None else max(0.0, self.grace_deadline - self.clock())
            if uid != holder.uid:
                why = f"only a process of uid {holder.uid} may take it over once its process is gone"
            elif holder.pid > 0:
                why = f"pid {holder.pid} still runs"
            else:
                # Its fd channel died with the old daemon, and its pid is none the daemon
                # can read: only its RESUME or the grace period's end tells.
                why = "its process is outside gpumemd's pid namespace, so nothing tells whether it still runs"
            raise p.ProtocolError(
                p.ErrorCode.ALREADY_EXISTS,
                f"client name '{name}' is held by a session kept across the daemon's restart ({who}), waiting up to "
                f"{left:.0f}s more for its client to resume; {why}. Connect under another name, or once it has resumed "
                "and closed, or its time is up",
                holder_pid=holder.own_pid,
                holder_session=holder.id,
            )
        log.warning(
            "session %d (client %r, %s) waiting to resume: its process is gone; released like a dead client's, "
            "its name goes to pid %d", holder.id, name, holder.pids, pid,
        )
        self._end_grace_unless_waiting({holder.id})
        return holder.id

    def _hello_reply(self, session: SessionRecord) -> p.HelloReply:
        return p.HelloReply(
            protocol=list(p.PROTOCOL_VERSION),
            daemon_version=__version__,
            daemon_pid=os.getpid(),
            session_id=session.id,
            token=session.token,
            backend=self.backend,
            device=self.device,
            credential=session.credential,
            generation=self.generation,
        )

    # ------------------------------------------------------------------ after a restart

    def resume(self, m: p.Resume, pid: int, uid: int, gid: int) -> tuple[SessionRecord, p.HelloReply]:
        """A client back after a restart: its session, if the credential is the one HELLO
        issued and the connection comes from the uid and gid that said HELLO (and the same
        pid, where the daemon saw one both times: a client outside its pid namespace shows 0)."""
        session = self.sessions.get(m.session_id)
        if session is None or not session.credential:
            raise p.ProtocolError(
                p.ErrorCode.SESSION_LOST,
                f"gpumemd (pid {os.getpid()}, generation {self.generation}) holds no session {m.session_id} to resume: "
                f"its client did not come back within the {self.config.restart_grace:g}s grace period and what it held was "
                "released, or the daemon restarted without its state (no fd store); open a new session",
                session=m.session_id,
            )
        if not hmac.compare_digest(m.credential, session.credential):
            log.warning("resume of session %d (client %r) refused: wrong credential from pid %d uid %d", session.id, session.name, pid, uid)
            raise p.ProtocolError(p.ErrorCode.PERMISSION_DENIED, f"wrong resume credential for session {m.session_id}", session=m.session_id)
        other_pid = pid != session.pid and pid > 0 and session.pid > 0
        if (uid, gid) != (session.uid, session.gid) or other_pid:
            log.warning(
                "resume of session %d (client %r, pid %d uid %d gid %d) refused: its credential came from pid %d uid %d gid %d",
                session.id, session.name, session.pid, session.uid, session.gid, pid, uid, gid,
            )
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED,
                f"session {session.id} belongs to pid {session.pid} (uid {session.uid}, gid {session.gid}); this connection "
                f"is pid {pid} (uid {uid}, gid {gid}): only the process that opened a session may resume it",
                session=session.id,
            )
        if not session.waiting:
            raise p.ProtocolError(
                p.ErrorCode.ALREADY_EXISTS, f"session {session.id} is connected already; it is resumed once", session=session.id
            )
        session.waiting = False
        session.resending = set(m.pending)
        # Chunks of the answers it asks for again that it does not map: those replies never
        # reached it (each goes again, with them, when its request comes again).
        self.arenas.drop_holder(session.id, session.handed_out(session.resending) - {c for h in m.holdings for c in h.chunks})
        left = sum(1 for s in self.sessions.values() if s.waiting)
        if not left:
            self.grace_deadline = None
        log.info("session %d resumed: client %r pid %d (%d session(s) still waiting)", session.id, session.name, pid, left)
        return session, self._hello_reply(session)

    def grace_left(self, now: float) -> float:
        return 0.0 if self.grace_deadline is None else max(0.0, self.grace_deadline - now)

    def tick(self) -> list[int]:
        """The sessions kept across a restart to close now: those whose client died before
        it resumed, and, once the grace period is over, every one still waiting."""
        if self.grace_deadline is None:
            return []
        closing = self.release_gone()  # a client that died before it resumed
        if self.grace_deadline is not None and self.clock() >= self.grace_deadline:
            self.grace_deadline = None
            for session in [s for s in self.sessions.values() if s.waiting and s.id not in closing]:
                log.warning(
                    "session %d (client %r, %s) did not resume within the %gs grace period; what it held is "
                    "released like a dead client's", session.id, session.name, session.pids, self.config.restart_grace,
                )
                closing.append(session.id)
        return closing

    def release_gone(self) -> list[int]:
        """Sessions kept across a restart whose process is provably gone (it died while
        the daemon was down, or before the daemon saw its end) cannot resume: what they
        held goes at once as a dead client's (their ids returned, to close), and what they
        retained is orphaned for an adopter, instead of after the grace period (a standby
        waiting to adopt would wait it out). A process the daemon cannot read waits for
        the grace as before."""
        gone = self.gone
        if gone is None or self.grace_deadline is None:
            return []
        closing = []
        for session in [s for s in self.sessions.values() if s.waiting and gone(s.pid, s.since)]:
            log.warning(
                "session %d (client %r, %s) waiting to resume: its process is gone; released like a dead client's",
                session.id, session.name, session.pids,
            )
            closing.append(session.id)
        self._end_grace_unless_waiting(set(closing))
        return closing

    def _end_grace_unless_waiting(self, closing: set[int]) -> None:
        """The grace period ends once no session but those in ``closing`` waits."""
        if not any(s.waiting for s in self.sessions.values() if s.id not in closing):
            self.grace_deadline = None

    # ------------------------------------------------------------------ the durable record

    def image(self) -> SessionsImage:
        return SessionsImage([_SESSION.image(s) for s in self.sessions.values()], self.next_session)

    def restore(self, image: Any, generation: int) -> None:
        """The sessions of ``image`` (a ``SessionsImage`` as the record holds it), each
        waiting for its client to resume; the grace period starts with ``start_grace``,
        once the books are rebuilt too."""
        part = msgspec.convert(image, SessionsImage)
        for session in (_SESSION.restore(s, waiting=True) for s in part.sessions):
            self.sessions[session.id] = session
        self.next_session = part.next_session
        self.generation = generation + 1

    def start_grace(self) -> list[int]:
        """After a restore: the sessions rebuilt wait up to the grace period for their
        clients; those whose process is gone already are returned, to close."""
        if not self.sessions:
            return []
        self.grace_deadline = self.clock() + self.config.restart_grace
        return self.release_gone()
