"""systemd readiness and watchdog notifications (sd_notify(3)), without libsystemd."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("gpumemd.notify")


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

    def send(self, *lines: str) -> None:
        if not self._address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall("\n".join(lines).encode())
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._address, exc)
