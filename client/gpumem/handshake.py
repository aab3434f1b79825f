"""Opening a session's fd channel: connect to the daemon's fd socket, say HELLO (or
RESUME, for a session the daemon kept across a restart) and read its answer.

Each way it fails is its own error, since each asks the user to check something else:
nothing listens (start the daemon), the socket's group, a listen backlog that stays full
(tried again with backoff until the timeout: the daemon is stopped, hung, at its
open-file limit or flooded), no answer in time, the connection closed during the hello
(the daemon stopped or restarted: a resume tries again), a refusal, another protocol.
"""

from __future__ import annotations

import socket
import time

from gpumem_shared import fdchannel
from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumem.control import permission_denied
from gpumem.discovery import start_hint
from gpumem.errors import BadMessage, DaemonTimeout, DaemonUnavailable, error_from_protocol, error_from_reply

# connect() on the fd channel fails at once (EAGAIN) while the daemon's listen backlog is
# full: it is not accepting (stopped, busy, at its connection limit) or is flooded. Try
# again after these pauses, doubling, until the timeout.
_CONNECT_RETRY_FIRST = 0.005
_CONNECT_RETRY_MOST = 0.2


def connect(sock: socket.socket, ep: Endpoints, timeout: float, *, session_timeout: float) -> float:
    """Connect ``sock`` to the daemon's fd socket within ``timeout``, tried again with
    backoff while its listen backlog is full (``session_timeout``: the wait that refusal
    names). Returns the deadline, which the hello shares."""
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    try:
        _connect(sock, ep, deadline, session_timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        raise DaemonUnavailable(
            f"no gpumemd serves device {ep.index}: nothing listens at {ep.fd_path}; {start_hint(str(ep.index))}"
        ) from None
    except PermissionError:
        raise permission_denied(ep.fd_path) from None
    return deadline


def hello(sock: socket.socket, ep: Endpoints, message: p.Hello | p.Resume, deadline: float, timeout: float) -> p.HelloReply:
    """Say ``message`` on the connected fd channel and read the daemon's answer by
    ``deadline`` (``timeout``: the whole wait, which a refusal names)."""
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


def _connect(sock: socket.socket, ep: Endpoints, deadline: float, session_timeout: float) -> None:
    """connect(), tried again with backoff while the listen backlog is full."""
    pause = _CONNECT_RETRY_FIRST
    while True:
        try:
            sock.connect(str(ep.fd_path))
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DaemonTimeout(_backlog_full_message(ep, session_timeout)) from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, _CONNECT_RETRY_MOST)


def _backlog_full_message(ep: Endpoints, session_timeout: float) -> str:
    return (
        f"gpumemd for device {ep.index} took no new connection within {session_timeout:g}s: the listen backlog of "
        f"{ep.fd_path} stayed full. The daemon is stopped or hung (check 'systemctl status gpumemd@{ep.index}'), "
        "serves as many clients as its open-file limit allows (its log says; raise LimitNOFILE), or something "
        "floods it with connections (its log names the pids)"
    )
