"""What the daemon is configured with.

The bottom of the daemon's import graph: no other gpumemd module is imported here.
"""

from __future__ import annotations

import dataclasses
import os

from gpumem_shared import protocol as p
from gpumem_shared.address_plan import VA_PLAN_BASE, VA_PLAN_SLICE
from gpumem_shared.lease_order import LeaseOrdering

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    """What one tenant (a uid: the kernel names it for every fd channel, SO_PEERCRED) may
    take of what every tenant shares and the daemon has a fixed amount of. The defaults
    leave a lone tenant room for any real engine (a few sessions, tens of arenas and
    graph pools, windows of a few GiB to a few hundred) and any other tenant at least
    half of each, so no one uid can lock the rest out. tenants.py applies them."""

    sessions: int = 256  # live sessions of one uid
    arenas: int = 512  # arenas (KV pools' included) one uid owns
    # Shares of what is fixed at start: the address plan (every arena's window, its
    # placeholder scratch and guard step), and the graph-pool slots (MAX_POOLS).
    address_share: float = 0.5
    graph_pool_share: float = 0.5
    # Control requests of one session read and waiting to be served: a client has one
    # call out at a time, and one report per KV pool it is in a round of.
    requests: int = 64
    # Share of --sleep-host-limit one uid's sleep host buffers may take (sleepers.py).
    sleep_host_share: float = 0.5


def default_sleep_host_limit() -> int:
    """Half the machine's memory: sleepers' host buffers are real pages, and the engines
    and the rest of the machine need the other half."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


@dataclasses.dataclass
class StateConfig:
    index: int
    runtime_dir: str = ""
    bulk_chunk: int = 512 * MiB  # bulk commits come in chunks this large
    # KV prefixes: one chunk per this much of each buffer. Larger makes rounds faster
    # (fewer creates, exports and maps) and shrinks coarser (whole chunks only).
    kv_chunk: int = GiB
    reserve_bytes: int = 0  # never committed: the headroom other users of the device need
    # The most the daemon commits in all (0: the device's free memory is the only bound):
    # a bench emulates a smaller GPU with it, where KV pressure is real on a large one.
    capacity_bytes: int = 0
    # The address slice the daemon reserves at start and plans arena windows in: the
    # device's slice of the shared plan (gpumem_shared.address_plan) outside tests.
    va_base: int = VA_PLAN_BASE
    va_limit: int = VA_PLAN_BASE + VA_PLAN_SLICE
    max_reserve: int = VA_PLAN_SLICE
    round_timeout: float = 300.0  # seconds from a round's first join to its deadline
    round_policy: p.RoundPolicy = p.RoundPolicy.PARTIAL  # what a round's passed deadline does
    # Seconds a KV grow that other pools must give back for waits for their shrinks before
    # it is answered with what could be got (and who did not answer).
    move_timeout: float = 2.0
    # After a restart with the state kept: how long sessions wait for their clients to
    # resume before what they hold is released like a dead client's.
    restart_grace: float = 30.0
    # How long a retain group's objects stay orphaned (kept, accounted) for an adopter
    # after their holder's session ended without releasing them.
    retain_grace: float = 60.0
    tenants: TenantLimits = dataclasses.field(default_factory=TenantLimits)
    # Device-memory caps per tenant (memory_caps.py): the policy file and the DRA claims
    # directory, read at start and again on SIGHUP; neither: no caps.
    tenant_policy: str = ""
    tenant_claims: str = ""
    # How a handoff on a shared graph pool orders GPU work (lease_order.py): IPC events
    # until the H200 measures memops, which needs no shared IPC namespace.
    lease_ordering: LeaseOrdering = LeaseOrdering.IPC_EVENTS
    # The most host memory sleepers' buffers may take in all (sleepers.py).
    sleep_host_limit: int = dataclasses.field(default_factory=default_sleep_host_limit)
