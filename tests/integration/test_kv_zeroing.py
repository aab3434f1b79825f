"""No tenant sees another's bytes through a KV round either: a member that reports while
others are still pending gets its minimum staged (created and zeroed then, not at
handout), and what it finally maps reads zero, after another client filled and gave back
that much memory. On CUDA the staged chunks come from memory just released; the host
backend runs the same steps on fresh memfds."""

from __future__ import annotations

import json

from gpumemd_testkit import status, wait_status

MiB = 1 << 20
GiB = 1 << 30
ROW = 4096


def test_a_staged_kv_minimum_reaches_its_pool_zeroed(daemon_factory, backend, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    # One KV chunk each, the size of what the first tenant fills and gives back.
    chunk = GiB if backend == "cuda" else 64 * MiB
    daemon_factory(backend, args=["--kv-chunk-size", str(chunk)])
    a = run_client("shell", "tenant-a")
    a.expect("CONNECTED")
    a.send(f"create a {4 * chunk}")
    a.expect("OK")
    a.send(f"commit a {2 * chunk}")
    assert int(a.expect("OK")) == 2 * chunk
    a.send(f"fill a 0 {2 * chunk} 171")
    a.expect("OK")
    a.send("release a")
    a.expect("OK")
    wait_status(runtime_dir, lambda st: st["device"]["accounted_bytes"] == 0, 10.0, "tenant a's memory given back")

    tokens = chunk // ROW
    members = [run_client("shell", f"tenant-b{i}") for i in range(2)]
    for i, b in enumerate(members):
        b.expect("CONNECTED")
        b.send(f"kvdeclare kv{i} 1 {ROW} {tokens}")
        b.expect("OK")
        b.send(f"joinx kv{i} 2")
        b.expect("OK")
    # The first report is staged while the round waits for the second.
    members[0].send(f"capture kv0 0 {tokens} {tokens} 1")
    wait_status(runtime_dir, lambda st: st["device"]["accounted_bytes"] >= chunk, 30.0, "the first minimum staged")
    members[1].send("capture kv1 0 1 1 1")
    for i, b in enumerate(members):
        got = json.loads(b.expect("OK", timeout=60.0))
        assert got["tokens"] >= (tokens if i == 0 else 1)
    members[0].send(f"check kv0 0 {chunk} 0")
    assert members[0].expect("OK", timeout=120.0) == "MATCH", "the staged KV minimum holds an earlier tenant's bytes"
    for c in (a, *members):
        c.send("exit")
        c.finish()
    assert status(runtime_dir)["device"]["accounted_bytes"] == 0
