"""The KV book: KV pools (arenas laid out as token-row buffers) and the commit rounds
that size them after graph capture.

A round's CAPTURE_DONE replies are deferred: the book keeps each request id and answers
with a Completion when the round commits or fails. Memory comes from the arena book;
the budget split is kv_math's.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Mapping

import msgspec

from gpumem_shared import protocol as p
from gpumem_shared.driver import DriverError

from gpumemd import kv_math
from gpumemd.arenas import ArenaBook, map_batches
from gpumemd.checks import check_name
from gpumemd.config import StateConfig
from gpumemd.image import Image, Imager
from gpumemd.records import (
    ArenaRecord,
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
        check_name(m.name, "KV pool name")
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

    def grow(self, s: SessionRecord, m: p.KvGrow) -> Outcome:
        pool = self._owned(s, m.pool, "grow")
        in_round = self._round_of(pool)
        if in_round is not None:  # the round decides its tokens; a grow now would be overwritten
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' is in round {in_round.id}; it grows once the round commits")
        if not pool.tokens < m.tokens <= pool.max_tokens:
            raise p.ProtocolError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"KV pool '{pool.name}' holds {pool.tokens} tokens of at most {pool.max_tokens}; cannot grow to {m.tokens}",
            )
        arena = self.arenas.by_name[pool.name]
        wanted = self._missing(pool, arena, m.tokens)
        need = sum(size for _, size in wanted)
        available = self.arenas.require_available(need, f"growing KV pool '{pool.name}' from {pool.tokens} to {m.tokens} tokens")
        new = self.arenas.create_chunks([(arena, offset, size) for offset, size in wanted], available, ladder=False)
        pool.tokens = m.tokens
        return Outcome(self._reply(pool, new, []), handout=self.arenas.hand(s, new))

    def shrink(self, s: SessionRecord, m: p.KvShrink) -> Outcome:
        pool = self._owned(s, m.pool, "shrink")
        if not 0 <= m.tokens < pool.tokens:
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' holds {pool.tokens} tokens; cannot shrink to {m.tokens}")
        arena = self.arenas.by_name[pool.name]
        drop: list[ChunkRecord] = []
        kept_tokens = pool.tokens
        for buffer, mine in zip(pool.buffers, _by_buffer(pool, arena)):
            bound = buffer.offset + pool.prefix(buffer, m.tokens)
            drop += [c for c in mine if c.offset >= bound]
            kept_end = max((c.offset + c.size for c in mine if c.offset < bound), default=buffer.offset)
            kept_tokens = min(kept_tokens, (kept_end - buffer.offset) // buffer.row_bytes)
        gone = set(drop)  # a list's membership test would make this quadratic in chunks
        arena.chunks = [c for c in arena.chunks if c not in gone]
        notices: Notices = []
        self.arenas.retire(drop, notices, "", arena.name, exclude=s.id)
        pool.tokens = kept_tokens
        pool.shrink_request = None
        log.info("KV pool %r shrank to %d tokens (asked %d), %d bytes retired", pool.name, kept_tokens, m.tokens, sum(c.size for c in drop))
        return Outcome(self._reply(pool, [], [c.view() for c in drop if s.id in c.holders]), notices=notices)

    # ------------------------------------------------------------------ what others change

    def drop_session(self, session_id: int) -> list[RoundRecord]:
        """The client went away: its members leave their rounds. Returns the active rounds,
        to finish once its memory is back."""
        rounds = self.active_rounds()
        for round_ in rounds:
            for member in [m for m in round_.members if m.session_id == session_id]:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{member.pool.name}: the client went away")
        return rounds

    def drop_pool(self, name: str) -> list[RoundRecord]:
        """The pool's arena is gone: forget the pool; returns the rounds it left."""
        self.pools.pop(name, None)
        left = []
        for round_ in self.active_rounds():
            for member in [m for m in round_.members if m.pool.name == name]:
                round_.members.remove(member)
                round_.dropped.append(f"{member.client}/{name}: the pool was released")
                left.append(round_)
        return left

    def memory_freed(self) -> None:
        """Chunks were unmapped: a round waiting for shrinks may commit now."""
        for round_ in self.active_rounds():
            if round_.state == p.RoundState.AWAITING_SHRINK:
                self.try_finish(round_)

    def tick(self) -> None:
        for round_ in self.active_rounds():
            if self.clock() >= round_.deadline:
                self.try_finish(round_)

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
            work += [(arena, offset, size) for offset, size in self._missing(member.pool, arena, tokens[member])]
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
        work = [(arena, offset, size) for offset, size in self._missing(member.pool, arena, member.report.min_tokens)]
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
        what they hold above their minimum. Only their owners can free rows; nothing is
        taken without the owner's KV_SHRINK."""
        in_round = {m.pool.name for m in round_.members}
        donors = [
            pool
            for pool in self.pools.values()
            if pool.name not in in_round and pool.tokens > pool.min_tokens and pool.owner_id in self.sessions
        ]
        # A shrink gives back whole chunks only (KV_SHRINK keeps any chunk the bound falls
        # in), so count and ask for what chunk boundaries can actually free.
        spare = {pool: self._freeable(pool, pool.min_tokens) for pool in donors}
        donors = [pool for pool in donors if spare[pool] > 0]
        total = sum(spare[pool] for pool in donors)
        if total < deficit:
            return False
        for pool in donors:
            give = -(-deficit * spare[pool] // total)
            lo, hi = pool.min_tokens, pool.tokens  # freeable(lo) >= give; the most tokens that free it
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._freeable(pool, mid) >= give:
                    lo = mid
                else:
                    hi = mid - 1
            pool.shrink_request = lo
            names = ", ".join(f"{m.client}/{m.pool.name}" for m in round_.members)
            notice = p.Notice(
                kind=p.NoticeKind.KV_SHRINK,
                arena=pool.name,
                tokens=lo,
                message=f"gpumemd needs {deficit} bytes for round {round_.id} ({names}): when rows from "
                f"{lo} on are free, confirm with shrink({lo})",
            )
            self._notices.append((pool.owner_id, notice))
        return True

    def _freeable(self, pool: KvPoolRecord, tokens: int) -> int:
        """Bytes KV_SHRINK to ``tokens`` would give back: the chunks past every buffer's bound."""
        freed = 0
        for buffer, mine in zip(pool.buffers, _by_buffer(pool, self.arenas.by_name[pool.name])):
            bound = buffer.offset + pool.prefix(buffer, tokens)
            freed += sum(c.size for c in mine if c.offset >= bound)
        return freed

    def _missing(self, pool: KvPoolRecord, arena: ArenaRecord, tokens: int) -> list[tuple[int, int]]:
        """(offset, size) still to commit so every buffer holds ``tokens`` rows."""
        out = []
        for buffer, mine in zip(pool.buffers, _by_buffer(pool, arena)):
            have = max((c.offset + c.size for c in mine), default=buffer.offset)
            want = buffer.offset + pool.prefix(buffer, tokens)
            if want > have:
                out.append((have, want - have))
        return out

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


def _by_buffer(pool: KvPoolRecord, arena: ArenaRecord) -> list[list[ChunkRecord]]:
    """Each buffer's chunks, in one pass over the arena's: a pool may have thousands of
    buffers and as many chunks, and a scan of every chunk per buffer held the daemon's
    only thread for seconds (found by the protocol fuzzer)."""
    starts = [b.offset for b in pool.buffers]  # the layout places them in order
    out: list[list[ChunkRecord]] = [[] for _ in pool.buffers]
    for chunk in arena.chunks:
        i = bisect.bisect_right(starts, chunk.offset) - 1
        if i >= 0 and chunk.offset < pool.buffers[i].offset + pool.buffers[i].region:
            out[i].append(chunk)
    return out
