"""Per-tenant limits: no one uid takes what every tenant shares.

A tenant is a uid, as the kernel reports it for each session's fd channel (SO_PEERCRED).
What the daemon has a fixed amount of (sessions, its address plan, arenas, graph-pool
slots) is counted per tenant from the books themselves, so nothing here can drift from
them, and a request that would take a tenant past its limit (config.TenantLimits) is
refused with RESOURCE_EXHAUSTED, naming the limit, the tenant and what it holds.

Memory is not limited here: the device's bytes are what KV rounds and commits share by
their own rules (reserve, budgets, and the operator's memory caps: memory_caps.py); what
one tenant could take without committing a byte is what this module bounds. Each
arena's owner (its uid, gid and tenant token) is kept here, for those counts, for the
memory caps and for the arena names (names.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpumem_shared import protocol as p
from gpumem_shared.units import format_size

from gpumemd.config import GiB, TenantLimits
from gpumemd.names import key_uid
from gpumemd.records import ArenaRecord, SessionRecord


def plan_cost(window: int, granularity: int) -> int:
    """What an arena's window takes of the address plan: the window rounded up to the
    plan's alignment, and the guard step after it (WindowPlan.place)."""
    align = max(granularity, GiB)
    return -(-window // align) * align + align


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
        self.groups: dict[str, int] = {}  # and its owner's gid, for caps by group (memory_caps.py)
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
        return key_uid(arena.name, self.owners)

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
