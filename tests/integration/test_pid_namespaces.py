"""Clients in pid, IPC and mount namespaces of their own (an engine in a pod without
hostPID or hostIPC), against a real gpumemd: arenas, shares, leases with a handoff and a
move, KV rounds, kill -9 and restart with resume, on each backend.

Each client runs ``tests/clients.py shell`` as PID 1 of a fresh pid namespace, with its
own /proc (``unshare --pid --ipc --mount --mount-proc --fork``): it knows itself as pid
1, gpumemd (in the host's namespace) knows it by its host pid, and two such clients both
say they are pid 1. A gpumemd in a pid namespace of its own sees pid 0 for every client
(SO_PEERCRED numbers a peer in the reader's namespace): the last tests run it so, where
no pid can tell a live client from a dead one and only its connection can.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import CLIENTS, Client, child_env
from fdstore_kit import Restartable
from gpumemd_testkit import MiB, do, reply, status, wait_status

OTHER_UID = 4242  # no account needed: the kernel reports whatever uid a process runs as
NAMESPACES = ["unshare", "--pid", "--ipc", "--mount", "--mount-proc", "--fork", "--kill-child"]


def _namespaces_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to make pid, IPC and mount namespaces"
    probe = subprocess.run([*NAMESPACES, "--", "true"], capture_output=True, text=True, timeout=60)
    return None if probe.returncode == 0 else f"unshare refused here: {probe.stderr.strip()}"


_UNAVAILABLE = _namespaces_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")


def child_of(pid: int, timeout: float = 10.0) -> int:
    """The host pid of unshare(1)'s one child (``pid`` is unshare's), once it forked it."""
    deadline = time.monotonic() + timeout
    while True:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_bytes()
                except OSError:
                    continue  # it ended meanwhile
                if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
                    return int(entry.name)
        assert time.monotonic() < deadline, f"unshare (pid {pid}) forked no child within {timeout}s"
        time.sleep(0.01)


class NsClient(Client):
    """A shell client as PID 1 of namespaces of its own; ``pid`` is its host pid (what a
    gpumemd in the host's namespace sees), ``proc`` the unshare(1) above it."""

    def __init__(self, runtime_dir: Path, name: str, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [*NAMESPACES, "--", sys.executable, str(CLIENTS), "shell", name, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(runtime_dir),
        )
        self._pid = 0
        self.first = ""

    @property
    def pid(self) -> int:
        if not self._pid:
            self._pid = child_of(self.proc.pid)
        return self._pid

    def kill_9(self) -> None:
        """kill -9 of the client itself (not of unshare), and its end seen."""
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def ns_client(runtime_dir: Path) -> Iterator[Any]:
    """``ns_client(name)``: a connected shell client in namespaces of its own."""
    started: list[NsClient] = []

    def start(name: str, *args: str, first: str = "CONNECTED") -> NsClient:
        """``first``: what its first line must start with (ERR: its connect was refused);
        the rest of that line is ``first`` on the client."""
        c = NsClient(runtime_dir, name, list(args))
        started.append(c)
        c.first = c.expect(first, timeout=30)
        return c

    yield start
    for c in started:
        c.end()


def clients(runtime_dir: Path) -> dict[str, tuple[int, int]]:
    """Each client's (own pid, pid in gpumemd's namespace), by name."""
    return {c["name"]: (c["own_pid"], c["pid"]) for c in status(runtime_dir)["clients"]}


def test_namespaced_clients_share_an_arena_and_are_known_by_both_pids(daemon: Any, ns_client: Any, runtime_dir: Path) -> None:
    owner, sharer = ns_client("ns-owner"), ns_client("ns-sharer")
    assert clients(runtime_dir) == {"ns-owner": (1, owner.pid), "ns-sharer": (1, sharer.pid)}
    do(owner, f"create a {64 * MiB}")
    do(owner, f"commit a {8 * MiB}")
    do(owner, "share a ns-sharer")
    do(sharer, "attach a")
    do(owner, f"fill a 0 {MiB} 7")
    assert do(sharer, f"check a 0 {MiB} 7") == "MATCH"
    s = status(runtime_dir)
    [arena] = s["arenas"]
    assert arena["owner_pid"] == 1 and arena["owner"] == "ns-owner"
    text = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", "status", "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=30, env=child_env(runtime_dir), check=True,
    ).stdout
    assert f"1 ({owner.pid})" in text and f"1 ({sharer.pid})" in text, text


# Under ipc-events a namespaced taker opens its releaser's CUDA IPC event, whose legacy
# handle names its creator by pid: both are pid 1 in namespaces of their own, and on the
# H200 cuIpcOpenEventHandle answered CUDA_ERROR_INVALID_CONTEXT. Memops orders through a
# word in shared memory.
ORDERINGS = ["ipc-events", "memops"]


@pytest.mark.parametrize("ordering", ORDERINGS)
def test_a_lease_held_by_a_namespaced_client_survives_a_move_and_hands_over(
    daemon_factory: Any, backend: str, ordering: str, ns_client: Any, runtime_dir: Path
) -> None:
    """Its lease word carries the pid it knows itself by (1), not the host's: a sharer
    leaving moves the pool to a fresh segment, and the holder's lease moves along (a word
    the daemon did not take for its holder's would be dropped there, and the pool taken
    from under it). Then it hands the pool to another namespaced client waiting for it:
    under memops and on the host; under ipc-events on CUDA the taker cannot open the
    releaser's event, and it is refused at once, saying so, with nothing held."""
    daemon = daemon_factory(backend, args=["--lease-ordering", ordering])
    owner, holder, leaver = ns_client("ns-owner"), ns_client("ns-holder"), ns_client("ns-leaver")
    do(owner, f"create a {64 * MiB}")
    do(owner, f"commit a {16 * MiB}")
    for name in ("ns-holder", "ns-leaver"):
        do(owner, f"share a {name}")
    pool = json.loads(do(owner, f"gpregister a g 0 {16 * MiB} shared"))["id"]
    for c in (holder, leaver):
        do(c, "attach a")
        do(c, f"open {pool}")
    assert do(holder, f"lease replay {pool} 5 across-the-move") == "replay"
    do(leaver, "release a")  # answered once the pool moved
    s = status(runtime_dir)
    assert [(x["holder"], x["pid"], x["label"]) for x in s["leases"]] == [("ns-holder", 1, "across-the-move")]
    refused = reply(owner, f"lease replay {pool} 0 owner-too-early")
    assert refused.startswith("ERR LeaseConflict") and "ns-holder" in refused and "(pid 1)" in refused, refused
    owner.send(f"lease replay {pool} 20 owner-after")  # it sleeps until the holder gives the pool back
    do(holder, f"unlease {pool}")
    answer = owner.expect("", timeout=15)  # the handoff, or its refusal: well within the take's 20 s wait
    if backend == "cuda" and ordering == "ipc-events":
        assert answer.startswith("ERR DeviceDriverError") and "ns-holder" in answer and "--lease-ordering memops" in answer, answer
        assert status(runtime_dir)["leases"] == [], "the refused take holds nothing"
        assert do(holder, f"lease replay {pool} 5 after-the-refusal") == "replay", "and the pool is takeable"
        assert [(x["holder"], x["pid"]) for x in status(runtime_dir)["leases"]] == [("ns-holder", 1)]
    else:
        assert answer == "OK replay", answer
        assert [(x["holder"], x["pid"]) for x in status(runtime_dir)["leases"]] == [("ns-owner", 1)]
    assert "repaired" not in daemon.log(), daemon.log()


def test_a_kv_round_among_namespaced_clients(daemon: Any, ns_client: Any, runtime_dir: Path) -> None:
    first, second = ns_client("ns-first"), ns_client("ns-second")
    for c, pool in ((first, "kv-1"), (second, "kv-2")):
        do(c, f"kvdeclare {pool} 2 4096 4096")
        do(c, f"kvplaceholder {pool}")
        do(c, f"joinx {pool} 2")
    first.send("capture kv-1 0 256 1024 1")
    second.send("capture kv-2 0 256 1024 1")
    got = [json.loads(c.expect("OK")) for c in (first, second)]
    assert all(g["tokens"] >= 256 for g in got), got
    assert [do(c, f"kvcheck {pool}") for c, pool in ((first, "kv-1"), (second, "kv-2"))] == ["MATCH", "MATCH"]
    assert sorted(clients(runtime_dir).values()) == sorted([(1, first.pid), (1, second.pid)])


def test_kill_9_of_a_namespaced_client_reclaims_everything_it_held(daemon: Any, ns_client: Any, runtime_dir: Path) -> None:
    owner, other = ns_client("ns-victim"), ns_client("ns-survivor")
    do(owner, f"create a {64 * MiB}")
    do(owner, f"commit a {16 * MiB}")
    do(owner, "share a ns-survivor")
    pool = json.loads(do(owner, f"gpregister a g 0 {16 * MiB} shared"))["id"]
    do(other, "attach a")
    do(other, f"open {pool}")
    do(owner, f"lease replay {pool} 5 dies-holding-it")
    owner.kill_9()
    wait_status(runtime_dir, lambda s: [c["name"] for c in s["clients"]] == ["ns-survivor"] and not s["graph_pools"], 10, "the victim reclaimed")
    do(other, "release a")
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0 and not s["arenas"], 10, "memory back")


# ---------------------------------------------------------------------- gpumemd in a pid namespace


GRACE_S = 3.0


class NsService(Restartable):
    """gpumemd as PID 1 of a pid namespace of its own, under the fd store's stand-in: every
    client is outside, and SO_PEERCRED gives it pid 0 for each."""

    def __init__(self, runtime_dir: Path, backend: str) -> None:
        super().__init__(
            runtime_dir, backend, ["--restart-grace", str(GRACE_S)], child_env(runtime_dir),
            wrap=("unshare", "--pid", "--mount-proc", "--fork", "--kill-child", "--"),
        )

    def kill(self) -> None:
        """kill -9 of gpumemd itself; unshare(1) ends with it, and the store outlives both."""
        proc = self.manager.proc
        if proc is not None and proc.poll() is None:
            os.kill(child_of(proc.pid), signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def ns_service(runtime_dir: Path, backend: str) -> Iterator[NsService]:
    r = NsService(runtime_dir, backend)
    r.start()
    yield r
    r.close()


def test_a_daemon_that_sees_pid_0_reclaims_a_killed_client_by_its_connection(
    ns_service: NsService, ns_client: Any, run_client: Any, runtime_dir: Path
) -> None:
    """Nothing in /proc can say the client died (gpumemd has no pid for it): its fd
    channel's hang-up does, and everything it held comes back."""
    host = run_client("shell", "host-client")
    host.expect("CONNECTED")
    victim = ns_client("ns-victim")
    assert clients(runtime_dir) == {"host-client": (host.pid, 0), "ns-victim": (1, 0)}
    do(victim, f"create a {64 * MiB}")
    do(victim, f"commit a {16 * MiB}")
    do(victim, "share a host-client")
    pool = json.loads(do(victim, f"gpregister a g 0 {16 * MiB} shared"))["id"]
    do(host, "attach a")
    do(host, f"open {pool}")
    do(victim, f"lease replay {pool} 5 dies-holding-it")
    assert [(x["holder"], x["pid"]) for x in status(runtime_dir)["leases"]] == [("ns-victim", 1)]
    victim.kill_9()
    wait_status(runtime_dir, lambda s: list(clients(runtime_dir)) == ["host-client"] and not s["graph_pools"], 10, "the victim reclaimed")
    do(host, "release a")
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0 and not s["arenas"], 10, "memory back")


def test_clients_gpumemd_sees_as_pid_0_resume_after_a_restart(ns_service: NsService, ns_client: Any, runtime_dir: Path) -> None:
    """RESUME rests on the credential and the uid and gid that said HELLO: both clients
    come back with their arena and its bytes. A kept session whose client died while
    gpumemd was down cannot be proven gone without a pid: its name is refused, saying so,
    until the grace period releases what it held."""
    owner, sharer = ns_client("ns-owner"), ns_client("ns-sharer")
    do(owner, f"create a {64 * MiB}")
    do(owner, f"commit a {8 * MiB}")
    do(owner, "share a ns-sharer")
    do(sharer, "attach a")
    do(owner, f"fill a 0 {MiB} 9")
    ns_service.kill()
    ns_service.start()
    s = wait_status(runtime_dir, lambda s: s["daemon"]["waiting"] == 0, 10, "both sessions resumed")
    assert s["daemon"]["generation"] == 1 and clients(runtime_dir) == {"ns-owner": (1, 0), "ns-sharer": (1, 0)}
    assert do(sharer, f"check a 0 {MiB} 9") == "MATCH"
    do(owner, f"commit a {16 * MiB}")  # and it goes on working
    ns_service.kill()
    sharer.kill_9()
    ns_service.start()
    wait_status(runtime_dir, lambda s: s["daemon"]["waiting"] == 1, 10, "the owner resumed, the sharer did not")
    refused = ns_client("ns-sharer", first="ERR")
    assert refused.first.startswith("AlreadyExists") and "outside gpumemd's pid namespace" in refused.first, refused.first
    wait_status(runtime_dir, lambda s: list(clients(runtime_dir)) == ["ns-owner"], GRACE_S + 10, "the dead sharer released after the grace period")
    successor = ns_client("ns-sharer")
    do(successor, "attach a")
    assert do(successor, f"check a 0 {MiB} 9") == "MATCH"


def test_grants_rest_on_uid_and_gid_when_every_pid_is_0(ns_service: NsService, ns_client: Any, runtime_dir: Path) -> None:
    """A share by name admits that name under the owner's uid only, also where gpumemd has
    no pid for anyone: a namespaced process of another uid under the name gets nothing
    until it gives the grant's token; a grant naming its uid admits it without one."""
    owner = ns_client("ns-owner")
    do(owner, f"create a {64 * MiB}")
    do(owner, f"commit a {8 * MiB}")
    do(owner, f"fill a 0 {MiB} 5")
    token = do(owner, "share a ns-b")
    os.chmod(runtime_dir, 0o750)  # the other uid reaches the sockets through group root, as in test_grants.py
    impostor = ns_client("ns-b", "--as", f"{OTHER_UID}:0")
    assert clients(runtime_dir)["ns-b"] == (1, 0) and status(runtime_dir)["clients"][-1]["uid"] == OTHER_UID
    arena = f"{os.geteuid()}/a"  # another uid's arena is named with its owner's uid
    refused = reply(impostor, f"attach {arena}")
    assert refused.startswith("ERR PermissionDenied") and f"uid {OTHER_UID}" in refused, refused
    do(impostor, f"attach {arena} {token}")
    assert do(impostor, f"check {arena} 0 {MiB} 5") == "MATCH"
    do(owner, f"share a - uid={OTHER_UID}")
    other = ns_client("ns-c", "--as", f"{OTHER_UID}:0")
    do(other, f"attach {arena}")
    assert do(other, f"check {arena} 0 {MiB} 5") == "MATCH"


def test_a_retained_group_fails_over_when_gpumemd_sees_every_client_as_pid_0(ns_service: NsService, runtime_dir: Path) -> None:
    """The shipped DaemonSet's layout: no pid can tell gpumemd the holder died, and its
    session's end (the fd channel's hang-up) is the fence; on CUDA a settle of
    retain_fence.HIDDEN_SETTLE_S after it. Before, ADOPT was NOT_FENCED ("pid 0 still runs")
    until --retain-grace released the group."""
    from test_retain import RetainClient, orphaned, primary

    made: list[RetainClient] = []

    def spawn(name: str, *args: str) -> RetainClient:
        c = RetainClient(runtime_dir, [name, *args])
        made.append(c)
        c.expect("CONNECTED")
        return c

    try:
        eng, secret, addresses = primary(spawn)
        assert clients(runtime_dir)["primary"][1] == 0
        eng.kill()
        orphaned(runtime_dir)
        standby = spawn("standby")
        got = json.loads(do(standby, f"adopt g {secret} 10"))
        assert got["arenas"] == {"weights": addresses["weights"]}
        assert do(standby, f"check weights 0 {8 * MiB} 171") == "MATCH"
    finally:
        for c in made:
            c.end()
