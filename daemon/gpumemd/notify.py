"""systemd notifications (sd_notify(3)) without libsystemd: readiness, watchdog,
stopping, and the file-descriptor store (FDSTORE=1, FDSTOREREMOVE=1, BARRIER=1), with
what a start inherits from that store (sd_listen_fds(3): LISTEN_FDS, LISTEN_FDNAMES,
LISTEN_PID)."""

from __future__ import annotations

import array
import logging
import os
import select
import socket
from collections.abc import Mapping, MutableMapping

log = logging.getLogger("gpumemd.notify")

# sd_listen_fds(3): passed descriptors start here.
LISTEN_FDS_START = 3


class StoreError(Exception):
    """The service manager did not take what the daemon stored; the message says what
    to check."""


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        address = environ.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        watchdog_for_us = usec.isdigit() and (not pid or pid == str(os.getpid()))
        # Ping at half the interval, as sd_watchdog_enabled(3) advises.
        self.watchdog_interval: float | None = int(usec) / 2e6 if watchdog_for_us and int(usec) > 0 else None
        # systemd says how many descriptors the unit may store ($FDSTORE, from
        # FileDescriptorStoreMax=); 0 means no store, and nothing is kept across a restart.
        store = environ.get("FDSTORE", "")
        self.store_max = int(store) if store.isdigit() and self._address else 0
        self._sock: socket.socket | None = None

    def send(self, *lines: str) -> None:
        if not self._address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall("\n".join(lines).encode())
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._address, exc)

    # ------------------------------------------------------------------ the fd store

    def _store_socket(self) -> socket.socket:
        # One connected socket for the store's many messages: a socket per message would
        # cost two syscalls more per chunk.
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(self._address)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _send_fds(self, text: str, fds: list[int]) -> None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            self._store_socket().sendmsg([text.encode()], ancillary)
        except OSError as exc:
            raise StoreError(
                f"sd_notify to {self._address} failed: {exc.strerror or exc}; check that the unit sets "
                "FileDescriptorStoreMax= and NotifyAccess=main"
            ) from None

    def store(self, name: str, fd: int) -> None:
        """Keep a dup of ``fd`` in the service manager under ``name``. FDPOLL=0: chunks
        and memfds never hang up, and the manager must not poll device files."""
        self._send_fds(f"FDSTORE=1\nFDNAME={name}\nFDPOLL=0", [fd])

    def unstore(self, name: str) -> None:
        self._send_fds(f"FDSTOREREMOVE=1\nFDNAME={name}", [])

    def barrier(self, timeout: float) -> None:
        """Return once the manager has processed every message sent before (BARRIER=1: it
        closes the pipe end it is sent once it gets there)."""
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            try:
                self._send_fds("BARRIER=1", [w])
            finally:
                os.close(w)
            if not select.select([r], [], [], timeout)[0]:
                raise StoreError(
                    f"the service manager at {self._address} did not confirm the fd store within {timeout:g}s; "
                    "check that it runs and that the unit sets FileDescriptorStoreMax="
                )
        finally:
            os.close(r)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def inherited_fds(environ: MutableMapping[str, str]) -> dict[str, list[int]]:
    """The descriptors the service manager passed to this process, by name, as
    sd_listen_fds_with_names(3) reads them; the variables are removed (children must not
    take them for theirs). Empty when LISTEN_PID names another process."""
    count, names, pid = environ.pop("LISTEN_FDS", ""), environ.pop("LISTEN_FDNAMES", ""), environ.pop("LISTEN_PID", "")
    if not count.isdigit() or pid != str(os.getpid()):
        if count:
            log.warning("LISTEN_FDS=%s is for pid %s, not this process (%d): ignored", count, pid or "(unset)", os.getpid())
        return {}
    fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)))
    labels = names.split(":") if names else []
    labels += ["unknown"] * (len(fds) - len(labels))
    out: dict[str, list[int]] = {}
    for fd, label in zip(fds, labels):
        os.set_inheritable(fd, False)
        out.setdefault(label, []).append(fd)
    return out
