"""Typed exceptions: one class per daemon error code, plus the client's own failures."""

from __future__ import annotations

from gpumem_shared.protocol import ErrorCode, ProtocolError, Reply


class GpuMemError(Exception):
    """Base of every gpumem error. ``code`` is the daemon's ErrorCode, or None for
    failures the client detected itself (no daemon, timeout, address collision)."""

    code: ErrorCode | None = None

    def __init__(self, message: str, detail: dict[str, int | str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail or {}


class BadMessage(GpuMemError):
    code = ErrorCode.BAD_MESSAGE


class UnknownMessage(GpuMemError):
    code = ErrorCode.UNKNOWN_MESSAGE


class ProtocolMismatch(GpuMemError):
    code = ErrorCode.PROTOCOL_MISMATCH


class InvalidArgument(GpuMemError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


class NoSession(GpuMemError):
    code = ErrorCode.NO_SESSION


class NotFound(GpuMemError, LookupError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(GpuMemError):
    code = ErrorCode.ALREADY_EXISTS


class PermissionDenied(GpuMemError, PermissionError):
    code = ErrorCode.PERMISSION_DENIED


class OutOfMemory(GpuMemError, MemoryError):
    code = ErrorCode.OUT_OF_MEMORY

    @property
    def requested(self) -> int | None:
        value = self.detail.get("requested")
        return value if isinstance(value, int) else None

    @property
    def available(self) -> int | None:
        value = self.detail.get("available")
        return value if isinstance(value, int) else None


class UnexpectedFds(GpuMemError):
    code = ErrorCode.UNEXPECTED_FDS


class ShuttingDown(GpuMemError):
    code = ErrorCode.SHUTTING_DOWN


class DeviceDriverError(GpuMemError):
    code = ErrorCode.DRIVER_ERROR


class InternalError(GpuMemError):
    code = ErrorCode.INTERNAL


class RoundFailed(GpuMemError):
    """A KV commit round failed (its deadline passed, or the budget is short); the
    message and ``detail`` carry the figures."""

    code = ErrorCode.ROUND_FAILED


class LeaseConflict(GpuMemError):
    """The graph pool's lease is held by someone else (named in the message; ``detail``
    has holder, pid, kind and label)."""


class StaleEpoch(GpuMemError):
    """The graph pool was recaptured or retired since this view of it: refresh it."""


class LeaseNotHeld(GpuMemError):
    """Releasing a lease this process does not hold (a double release, or one the daemon
    swept)."""


class BorrowEscaped(GpuMemError):
    """Tensors borrowed from a graph pool's free runs outlived their borrow scope: the
    next replay would overwrite them. Replay and capture of the pool are refused until
    they are freed (the message names the scope and the client)."""


class BorrowOutOfMemory(GpuMemError, MemoryError):
    """No free run of the graph pool can hold the request (after the allocator's
    rounding). Borrowing never falls back to other memory."""


class BorrowStreamMismatch(InvalidArgument):
    """A borrow pool serves the stream its first borrow ran on; this one runs on another."""


class DaemonUnavailable(GpuMemError, ConnectionError):
    """No daemon answers: not running, wrong runtime directory, or no permission."""


class SocketPermissionDenied(DaemonUnavailable, PermissionError):
    """This user may not open the daemon's sockets: the message names the socket and the
    group that owns it, which the user joins to connect."""


class DaemonTimeout(DaemonUnavailable, TimeoutError):
    """The daemon did not answer within the call's timeout."""


class DeviceAmbiguous(DaemonUnavailable):
    """The device was named by a UUID prefix that several daemons' devices share."""


class DaemonStopped(DaemonUnavailable):
    """The daemon stopped (or died). Memory this process mapped stays valid."""


class SessionLost(GpuMemError):
    """The daemon restarted and does not hold this session any more: it came back after
    the grace period (what the session held was released), or without its state. Memory
    this process mapped stays valid; new requests need a new session."""

    code = ErrorCode.SESSION_LOST


class ResourceExhausted(GpuMemError):
    """This uid is at one of the daemon's per-tenant limits (detail: limit, uid, used,
    cap): what one user may hold of the sessions, arenas, address plan or graph-pool
    slots that every user shares, or of device memory (limit "device memory": detail
    tenant, used, cap; or "guaranteed minimums": what other tenants are owed).
    Releasing some makes room; the operator sets them (gpumemd --tenant-*)."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class ArenaAsleep(GpuMemError):
    """The arena sleeps (its chunks went back to the device): wake it first."""

    code = ErrorCode.ARENA_ASLEEP


class HostLimit(GpuMemError, MemoryError):
    """Sleepers' host buffers would pass the daemon's limit (detail: limit, used,
    requested; the message names the largest users). Waking or freeing buffers makes
    room; the operator sets it (gpumemd --sleep-host-limit)."""

    code = ErrorCode.HOST_LIMIT


class GroupHeld(GpuMemError):
    """A retain group another live session holds (detail: holder, holder_pid,
    holder_session): its engine still runs, or another adopter came first."""

    code = ErrorCode.GROUP_HELD


class NotFenced(GpuMemError):
    """A retain group's last holder may still write its memory (detail: pid): its process
    has not exited, or the driver still lists its GPU context. Adoption waits for that."""

    code = ErrorCode.NOT_FENCED


class SessionClosed(GpuMemError):
    """The session was closed by this process."""


class VaCollision(GpuMemError):
    """The arena's planned address window is taken in this process."""


class MappingError(GpuMemError):
    """This process could not map chunks the daemon handed out."""


class ArenaOutOfMemory(GpuMemError, MemoryError):
    """A torch or CuPy allocation routed into an arena found no room (or no backing) there."""


class TorchFeatureMissing(GpuMemError, RuntimeError):
    """The installed torch lacks what a gpumem feature needs (the message says what)."""


_BY_CODE: dict[ErrorCode, type[GpuMemError]] = {
    cls.code: cls
    for cls in (
        BadMessage, UnknownMessage, ProtocolMismatch, InvalidArgument, NoSession, NotFound, AlreadyExists,
        PermissionDenied, OutOfMemory, UnexpectedFds, ShuttingDown, DeviceDriverError, InternalError, RoundFailed,
        SessionLost, ResourceExhausted, ArenaAsleep, HostLimit, GroupHeld, NotFenced,
    )
    if cls.code is not None
}


def error_from_reply(reply: Reply) -> GpuMemError:
    cls = _BY_CODE.get(reply.code, InternalError)
    return cls(reply.message, dict(reply.detail))


def error_from_protocol(exc: ProtocolError, context: str) -> GpuMemError:
    """A reply this client could not accept (bad frame, other protocol major)."""
    cls = _BY_CODE.get(exc.code, BadMessage)
    return cls(f"{context}: {exc.message}", {k: v for k, v in exc.detail.items()})
