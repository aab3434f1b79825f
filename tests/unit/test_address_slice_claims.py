"""Who holds what in a daemon's address slice in this process (gpumem.address_slices),
read without a driver: each arena is mapped by one session, and a standby's windows
(gpumem.standby) refuse every arena planned over them until vacated or dropped."""

from __future__ import annotations

from typing import Any

import pytest

from gpumem import address_slices
from gpumem.address_slices import AddressSlice
from gpumem.errors import VaCollision

GiB = 1 << 30
BASE = 0x7000_0000_0000


@pytest.fixture
def held() -> AddressSlice:
    driver: Any = None  # nothing here reserves or frees
    return AddressSlice(BASE, 64 * GiB, "the test's daemon", driver)


def test_a_standbys_window_refuses_an_arena_of_any_session_planned_over_it(held: AddressSlice) -> None:
    standby = address_slices.reserve(held, 1, "g", {"kv": (BASE, BASE + 4 * GiB), "w": (BASE + 5 * GiB, BASE + 6 * GiB)})
    for session in (1, 2):  # the reserving session's own arenas, and another session's of the process
        with pytest.raises(VaCollision, match=r"over the window of 'kv' that this process reserved for retain group 'g'"):
            address_slices.claim(held, "mine", BASE + GiB, BASE + 2 * GiB, session, f"client-{session}")
    address_slices.claim(held, "beside", BASE + 4 * GiB, BASE + 5 * GiB, 2, "client-2")  # touching is not overlapping
    standby.vacate("kv")  # the adopted arena is mapped there next
    address_slices.claim(held, "kv", BASE, BASE + 4 * GiB, 1, "client-1")
    with pytest.raises(VaCollision, match="window of 'w'"):
        address_slices.claim(held, "mine", BASE + 5 * GiB, BASE + 6 * GiB, 1, "client-1")
    standby.drop()
    address_slices.claim(held, "mine", BASE + 5 * GiB, BASE + 6 * GiB, 1, "client-1")
    assert held.standbys == {} and set(held.mapped) == {"beside", "kv", "mine"}


def test_a_dropped_claim_leaves_the_other_sessions_claim_of_the_group(held: AddressSlice) -> None:
    window = {"kv": (BASE, BASE + GiB)}
    first, second = address_slices.reserve(held, 1, "g", window), address_slices.reserve(held, 2, "g", window)
    first.drop()
    first.drop()  # twice: nothing more
    assert held.standbys == {(2, "g"): second}
    with pytest.raises(VaCollision, match="window of 'kv'"):
        address_slices.claim(held, "mine", BASE, BASE + GiB, 1, "client-1")
    second.drop()
    address_slices.claim(held, "mine", BASE, BASE + GiB, 1, "client-1")
