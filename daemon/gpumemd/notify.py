"""systemd notifications (sd_notify(3)) without libsystemd: readiness, watchdog,
stopping, and the file-descriptor store (FDSTORE=1, FDSTOREREMOVE=1, BARRIER=1), with
what a start inherits from that store (sd_listen_fds(3): LISTEN_FDS, LISTEN_FDNAMES,
LISTEN_PID)."""

from __future__ import annotations

import array
import logging
import os
import resource
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


class PassedFdsError(Exception):
    """LISTEN_FDS names descriptors this process was not passed; the message is one line."""


def inherited_fds(environ: MutableMapping[str, str]) -> dict[str, list[int]]:
    """The descriptors the service manager passed to this process, by name, as
    sd_listen_fds_with_names(3) reads them; the variables are removed (children must not
    take them for theirs). Called before the daemon opens any descriptor of its own.

    LISTEN_PID naming another process: the variables are not for this one (a wrapper
    that forked instead of exec'ing), and nothing is adopted, as sd_listen_fds(3) says.
    Unlike sd_listen_fds, the descriptors in LISTEN_FDS' range that are open are closed:
    whatever holds them (chunks of GPU memory) would otherwise stay allocated for the
    daemon's life with nobody to use it, and closing them takes nothing from the process
    that passed them, which keeps its own. Nothing of the daemon's is open yet to be
    closed by mistake. PassedFdsError: LISTEN_FDS counts descriptors that are not open."""
    count, names, pid = environ.pop("LISTEN_FDS", ""), environ.pop("LISTEN_FDNAMES", ""), environ.pop("LISTEN_PID", "")
    if not count:
        return {}
    if not count.isdigit():
        raise PassedFdsError(f"LISTEN_FDS={count[:32]!r} is not a number of descriptors")
    if pid != str(os.getpid()):
        end = min(LISTEN_FDS_START + int(count), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        closed = [fd for fd in range(LISTEN_FDS_START, end) if _close_if_open(fd)]
        log.warning(
            "LISTEN_FDS=%s is for pid %s, not this process (%d): not adopted; %d of them open here, closed",
            count, pid or "(unset)", os.getpid(), len(closed),
        )
        return {}
    fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)))
    for fd in fds:  # the first one missing ends the check: LISTEN_FDS may be absurdly large
        try:
            os.set_inheritable(fd, False)
        except OSError:
            raise PassedFdsError(
                f"LISTEN_FDS={count} but descriptor {fd} was not passed (not open); check what starts gpumemd "
                "(systemd sets LISTEN_FDS itself)"
            ) from None
    labels = names.split(":") if names else []
    labels += ["unknown"] * (len(fds) - len(labels))
    out: dict[str, list[int]] = {}
    for fd, label in zip(fds, labels):
        out.setdefault(label, []).append(fd)
    return out


def _close_if_open(fd: int) -> bool:
    try:
        os.close(fd)
    except OSError:
        return False
    return True
