"""A client's session with the daemon of one GPU: the public facade.

``connect()`` finds the device's daemon and opens a session: its core (gpumem.core)
holds the channel (gpumem.channel: the fd channel says HELLO and stays open for the
session's life, and the ZeroMQ DEALER carries every request under the session's token),
the driver that maps chunks, the daemon's address slice, the session's side of the
leases on graph pools (gpumem.leases), and the registries of its arenas and borrow
pools. ``Session`` is what engines call; the arenas, pools and borrows it hands out
hold the core.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpumem_shared.lease_table import LeaseKind
from gpumem_shared import protocol as p
from gpumem_shared.paths import Endpoints
from gpumem.address_slices import AddressSlice
from gpumem.arena import Arena
from gpumem.borrow import Borrow
from gpumem.core import SessionCore
from gpumem.discovery import resolve_device
from gpumem.errors import AlreadyExists, InvalidArgument
from gpumem.graph_pools import GraphPool
from gpumem.handoffs import LeasePool
from gpumem.kv_pool import KvPool
from gpumem.leases import Lease
from gpumem.paged_kv import PagedKvCache
from gpumem.prefix_directory import PrefixDirectory
from gpumem.retain import Adopted, RetainGroup, adopt
from gpumem.standby import Reservation

DEFAULT_TIMEOUT = 10.0
# replay() runs on every step: a module global, because before Python 3.12 reading an enum
# member off its class costs about 60 ns (EnumType.__getattr__).
_REPLAY = LeaseKind.REPLAY


def connect(
    device: int | str = 0,
    name: str | None = None,
    *,
    runtime_dir: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    peers: Sequence[int] = (),
    tenant_token: str | None = None,
    tenant_token_file: str | os.PathLike[str] | None = None,
) -> Session:
    """Open a session with the daemon of ``device``: this process's CUDA ordinal
    (matched to its daemon by UUID, so CUDA_VISIBLE_DEVICES remapping is honoured), or a
    UUID or unique prefix of one, such as "GPU-8932f937".

    ``name`` identifies this client in ``gpumemctl status`` and in arena shares; no two
    live sessions of a daemon hold one name (``AlreadyExists`` names the holder). The
    default is the program name and pid, with a counter from the second session of the
    process on; a default that another process holds already (a pid namespace of its
    own) moves on to the next count. ``runtime_dir`` defaults to
    $GPUMEMD_RUNTIME_DIR, /run/gpumemd for root, else $XDG_RUNTIME_DIR/gpumemd.
    ``timeout`` bounds every call of this session unless a call gives its own.
    ``peers``: this process's CUDA ordinals of other GPUs whose kernels must reach the
    memory this session maps (peer access; refused where the hardware has no path).
    ``tenant_token``, or ``tenant_token_file`` (a file holding it, such as the one a DRA
    claim's directory gives the pod; read now, surrounding whitespace dropped): the secret
    that makes this session count against that token's tenant in the daemon's caps
    rather than its uid's (docs/architecture.md, "Tenant caps"). A token the daemon's
    policy does not name is refused (``PermissionDenied``).
    """
    token = _tenant_token(tenant_token, tenant_token_file)
    endpoints = resolve_device(device, runtime_dir)
    if name:
        return Session(endpoints, name, timeout, peers, tenant_token=token)
    for _ in range(_DEFAULT_NAME_TRIES - 1):
        try:
            return Session(endpoints, _default_name(), timeout, peers, tenant_token=token)
        except AlreadyExists:
            continue  # another process holds it (another pid namespace, or its own choice)
    return Session(endpoints, _default_name(), timeout, peers, tenant_token=token)


def _tenant_token(token: str | None, path: str | os.PathLike[str] | None) -> str:
    """The token connect() presents ("": none). No message here quotes it."""
    if token is not None and path is not None:
        raise InvalidArgument("give connect() a tenant_token or a tenant_token_file, not both")
    if path is not None:
        try:
            token = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "it is not text"
            raise InvalidArgument(f"cannot read the tenant token file {os.fspath(path)}: {why}") from None
        if not token:
            raise InvalidArgument(f"the tenant token file {os.fspath(path)} is empty")
    if token is None:
        return ""
    if not token or len(token) > p.MAX_TENANT_TOKEN or not token.isprintable():
        raise InvalidArgument(f"a tenant token is 1 to {p.MAX_TENANT_TOKEN} printable characters")
    return token


# A default name held elsewhere is tried again with the next count, this many times.
_DEFAULT_NAME_TRIES = 16
# Default names handed out, per process id: a forked child counts from 1 under its own
# pid. itertools.count and dict.setdefault need no lock, so a fork cannot inherit one held.
_default_counts: dict[int, itertools.count[int]] = {}


def _default_name() -> str:
    program = re.sub(r"[^A-Za-z0-9._-]", "", Path(sys.argv[0] if sys.argv else "").stem)[:96]
    if not program[:1].isalnum():
        program = "client" + program
    pid = os.getpid()
    n = next(_default_counts.setdefault(pid, itertools.count(1)))
    return f"{program}-{pid}" if n == 1 else f"{program}-{pid}-{n}"


class Session:
    """The public facade over a session's core (gpumem.core): what engines call. The
    objects it hands out hold the core, not the session."""

    def __init__(
        self, endpoints: Endpoints, name: str, timeout: float, peers: Sequence[int] = (), *, tenant_token: str = ""
    ) -> None:
        self.core = core = SessionCore.open(endpoints, name, timeout, peers, tenant_token)
        self.endpoints = endpoints
        self.peers = list(peers)
        self.name = name
        self.timeout = timeout
        self.channel = core.channel
        self.driver = core.driver
        # Read-only: arenas and borrow pools come and go through the core's methods.
        self.arenas = core.arenas
        self.borrow_pools = core.borrow_pools
        self.session_id = core.session_id
        self.backend = core.backend
        self.device = core.device
        self.daemon_version = core.channel.hello.daemon_version
        self.daemon_pid = core.daemon_pid
        self.device_ordinal = core.device_ordinal
        # A plain attribute: replay() reads it on every step.
        self.leasing = core.leasing

    def address_slice(self) -> AddressSlice:
        """The daemon's address slice in this process, where its arenas are mapped
        (``SessionCore.address_slice``)."""
        return self.core.address_slice()

    # ------------------------------------------------------------------ calls

    def call(self, message: p.RequestMessage, timeout: float | None = None) -> Any:
        """One request; returns the typed reply body (``SessionCore.call``)."""
        return self.core.call(message, timeout)

    # ------------------------------------------------------------------ API

    def ping(self, timeout: float | None = None) -> None:
        self.channel.call(p.Ping(), timeout)

    def status(self, timeout: float | None = None) -> p.StatusReply:
        body: p.StatusReply = self.channel.call(p.Status(), timeout)[0]
        return body

    def notices(self, kind: str | None = None, arena: str | None = None) -> list[p.Notice]:
        """Take the notices received so far (daemon stopping, arenas changed by their
        owner, KV shrink requests), optionally only those of one kind and arena."""
        return self.channel.notices(kind, arena)

    def create_arena(self, name: str, reserve_bytes: int) -> Arena:
        """Reserve ``reserve_bytes`` of address space (a multiple of the device
        granularity) under ``name``; nothing is committed until ``Arena.commit``."""
        return Arena.create(self.core, name, reserve_bytes)

    def attach_arena(self, name: str, token: str | None = None) -> Arena:
        """Map an arena another client owns, where one of its grants admits this session:
        by its identity (client name, uid, gid), or by ``token``, the one the owner's
        ``share`` returned and handed over. Refused with ``PermissionDenied`` saying why.
        Names are per uid: another user's arena is named with its owner's uid,
        ``"1000/kv"``; a bare name is this process's uid's. The arena's ``name`` is the
        one the daemon answered with (docs/protocol.md, "Arena names")."""
        return Arena.attach(self.core, name, token or "")

    def open_graph_pool(self, pool_id: int = 0, *, owner: str = "", label: str = "") -> GraphPool:
        """Another client's shared graph pool (by id, or by owner and label), to take
        leases on and borrow from. Its arena must be attached in this session first. The
        daemon grants the pool's lease segment with it."""
        return GraphPool.open(self.core, pool_id, owner=owner, label=label)

    def capture(self, pool: LeasePool, *, wait: float = 0.0, label: str = "capture", stream: int | None = None) -> Lease:
        """The capture lease on a graph pool: excludes every other lease, retires this
        process's borrow pool on it and, for the pool's owner, empties its registered runs
        under a new epoch (capture re-carves them: no borrower may use the old ones once
        the lease is given back). ``refresh(recaptured=True)`` after the capture reports the
        new runs. ``wait`` bounds how long to wait for a holder (0: fail at once)."""
        lease = Lease.acquire(self.leasing, pool, LeaseKind.CAPTURE, label, wait, stream)
        try:
            borrowed = self.borrow_pools.get(pool.id)
            if borrowed is not None:
                borrowed.retire()
            if isinstance(pool, GraphPool) and pool.arena.is_owner:
                pool.begin_capture()
        except BaseException:
            lease.release()
            raise
        return lease

    def replay(self, pool: LeasePool, *, wait: float = 0.0, label: str = "replay", stream: int | None = None) -> Lease:
        """The replay lease: excludes capture and borrow (and other replays)."""
        return Lease.acquire(self.leasing, pool, _REPLAY, label, wait, stream)

    def borrow(self, pool: GraphPool, *, user: str, wait: float = 0.0, stream: int | None = None) -> Borrow:
        """Borrow the pool's free runs for ``user`` (named to anyone who conflicts): holds
        the borrow lease (excludes capture and replay) and routes this thread's torch
        allocations into the runs until the borrow ends. See gpumem.borrow."""
        return Borrow(self.core, pool, user, wait, stream)

    def declare_kv_pool(
        self, name: str, buffers: list[p.KvBuffer], *, max_tokens: int = 0, reserve_bytes: int = 0
    ) -> KvPool:
        """Declare a KV pool: ``buffers`` (name, bytes per token row, alignment) laid out
        in one arena, each with room for ``max_tokens`` rows (or as many as
        ``reserve_bytes`` holds). Virtual only until a commit round or ``grow``."""
        return KvPool.declare(self.core, name, buffers, max_tokens=max_tokens, reserve_bytes=reserve_bytes)

    def declare_paged_kv(
        self,
        name: str,
        *,
        layers: int,
        block_shape: tuple[int, ...],
        itemsize: int,
        combined: bool = False,
        max_blocks: int = 0,
        expect: int = 0,
    ) -> PagedKvCache:
        """A paged KV cache of ``layers`` layers whose rows are blocks of ``block_shape``
        elements of ``itemsize`` bytes: K and V buffers per layer (or one combined),
        ``max_blocks`` of them (default: what the device could hold), virtual with the
        placeholder under them, the round joined (``expect``: the pools it gathers, as
        in ``KvPool.join_round``). See gpumem.paged_kv."""
        return PagedKvCache.declare(
            self.core, name, layers=layers, block_shape=block_shape, itemsize=itemsize, combined=combined,
            max_blocks=max_blocks, expect=expect,
        )

    def retain_group(self, name: str) -> RetainGroup:
        """Open retain group ``name``, held by this session: what it marks retained
        (``RetainGroup.retain``) outlives this session's abnormal end, for a process of
        this uid that gives ``secret`` to adopt (see gpumem.retain)."""
        return RetainGroup.open(self.core, name)

    def adopt(self, group: str, secret: str, *, wait: float = 0.0, confirm: bool = True, reservation: Reservation | None = None) -> Adopted:
        """Take over the retained arenas and KV pools of ``group``, whose holder ended,
        mapped at their addresses (``gpumem.retain.adopt``: ``wait`` bounds the wait for
        the holder's end and its fence; ``reservation``, from ``reserve_retained``: the
        adopted chunks replace its placeholder, and it is closed once they did; kept where the
        adoption fails, to try again; this session's reservation of ``group`` by default)."""
        # The process's own reservation of the group, if any: its windows are not free here otherwise.
        reservation = reservation or Reservation.held(self.core, group)
        adopted = adopt(self.core, group, secret, wait=wait, confirm=confirm, reservation=reservation)
        if reservation is not None:
            reservation.close()
        return adopted

    def reserve_retained(self, group: str, secret: str) -> Reservation:
        """Back the windows of retain group ``group``'s objects with this process's
        placeholder, for a standby to build tensors and capture graphs at the addresses
        it adopts later (gpumem.standby). No byte of the group's memory is mapped."""
        return Reservation.open(self.core, group, secret)

    def create_prefix_directory(self, name: str, *, blocks: int) -> PrefixDirectory:
        """A prefix directory for ``blocks`` KV blocks in a new arena ``name``, to retain
        with the pool (see gpumem.prefix_directory)."""
        return PrefixDirectory.create(self.core, name, blocks=blocks)

    def close(self) -> None:
        """Release this session's arenas (unmapping them) and close both channels."""
        self.core.close()

    @property
    def closed(self) -> bool:
        return self.core.closed

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpumem.Session '{self.name}' device {self.device.index} ({self.backend}) id {self.session_id}>"


