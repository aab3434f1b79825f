"""The KV book: KV pools (arenas laid out as token-row buffers) and the commit rounds
that size them after graph capture.

A round's CAPTURE_DONE replies are deferred: the book keeps each request id and answers
with a Completion when the round commits or fails. Memory comes from the arena book;
the budget split is kv_math's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

import msgspec

from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError

from gpumemd import kv_math, kv_moves
from gpumemd.kv_moves import PendingGrow
from gpumemd.arenas import ArenaBook, map_batches
from gpumemd.config import StateConfig
from gpumemd.image import Image, Imager
from gpumemd.records import (
    ChunkRecord,
    Completion,
    KvPoolRecord,
    MemberRecord,
    Notices,
    Outcome,
    RoundRecord,
    SessionRecord,
)
from gpumemd.tally import Tally

log = logging.getLogger("gpumemd.kv_pools")

# Finished rounds stay in the status for a while.
_ROUNDS_KEPT = 16
# Weights are relative shares: beyond this ratio between two members nothing changes
# but the arithmetic (1e308 twice overflows to inf, and the split turns into NaN).
MAX_WEIGHT = 1e6


def _budget_figures(round_: RoundRecord) -> dict[str, int]:
    """The round's budget for a log line's figures; none before it was measured."""
    return {} if round_.budget == p.RoundBudget() else msgspec.structs.asdict(round_.budget)


_POOL, _ROUND, _MEMBER = Imager(KvPoolRecord), Imager(RoundRecord), Imager(MemberRecord)


class KvBookImage(msgspec.Struct):
    pools: list[Image]
    rounds: list[Image]
    next_round: int


class KvBook:
    def __init__(
        self,
        arenas: ArenaBook,
        sessions: Mapping[int, SessionRecord],
        config: StateConfig,
        clock: Callable[[], float],
        tally: Tally,
    ) -> None:
        self.arenas = arenas
        self.sessions = sessions
        self.config = config
        self.clock = clock
        self.tally = tally
        self.pools: dict[str, KvPoolRecord] = {}
        self.rounds: list[RoundRecord] = []  # the active one last; finished ones kept for status
        self.next_round = 1
        self._completions: list[Completion] = []
        self._notices: Notices = []
        self.grows: list[PendingGrow] = []

    # ------------------------------------------------------------------ lookups

    def active_rounds(self) -> list[RoundRecord]:
        return [r for r in self.rounds if r.active]

    def _owned(self, s: SessionRecord, name: str, action: str) -> KvPoolRecord:
        pool = self.pools.get(name)
        if pool is None:
            raise p.ProtocolError(p.ErrorCode.NOT_FOUND, f"no KV pool named '{name}' on device {self.arenas.device.index}")
        if pool.owner_id != s.id:
            arena = self.arenas.by_name[name]
            raise p.ProtocolError(
                p.ErrorCode.PERMISSION_DENIED, f"KV pool '{name}' belongs to {arena.owner_label()}; only its owner may {action} it"
            )
        return pool

    def _round_of(self, pool: KvPoolRecord) -> RoundRecord | None:
        return next((r for r in self.active_rounds() if r.member(pool.name)), None)

    # ------------------------------------------------------------------ requests

    def declare(self, s: SessionRecord, m: p.KvDeclare) -> Outcome:
        g = self.arenas.device.granularity
        if m.max_tokens < 0 or m.reserve_bytes < 0 or (m.max_tokens == 0) == (m.reserve_bytes == 0):
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{m.name}' needs exactly one positive bound: max_tokens ({m.max_tokens}) or reserve_bytes ({m.reserve_bytes})",
            )
        limit = self.config.max_reserve
        if m.max_tokens > limit or m.reserve_bytes > limit:  # every token row is a byte at least
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{m.name}': max_tokens ({m.max_tokens}) or reserve_bytes ({m.reserve_bytes}) is above the "
                f"daemon's limit of {limit} bytes per pool",
                limit=limit,
            )
        max_tokens = m.max_tokens or kv_math.tokens_within(m.buffers, m.reserve_bytes, g)
        if max_tokens <= 0:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"reserve_bytes {m.reserve_bytes} holds no token of KV pool '{m.name}'")
        layouts, window = kv_math.layout(m.buffers, max_tokens, g)
        if window > self.config.max_reserve:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{m.name}' needs a {window}-byte window for {max_tokens} tokens, above the limit of "
                f"{self.config.max_reserve}",
                requested=window,
                limit=self.config.max_reserve,
            )
        arena = self.arenas.create(s, m.name, window, kv=True)
        pool = KvPoolRecord(name=m.name, owner_id=s.id, buffers=layouts, max_tokens=max_tokens, granularity=g)
        self.pools[m.name] = pool
        return Outcome(p.KvDeclareReply(pool=pool.view(self.arenas.view(arena))))

    def join(self, s: SessionRecord, m: p.RoundJoin) -> Outcome:
        pool = self._owned(s, m.pool, "join a round with")
        if pool.tokens:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' already holds {pool.tokens} tokens; grow it instead")
        if m.expect < 0:  # before any round is opened or touched
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"expect must be >= 0, not {m.expect}")
        active = self.active_rounds()
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

    def capture_done(self, s: SessionRecord, m: p.CaptureDone, request_id: int) -> Outcome:
        """Record the report; the reply is deferred until the round commits or fails."""
        pool = self._owned(s, m.pool, "report capture-done for")
        round_ = self._round_of(pool)
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
        self.try_finish(round_)
        return Outcome(None)

    def grow(self, s: SessionRecord, m: p.KvGrow, request_id: int) -> Outcome:
        """Grow now if the memory is free; else ask pools above their fair share to give
        back, and answer once they did or at the move deadline (deferred)."""
        pool = self._owned(s, m.pool, "grow")
        in_round = self._round_of(pool)
        if in_round is not None:  # the round decides its tokens; a grow now would be overwritten
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' is in round {in_round.id}; it grows once the round commits")
        if not pool.tokens < m.tokens <= pool.max_tokens:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{pool.name}' holds {pool.tokens} tokens of at most {pool.max_tokens}; cannot grow to {m.tokens}",
            )
        if any(g.pool is pool for g in self.grows):
            raise p.ProtocolError(p.ErrorCode.ALREADY_EXISTS, f"a grow of KV pool '{pool.name}' is already waiting for memory")
        kv_moves.said(pool, m.in_use)
        need = kv_moves.need(pool, self.arenas.by_name[pool.name], m.tokens)
        available = self.arenas.available_bytes()
        what = f"growing KV pool '{pool.name}' from {pool.tokens} to {m.tokens} tokens"
        if need <= available:
            return Outcome(*self._grown(s, pool, m.tokens, m.tokens, []))
        claims = self._claims(pool, m.tokens)
        gives = kv_moves.donors(claims, sum(c.held for c in claims) + available, pool.name, need - available)
        if not gives:  # no pool holds more than its share: nothing to wait for
            self.tally.kv_grows_refused += 1
            self.arenas.require_available(need, what)  # refuses, with the figures
        asked = [self.pools[name] for name, _ in gives]
        for donor, (_, give) in zip(asked, gives):
            self._ask(donor, give, f"KV pool '{pool.name}' of {s.name} needs {need - available} more bytes to grow to {m.tokens} tokens")
        self.grows.append(PendingGrow(s.id, request_id, pool, m.tokens, self.clock(), self.clock() + self.config.move_timeout, asked))
        self.tally.kv_grows_deferred += 1
        figures = {"pool": pool.name, "asked_tokens": m.tokens, "need": need, "available": available}
        log.info("%s: %d bytes short; asked %s to give back", what, need - available, gives, extra={"figures": figures})
        return Outcome(None)

    def report_demand(self, s: SessionRecord, m: p.KvDemand) -> Outcome:
        kv_moves.said(self._owned(s, m.pool, "report demand for"), m.in_use)
        return Outcome(p.Ack())

    def shrink(self, s: SessionRecord, m: p.KvShrink) -> Outcome:
        pool = self._owned(s, m.pool, "shrink")
        kv_moves.said(pool, m.in_use)
        if not 0 <= m.tokens < pool.tokens:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' holds {pool.tokens} tokens; cannot shrink to {m.tokens}")
        arena = self.arenas.by_name[pool.name]
        drop: list[ChunkRecord] = []
        kept_tokens = pool.tokens
        for buffer, mine in zip(pool.buffers, kv_moves.by_buffer(pool, arena)):
            bound = buffer.offset + pool.prefix(buffer, m.tokens)
            drop += [c for c in mine if c.offset >= bound]
            kept_end = max((c.offset + c.size for c in mine if c.offset < bound), default=buffer.offset)
            kept_tokens = min(kept_tokens, (kept_end - buffer.offset) // buffer.row_bytes)
        gone = set(drop)  # a list's membership test would make this quadratic in chunks
        arena.chunks = [c for c in arena.chunks if c not in gone]
        notices: Notices = []
        self.arenas.retire(drop, notices, "", arena.name, exclude=s.id)
        pool.tokens = kept_tokens
        if pool.shrink_request is not None:
            self.tally.kv_shrinks_confirmed += 1
        pool.shrink_request = None
        log.info("KV pool %r shrank to %d tokens (asked %d), %d bytes retired", pool.name, kept_tokens, m.tokens, sum(c.size for c in drop))
        return Outcome(self._reply(pool, [], [c.view() for c in drop if s.id in c.holders]), notices=notices)

    # ------------------------------------------------------------------ what others change

    def drop_session(self, session_id: int) -> list[RoundRecord]:
        """The client went away: its members leave their rounds. Returns the active rounds,
        to finish once its memory is back."""
        self.grows = [g for g in self.grows if g.session_id != session_id]  # no one to answer
        rounds = self.active_rounds()
        for round_ in rounds:
            for member in [m for m in round_.members if m.session_id == session_id]:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{member.pool.name}: the client went away")
        return rounds

    def drop_pool(self, name: str) -> list[RoundRecord]:
        """The pool's arena is gone: forget the pool; returns the rounds it left."""
        self.pools.pop(name, None)
        for grow in [g for g in self.grows if g.pool.name == name]:
            self.grows.remove(grow)
            self._completions.append(
                Completion(grow.session_id, grow.request_id, p.ProtocolError(p.ErrorCode.NOT_FOUND, f"KV pool '{name}' was released while it waited to grow"))
            )
        left = []
        for round_ in self.active_rounds():
            for member in [m for m in round_.members if m.pool.name == name]:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{name}: the pool was released")
                left.append(round_)
        return left

    def memory_freed(self) -> None:
        """Chunks were unmapped (or a client's memory reclaimed): a round or a grow
        waiting for shrinks may go ahead now."""
        for round_ in self.active_rounds():
            if round_.state == p.RoundState.AWAITING_SHRINK:
                self.try_finish(round_)
        for grow in list(self.grows):
            self._settle(grow)

    def tick(self) -> None:
        for round_ in self.active_rounds():
            if self.clock() >= round_.deadline:
                self.try_finish(round_)
        for grow in [g for g in self.grows if self.clock() >= g.deadline]:
            self._settle(grow)

    def take_completions(self) -> list[Completion]:
        out, self._completions = self._completions, []
        return out

    def take_notices(self) -> Notices:
        out, self._notices = self._notices, []
        return out

    # ------------------------------------------------------------------ the durable record

    def image(self) -> KvBookImage:
        now = self.clock()
        rounds = [
            _ROUND.image(
                r,
                created=now - r.created,  # seconds since: monotonic clocks do not survive a restart
                deadline=r.deadline - now,  # seconds left
                members=[_MEMBER.image(m, pool=m.pool.name, staged=[c.id for c in m.staged]) for m in r.members],
            )
            for r in self.rounds
        ]
        return KvBookImage([_POOL.image(k) for k in self.pools.values()], rounds, self.next_round)

    def restore(self, part: object) -> None:
        """The book as ``image`` left it (the arena book restored first); a pool whose
        arena was not rebuilt is dropped, and its members with it."""
        book = msgspec.convert(part, KvBookImage)
        for pool in (_POOL.restore(k) for k in book.pools):
            if pool.name in self.arenas.by_name:
                self.pools[pool.name] = pool
        chunks = {c.id: c for a in self.arenas.by_name.values() for c in a.chunks}
        now = self.clock()
        for image in (_ROUND.fields(r) for r in book.rounds):
            members = [
                _MEMBER.restore(m, pool=self.pools[m["pool"]], staged=[chunks[c] for c in m["staged"] if c in chunks])
                for m in (_MEMBER.fields(i) for i in image["members"])
                if m["pool"] in self.pools
            ]
            round_ = _ROUND.restore(image, members=members)
            round_.created, round_.deadline = now - round_.created, now + round_.deadline
            self.rounds.append(round_)
        self.next_round = book.next_round

    # ------------------------------------------------------------------ the round

    def try_finish(self, round_: RoundRecord) -> None:
        """Commit the round once every member reported (or its deadline passed)."""
        now = self.clock()
        if not round_.active:
            return
        late = now >= round_.deadline
        absent = max(0, round_.expect - round_.joined)
        if (round_.pending or absent) and not late:
            return
        if round_.pending or absent:
            missing = ", ".join(
                [f"{m.client}/{m.pool.name}" for m in round_.pending] + ([f"{absent} expected pool(s) that never joined"] if absent else [])
            )
            if round_.policy == p.RoundPolicy.FAIL:
                self._fail(round_, f"round {round_.id} passed its deadline; these members did not report capture-done: {missing}")
                return
            for member in round_.pending:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{member.pool.name}: did not report capture-done by the deadline")
            log.warning("round %d: deadline passed; committing without %s", round_.id, missing)
        members = list(round_.members)
        if not members:
            round_.state = p.RoundState.FAILED
            round_.error = "no member reported capture-done"
            self._ended(round_)
            return
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
        try:
            tokens = kv_math.split(members, max(budget, 0))
        except kv_math.BudgetShort as short:
            if round_.state == p.RoundState.OPEN and not late and self._ask_shrinks(round_, short.needed - max(budget, 0)):
                round_.state = p.RoundState.AWAITING_SHRINK
                return
            if round_.state == p.RoundState.AWAITING_SHRINK and not late:
                return
            self._fail(
                round_,
                f"round {round_.id}: the members' minimum KV needs {short.needed} bytes but the budget is {budget} "
                f"(free {free} - reserve {reserve} - headroom {headroom})",
                needed=short.needed,
                budget=budget,
            )
            return
        work = []
        for member in members:
            arena = self.arenas.by_name[member.pool.name]
            work += [(arena, offset, size) for offset, size in kv_moves.missing(member.pool, arena, tokens[member])]
        started = time.perf_counter()
        try:
            self.arenas.create_chunks(work, max(budget, 0), ladder=False)
        except p.ProtocolError as exc:
            self._fail(round_, f"round {round_.id}: {exc.message}")
            return
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
            reply = self._reply(member.pool, new, [], round_)
            self._completions.append(Completion(member.session_id, member.request_id, reply, self.arenas.hand(self.sessions[member.session_id], new)))
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

    def _fail(self, round_: RoundRecord, message: str, **detail: int | str) -> None:
        round_.state = p.RoundState.FAILED
        round_.error = message
        self._ended(round_)
        log.warning("%s", message, extra={"figures": {"round": round_.id, **_budget_figures(round_), **detail}})
        for member in round_.members:
            self._unstage(member)
            if member.reported:
                error = p.ProtocolError(p.ErrorCode.ROUND_FAILED, message, **detail)
                self._completions.append(Completion(member.session_id, member.request_id, error))

    def _ask_shrinks(self, round_: RoundRecord, deficit: int) -> bool:
        """Ask pools committed earlier to give back ``deficit`` bytes, in proportion to
        what they hold above their floor. Only their owners can free rows; nothing is
        taken without the owner's KV_SHRINK."""
        in_round = {m.pool.name for m in round_.members}
        donors = [pool for pool in self.pools.values() if pool.name not in in_round and pool.owner_id in self.sessions]
        spare = {pool: kv_moves.spare(pool, self.arenas.by_name[pool.name]) for pool in donors}
        donors = [pool for pool in donors if spare[pool] > 0]
        total = sum(spare[pool] for pool in donors)
        if total < deficit:
            return False
        names = ", ".join(f"{m.client}/{m.pool.name}" for m in round_.members)
        for pool in donors:
            self._ask(pool, -(-deficit * spare[pool] // total), f"round {round_.id} ({names}) needs {deficit} bytes")
        return True

    # ------------------------------------------------------------------ runtime moves

    def demand(self, pool: KvPoolRecord) -> int:
        return kv_moves.demand(pool, next((g.tokens for g in self.grows if g.pool is pool), None))

    def _claims(self, taker: KvPoolRecord | None = None, tokens: int = 0) -> list[kv_moves.Claim]:
        """Every committed pool (and the taker) as the move policy sees it."""
        out = []
        for pool in self.pools.values():
            if not (pool.tokens or pool is taker) or self._round_of(pool) is not None:
                continue
            floor = kv_moves.floor(pool)
            demand = max(tokens, floor) if pool is taker else self.demand(pool)
            held = sum(c.size for c in self.arenas.by_name[pool.name].chunks)
            out.append(kv_moves.Claim(pool.name, held, pool.cost(floor), pool.cost(demand), pool.weight, idle=pool.in_use == 0))
        return out

    def shares(self) -> dict[str, int]:
        """Each committed pool's fair share in bytes, for the status."""
        claims = self._claims()
        return kv_moves.fair_shares(claims, sum(c.held for c in claims) + self.arenas.available_bytes())

    def _ask(self, pool: KvPoolRecord, give: int, why: str) -> None:
        """Send ``pool`` a KV_SHRINK notice for the most tokens that free ``give`` bytes."""
        lo = kv_moves.shrink_bound(pool, self.arenas.by_name[pool.name], give)
        pool.shrink_request = lo
        message = f"gpumemd asks for {give} bytes back: {why}. When rows from {lo} on are free, confirm with shrink({lo})"
        self._notices.append((pool.owner_id, p.Notice(kind=p.NoticeKind.KV_SHRINK, arena=pool.name, tokens=lo, message=message)))
        self.tally.kv_shrinks_asked += 1

    def _grown(self, s: SessionRecord, pool: KvPoolRecord, tokens: int, asked: int, unanswered: list[str]) -> tuple[p.KvCommitReply, list[ChunkRecord]]:
        arena = self.arenas.by_name[pool.name]
        work = [(arena, offset, size) for offset, size in kv_moves.missing(pool, arena, tokens)]
        new = self.arenas.create_chunks(work, self.arenas.available_bytes(), ladder=False) if work else []
        pool.tokens = max(pool.tokens, tokens)
        reply = msgspec.structs.replace(self._reply(pool, new, []), asked_tokens=asked, unanswered=unanswered)
        return reply, self.arenas.hand(s, new)

    def _settle(self, grow: PendingGrow) -> None:
        """Answer a waiting grow once its memory is free, or at its deadline with what
        fits then (OUT_OF_MEMORY if nothing), naming the pools that did not give back."""
        pool, arena, now = grow.pool, self.arenas.by_name[grow.pool.name], self.clock()
        available = self.arenas.available_bytes()
        full = kv_moves.need(pool, arena, grow.tokens) <= available
        if not full and now < grow.deadline and any(d.shrink_request is not None and d.name in self.pools for d in grow.asked):
            return
        self.grows.remove(grow)
        unanswered = [f"{self.arenas.by_name[d.name].owner_name}/{d.name}" for d in grow.asked if d.shrink_request is not None and d.name in self.pools]
        tokens = grow.tokens if full else kv_moves.most_within(pool, arena, grow.tokens, available)
        figures = {"pool": pool.name, "asked_tokens": grow.tokens, "tokens": tokens, "waited_ms": round((now - grow.created) * 1e3, 3)}
        before = self.arenas.accounted_bytes()
        try:
            if tokens == pool.tokens:
                message = f"KV pool '{pool.name}': nothing came free within {self.config.move_timeout:g}s; not answered: {', '.join(unanswered) or 'none'}"
                self.arenas.require_available(kv_moves.need(pool, arena, grow.tokens), message)  # refuses, with the figures
            reply, handout = self._grown(self.sessions[grow.session_id], pool, tokens, grow.tokens, unanswered)
        except p.ProtocolError as exc:
            self.tally.kv_grows_refused += 1
            self._completions.append(Completion(grow.session_id, grow.request_id, exc))
            return
        moved = self.arenas.accounted_bytes() - before
        self.tally.kv_grew(full, moved, now - grow.created)
        log.info(
            "KV pool %r grew to %d tokens (asked %d) after %.0f ms: %d bytes; not answered: %s",
            pool.name, tokens, grow.tokens, (now - grow.created) * 1e3, moved, ", ".join(unanswered) or "none",
            extra={"figures": {**figures, "bytes": moved}},
        )
        self._completions.append(Completion(grow.session_id, grow.request_id, reply, handout))

    def _reply(self, pool: KvPoolRecord, new: list[ChunkRecord], retired: list[p.ChunkView], round_: RoundRecord | None = None) -> p.KvCommitReply:
        view = self.arenas.view(self.arenas.by_name[pool.name])
        return p.KvCommitReply(
            pool=pool.view(view),
            arena=view,
            chunks=[c.view() for c in new],
            retired=retired,
            fd_batches=map_batches(len(new)),
            round_id=round_.id if round_ else 0,
            budget=msgspec.structs.replace(round_.budget) if round_ else p.RoundBudget(),
        )

