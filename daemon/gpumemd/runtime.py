"""What the daemon needs of its host before it serves: the lock that makes it its
device's only daemon, its files in the runtime directory (stale sockets cleared, socket
modes and group, the identity file clients discover it by), and the open-file limit with
the connections it allows.

Everything here runs once, at start or at stop, on the daemon's thread.
"""

from __future__ import annotations

import dataclasses
import fcntl
import grp
import json
import logging
import os
import resource
import socket
from pathlib import Path

from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints

log = logging.getLogger("gpumemd.runtime")

# What the open-file limit must leave besides connections on both channels: ZeroMQ's
# own descriptors (its context, the ROUTER's listener; libzmq aborts the process when it
# cannot accept a peer, so the control channel's count is kept within its share:
# control_door.py), the lease table, the lock, the wake-up pipe, the host backend's chunk
# memfds, chunk descriptors being handed out.
FD_HEADROOM_MIN = 64
# Connections that have not said HELLO: anyone who may open the socket can make them, and
# each holds a descriptor until its HELLO timeout.
MAX_PENDING = 256
class StartupError(Exception):
    """The daemon cannot start; the message is the one line an operator sees."""


@dataclasses.dataclass(frozen=True)
class FdBudget:
    """How many connections the open-file limit allows, on each channel."""

    limit: int
    connections: int  # fd channel: sessions and pending connections together
    pending: int  # fd channel: connections that have not said HELLO yet
    control: int  # control channel: a DEALER per session, and anonymous peers (gpumemctl)

    @classmethod
    def of(cls, limit: int) -> FdBudget:
        headroom = max(FD_HEADROOM_MIN, limit // 4)
        # A session holds a control-channel connection besides its fd channel.
        connections = max(1, (limit - headroom) // 2)
        return cls(limit, connections, max(1, min(MAX_PENDING, connections // 4)), max(1, limit - headroom - connections))


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (what a shell's ulimit or a unit's
    LimitNOFILE allows); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or hard == resource.RLIM_INFINITY:
        log.info("open-file limit %d", soft)
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("open-file limit %d: raising it to the hard limit %d failed (%s)", soft, hard, exc)
        return soft
    log.info("open-file limit %d (soft limit raised from %d to the hard limit)", hard, soft)
    return hard


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


def group_id(socket_group: str | None) -> int | None:
    """The group the sockets are given to (by name, or by number: a container may know
    the group by number only)."""
    if not socket_group:
        return None
    if socket_group.isdigit():
        return int(socket_group)
    try:
        return grp.getgrnam(socket_group).gr_gid
    except KeyError:
        raise StartupError(f"socket group '{socket_group}' does not exist (groupadd it, or drop --socket-group)") from None


def take_lock(endpoints: Endpoints) -> int:
    """The device's lock (flock on gpuN.lock), held for the daemon's life; returns its fd.
    A ZeroMQ ipc bind would silently take a live daemon's socket over: holding this lock
    is what proves any socket file present belongs to a dead one."""
    fd = os.open(endpoints.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(
            f"another gpumemd (pid {holder}) already serves device {endpoints.index} in "
            f"{endpoints.runtime_dir}; stop it first (systemctl stop gpumemd@{endpoints.index})"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def remove_stale_sockets(endpoints: Endpoints) -> None:
    """Under the lock: socket files here belong to a daemon that is gone."""
    for stale in (endpoints.zmq_path, endpoints.fd_path):
        if stale.exists() or stale.is_symlink():
            log.info("removing stale socket %s left by a daemon that is gone", stale)
            stale.unlink()


def set_socket_modes(endpoints: Endpoints, gid: int | None) -> None:
    for path in (endpoints.zmq_path, endpoints.fd_path):
        os.chmod(path, 0o660)
        if gid is not None:
            os.chown(path, -1, gid)


def write_info(endpoints: Endpoints, uuid: str, backend: str) -> None:
    """The identity file clients and gpumemctl discover the daemon by (index, UUID,
    backend), written whole or not at all."""
    info = {"index": endpoints.index, "uuid": uuid, "backend": backend, "pid": os.getpid(), "protocol": list(p.PROTOCOL_VERSION)}
    tmp = endpoints.info_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info) + "\n")
    os.chmod(tmp, 0o644)
    tmp.rename(endpoints.info_path)


def remove_files(endpoints: Endpoints) -> None:
    """At stop: the sockets and the identity file (the lock file stays; the lock goes
    with its descriptor)."""
    for path in (endpoints.zmq_path, endpoints.fd_path, endpoints.info_path):
        path.unlink(missing_ok=True)
