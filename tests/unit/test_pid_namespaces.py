"""Clients in pid namespaces other than the daemon's, on the state alone: SO_PEERCRED
gives pid 0 (the client is outside the daemon's namespace) or the daemon's number for a
process that knows itself by another (1, say). No pid decides anything there: lease words
carry the pid the client says it has, RESUME rests on the credential and the uid and gid,
and a kept session's liveness is never read from /proc under a pid that names another
process there."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpumem_shared import lease_table
from gpumem_shared import protocol as p
from gpumem_shared.lease_table import LeaseKind
from gpumemd import fencing

from .harness import GiB, Harness, MiB
from .test_lease_handoff import ARENA, opens, register
from .lease_kit import follow


def gone_pid() -> int:
    """A pid no process has now: a child's, once reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("kernel_pid", [0, 40123], ids=["outside the daemon's namespace", "numbered in the daemon's"])
def test_a_namespaced_clients_lease_moves_along_under_the_pid_it_knows(h: Harness, kernel_pid: int) -> None:
    """Its word carries its own pid (1), whatever the kernel's number for it: a sharer
    leaving moves the pool, and the word must move too, or the pool is taken from under
    its holder."""
    s = h.connect("ns-owner", pid=kernel_pid, own_pid=1)
    h.create(s, ARENA, GiB)
    h.commit(s, ARENA, 64 * MiB)
    b = h.connect("ns-b", pid=0, own_pid=1)
    h.share(s, ARENA, "ns-b")
    h.attach(b, ARENA)
    pool = register(h, s, 0, "p", True)
    opens(h, b, pool)
    held = lease_table.encode(LeaseKind.REPLAY, s.id, 1)
    assert pool.segment.acquire(held, pool.epoch, 0)[0] in (lease_table.LeaseStatus.OK, lease_table.LeaseStatus.OK_ORDER)
    h.ok(b, p.ReleaseArena(name=ARENA))
    follow(h, s, pool)
    assert pool.segment.peek() == held, "the holder's own word did not move with the pool"
    [lease] = h.state.status().leases
    assert (lease.holder, lease.pid) == ("ns-owner", 1)
    [mine] = [c for c in h.state.status().clients if c.name == "ns-owner"]
    assert (mine.pid, mine.own_pid) == (kernel_pid, 1)


def test_liveness_is_not_read_from_a_proc_of_another_pid_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon whose /proc is not its own namespace's (its number for itself is not
    /proc/self) cannot ask /proc about any pid: there it names another process."""
    dead, since = gone_pid(), time.time() - 60
    assert fencing.process_gone(dead, since), "a reaped child is gone, read from our own /proc"
    ours = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: ours + 1 if ours > 1 else 2)  # as a daemon that is pid N of another namespace
    assert not fencing.process_gone(dead, since)


def test_hello_says_the_clients_own_pid(h: Harness) -> None:
    s = h.connect("ns", pid=0, own_pid=1)
    assert (s.pid, s.own_pid, s.pids) == (0, 1, "pid 1")
    t = h.connect("below", pid=31337, own_pid=1)
    assert t.pids == "pid 1 (31337 in gpumemd's pid namespace)"
    old = h.connect("before-1.9", pid=555)  # says no pid: the kernel's is its own
    assert (old.own_pid, old.pids) == (555, "pid 555")
