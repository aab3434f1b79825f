"""Placeholder backing and framework-agnostic views, in real client processes, on every
backend: a placeholder aliases one chunk over many slots; commit swaps in real, clean
memory at the same addresses; decommit puts the placeholder back; bytes written through
a view in one process are read by another."""

from __future__ import annotations

import json

from gpumemd_testkit import status

MiB = 1 << 20
GiB = 1 << 30
SLOT = 64 * MiB


def test_placeholder_commit_swap_and_decommit(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    c = run_client("shell", "engine-a")
    c.expect("CONNECTED")
    c.send(f"create kv {8 * GiB}")
    c.expect("OK")
    c.send(f"placeholder kv 0 {4 * GiB} {SLOT}")
    assert int(c.expect("OK")) == 4 * GiB
    (arena,) = status(runtime_dir)["arenas"]
    assert arena["placeholder_bytes"] == SLOT + 2 * MiB  # the daemon accounts the aliased chunks once
    assert status(runtime_dir)["device"]["accounted_bytes"] == SLOT + 2 * MiB

    # aliasing: a byte written in one slot shows in every slot
    c.send("rawwrite kv 0 a1a2a3")
    c.expect("OK")
    c.send(f"rawread kv {3 * GiB} 3")
    assert c.expect("OK") == "a1a2a3"

    # commit swaps real memory in over the placeholder, at the same addresses: clean bytes
    commit = 1 * GiB + 6 * MiB
    c.send(f"commit kv {commit}")
    assert int(c.expect("OK")) == commit
    c.send("check kv 0 4096 0")
    assert c.expect("OK") == "MATCH"
    c.send(f"check kv {commit - 4096} 4096 0")
    assert c.expect("OK") == "MATCH"
    c.send("backed kv")
    backed = json.loads(c.expect("OK"))
    assert backed["backed"] == [[0, 4 * GiB]]  # no hole where the slot was split
    assert backed["committed"] == [[0, commit]]
    assert backed["placeholder"] == 4 * GiB - commit
    # the slot-aligned placeholder past the commit still aliases the first slot chunk
    c.send(f"rawread kv {2 * GiB} 3")
    assert c.expect("OK") == "a1a2a3"

    # decommit: the placeholder comes back where it was asked for
    c.send(f"decommit kv {512 * MiB}")
    assert int(c.expect("OK")) == 512 * MiB
    c.send("backed kv")
    backed = json.loads(c.expect("OK"))
    assert backed["backed"] == [[0, 4 * GiB]]
    assert backed["committed"] == [[0, 512 * MiB]]
    c.send(f"rawread kv {768 * MiB} 3")
    assert c.expect("OK") == "a1a2a3"
    assert status(runtime_dir)["device"]["accounted_bytes"] == 512 * MiB + SLOT + 2 * MiB

    c.send("release kv")
    c.expect("OK")
    s = status(runtime_dir)
    assert s["arenas"] == [] and s["device"]["accounted_bytes"] == 0


def test_placeholder_is_owner_only_and_validated(daemon, run_client) -> None:  # type: ignore[no-untyped-def]
    owner = run_client("shell", "engine-a")
    other = run_client("shell", "engine-b")
    owner.expect("CONNECTED")
    other.expect("CONNECTED")
    owner.send(f"create kv {4 * GiB}")
    owner.expect("OK")
    owner.send("share kv engine-b")
    owner.expect("OK")
    other.send("attach kv")
    other.expect("OK")
    other.send(f"placeholder kv 0 {GiB} {SLOT}")
    assert other.expect("ERR").startswith("PermissionDenied")
    owner.send(f"placeholder kv 1 {GiB} {SLOT}")
    assert owner.expect("ERR").startswith("InvalidArgument")
    owner.send(f"placeholder kv 0 {8 * GiB} {SLOT}")
    assert owner.expect("ERR").startswith("InvalidArgument")
    owner.send(f"placeholder kv 0 {GiB} {3 * MiB}")
    assert owner.expect("ERR").startswith("InvalidArgument")


def test_view_written_in_one_process_is_read_in_another(daemon, run_client) -> None:  # type: ignore[no-untyped-def]
    a = run_client("shell", "writer")
    b = run_client("shell", "reader")
    a.expect("CONNECTED")
    b.expect("CONNECTED")
    a.send(f"create buf {4 * GiB}")
    a.expect("OK")
    a.send(f"commit buf {64 * MiB}")
    a.expect("OK")
    a.send(f"viewfill buf {MiB} {MiB} 77")  # NumPy (host) or torch via DLPack (CUDA)
    a.expect("OK")
    a.send("share buf reader")
    a.expect("OK")
    b.send("attach buf")
    b.expect("OK")
    b.send(f"check buf {MiB} {MiB} 77")
    assert b.expect("OK") == "MATCH"
    b.send(f"check buf {2 * MiB} {MiB} 0")  # and nothing beyond the view was touched
    assert b.expect("OK") == "MATCH"


def _back_at_once(arena: object, ranges: list[tuple[int, int]]) -> list[BaseException]:
    """``arena.placeholder`` over each range, from one thread per range released together;
    what the threads raised."""
    import threading

    gate, errors = threading.Barrier(len(ranges)), []

    def back(offset: int, nbytes: int) -> None:
        gate.wait()
        try:
            arena.placeholder(offset, nbytes)  # type: ignore[attr-defined]
        except BaseException as exc:  # the test reports whatever a thread hit
            errors.append(exc)

    threads = [threading.Thread(target=back, args=r) for r in ranges]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


def test_first_placeholder_calls_racing_in_two_threads_both_land(daemon, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """Two threads back different ranges of a fresh arena with placeholders at once. The
    daemon hands a session each placeholder chunk once: the reply that came second has no
    descriptors, and the thread holding it must not map (or lose) what the first brought."""
    import os

    import gpumem

    s = gpumem.connect(0, name="placeholder-race", runtime_dir=runtime_dir, timeout=30.0)
    try:
        g = s.device.granularity
        before = len(os.listdir("/proc/self/fd"))
        for round_ in range(20):
            arena = s.create_arena(f"race-{round_}", 8 * g)
            errors = _back_at_once(arena, [(0, 4 * g), (4 * g, 4 * g)])
            assert not errors, errors
            assert arena.placeholder_bytes == 8 * g, f"round {round_}: {arena.placeholder_bytes} of {8 * g} bytes backed"
            arena.release()
        assert len(os.listdir("/proc/self/fd")) <= before + 2, "placeholder descriptors leaked"
    finally:
        s.close()
