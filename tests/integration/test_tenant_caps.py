"""Tenant memory caps across real processes (memory_caps.py): clients of different uids, each
held to its cap at every commit, an allocation storm from several tenants that never
gets one byte past any cap, a cap lowered by SIGHUP in force within 100 ms, and caps
from DRA claims written by a stand-in driver (dra_kit).

Other users are real as far as the daemon can tell: tests/clients.py --as drops the
client to another uid (and gid) before it connects; the daemon reads them from
SO_PEERCRED (see test_grants.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import child_env
from dra_kit import FakeDraDriver
from gpumemd_testkit import GiB, MiB, do, reply, status, wait_status
from test_grants import ctl

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
A, B, C = 4242, 4243, 4244
GROUP = 777


def open_sockets(runtime_dir: Path) -> None:
    """Let clients of any uid and gid in: the sockets are 0660, group root, and a client
    run --as UID:GID has no supplementary groups."""
    os.chmod(runtime_dir, 0o755)
    for path in runtime_dir.iterdir():
        if stat.S_ISSOCK(path.lstat().st_mode):
            os.chmod(path, 0o666)


def tenants(runtime_dir: Path) -> dict[str, dict[str, Any]]:
    return {t["tenant"]: t for t in status(runtime_dir)["tenants"]}


def refused(client: Any, command: str, *why: str) -> str:
    line = reply(client, command)
    assert line.startswith("ERR ResourceExhausted "), f"{command!r} answered {line!r}"
    for part in why:
        assert part in line, line
    return line


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    return tmp_path / "tenants.toml"


@pytest.fixture
def claims() -> Iterator[Path]:
    """The claims root, where the engine's uid can reach its claim's directory."""
    path = Path(tempfile.mkdtemp(prefix="gpumemd-claims-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_each_uid_is_held_to_its_cap_and_status_shows_it(daemon_factory, backend, run_client, runtime_dir, policy) -> None:  # type: ignore[no-untyped-def]
    policy.write_text(f'[[tenant]]\nuid = {A}\nmax = "64MiB"\n[[tenant]]\ngid = {GROUP}\nmax = "32MiB"\n')
    daemon_factory(backend, args=["--tenant-policy", str(policy)])
    open_sockets(runtime_dir)
    a, b1, b2 = (run_client("shell", name, "--as", who) for name, who in (("a", f"{A}:0"), ("b1", f"{B}:{GROUP}"), ("b2", f"{C}:{GROUP}")))
    root = run_client("shell", "root")
    for c in (a, b1, b2, root):
        c.expect("CONNECTED")
        do(c, f"create x {GiB}")
    assert int(do(a, f"commit x {64 * MiB}")) == 64 * MiB
    refused(a, f"commit x {66 * MiB}", "uid 4242 holds 64 MiB", "cap of 64 MiB", str(policy))
    # Two uids of one group share its cap.
    do(b1, f"commit x {16 * MiB}")
    do(b2, f"commit x {16 * MiB}")
    refused(b2, f"commit x {18 * MiB}", "gid 777 holds 32 MiB")
    # The uncapped user is not held by anyone's cap.
    do(root, f"commit x {256 * MiB}")
    rows = tenants(runtime_dir)
    assert {t: (r["used_bytes"], r["max_bytes"]) for t, r in rows.items()} == {"uid 4242": (64 * MiB, 64 * MiB), "gid 777": (32 * MiB, 32 * MiB)}
    out = ctl(runtime_dir, "status")
    assert "TENANT CAPS" in out and "uid 4242" in out and "gid 777" in out
    for c in (a, b1, b2, root):
        c.send("exit")
        c.finish()
    assert status(runtime_dir)["device"]["accounted_bytes"] == 0


@needs_root
def test_placeholders_count_in_the_cap(daemon_factory, backend, run_client, runtime_dir, policy) -> None:  # type: ignore[no-untyped-def]
    # Placeholder chunks are device memory: an arena of placeholders alone once took a
    # capped uid past its cap (31 arenas of 256 MiB placeholders under a 1 GiB cap).
    policy.write_text(f'[[tenant]]\nuid = {A}\nmax = "48MiB"\n')
    daemon_factory(backend, args=["--tenant-policy", str(policy)])
    open_sockets(runtime_dir)
    a = run_client("shell", "a", "--as", f"{A}:0")
    a.expect("CONNECTED")
    do(a, f"create x {GiB}")
    do(a, f"create y {GiB}")
    do(a, f"placeholder x 0 {64 * MiB} {32 * MiB}")
    used = tenants(runtime_dir)["uid 4242"]["used_bytes"]
    assert used >= 32 * MiB, f"the placeholders count {used} bytes"
    refused(a, f"placeholder y 0 {64 * MiB} {32 * MiB}", "uid 4242 holds", "cap of 48 MiB")
    refused(a, f"commit x {48 * MiB - used + 2 * MiB}", "uid 4242 holds")
    a.send("exit")
    a.finish()
    assert status(runtime_dir)["device"]["accounted_bytes"] == 0


@needs_root
def test_an_allocation_storm_from_several_tenants_never_passes_a_cap(daemon_factory, backend, run_client, runtime_dir, policy) -> None:  # type: ignore[no-untyped-def]
    caps = {A: 48 * MiB, B: 80 * MiB, C: 32 * MiB}
    policy.write_text("".join(f'[[tenant]]\nuid = {uid}\nmax = {cap}\n' for uid, cap in caps.items()))
    daemon_factory(backend, args=["--tenant-policy", str(policy)])
    open_sockets(runtime_dir)
    rng = random.Random(27)
    clients = []
    for uid in caps:
        for i in range(2):  # two sessions per tenant: they share its cap
            c = run_client("shell", f"t{uid}-{i}", "--as", f"{uid}:0")
            c.expect("CONNECTED")
            clients.append((uid, c, {}))  # arena -> committed as the client last heard (names are per uid)
    refusals = 0
    for step in range(400):
        k = rng.randrange(len(clients))
        uid, c, held = clients[k]
        name = f"c{k}a{rng.randrange(3)}"
        if name not in held:
            do(c, f"create {name} {GiB}")
            held[name] = 0
        op = rng.random()
        if op < 0.6:
            size = held[name] + rng.randrange(1, 12) * 2 * MiB
            line = reply(c, f"commit {name} {size}")
            if line.startswith("OK"):
                held[name] = size
            else:
                assert line.startswith("ERR ResourceExhausted ") and f"uid {uid}" in line, line
                refusals += 1
        elif op < 0.85 and held[name]:
            to = rng.randrange(0, held[name] // (2 * MiB) + 1) * 2 * MiB
            held[name] = int(do(c, f"decommit {name} {to}"))  # to a chunk boundary at or above it
        else:
            do(c, f"release {name}")
            del held[name]
        if step % 10 == 0:
            for tenant, row in tenants(runtime_dir).items():
                assert row["used_bytes"] <= row["max_bytes"], f"step {step}: {tenant} holds {row['used_bytes']} over its cap {row['max_bytes']}"
        for other in {u for u, _, _ in clients}:
            mine = sum(sum(h.values()) for u, _, h in clients if u == other)
            assert mine <= caps[other], f"step {step}: uid {other}'s clients hold {mine} over its cap {caps[other]}"
    assert refusals > 20, f"only {refusals} refusals: the storm never pressed on a cap"
    for _, c, _ in clients:
        c.send("exit")
        c.finish()
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0, 10.0, "every tenant's memory given back")


def test_a_cap_lowered_by_sighup_is_in_force_within_100ms_and_takes_nothing_away(daemon_factory, backend, run_client, runtime_dir, policy) -> None:  # type: ignore[no-untyped-def]
    uid = os.getuid()
    policy.write_text(f'[[tenant]]\nuid = {uid}\nmax = "128MiB"\n')
    d = daemon_factory(backend, args=["--tenant-policy", str(policy)])
    c = run_client("shell", "engine")
    c.expect("CONNECTED")
    do(c, f"create x {GiB}")
    do(c, f"commit x {64 * MiB}")
    policy.write_text(f'[[tenant]]\nuid = {uid}\nmax = "32MiB"\n')
    started = time.monotonic()
    os.kill(d.pid, signal.SIGHUP)
    while tenants(runtime_dir)[f"uid {uid}"]["max_bytes"] != 32 * MiB:
        assert time.monotonic() - started < 5.0, "the lowered cap never applied"
    took = time.monotonic() - started
    assert took < 0.1, f"the lowered cap applied {took * 1e3:.0f} ms after SIGHUP"
    refused(c, f"commit x {66 * MiB}", "holds 64 MiB", "cap of 32 MiB")
    # What the tenant held stays mapped and usable; status shows it over the cap.
    do(c, f"fill x 0 {64 * MiB} 7")
    assert do(c, f"check x 0 {64 * MiB} 7") == "MATCH"
    assert tenants(runtime_dir)[f"uid {uid}"]["used_bytes"] == 64 * MiB
    assert "over: commits refused" in ctl(runtime_dir, "status")
    # Under the cap again, it commits again.
    assert int(do(c, "decommit x 0")) == 0
    do(c, f"commit x {32 * MiB}")
    # A policy that does not parse keeps the caps in force, and says so in the log.
    policy.write_text(f'[[tenant]]\nuid = {uid}\nmax = "lots"\n')
    os.kill(d.pid, signal.SIGHUP)
    deadline = time.monotonic() + 5.0
    while "tenant caps not reloaded" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.01)
    refused(c, f"commit x {34 * MiB}", "cap of 32 MiB")
    c.send("exit")
    c.finish()


def test_a_bad_policy_stops_the_daemon_at_start_naming_the_entry(daemon_factory, policy) -> None:  # type: ignore[no-untyped-def]
    policy.write_text('[[tenant]]\nuid = 1\nmax = "1MiB"\nmin = "2MiB"\n')
    d = daemon_factory("host", args=["--tenant-policy", str(policy)], wait=False)
    assert d.proc.wait(timeout=60) != 0
    assert f"{policy} tenant #1: its minimum 2 MiB is above its maximum 1 MiB" in d.log()


@needs_root
def test_a_dra_claim_becomes_its_tenants_cap_and_its_pod_finds_the_daemon(daemon_factory, backend, run_client, runtime_dir, claims) -> None:  # type: ignore[no-untyped-def]
    daemon_factory(backend, args=["--tenant-claims", str(claims)])
    open_sockets(runtime_dir)
    driver = FakeDraDriver(claims, runtime_dir)
    claim = driver.prepare("0f6c3b1e-claim", A, 48 * MiB)  # no signal: the daemon sees the claim come
    wait_status(runtime_dir, lambda s: any(t["tenant"] == f"uid {A}" for t in s["tenants"]), 5.0, "the claim's cap")
    # The engine pod knows only what its claim's CDI edits give it.
    env = child_env(runtime_dir, **driver.pod_env(claim))
    engine = run_client("shell", "engine", "--as", f"{A}:0", env=env)
    engine.expect("CONNECTED")
    do(engine, f"create kv {GiB}")
    do(engine, f"commit kv {48 * MiB}")
    refused(engine, f"commit kv {50 * MiB}", "cap of 48 MiB", "claim 0f6c3b1e-claim")
    row = tenants(runtime_dir)[f"uid {A}"]
    assert (row["max_bytes"], row["min_bytes"], row["source"]) == (48 * MiB, 48 * MiB, "claim 0f6c3b1e-claim")
    # The claim goes (the pod was deleted): no cap any more, again with no signal.
    driver.unprepare("0f6c3b1e-claim")
    wait_status(runtime_dir, lambda s: not s["tenants"], 5.0, "the claim's cap gone")
    do(engine, f"commit kv {64 * MiB}")
    engine.send("exit")
    engine.finish()


@needs_root
def test_a_kv_round_and_grows_of_two_uids_stay_within_their_caps(daemon_factory, backend, run_client, runtime_dir, policy) -> None:  # type: ignore[no-untyped-def]
    policy.write_text(f'[[tenant]]\nuid = {A}\nmax = "64MiB"\n[[tenant]]\nuid = {B}\nmax = "96MiB"\n')
    daemon_factory(backend, args=["--tenant-policy", str(policy)])
    open_sockets(runtime_dir)
    a, b = run_client("shell", "engine-a", "--as", f"{A}:0"), run_client("shell", "engine-b", "--as", f"{B}:0")
    row = 4096  # 256 tokens a MiB
    for c in (a, b):
        c.expect("CONNECTED")
        do(c, f"kvdeclare kv 1 {row} 262144")
        do(c, "join kv")
    a.send("capture kv 0 1024 262144 1.0")
    b.send("capture kv 0 1024 262144 1.0")
    got = {name: json.loads(c.expect("OK", timeout=60.0))["tokens"] for name, c in (("a", a), ("b", b))}
    # Each gets its cap (the host device has 4 GiB: the caps, not the device, bound them).
    assert got == {"a": 64 * 256, "b": 96 * 256}, got
    # A grow past the cap gets nothing more: refused, naming it.
    refused(a, "kvgrow kv 20000", "uid 4242 holds 64 MiB", "cap of 64 MiB")
    # Raised, the grow gets what the new cap leaves.
    policy.write_text(f'[[tenant]]\nuid = {A}\nmax = "80MiB"\n[[tenant]]\nuid = {B}\nmax = "96MiB"\n')
    os.kill(int(status(runtime_dir)["daemon"]["pid"]), signal.SIGHUP)
    wait_status(runtime_dir, lambda s: any(t["max_bytes"] == 80 * MiB for t in s["tenants"]), 5.0, "the raised cap")
    assert json.loads(do(a, "kvgrow kv 262144"))["tokens"] == 80 * 256
    rows = tenants(runtime_dir)
    assert (rows[f"uid {A}"]["used_bytes"], rows[f"uid {B}"]["used_bytes"]) == (80 * MiB, 96 * MiB)
    for c in (a, b):
        c.send("exit")
        c.finish()
