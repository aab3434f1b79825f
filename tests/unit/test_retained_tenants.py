"""Retained memory and the tenants it belongs to: what an adoption moves counts against
the adopter's account from then on, and is refused where it would pass the adopter's cap
(nothing moves); a sleeping arena's host buffer moves with it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpumem_shared import protocol as p
from gpumemd.records import SessionRecord as Session

from .harness import Harness, MiB
from .test_memory_caps import policy, token_rules
from .test_retained import GRACE, Fence, adopt, die, group, retain, retained
from .test_sleepers import _asleep, _buffer

TEAM_1, TEAM_2, TEAM_3 = "team-1-4f1b0c9e2d7a8b63f5e1d0c2", "team-2-9a8b7c6d5e4f3a2b1c0d9e8f", "team-3-0d1c2b3a4f5e6d7c8b9a"


POLICY = token_rules((TEAM_1, "team-1", "64MiB"), (TEAM_2, "team-2", "16MiB"), (TEAM_3, "team-3", "64MiB"))


@pytest.fixture
def h(make_harness: Callable[..., Harness], tmp_path: Path) -> Harness:
    harness = make_harness(retain_grace=GRACE, tenant_policy=policy(tmp_path, POLICY))
    harness.state.retained.writers.fence = Fence()
    return harness


def primary(h: Harness, token: str = TEAM_1) -> tuple[Session, str]:
    s = h.connect("primary", tenant_token=token)
    h.create(s, "weights", 64 * MiB)
    h.commit(s, "weights", 32 * MiB)
    secret = group(h, s)
    retain(h, s, "weights")
    return s, secret


def test_an_adoption_past_the_adopters_cap_is_refused_and_what_moves_counts_against_the_adopter(h: Harness) -> None:
    s, secret = primary(h)
    die(h, s)
    caps = h.state.arenas.caps
    assert caps.usage()["token team-1"] == 32 * MiB  # an orphan counts against its dead holder's tenant
    small = h.connect("small", tenant_token=TEAM_2)
    refused = h.refused(small, p.Adopt(group="g", secret=secret), p.ErrorCode.RESOURCE_EXHAUSTED)
    assert (refused.detail["tenant"], refused.detail["cap"]) == ("token team-2", 16 * MiB)
    assert "adopting retain group 'g'" in refused.message and "32 MiB" in refused.message
    assert retained(h)["g"].state is p.RetainState.ORPHANED  # nothing moved
    assert all(not c.holders for c in h.state.arenas.by_name["weights"].chunks)
    big = h.connect("big", tenant_token=TEAM_3)
    adopt(h, big, secret)
    # Charged to the adopter from the adoption on, no longer to the dead holder's tenant.
    assert (caps.usage()["token team-1"], caps.usage()["token team-3"]) == (0, 32 * MiB)
    h.ok(big, p.AdoptDone(group="g"))
    h.create(big, "extra", 64 * MiB)
    h.refused(big, p.CommitArena(name="extra", nbytes=34 * MiB), p.ErrorCode.RESOURCE_EXHAUSTED)


def test_an_adoption_within_one_account_moves_nothing_between_accounts(h: Harness) -> None:
    s, secret = primary(h)
    h.create(s, "more", 64 * MiB)
    h.commit(s, "more", 32 * MiB)  # team-1 at its cap, the group's 32 MiB of it
    die(h, s)
    standby = h.connect("standby", tenant_token=TEAM_1)
    adopt(h, standby, secret)  # what it adopts is team-1's already: not counted twice
    assert h.state.arenas.caps.usage()["token team-1"] == 32 * MiB


def test_a_sleeping_arenas_host_buffer_moves_to_its_adopter(h: Harness) -> None:
    s, secret = primary(h)
    _buffer(h, s, "weights", 32 * MiB)
    _asleep(h, s, "weights", kept=32 * MiB)
    die(h, s)
    standby = h.connect("standby", tenant_token=TEAM_3)
    adopt(h, standby, secret)
    assert h.state.sleepers.host_bytes_by_session() == {standby.id: 32 * MiB}
    (sleeper,) = h.state.status().sleepers
    assert sleeper.owner == "standby"
    h.ok(standby, p.AdoptDone(group="g"))
    assert h.ok(standby, p.WakeArena(name="weights")).reply.arena.committed == 32 * MiB
