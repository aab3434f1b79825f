"""Two engines at work (commits and decommits, a share, a KV round, replay leases,
borrows; tests/restart_engine.py) while gpumemd is killed with kill -9 and started again
through the fd-store fixture, again and again: the engines never fail a call, their bytes
stay, the status before and after each restart agrees, and once they exit the daemon
holds nothing. The CUDA run (marked gpu) does the same on the device and checks that its
free memory comes back too."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, child_env
from fdstore_kit import Restartable
from gpumemd_testkit import read_line, status, wait_status

ENGINE = ROOT / "tests" / "restart_engine.py"


def kept(s: dict[str, Any]) -> dict[str, Any]:
    """What a restart keeps, as status shows it (clients minus their waiting flag)."""
    clients = [{k: v for k, v in c.items() if k != "waiting"} for c in s["clients"]]
    return {
        "accounted": s["device"]["accounted_bytes"], "clients": clients, "arenas": s["arenas"],
        "graph_pools": s["graph_pools"], "kv": s["kv"], "leases": s["leases"],
    }


def ctl_status(runtime_dir: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "gpumem.ctl", "status", "--json", "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=60, env=child_env(runtime_dir),
    )
    assert result.returncode == 0, result
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def _where(pid: int) -> dict[str, Any]:
    """What a process that will not stop is doing: each thread's state and kernel wait
    channel, and the main thread's system call (a thread in D sleeps in the kernel, and
    a stop waits for it)."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            return f"({exc.strerror})"

    threads = {}
    for task in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        stat = read(f"/proc/{pid}/task/{task}/stat")
        state = stat.rpartition(")")[2].split()[0] if ")" in stat else stat
        if state != "T":
            threads[task] = (state, read(f"/proc/{pid}/task/{task}/wchan"))
    return {"pid": pid, "syscall": read(f"/proc/{pid}/syscall"), "threads": threads}


def settle(runtime_dir: Path, engines: list[subprocess.Popen[str]]) -> None:
    """Until the stopped engines are stopped (a signal lands a moment after kill()
    returns) and the daemon has served what they sent before: two looks alike. An engine
    that exited instead (a failed call ends it) is reported with what it said."""
    deadline = time.monotonic() + 10
    while any(_state(e.pid) != "T" for e in engines):
        for e in engines:
            if _state(e.pid) == "Z":
                raise AssertionError(f"an engine failed (status {e.wait()}):\n{e.stderr.read() if e.stderr else ''}")
        assert time.monotonic() < deadline, f"the engines did not stop: {[_where(e.pid) for e in engines]}"
        time.sleep(0.005)
    last = kept(status(runtime_dir))
    while True:
        time.sleep(0.02)
        now = kept(status(runtime_dir))
        if now == last:
            return
        assert time.monotonic() < deadline, "the daemon's state kept moving with the engines stopped"
        last = now


@pytest.mark.parametrize(("backend", "restarts"), [("host", 50), pytest.param("cuda", 20, marks=pytest.mark.gpu)])
def test_engines_never_notice_kill_9_restarts(runtime_dir: Path, backend: str, restarts: int) -> None:
    r = Restartable(runtime_dir, backend, [], child_env(runtime_dir))
    engines: list[subprocess.Popen[str]] = []
    try:
        r.start()
        free_before = status(runtime_dir)["device"]["free_bytes"]
        for role in "ab":
            engines.append(subprocess.Popen(
                [sys.executable, str(ENGINE), role, str(runtime_dir), str(runtime_dir / f"stop-{role}")],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(runtime_dir),
            ))
        for engine in engines:
            read_line(engine, "READY", 120)
        rng = random.Random(12)
        for n in range(restarts):
            time.sleep(rng.uniform(0.05, 0.3))  # the engines mid-work
            for engine in engines:  # frozen, so that nothing moves between the two looks
                os.kill(engine.pid, signal.SIGSTOP)
            settle(runtime_dir, engines)
            by_ctl = n in (0, restarts - 1)  # gpumemctl's own view, at the first and the last
            before = ctl_status(runtime_dir) if by_ctl else status(runtime_dir)
            r.restart()
            after = ctl_status(runtime_dir) if by_ctl else status(runtime_dir)
            for engine in engines:
                os.kill(engine.pid, signal.SIGCONT)
            for engine in engines:
                assert engine.poll() is None, f"an engine failed by restart {n + 1}:\n{engine.stderr.read() if engine.stderr else ''}"
            assert after["daemon"]["generation"] == n + 1 and after["daemon"]["waiting"] == 2, after["daemon"]
            changed = {k: (v, kept(after)[k]) for k, v in kept(before).items() if kept(after)[k] != v}
            assert not changed, f"restart {n + 1} changed {changed}"
        dones = []
        for role, engine in reversed(list(zip("ab", engines))):  # b first: it borrows from a's pool
            (runtime_dir / f"stop-{role}").touch()
            done = json.loads(read_line(engine, "DONE", 120))
            assert engine.wait(60) == 0
            assert done["iterations"] > restarts / 10, done
            dones.append(done)
        s = wait_status(runtime_dir, lambda s: not s["clients"] and s["device"]["accounted_bytes"] == 0, 20, "memory back at 0")
        assert s["arenas"] == [] and s["graph_pools"] == [] and s["kv"] == []
        free_delta = 0
        if backend == "cuda":  # the device's own measure: every byte given back
            s = wait_status(runtime_dir, lambda s: s["device"]["free_bytes"] >= free_before - (64 << 20), 20, "device free memory back")
            free_delta = s["device"]["free_bytes"] - free_before
        engines_line = ", ".join(f"{d['role']}: {d['iterations']} iterations, {d['calls']} calls, slowest {d['slowest_s']} s" for d in dones)
        print(f"\nrestart loop ({backend}): {restarts} kill -9 restarts; {engines_line}; 0 bytes accounted at the end, device free {free_delta:+d} bytes vs baseline")
        assert r.manager.settled_names(["record-0", "record-1"]) == ["record-0", "record-1"]
        assert r.manager.refused == 0
    finally:
        for engine in engines:
            if engine.poll() is None:
                os.kill(engine.pid, signal.SIGCONT)
                engine.kill()
                engine.wait()
            for stream in (engine.stdout, engine.stderr):
                if stream is not None:
                    stream.close()
        r.close()
