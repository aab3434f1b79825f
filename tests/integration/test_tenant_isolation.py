"""No tenant sees another's bytes: memory one client filled and gave back reaches the next
client zeroed, every byte of it, on every backend. On CUDA the daemon zeroes each chunk
before its first descriptor leaves (the driver promises nothing about fresh allocations);
memfd pages are zero by construction."""

from __future__ import annotations

from gpumemd_testkit import status, wait_status

MiB = 1 << 20
GiB = 1 << 30


def test_memory_filled_by_one_tenant_reaches_the_next_zeroed(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    # Bulk chunks and a tail ladder: every size the daemon creates.
    size = (2 * GiB + 6 * MiB) if daemon.backend == "cuda" else (64 * MiB + 6 * MiB)
    a = run_client("shell", "tenant-a")
    a.expect("CONNECTED")
    for round_ in range(2):  # the second pass reuses whatever the first gave back
        a.send(f"create a{round_} {4 * GiB}")
        a.expect("OK")
        a.send(f"commit a{round_} {size}")
        assert int(a.expect("OK")) == size
        a.send(f"fill a{round_} 0 {size} 171")  # 0xAB everywhere
        a.expect("OK")
        a.send(f"check a{round_} 0 {size} 171")
        assert a.expect("OK") == "MATCH", "the fill did not land: the check below would prove nothing"
        a.send(f"release a{round_}")
        a.expect("OK")
        wait_status(runtime_dir, lambda st: st["device"]["accounted_bytes"] == 0, 5.0, "tenant a's memory given back")

        b = run_client("shell", f"tenant-b{round_}")
        b.expect("CONNECTED")
        b.send(f"create b{round_} {4 * GiB}")
        b.expect("OK")
        b.send(f"commit b{round_} {size}")
        assert int(b.expect("OK")) == size
        b.send(f"check b{round_} 0 {size} 0")
        assert b.expect("OK", timeout=120.0) == "MATCH", f"tenant b read tenant a's bytes (pass {round_})"
        b.send("exit")
        b.finish()
    a.send("exit")
    a.finish()
    assert status(runtime_dir)["device"]["accounted_bytes"] == 0
