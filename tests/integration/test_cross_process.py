"""The foundation scenario on a real daemon with real client processes, on every backend:
bytes written by one client are read by another; kill -9 returns the owner's memory."""

from __future__ import annotations

from gpumemd_testkit import status, wait_status

MiB = 1 << 20
GiB = 1 << 30
RESERVE = 64 * GiB


def test_bytes_cross_processes_and_kill_returns_memory(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    commit = 1 * GiB + 6 * MiB  # two bulk chunks and a tail ladder
    owner = run_client("shell", "engine-a")
    reader = run_client("shell", "engine-b")
    owner.expect("CONNECTED")
    reader.expect("CONNECTED")
    baseline = status(runtime_dir)["device"]["free_bytes"]

    owner.send(f"create kv {RESERVE}")
    address = int(owner.expect("OK"))
    owner.send(f"commit kv {commit}")
    assert int(owner.expect("OK")) == commit
    owner.send(f"fill kv 0 {commit} 171")  # 0xAB over every chunk
    owner.expect("OK")
    owner.send("write kv 1000 c0ffee")
    owner.expect("OK")
    owner.send("share kv engine-b")
    owner.expect("OK")

    reader.send("attach kv")
    assert int(reader.expect("OK")) == address  # same virtual address in both processes
    reader.send("read kv 1000 3")
    assert reader.expect("OK") == "c0ffee"
    reader.send("check kv 0 1000 171")
    assert reader.expect("OK") == "MATCH"
    reader.send(f"check kv {commit - 8 * MiB} {8 * MiB} 171")
    assert reader.expect("OK") == "MATCH"
    reader.send(f"write kv {commit - 4} 0badf00d")
    reader.expect("OK")
    owner.send(f"read kv {commit - 4} 4")
    assert owner.expect("OK") == "0badf00d"

    s = status(runtime_dir)
    (arena,) = s["arenas"]
    assert arena["committed"] == commit and arena["owner"] == "engine-a"
    assert sorted(arena["attached"]) == ["engine-a", "engine-b"]
    assert {c["name"] for c in s["clients"]} == {"engine-a", "engine-b"}

    # kill -9 the owner: the reader still holds the arena, so it stays, owner marked gone
    owner.kill()
    s = wait_status(runtime_dir, lambda st: len(st["clients"]) == 1, 1.0, "owner's session dropped")
    assert s["arenas"][0]["owner_alive"] is False
    reader.send("read kv 1000 3")
    assert reader.expect("OK") == "c0ffee"

    # kill -9 the last holder: every byte comes back
    reader.kill()
    s = wait_status(runtime_dir, lambda st: not st["clients"], 1.0, "reader's session dropped")
    assert s["arenas"] == []
    assert s["device"]["accounted_bytes"] == 0
    if daemon.backend == "cuda":
        # the driver frees memory once the last mapping is gone: free returns to baseline
        wait_status(runtime_dir, lambda st: st["device"]["free_bytes"] >= baseline - 64 * MiB, 5.0, "device memory returned")
    else:
        assert s["device"]["free_bytes"] == baseline


def test_memory_handed_out_is_clean(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    """A chunk freed by one client and reused by the next never shows the old bytes."""
    a = run_client("shell", "tenant-a")
    a.expect("CONNECTED")
    a.send(f"create secret {RESERVE}")
    a.expect("OK")
    a.send(f"commit secret {512 * MiB}")
    a.expect("OK")
    a.send(f"fill secret 0 {512 * MiB} 90")
    a.expect("OK")
    a.send("release secret")
    a.expect("OK")
    a.send("exit")
    a.finish()

    b = run_client("shell", "tenant-b")
    b.expect("CONNECTED")
    b.send(f"create fresh {RESERVE}")
    b.expect("OK")
    b.send(f"commit fresh {512 * MiB}")
    b.expect("OK")
    b.send(f"check fresh 0 {512 * MiB} 0")
    assert b.expect("OK") == "MATCH"
