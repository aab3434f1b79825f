"""Where a daemon's sockets live, found the same way by gpumemd, clients and gpumemctl.

For device N under the runtime directory:
  gpu<N>.zmq   ZeroMQ control channel (ROUTER)
  gpu<N>.fd    AF_UNIX SOCK_SEQPACKET fd channel; one connection per session
  gpu<N>.lock  flock held by the live daemon; refuses a second one
  gpu<N>.json  identity of the live daemon (uuid, backend, pid), for discovery by UUID
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENV_RUNTIME_DIR = "GPUMEMD_RUNTIME_DIR"
# Where the system daemons (gpumemd@N under systemd, RuntimeDirectory=gpumemd) live.
SYSTEM_RUNTIME_DIR = Path("/run/gpumemd")


class UnsafeRuntimeDir(Exception):
    """The runtime directory is one someone else may control; the message says which and why."""


def _tmp_runtime_dir(euid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"gpumemd-{euid}"


def _user_runtime_dir(environ: Mapping[str, str], euid: int) -> Path:
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "gpumemd"
    return _tmp_runtime_dir(euid)


def default_runtime_dir(environ: Mapping[str, str] | None = None, *, euid: int | None = None) -> Path:
    """Where a daemon started by hand puts its sockets: $GPUMEMD_RUNTIME_DIR, the system
    directory for root, else the user's own runtime directory."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_RUNTIME_DIR):
        return Path(environ[ENV_RUNTIME_DIR])
    euid = os.geteuid() if euid is None else euid
    return SYSTEM_RUNTIME_DIR if euid == 0 else _user_runtime_dir(environ, euid)


def runtime_dir_candidates(environ: Mapping[str, str] | None = None, *, euid: int | None = None) -> list[Path]:
    """Where clients look for daemons, in order: $GPUMEMD_RUNTIME_DIR alone if set; else
    the system directory first (engines that are not root use the daemons systemd runs
    as root), then the user's own (a daemon the user started by hand)."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_RUNTIME_DIR):
        return [Path(environ[ENV_RUNTIME_DIR])]
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        return [SYSTEM_RUNTIME_DIR]
    return [SYSTEM_RUNTIME_DIR, _user_runtime_dir(environ, euid)]


def resolve_runtime_dir(
    explicit: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None, *, euid: int | None = None
) -> Path:
    """The daemon's runtime directory, absolute: clients started elsewhere must find the
    same place. The fallback under the temporary directory is made private (0700) and
    refused unless it is: in a directory everyone may write, someone else can make
    ``gpumemd-<uid>`` first and would then see, or replace, the daemon's sockets."""
    euid = os.geteuid() if euid is None else euid
    path = Path(explicit) if explicit else default_runtime_dir(environ, euid=euid)
    path = path.absolute()
    if not explicit and path == _tmp_runtime_dir(euid).absolute():
        check_private_dir(path, euid)
    return path


def check_private_dir(path: Path, euid: int) -> None:
    """Make ``path`` (0700) if it is not there; refuse it unless it is a directory of
    ``euid``'s that nobody else may write."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeRuntimeDir(f"cannot create runtime directory {path}: {exc.strerror or exc}") from None
    st = os.lstat(path)
    fix = f"remove it, or give gpumemd a private directory (XDG_RUNTIME_DIR, {ENV_RUNTIME_DIR} or --runtime-dir)"
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRuntimeDir(f"runtime directory {path} is not a directory (a symlink or a file): {fix}")
    if st.st_uid != euid:
        raise UnsafeRuntimeDir(f"runtime directory {path} belongs to uid {st.st_uid}, not to uid {euid} who runs gpumemd: {fix}")
    if st.st_mode & 0o022:
        raise UnsafeRuntimeDir(f"runtime directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): {fix}")


@dataclasses.dataclass(frozen=True)
class Endpoints:
    runtime_dir: Path
    index: int

    @property
    def zmq_path(self) -> Path:
        return self.runtime_dir / f"gpu{self.index}.zmq"

    @property
    def zmq_url(self) -> str:
        return f"ipc://{self.zmq_path}"

    @property
    def fd_path(self) -> Path:
        return self.runtime_dir / f"gpu{self.index}.fd"

    @property
    def lock_path(self) -> Path:
        return self.runtime_dir / f"gpu{self.index}.lock"

    @property
    def info_path(self) -> Path:
        return self.runtime_dir / f"gpu{self.index}.json"


def daemon_alive(endpoints: Endpoints) -> bool:
    """Whether a live daemon holds the device's lock (a socket file alone may be stale)."""
    try:
        fd = os.open(endpoints.lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True  # cannot tell (e.g. no permission): let the request find out
    finally:
        os.close(fd)
    return False


def read_info(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def discover(runtime_dir: Path) -> list[dict[str, Any]]:
    """Identity records of the daemons that announced themselves in ``runtime_dir``."""
    found = []
    for path in sorted(runtime_dir.glob("gpu*.json")):
        info = read_info(path)
        if info is not None and isinstance(info.get("index"), int):
            found.append(info)
    return found
