"""Runtime KV moves in DaemonState: the daemon's capacity cap, and grows that do not fit
answered from what other pools give back (fair share, minimums, idle first, deadlines,
liars and the dead), on the real host driver with a fake clock."""

from __future__ import annotations

from collections.abc import Callable

from gpumem_shared import protocol as p
from gpumem_shared.protocol import ErrorCode

from .harness import Harness, MiB
from .test_kv_rounds import capture, commit_reply, declare, done, join

# --------------------------------------------------------------------------- the capacity cap


def test_capacity_caps_what_a_round_measures_and_every_commit(make_harness: Callable[..., Harness]) -> None:
    # The host device has 256 MiB; the daemon may commit 64 MiB. 16 MiB go to a plain arena,
    # so the round measures 48 MiB free: 48 MiB / 4 KiB rows = 12288 tokens.
    h = make_harness(capacity_bytes=64 * MiB)
    a, other = h.connect("engine-a"), h.connect("other")
    h.create(other, "plain", 64 * MiB)
    h.commit(other, "plain", 16 * MiB)
    declare(h, a, "kv", rows=(4096,), max_tokens=65536)
    join(h, a, "kv")
    capture(h, a, "kv", 1)
    reply = commit_reply(done(h)[1])
    assert (reply.budget.free, reply.budget.committed, reply.pool.tokens) == (48 * MiB, 48 * MiB, 12288)
    assert h.state.arenas.accounted_bytes() == 64 * MiB
    assert h.state.status().device.free_bytes == 0
    refused = h.refused(other, p.CommitArena(name="plain", nbytes=18 * MiB), ErrorCode.OUT_OF_MEMORY)
    assert refused.detail["available"] == 0
