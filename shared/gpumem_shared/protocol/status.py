"""STATUS: everything gpumemctl shows, one view per kind of object the daemon keeps."""

from __future__ import annotations

import msgspec

from gpumem_shared.protocol.base import Extent, Message, RequestMessage, RoundBudget
from gpumem_shared.protocol.codes import Backend, MsgType, RoundPolicy, RoundState
from gpumem_shared.protocol.retain import RetainedStatus


class DaemonStatus(Message):
    version: str
    protocol: str
    pid: int
    backend: Backend
    uptime_s: float
    runtime_dir: str
    state: str  # "serving" | "stopping"
    generation: int = 0  # since 1.4: restarts with the state kept (0: a fresh start)
    waiting: int = 0  # since 1.4: sessions kept across a restart whose client has not resumed yet
    waiting_objects: int = 0  # since 1.4: arenas and graph pools those sessions hold
    grace_left_s: float = 0.0  # since 1.4: until waiting sessions are released like dead clients'
    # since 1.5: what the last start could not rebuild from the fd store (a corrupt newest write, refused descriptors)
    restore_problems: list[str] = msgspec.field(default_factory=list)
    # since 1.8: sleepers' host buffers, and the most they may take (--sleep-host-limit)
    sleep_host_bytes: int = 0
    sleep_host_limit: int = 0
    # since 1.11: how lease handoffs are ordered (--lease-ordering: "ipc-events" or
    # "memops"; "" from an older daemon) and, under memops, the sequence chunk's lanes:
    # how many there are and how many are held or still draining (not free for a new user)
    lease_ordering: str = ""
    lease_lanes: int = 0
    lease_lanes_in_use: int = 0


class DeviceStatus(Message):
    index: int
    uuid: str
    name: str
    total_bytes: int
    free_bytes: int  # measured (cuMemGetInfo) on CUDA; capacity minus accounted on host
    granularity: int
    accounted_bytes: int  # chunks the daemon created that are still held by someone
    reserve_bytes: int  # kept free, never committed


class ClientStatus(Message):
    session_id: int
    name: str
    pid: int  # the kernel's, as the daemon's pid namespace numbers it (0: the client is outside it)
    uid: int
    gid: int
    since: float  # unix time
    arenas: list[str]
    waiting: bool = False  # since 1.4: kept across a restart, its client not back yet
    host_bytes: int = 0  # since 1.8: its arenas' sleep buffers in host memory
    own_pid: int = 0  # since 1.9: its pid as its own pid namespace numbers it (HELLO says it)
    # since 1.11: the capped tenant it counts against, as TenantCapStatus names it ("": none)
    tenant: str = ""


class GrantStatus(Message):
    """One grant on an arena, as status shows it (its token never travels here): a
    session may attach when every field the grant names matches it (-1 and "" name
    nothing), or when it gives the grant's token and every field the share named
    explicitly matches."""

    id: int
    client: str = ""  # the client name it admits ("": any name)
    uid: int = -1  # the uid it admits (-1: any)
    gid: int = -1  # the primary gid it admits (-1: any)
    # ``uid`` is the owner's, implied by a share that named a client alone: a session
    # that gives the token is admitted under any uid.
    uid_implied: bool = False
    read_only: bool = False  # since 1.9: it admits read-only mappings


class ArenaStatus(Message):
    name: str
    owner: str
    owner_pid: int
    owner_alive: bool
    address: int
    reserved: int
    committed: int
    chunks: int
    shared_with: list[str]  # the client names its grants name (1.2's view of them)
    attached: list[str]
    retiring_bytes: int  # decommitted, still mapped by some client
    placeholder_bytes: int = 0  # small chunks the owner aliases over uncommitted space
    grants: list[GrantStatus] = msgspec.field(default_factory=list)
    # Since 1.7: the uid whose name it is (-1: unknown, its owner gone before a restart).
    # Names are per uid: ``name`` is "UID/NAME" when another uid's arena holds the bare name.
    owner_uid: int = -1


class RoundMemberStatus(Message):
    client: str
    pool: str
    reported: bool
    headroom_bytes: int
    graph_pool_bytes: int
    min_tokens: int
    max_tokens: int
    weight: float
    tokens: int  # the result, once committed
    bytes: int


class RoundStatus(Message):
    id: int
    state: RoundState
    expect: int  # pools the round waits for (0: whoever joined)
    policy: RoundPolicy
    deadline_in_s: float  # negative once passed
    members: list[RoundMemberStatus]
    dropped: list[str]
    # The daemon may still build this as a dict with the same keys: it encodes alike,
    # and a peer decoding the reply always gets a RoundBudget.
    budget: RoundBudget
    error: str


class KvPoolStatus(Message):
    name: str
    owner: str
    buffers: int
    bytes_per_token: int
    max_tokens: int  # declared bound
    tokens: int  # committed
    committed_bytes: int
    min_tokens: int
    shrink_request: int  # tokens the daemon asked for; -1 when none
    # The runtime-move policy's figures: its weight, the tokens it wants now (a waiting
    # grow's, else what its engine last said it uses), its fair share in bytes, and the
    # rows in use its engine last reported (-1: never).
    weight: float = 1.0
    demand_tokens: int = 0
    share_bytes: int = 0
    in_use: int = -1


class GraphPoolStatus(Message):
    id: int
    owner: str
    arena: str
    label: str
    epoch: int  # bumped by every capture into the pool and every change of its runs
    extents: list[Extent]  # the pool's segments
    free_runs: list[Extent]  # idle space between replays, largest first
    free_bytes: int
    slot: int = 0  # deprecated since 1.3, always 0: the pool's lease slot is in its own segment
    shared: bool = False  # other processes may take leases on it (and borrow its free runs)
    escaped_by: str = ""  # clients whose borrowed tensors outlived their scope: replays are refused
    # Times gpumemd repaired its lease slot: a word or field no client could rightly have
    # written (a session that may not use the pool, an impossible value). See its log.
    lease_repairs: int = 0


class LeaseStatus(Message):
    pool_id: int
    slot: int  # deprecated since 1.3, always 0 (see GraphPoolStatus.slot)
    kind: str  # capture | replay | borrow
    holder: str  # client name
    pid: int
    label: str
    since: float  # unix time


class SleeperStatus(Message):
    """An arena that sleeps, or keeps a host buffer for its next sleep (since 1.8)."""

    arena: str
    owner: str
    asleep: bool
    committed_bytes: int  # what a wake commits again (while asleep); 0 awake
    kept_bytes: int  # what its owner copied to the host buffer at the sleep
    host_bytes: int  # its host buffer's size (0: none)
    since: float  # unix time it fell asleep (0: awake)


class TenantCapStatus(Message):
    """A tenant's device-memory cap and what it holds (since 1.9; the daemon's memory_caps.py)."""

    tenant: str  # "uid N", "gid N", since 1.11 "token NAME" (the policy's name for a tenant token)
    max_bytes: int  # -1: no maximum
    min_bytes: int  # guaranteed: no other tenant commits it
    used_bytes: int  # may be above max_bytes after the cap was lowered: nothing is taken away
    source: str  # the policy file or DRA claim that set it


class StatusReply(Message):
    daemon: DaemonStatus
    device: DeviceStatus
    clients: list[ClientStatus]
    arenas: list[ArenaStatus]
    # The graph-pool registry under its 1.0 name. Deprecated since 1.2: read
    # ``graph_pools``; ``extents`` (the same list) goes at the next major.
    extents: list[GraphPoolStatus]
    leases: list[LeaseStatus]
    rounds: list[RoundStatus] = msgspec.field(default_factory=list)
    kv: list[KvPoolStatus] = msgspec.field(default_factory=list)
    graph_pools: list[GraphPoolStatus] = msgspec.field(default_factory=list)
    sleepers: list[SleeperStatus] = msgspec.field(default_factory=list)  # since 1.8
    retained: list[RetainedStatus] = msgspec.field(default_factory=list)  # since 1.9: retain groups, orphaned ones included
    tenants: list[TenantCapStatus] = msgspec.field(default_factory=list)  # since 1.9

    def __post_init__(self) -> None:
        # Either name may be the one filled: a 1.1 daemon sends ``extents`` only, a
        # builder may give only one of them. Both always carry the same pools.
        if self.extents and not self.graph_pools:
            self.graph_pools = self.extents
        elif self.graph_pools and not self.extents:
            self.extents = self.graph_pools


class Status(RequestMessage, kw_only=True):
    """Everything gpumemctl shows; needs no session."""

    TYPE = MsgType.STATUS
    REPLY = StatusReply
    NEEDS_SESSION = False
    WHILE_STOPPING = True
