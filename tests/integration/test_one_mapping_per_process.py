"""A process maps each arena of a daemon once (gpumem.address_slices): the daemon plans
an arena at one address for everyone, so a second session of the process attaching an
arena the first one maps would map it over the first one's mapping (CUDA refuses it,
the host backend silently replaces it, read-only even). The second session is refused
with a VaCollision naming the arena, the session that maps it and what to do; the first
session's mapping and the daemon's books stay as they were; another process attaches
fine; once the session that mapped it lets go, another session of the process may."""

from __future__ import annotations

import pytest

import gpumem
from gpumem.errors import VaCollision
from gpumemd_testkit import MiB, do, status

PATTERN = bytes(range(256)) * 16


def attached(runtime_dir, arena: str) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted({a["name"]: a["attached"] for a in status(runtime_dir)["arenas"]}[arena])


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "writable"])
def test_a_second_session_of_the_process_is_refused_the_arena_the_first_maps(  # type: ignore[no-untyped-def]
    daemon, run_client, runtime_dir, read_only: bool
) -> None:
    owner = gpumem.connect(0, name="once-owner", runtime_dir=runtime_dir)
    second = gpumem.connect(0, name="once-second", runtime_dir=runtime_dir)
    try:
        arena = owner.create_arena("once-weights", 64 * MiB)
        arena.commit(8 * MiB)
        arena.write(2 * MiB, PATTERN)
        token = arena.share("once-second", read_only=read_only)
        arena.share("once-elsewhere", read_only=read_only)
        with pytest.raises(VaCollision) as refused:
            second.attach_arena("once-weights", token)
        message = str(refused.value)
        for part in ("arena 'once-weights'", "session 'once-owner'", "'once-second'", "from another process"):
            assert part in message, message
        with pytest.raises(VaCollision):
            second.attach_arena("once-weights")  # by identity: the same answer
        assert attached(runtime_dir, "once-weights") == ["once-owner"]
        assert "once-weights" not in second.arenas

        # The owner's mapping is its own still: writable, and its bytes intact.
        assert arena.read(2 * MiB, len(PATTERN)) == PATTERN
        arena.write(4 * MiB, b"\x5a" * 4096)
        assert arena.read(4 * MiB, 4096) == b"\x5a" * 4096
        assert arena.mapped_bytes == 8 * MiB

        # The refused session is not hurt: its own arenas map as before.
        own = second.create_arena("once-own", 16 * MiB)
        own.commit(2 * MiB)
        own.write(0, b"own")
        assert own.read(0, 3) == b"own"

        # Another process maps the arena at the same address, and sees the owner's bytes.
        elsewhere = run_client("shell", "once-elsewhere")
        elsewhere.expect("CONNECTED")
        assert int(do(elsewhere, "attach once-weights")) == arena.address
        assert bytes.fromhex(do(elsewhere, f"read once-weights {2 * MiB} {len(PATTERN)}")) == PATTERN
        assert bytes.fromhex(do(elsewhere, f"read once-weights {4 * MiB} 16")) == b"\x5a" * 16
        assert attached(runtime_dir, "once-weights") == ["once-elsewhere", "once-owner"]
        assert arena.read(2 * MiB, len(PATTERN)) == PATTERN
    finally:
        second.close()
        owner.close()


def test_once_the_session_mapping_it_lets_go_another_session_of_the_process_may(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    owner = run_client("shell", "once-owner")
    owner.expect("CONNECTED")
    do(owner, f"create once-weights {64 * MiB}")
    do(owner, f"commit once-weights {4 * MiB}")
    do(owner, f"write once-weights {MiB} {PATTERN[:64].hex()}")
    first = gpumem.connect(0, name="once-first", runtime_dir=runtime_dir)
    later = gpumem.connect(0, name="once-later", runtime_dir=runtime_dir)
    try:
        for name in ("once-first", "once-later"):
            do(owner, f"share once-weights {name}")
        held = first.attach_arena("once-weights")
        with pytest.raises(VaCollision, match="session 'once-first'"):
            later.attach_arena("once-weights")
        assert attached(runtime_dir, "once-weights") == ["once-first", "once-owner"]
        assert held.read(MiB, 64) == PATTERN[:64]
        held.release()
        again = later.attach_arena("once-weights")
        assert again.read(MiB, 64) == PATTERN[:64]
        assert attached(runtime_dir, "once-weights") == ["once-later", "once-owner"]
        with pytest.raises(VaCollision, match="session 'once-later'"):
            first.attach_arena("once-weights")
    finally:
        later.close()
        first.close()
