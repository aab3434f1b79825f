"""A stand-in for systemd's service manager, as far as gpumemd's restart uses it.

``ServiceManager`` speaks the documented protocol (sd_notify(3), sd_listen_fds(3),
systemd.io/FILE_DESCRIPTOR_STORE): a NOTIFY_SOCKET that keeps the descriptors sent with
``FDSTORE=1`` under their ``FDNAME=``, drops them on ``FDSTOREREMOVE=1``, answers
``BARRIER=1`` by closing the descriptor that came with it once every message before it
is processed, and sees ``READY=1``. ``start`` runs gpumemd the way systemd does with
``FileDescriptorStoreMax=`` set: ``$FDSTORE`` in its environment, and the stored
descriptors moved to 3, 4, ... with ``LISTEN_FDS``, ``LISTEN_FDNAMES`` and
``LISTEN_PID`` naming them. The store outlives each daemon (``FileDescriptorStorePreserve=``),
so ``kill -9`` and ``start`` again is a crash and a restart. The daemon has no other
mechanism: the same code runs under systemd.
"""

from __future__ import annotations

import array
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# Runs in the child before gpumemd, as systemd's exec step does: the descriptors named in
# argv[1] ("fd=name,...") move to 3, 4, ... and LISTEN_* name them for this pid.
_LAUNCH = """
import fcntl, os, sys
pairs = [item.split("=", 1) for item in sys.argv[1].split(",") if item]
high = []
for fd, _ in pairs:
    high.append(fcntl.fcntl(int(fd), fcntl.F_DUPFD, 3 + len(pairs)))
    os.close(int(fd))
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i, inheritable=True)
    os.close(fd)
if pairs:
    os.environ["LISTEN_FDS"] = str(len(pairs))
    os.environ["LISTEN_FDNAMES"] = ":".join(name for _, name in pairs)
    os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[2], sys.argv[2:])
"""

START_TIMEOUT = 60.0


class ServiceManager:
    def __init__(self, runtime_dir: Path, store_max: int = 4096) -> None:
        self.runtime_dir = runtime_dir
        self.store_max = store_max
        self.path = runtime_dir / "notify.sock"
        self.store: list[tuple[str, int]] = []  # (name, fd), in the order stored
        self.refused = 0  # FDSTORE beyond store_max, as systemd refuses them
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # the store's names changed
        self._ready = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.bind(str(self.path))
        self._sock.settimeout(0.1)
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="service-manager", daemon=True)
        self._thread.start()
        self.proc: subprocess.Popen[bytes] | None = None
        # While holding, a BARRIER=1 goes unanswered (its pipe kept open): the daemon is
        # then frozen between storing new descriptors and writing its record, the instant
        # a test kills it at.
        self._holding = False
        self._held: list[int] = []
        self.barrier_held = threading.Event()
        self.log_path = runtime_dir / "gpumemd-restarts.log"
        self._log = open(self.log_path, "ab")
        self.starts = 0

    # ------------------------------------------------------------------ NOTIFY_SOCKET

    def _serve(self) -> None:
        while not self._closing:
            try:
                data, ancillary, _flags, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(253 * 4))
            except TimeoutError:
                continue
            except OSError:
                return
            fds: list[int] = []
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
            self._handle(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line), fds)

    def _handle(self, fields: dict[str, str], fds: list[int]) -> None:
        with self._lock:
            if fields.get("FDSTORE") == "1":
                name = fields.get("FDNAME", "stored")
                for fd in fds:
                    if len(self.store) >= self.store_max:
                        self.refused += 1
                        os.close(fd)
                    else:
                        self.store.append((name, fd))
                self._changed.notify_all()
                return
            if fields.get("FDSTOREREMOVE") == "1":
                name = fields.get("FDNAME", "")
                for _, fd in [e for e in self.store if e[0] == name]:
                    os.close(fd)
                self.store = [e for e in self.store if e[0] != name]
                self._changed.notify_all()
            if fields.get("READY") == "1":
                self._ready.set()
            if fields.get("BARRIER") == "1" and self._holding:
                self._held.extend(fds)
                self.barrier_held.set()
                return
        for fd in fds:  # BARRIER=1's pipe among them: closing it answers the barrier
            os.close(fd)

    def hold_barriers(self) -> None:
        with self._lock:
            self._holding = True
            self.barrier_held.clear()

    def release_barriers(self) -> None:
        with self._lock:
            self._holding = False
            held, self._held = self._held, []
        for fd in held:
            os.close(fd)

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self.store]

    def settled_names(self, expected: list[str], timeout: float = 10.0) -> list[str]:
        """The store's names, sorted, once they are ``expected`` or ``timeout`` passed:
        nothing answers an FDSTOREREMOVE, so this thread may take one a moment after the
        daemon replied to the request that made it send it."""
        with self._changed:
            self._changed.wait_for(lambda: sorted(n for n, _ in self.store) == sorted(expected), timeout)
            return sorted(name for name, _ in self.store)

    # ------------------------------------------------------------------ the service

    def start(self, args: list[str], env: dict[str, str], wait: bool = True, wrap: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        """Start gpumemd (``args`` after the interpreter) with the store passed in;
        ``wrap``: a command it runs under (unshare(1), say), which passes descriptors on."""
        assert self.proc is None or self.proc.poll() is not None, "the last gpumemd still runs"
        with self._lock:
            passed = list(self.store)
        env = dict(env, NOTIFY_SOCKET=str(self.path), FDSTORE=str(self.store_max))
        env.pop("LISTEN_FDS", None)
        spec = ",".join(f"{fd}={name}" for name, fd in passed)
        self._ready.clear()
        self.starts += 1
        self._log.write(f"---- start {self.starts} with {len(passed)} stored descriptors\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            # -S: the launcher needs no site-packages, and what it would spend importing
            # them is in every restart's figure (systemd's exec step costs no Python).
            [*wrap, sys.executable, "-S", "-c", _LAUNCH, spec, sys.executable, "-m", "gpumemd", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, pass_fds=[fd for _, fd in passed],
        )
        if wait:
            self.wait_ready()
        return self.proc

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.02):
            if self.proc.poll() is not None:
                raise AssertionError(f"gpumemd exited with {self.proc.returncode} before READY=1:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"gpumemd sent no READY=1 within {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        """kill -9: nothing of the daemon's runs after it; the store keeps its descriptors."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout)
        return self.proc.returncode

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        self.kill()
        self._closing = True
        self._thread.join(5)
        self._sock.close()
        with self._lock:
            for _, fd in self.store:
                os.close(fd)
            self.store = []
        self._log.close()


class Restartable:
    """gpumemd for one device under a ServiceManager: ``start``, ``kill`` (-9), ``restart``
    (kill and start again), every start with the store the last one left."""

    def __init__(
        self, runtime_dir: Path, backend: str, args: list[str], env: dict[str, str], device: int = 0, wrap: tuple[str, ...] = ()
    ) -> None:
        self.runtime_dir = runtime_dir
        self.wrap = wrap
        self.manager = ServiceManager(runtime_dir)
        self.args = ["--device", str(device), "--backend", backend, "--runtime-dir", str(runtime_dir), *args]
        if backend == "host" and not any(a.startswith("--host-capacity") for a in args):
            self.args += ["--host-capacity", "4GiB"]
        self.env = env

    @property
    def pid(self) -> int:
        assert self.manager.proc is not None
        return self.manager.proc.pid

    def start(self, wait: bool = True) -> Restartable:
        self.manager.start(self.args, self.env, wait, self.wrap)
        return self

    def kill(self) -> None:
        self.manager.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> int:
        return self.manager.stop()

    def log(self) -> str:
        return self.manager.log()

    def close(self) -> None:
        self.manager.close()
