"""KV pools on the client side: declare, lay out, capture on placeholder, commit after
capture, grow and shrink.

    pool = session.declare_kv_pool("engine-a-kv", [gpumem.KvBuffer(f"k{i}", row) for i in ...], max_tokens=1 << 20)
    k0 = pool.tensor("k0", torch.float16, (heads, head_dim))   # (max_tokens, heads, head_dim), virtual-only
    pool.placeholder()                                         # capture can copy into every row
    pool.join_round()
    ... capture the decode graphs ...
    tokens = pool.capture_done(headroom_bytes=..., min_tokens=...)   # waits for the round to commit
    # rows [0, tokens) of every buffer are real memory now, at the same addresses

The daemon may ask a pool to give rows back for an engine that joins later, or for a
neighbour's grow while this pool holds more than its fair share (``shrink_requests()``,
``answer_shrinks()``); nothing is taken until the owner confirms with ``shrink()``.
Runtime moves (docs/architecture.md, "Runtime KV moves"):

    pool.report_demand(rows_in_use)          # on a change (a burst starts, the pool idles), not per step
    wait = pool.grow_ahead(rows_in_use, watermark=4096, step=16384)   # None while far from the top
    ... decode steps go on ...; at a step boundary before the rows run out: wait.wait()
    pool.answer_shrinks(move_live)           # at a step boundary: give back what the daemon asked
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypedDict

from gpumem_shared import protocol as p
from gpumem.arena import DEFAULT_PLACEHOLDER_SLOT, Arena
from gpumem.errors import DaemonTimeout, GpuMemError, InvalidArgument
from gpumem.views import RawView

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from gpumem.core import SessionCore

KvBuffer = p.KvBuffer

# How long past a round's deadline capture_done waits for the daemon's answer.
_DEADLINE_SLACK_S = 30.0

P = ParamSpec("P")


class RoundFigures(TypedDict, total=False):
    """What an engine tells its commit round once its graphs are captured (CAPTURE_DONE),
    as every report call takes them: ``capture_done``/``send_capture_done`` of ``KvPool``
    and ``PagedKvCache``, ``EngineMemory.kv_commit``/``start_kv_commit``. The minimum and
    maximum go beside these, in the caller's unit (``min_tokens``, or ``min_blocks``: a
    block is a row), and so does ``timeout``, the call's bound on the wait (default: a
    little past the round's deadline). ``CaptureFigures`` adds the graph pools' bytes."""

    headroom_bytes: int  # what the engine will still allocate past its arenas' peaks, kept out of the budget
    weight: float  # its share of what is left once every member has its minimum (relative to the others')


class CaptureFigures(RoundFigures, total=False):
    graph_pool_bytes: int  # what its captured graphs hold (EngineMemory counts its graphs arena)


def waited(send: Callable[P, RoundWait]) -> Callable[P, int]:
    """The report call that waits, made from the one that does not (same figures)."""

    def wait_for_round(*args: P.args, **kwargs: P.kwargs) -> int:
        return send(*args, **kwargs).wait()

    wait_for_round.__doc__ = (
        f"``{send.__name__}``, waited for: sends the report and waits for the round to commit; returns the rows "
        "(tokens, or blocks) every buffer now holds. Raises RoundFailed (the deadline passed, or the budget "
        "cannot cover the minimums) with the figures."
    )
    # help() and editors show the keywords, not (*args, **kwargs).
    wait_for_round.__signature__ = inspect.signature(send).replace(return_annotation="int")  # type: ignore[attr-defined]
    return wait_for_round


class KvPool:
    def __init__(self, core: SessionCore, view: p.KvPoolView) -> None:
        self.core = core
        self.name = view.name
        self.arena = Arena(core, view.arena, owner=True)
        self.buffers = {b.name: b for b in view.buffers}
        self.max_tokens = view.max_tokens  # the declared bound
        self.tokens = view.tokens  # rows committed in every buffer
        self.bytes_per_token = view.bytes_per_token
        self.budget = p.RoundBudget()  # the figures of the round that sized the pool
        self.round_id = 0
        self._round_deadline_s = 0.0
        # Set by the engine: the highest row it still uses. shrink() refuses to give
        # back rows below it.
        self.rows_in_use: Callable[[], int] | None = None
        # Rows 0 .. n-1 an engine keeps for itself whose contents never matter (transformers'
        # trash blocks): in use while it serves, given back with the rest by a sleep.
        self.reserved_rows = 0
        self.unanswered: list[str] = []  # the pools that did not give back for the last grow
        self.gone: list[str] = []  # those that went away before answering it (died, closed, released)
        self._reported = -1  # the last use sent with report_demand
        self._growing: GrowWait | None = None

    @classmethod
    def declare(
        cls, core: SessionCore, name: str, buffers: list[p.KvBuffer], *, max_tokens: int = 0, reserve_bytes: int = 0
    ) -> KvPool:
        """``Session.declare_kv_pool``: the daemon lays the pool out in an arena of its
        own, whose window this process maps."""
        reply: p.KvDeclareReply = core.call(p.KvDeclare(name=name, buffers=buffers, max_tokens=max_tokens, reserve_bytes=reserve_bytes))
        pool = cls(core, reply.pool)
        try:
            pool.arena.reserve_window()
        except BaseException:
            core.call(p.ReleaseArena(name=name))
            raise
        core.add_arena(pool.arena)
        return pool

    # ------------------------------------------------------------------ layout

    def view(self, buffer: str) -> RawView:
        """The whole region of ``buffer`` (max_tokens rows of its row_bytes, row i at
        byte i * row_bytes) as a framework-agnostic RawView: DLPack and
        ``__cuda_array_interface__`` on CUDA, ``__array_interface__`` on the host backend
        (``numpy.asarray(view)``), no torch needed. Only the first ``tokens`` rows are
        backed by memory: the rest are virtual or placeholder, never to be touched."""
        b = self._buffer(buffer)
        return self.arena.view(b.offset, self.max_tokens * b.row_bytes)

    def tensor(self, buffer: str, dtype: Any, row_shape: tuple[int, ...] | None = None) -> Any:
        """``buffer`` as a torch tensor of shape (max_tokens, *row_shape), outside any pool.
        Rows at and beyond ``tokens`` are placeholder or unmapped: never touch them."""
        from gpumem.torch_support import import_torch

        torch = import_torch("KV tensors")
        b = self._buffer(buffer)
        rows = self.arena.tensor(b.offset, (self.max_tokens * b.row_bytes,), torch.uint8).view(dtype)
        per_row = rows.numel() // self.max_tokens
        shape = row_shape if row_shape is not None else (per_row,)
        return rows.view(self.max_tokens, *shape)

    def placeholder(self, slot_bytes: int = DEFAULT_PLACEHOLDER_SLOT) -> None:
        """Alias a placeholder over every buffer, so graphs can be captured before the
        round commits real memory (then swapped in at the same addresses)."""
        self.arena.placeholder(0, self.arena.reserved, slot_bytes)

    def _buffer(self, name: str) -> p.KvBufferView:
        try:
            return self.buffers[name]
        except KeyError:
            raise InvalidArgument(f"KV pool '{self.name}' has no buffer '{name}' (it has {sorted(self.buffers)})") from None

    # ------------------------------------------------------------------ commit round

    def join_round(self, expect: int = 0) -> p.RoundView:
        """Join the device's open commit round. Join early (before loading and capture)
        and give ``expect``, the number of pools the round should gather, when engines
        may start at different times: the round then waits for all of them."""
        view: p.RoundView = self.core.call(p.RoundJoin(pool=self.name, expect=expect))
        self.round_id = view.round_id
        self._round_deadline_s = view.deadline_in_s
        return view

    def send_capture_done(
        self, *, min_tokens: int = 0, max_tokens: int = 0, timeout: float | None = None, **figures: Unpack[CaptureFigures]
    ) -> RoundWait:
        """Report that this engine's graphs are captured (``CaptureFigures``), without
        waiting: the engine goes on with its start-up while other engines capture, and
        calls ``wait()`` on the ``RoundWait`` (the tokens every buffer holds) before it
        needs the rows (the session's other calls work meanwhile). ``timeout`` bounds
        the wait from now. ``capture_done`` is the same report, waited for."""
        message = p.CaptureDone(pool=self.name, min_tokens=min_tokens, max_tokens=max_tokens, **figures)
        limit = timeout if timeout is not None else max(self.core.timeout, self._round_deadline_s + _DEADLINE_SLACK_S)
        return RoundWait(self, message, self.core.channel.start(message), limit)

    capture_done = waited(send_capture_done)

    # ------------------------------------------------------------------ elastic

    def grow(self, tokens: int, *, in_use: int = -1, timeout: float | None = None) -> int:
        """Commit rows up to ``tokens``; returns the tokens the pool holds. When they do not
        fit the daemon asks pools above their fair share to give back; it answers at once
        with what is free if any (fewer tokens than asked, ``unanswered`` naming the pools
        asked: the next grow finds what they give back free), else when they did, or at
        its move deadline with what it got (``unanswered``: the pools that did not give
        back; ``gone``: those that went away before they answered, what they held came
        back). OutOfMemory (with the figures) when it got nothing. ``in_use`` tells the
        daemon the rows in use now."""
        return self.send_grow(tokens, in_use=in_use).wait(timeout)

    def send_grow(self, tokens: int, *, in_use: int = -1, wait: float = 0.0) -> GrowWait:
        """``grow`` without waiting: the engine goes on with its steps and collects the
        answer with ``wait()`` (``growing`` is it until then). Given ``wait``, the daemon
        holds the answer until all the rows fit, asking pools above their share again as
        they answer, or up to ``wait`` seconds, then answers with what fits (the rest of
        a wake that got part, ``ArenaSleep.wake``)."""
        message = p.KvGrow(pool=self.name, tokens=tokens, in_use=in_use, wait=wait)
        self._growing = GrowWait(self, message, self.core.channel.start(message))
        return self._growing

    @property
    def growing(self) -> GrowWait | None:
        """The grow sent and not collected yet (one at a time: the daemon refuses a second)."""
        return self._growing if self._growing is not None and not self._growing.done else None

    def grow_ahead(self, in_use: int, *, watermark: int, step: int) -> GrowWait | None:
        """Grow before the rows run out, off the step's critical path: once fewer than
        ``watermark`` committed rows are free, ask for ``step`` more (up to the declared
        bound) without waiting. None when no grow is needed, or one is on its way."""
        if self._growing is not None and not self._growing.done:
            return None
        if self.tokens - in_use >= watermark or self.tokens >= self.max_tokens:
            return None
        return self.send_grow(min(self.max_tokens, self.tokens + step), in_use=in_use)

    def report_demand(self, in_use: int) -> None:
        """Tell the daemon how many rows the engine uses (0: idle), which decides whether
        this pool is asked to give back for a neighbour's grow. A call to the daemon, so
        send it when the use changes much (a burst starts or ends), not per step; the
        same figure twice is not sent."""
        if in_use != self._reported:
            self.core.call(p.KvDemand(pool=self.name, in_use=in_use))
            self._reported = in_use

    def shrink_requests(self) -> list[int]:
        """Bounds the daemon asked this pool to shrink to, oldest first."""
        return [n.tokens for n in self.core.channel.notices(kind=p.NoticeKind.KV_SHRINK, arena=self.name)]

    def answer_shrinks(self, move_live: Callable[[int], int] | None = None, *, down_to: int | None = None) -> int | None:
        """Answer the daemon's KV_SHRINK notices (None when there were none): give back
        the rows from the latest bound asked on. Rows still in use there (``rows_in_use``)
        are the engine's to move first: ``move_live(bound)`` copies the live blocks at or
        past ``bound`` into free rows below it (device to device, updating the engine's
        block tables) and returns the rows it still uses; rows it could not move are kept
        and the rest given back (nothing, when every row asked for is live: the answer
        still goes). ``down_to``: the rows the engine needs, when it gives back down to
        them rather than to the bound asked (the daemon asks for the grow in hand; what
        more comes free serves the neighbour's next grows at once, without another ask).
        Returns the tokens the pool keeps."""
        if self._growing is not None and not self._growing.done:
            # Its answer may hold rows this process does not map yet: a shrink now would
            # give back rows it never saw. The notices wait for the grow's answer.
            return None
        bounds = self.shrink_requests()
        if not bounds:
            return None
        bound = bounds[-1]  # the daemon's latest ask replaces the earlier ones
        if down_to is not None:
            bound = max(0, min(bound, down_to))
        used = self.rows_in_use() if self.rows_in_use is not None else 0
        if used > bound and move_live is not None:
            used = move_live(bound)
        keep = max(bound, used)
        # Answered even when every row asked for is live (a shrink to the tokens held):
        # the neighbour's grow then goes ahead with what is free instead of waiting for
        # the daemon's move deadline.
        if keep < self.tokens:
            return self.shrink(keep)
        try:
            return self.shrink(self.tokens)
        except InvalidArgument:  # no request pending any more (a notice the daemon has since had answered)
            return self.tokens

    def shrink(self, tokens: int, *, sleep: bool = False, kept_bytes: int = 0) -> int:
        """Confirm rows from ``tokens`` on are free and give them back. Whole chunks go,
        so the pool may keep a few more rows; returns the tokens it keeps. ``sleep`` (with
        ``tokens`` 0, ``kept_bytes`` copied to host memory first: ArenaSleep's): the daemon
        shows the pool asleep and asks nothing of it until a grow wakes it."""
        in_use = self.rows_in_use() if self.rows_in_use is not None else 0
        if in_use > tokens and not (sleep and in_use <= self.reserved_rows):
            raise InvalidArgument(f"KV pool '{self.name}' still uses rows up to {in_use}; it cannot give back rows from {tokens} on")
        reply, fds = self.core.channel.call(p.KvShrink(pool=self.name, tokens=tokens, sleep=sleep, kept_bytes=kept_bytes))
        self.apply(reply, fds)
        return self.tokens

    def apply(self, reply: p.KvCommitReply, fds: dict[int, int]) -> None:
        """Carry out a reply that changed the pool's rows (takes ownership of ``fds``)."""
        self.arena.apply(reply, fds)
        self.tokens = reply.pool.tokens
        if reply.round_id:
            self.round_id = reply.round_id
            self.budget = reply.budget

    def release(self) -> None:
        self.arena.release()

    def __repr__(self) -> str:
        return f"<gpumem.KvPool '{self.name}' {len(self.buffers)} buffers, {self.tokens}/{self.max_tokens} tokens>"


class _PoolWait:
    """A request of ``pool`` sent and not yet answered: ``wait()`` collects it once."""

    def __init__(self, pool: KvPool, request_id: int, what: str) -> None:
        self.pool = pool
        self._request_id = request_id
        self._what = what
        self._tokens: int | None = None

    @property
    def done(self) -> bool:
        """Whether ``wait()`` returned already."""
        return self._tokens is not None

    def __repr__(self) -> str:
        state = f"{self._tokens} tokens" if self._tokens is not None else "pending"
        return f"<gpumem.{type(self).__name__} KV pool '{self.pool.name}'{self._what} ({state})>"


class GrowWait(_PoolWait):
    """A KV_GROW sent and not yet answered (``KvPool.send_grow``)."""

    def __init__(self, pool: KvPool, message: p.KvGrow, request_id: int) -> None:
        super().__init__(pool, request_id, f" to {message.tokens} tokens")
        self._message = message

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the answer (``timeout``: the session's); returns the tokens the pool
        holds. The daemon answers within its move deadline; DaemonTimeout when the wait
        ends first (``wait`` may be called again then)."""
        if self._tokens is None:
            pool = self.pool
            try:
                reply, fds = pool.core.channel.finish(self._request_id, self._message, timeout if timeout is not None else pool.core.timeout)
            except DaemonTimeout:
                raise  # not answered yet: wait() may be called again
            except GpuMemError:
                self._tokens = pool.tokens  # answered with a refusal (OutOfMemory: nothing came free)
                raise
            self._tokens = pool.tokens  # answered: never waited for again, even if applying it fails
            pool.apply(reply, fds)
            pool.unanswered, pool.gone = reply.unanswered, reply.gone
            self._tokens = pool.tokens
        return self._tokens


class RoundWait(_PoolWait):
    """A CAPTURE_DONE sent and not yet answered (``KvPool.send_capture_done``)."""

    def __init__(self, pool: KvPool, message: p.CaptureDone, request_id: int, timeout: float) -> None:
        super().__init__(pool, request_id, "")
        self._message = message
        self._deadline = time.monotonic() + timeout

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the round to commit (until the deadline ``send_capture_done`` set, or
        ``timeout`` seconds); returns the tokens every buffer holds. Raises RoundFailed
        as ``capture_done`` does, and DaemonTimeout when the round outlives the wait
        (``wait`` may be called again then)."""
        if self._tokens is None:
            left = self._deadline - time.monotonic() if timeout is None else timeout
            pool, arena = self.pool, self.pool.arena
            # The round commits at least the minimum rows of each buffer over the
            # placeholder there: unmapped now, it costs nothing while the round finishes
            # (the engine waits for its rows, so nothing touches them meanwhile).
            rows = self._message.min_tokens
            arena.vacate([(b.offset, b.offset + rows * b.row_bytes) for b in pool.buffers.values()])
            try:
                reply, fds = pool.core.channel.finish(self._request_id, self._message, max(left, 0.001))
            except BaseException:
                arena.restore_placeholder()
                raise
            pool.apply(reply, fds)
            self._tokens = pool.tokens
        return self._tokens
