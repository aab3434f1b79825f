"""A sharer's sync after its owner gave chunks back and committed new ones at the same
offsets, in real client processes on every backend: the sharer ends up mapping the new
chunks and reads the owner's new bytes (a wrong unmap there faults on the next read,
which kills the process)."""

from __future__ import annotations

import json

from gpumemd_testkit import do, status, wait_status

MiB = 1 << 20
GiB = 1 << 30


def test_sync_after_decommit_and_recommit_maps_the_new_chunks(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    owner = run_client("shell", "owner")
    sharer = run_client("shell", "sharer")
    owner.expect("CONNECTED")
    sharer.expect("CONNECTED")
    do(owner, f"create kv {GiB}")
    do(owner, f"commit kv {8 * MiB}")
    do(owner, f"fill kv 0 {8 * MiB} 17")
    do(owner, "share kv sharer")
    do(sharer, "attach kv")
    assert do(sharer, f"check kv 0 {8 * MiB} 17") == "MATCH"

    # Between two of the sharer's syncs: every chunk retired, new ones at the same offsets
    # (and one more past them).
    do(owner, "decommit kv 0")
    do(owner, f"commit kv {12 * MiB}")
    do(owner, f"fill kv 0 {12 * MiB} 90")
    assert int(do(sharer, "sync kv")) == 12 * MiB
    assert do(sharer, f"check kv 0 {12 * MiB} 90") == "MATCH", "the sharer does not see the new chunks"
    backed = json.loads(do(sharer, "backed kv"))
    assert backed["committed"] == [[0, 12 * MiB]] and backed["backed"] == [[0, 12 * MiB]]

    # The retired chunks are gone everywhere: only the new ones stay counted.
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 12 * MiB, 5.0, "retired chunks unmapped by the sharer")

    # Its bookkeeping holds the new chunks by id: they retire cleanly too.
    do(owner, "decommit kv 0")
    assert int(do(sharer, "sync kv")) == 0
    do(sharer, "release kv")
    do(owner, "release kv")
    for client in (owner, sharer):
        client.send("exit")
        client.finish()
    assert status(runtime_dir)["device"]["accounted_bytes"] == 0
