"""The KV book: KV pools (arenas laid out as token-row buffers), the commit rounds that
size them after graph capture (kv_rounds.py, the book's round desk), and the moves that
resize them at run time: grows, and the shrinks that make room for them.

A round's CAPTURE_DONE replies, and a grow that waits for others to give back, are
deferred: the book keeps each request id and answers with a Completion. Memory comes
from the arena book; the budget split is kv_math's, the move policy kv_moves'.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

import msgspec

from gpumem_shared import protocol as p

from gpumemd import kv_math, kv_moves
from gpumemd.kv_moves import PendingGrow
from gpumemd.kv_rounds import RoundDesk, commit_reply
from gpumemd.arenas import ArenaBook
from gpumemd.config import StateConfig
from gpumemd.image import Image, Imager
from gpumemd.records import ChunkRecord, Completion, KvPoolRecord, Notices, Outcome, RoundRecord, SessionRecord, wait_deadline
from gpumemd.tally import Tally

log = logging.getLogger("gpumemd.kv_pools")

_POOL = Imager(KvPoolRecord)


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
        wall_clock: Callable[[], float],
        tally: Tally,
    ) -> None:
        self.arenas = arenas
        self.sessions = sessions
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.tally = tally
        self.pools: dict[str, KvPoolRecord] = {}
        self._completions: list[Completion] = []
        self._notices: Notices = []
        self.grows: list[PendingGrow] = []
        # Pools that answered a request keeping more than asked (their live rows stood in
        # the way), by name: (tokens kept, use said). While both stay so, asking again is
        # futile and would cost the next grow a step of that engine: what it kept is its
        # minimum to the move policy. Not in the durable record: after a restart it is asked afresh.
        self.kept_live: dict[str, tuple[int, int]] = {}
        # When each pool last confirmed a shrink that retired chunks (the book's clock): what
        # it still maps of them past --move-timeout it keeps, and it counts against it. Not
        # in the durable record: after a restart whatever it still maps counts at once.
        self.confirmed: dict[str, float] = {}
        self.desk = RoundDesk(arenas, sessions, config, clock, tally, self.pools)

    # ------------------------------------------------------------------ lookups

    @property
    def rounds(self) -> list[RoundRecord]:
        """The active one last; finished ones kept for status."""
        return self.desk.rounds

    def active_rounds(self) -> list[RoundRecord]:
        return self.desk.active()

    def try_finish(self, round_: RoundRecord) -> None:
        """A step of the round (kv_rounds.py): its answers to send, and the shrinks its
        minimums need asked by the one donor rule (none unless the donors cover them)."""
        step = self.desk.try_finish(round_)
        if step.short:
            step.done = self.desk.asked(round_, step, bool(self.ask_back(step.short, step.why, whole=True)))
        self._completions += step.done

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
        if self.arenas.by_name[pool.name].asleep:  # a round's rows would wake it behind the sleeper's back
            raise p.ProtocolError(p.ErrorCode.ARENA_ASLEEP, f"KV pool '{pool.name}' sleeps: grow it back to wake it", arena=pool.name)
        return self.desk.join(s, pool, m)

    def capture_done(self, s: SessionRecord, m: p.CaptureDone, request_id: int) -> Outcome:
        """Record the report; the reply is deferred until the round commits or fails."""
        pool = self._owned(s, m.pool, "report capture-done for")
        outcome = self.desk.report(s, pool, m, request_id)
        round_ = self.desk.of(pool)
        if round_ is not None:
            self.try_finish(round_)
        return outcome

    def grow(self, s: SessionRecord, m: p.KvGrow, request_id: int) -> Outcome:
        """Grow now if the memory is free; else ask pools above their fair share to give
        back, and answer once they did or at the move deadline (deferred)."""
        pool = self._owned(s, m.pool, "grow")
        in_round = self.desk.of(pool)
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
        now = self.clock()
        deadline = max(now + self.config.move_timeout, wait_deadline(m.wait, now, f"growing KV pool '{pool.name}'"))
        tokens = self._within_cap(pool, m.tokens)
        need = kv_moves.need(pool, self.arenas.by_name[pool.name], tokens)
        available = self._available(pool)
        what = f"growing KV pool '{pool.name}' from {pool.tokens} to {tokens} tokens{self._kept_named()}"
        if need <= available:
            return Outcome(*self._grown(s, pool, tokens, m.tokens, [], []))
        short = need - available
        asked = self.ask_back(short, f"KV pool '{pool.name}' of {s.name} needs {short} more bytes to grow to {tokens} tokens", pool, tokens)
        if not asked and not m.wait:  # no pool holds more than its share: nothing to wait for
            self.tally.kv_grows_refused += 1
            self.arenas.require_available(need, what)  # refuses, with the figures
        self.grows.append(PendingGrow(s.id, request_id, now, deadline, pool=pool, tokens=tokens, asked=asked, whole=m.wait > 0))
        self.tally.kv_grows_deferred += 1
        figures = {"pool": pool.name, "asked_tokens": tokens, "need": need, "available": available}
        log.info("%s: %d bytes short; asked %s to give back", what, short, [d.name for d in asked], extra={"figures": figures})
        return Outcome(None)

    def _within_cap(self, pool: KvPoolRecord, tokens: int) -> int:
        """The most of ``tokens`` the pool's tenant may hold under its cap (memory_caps.py): a
        grow past it gets what fits, one with no row to gain is refused, naming the cap."""
        arena = self.arenas.by_name[pool.name]
        room = self.arenas.caps.room(arena)
        need = kv_moves.need(pool, arena, tokens)
        if room is None or need <= room:
            return tokens
        most = kv_moves.most_within(pool, arena, tokens, room)
        if most <= pool.tokens:
            self.arenas.caps.check([(arena, 0, need)], self.arenas.available_bytes)  # refuses, naming the cap
        return most

    def _available(self, pool: KvPoolRecord) -> int:
        """Free for ``pool``'s grow: what other tenants are guaranteed and do not hold is not."""
        caps = self.arenas.caps
        held_back = caps.held_back(caps.accounts_of([(self.arenas.by_name[pool.name], 0, 0)]))
        return max(0, self.arenas.available_bytes() - held_back)

    def report_demand(self, s: SessionRecord, m: p.KvDemand) -> Outcome:
        kv_moves.said(self._owned(s, m.pool, "report demand for"), m.in_use)
        return Outcome(p.Ack())

    def shrink(self, s: SessionRecord, m: p.KvShrink) -> Outcome:
        pool = self._owned(s, m.pool, "shrink")
        kv_moves.said(pool, m.in_use)
        # A shrink to the tokens held answers a request with nothing to give (every row
        # asked for is live): the grow waiting for it is answered now, not at the deadline.
        answer = m.tokens == pool.tokens and pool.shrink_request is not None and not m.sleep
        if not (0 <= m.tokens < pool.tokens or answer):
            raise p.ProtocolError(p.ErrorCode.INVALID_ARGUMENT, f"KV pool '{pool.name}' holds {pool.tokens} tokens; cannot shrink to {m.tokens}")
        arena = self.arenas.by_name[pool.name]
        if m.sleep:
            if m.tokens or not 0 <= m.kept_bytes <= arena.committed:
                raise p.ProtocolError(
                    p.ErrorCode.INVALID_ARGUMENT,
                    f"KV pool '{pool.name}' sleeps by a shrink to 0 tokens (not {m.tokens}) keeping at most its committed "
                    f"{arena.committed} bytes (not {m.kept_bytes})",
                )
            # A pool asleep holds nothing and wants nothing: no share, never asked to give
            # back; its wake is a grow like any.
            self.arenas.fall_asleep(arena, arena.committed, m.kept_bytes, self.wall_clock())
            log.info("KV pool %r of client %r asleep: %d bytes handed back, %d kept in host memory", pool.name, s.name, arena.committed,
                     m.kept_bytes, extra={"figures": {"arena": pool.name, "committed": arena.committed, "kept": m.kept_bytes}})
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
        if drop:
            self.confirmed[pool.name] = self.clock()
        if pool.shrink_request is not None:
            self.tally.kv_shrinks_confirmed += 1
            if kept_tokens > pool.shrink_request:
                self.kept_live[pool.name] = (kept_tokens, pool.in_use)
            else:
                self.kept_live.pop(pool.name, None)
        pool.shrink_request = None
        log.info("KV pool %r shrank to %d tokens (asked %d), %d bytes retired", pool.name, kept_tokens, m.tokens, sum(c.size for c in drop))
        outcome = Outcome(commit_reply(self.arenas, pool, [], [c.view() for c in drop if s.id in c.holders]), notices=notices)
        if not drop:
            # An answer with nothing to give: a grow, round or wake that waited for it goes
            # ahead now with what is free (what it gave, the arena book says came free).
            self.arenas.freed = True
        return outcome

    # ------------------------------------------------------------------ what others change

    def drop_session(self, session_id: int) -> list[RoundRecord]:
        """The client went away: its members leave their rounds. Returns the active rounds,
        to finish once its memory is back."""
        self.grows = [g for g in self.grows if g.session_id != session_id]  # no one to answer
        return self.desk.drop_session(session_id)

    def drop_pool(self, name: str) -> list[RoundRecord]:
        """The pool's arena is gone (its client died or closed, or released it): forget the
        pool, naming it to the grows it had not answered yet; returns the rounds it left."""
        pool = self.pools.pop(name, None)
        self.kept_live.pop(name, None)
        self.confirmed.pop(name, None)
        if pool is not None and pool.shrink_request is not None:
            label = f"{self.arenas.by_name[name].owner_name}/{name}"
            for grow in self.grows:
                if any(d is pool for d in grow.asked):
                    grow.gone.append(label)
        for grow in [g for g in self.grows if g.pool.name == name]:
            self.grows.remove(grow)
            self._completions.append(
                Completion(grow.session_id, grow.request_id, p.ProtocolError(p.ErrorCode.NOT_FOUND, f"KV pool '{name}' was released while it waited to grow"))
            )
        return self.desk.drop_pool(name)

    def transfer(self, name: str, s: SessionRecord) -> None:
        """``s`` owns pool ``name`` (if arena ``name`` is one) from now on: an adoption."""
        pool = self.pools.get(name)
        if pool is not None:
            pool.owner_id = s.id

    def memory_freed(self) -> None:
        """Chunks were unmapped (or a client's memory reclaimed): a round or a grow
        waiting for shrinks may go ahead now."""
        for round_ in self.desk.awaiting():
            self.try_finish(round_)
        for grow in list(self.grows):
            self._settle(grow)

    def tick(self) -> None:
        for round_ in self.desk.late():
            self.try_finish(round_)
        for grow in [g for g in self.grows if g.whole or self.clock() >= g.deadline]:  # one that waits for all its rows may ask again
            self._settle(grow)

    def take_completions(self) -> list[Completion]:
        out, self._completions = self._completions, []
        return out

    def has_mail(self) -> bool:
        return bool(self._notices or self._completions)

    def take_notices(self) -> Notices:
        out, self._notices = self._notices, []
        return out

    # ------------------------------------------------------------------ the durable record

    def image(self) -> KvBookImage:
        return KvBookImage([_POOL.image(k) for k in self.pools.values()], self.desk.image(), self.desk.next_round)

    def restore(self, part: object) -> None:
        """The book as ``image`` left it (the arena book restored first); a pool whose
        arena was not rebuilt is dropped, and its members with it."""
        book = msgspec.convert(part, KvBookImage)
        for pool in (_POOL.restore(k) for k in book.pools):
            if pool.name in self.arenas.by_name:
                self.pools[pool.name] = pool
        self.desk.restore(book.rounds, book.next_round)

    # ------------------------------------------------------------------ the round

    # ------------------------------------------------------------------ runtime moves

    def demand(self, pool: KvPoolRecord) -> int:
        waiting = next((g.tokens for g in self.grows if g.pool is pool), None)
        if waiting is None and self.arenas.by_name[pool.name].asleep:
            return 0  # whatever its engine used before its sleep
        return kv_moves.demand(pool, waiting)

    def _claims(self, taker: KvPoolRecord | None = None, tokens: int = 0) -> list[kv_moves.Claim]:
        """Every committed pool (and the taker) as the move policy sees it; not one in a
        round, nor one asleep (it holds nothing: a sleep shrinks it to 0 tokens, and a
        round cannot commit it) unless it is the taker, whose grow wakes it."""
        out = []
        kept = self.kept_mapped()
        for pool in self.pools.values():
            if not (pool.tokens or pool is taker) or self.desk.of(pool) is not None:
                continue
            floor = kv_moves.floor(pool)
            if pool is not taker and self.kept_live.get(pool.name) == (pool.tokens, pool.in_use):
                floor = max(floor, pool.tokens)  # it answered so a moment ago, and nothing changed since
            demand = max(tokens, floor) if pool is taker else self.demand(pool)
            held = sum(c.size for c in self.arenas.by_name[pool.name].chunks) + kept.get(pool.name, 0)
            out.append(kv_moves.Claim(pool.name, held, pool.cost(floor), pool.cost(demand), pool.weight, idle=pool.in_use == 0))
        return self._evened(out)

    def _evened(self, claims: list[kv_moves.Claim]) -> list[kv_moves.Claim]:
        """The weights and minimums engines declare, bounded across tenants: a pool's
        weight divides its own tenant's (each tenant weighs 1 however its engines weigh
        their pools), and a tenant's minimums guard at most its even part of what the
        pools hold and what is free. One tenant alone: as declared."""
        tenant = {c.name: self.arenas.caps.tenant(c.name) for c in claims}
        count = len(set(tenant.values()))
        if count < 2:
            return claims
        weights: dict[str, float] = {}
        floors: dict[str, int] = {}
        for c in claims:
            weights[tenant[c.name]] = weights.get(tenant[c.name], 0.0) + c.weight
            floors[tenant[c.name]] = floors.get(tenant[c.name], 0) + c.minimum
        part = (sum(c.held for c in claims) + self.arenas.available_bytes()) // count
        out = []
        for c in claims:
            t = tenant[c.name]
            minimum = c.minimum if floors[t] <= part else c.minimum * part // floors[t]
            out.append(dataclasses.replace(c, minimum=minimum, weight=c.weight / weights[t]))
        return out

    def kept_mapped(self) -> dict[str, int]:
        """The bytes each pool gave back by a confirmed shrink and still maps past
        --move-timeout (its owner never reported the unmap): memory it keeps, which counts
        against it as what it holds (its share, what it is asked to give), and which a
        grow's answer names."""
        now, late = self.clock(), self.config.move_timeout
        out: dict[str, int] = {}
        for chunk in self.arenas.retiring.values():
            pool = self.pools.get(chunk.arena)
            if pool is not None and pool.owner_id in chunk.holders and now - self.confirmed.get(pool.name, now - late) >= late:
                out[pool.name] = out.get(pool.name, 0) + chunk.size
        return out

    def _kept_named(self) -> str:
        kept = self.kept_mapped()
        named = ", ".join(f"{self.arenas.by_name[n].owner_name}/{n} {size} bytes" for n, size in sorted(kept.items()))
        return f"; still mapped after a confirmed shrink (never unmapped): {named}" if named else ""

    def shares(self) -> dict[str, int]:
        """Each committed pool's fair share in bytes, for the status."""
        claims = self._claims()
        return kv_moves.fair_shares(claims, sum(c.held for c in claims) + self.arenas.available_bytes())

    def ask_back(self, short: int, why: str, taker: KvPoolRecord | None = None, tokens: int = 0, *, whole: bool = False) -> list[KvPoolRecord]:
        """The one donor rule: a grow (``taker``, to ``tokens``), a round's minimums and a
        wake all ask through it for the ``short`` bytes they lack. Pools holding more than
        their fair share give back (kv_moves.donors: idle ones first); the taker claims its
        share beside them, a need without one is set aside before the split. Not asked: a
        pool in a round, one whose own grow waits (its engine's view of its rows is about
        to change, and it would give back what it waits for), one whose owner is gone
        (nobody can answer for an orphan), and below what a pool kept live a moment ago
        (``kept_live``). A pool asked already is asked again only for more (a lower bound):
        its answer serves this need too. ``whole``: ask nobody unless the donors cover all of ``short``. Returns
        the pools whose answers the need waits for."""
        claims = self._claims(taker, tokens)
        minimums = {c.name: c.minimum for c in claims}
        held = sum(c.held for c in claims)
        total = held + self._available(taker) if taker is not None else held - short
        gives = [
            (self.pools[name], give)
            for name, give in kv_moves.donors(claims, max(0, total), taker.name if taker else "", short)
            if not any(g.pool.name == name for g in self.grows) and self.pools[name].owner_id in self.sessions
        ]
        bounds = []
        for pool, give in self._above_minimums(gives, taker):
            least = pool.most_tokens_within(minimums[pool.name], pool.tokens)  # its floor, evened across tenants
            lo = kv_moves.shrink_bound(pool, self.arenas.by_name[pool.name], give, least)
            if lo < pool.tokens:  # not one above its share by what it keeps mapped alone: its live rows are its floor
                bounds.append((pool, give, lo))
        if whole and sum(give for _, give, _ in bounds) < short:
            return []
        for pool, give, lo in bounds:
            if pool.shrink_request is None or lo < pool.shrink_request:
                pool.shrink_request = lo
                message = f"gpumemd asks for {give} bytes back: {why}. When rows from {lo} on are free, confirm with shrink({lo})"
                self._notices.append((pool.owner_id, p.Notice(kind=p.NoticeKind.KV_SHRINK, arena=pool.name, tokens=lo, message=message)))
                self.tally.kv_shrinks_asked += 1
        return [pool for pool, _, _ in bounds]

    def _above_minimums(self, gives: list[tuple[KvPoolRecord, int]], taker: KvPoolRecord | None) -> list[tuple[KvPoolRecord, int]]:
        """``gives`` less what would take a donor's tenant below its guaranteed minimum
        (memory_caps.py) for another tenant's need: memory given back from under a
        minimum is held back for that tenant, and the taker could not use it."""
        caps = self.arenas.caps
        found = caps.account_of(taker.name) if taker is not None else None
        taking = found[0] if found is not None else ""
        spare: dict[str, int] = {}
        used: dict[str, int] | None = None
        out = []
        for pool, give in gives:
            found = caps.account_of(pool.name)
            if found is not None and found[1].min_bytes and found[0] != taking:
                used = caps.usage() if used is None else used
                left = spare.setdefault(found[0], max(0, used.get(found[0], 0) - found[1].min_bytes))
                give = min(give, left)
                spare[found[0]] = left - give
            if give > 0:
                out.append((pool, give))
        return out

    def _grown(
        self, s: SessionRecord, pool: KvPoolRecord, tokens: int, asked: int, unanswered: list[str], gone: list[str]
    ) -> tuple[p.KvCommitReply, list[ChunkRecord]]:
        arena = self.arenas.by_name[pool.name]
        work = [(arena, offset, size) for offset, size in kv_moves.missing(pool, arena, tokens)]
        new = self.arenas.create_chunks(work, self.arenas.available_bytes(), ladder=False) if work else []
        pool.tokens = max(pool.tokens, tokens)
        if pool.tokens and self.arenas.wake(arena) is not None:
            log.info("KV pool %r of client %r awake: grown to %d tokens", pool.name, s.name, pool.tokens)
        reply = msgspec.structs.replace(commit_reply(self.arenas, pool, new, []), asked_tokens=asked, unanswered=unanswered, gone=gone)
        return reply, self.arenas.hand(s, new)

    def _settle(self, grow: PendingGrow) -> None:
        """Answer a waiting grow once its memory is free, or at its deadline with what
        fits then (OUT_OF_MEMORY if nothing), naming the pools that did not give back and
        those that went away before they answered."""
        pool, arena, now = grow.pool, self.arenas.by_name[grow.pool.name], self.clock()
        available = self._available(pool)
        full = kv_moves.need(pool, arena, grow.tokens) <= available
        # A pool that went is not waited for, nor one of its name declared since.
        waiting = [d for d in grow.asked if d.shrink_request is not None and self.pools.get(d.name) is d]
        if not full and now < grow.deadline and (waiting or grow.whole):
            if not waiting:  # a grow that waits for all its rows: every pool asked answered, and it is short still
                short = kv_moves.need(pool, arena, grow.tokens) - available
                grow.asked = self.ask_back(short, f"KV pool '{pool.name}' needs {short} more bytes to grow to {grow.tokens} tokens", pool, grow.tokens)
            return
        self.grows.remove(grow)
        unanswered = [f"{self.arenas.by_name[d.name].owner_name}/{d.name}" for d in waiting]
        named = f"not answered: {', '.join(unanswered) or 'none'}; gone before answering: {', '.join(grow.gone) or 'none'}{self._kept_named()}"
        tokens = grow.tokens if full else kv_moves.most_within(pool, arena, grow.tokens, available)
        figures = {
            "pool": pool.name, "asked_tokens": grow.tokens, "tokens": tokens, "waited_ms": round((now - grow.created) * 1e3, 3),
            "unanswered": unanswered, "gone": grow.gone,
        }
        before = self.arenas.accounted_bytes()
        try:
            if tokens == pool.tokens:
                message = f"KV pool '{pool.name}': nothing came free within {now - grow.created:.3g}s; {named}"
                self.arenas.require_available(kv_moves.need(pool, arena, grow.tokens), message)  # refuses, with the figures
            reply, handout = self._grown(self.sessions[grow.session_id], pool, tokens, grow.tokens, unanswered, grow.gone)
        except p.ProtocolError as exc:
            self.tally.kv_grows_refused += 1
            self._completions.append(Completion(grow.session_id, grow.request_id, exc))
            return
        moved = self.arenas.accounted_bytes() - before
        self.tally.kv_grew(full, moved, now - grow.created)
        log.info(
            "KV pool %r grew to %d tokens (asked %d) after %.0f ms: %d bytes; %s",
            pool.name, tokens, grow.tokens, (now - grow.created) * 1e3, moved, named,
            extra={"figures": {**figures, "bytes": moved}},
        )
        self._completions.append(Completion(grow.session_id, grow.request_id, reply, handout))

