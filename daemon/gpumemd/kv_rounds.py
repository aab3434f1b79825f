"""The KV book's commit rounds: pools join the device's open round before capture, each
reports CAPTURE_DONE with its figures (checked here; its minimum staged while the others
capture), and the round commits once every member reported or its deadline passed: the
budget measured and split (kv_math), the chunks created, and each member's deferred
reply answered as a Completion. Short of the minimums, pools committed before are asked
to give back (KV_SHRINK); past the deadline, the round fails with its figures.

The KV book (kv_pools.py) owns the pools and the way out: each step of a round returns
what it leaves the book (a RoundStep: the deferred answers to send, and the bytes its
minimums lack, which the book asks back by its one donor rule); the desk writes into
nothing of the book's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping

import msgspec

from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError

from gpumemd import kv_math, kv_moves
from gpumemd.arenas import ArenaBook, map_batches
from gpumemd.config import StateConfig
from gpumemd.image import Image, Imager
from gpumemd.records import ChunkRecord, Completion, KvPoolRecord, MemberRecord, Outcome, RoundRecord, SessionRecord
from gpumemd.tally import Tally

log = logging.getLogger("gpumemd.kv_pools")  # the KV book's lines, its rounds' included, under one name

# Finished rounds stay in the status for a while.
_ROUNDS_KEPT = 16
# Weights are relative shares: beyond this ratio between two members nothing changes
# but the arithmetic (1e308 twice overflows to inf, and the split turns into NaN).
MAX_WEIGHT = 1e6


def _budget_figures(round_: RoundRecord) -> dict[str, int]:
    """The round's budget for a log line's figures; none before it was measured."""
    return {} if round_.budget == p.RoundBudget() else msgspec.structs.asdict(round_.budget)


_ROUND, _MEMBER = Imager(RoundRecord), Imager(MemberRecord)


@dataclasses.dataclass
class RoundStep:
    """What a step of a round leaves to the book: the deferred answers to send and, where
    the members' minimums do not fit, the bytes to ask pools to give back (``short``, for
    ``why``) and what the round fails with if none can (``failure``, with its figures)."""

    done: list[Completion] = dataclasses.field(default_factory=list)
    short: int = 0
    why: str = ""
    failure: str = ""
    figures: dict[str, int] = dataclasses.field(default_factory=dict)


class RoundDesk:
    """The rounds, the oldest first, and the next round's id; the book's pools, read."""

    def __init__(
        self,
        arenas: ArenaBook,
        sessions: Mapping[int, SessionRecord],
        config: StateConfig,
        clock: Callable[[], float],
        tally: Tally,
        pools: Mapping[str, KvPoolRecord],
    ) -> None:
        self.arenas = arenas
        self.sessions = sessions
        self.config = config
        self.clock = clock
        self.tally = tally
        self.pools = pools  # the book's
        self.rounds: list[RoundRecord] = []  # the active one last; finished ones kept for status
        self.next_round = 1

    def active(self) -> list[RoundRecord]:
        return [r for r in self.rounds if r.active]

    def of(self, pool: KvPoolRecord) -> RoundRecord | None:
        """The active round ``pool`` is in."""
        return next((r for r in self.active() if r.member(pool.name)), None)

    # ------------------------------------------------------------------ requests (the pool checked by the book)

    def join(self, s: SessionRecord, pool: KvPoolRecord, m: p.RoundJoin) -> Outcome:
        if pool.tokens:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' already holds {pool.tokens} tokens; grow it instead")
        if m.expect < 0:  # before any round is opened or touched
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"expect must be >= 0, not {m.expect}")
        active = self.active()
        if any(r.member(pool.name) for r in active):
            raise p.ProtocolError(p.ErrorCode.ALREADY_EXISTS, f"KV pool '{pool.name}' is already in round {active[-1].id}")
        if active:
            round_ = active[-1]
            round_.state = p.RoundState.OPEN
        else:
            now = self.clock()
            round_ = RoundRecord(id=self.next_round, created=now, deadline=now + self.config.round_timeout, policy=self.config.round_policy)
            self.next_round += 1
            self.rounds.append(round_)
            del self.rounds[:-_ROUNDS_KEPT]
        round_.expect = max(round_.expect, m.expect)
        round_.joined += 1
        round_.members.append(MemberRecord(pool=pool, session_id=s.id, client=s.name))
        log.info("round %d: %r joined with pool %r", round_.id, s.name, pool.name)
        return Outcome(
            p.RoundView(
                round_id=round_.id,
                state=round_.state,
                deadline_in_s=round(round_.deadline - self.clock(), 3),
                members=[f"{m.client}/{m.pool.name}" for m in round_.members],
            )
        )

    def report(self, s: SessionRecord, pool: KvPoolRecord, m: p.CaptureDone, request_id: int) -> Outcome:
        """Record the report (the book then tries to finish the round); the reply is
        deferred until the round commits or fails."""
        round_ = self.of(pool)
        if round_ is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"KV pool '{pool.name}' is in no open round; join one first")
        member = round_.member(pool.name)
        assert member is not None
        if member.reported and member.request_id == request_id and member.session_id == s.id:
            return Outcome(None)  # sent again after a daemon restart: still waiting for its round
        if member.reported:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' already reported capture-done in round {round_.id}")
        max_tokens = m.max_tokens or pool.max_tokens
        if not 0 <= m.min_tokens <= max_tokens <= pool.max_tokens:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{pool.name}': need 0 <= min_tokens ({m.min_tokens}) <= max_tokens ({max_tokens}) <= the "
                f"declared {pool.max_tokens}",
            )
        total = self.arenas.device.total_bytes
        if not (0 <= m.headroom_bytes <= total and 0 <= m.graph_pool_bytes <= total):
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{pool.name}': headroom_bytes ({m.headroom_bytes}) and graph_pool_bytes ({m.graph_pool_bytes}) "
                f"must lie between 0 and the device's {total} bytes",
            )
        if not (math.isfinite(m.weight) and 0 < m.weight <= MAX_WEIGHT):
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}': weight {m.weight} must be a number in (0, {MAX_WEIGHT:g}]"
            )
        member.reported = True
        member.report = msgspec.structs.replace(m, max_tokens=max_tokens)
        member.request_id = request_id
        if round_.pending or round_.joined < round_.expect:
            self._stage(member)
        return Outcome(None)

    # ------------------------------------------------------------------ what others change

    def drop_session(self, session_id: int) -> list[RoundRecord]:
        """The client went away: its members leave their rounds. Returns the active rounds,
        to finish once its memory is back."""
        rounds = self.active()
        for round_ in rounds:
            for member in [m for m in round_.members if m.session_id == session_id]:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{member.pool.name}: the client went away")
        return rounds

    def drop_pool(self, name: str) -> list[RoundRecord]:
        """The pool is gone: its members leave their rounds; returns the rounds it left."""
        left = []
        for round_ in self.active():
            for member in [m for m in round_.members if m.pool.name == name]:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{name}: the pool was released")
                left.append(round_)
        return left

    def awaiting(self) -> list[RoundRecord]:
        """The rounds waiting for shrinks: memory that came free may let them go ahead."""
        return [r for r in self.active() if r.state == p.RoundState.AWAITING_SHRINK]

    def late(self) -> list[RoundRecord]:
        return [r for r in self.active() if self.clock() >= r.deadline]

    def asked(self, round_: RoundRecord, step: RoundStep, asked: bool) -> list[Completion]:
        """The book asked pools for ``step.short`` (``asked``: some will give back): the
        round waits for their shrinks, or fails now. Returns its deferred answers."""
        if asked:
            round_.state = p.RoundState.AWAITING_SHRINK
            return step.done
        return step.done + self._fail(round_, step.failure, **step.figures)

    # ------------------------------------------------------------------ the durable record

    def image(self) -> list[Image]:
        now = self.clock()
        return [
            _ROUND.image(
                r,
                created=now - r.created,  # seconds since: monotonic clocks do not survive a restart
                deadline=r.deadline - now,  # seconds left
                members=[_MEMBER.image(m, pool=m.pool.name, staged=[c.id for c in m.staged]) for m in r.members],
            )
            for r in self.rounds
        ]

    def restore(self, rounds: list[Image], next_round: int) -> None:
        """The rounds as ``image`` left them (the pools restored first); a member whose
        pool was not rebuilt is dropped."""
        chunks = {c.id: c for a in self.arenas.by_name.values() for c in a.chunks}
        now = self.clock()
        for image in (_ROUND.fields(r) for r in rounds):
            members = [
                _MEMBER.restore(m, pool=self.pools[m["pool"]], staged=[chunks[c] for c in m["staged"] if c in chunks])
                for m in (_MEMBER.fields(i) for i in image["members"])
                if m["pool"] in self.pools
            ]
            round_ = _ROUND.restore(image, members=members)
            round_.created, round_.deadline = now - round_.created, now + round_.deadline
            self.rounds.append(round_)
        self.next_round = next_round

    # ------------------------------------------------------------------ the round

    def try_finish(self, round_: RoundRecord) -> RoundStep:
        """Commit the round once every member reported (or its deadline passed)."""
        now = self.clock()
        if not round_.active:
            return RoundStep()
        late = now >= round_.deadline
        absent = max(0, round_.expect - round_.joined)
        if (round_.pending or absent) and not late:
            return RoundStep()
        if round_.pending or absent:
            missing = ", ".join(
                [f"{m.client}/{m.pool.name}" for m in round_.pending] + ([f"{absent} expected pool(s) that never joined"] if absent else [])
            )
            if round_.policy == p.RoundPolicy.FAIL:
                return RoundStep(self._fail(round_, f"round {round_.id} passed its deadline; these members did not report capture-done: {missing}"))
            for member in round_.pending:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{member.pool.name}: did not report capture-done by the deadline")
            log.warning("round %d: deadline passed; committing without %s", round_.id, missing)
        done: list[Completion] = []
        members = self._within_caps(round_, done)
        if not members:
            round_.state = p.RoundState.FAILED
            round_.error = "no member reported capture-done"
            self._ended(round_)
            return RoundStep(done)
        staged = sum(c.size for m in members for c in m.staged)
        free = self.arenas.free_bytes() + staged  # staged minimums are the members' own
        headroom = sum(m.report.headroom_bytes for m in members)
        reserve = self.config.reserve_bytes
        budget = free - reserve - headroom
        round_.budget = p.RoundBudget(
            free=free,
            staged=staged,
            reserve=reserve,
            headroom=headroom,
            graph_pools=sum(m.report.graph_pool_bytes for m in members),
            budget=budget,
            minimums=sum(m.pool.cost(m.report.min_tokens) for m in members),
        )
        caps = self.arenas.caps
        held_back = caps.held_back(caps.accounts_of((self.arenas.by_name[m.pool.name], 0, 0) for m in members))
        try:
            tokens = self._split(members, max(budget - held_back, 0))
        except kv_math.BudgetShort as short:
            failure = (
                f"round {round_.id}: the members' minimum KV needs {short.needed} bytes but the budget is {budget} "
                f"(free {free} - reserve {reserve} - headroom {headroom}; {held_back} more held back for other tenants' minimums)"
            )
            figures = {"needed": short.needed, "budget": budget}
            if round_.state == p.RoundState.OPEN and not late:  # pools committed earlier may give back (the book asks them)
                deficit = short.needed - max(budget - held_back, 0)
                names = ", ".join(f"{m.client}/{m.pool.name}" for m in round_.members)
                return RoundStep(done, deficit, f"round {round_.id} ({names}) needs {deficit} bytes", failure, figures)
            if round_.state == p.RoundState.AWAITING_SHRINK and not late:
                return RoundStep(done)
            return RoundStep(done + self._fail(round_, failure, **figures))
        work = []
        for member in members:
            arena = self.arenas.by_name[member.pool.name]
            work += [(arena, offset, size) for offset, size in kv_moves.missing(member.pool, arena, tokens[member])]
        started = time.perf_counter()
        try:
            self.arenas.create_chunks(work, max(budget, 0), ladder=False)
        except p.ProtocolError as exc:
            return RoundStep(done + self._fail(round_, f"round {round_.id}: {exc.message}"))
        created_ms = (time.perf_counter() - started) * 1e3
        round_.state = p.RoundState.COMMITTED
        handouts = []
        for member in members:
            pool = member.pool
            pool.tokens = tokens[member]
            pool.min_tokens = member.report.min_tokens
            pool.top_tokens, pool.weight = member.report.max_tokens, member.report.weight
            member.tokens = tokens[member]
            member.bytes = pool.cost(tokens[member])
            member.staged = []
            handouts.append((member, [c for c in self.arenas.by_name[pool.name].chunks if member.session_id not in c.holders]))
        handed = sum(len(new) for _, new in handouts)
        committed = sum(c.size for _, new in handouts for c in new)
        round_.budget.committed = committed  # before the replies: each carries a copy of the budget
        self._ended(round_)
        for member, new in handouts:
            reply = commit_reply(self.arenas, member.pool, new, [], round_)
            done.append(Completion(member.session_id, member.request_id, reply, self.arenas.hand(self.sessions[member.session_id], new)))
        log.info(
            "round %d committed: %s (%d bytes in %d chunks; %d staged before the last report, the rest created in %.1f ms)",
            round_.id,
            ", ".join(f"{m.client}/{m.pool.name}={m.tokens} tokens" for m in members),
            committed,
            handed,
            staged,
            created_ms,
            extra={"figures": {"round": round_.id, "chunks": handed, "created_ms": round(created_ms, 3), **_budget_figures(round_)}},
        )
        return RoundStep(done)

    def _by_tenant(self, members: list[MemberRecord]) -> dict[str, tuple[int, list[MemberRecord]]]:
        """Capped tenants' members, with the bytes each tenant may hold for them: what
        its cap leaves, plus what their staged minimums hold already."""
        out: dict[str, tuple[int, list[MemberRecord]]] = {}
        for member in members:
            arena = self.arenas.by_name[member.pool.name]
            found, room = self.arenas.caps.account_of(arena.name), self.arenas.caps.room(arena)
            if found is not None and room is not None:
                held, group = out.get(found[0], (room, []))
                out[found[0]] = (held + sum(c.size for c in member.staged), [*group, member])
        return out

    def _within_caps(self, round_: RoundRecord, done: list[Completion]) -> list[MemberRecord]:
        """The members whose tenants' caps hold their minimums; the others leave the round,
        refused with RESOURCE_EXHAUSTED (their tenant's bound is no other member's concern:
        the refusals go to ``done``)."""
        for tenant, (room, group) in self._by_tenant(list(round_.members)).items():
            needed = sum(m.pool.cost(m.report.min_tokens) for m in group)
            if needed <= room:
                continue
            message = (
                f"round {round_.id}: {tenant}'s cap leaves {room} bytes for its members "
                f"({', '.join(f'{m.client}/{m.pool.name}' for m in group)}) and their minimums need {needed}"
            )
            log.warning("%s; they leave the round", message)
            for member in group:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{member.pool.name}: {tenant}'s cap")
                self._unstage(member)
                if member.reported:
                    error = p.ProtocolError(p.ErrorCode.RESOURCE_EXHAUSTED, message, limit="device memory", tenant=tenant, room=room, needed=needed)
                    done.append(Completion(member.session_id, member.request_id, error))
        return list(round_.members)

    def _split(self, members: list[MemberRecord], budget: int) -> dict[MemberRecord, int]:
        """kv_math.split within each tenant's cap: a capped tenant whose members' shares
        pass it gets its cap, split among them alone (minimums first, then by weight),
        and the rest of the budget is split again among the others."""
        evened = self._evened(members)
        members = list(evened)
        rooms = self._by_tenant(members)
        fixed: dict[MemberRecord, int] = {}
        while True:
            rest = [m for m in members if m not in fixed]
            tokens = kv_math.split(rest, budget - sum(m.pool.cost(t) for m, t in fixed.items())) if rest else {}
            over = [(room, group) for room, group in rooms.values() if group[0] not in fixed and sum(m.pool.cost(tokens[m]) for m in group) > room]
            if not over:
                return {evened[m]: t for m, t in {**fixed, **tokens}.items()}
            for room, group in over:
                fixed.update(kv_math.split(group, room))

    def _evened(self, members: list[MemberRecord]) -> dict[MemberRecord, MemberRecord]:
        """Stand-ins for ``members`` (each to its member) whose weights are bounded across
        tenants: a member's weight divides its own tenant's, each tenant weighing 1,
        however its engines weigh their pools. One tenant alone: the members themselves."""
        tenant = {m: self.arenas.caps.tenant(m.pool.name) for m in members}
        if len(set(tenant.values())) < 2:
            return {m: m for m in members}
        weights: dict[str, float] = {}
        for m in members:
            weights[tenant[m]] = weights.get(tenant[m], 0.0) + m.report.weight
        return {
            dataclasses.replace(m, report=msgspec.structs.replace(m.report, weight=m.report.weight / weights[tenant[m]])): m
            for m in members
        }

    def _stage(self, member: MemberRecord) -> None:
        """Create and zero the reporting member's minimum while the round waits for the
        others: it gets at least that much if the round commits, and the round's last
        report then waits only for what is left. Given back if the round fails."""
        arena = self.arenas.by_name[member.pool.name]
        work = [(arena, offset, size) for offset, size in kv_moves.missing(member.pool, arena, member.report.min_tokens)]
        need = sum(size for _, _, size in work)
        if not work or need > self.arenas.available_bytes():
            return
        before = {c.id for c in arena.chunks}
        try:
            new = self.arenas.create_chunks(work, need, ladder=False)
            self.arenas.driver.zero([(c.address, c.size) for c in new])
        except (p.ProtocolError, DriverError) as exc:
            log.warning("staging the minimum of %s/%s failed (%s); the round will create it", member.client, member.pool.name, exc)
            new = [c for c in arena.chunks if c.id not in before]
            arena.chunks = [c for c in arena.chunks if c.id in before]
            self.arenas.retire(new, [], "", arena.name)
            return
        for chunk in new:
            chunk.fresh = False
        member.staged = new

    def _unstage(self, member: MemberRecord) -> None:
        arena = self.arenas.by_name.get(member.pool.name)
        if arena is not None and member.staged:
            ids = {c.id for c in member.staged}
            drop = [c for c in arena.chunks if c.id in ids]
            arena.chunks = [c for c in arena.chunks if c.id not in ids]
            self.arenas.retire(drop, [], "", arena.name)
        member.staged = []

    def _ended(self, round_: RoundRecord) -> None:
        self.tally.round_ended(round_.state, self.clock() - round_.created, round_.budget)

    def _fail(self, round_: RoundRecord, message: str, **detail: int | str) -> list[Completion]:
        """End the round failed; returns the refusals of the members that reported."""
        round_.state = p.RoundState.FAILED
        round_.error = message
        self._ended(round_)
        log.warning("%s", message, extra={"figures": {"round": round_.id, **_budget_figures(round_), **detail}})
        done = []
        for member in round_.members:
            self._unstage(member)
            if member.reported:
                done.append(Completion(member.session_id, member.request_id, p.ProtocolError(p.ErrorCode.ROUND_FAILED, message, **detail)))
        return done


def commit_reply(arenas: ArenaBook, pool: KvPoolRecord, new: list[ChunkRecord], retired: list[p.ChunkView], round_: RoundRecord | None = None) -> p.KvCommitReply:
    """The reply to a commit, a grow or a shrink of ``pool``: its chunks ``new`` (handed
    out in fd batches before it) and ``retired``, and the round's figures if a round."""
    view = arenas.view(arenas.by_name[pool.name])
    return p.KvCommitReply(
        pool=pool.view(view),
        arena=view,
        chunks=[c.view() for c in new],
        retired=retired,
        fd_batches=map_batches(len(new)),
        round_id=round_.id if round_ else 0,
        budget=msgspec.structs.replace(round_.budget) if round_ else p.RoundBudget(),
    )
