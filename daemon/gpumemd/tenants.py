"""Per-tenant limits: no one uid takes what every tenant shares.

A tenant is a uid, as the kernel reports it for each session's fd channel (SO_PEERCRED).
What the daemon has a fixed amount of (sessions, its address plan, arenas, graph-pool
slots) is counted per tenant from the books themselves, so nothing here can drift from
them, and a request that would take a tenant past its limit (config.TenantLimits) is
refused with RESOURCE_EXHAUSTED, naming the limit, the tenant and what it holds.

Memory is not limited here: the device's bytes are what KV rounds and commits share by
their own rules (reserve, budgets); what one tenant could take without committing a
byte is what this module bounds.

Names: each uid has its own arena names (KV pools are arenas), so no tenant can take a
name another tenant's engine needs. Inside the daemon an arena is known by its key: its
name, or "UID/NAME" when another uid's arena holds the bare name already ("/" is in no
name). A client says a name of its own uid, or "UID/NAME" for another uid's arena (its
grants still decide the attach); replies carry the key, which the client says from
then on (``Tenants.resolve``).

Service: control requests wait in one queue per peer (``FairQueue``), served one peer
at a time in turn, so a peer that floods (however many connections it opens) waits
behind itself rather than putting every other session behind its backlog.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping

from gpumem_shared import protocol as p
from gpumem_shared.units import format_size

from gpumemd.checks import check_name
from gpumemd.config import GiB, MiB, TenantLimits
from gpumemd.records import ArenaRecord, SessionRecord


def plan_cost(window: int, granularity: int) -> int:
    """What an arena's window takes of the address plan: the window rounded up to the
    plan's alignment, and the guard step after it (arenas._plan_window)."""
    align = max(granularity, GiB)
    return -(-window // align) * align + align


# A uid is at most ten digits; the name after it is checked as any name is.
_QUALIFIED = re.compile(r"([0-9]{1,10})/(.*)", re.ASCII | re.DOTALL)


def plain_name(key: str) -> str:
    """The name an arena's key holds, without the owner's uid."""
    qualified = _QUALIFIED.fullmatch(key)
    return key if qualified is None else qualified[2]


def _refuse(limit: str, uid: int, detail: str, used: int, cap: int) -> p.ProtocolError:
    return p.ProtocolError(
        p.ErrorCode.RESOURCE_EXHAUSTED,
        f"uid {uid} is at its limit of {limit}: {detail}; release some first, or ask the operator to raise the limit",
        limit=limit,
        uid=uid,
        used=used,
        cap=cap,
    )


class Tenants:
    def __init__(self, limits: TenantLimits, sessions: dict[int, SessionRecord]) -> None:
        self.limits = limits
        self.sessions = sessions
        # Each arena's tenant, by name: it counts against its owner's uid while sharers
        # keep it after the owner's session ended. Not in the durable record (its arena
        # images stay as they were): after a restart, known from the owners' sessions.
        self.owners: dict[str, int] = {}
        self.groups: dict[str, int] = {}  # and its owner's gid, for caps by group (caps.py)
        self.tokens: dict[str, bytes] = {}  # and its owner's tenant token digest, where it presented one

    def own(self, key: str, s: SessionRecord) -> None:
        """The arena ``key`` counts against ``s``'s tenant from now on."""
        self.owners[key], self.groups[key] = s.uid, s.gid
        if s.tenant_key:
            self.tokens[key] = s.tenant_key
        else:
            self.tokens.pop(key, None)

    def forget(self, key: str) -> None:
        self.owners.pop(key, None)
        self.groups.pop(key, None)
        self.tokens.pop(key, None)

    def adopt(self, arena: ArenaRecord) -> None:
        """An arena rebuilt after a restart: its tenant, if its owner's session came back too."""
        owner = self.sessions.get(arena.owner_id)
        if owner is not None:
            self.own(arena.name, owner)

    def owner_uid(self, arena: ArenaRecord) -> int:
        """The uid ``arena`` counts against; -1 where no session tells it any more."""
        return self._uid_of(arena.name)

    def _uid_of(self, key: str) -> int:
        qualified = _QUALIFIED.fullmatch(key)
        return self.owners.get(key, -1 if qualified is None else int(qualified[1]))  # a key "UID/NAME" says it too

    def resolve(self, s: SessionRecord, name: str, arenas: Mapping[str, ArenaRecord], *, create: str = "") -> str:
        """The key of the arena ``s`` means by ``name`` (a name it has no arena of: the
        name itself, which the book then finds nothing under); for a create (``create``
        says what the name is called in a refusal), the key the new arena gets. Another
        uid's arena is never reached by its bare name: a process that asks for its own
        uid's ``kv`` before it exists must not be handed another user's."""
        if not create:
            named = arenas.get(name)
            if named is not None and s.id in named.attached:
                return name  # the key the daemon gave this session
        qualified = _QUALIFIED.fullmatch(name)
        uid, plain = (int(qualified[1]), qualified[2]) if qualified else (s.uid, name)
        if create:
            check_name(plain, create)
            if uid != s.uid:
                raise p.ProtocolError(
                    p.ErrorCode.PERMISSION_DENIED,
                    f"arena name '{name}' is one of uid {uid}'s; uid {s.uid} creates arenas under its own names",
                    uid=s.uid,
                )
        for key in (plain, f"{uid}/{plain}"):
            if key in arenas and self._uid_of(key) == uid:
                return key
        if create:
            return plain if plain not in arenas else f"{uid}/{plain}"
        if qualified is None and plain in arenas:
            holder = self._uid_of(plain)
            whose = f"uid {holder}, as '{holder}/{plain}'" if holder >= 0 else "a uid no session names since a restart"
            raise p.ProtocolError(
                p.ErrorCode.NOT_FOUND,
                f"uid {s.uid} has no arena named '{plain}'; the one of that name belongs to {whose}: another uid's arena "
                "is named with its owner's uid, and attached through a grant of its owner's",
                arena=plain,
                owner_uid=holder,
            )
        return name

    def check_session(self, uid: int) -> None:
        used = sum(1 for s in self.sessions.values() if s.uid == uid)
        if used >= self.limits.sessions:
            raise _refuse("sessions", uid, f"{used} live sessions of {self.limits.sessions} (--tenant-sessions)", used, self.limits.sessions)

    def check_arena(self, s: SessionRecord, arenas: Iterable[ArenaRecord], window: int, granularity: int, plan: int) -> None:
        """Before ``s`` creates an arena of ``window`` bytes (scratch included) in a plan of ``plan`` bytes."""
        owned = [a for a in arenas if self.owners.get(a.name) == s.uid]
        if len(owned) >= self.limits.arenas:
            raise _refuse("arenas", s.uid, f"owns {len(owned)} arenas of {self.limits.arenas} (--tenant-arenas)", len(owned), self.limits.arenas)
        if self.limits.address_share >= 1:
            return  # the whole plan: its own first fit says when it is full (OUT_OF_MEMORY)
        cap = int(plan * self.limits.address_share)
        used = sum(plan_cost(a.window, granularity) for a in owned)
        need = plan_cost(window, granularity)
        if used + need > cap:
            raise _refuse(
                "address space",
                s.uid,
                f"its arenas' windows take {format_size(used)} of the address plan, and {format_size(need)} more would pass its "
                f"share of {format_size(cap)} ({self.limits.address_share:g} of {format_size(plan)}, --tenant-address-share)",
                used,
                cap,
            )

    def check_graph_pool(self, s: SessionRecord, owners: Iterable[int], slots: int) -> None:
        """Before ``s`` registers a graph pool; ``owners``: the session of every pool kept."""
        cap = max(1, int(slots * self.limits.graph_pool_share))
        used = 0
        for owner in owners:
            session = self.sessions.get(owner)
            if session is not None and session.uid == s.uid:
                used += 1
        if used >= cap:
            raise _refuse(
                "graph pools", s.uid,
                f"its sessions keep {used} graph pools of its share of {cap} ({self.limits.graph_pool_share:g} of the daemon's "
                f"{slots}, --tenant-graph-pool-share)",
                used, cap,
            )


# Anonymous control peers (gpumemctl, pings) share one queue: a connection costs nothing
# to open, so they are served as one peer, however many there are.
ANONYMOUS = 0
# Read ahead of service: enough for every anonymous peer a few requests deep, and bytes
# for a thousand average requests many times over (a frame may be 2 MiB; real ones are
# hundreds of bytes).
ANONYMOUS_QUEUED = 1024
QUEUED_BYTES = 64 * MiB


class FairQueue:
    """Control requests read, not yet served: a FIFO per peer (a session id, or
    ANONYMOUS), and the ring of peers with requests waiting. ``pop`` takes the next
    peer's oldest request, so each peer's requests keep their order and one peer's
    backlog delays another by one request per turn at most."""

    def __init__(self, per_session: int) -> None:
        self.per_session = per_session
        self._queues: dict[int, deque[tuple[bytes, bytes]]] = {}
        # The peers with requests waiting, in turn: empty while nothing is queued (the
        # server's loop asks on every turn, so it asks the deque, not a method).
        self.peers: deque[int] = deque()
        self._bytes = 0

    def push(self, peer: int, identity: bytes, frame: bytes) -> p.ProtocolError | None:
        """Queue ``frame`` from ``peer``, or the refusal to answer it with at once."""
        queue = self._queues.get(peer)
        held = 0 if queue is None else len(queue)
        cap = ANONYMOUS_QUEUED if peer == ANONYMOUS else self.per_session
        if held >= cap:
            who = "anonymous control peers" if peer == ANONYMOUS else f"session {peer}"
            flag = "" if peer == ANONYMOUS else " (--tenant-requests)"
            return p.ProtocolError(
                p.ErrorCode.RESOURCE_EXHAUSTED,
                f"{who} already have {held} requests waiting for the daemon, the limit{flag}; wait for their replies",
                limit="requests",
                used=held,
                cap=cap,
            )
        if self._bytes + len(frame) > QUEUED_BYTES:
            return p.ProtocolError(
                p.ErrorCode.RESOURCE_EXHAUSTED,
                f"the daemon holds {format_size(self._bytes)} of requests waiting, its limit; send again once they are served",
                limit="request bytes",
                used=self._bytes,
                cap=QUEUED_BYTES,
            )
        if queue is None:
            queue = self._queues[peer] = deque()
            self.peers.append(peer)
        queue.append((identity, frame))
        self._bytes += len(frame)
        return None

    def pop(self) -> tuple[bytes, bytes]:
        peer = self.peers.popleft()
        queue = self._queues[peer]
        identity, frame = queue.popleft()
        self._bytes -= len(frame)
        if queue:
            self.peers.append(peer)
        else:
            del self._queues[peer]
        return identity, frame
