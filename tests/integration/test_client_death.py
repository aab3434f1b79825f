"""kill -9 of one client among several: the daemon notices within a second, takes back
what the dead client alone held, and leaves every other client exactly as it was."""

from __future__ import annotations

import json
import time

from gpumemd_testkit import GiB, MiB, do, status, wait_status


def test_kill_9_is_noticed_fast_and_others_are_untouched(daemon, run_client, runtime_dir) -> None:  # type: ignore[no-untyped-def]
    owner = run_client("shell", "bystander-a")  # owns "shared", attached by b and the victim
    peer = run_client("shell", "bystander-b")  # owns "own-b", attached to "shared"
    victim = run_client("shell", "victim")  # owns "doomed", attached to "shared"
    for c in (owner, peer, victim):
        c.expect("CONNECTED")

    do(owner, f"create shared {16 * GiB}")
    do(owner, f"commit shared {10 * MiB}")
    do(owner, "write shared 0 a1a2a3a4")
    for name in ("bystander-b", "victim"):
        do(owner, f"share shared {name}")
    do(peer, f"create own-b {16 * GiB}")
    do(peer, f"commit own-b {4 * MiB}")
    do(peer, "write own-b 100 b1b2")
    for c in (peer, victim):
        do(c, "attach shared")
    do(victim, f"create doomed {16 * GiB}")
    do(victim, f"commit doomed {6 * MiB}")
    do(victim, f"write shared {4 * MiB} 0dead0")

    before = status(runtime_dir)
    assert before["device"]["accounted_bytes"] == (10 + 4 + 6) * MiB
    by_name = {a["name"]: a for a in before["arenas"]}
    assert by_name["shared"]["attached"] == ["bystander-a", "bystander-b", "victim"]

    killed_at = time.monotonic()
    victim.kill()
    after = wait_status(
        runtime_dir, lambda s: "victim" not in {c["name"] for c in s["clients"]}, 1.0, "victim's session dropped"
    )
    assert time.monotonic() - killed_at < 1.0 + 0.5  # the wait itself is bounded at 1 s

    # Only what the victim alone held came back.
    assert after["device"]["accounted_bytes"] == (10 + 4) * MiB
    assert sorted(c["name"] for c in after["clients"]) == ["bystander-a", "bystander-b"]
    assert [c for c in after["clients"]] == [c for c in before["clients"] if c["name"] != "victim"]
    arenas = {a["name"]: a for a in after["arenas"]}
    assert set(arenas) == {"shared", "own-b"}
    assert arenas["own-b"] == by_name["own-b"]
    expected_shared = dict(by_name["shared"], attached=["bystander-a", "bystander-b"])
    assert arenas["shared"] == expected_shared

    # The survivors' mappings and sessions work as before, including what the victim wrote.
    assert do(owner, "read shared 0 4") == "a1a2a3a4"
    assert do(peer, f"read shared {4 * MiB} 3") == "0dead0"
    assert do(peer, "read own-b 100 2") == "b1b2"
    assert json.loads(do(owner, "notices")) == []  # a sharer's death is no news to the owner
    assert int(do(owner, f"commit shared {12 * MiB}")) == 12 * MiB
    assert int(do(peer, "sync shared")) == 12 * MiB
    do(peer, f"write shared {11 * MiB} c0c1")
    assert do(owner, f"read shared {11 * MiB} 2") == "c0c1"
    for c in (owner, peer):
        do(c, "ping")
    assert status(runtime_dir)["device"]["accounted_bytes"] == (12 + 4) * MiB
    # A new client may take the dead one's name and arena name at once.
    again = run_client("shell", "victim")
    again.expect("CONNECTED")
    do(again, f"create doomed {16 * GiB}")
