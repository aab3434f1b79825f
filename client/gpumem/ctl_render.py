"""What gpumemctl prints from a StatusReply: the status page, each list view, a frame of
``top``. Pure functions of the reply (and, for ``top``, the frame before and the time):
no sockets, no click, so tests build replies by hand and read the text."""

from __future__ import annotations

import collections
import datetime

from gpumem_shared import protocol as p
from gpumem_shared.units import format_size


def _client_pid(c: p.ClientStatus) -> str:
    """Its own pid, and gpumemd's number for it where that differs: the client runs in a
    pid namespace of its own (gpumemd sees 0 from outside its own: nothing to add)."""
    own = c.own_pid or c.pid
    return str(own) if c.pid in (0, own) else f"{own} ({c.pid})"


def render_leases(s: p.StatusReply) -> list[str]:
    return _table(
        ["POOL", "KIND", "HOLDER", "PID", "LABEL", "SINCE"],
        [
            [
                str(lease.pool_id),
                lease.kind,
                lease.holder,
                str(lease.pid),
                lease.label or "-",
                datetime.datetime.fromtimestamp(lease.since).strftime("%H:%M:%S.%f")[:-3],
            ]
            for lease in s.leases
        ],
    )


def render_graph_pools(s: p.StatusReply, runs: bool = False) -> list[str]:
    named = arena_names(s)
    lines = _table(
        ["POOL", "OWNER", "ARENA", "LABEL", "EPOCH", "SHARED", "EXTENTS", "EXTENT BYTES", "FREE RUNS", "FREE", "LARGEST RUN", "REPAIRS"],
        [
            [
                str(g.id),
                g.owner,
                named.get(g.arena, g.arena),
                g.label,
                str(g.epoch),
                "yes" if g.shared else "no",
                str(len(g.extents)),
                format_size(sum(e.size for e in g.extents)),
                str(len(g.free_runs)),
                format_size(g.free_bytes),
                format_size(g.free_runs[0].size) if g.free_runs else "-",
                str(g.lease_repairs),
            ]
            for g in s.graph_pools
        ],
    )
    for g in s.graph_pools:
        if g.escaped_by:
            lines.append(f"  pool {g.id}: replay and capture refused: {g.escaped_by} holds borrowed tensors past their scope")
        if g.lease_repairs:
            lines.append(
                f"  pool {g.id}: gpumemd repaired its lease slot {g.lease_repairs} time(s): a client wrote there what no "
                "client may (a session without the right to the pool, an impossible value); the daemon's log names it"
            )
    if runs:
        for g in s.graph_pools:
            lines.append(f"  pool {g.id} free runs (offset+size): " + (", ".join(f"{r.offset:#x}+{format_size(r.size)}" for r in g.free_runs) or "none"))
    return lines


def _grant_text(g: p.GrantStatus) -> str:
    """A grant in a few words; "token" where only its token admits."""
    named = [g.client] if g.client else []
    named += [f"uid {g.uid}"] if g.uid != -1 else []
    named += [f"gid {g.gid}"] if g.gid != -1 else []
    return " ".join(named) if named else "token"


def arena_names(s: p.StatusReply) -> dict[str, str]:
    """Each arena's name as shown: names are per uid, so a name that two uids' arenas
    hold is shown with its owner's uid ("UID/NAME", what another uid attaches it by)."""
    plain = {a.name: a.name.rpartition("/")[2] for a in s.arenas}
    held = collections.Counter(plain.values())
    return {a.name: f"{a.owner_uid}/{plain[a.name]}" if held[plain[a.name]] > 1 and a.owner_uid >= 0 else a.name for a in s.arenas}


def render_arenas(s: p.StatusReply) -> list[str]:
    """Arenas, then their grants: who may attach by identity, and whom a grant's token
    admits besides (the status carries no token)."""
    named = arena_names(s)
    lines = _table(
        ["NAME", "OWNER", "RESERVED", "COMMITTED", "CHUNKS", "ADDRESS", "GRANTS", "ATTACHED", "RETIRING"],
        [
            [
                named[a.name],
                a.owner if a.owner_alive else f"{a.owner} (gone)",
                format_size(a.reserved),
                format_size(a.committed),
                str(a.chunks),
                f"{a.address:#x}",
                ", ".join(_grant_text(g) for g in a.grants) or "-",
                ",".join(a.attached) or "-",
                format_size(a.retiring_bytes) if a.retiring_bytes else "-",
            ]
            for a in s.arenas
        ],
    )
    rows = [
        [
            named[a.name],
            str(g.id),
            g.client or "any",
            "any" if g.uid == -1 else (f"{g.uid} (owner's)" if g.uid_implied else str(g.uid)),
            "any" if g.gid == -1 else str(g.gid),
            f"{g.client}, any uid" if g.uid_implied else ("anyone" if _grant_text(g) == "token" else "no one more"),
        ]
        for a in s.arenas
        for g in a.grants
    ]
    if rows:
        lines += ["", "  GRANTS: a session matching CLIENT, UID and GID may attach; with the grant's token, also whom TOKEN ADMITS says"]
        lines += _table(["ARENA", "GRANT", "CLIENT", "UID", "GID", "TOKEN ADMITS"], rows)
    return lines


def render_sleepers(s: p.StatusReply) -> list[str]:
    return _table(
        ["ARENA", "OWNER", "STATE", "TO COMMIT", "KEPT", "HOST BUFFER", "SINCE"],
        [
            [
                x.arena,
                x.owner,
                "asleep" if x.asleep else "awake",
                format_size(x.committed_bytes) if x.asleep else "-",
                format_size(x.kept_bytes) if x.asleep else "-",
                format_size(x.host_bytes) if x.host_bytes else "-",
                datetime.datetime.fromtimestamp(x.since).strftime("%Y-%m-%d %H:%M:%S") if x.asleep else "-",
            ]
            for x in s.sleepers
        ],
    )


def render_tenants(s: p.StatusReply) -> list[str]:
    return _table(
        ["TENANT", "USED", "MAX", "MIN", "FROM"],
        [
            [
                t.tenant,
                format_size(t.used_bytes) + (" (over: commits refused)" if 0 <= t.max_bytes < t.used_bytes else ""),
                "-" if t.max_bytes < 0 else format_size(t.max_bytes),
                format_size(t.min_bytes),
                t.source,
            ]
            for t in s.tenants
        ],
    )


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["  (none)"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return lines


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, seconds = divmod(seconds, 86400)
    hours, seconds = divmod(seconds, 3600)
    minutes, seconds = divmod(seconds, 60)
    parts = [f"{days}d"] if days else []
    parts += [f"{hours}h"] if hours or days else []
    parts += [f"{minutes}m", f"{seconds}s"] if not days else [f"{minutes}m"]
    return "".join(parts)


def render_status(s: p.StatusReply) -> str:
    d, dev = s.daemon, s.device
    lines = [
        f"gpumemd {d.version} (protocol {d.protocol})  pid {d.pid}  backend {d.backend}  {d.state}, up {_duration(d.uptime_s)}",
        f"  runtime dir {d.runtime_dir}",
    ]
    if d.generation or d.waiting:
        lines.append(
            f"  restarted {d.generation} time(s) with its state kept; {d.waiting} client(s) holding {d.waiting_objects} "
            f"arena(s) and graph pool(s) not resumed yet" + (f", released in {_duration(d.grace_left_s)}" if d.waiting else "")
        )
    lines += [f"  NOT REBUILT at its start: {problem}" for problem in d.restore_problems]
    if d.lease_ordering == "memops":
        lines.append(f"  lease ordering memops: {d.lease_lanes_in_use} of {d.lease_lanes} lanes in use")
    elif d.lease_ordering:  # "": a daemon before 1.11 does not say
        lines.append(f"  lease ordering {d.lease_ordering}")
    lines += [
        f"device {dev.index}: {dev.name}  {dev.uuid}",
        f"  total {format_size(dev.total_bytes)}  free {format_size(dev.free_bytes)}  gpumemd holds "
        f"{format_size(dev.accounted_bytes)}  reserve {format_size(dev.reserve_bytes)}  granularity {format_size(dev.granularity)}",
    ]
    if d.sleep_host_bytes or s.sleepers:
        lines.append(f"  sleepers' host buffers {format_size(d.sleep_host_bytes)} of {format_size(d.sleep_host_limit)} (--sleep-host-limit)")
    lines += ["", "CLIENTS"]
    host = any(c.host_bytes for c in s.clients)  # a column of its own once something slept
    tenant = any(c.tenant for c in s.clients)  # and once a cap policy names their tenants
    lines += _table(
        ["ID", "NAME", "PID", "UID", "SINCE", "ARENAS"] + (["HOST"] if host else []) + (["TENANT"] if tenant else []),
        [
            [
                str(c.session_id),
                f"{c.name} (waiting)" if c.waiting else c.name,
                _client_pid(c),
                str(c.uid),
                datetime.datetime.fromtimestamp(c.since).strftime("%Y-%m-%d %H:%M:%S"),
                ",".join(c.arenas) or "-",
            ]
            + ([format_size(c.host_bytes)] if host else [])
            + ([c.tenant or "-"] if tenant else [])
            for c in s.clients
        ],
    )
    if s.tenants:
        lines += ["", "TENANT CAPS"] + render_tenants(s)
    lines += ["", "ARENAS"] + render_arenas(s)
    if s.sleepers:
        lines += ["", "SLEEPERS"] + render_sleepers(s)
    lines += ["", "GRAPH POOLS"] + render_graph_pools(s)
    lines += ["", "LEASES"] + render_leases(s)
    lines += ["", "ROUNDS"] + render_rounds(s)
    lines += ["", "KV"] + render_kv(s)
    if s.retained:  # shown where there are any: most daemons never see a retain group
        lines += ["", "RETAINED"] + render_retained(s)
    return "\n".join(lines)


def render_retained(s: p.StatusReply) -> list[str]:
    """Retain groups: who holds each, or whose death orphaned it and until when."""
    rows = []
    for g in s.retained:
        if g.state is p.RetainState.ORPHANED:
            who = f"{g.previous} (pid {g.previous_pid}, {'fenced' if g.fenced else 'NOT fenced yet'})"
            until = f"released in {_duration(max(0.0, g.deadline_in_s))}"
        else:
            who = f"{g.holder} (pid {g.holder_pid})"
            until = f"unconfirmed: released in {_duration(max(0.0, g.deadline_in_s))} if it dies" if g.state is p.RetainState.ADOPTING else "-"
        rows.append([g.group, str(g.uid), str(g.state), who, format_size(g.committed_bytes), ",".join(g.objects) or "-", until])
    return _table(["GROUP", "UID", "STATE", "HOLDER / ORPHANED BY", "COMMITTED", "OBJECTS", "DEADLINE"], rows)


def _tokens(n: int) -> str:
    return "-" if n <= 0 else str(n)


def _deadline(r: p.RoundStatus) -> str:
    """An open round's deadline; an ended round has none left to show (the daemon keeps
    counting to it, and "deadline in 4m52s" read as a round still waiting)."""
    if r.state in (p.RoundState.COMMITTED, p.RoundState.FAILED):
        return ""
    if r.deadline_in_s >= 0:
        return f"  deadline in {_duration(r.deadline_in_s)}"
    return f"  deadline passed {_duration(-r.deadline_in_s)} ago"


def _budget_lines(r: p.RoundStatus, pools: dict[str, p.KvPoolStatus]) -> list[str]:
    """The round's budget as the daemon computed it, one step per line."""
    b = r.budget
    pending = [f"{m.client}/{m.pool}" for m in r.members if not m.reported]
    absent = max(0, r.expect - len(r.members) - len(r.dropped))
    waits = [f"capture-done from {', '.join(pending)}"] if pending else []
    waits += [f"{absent} more expected pool(s) to join"] if absent else []
    waiting = f"waiting for {' and '.join(waits)}" if waits and r.state in (p.RoundState.OPEN, p.RoundState.AWAITING_SHRINK) else ""
    if b == p.RoundBudget():
        if waiting:
            return [f"budget: not computed yet; {waiting}"]
        failed = r.state == p.RoundState.FAILED
        return ["budget: not computed (the round failed before it was measured)" if failed else "budget: not computed yet"]
    budget = max(b.budget, 0)
    lines = [f"{waiting}; the figures below are from the last attempt and are computed again then"] if waiting else []
    lines.append(
        f"budget: free {format_size(b.free)} - reserve {format_size(b.reserve)} - headroom {format_size(b.headroom)}"
        f" = {format_size(b.budget)}"
        + (f"  (graph pools {format_size(b.graph_pools)}: already in use, not deducted)" if b.graph_pools else "")
    )
    if b.minimums > budget:
        lines.append(f"minimums: {format_size(b.minimums)} needed first; short by {format_size(b.minimums - budget)}")
    else:
        total_weight = sum(m.weight for m in r.members if m.reported)
        lines.append(
            f"minimums: {format_size(b.minimums)} first; the other {format_size(budget - b.minimums)} shared by weight"
            + (f" (total weight {total_weight:g}), each capped at its max tokens" if total_weight else "")
        )
    if r.state == p.RoundState.COMMITTED:
        lines.append(
            f"committed: {format_size(b.committed)} to the members' pools; {format_size(budget - b.committed)}"
            " of the budget unused (max-token caps, granularity rounding)"
        )
    elif r.state == p.RoundState.AWAITING_SHRINK:
        asked = [f"{k.name} ({k.owner}) to {k.shrink_request} tokens" for k in pools.values() if k.shrink_request >= 0]
        lines.append("waiting for shrink confirmations: " + (", ".join(asked) if asked else "none pending"))
    return lines


def render_rounds(s: p.StatusReply) -> list[str]:
    if not s.rounds:
        return _table([], [])
    pools = {k.name: k for k in s.kv}
    lines: list[str] = []
    for r in s.rounds:
        reported = sum(1 for m in r.members if m.reported)
        lines.append(
            f"  round {r.id}  {r.state}  policy {r.policy}{_deadline(r)}  "
            f"{reported}/{len(r.members)} reported" + (f"  expects {r.expect} pools" if r.expect else "")
        )
        lines += [f"    {line}" for line in _budget_lines(r, pools)]
        total_weight = sum(m.weight for m in r.members if m.reported) or 1.0
        rows = [
            [
                m.client,
                m.pool,
                "reported" if m.reported else "PENDING",
                format_size(m.headroom_bytes) if m.reported else "-",
                format_size(m.graph_pool_bytes) if m.reported else "-",
                str(m.min_tokens) if m.reported else "-",
                str(m.max_tokens) if m.reported else "-",
                f"{m.weight:g} ({100 * m.weight / total_weight:.0f}%)" if m.reported else "-",
                _tokens(m.tokens),
                format_size(m.bytes) if m.tokens else "-",
            ]
            for m in r.members
        ]
        table = _table(
            ["CLIENT", "POOL", "CAPTURE", "HEADROOM", "GRAPH POOL", "MIN TOKENS", "MAX TOKENS", "WEIGHT", "TOKENS", "BYTES"],
            rows,
        )
        lines += [f"  {line}" for line in table] if rows else ["    (no members)"]
        lines += [f"    dropped: {d}" for d in r.dropped]
        if r.error:
            lines.append(f"    error: {r.error}")
    return lines


def render_kv(s: p.StatusReply) -> list[str]:
    named = arena_names(s)  # a KV pool is an arena, its name the arena's
    return _table(
        ["NAME", "OWNER", "BUFFERS", "BYTES/TOKEN", "TOKENS", "COMMITTED", "MIN TOKENS", "IN USE", "DEMAND", "WEIGHT", "SHARE", "SHRINK REQUEST"],
        [
            [
                named.get(k.name, k.name),
                k.owner,
                str(k.buffers),
                format_size(k.bytes_per_token),
                f"{k.tokens}/{k.max_tokens}",
                format_size(k.committed_bytes),
                str(k.min_tokens),
                *_moves(k),
                f"to {k.shrink_request} tokens" if k.shrink_request >= 0 else "-",
            ]
            for k in s.kv
        ],
    )


def _moves(k: p.KvPoolStatus) -> list[str]:
    """The runtime-move policy's view of a pool: rows in use (as its engine said), the
    tokens it wants, its weight, its fair share."""
    return [str(k.in_use) if k.in_use >= 0 else "-", str(k.demand_tokens), f"{k.weight:g}", format_size(k.share_bytes)]


# ---------------------------------------------------------------------------- top


def _owned(s: p.StatusReply) -> dict[str, int]:
    """Committed bytes of the arenas each live client owns, by client name."""
    owned = {c.name: 0 for c in s.clients}
    for arena in s.arenas:
        if arena.owner_alive and arena.owner in owned:
            owned[arena.owner] += arena.committed
    return owned


def _change(now: int, before: int | None) -> str:
    if before is None or now == before:
        return ""
    return ("+" if now > before else "-") + format_size(abs(now - before))


def _held_for(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}ms" if seconds < 1 else _duration(seconds)


def render_top(s: p.StatusReply, before: p.StatusReply | None, now: float) -> list[str]:
    """One frame of ``gpumemctl top``: the status, busiest first, with each client's
    change in committed bytes since the frame ``before``."""
    d, dev = s.daemon, s.device
    held = 100 * dev.accounted_bytes / dev.total_bytes if dev.total_bytes else 0.0
    active = [r for r in s.rounds if r.state in (p.RoundState.OPEN, p.RoundState.AWAITING_SHRINK)]
    lines = [
        f"gpumemd {d.version}  device {dev.index}: {dev.name}  {d.backend}  {d.state}, up {_duration(d.uptime_s)}"
        f"  {datetime.datetime.fromtimestamp(now).strftime('%H:%M:%S')}",
        f"memory  total {format_size(dev.total_bytes)}  free {format_size(dev.free_bytes)}  held by gpumemd "
        f"{format_size(dev.accounted_bytes)} ({held:.0f}%)  reserve {format_size(dev.reserve_bytes)}",
        f"{len(s.clients)} clients  {len(s.arenas)} arenas  {len(s.graph_pools)} graph pools  "
        f"{len(s.leases)} leases held  {len(active)} KV rounds active",
        "",
        "CLIENTS",
    ]
    owned, owned_before = _owned(s), _owned(before) if before is not None else {}
    clients = sorted(s.clients, key=lambda c: (-owned[c.name], c.name, c.session_id))
    lines += _table(
        ["CLIENT", "PID", "SESSION", "COMMITTED", "CHANGE", "ARENAS"],
        [
            [c.name, _client_pid(c), str(c.session_id), format_size(owned[c.name]), _change(owned[c.name], owned_before.get(c.name) if before else None),
             ",".join(c.arenas) or "-"]
            for c in clients
        ],
    )
    lines += ["", "ARENAS"]
    named = arena_names(s)
    lines += _table(
        ["ARENA", "OWNER", "COMMITTED", "RESERVED", "USED", "CHUNKS", "ATTACHED", "RETIRING"],
        [
            [named[a.name], a.owner if a.owner_alive else f"{a.owner} (gone)", format_size(a.committed), format_size(a.reserved),
             f"{100 * a.committed / a.reserved:.0f}%" if a.reserved else "-", str(a.chunks), ",".join(a.attached) or "-",
             format_size(a.retiring_bytes) if a.retiring_bytes else "-"]
            for a in sorted(s.arenas, key=lambda a: (-a.committed, a.name))
        ],
    )
    pools = {g.id: g for g in s.graph_pools}
    lines += ["", "LEASES"]
    lines += _table(
        ["POOL", "ARENA", "KIND", "HOLDER", "PID", "LABEL", "HELD FOR"],
        [
            [f"{pools[lease.pool_id].label} ({lease.pool_id})" if lease.pool_id in pools else str(lease.pool_id),
             named.get(pools[lease.pool_id].arena, pools[lease.pool_id].arena) if lease.pool_id in pools else "-", lease.kind, lease.holder, str(lease.pid), lease.label or "-",
             _held_for(max(0.0, now - lease.since))]
            for lease in sorted(s.leases, key=lambda lease: lease.since)
        ],
    )
    lines += ["", "ROUNDS"]
    if not s.rounds:
        lines.append("  (none)")
    for r in s.rounds[-3:]:  # the active one last
        reported = sum(1 for m in r.members if m.reported)
        figures = f"  budget {format_size(r.budget.budget)}  committed {format_size(r.budget.committed)}" if r.budget != p.RoundBudget() else ""
        pending = [f"{m.client}/{m.pool}" for m in r.members if not m.reported]
        waiting = f"  waiting for {', '.join(pending)}" if pending and r in active else ""
        lines.append(f"  round {r.id}  {r.state}  {reported}/{len(r.members)} reported{figures}{waiting}" + (f"  error: {r.error}" if r.error else ""))
    if s.kv:
        lines += ["", "KV POOLS"]
        lines += _table(
            ["POOL", "OWNER", "MIN TOKENS", "TOKENS", "COMMITTED", "IN USE", "DEMAND", "WEIGHT", "SHARE", "SHRINK REQUEST"],
            [
                [named.get(k.name, k.name), k.owner, str(k.min_tokens), str(k.tokens), format_size(k.committed_bytes), *_moves(k),
                 f"to {k.shrink_request}" if k.shrink_request >= 0 else "-"]
                for k in sorted(s.kv, key=lambda k: (-k.committed_bytes, k.name))
            ],
        )
    return lines
