"""The daemon's records: sessions, arenas, chunks, graph pools, KV pools and rounds.

Plain data owned by the daemon's one thread, with the derived figures more than one
book reads. The books (arenas.py, graph_pools.py, kv_pools.py) keep them; what a
request changes across books is the dispatcher's (state.py). Names end in ``Record``:
the client library has its own Session, Arena and GraphPool.
"""

from __future__ import annotations

import dataclasses
import math

from gpumem_shared import protocol as p
from gpumem_shared.driver.base import Handle
from gpumem_shared.lease_table import LeaseSegment

from gpumemd.config import MiB

# Beyond each arena's client-visible window the daemon plans this much more of its slice,
# to map (and scrub) the arena's placeholder chunks, which have no place of their own in
# the window. Clients never map there.
PLACEHOLDER_SCRATCH = 512 * MiB

# (session id, notice) pairs for the server to deliver.
Notices = list[tuple[int, p.Notice]]


ANSWERS_KEPT = 8


@dataclasses.dataclass
class Answer:
    """A reply as the record keeps it."""

    reply: bytes = dataclasses.field(repr=False)
    handout: list[int]  # chunk ids
    grants: list[int]  # graph pool ids
    host_buffers: list[int] = dataclasses.field(default_factory=list)  # host buffer ids (a SLEEP_BUFFER's answer)


@dataclasses.dataclass(eq=False)
class SessionRecord:
    id: int
    name: str
    # The kernel's (SO_PEERCRED), as the daemon's pid namespace numbers it: 0 for a client
    # outside it, and the host's number for one in a namespace below. Nothing rests on
    # it: the session lives as long as its fd channel, and is the uid and gid that opened it.
    pid: int
    uid: int
    gid: int
    since: float  # unix time
    token: bytes  # its ZeroMQ routing id
    # Its pid as its own namespace numbers it (HELLO says it; before 1.9, the kernel's):
    # what its lease words carry, and what its users know it by.
    own_pid: int = 0
    # What RESUME proves the session with after a restart (empty: no fd store, no resume).
    credential: bytes = dataclasses.field(default=b"", repr=False)
    # The SHA-256 of the tenant token it presented at HELLO (memory_caps.py; b"": none).
    # Never the token: the daemon keeps nothing a client could present again.
    tenant_key: bytes = dataclasses.field(default=b"", repr=False)
    waiting: bool = False  # kept across a restart; its client has not resumed yet
    # The last replies sent (or due) to this session, by request id, oldest first: a
    # request resent after a restart under its id gets its reply again instead of running
    # twice (its chunks and lease segments handed out anew where the client lacks them).
    # A client has one call out at a time besides its deferred requests (a round's report
    # per KV pool), so the last few cover whatever a crash can leave unanswered.
    answers: dict[int, Answer] = dataclasses.field(default_factory=dict, repr=False)
    # The requests the resumed client said it sends again: those with a remembered answer
    # get it again, whether it was given before the restart or between the resume and the
    # resend (the new DEALER may not have been connected to take it).
    resending: set[int] = dataclasses.field(default_factory=set)

    @property
    def pids(self) -> str:
        """Its pid for a message: its own, and the kernel's where that one differs and is known."""
        if self.pid in (0, self.own_pid):
            return f"pid {self.own_pid}"
        return f"pid {self.own_pid} ({self.pid} in gpumemd's pid namespace)"

    def remember(
        self, request_id: int, reply: bytes, handout: list[ChunkRecord], grants: list[tuple[int, int]],
        host_buffers: list[tuple[int, int]] | None = None,
    ) -> None:
        buffer_ids = [buffer_id for buffer_id, _ in host_buffers or []]
        self.answers[request_id] = Answer(reply, [c.id for c in handout], [pool_id for pool_id, _ in grants], buffer_ids)
        while len(self.answers) > ANSWERS_KEPT:
            oldest = next(iter(self.answers))
            del self.answers[oldest]

    def handed_out(self, request_ids: set[int]) -> set[int]:
        """The chunks the remembered replies to ``request_ids`` handed out."""
        return {cid for rid in request_ids if rid in self.answers for cid in self.answers[rid].handout}


@dataclasses.dataclass(eq=False)
class ChunkRecord:
    id: int
    arena: str
    offset: int
    size: int
    address: int
    handle: Handle | None  # None once the daemon dropped its reference (retiring)
    holders: set[int] = dataclasses.field(default_factory=set)  # sessions that map it
    fresh: bool = True  # never handed out: zeroed before its first fd leaves the daemon

    def view(self) -> p.ChunkView:
        return p.ChunkView(id=self.id, offset=self.offset, size=self.size)


@dataclasses.dataclass(eq=False)
class GrantRecord:
    """Who may attach an arena, by identity (what the grant names) or by its token
    (see p.GrantStatus for the rules)."""

    id: int
    # Compared in constant time; kept out of repr so no log line can carry it.
    token: bytes = dataclasses.field(repr=False)
    client: str = ""
    uid: int = -1
    gid: int = -1
    uid_implied: bool = False
    read_only: bool = False  # the sessions it admits map the arena read-only

    def status(self) -> p.GrantStatus:
        return p.GrantStatus(
            id=self.id, client=self.client, uid=self.uid, gid=self.gid, uid_implied=self.uid_implied, read_only=self.read_only
        )


@dataclasses.dataclass(eq=False)
class SleepRecord:
    """An arena asleep (sleepers.py), or a KV pool (kv_pools.py: shrunk to nothing to sleep)."""

    committed: int  # what waking commits again
    kept: int  # bytes the owner copied to its host buffer first
    since: float  # unix time


@dataclasses.dataclass(eq=False)
class ArenaRecord:
    name: str
    owner_id: int
    owner_name: str
    owner_pid: int
    address: int
    reserved: int
    kv: bool = False  # a KV pool's arena: its memory comes from rounds, grow and shrink
    owner_alive: bool = True
    released: bool = False  # the owner released it; waits for sharers to detach
    chunks: list[ChunkRecord] = dataclasses.field(default_factory=list)  # live, by offset
    placeholders: list[ChunkRecord] = dataclasses.field(default_factory=list)  # owner's, any offset
    grants: list[GrantRecord] = dataclasses.field(default_factory=list)
    attached: set[int] = dataclasses.field(default_factory=set)  # owner and sharers
    readers: set[int] = dataclasses.field(default_factory=set)  # sharers attached through read-only grants only
    # Its sleep (sleepers.py; a KV pool's by the KV book's moves), written by the arena
    # book alone and imaged with the arena: None while awake.
    asleep: SleepRecord | None = None

    @property
    def window(self) -> int:
        """What the daemon plans: the clients' window plus the placeholder scratch."""
        return self.reserved + PLACEHOLDER_SCRATCH

    @property
    def committed(self) -> int:
        return sum(c.size for c in self.chunks)

    def owner_label(self) -> str:
        return f"client '{self.owner_name}' (pid {self.owner_pid})"


@dataclasses.dataclass(eq=False)
class GraphPoolRecord:
    """A CUDA-graph pool captured into an arena, as its owner last described it, with its
    lease segment and the sessions that may use it."""

    id: int
    owner_id: int
    owner_name: str
    arena: str
    label: str
    epoch: int
    extents: list[tuple[int, int]]  # (offset, size), by offset
    free_runs: list[tuple[int, int]]  # (offset, size), largest first
    segment: LeaseSegment  # its lease slot, in a segment of its own
    segment_fd: int  # the segment's memfd, granted to each session that may use the pool
    shared: bool = False  # clients the arena is shared with may open it
    # Sessions granted the segment that still may use the pool: its owner, and those that
    # opened it and still have its arena attached.
    users: set[int] = dataclasses.field(default_factory=set)
    events: dict[int, bytes] = dataclasses.field(default_factory=dict)  # session id -> its IPC event handle
    escapers: set[int] = dataclasses.field(default_factory=set)  # sessions with borrowed tensors past their scope
    lease_repairs: int = 0  # fields of its slot the daemon repaired (written by no rightful client)
    segment_moves: int = 0  # fresh segments it moved to, a user having lost its right (persisted: names the stored fd)

    def status(self) -> p.GraphPoolStatus:
        return p.GraphPoolStatus(
            id=self.id,
            owner=self.owner_name,
            arena=self.arena,
            label=self.label,
            epoch=self.epoch,
            extents=[p.Extent(offset=o, size=n) for o, n in self.extents],
            free_runs=[p.Extent(offset=o, size=n) for o, n in self.free_runs],
            free_bytes=sum(n for _, n in self.free_runs),
            shared=self.shared,
            lease_repairs=self.lease_repairs,
        )


@dataclasses.dataclass(eq=False)
class KvBufferLayout:
    name: str
    row_bytes: int
    offset: int  # from the arena's base, granularity-aligned
    region: int  # bytes reserved for max_tokens rows, granularity-aligned


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclasses.dataclass(eq=False)
class KvPoolRecord:
    """An arena laid out as buffers of token rows; committed N tokens at a time: the
    prefix of every buffer, rounded up to the granularity."""

    name: str  # also its arena's name
    owner_id: int
    buffers: list[KvBufferLayout]
    max_tokens: int  # the declared bound: every region holds this many rows
    granularity: int
    tokens: int = 0  # committed rows per buffer
    min_tokens: int = 0  # from its round's capture-done, kept for shrink requests
    shrink_request: int | None = None  # tokens the daemon asked it to shrink to
    # From its round's capture-done too, for runtime moves: the most it may grow to by
    # others' memory (0: the declared bound) and its weight against the other pools.
    top_tokens: int = 0
    weight: float = 1.0
    in_use: int = -1  # rows its engine last said it uses (-1: never said)

    @property
    def bytes_per_token(self) -> int:
        return sum(b.row_bytes for b in self.buffers)

    def prefix(self, buffer: KvBufferLayout, tokens: int) -> int:
        return align_up(tokens * buffer.row_bytes, self.granularity)

    def cost(self, tokens: int) -> int:
        """Bytes committed for ``tokens`` rows in every buffer."""
        return sum(self.prefix(b, tokens) for b in self.buffers)

    def most_tokens_within(self, nbytes: int, cap: int) -> int:
        """The most tokens (<= cap) whose cost fits in ``nbytes``."""
        if self.cost(cap) <= nbytes:
            return cap
        lo, hi = 0, cap  # cost(lo) fits, cost(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.cost(mid) <= nbytes:
                lo = mid
            else:
                hi = mid
        return lo

    def view(self, arena: p.ArenaView) -> p.KvPoolView:
        return p.KvPoolView(
            name=self.name,
            arena=arena,
            buffers=[p.KvBufferView(name=b.name, offset=b.offset, row_bytes=b.row_bytes, region_bytes=b.region) for b in self.buffers],
            max_tokens=self.max_tokens,
            tokens=self.tokens,
            bytes_per_token=self.bytes_per_token,
        )


@dataclasses.dataclass(eq=False)
class MemberRecord:
    """A KV pool in a commit round, with what its capture-done reported."""

    pool: KvPoolRecord
    session_id: int
    client: str
    reported: bool = False
    # What its CAPTURE_DONE said, its max_tokens resolved (0 there: the declared bound);
    # before it reports, the request's defaults, which ask for nothing.
    report: p.CaptureDone = dataclasses.field(default_factory=lambda: p.CaptureDone(pool=""))
    request_id: int = 0  # the deferred CAPTURE_DONE to answer
    tokens: int = 0
    bytes: int = 0
    # Chunks for its min_tokens, created and zeroed while the round waits for others:
    # what the last report has to wait for shrinks.
    staged: list[ChunkRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class RoundRecord:
    id: int
    created: float  # monotonic
    deadline: float  # monotonic
    policy: p.RoundPolicy
    state: p.RoundState = p.RoundState.OPEN
    expect: int = 0  # members to wait for before committing
    joined: int = 0  # members that ever joined (dropped ones included)
    members: list[MemberRecord] = dataclasses.field(default_factory=list)
    dropped: list[str] = dataclasses.field(default_factory=list)  # "client/pool: why"
    budget: p.RoundBudget = dataclasses.field(default_factory=p.RoundBudget)
    error: str = ""

    @property
    def active(self) -> bool:
        return self.state in (p.RoundState.OPEN, p.RoundState.AWAITING_SHRINK)

    def member(self, pool: str) -> MemberRecord | None:
        return next((m for m in self.members if m.pool.name == pool), None)

    @property
    def pending(self) -> list[MemberRecord]:
        return [m for m in self.members if not m.reported]


@dataclasses.dataclass
class Outcome:
    """What a request produced: the reply (None: it comes later, as a Completion), the
    chunks whose fds go to the requester before it, the lease segments it grants
    (graph pool id, the segment's memfd, which the daemon keeps) and the host buffers
    (buffer id, its memfd, the daemon's too) whose fds go the same way, and notices for
    other sessions. Grants and host buffers are apart because their ids are not: a
    remembered answer handed again after a restart must find the right one."""

    reply: p.Message | None
    handout: list[ChunkRecord] = dataclasses.field(default_factory=list)
    notices: Notices = dataclasses.field(default_factory=list)
    grants: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    host_buffers: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Completion:
    """A deferred answer (a CAPTURE_DONE answered when its round commits or fails; a
    PendingWait's answer)."""

    session_id: int
    request_id: int
    reply: p.Message | p.ProtocolError
    handout: list[ChunkRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class PendingWait:
    """A request answered once it can be, or at its deadline: a KV grow waiting for pools
    to give back, a wake for memory, an adoption for its group's holder to end. Every
    book that keeps them settles them when memory comes free and on the tick. Not kept
    across a restart: the client sends it again, and it is decided afresh."""

    session_id: int
    request_id: int
    created: float
    deadline: float


def wait_deadline(wait: float, now: float, what: str) -> float:
    """When a request that may wait ``wait`` seconds (its own field) is answered at the latest."""
    if not (math.isfinite(wait) and 0 <= wait <= p.MAX_WAIT_S):
        raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"{what}: wait {wait} must be a number of seconds in [0, {p.MAX_WAIT_S:g}]")
    return now + wait


@dataclasses.dataclass(eq=False)
class GroupRecord:
    """A retain group (retained.py): a uid's, held by one session, its secret, the arenas
    it keeps, and the writers its adoption waits out (retain_fence.py)."""

    name: str
    uid: int
    # Compared in constant time; kept out of repr so no log line can carry it.
    secret: bytes = dataclasses.field(repr=False)
    objects: list[str] = dataclasses.field(default_factory=list)  # arena names (a KV pool's arena has its name)
    holder: int = 0  # the session that holds it; 0 while orphaned
    # The session that held it last and ended: the one whose writes the fence waits out.
    previous: str = ""
    previous_pid: int = 0
    previous_since: float = 0.0  # its HELLO (unix time): a reused pid is not it
    previous_ended: float = 0.0  # when its session ended (the book's clock)
    # Every other session that mapped the group's memory (a sharer its owner admitted) and
    # ended: (how the log names it, pid, HELLO time, when it ended). An adoption waits for
    # each one's fence as for the last holder's: its process may still write.
    writers: list[tuple[str, int, float, float]] = dataclasses.field(default_factory=list)
    # Until an orphaned group is released (monotonic); kept while an adopter has not
    # confirmed, None once held for good.
    deadline: float | None = None
    adopting: bool = False  # adopted, not confirmed yet
