"""What the daemon needs of its host before it serves: the locks that make it its
device's only daemon, its files in the runtime directory (stale sockets cleared, socket
modes and group, the identity file clients discover it by), and the open-file limit with
the connections it allows.

Everything here runs once, at start or at stop, on the daemon's thread.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import grp
import hashlib
import json
import logging
import os
import resource
import socket
import stat
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
# The device lock is an abstract socket named by a digest of the UUID; the holder's pid
# and runtime directory follow the same digest in a second name, which /proc/net/unix
# shows to the daemon refused. A name has 107 bytes: the digest leaves room for the
# directory (whose socket paths must fit in 108 bytes themselves).
_ABSTRACT_MAX = 107
_HOLDER = "/pid="
# Root daemons' device locks: /run is root's alone, so no other user can plant a file
# or a link here before the first daemon starts.
DEVICE_LOCK_DIR = Path("/run/gpumemd-devices")


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


def take_lock(endpoints: Endpoints, device_uuid: str | None) -> list[int]:
    """The device's locks, held for the daemon's life; returns their fds. The flock on
    gpuN.lock: a ZeroMQ ipc bind would silently take a live daemon's socket over, and
    holding this lock is what proves any socket file present belongs to a dead one. With
    ``device_uuid``, the device's own lock besides (take_device_lock)."""
    fds = take_device_lock(device_uuid, endpoints.runtime_dir) if device_uuid is not None else []
    try:
        fds.append(_take_dir_lock(endpoints))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def take_device_lock(uuid: str, runtime_dir: Path) -> list[int]:
    """One daemon per GPU, whichever runtime directory it was given. Returns the locks' fds.

    An abstract unix socket named by the device's UUID, bound for the daemon's life (the
    kernel frees the name when the process dies, however it dies; no file to leave stale).
    Abstract names are per network namespace, and anyone may bind one first: a root daemon
    (what systemd runs) holds a lock file in a directory only root writes
    (DEVICE_LOCK_DIR), which decides among root daemons and which an unprivileged squatter
    of the abstract name cannot take; a daemon of another user sees it and stands back."""
    fds: list[int] = []
    if os.geteuid() == 0:
        fds.append(_take_root_lock(uuid, runtime_dir))
    else:
        _stand_back_for_root(uuid)
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        lock.bind(_abstract(_lock_name(uuid)))
    except OSError as exc:
        lock.close()
        if exc.errno == errno.EADDRINUSE and fds:
            # The root lock is ours, so the name's holder is no root daemon: another user's
            # daemon or a squatter. Either way it does not keep the system's daemon out.
            log.warning("device %s's abstract lock name is held by a process of another user (%s); serving on the root lock",
                        uuid, _device_holder(uuid))
            return fds
        for fd in fds:
            os.close(fd)
        if exc.errno != errno.EADDRINUSE:
            raise StartupError(f"cannot take device {uuid}'s lock: {exc.strerror or exc}") from None
        who = _device_holder(uuid)
        raise StartupError(f"another gpumemd ({who}) already serves device {uuid}; {how_to_stop(_pid_in(who))}") from None
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        holder.bind(_abstract(f"{_lock_name(uuid)}{_HOLDER}{os.getpid()} {runtime_dir}"))
    except OSError:  # only a name for the message of a daemon refused
        holder.close()
        return [*fds, lock.detach()]
    return [*fds, lock.detach(), holder.detach()]


def _root_lock_path(uuid: str) -> Path:
    return DEVICE_LOCK_DIR / (_lock_name(uuid).rpartition("/")[2] + ".lock")


def _take_root_lock(uuid: str, runtime_dir: Path) -> int:
    try:
        DEVICE_LOCK_DIR.mkdir(mode=0o755, exist_ok=True)
        st = os.lstat(DEVICE_LOCK_DIR)
    except OSError as exc:
        raise StartupError(f"cannot make the device lock directory {DEVICE_LOCK_DIR}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise StartupError(f"the device lock directory {DEVICE_LOCK_DIR} is not a directory only root may write; remove it")
    path = _root_lock_path(uuid)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise StartupError(f"cannot open device {uuid}'s lock {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "pid unknown"
        os.close(fd)
        raise StartupError(f"another gpumemd ({holder}) already serves device {uuid}; {how_to_stop(_pid_in(holder))}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, runtime directory {runtime_dir}\n".encode(), 0)
    return fd


def _stand_back_for_root(uuid: str) -> None:
    """A root daemon serving the device keeps an unprivileged one from starting beside it."""
    try:
        fd = os.open(_root_lock_path(uuid), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return  # no root daemon has served it (or its lock is not ours to read)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "pid unknown"
        raise StartupError(f"the system's gpumemd ({holder}) already serves device {uuid}; use it, or stop it first") from None
    finally:
        os.close(fd)


def _lock_name(uuid: str) -> str:
    return "gpumemd/" + hashlib.sha256(uuid.encode()).hexdigest()[:24]


def _abstract(name: str) -> bytes:
    return b"\0" + name.encode()[:_ABSTRACT_MAX]


def _device_holder(uuid: str) -> str:
    """Who holds the device's lock, from the holder's second name in /proc/net/unix."""
    prefix = "@" + _lock_name(uuid) + _HOLDER
    try:
        with open("/proc/net/unix") as table:
            for line in table:
                fields = line.rstrip("\n").split(None, 7)
                if len(fields) == 8 and fields[7].startswith(prefix):
                    pid, _, runtime_dir = fields[7][len(prefix):].partition(" ")
                    cut = " (cut short)" if len(fields[7]) >= _ABSTRACT_MAX else ""
                    return f"pid {pid}, runtime directory {runtime_dir}{cut}"
    except OSError:
        pass
    return "pid unknown: it is starting, or in another network namespace"


def _take_dir_lock(endpoints: Endpoints) -> int:
    while True:
        fd = os.open(endpoints.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StartupError(
                f"another gpumemd (pid {holder}) already serves device {endpoints.index} in "
                f"{endpoints.runtime_dir}; {how_to_stop(int(holder) if holder.isdigit() else None)}"
            ) from None
        # A stopping daemon removes the file it held (remove_files): a lock taken on the
        # removed file would stand beside the next daemon's on a new one.
        try:
            current = os.stat(endpoints.lock_path)
        except FileNotFoundError:
            current = None
        opened = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def how_to_stop(pid: int | None) -> str:
    """What stops the daemon that holds a lock: its unit where systemd runs it (stopping
    the process alone would see it restarted), else its pid."""
    if pid is None:
        return "stop it first (systemctl stop gpumemd@<index> where systemd runs it, else kill its pid)"
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        command, cgroups = b"", ""
    if b"gpumemd" not in command:  # the pid it wrote is another PID namespace's (a container's), or gone
        return f"stop it first (it reported pid {pid}, which is no gpumemd in this PID namespace: a container's?)"
    units = [part for line in cgroups.splitlines() for part in line.rpartition(":")[2].split("/") if part.endswith(".service")]
    if units and units[-1].startswith("gpumemd"):
        return f"stop it first: systemctl stop {units[-1].removesuffix('.service')}"
    return f"stop pid {pid} first (kill {pid}): no systemd unit runs it"


def _pid_in(holder: str) -> int | None:
    word = holder.removeprefix("pid ").split(",", 1)[0]
    return int(word) if word.isdigit() else None


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
            try:
                os.chown(path, -1, gid)
            except PermissionError:
                # The unit keeps no capability (CAP_CHOWN included): root gives a file to
                # a group only as a member of it.
                raise StartupError(
                    f"cannot give {path} to group {gid}: not a member of it, and no CAP_CHOWN "
                    "(under systemd: SupplementaryGroups= must name the --socket-group)"
                ) from None


def write_info(endpoints: Endpoints, uuid: str, backend: str) -> None:
    """The identity file clients and gpumemctl discover the daemon by (index, UUID,
    backend), written whole or not at all."""
    info = {"index": endpoints.index, "uuid": uuid, "backend": backend, "pid": os.getpid(), "protocol": list(p.PROTOCOL_VERSION)}
    tmp = endpoints.info_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info) + "\n")
    os.chmod(tmp, 0o644)
    tmp.rename(endpoints.info_path)


def remove_files(endpoints: Endpoints) -> None:
    """At stop, the lock still held: the sockets, the identity file and the lock file (a
    daemon taking the lock checks that its file is still the one named, _take_dir_lock)."""
    for path in (endpoints.zmq_path, endpoints.fd_path, endpoints.info_path, endpoints.lock_path):
        path.unlink(missing_ok=True)


def check_runtime_dir(path: Path) -> None:
    """Make the runtime directory if it is not there, and refuse one that others may
    write: anyone could plant a socket, an identity file or a lock there before the
    daemon, or replace its own."""
    fix = f"give gpumemd a directory of its own (--runtime-dir {path / 'gpumemd'}, or leave --runtime-dir out for the default)"
    try:
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise StartupError(
            f"cannot make runtime directory {path}: {exc.strerror or exc}; make it as a user who may, or {fix}"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"runtime directory {path} is not a directory; {fix}")
    if st.st_mode & 0o002:
        raise StartupError(f"runtime directory {path} may be written by others (mode {stat.S_IMODE(st.st_mode):o}); {fix}")
    if st.st_uid not in (0, os.geteuid()):
        raise StartupError(
            f"runtime directory {path} belongs to uid {st.st_uid}, who could replace the daemon's sockets; {fix}"
        )

