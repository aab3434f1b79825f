"""This round's capabilities with one daemon per device, both serving at once: runtime KV
moves on each device, a kill -9 and restart of daemon 1 from the fd store while daemon 0
serves, a sleep on device 0 while device 1 works, and a retain group of the same name on
each device adopted by a standby of each. Every scenario checks both daemons' books.

On the host backend daemons 0 and 1 stand in for two GPUs in CI; the CUDA variant
(``gpu2``) runs the same scenario with one daemon on each of GPUs 0 and 1. Every client is
a process of its own (the test process never initialises CUDA)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import test_retain as kit
from conftest import Client, child_env
from fdstore_kit import Restartable
from gpumemd_testkit import GiB, MiB, do, reply, status, wait_status
from kv_testkit import Engine, cost

DEVICES = (0, 1)
spawn = kit.spawn  # the retain shells' fixture, shared with test_retain


@pytest.fixture(params=["host", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.gpu2])])
def backend(request: pytest.FixtureRequest) -> str:
    """This module's backends: the CUDA variant needs two GPUs."""
    return str(request.param)


StartBoth = Callable[..., dict[int, Any]]


@pytest.fixture
def start_both(daemon_factory: Any, backend: str) -> StartBoth:
    """A daemon on each of devices 0 and 1, with the same arguments."""

    def start(*args: str) -> dict[int, Any]:
        return {d: daemon_factory(backend, device=d, args=list(args)) for d in DEVICES}

    return start


def shell(run_client: Any, name: str, device: int) -> Client:
    c: Client = run_client("shell", name, str(device))
    c.expect("CONNECTED")
    return c


def both_status(runtime_dir: Path) -> dict[int, dict[str, Any]]:
    return {d: status(runtime_dir, d) for d in DEVICES}


# ------------------------------------------------------------------ KV moves

KiB = 1 << 10
ROWS = [64 * KiB, 64 * KiB]  # 128 KiB a token: a 32 MiB chunk per buffer holds 512 tokens
CAP = 512 * MiB


def kv_books(s: dict[str, Any]) -> dict[str, Any]:
    return {"accounted": s["device"]["accounted_bytes"], "kv": s["kv"], "arenas": s["arenas"]}


def ask_grow(taker: Engine, giver: Engine) -> None:
    """The giver idles, the taker wants 384 MiB of the 512: its answer comes in ``settle``."""
    giver.do(f"demand {giver.pool} 0")
    taker.client.send(f"kvgrow {taker.pool} 3072")


def settle(runtime_dir: Path, device: int, taker: Engine, giver: Engine) -> None:
    kept = json.loads(giver.do(f"answershrink {giver.pool} 10"))
    assert 256 <= kept <= 1024 and cost(ROWS, 3072) + cost(ROWS, kept) <= CAP, kept
    line = taker.answer()
    full = {"tokens": 3072, "unanswered": []}
    if line.startswith("OK ") and json.loads(line[3:]) != full:
        # The giver kept less than it could the move before, so some memory was free: the
        # grow was answered with it at once, naming the pool it asked; the next grow finds
        # what that pool gave back since.
        assert json.loads(line[3:])["unanswered"] == [f"{giver.name}/{giver.pool}"], line
        line = taker.reply(f"kvgrow {taker.pool} 3072")
    assert line.startswith("OK ") and json.loads(line[3:]) == full, line
    s = status(runtime_dir, device)
    assert {k["name"]: k["tokens"] for k in s["kv"]} == {taker.pool: 3072, giver.pool: kept}
    assert s["device"]["accounted_bytes"] == cost(ROWS, 3072) + cost(ROWS, kept)
    assert taker.kvcheck() == "MATCH" and giver.kvcheck() == "MATCH"
    giver.do(f"demand {giver.pool} {kept}")  # busy again: it wants what it holds


def test_kv_moves_on_each_device_at_once_leave_the_other_device_alone(start_both: StartBoth, backend: str, run_client: Any, runtime_dir: Path) -> None:
    host = ["--host-capacity", "1GiB"] if backend == "host" else []
    start_both(*host, "--capacity", "512MiB", "--reserve", "0", "--kv-chunk-size", "32MiB", "--move-timeout", "10")
    engines = {d: tuple(Engine(run_client, f"engine-{x}", f"kv-{x}{d}", ROWS, max_tokens=4096, device=d) for x in "ab") for d in DEVICES}
    for a, b in engines.values():
        a.do(f"join {a.pool}")
        b.do(f"join {b.pool}")
    for a, b in engines.values():
        a.report(min_tokens=256)
        b.report(min_tokens=256)
    for d, (a, b) in engines.items():  # a round of each daemon's own: 256 MiB a pool
        assert (a.result()["tokens"], b.result()["tokens"]) == (2048, 2048)
        s = status(runtime_dir, d)
        assert {k["name"]: k["tokens"] for k in s["kv"]} == {f"kv-a{d}": 2048, f"kv-b{d}": 2048}
        assert s["device"]["accounted_bytes"] == CAP

    (a0, b0), (a1, b1) = engines[0], engines[1]
    quiet = kv_books(status(runtime_dir, 1))
    ask_grow(a0, b0)
    settle(runtime_dir, 0, a0, b0)
    assert kv_books(status(runtime_dir, 1)) == quiet, "device 0's move reached device 1's books"

    # Both at once, in opposite directions: b0 takes back from a0 while a1 takes from b1.
    ask_grow(b0, a0)
    ask_grow(a1, b1)
    settle(runtime_dir, 0, b0, a0)
    settle(runtime_dir, 1, a1, b1)
    for d, s in both_status(runtime_dir).items():
        assert {k["owner"] for k in s["kv"]} == {"engine-a", "engine-b"} and all(k["name"].endswith(str(d)) for k in s["kv"])
        assert sum(k["share_bytes"] for k in s["kv"]) <= CAP


# ------------------------------------------------------------------ restart


@pytest.fixture
def restartable(runtime_dir: Path) -> Iterator[Callable[..., Restartable]]:
    made: list[Restartable] = []

    def make(backend: str, device: int) -> Restartable:
        made.append(Restartable(runtime_dir, backend, [], child_env(runtime_dir), device=device))
        return made[-1].start()

    yield make
    for r in made:
        r.close()


class Steady(threading.Thread):
    """Commits, writes, reads back and decommits on one shell in a loop until stopped,
    counting rounds; the first failure ends it and is kept."""

    def __init__(self, client: Client) -> None:
        super().__init__(name="steady-client", daemon=True)
        self.client = client
        self.rounds = 0
        self.failure: str | None = None
        self._changed = threading.Condition()
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            do(self.client, f"create s {GiB}")
            while not self._stopping.is_set():
                mark = f"{self.rounds % 251:02x}" * 4
                do(self.client, f"commit s {8 * MiB}")
                do(self.client, f"write s {4 * MiB} {mark}")
                got = do(self.client, f"read s {4 * MiB} 4")
                assert got == mark, f"round {self.rounds}: read {got}, wrote {mark}"
                do(self.client, "decommit s 0")
                with self._changed:
                    self.rounds += 1
                    self._changed.notify_all()
        except BaseException as exc:  # kept for the test to show; the loop ends at the first
            with self._changed:
                self.failure = f"{type(exc).__name__}: {exc}"
                self._changed.notify_all()

    def wait_more(self, more: int, what: str, timeout: float = 30.0) -> None:
        with self._changed:
            target = self.rounds + more
            self._changed.wait_for(lambda: self.rounds >= target or self.failure is not None, timeout)
            assert self.failure is None, f"the client of daemon 0 failed {what}: {self.failure}"
            assert self.rounds >= target, f"the client of daemon 0 made no {more} rounds within {timeout}s {what} ({self.rounds} in all)"

    def finish(self) -> None:
        self._stopping.set()
        self.join(30)
        assert not self.is_alive(), "the client of daemon 0 is stuck in a round"
        assert self.failure is None, self.failure


def test_daemon_1_killed_and_restarted_while_daemon_0_serves(
    daemon_factory: Any, restartable: Callable[..., Restartable], backend: str, run_client: Any, runtime_dir: Path
) -> None:
    d0 = daemon_factory(backend, device=0)
    r1 = restartable(backend, 1)
    keeper = shell(run_client, "keeper", 1)
    do(keeper, f"create a {GiB}")
    do(keeper, f"commit a {16 * MiB}")
    do(keeper, f"fill a 0 {16 * MiB} 171")
    do(keeper, "write a 0 c0ffee")
    before1 = status(runtime_dir, 1)
    assert (before1["daemon"]["pid"], before1["daemon"]["generation"]) == (r1.pid, 0)

    steady = Steady(shell(run_client, "steady", 0))
    steady.start()
    try:
        steady.wait_more(3, "before the kill")
        r1.kill()
        steady.wait_more(3, "while daemon 1 was dead")
        r1.start()
        assert do(keeper, "read a 0 3") == "c0ffee"  # this call resumes the session if its watcher has not yet
        assert do(keeper, f"check a 3 {16 * MiB - 3} 171") == "MATCH"
        assert int(do(keeper, f"commit a {32 * MiB}")) == 32 * MiB  # new work on the new daemon
        s1 = wait_status(runtime_dir, lambda s: s["daemon"]["waiting"] == 0, 10, "keeper resumed", device=1)
        assert (s1["daemon"]["pid"], s1["daemon"]["generation"]) == (r1.pid, 1) and r1.pid != before1["daemon"]["pid"]
        assert [(c["name"], c["session_id"]) for c in s1["clients"]] == [(c["name"], c["session_id"]) for c in before1["clients"]]
        assert [(x["name"], x["committed"]) for x in s1["arenas"]] == [("a", 32 * MiB)]
        steady.wait_more(3, "after the restart")
    finally:
        steady.finish()
    s0 = status(runtime_dir, 0)
    assert (s0["daemon"]["pid"], s0["daemon"]["generation"], s0["daemon"]["restore_problems"]) == (d0.pid, 0, [])
    assert [c["name"] for c in s0["clients"]] == ["steady"] and [(x["name"], x["committed"]) for x in s0["arenas"]] == [("s", 0)]
    assert d0.proc.poll() is None


# ------------------------------------------------------------------ sleep

WEIGHTS = 64 * MiB + 6 * MiB  # a tail past the bulk chunks


def test_a_sleep_on_device_0_while_device_1_commits_and_reads(start_both: StartBoth, run_client: Any, runtime_dir: Path) -> None:
    start_both()
    sleeper, worker = shell(run_client, "sleeper", 0), shell(run_client, "worker", 1)
    address = int(do(sleeper, f"create weights {GiB}"))
    do(sleeper, f"commit weights {WEIGHTS}")
    do(sleeper, f"fill weights 0 {WEIGHTS} 171")
    do(sleeper, f"write weights {WEIGHTS - 4} 0badf00d")
    do(worker, f"create kv {GiB}")

    # The sleep and the worker's commit at once, each on its own daemon.
    sleeper.send("sleep weights keep")
    worker.send(f"commit kv {WEIGHTS}")
    assert json.loads(sleeper.expect("OK")) == {"committed": 0, "host": WEIGHTS}
    assert int(worker.expect("OK")) == WEIGHTS
    do(worker, f"fill kv 0 {WEIGHTS} 90")
    assert do(worker, f"check kv 0 {WEIGHTS} 90") == "MATCH"
    s = both_status(runtime_dir)
    assert (s[0]["device"]["accounted_bytes"], s[0]["daemon"]["sleep_host_bytes"]) == (0, WEIGHTS)
    assert [(c["name"], c["host_bytes"]) for c in s[0]["clients"]] == [("sleeper", WEIGHTS)]
    assert [(x["arena"], x["asleep"], x["kept_bytes"]) for x in s[0]["sleepers"]] == [("weights", True, WEIGHTS)]
    assert (s[1]["device"]["accounted_bytes"], s[1]["daemon"]["sleep_host_bytes"], s[1]["sleepers"]) == (WEIGHTS, 0, [])
    assert [(c["name"], c["host_bytes"]) for c in s[1]["clients"]] == [("worker", 0)]

    # The wake and more work on device 1 at once.
    sleeper.send("wake weights")
    worker.send(f"commit kv {2 * WEIGHTS}")
    assert json.loads(sleeper.expect("OK"))["committed"] == WEIGHTS
    assert int(worker.expect("OK")) == 2 * WEIGHTS
    assert int(do(sleeper, "address weights")) == address
    assert do(sleeper, f"check weights 0 {WEIGHTS - 4} 171") == "MATCH"
    assert do(sleeper, f"read weights {WEIGHTS - 4} 4") == "0badf00d"
    assert do(worker, f"check kv 0 {WEIGHTS} 90") == "MATCH"
    s = both_status(runtime_dir)
    assert s[0]["device"]["accounted_bytes"] == WEIGHTS and [x["asleep"] for x in s[0]["sleepers"]] == [False]
    assert (s[1]["device"]["accounted_bytes"], s[1]["daemon"]["sleep_host_bytes"], s[1]["sleepers"]) == (2 * WEIGHTS, 0, [])
    do(sleeper, "freehost weights")
    assert status(runtime_dir, 0)["daemon"]["sleep_host_bytes"] == 0


# ------------------------------------------------------------------ retain and adopt


def test_a_group_of_one_name_on_each_device_adopted_by_each_standby_with_its_own_secret(
    start_both: StartBoth, spawn: kit.Spawn, runtime_dir: Path
) -> None:
    start_both()
    def on(device: int) -> kit.Spawn:
        return lambda name, *args: spawn(name, str(device), *args)

    primaries = {d: kit.primary(on(d)) for d in DEVICES}
    standbys = {d: spawn("standby", str(d)) for d in DEVICES}
    secrets = {d: primaries[d][1] for d in DEVICES}
    addresses = {d: primaries[d][2] for d in DEVICES}
    assert secrets[0] != secrets[1] and addresses[0] != addresses[1]  # each daemon plans in its own address slice
    for d in DEVICES:
        other = secrets[1 - d]
        refused = reply(standbys[d], f"reserve g {other}")
        assert refused.startswith("ERR PermissionDenied") and other not in refused, refused
        assert json.loads(do(standbys[d], f"reserve g {secrets[d]}")) == addresses[d]
    booked = {d: s["device"]["accounted_bytes"] for d, s in both_status(runtime_dir).items()}

    for d in DEVICES:
        primaries[d][0].kill()
    for d in DEVICES:
        wait_status(runtime_dir, kit.in_state("orphaned"), 10.0, f"device {d}'s group orphaned", device=d)
    for d in DEVICES:
        wrong = reply(standbys[d], f"adopt g {secrets[1 - d]} 0 reserved")
        assert wrong.startswith("ERR PermissionDenied") and "wrong secret" in wrong, wrong
        assert kit.group_of(status(runtime_dir, d))["state"] == "orphaned"  # type: ignore[index]
    for d in DEVICES:
        got = json.loads(do(standbys[d], f"adopt g {secrets[d]} 5 reserved"))
        assert got["arenas"] == {"weights": addresses[d]["weights"]} and got["kv"] == {"kv": [addresses[d]["kv"], 4096]}
        assert got["previous"].startswith("client 'primary'")
        assert do(standbys[d], f"check weights 0 {8 * MiB} 171") == "MATCH"
        assert do(standbys[d], f"check kv 0 {4096 * 4096} 90") == "MATCH"
    for d, s in both_status(runtime_dir).items():
        g = kit.group_of(s)
        assert g is not None and (g["state"], g["holder"]) == ("held", "standby")
        assert {a["name"]: a["owner"] for a in s["arenas"]} == {"weights": "standby", "kv": "standby"}
        assert s["device"]["accounted_bytes"] == booked[d]  # the reservation's placeholder backs the pool now: nothing added
