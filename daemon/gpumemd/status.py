"""What gpumemctl shows: the STATUS reply, assembled from every book in one place. Read-only."""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from gpumem_shared import __version__, lease_table
from gpumem_shared import protocol as p

from gpumemd.arenas import ArenaBook
from gpumemd.graph_pools import GraphPoolBook
from gpumemd.kv_pools import KvBook
from gpumemd.records import GraphPoolRecord, RoundRecord, SessionRecord
from gpumemd.retained import RetainBook
from gpumemd.sleepers import SleeperBook


def assemble(
    daemon: p.DaemonStatus,
    sessions: Mapping[int, SessionRecord],
    arenas: ArenaBook,
    graph_pools: GraphPoolBook,
    kv: KvBook,
    sleepers: SleeperBook,
    retained: RetainBook,
    now: float,
) -> p.StatusReply:
    names = {sid: s.name for sid, s in sessions.items()}
    device = arenas.device
    host = sleepers.host_bytes_by_session()
    daemon.sleep_host_bytes, daemon.sleep_host_limit = sum(host.values()), arenas.config.sleep_host_limit
    daemon.lease_ordering = arenas.config.lease_ordering.value
    order = graph_pools.order
    if order is not None:
        daemon.lease_lanes, daemon.lease_lanes_in_use = order.lanes.lanes, order.lanes.in_use()
    waiting = {sid for sid, s in sessions.items() if s.waiting}
    if waiting:
        daemon.waiting = len(waiting)
        daemon.waiting_objects = sum(1 for a in arenas.by_name.values() if a.attached & waiting) + sum(
            1 for g in graph_pools.by_id.values() if g.owner_id in waiting
        )
    shares = kv.shares()
    return p.StatusReply(
        daemon=daemon,
        device=p.DeviceStatus(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            total_bytes=device.total_bytes,
            free_bytes=arenas.free_bytes(),
            granularity=device.granularity,
            accounted_bytes=arenas.accounted_bytes(),
            reserve_bytes=arenas.config.reserve_bytes,
        ),
        clients=[
            p.ClientStatus(
                session_id=s.id,
                name=s.name,
                pid=s.pid,
                uid=s.uid,
                gid=s.gid,
                since=s.since,
                arenas=sorted(a.name for a in arenas.by_name.values() if s.id in a.attached),
                waiting=s.waiting,
                own_pid=s.own_pid,
                tenant=arenas.caps.session_account(s.uid, s.gid, s.tenant_key),
                host_bytes=host.get(s.id, 0),
            )
            for s in sessions.values()
        ],
        arenas=[
            p.ArenaStatus(
                name=a.name,
                owner=a.owner_name,
                owner_pid=a.owner_pid,
                owner_alive=a.owner_alive,
                address=a.address,
                reserved=a.reserved,
                committed=a.committed,
                chunks=len(a.chunks),
                shared_with=sorted({g.client for g in a.grants if g.client}),
                attached=sorted(names[sid] for sid in a.attached if sid in names),
                retiring_bytes=sum(c.size for c in arenas.retiring.values() if c.arena == a.name),
                placeholder_bytes=sum(c.size for c in a.placeholders),
                grants=[g.status() for g in a.grants],
                owner_uid=arenas.tenants.owner_uid(a),
            )
            for a in arenas.by_name.values()
        ],
        graph_pools=[_graph_pool(g, names) for g in graph_pools.by_id.values()],
        extents=[],  # filled from graph_pools for 1.1 readers (see StatusReply)
        leases=_leases(sessions, graph_pools),
        rounds=[_round(r, now) for r in kv.rounds],
        kv=[
            p.KvPoolStatus(
                name=pool.name,
                owner=arenas.by_name[pool.name].owner_name,
                buffers=len(pool.buffers),
                bytes_per_token=pool.bytes_per_token,
                max_tokens=pool.max_tokens,
                tokens=pool.tokens,
                committed_bytes=arenas.by_name[pool.name].committed,
                min_tokens=pool.min_tokens,
                shrink_request=-1 if pool.shrink_request is None else pool.shrink_request,
                weight=pool.weight,
                demand_tokens=kv.demand(pool),
                share_bytes=shares.get(pool.name, 0),
                in_use=pool.in_use,
            )
            for pool in kv.pools.values()
        ],
        tenants=arenas.caps.status(),
        sleepers=sleepers.status(),
        retained=retained.status(),
    )


def daemon_status(
    backend: str, uptime_s: float, runtime_dir: str, stopping: bool, generation: int = 0, grace_left_s: float = 0.0,
    restore_problems: list[str] | None = None,
) -> p.DaemonStatus:
    return p.DaemonStatus(
        version=__version__,
        protocol=f"{p.PROTOCOL_VERSION[0]}.{p.PROTOCOL_VERSION[1]}",
        pid=os.getpid(),
        backend=p.Backend(backend),
        uptime_s=round(uptime_s, 3),
        runtime_dir=runtime_dir,
        state="stopping" if stopping else "serving",
        generation=generation,
        grace_left_s=round(grace_left_s, 3),
        restore_problems=list(restore_problems or []),
    )


def _graph_pool(pool: GraphPoolRecord, names: dict[int, str]) -> p.GraphPoolStatus:
    view = pool.status()
    view.escaped_by = ", ".join(f"client '{names.get(sid, sid)}'" for sid in sorted(pool.escapers))
    return view


def _leases(sessions: Mapping[int, SessionRecord], graph_pools: GraphPoolBook) -> list[p.LeaseStatus]:
    out = []
    by_word = {lease_table.word_session(i): s for i, s in sessions.items()}
    for pool in graph_pools.by_id.values():
        holder = pool.segment.holder()
        if holder is None:
            continue
        session = by_word.get(holder.session)
        out.append(
            p.LeaseStatus(
                pool_id=pool.id,
                slot=0,
                kind=holder.kind_name,
                holder=session.name if session else f"session {holder.session}",
                pid=holder.pid,
                label=holder.label,
                since=holder.since_ns / 1e9,
            )
        )
    return out


def _round(r: RoundRecord, now: float) -> p.RoundStatus:
    return p.RoundStatus(
        id=r.id,
        state=r.state,
        expect=r.expect,
        policy=r.policy,
        deadline_in_s=round(r.deadline - now, 3),
        members=[
            p.RoundMemberStatus(
                client=m.client,
                pool=m.pool.name,
                reported=m.reported,
                headroom_bytes=m.report.headroom_bytes,
                graph_pool_bytes=m.report.graph_pool_bytes,
                min_tokens=m.report.min_tokens,
                max_tokens=m.report.max_tokens,
                weight=m.report.weight,
                tokens=m.tokens,
                bytes=m.bytes,
            )
            for m in r.members
        ],
        dropped=list(r.dropped),
        budget=msgspec.structs.replace(r.budget),
        error=r.error,
    )
