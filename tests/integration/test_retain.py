"""Retained memory with real processes: an engine killed with -9 leaves its retained
arena and KV pool to the daemon (orphaned, accounted, with a deadline), and another
process adopts them with the group's secret at the same addresses, contents intact.
And what goes wrong: a wrong or stolen secret, two adopters at once, an adopter killed
mid-adoption, a holder whose process still runs (also across a restart), the deadline,
and gpumemd itself killed during the failover (the fd store keeps the orphans)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Client, child_env
from fdstore_kit import Restartable
from gpumemd_testkit import GiB, MiB, do, reply, status, wait_status

SCRIPT = Path(__file__).resolve().parent.parent / "retain_clients.py"
OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")


class RetainClient(Client):
    """A tests/retain_clients.py shell in its own process."""

    def __init__(self, runtime_dir: Path, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "shell", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(runtime_dir),
        )


Spawn = Callable[..., RetainClient]


@pytest.fixture
def spawn(runtime_dir: Path) -> Iterator[Spawn]:
    made: list[RetainClient] = []

    def start(name: str, *args: str) -> RetainClient:
        c = RetainClient(runtime_dir, [name, *args])
        made.append(c)
        c.expect("CONNECTED")
        return c

    yield start
    for c in made:
        c.end()


def group_of(s: dict[str, Any], name: str = "g") -> dict[str, Any] | None:
    return next((g for g in s.get("retained", []) if g["group"] == name), None)


def in_state(state: str, name: str = "g") -> Callable[[dict[str, Any]], bool]:
    return lambda s: (g := group_of(s, name)) is not None and g["state"] == state


def primary(spawn: Spawn, name: str = "primary") -> tuple[RetainClient, str, dict[str, int]]:
    """An engine with a plain arena and a KV pool, each holding a pattern, both retained
    for group "g"; returns it, the secret and the two addresses."""
    c = spawn(name)
    addresses = {"weights": int(do(c, f"create weights {GiB}"))}
    do(c, f"commit weights {8 * MiB}")
    do(c, f"fill weights 0 {8 * MiB} 171")
    do(c, "kvdeclare kv 2 4096 16384")
    assert int(do(c, "grow kv 4096")) == 4096
    do(c, f"fill kv 0 {4096 * 4096} 90")  # buffer b0's rows
    addresses["kv"] = int(do(c, "address kv"))
    secret = do(c, "group g")
    do(c, "retain g weights")
    do(c, "retain g kv")
    return c, secret, addresses


def orphaned(runtime_dir: Path) -> dict[str, Any]:
    return wait_status(runtime_dir, in_state("orphaned"), 10.0, "the group orphaned")


def test_kill_9_then_another_process_adopts_at_the_same_addresses(daemon: Any, spawn: Spawn, runtime_dir: Path) -> None:
    eng, secret, addresses = primary(spawn)
    before = status(runtime_dir)["device"]["accounted_bytes"]
    assert group_of(status(runtime_dir))["state"] == "held"  # type: ignore[index]
    eng.kill()
    s = orphaned(runtime_dir)
    g = group_of(s)
    assert g is not None
    assert (g["objects"], g["previous"], g["fenced"]) == (["weights", "kv"], "primary", True)
    assert 0 < g["deadline_in_s"] <= 60
    assert s["device"]["accounted_bytes"] == before  # kept, and counted
    assert {a["name"]: a["owner_alive"] for a in s["arenas"]} == {"weights": False, "kv": False}

    standby = spawn("standby")
    got = json.loads(do(standby, f"adopt g {secret} 5"))
    assert got["arenas"] == {"weights": addresses["weights"]}
    assert got["kv"] == {"kv": [addresses["kv"], 4096]}
    assert got["previous"].startswith("client 'primary'")
    assert do(standby, f"check weights 0 {8 * MiB} 171") == "MATCH"
    assert do(standby, f"check kv 0 {4096 * 4096} 90") == "MATCH"
    assert do(standby, "kvcheck kv") == "MATCH"
    assert int(do(standby, "grow kv 8192")) == 8192  # its own now
    s = status(runtime_dir)
    g = group_of(s)
    assert g is not None and (g["state"], g["holder"], g["deadline_in_s"]) == ("held", "standby", -1.0)
    assert {a["name"]: (a["owner"], a["owner_alive"]) for a in s["arenas"]} == {"weights": ("standby", True), "kv": ("standby", True)}
    do(standby, "close")  # an ordinary end releases them as any other
    after = wait_status(runtime_dir, lambda s: not s["arenas"], 5.0, "everything released")
    assert after["device"]["accounted_bytes"] == 0 and after["retained"] == []


def test_an_adoption_waits_for_every_sharer_and_the_dead_owners_grants_die(daemon: Any, spawn: Spawn, runtime_dir: Path) -> None:
    """The fence covers every writer: a sharer the dead owner admitted keeps the group
    NOT_FENCED while it maps the memory, and is waited out once killed (the reply names
    it); the dead owner's grant admits nobody to the adopter's memory afterwards."""
    eng, secret, _ = primary(spawn)
    do(eng, "share weights mate")
    mate = spawn("mate")
    do(mate, "attach weights")
    eng.kill()
    orphaned(runtime_dir)
    standby = spawn("standby")
    held = reply(standby, f"adopt g {secret} 0")
    assert held.startswith("ERR NotFenced") and "client 'mate'" in held, held
    weights = next(a for a in status(runtime_dir)["arenas"] if a["name"] == "weights")
    assert weights["attached"] == ["mate"]
    do(mate, f"fill weights 0 {MiB} 7")  # it still writes: that is why the adopter waits
    mate.kill()
    got = json.loads(do(standby, f"adopt g {secret} 10"))
    assert got["waited_for"][0].startswith("client 'primary'") and got["waited_for"][1].startswith("client 'mate'"), got
    assert do(standby, f"check weights {MiB} {7 * MiB} 171") == "MATCH"
    do(standby, f"fill weights 0 {MiB} 171")
    late = spawn("mate")  # a fresh process under the name the dead owner's grant named
    assert reply(late, "attach weights").startswith("ERR PermissionDenied")
    weights = next(a for a in status(runtime_dir)["arenas"] if a["name"] == "weights")
    assert weights["attached"] == ["standby"] and weights["grants"] == []
    assert do(standby, f"check weights 0 {8 * MiB} 171") == "MATCH"


def test_a_forked_child_of_the_dead_holder_keeps_the_adoption_waiting(daemon_factory: Any, spawn: Spawn, runtime_dir: Path) -> None:
    """Host backend: a child the holder forked closes every descriptor and writes on
    through the mappings it inherited. The holder's death and exit prove nothing about
    it; /proc/PID/maps does, and ADOPT is NOT_FENCED naming it until it is gone. (On CUDA
    a forked child cannot use its parent's context: the parent's fence covers it.)"""
    daemon_factory("host")
    eng, secret, _ = primary(spawn)
    child = int(do(eng, "forkwrite weights 7"))
    try:
        eng.kill()
        orphaned(runtime_dir)
        standby = spawn("standby")
        held = reply(standby, f"adopt g {secret} 0")
        assert held.startswith("ERR NotFenced") and str(child) in held and "/proc/PID/maps" in held, held
    finally:
        os.kill(child, signal.SIGKILL)
    got = json.loads(do(standby, f"adopt g {secret} 10"))
    assert got["arenas"]
    do(standby, f"fill weights 0 {MiB} 171")
    assert do(standby, f"check weights 0 {8 * MiB} 171") == "MATCH"  # nobody writes it any more


def test_no_byte_reaches_a_wrong_secret_or_a_grant(daemon: Any, spawn: Spawn, runtime_dir: Path) -> None:
    eng, secret, addresses = primary(spawn)
    do(eng, "share weights reader")
    eng.kill()
    orphaned(runtime_dir)
    thief = spawn("reader")
    wrong = reply(thief, f"adopt g {'0' * 64} 0")
    assert wrong.startswith("ERR PermissionDenied") and "wrong secret" in wrong and secret not in wrong
    assert reply(thief, "attach weights").startswith("ERR PermissionDenied")  # the dead owner's grant opens nothing
    probe = json.loads(do(thief, f"probe {addresses['weights']} {8 * MiB}"))
    assert not probe["mapped"] and not [f for f in probe["fds"] if "gpumemd-chunk" in f]
    assert group_of(status(runtime_dir))["state"] == "orphaned"  # type: ignore[index]


@needs_root
def test_a_stolen_secret_is_refused_to_another_uid(daemon: Any, spawn: Spawn, runtime_dir: Path) -> None:
    os.chmod(runtime_dir, 0o750)  # the other uid reaches the sockets through group root
    eng, secret, addresses = primary(spawn)
    eng.kill()
    orphaned(runtime_dir)
    thief = spawn("thief", "--as", f"{OTHER_UID}:0")
    stolen = reply(thief, f"adopt g {secret} 0")
    assert stolen.startswith("ERR PermissionDenied") and f"uid {os.geteuid()}" in stolen
    probe = json.loads(do(thief, f"probe {addresses['kv']} {4096 * 4096}"))
    assert not probe["mapped"] and not [f for f in probe["fds"] if "gpumemd-chunk" in f]
    assert group_of(status(runtime_dir))["state"] == "orphaned"  # type: ignore[index]


def test_two_adopters_at_once_one_wins_the_other_is_told_who(daemon: Any, spawn: Spawn, runtime_dir: Path) -> None:
    eng, secret, _ = primary(spawn)
    a, b = spawn("adopter-a"), spawn("adopter-b")
    for c in (a, b):  # both wait for the death, then race
        c.send(f"adopt g {secret} 20")
    eng.kill()
    started = time.monotonic()
    answers = {c: c.expect("", 30) for c in (a, b)}
    assert time.monotonic() - started < 10  # the loser is told when the winner took it, not when its wait ends
    won = [c for c, line in answers.items() if line.startswith("OK")]
    assert len(won) == 1, answers
    winner = "adopter-a" if won[0] is a else "adopter-b"
    (lost,) = [line for c, line in answers.items() if c is not won[0]]
    assert lost.startswith("ERR GroupHeld") and f'"holder": "{winner}"' in lost, lost
    assert do(won[0], f"check weights 0 {8 * MiB} 171") == "MATCH"


def test_an_adopter_killed_mid_adoption_gives_it_back(daemon: Any, spawn: Spawn, runtime_dir: Path) -> None:
    eng, secret, addresses = primary(spawn)
    eng.kill()
    first = orphaned(runtime_dir)
    deadline = group_of(first)["deadline_in_s"]  # type: ignore[index]
    adopter = spawn("adopter")
    do(adopter, f"adopt g {secret} 5 noconfirm")
    do(adopter, f"fill weights 0 {MiB} 7")  # it wrote before it died: what it wrote stays
    assert group_of(status(runtime_dir))["state"] == "adopting"  # type: ignore[index]
    adopter.kill()
    s = wait_status(runtime_dir, lambda s: group_of(s)["previous"] == "adopter", 10.0, "the group back to orphaned")  # type: ignore[index]
    g = group_of(s)
    assert g is not None and g["state"] == "orphaned" and g["deadline_in_s"] < deadline  # not extended
    last = spawn("last")
    got = json.loads(do(last, f"adopt g {secret} 5"))
    assert got["arenas"]["weights"] == addresses["weights"]
    assert do(last, f"check weights 0 {MiB} 7") == "MATCH"
    assert do(last, f"check weights {MiB} {7 * MiB} 171") == "MATCH"


def test_a_holder_whose_process_runs_on_is_not_adopted_until_it_exits(daemon: Any, spawn: Spawn, runtime_dir: Path) -> None:
    eng, secret, _ = primary(spawn)
    do(eng, "cut")  # its session ends; the process (it could still write) does not
    orphaned(runtime_dir)
    standby = spawn("standby")
    refused = reply(standby, f"adopt g {secret} 0.3")
    assert refused.startswith("ERR NotFenced") and f"pid {eng.pid} still runs" in refused
    assert not group_of(status(runtime_dir))["fenced"]  # type: ignore[index]
    standby.send(f"adopt g {secret} 20")
    eng.kill()
    assert standby.expect("OK", 30)


def test_the_deadline_releases_an_orphan(daemon_factory: Any, backend: str, spawn: Spawn, runtime_dir: Path) -> None:
    daemon_factory(backend, args=["--retain-grace", "0.5"])
    eng, secret, _ = primary(spawn)
    eng.kill()
    s = wait_status(runtime_dir, lambda s: not s["arenas"] and s["retained"] == [], 10.0, "the orphan released at its deadline")
    assert s["device"]["accounted_bytes"] == 0
    late = spawn("late")
    assert reply(late, f"adopt g {secret} 0").startswith("ERR NotFound")


@pytest.fixture
def service(runtime_dir: Path, backend: str) -> Iterator[Restartable]:
    r = Restartable(runtime_dir, backend, [], child_env(runtime_dir))
    yield r.start()
    r.close()


def test_gpumemd_killed_during_the_failover_keeps_the_orphans(service: Restartable, spawn: Spawn, runtime_dir: Path) -> None:
    eng, secret, addresses = primary(spawn)
    eng.kill()
    orphaned(runtime_dir)
    service.restart()  # kill -9 and start again, with what the store kept
    s = wait_status(runtime_dir, in_state("orphaned"), 10.0, "the orphan rebuilt")
    assert s["daemon"]["generation"] == 1
    adopter = spawn("adopter")
    do(adopter, f"adopt g {secret} 5 noconfirm")
    service.restart()  # during the adoption: the adopter resumes, and confirms
    do(adopter, "confirm g")
    assert do(adopter, f"check weights 0 {8 * MiB} 171") == "MATCH"
    assert do(adopter, f"check kv 0 {4096 * 4096} 90") == "MATCH"
    g = group_of(status(runtime_dir))
    assert g is not None and (g["state"], g["holder"]) == ("held", "adopter")
    assert int(do(adopter, "address kv")) == addresses["kv"]


def test_a_holder_alive_across_a_restart_is_adopted_once_it_dies(runtime_dir: Path, backend: str, spawn: Spawn) -> None:
    """gpumemd killed during a failover and back before the dead engine's process is gone
    (on CUDA its teardown takes a while): the restarted daemon keeps the group for the
    holder's session, which may still resume, and a standby waiting in adopt takes it as
    soon as the process is gone, not after the restart grace."""
    service = Restartable(runtime_dir, backend, ["--restart-grace", "120"], child_env(runtime_dir))
    service.start()
    try:
        eng, secret, addresses = primary(spawn)
        os.kill(eng.pid, signal.SIGSTOP)  # it neither resumes nor ends across the restart
        service.restart()
        standby = spawn("standby")
        held = reply(standby, f"adopt g {secret} 0.3")
        assert held.startswith("ERR GroupHeld") and "'primary'" in held, held
        standby.send(f"adopt g {secret} 60")
        eng.kill()
        assert standby.expect("OK", 30), "adopted once the holder was gone, well inside the 120 s restart grace"
        assert do(standby, f"check kv 0 {4096 * 4096} 90") == "MATCH"
        assert int(do(standby, "address kv")) == addresses["kv"]
    finally:
        service.close()


def test_the_prefix_directory_outlives_its_writer(daemon: Any, spawn: Spawn, runtime_dir: Path) -> None:
    eng, secret, _ = primary(spawn)
    do(eng, "dircreate kv-prefix 64")
    do(eng, "retain g kv-prefix")
    for block, h in ((0, 11), (1, 22), (2, 33), (5, 55)):
        do(eng, f"dirpublish kv-prefix {block} {h}")
    do(eng, "dirinvalidate kv-prefix 1")  # being rewritten when it died
    do(eng, "dirtear kv-prefix 3 44")  # a publish cut short
    eng.kill()
    orphaned(runtime_dir)
    standby = spawn("standby")
    do(standby, f"adopt g {secret} 5")
    do(standby, "diropen kv-prefix")
    scan = json.loads(do(standby, "dirscan kv-prefix 4"))  # it committed 4 blocks: block 5 is past them
    assert scan["blocks"] == {"11": 0, "33": 2}
    assert (scan["corrupt"], scan["beyond"]) == (1, 1)


def test_a_read_only_grant_maps_the_weights_for_reading_only(daemon: Any, backend: str, spawn: Spawn, runtime_dir: Path) -> None:
    eng = spawn("primary")
    address = int(do(eng, f"create weights {GiB}"))
    do(eng, f"commit weights {8 * MiB}")
    do(eng, f"fill weights 0 {8 * MiB} 171")
    do(eng, "roshare weights standby")
    standby = spawn("standby")
    assert int(do(standby, "attach weights")) == address
    assert do(standby, f"check weights 0 {8 * MiB} 171") == "MATCH"
    assert reply(standby, "write weights 0 00").startswith("ERR PermissionDenied")
    assert do(standby, "access weights") == "r" and do(eng, "access weights") == "rw"
    grants = {a["name"]: a["grants"] for a in status(runtime_dir)["arenas"]}["weights"]
    assert [g["read_only"] for g in grants] == [True]
    eng.kill()  # the standby keeps what it maps: the weights outlive the primary
    wait_status(runtime_dir, lambda s: [c["name"] for c in s["clients"]] == ["standby"], 10.0, "the primary gone")
    assert do(standby, f"check weights 0 {8 * MiB} 171") == "MATCH"


@needs_root
def test_a_read_only_grants_descriptors_cannot_map_writable(daemon_factory: Any, spawn: Spawn, runtime_dir: Path) -> None:
    """The host backend's descriptors themselves: opened read-only (no writable shared
    mapping, as root too), and not to be opened again read-write through /proc by
    anyone but root. CUDA's read-only is the mapping's access (docs/architecture.md)."""
    daemon_factory("host")
    os.chmod(runtime_dir, 0o750)  # the other uid reaches the sockets through group root
    eng = spawn("primary")
    do(eng, f"create weights {GiB}")
    do(eng, f"commit weights {8 * MiB}")
    token = do(eng, "roshare weights -")
    for name, args, arena in (("reader", (), "weights"), ("other", ("--as", f"{OTHER_UID}:0"), f"{os.getuid()}/weights")):
        c = spawn(name, *args)
        got = json.loads(do(c, f"rofds {arena} {token}"))
        assert got["read_only"] and got["fds"] >= 1
        assert set(got["modes"]) == {"rdonly"} and not any(got["write_map"]), got
        if name == "other":
            assert not any(got["reopen_rw"]), got
    assert do(eng, "write weights 0 c0ffee") is not None  # the owner's own mapping stays writable
    assert do(eng, "read weights 0 3") == "c0ffee"


_ENGINE = r"""
import sys, time
import gpumem
mem = gpumem.EngineMemory("primary", runtime_dir=sys.argv[1])
kv = mem.kv_cache(layers=2, block_shape=(16, 64), itemsize=2, max_blocks=64)
assert mem.kv_commit(max_blocks=32) == 32
k0 = kv.pool.buffers["k0"]
kv.pool.arena.write(k0.offset + 3 * k0.row_bytes, bytes([7]) * k0.row_bytes)  # block 3 of layer 0's K
group = mem.retain("engine")
mem.prefix.publish(3, 1234)
print("READY", group.secret, kv.pool.arena.address, flush=True)
time.sleep(600)
"""


def test_an_engine_adopts_a_dead_engines_kv_cache_and_prefix_directory(daemon: Any, runtime_dir: Path) -> None:
    import gpumem

    primary = subprocess.Popen([sys.executable, "-c", _ENGINE, str(runtime_dir)], stdout=subprocess.PIPE, text=True, env=child_env(runtime_dir))
    try:
        assert primary.stdout is not None
        secret, address = primary.stdout.readline().split()[1:]
        primary.kill()
        primary.wait()
        with gpumem.EngineMemory("standby", runtime_dir=str(runtime_dir)) as mem:
            adopted = mem.adopt_kv("engine", secret, layers=2, block_shape=(16, 64), itemsize=2, wait=10)
            assert adopted.confirmed and adopted.previous.startswith("client 'primary'")
            assert mem.kv is not None and mem.prefix is not None
            assert (mem.kv.blocks, mem.kv.max_blocks, mem.kv.pool.arena.address) == (32, 64, int(address))
            k0 = mem.kv.pool.buffers["k0"]
            assert mem.kv.pool.arena.read(k0.offset + 3 * k0.row_bytes, k0.row_bytes) == bytes([7]) * k0.row_bytes
            assert mem.prefix.scan(mem.kv.blocks).blocks == {1234: 3}
            mem.prefix.publish(4, 4321)  # it goes on publishing where the dead one stopped
            assert mem.prefix.scan().blocks == {1234: 3, 4321: 4}
    finally:
        if primary.poll() is None:
            primary.kill()
            primary.wait()
        if primary.stdout is not None:
            primary.stdout.close()
    s = wait_status(runtime_dir, lambda s: not s["arenas"], 5.0, "the standby's close released everything")
    assert s["device"]["accounted_bytes"] == 0


def test_an_adoption_is_charged_to_the_adopters_tenant_or_refused(daemon_factory: Any, backend: str, spawn: Spawn, runtime_dir: Path, tmp_path: Path) -> None:
    """Pods of one uid with tenant tokens of their own: what a group holds moves to the
    adopter's tenant, and an adopter whose cap has no room for it is refused with nothing
    moved (before, a tenant capped at 8 MiB adopted another's 16 MiB)."""
    import hashlib

    tokens = {name: f"{name}-{os.urandom(12).hex()}" for name in ("team-1", "team-2", "team-3")}
    rules = [("team-1", "64MiB"), ("team-2", "8MiB"), ("team-3", "64MiB")]
    policy = tmp_path / "tenants.toml"
    policy.write_text("".join(
        f'[[tenant]]\ntoken_sha256 = "{hashlib.sha256(tokens[n].encode()).hexdigest()}"\nname = "{n}"\nmax = "{m}"\n' for n, m in rules
    ))
    files = {}
    for name, token in tokens.items():
        files[name] = tmp_path / f"{name}.token"
        files[name].write_text(token)
    daemon_factory(backend, args=["--tenant-policy", str(policy)])
    eng = spawn("primary", "--tenant-token-file", str(files["team-1"]))
    do(eng, f"create weights {GiB}")
    do(eng, f"commit weights {16 * MiB}")
    do(eng, f"fill weights 0 {16 * MiB} 171")
    secret = do(eng, "group g")
    do(eng, "retain g weights")
    eng.kill()
    orphaned(runtime_dir)
    small = spawn("small", "--tenant-token-file", str(files["team-2"]))
    refused = reply(small, f"adopt g {secret} 0")
    assert refused.startswith("ERR ResourceExhausted") and "token team-2" in refused and "adopting retain group 'g'" in refused, refused
    assert group_of(status(runtime_dir))["state"] == "orphaned"  # type: ignore[index]
    big = spawn("big", "--tenant-token-file", str(files["team-3"]))
    json.loads(do(big, f"adopt g {secret} 5"))
    assert do(big, f"check weights 0 {16 * MiB} 171") == "MATCH"
    used = {t["tenant"]: t["used_bytes"] for t in status(runtime_dir)["tenants"]}
    assert (used["token team-1"], used["token team-3"]) == (0, 16 * MiB)
