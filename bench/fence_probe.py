#!/usr/bin/env python3
"""When does a killed engine stop writing its memory? The fence a retain group's adoption
waits for (docs/architecture.md, "Fencing"), measured.

A writer process maps an arena (retained for a group) and writes to it without end: on
CUDA a kernel that stores a counter and the GPU's clock in a loop for ``--kernel-seconds``
(plain PTX, JIT-compiled by the driver: no compiler needed), on the host a thread. This
process maps the same arena (a grant) and reads the counter in a tight loop. Then
``kill -9`` of the writer, and, against the kill's time, when each of these happened:

- last_write: the counter last changed (the writes stopped);
- socket_eof: a socket the writer held reached EOF here (its descriptors were closed);
- leader_zombie: /proc shows the writer's main thread a zombie (other threads may still exit);
- exited: every thread of it exited (gpumemd's fence: ``fencing.process_gone``);
- nvml_gone (CUDA): NVML's compute processes of the device no longer list it;
- orphaned: gpumemd's status shows the group orphaned (the daemon saw its fd channel's EOF);
- adopted: a third process, waiting in ``Session.adopt``, got the group.

    python bench/fence_probe.py --backend cuda --trials 20
    python bench/fence_probe.py --backend host

Hypothesis (CUDA): the writes stop before socket_eof (the driver tears the context down
while the process's descriptors close, the device files first), NVML drops the pid no
later than the exit, so adoption (which waits for both) never sees a write. The figure
that decides: writes_after_adopted (must be 0 in every trial); writes_after_exited and
writes_after_nvml say which of the two checks is the one that matters.
Last line: {"bench": "fence_probe", "backend", "figures", "targets", "ok"}; ok means no
trial saw a write after its adoption.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as c

c.ensure_importable()
from gpumemd.fencing import process_gone  # noqa: E402  (importable once the checkout is)

BENCH = "fence_probe"
MiB = 1 << 20

# The writer's kernel: p[0] = an iteration count, p[1] = %globaltimer, until ns passed.
_PTX = r"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry spin(.param .u64 p, .param .u64 ns)
{
    .reg .u64 %rd<8>;
    .reg .pred %again;
    ld.param.u64 %rd1, [p];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u64 %rd2, [ns];
    mov.u64 %rd3, %globaltimer;
    mov.u64 %rd5, 0;
LOOP:
    add.u64 %rd5, %rd5, 1;
    mov.u64 %rd4, %globaltimer;
    st.volatile.global.u64 [%rd1], %rd5;
    st.volatile.global.u64 [%rd1+8], %rd4;
    membar.sys;
    sub.u64 %rd6, %rd4, %rd3;
    setp.lt.u64 %again, %rd6, %rd2;
    @%again bra LOOP;
    ret;
}
"""


def _cuda_ok(result: Any, what: str) -> Any:
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: CUDA error {int(err)}")
    return rest[0] if len(rest) == 1 else rest


def _launch_spin(address: int, seconds: float) -> None:
    """The kernel, on the current context (the session's), left running."""
    from cuda.bindings import driver as cu

    module = _cuda_ok(cu.cuModuleLoadData(_PTX.encode() + b"\0"), "cuModuleLoadData")
    function = _cuda_ok(cu.cuModuleGetFunction(module, b"spin"), "cuModuleGetFunction")
    args = ((address, int(seconds * 1e9)), (ctypes.c_void_p, ctypes.c_ulonglong))
    _cuda_ok(cu.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, 0, args, 0), "cuLaunchKernel")


def writer(runtime_dir: str, group: str, seconds: float) -> int:
    """The engine to kill: an arena retained for ``group``, shared with the observer,
    written without end. Holds the socket it inherited (fd 3) until it dies."""
    import threading

    import gpumem

    session = gpumem.connect(0, "fence-writer", runtime_dir=runtime_dir)
    arena = session.create_arena(group, 64 * MiB)
    arena.commit(session.device.granularity)
    arena.share("fence-observer")
    retained = session.retain_group(group)
    retained.retain(arena)
    print("READY", retained.secret, flush=True)
    if session.backend == "cuda":
        _launch_spin(arena.address, seconds)
    else:
        words = (ctypes.c_uint64 * 2).from_address(arena.address)

        def spin() -> None:
            i = 0
            while True:
                i += 1
                words[0], words[1] = i, time.monotonic_ns()

        threading.Thread(target=spin, daemon=True).start()
    print("WRITING", flush=True)
    time.sleep(3600)
    return 0


def adopter(runtime_dir: str, group: str, secret: str) -> int:
    """Waits for the group and prints when it got it (CLOCK_MONOTONIC, shared by every process)."""
    import gpumem

    session = gpumem.connect(0, "fence-adopter", runtime_dir=runtime_dir)
    print("WAITING", flush=True)
    session.adopt(group, secret, wait=60.0)
    print("ADOPTED", time.monotonic_ns(), flush=True)
    sys.stdin.read()  # until the probe closes our stdin
    session.close()
    return 0


class Lines:
    """A helper's stdout read line by line with a deadline (select on the descriptor
    itself: a buffered reader may hold a second line that select cannot see)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc, self.fd, self.buffer = proc, proc.stdout.fileno(), b""

    def ready(self) -> bool:
        return b"\n" in self.buffer or bool(select.select([self.fd], [], [], 0)[0])

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                if line.startswith(prefix.encode()):
                    return line[len(prefix):].decode().strip()
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                break
            chunk = os.read(self.fd, 4096)
            if not chunk:
                break
            self.buffer += chunk
        raise RuntimeError(f"{self.proc.args!r} printed no {prefix!r} within {timeout:g}s")


def _leader_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(b")") + 2 :].split()[0] in (b"Z", b"X")


def trial(index: int, runtime_dir: Path, observer: Any, nvml: Any, seconds: float, window: float, env: dict[str, str]) -> dict[str, Any]:
    group = f"fence-{index}"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    script = str(Path(__file__).resolve())
    started = time.time()
    w = subprocess.Popen(
        [sys.executable, script, "--writer", str(runtime_dir), group, str(seconds)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, pass_fds=[theirs.fileno()],
    )
    theirs.close()
    a: subprocess.Popen[bytes] | None = None
    wl = Lines(w)
    try:
        secret = wl.expect("READY", 60)
        arena = observer.attach_arena(group)
        wl.expect("WRITING", 60)
        a = subprocess.Popen([sys.executable, script, "--adopter", str(runtime_dir), group, secret],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        al = Lines(a)
        al.expect("WAITING", 60)
        first = arena.read(0, 8)
        time.sleep(0.05)
        if arena.read(0, 8) == first:
            raise RuntimeError("the writer does not write: the counter stood still for 50 ms before the kill")
        killed = time.monotonic_ns()
        os.kill(w.pid, signal.SIGKILL)
        last, last_change = arena.read(0, 8), killed
        seen: dict[str, int] = {}
        next_slow = 0
        while True:
            now = time.monotonic_ns()
            value = arena.read(0, 8)
            if value != last:
                last, last_change = value, now
            if "socket_eof" not in seen and select.select([ours], [], [], 0)[0] and not ours.recv(1):
                seen["socket_eof"] = now
            if "leader_zombie" not in seen and _leader_zombie(w.pid):
                seen["leader_zombie"] = now
            if "exited" not in seen and process_gone(w.pid, started):
                seen["exited"] = now
            if now >= next_slow:  # the calls that cost a millisecond or so, not every turn
                next_slow = now + 1_000_000
                if nvml is not None and "nvml_gone" not in seen and w.pid not in nvml.pids():
                    seen["nvml_gone"] = now
                # Stamped when the answer is in, not when the loop turned: the daemon answers
                # after it took the EOF, and the first poll, sent 0.04 ms after the kill, came
                # back orphaned on the H200 (an upper bound, like the others' stamps).
                if "orphaned" not in seen and any(g.group == group and g.state == "orphaned" for g in observer.status().retained):
                    seen["orphaned"] = time.monotonic_ns()
                if "adopted" not in seen and al.ready():
                    seen["adopted"] = int(al.expect("ADOPTED", 5))
            wanted = {"socket_eof", "leader_zombie", "exited", "orphaned", "adopted"} | ({"nvml_gone"} if nvml is not None else set())
            if (wanted <= seen.keys() and now - max([last_change, *seen.values()]) > 200_000_000) or now - killed > window * 1e9:
                break
        ms = {k: round((v - killed) / 1e6, 3) for k, v in seen.items()}
        ms["last_write"] = round((last_change - killed) / 1e6, 3)
        after = {f"writes_after_{k}": last_change > v for k, v in seen.items()}
        return {"ms": ms, **after, "missing": sorted(wanted - seen.keys())}
    finally:
        if w.poll() is None:
            w.kill()
        w.wait()
        ours.close()
        if a is not None:
            if a.stdin is not None:
                a.stdin.close()
            try:
                a.wait(10)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()
        for stream in (w.stdout, a.stdout if a is not None else None):
            if stream is not None:
                stream.close()
        if group in observer.arenas:
            observer.arenas[group].release()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        return writer(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    if len(sys.argv) > 1 and sys.argv[1] == "--adopter":
        return adopter(sys.argv[2], sys.argv[3], sys.argv[4])
    ap = c.ArgumentParser(BENCH, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="cuda")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--kernel-seconds", type=float, default=20.0, help="how long the CUDA kernel writes at most (default: 20)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds after each kill to watch (default: 10)")
    args = ap.parse_args()

    def body(result: c.Result, cleanup: Any) -> None:
        c.ensure_importable()
        import gpumem

        rt = cleanup.enter_context(c.runtime_dir())
        daemon = c.Daemon(rt, args.backend, args=["--retain-grace", "120"]).wait_ready(60)
        cleanup.callback(daemon.stop)
        env = c.child_env(GPUMEMD_RUNTIME_DIR=str(rt))
        observer = gpumem.connect(0, "fence-observer", runtime_dir=str(rt))
        cleanup.callback(observer.close)
        nvml = None
        if args.backend == "cuda":
            from gpumemd.fencing import NvmlProcesses

            nvml = NvmlProcesses(observer.device.uuid)
        trials = []
        for i in range(args.trials):
            t = trial(i, rt, observer, nvml, args.kernel_seconds, args.window, env)
            c.say(f"trial {i}: {json.dumps(t)}")
            trials.append(t)
        keys = sorted({k for t in trials for k in t["ms"]})
        for k in keys:
            values = [t["ms"][k] for t in trials if k in t["ms"]]
            result.figures[f"{k}_ms_p50"] = c.median(values)
            result.figures[f"{k}_ms_max"] = max(values)
        for k in sorted({k for t in trials for k in t if k.startswith("writes_after_")}):
            result.figures[k] = sum(1 for t in trials if t.get(k))
        result.figures["trials"] = len(trials)
        result.figures["incomplete"] = sum(1 for t in trials if t["missing"])
        result.targets["writes_after_adopted"] = 0
        result.ok = result.figures.get("writes_after_adopted", 1) == 0 and not result.figures["incomplete"]

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    sys.exit(main())
