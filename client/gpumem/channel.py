"""The control channel: one ZeroMQ DEALER speaking request/reply to the daemon's ROUTER.

Used with a session's token as routing id (the daemon then knows who is asking), or
anonymously by gpumemctl for read-only requests. Every wait is bounded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumem.errors import DaemonTimeout, error_from_protocol, error_from_reply

T = TypeVar("T")

# While waiting for a reply, wake this often to let the caller check whether the
# daemon is still there (its fd channel) instead of sleeping out the whole timeout.
_SLICE_MS = 250


class ControlChannel:
    def __init__(self, endpoints: Endpoints, routing_id: bytes | None = None) -> None:
        self.endpoints = endpoints
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, _SLICE_MS)
        self._rcvtimeo = _SLICE_MS
        if routing_id is not None:
            self._sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self._sock.connect(endpoints.zmq_url)
        self._ids = itertools.count(1)

    def call(
        self, message: Any, timeout: float, still_alive: Callable[[int], None] | None = None
    ) -> tuple[int, Any]:
        """Send one request; return (request id, typed reply body) or raise the typed error.
        ``still_alive(request_id)`` runs whenever a slice of the wait passes unanswered."""
        request_id = next(self._ids)
        try:
            frame = p.encode_request(request_id, message)
        except p.ProtocolError as exc:
            raise error_from_protocol(exc, "request refused before sending") from None
        self._sock.send(frame, copy=True)
        remaining_ms = max(int(timeout * 1000), 1)
        while True:
            wait = min(remaining_ms, _SLICE_MS)
            if wait != self._rcvtimeo:
                self._sock.setsockopt(zmq.RCVTIMEO, wait)
                self._rcvtimeo = wait
            try:
                # A blocking recv bounded by RCVTIMEO: cheaper than building a poller per call.
                frame = self._sock.recv(copy=True)
            except zmq.Again:
                remaining_ms -= wait
                if still_alive is not None:
                    still_alive(request_id)
                if remaining_ms <= 0:
                    raise DaemonTimeout(self._timeout_message(message, timeout)) from None
                continue
            try:
                reply = p.decode_reply(frame)
            except p.ProtocolError as exc:
                raise error_from_protocol(exc, "reply from gpumemd refused") from None
            if reply.request_id != request_id:
                continue  # the late answer to an earlier call that timed out
            if not reply.ok:
                raise error_from_reply(reply)
            try:
                return request_id, p.decode_body(message.REPLY, reply.body)
            except p.ProtocolError as exc:
                raise error_from_protocol(exc, f"malformed {type(message).__name__} reply from gpumemd") from None

    def _timeout_message(self, message: Any, timeout: float) -> str:
        index = self.endpoints.index
        return (
            f"gpumemd for device {index} did not answer {type(message).__name__} within {timeout:g}s "
            f"(control socket {self.endpoints.zmq_path}); check 'systemctl status gpumemd@{index}' or that "
            f"'gpumemd --device {index}' runs with this runtime directory, and raise the timeout if the "
            "daemon is only busy"
        )

    def close(self) -> None:
        self._sock.close(linger=0)

