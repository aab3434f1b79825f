"""The state image: what the durable record holds of the books, as plain msgspec
structs encoded as msgpack arrays, and the fds the store must hold for it by name
(``chunk-<id>``, ``lease-<id>``). ``capture`` builds it from a live state; the rebuild
in durable.py reads it back. A snapshot of the whole state rather than a journal: a
handful of arenas encode in microseconds, and there is no replay to get wrong.
"""

from __future__ import annotations

import msgspec

from gpumem_shared import protocol as p

from gpumemd.records import ChunkRecord
from gpumemd.state import DaemonState

IMAGE_VERSION = 2  # 2: several remembered replies per session


def chunk_name(chunk_id: int) -> str:
    return f"chunk-{chunk_id}"


def lease_name(pool_id: int, moves: int = 0) -> str:
    """A pool's lease segment in the store: a new name each time the pool moves to a fresh
    segment, so that the store takes the new one and lets go of the retired one."""
    return f"lease-{pool_id}.{moves}" if moves else f"lease-{pool_id}"


class _Image(msgspec.Struct, array_like=True):
    pass


class ChunkImage(_Image):
    id: int
    arena: str
    offset: int
    size: int
    address: int
    fresh: bool
    holders: list[int]


class GrantImage(_Image):
    id: int
    token: bytes
    client: str
    uid: int
    gid: int
    uid_implied: bool


class ArenaImage(_Image):
    name: str
    owner_id: int
    owner_name: str
    owner_pid: int
    address: int
    reserved: int
    kv: bool
    owner_alive: bool
    released: bool
    chunks: list[ChunkImage]
    placeholders: list[ChunkImage]
    grants: list[GrantImage]
    attached: list[int]


class SessionImage(_Image):
    id: int
    name: str
    pid: int
    uid: int
    gid: int
    since: float
    token: bytes
    credential: bytes
    answers: list[tuple[int, bytes, list[int], list[int]]]  # request id, reply, chunk ids, graph pool ids


class GraphPoolImage(_Image):
    id: int
    owner_id: int
    owner_name: str
    arena: str
    label: str
    epoch: int
    extents: list[tuple[int, int]]
    free_runs: list[tuple[int, int]]
    shared: bool
    users: list[int]
    events: dict[int, bytes]
    escapers: list[int]
    lease_repairs: int
    segment_moves: int = 0


class KvPoolImage(_Image):
    name: str
    owner_id: int
    buffers: list[tuple[str, int, int, int]]  # name, row bytes, offset, region
    max_tokens: int
    granularity: int
    tokens: int
    min_tokens: int
    shrink_request: int | None


class MemberImage(_Image):
    pool: str
    session_id: int
    client: str
    reported: bool
    headroom_bytes: int
    graph_pool_bytes: int
    min_tokens: int
    max_tokens: int
    weight: float
    request_id: int
    tokens: int
    bytes: int
    staged: list[int]  # chunk ids


class RoundImage(_Image):
    id: int
    age: float  # seconds since it opened (monotonic clocks do not survive a restart)
    left: float  # seconds to its deadline
    policy: p.RoundPolicy
    state: p.RoundState
    expect: int
    joined: int
    members: list[MemberImage]
    dropped: list[str]
    budget: p.RoundBudget
    error: str


class StateImage(_Image):
    version: int
    device_uuid: str
    backend: str
    va_base: int
    generation: int
    next_session: int
    next_chunk: int
    next_grant: int
    next_pool: int
    next_round: int
    sessions: list[SessionImage]
    arenas: list[ArenaImage]
    retiring: list[ChunkImage]
    graph_pools: list[GraphPoolImage]
    kv_pools: list[KvPoolImage]
    rounds: list[RoundImage]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StateImage)


def decode(payload: bytes) -> StateImage:
    """The image a record's payload holds (msgspec's errors if it does not)."""
    return _DECODER.decode(payload)


def _chunk(c: ChunkRecord) -> ChunkImage:
    return ChunkImage(c.id, c.arena, c.offset, c.size, c.address, c.fresh, list(c.holders))


def capture(state: DaemonState) -> tuple[bytes, dict[str, int]]:
    """The state's image, and the fds the store must hold for it, by name."""
    chunk_fd = state.driver.chunk_fd
    fds: dict[str, int] = {}
    arenas = []
    for a in state.arenas.by_name.values():
        live = a.chunks + a.placeholders
        for c in live:
            fds[chunk_name(c.id)] = chunk_fd(c.handle)
        arenas.append(
            ArenaImage(
                a.name, a.owner_id, a.owner_name, a.owner_pid, a.address, a.reserved, a.kv, a.owner_alive, a.released,
                [_chunk(c) for c in a.chunks], [_chunk(c) for c in a.placeholders],
                [GrantImage(g.id, g.token, g.client, g.uid, g.gid, g.uid_implied) for g in a.grants], sorted(a.attached),
            )
        )
    pools = []
    for g in state.graph_pools.by_id.values():
        fds[lease_name(g.id, g.segment_moves)] = g.segment_fd
        pools.append(
            GraphPoolImage(
                g.id, g.owner_id, g.owner_name, g.arena, g.label, g.epoch, g.extents, g.free_runs, g.shared,
                sorted(g.users), g.events, sorted(g.escapers), g.lease_repairs, g.segment_moves,
            )
        )
    now = state.clock()
    image = StateImage(
        version=IMAGE_VERSION,
        device_uuid=state.device.uuid,
        backend=state.driver.kind,
        va_base=state.config.va_base,
        generation=state.generation,
        next_session=state.next_session,
        next_chunk=state.arenas.next_chunk,
        next_grant=state.arenas.next_grant,
        next_pool=state.graph_pools.next_id,
        next_round=state.kv.next_round,
        sessions=[
            SessionImage(
                s.id, s.name, s.pid, s.uid, s.gid, s.since, s.token, s.credential,
                [(rid, a.reply, a.handout, a.grants) for rid, a in s.answers.items()],
            )
            for s in state.sessions.values()
        ],
        arenas=arenas,
        retiring=[_chunk(c) for c in state.arenas.retiring.values()],
        graph_pools=pools,
        kv_pools=[
            KvPoolImage(
                k.name, k.owner_id, [(b.name, b.row_bytes, b.offset, b.region) for b in k.buffers], k.max_tokens,
                k.granularity, k.tokens, k.min_tokens, k.shrink_request,
            )
            for k in state.kv.pools.values()
        ],
        rounds=[
            RoundImage(
                r.id, now - r.created, r.deadline - now, r.policy, r.state, r.expect, r.joined,
                [
                    MemberImage(
                        m.pool.name, m.session_id, m.client, m.reported, m.headroom_bytes, m.graph_pool_bytes, m.min_tokens,
                        m.max_tokens, m.weight, m.request_id, m.tokens, m.bytes, [c.id for c in m.staged],
                    )
                    for m in r.members
                ],
                list(r.dropped), r.budget, r.error,
            )
            for r in state.kv.rounds
        ],
    )
    return _ENCODER.encode(image), fds
