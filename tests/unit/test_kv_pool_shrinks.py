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
