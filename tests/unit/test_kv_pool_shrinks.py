"""KvPool.answer_shrinks without a daemon: which of the KV_SHRINK notices it answers,
and what it gives back (the notices and the KV_SHRINK call stood in for)."""

from __future__ import annotations

from gpumem.kv_pool import KvPool


class Pool(KvPool):
    """A pool of ``tokens`` rows with the daemon's asks ``bounds`` (oldest first) waiting;
    ``shrunk`` records each shrink sent."""

    def __init__(self, tokens: int, bounds: list[int], in_use: int = 0) -> None:  # no daemon: KvPool's own is not called
        self.name = "kv"
        self.tokens = tokens
        self.rows_in_use = lambda: in_use
        self._growing = None
        self.bounds = bounds
        self.shrunk: list[int] = []

    def shrink_requests(self) -> list[int]:
        bounds, self.bounds = self.bounds, []
        return bounds

    def shrink(self, tokens: int, *, sleep: bool = False, kept_bytes: int = 0) -> int:
        self.shrunk.append(tokens)
        self.tokens = tokens
        return tokens


def test_the_latest_ask_is_answered_not_the_oldest() -> None:
    pool = Pool(4096, bounds=[1024, 3072])  # the daemon asked for less once the first grow was served
    assert pool.answer_shrinks() == 3072
    assert pool.shrunk == [3072]


def test_live_rows_past_the_bound_are_kept_and_no_notice_means_no_answer() -> None:
    pool = Pool(4096, bounds=[2048, 1024], in_use=1500)
    assert pool.answer_shrinks() == 1500
    assert pool.answer_shrinks() is None and pool.shrunk == [1500]


class Channel:
    """The daemon's side of KV_SHRINK: records each one and answers with the rows kept."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, bool]] = []

    def call(self, msg: object) -> tuple[object, dict[int, int]]:
        import types

        self.sent.append((msg.tokens, msg.sleep))  # type: ignore[attr-defined]
        return types.SimpleNamespace(pool=types.SimpleNamespace(tokens=msg.tokens), round_id=0), {}  # type: ignore[attr-defined]


def _sending(in_use: int, reserved: int) -> tuple[KvPool, Channel]:
    import types

    pool = KvPool.__new__(KvPool)
    channel = Channel()
    pool.name, pool.tokens, pool.rows_in_use, pool.reserved_rows = "kv", 64, lambda: in_use, reserved
    pool.core = types.SimpleNamespace(channel=channel)  # type: ignore[assignment]
    pool.arena = types.SimpleNamespace(apply=lambda reply, fds: None)  # type: ignore[assignment]
    return pool, channel


def test_a_sleep_gives_back_the_rows_the_engine_reserves_but_a_shrink_does_not() -> None:
    """transformers keeps its trash blocks in rows 0 and 1 (always in use, contents never
    read back): a sleep hands them back with the rest; a shrink below them, or a sleep
    while a sequence holds a row past them, is refused before the daemon hears of it."""
    import pytest

    from gpumem.errors import InvalidArgument

    pool, channel = _sending(in_use=2, reserved=2)
    assert pool.shrink(0, sleep=True) == 0 and channel.sent == [(0, True)]
    pool, channel = _sending(in_use=2, reserved=2)
    with pytest.raises(InvalidArgument, match="still uses rows up to 2"):
        pool.shrink(0)
    pool, channel = _sending(in_use=3, reserved=2)
    with pytest.raises(InvalidArgument, match="still uses rows up to 3"):
        pool.shrink(0, sleep=True)
    assert channel.sent == []
