"""Churn: many client processes creating, sharing, attaching, syncing and releasing
arenas and KV pools against one daemon, some of them killed with SIGKILL (and started
again) as they go.

    python tests/churn_workload.py worker RUNTIME_DIR INDEX WORKERS DEADLINE SEED

runs one worker: client ``churn-INDEX`` of device 0's daemon, doing random operations
until CLOCK_MONOTONIC reaches DEADLINE, then releasing everything and printing its
counts as ``REPORT {json}`` (``PROGRESS {json}`` lines on the way, so a worker killed
midway still tells what it did). ``churn()`` runs the whole workload and checks the
daemon afterwards; tests/integration/test_churn.py and bench/churn.py call it.

Each worker owns up to three plain arenas (shared with every other worker's name) and
one KV pool, and attaches arenas the others own. Owners write an 8-byte tag of the
arena's name at every granule they commit; whoever maps the arena reads granules back
and accepts the tag, or zeros where the owner has not written yet (fresh chunks are
zeroed): anything else means a chunk mapped at the wrong place. Decommits often go to
0 and are followed by commits, so a sharer's sync meets new chunks at the offsets of
retired ones. What the daemon may refuse under churn (an arena released between the
status that listed it and the attach, memory exhausted) counts as refused; any other
error is a failure, and a VaCollision is counted on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
G = 2 * MiB
ARENA_BYTES = 256 * MiB
MAX_COMMIT = 64 * MiB
KV_ROW = 4096
KV_TOKENS = 4096  # 16 MiB per buffer
MAX_OWNED = 3
ZEROS = bytes(8)
PROGRESS_EVERY_S = 0.5


def tag(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=8).digest()



# --------------------------------------------------------------------------- one worker


class Mismatch(Exception):
    """What a worker read or mapped is not what it should be."""


@dataclasses.dataclass
class Owned:
    arena: Any  # gpumem.Arena
    cover: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # placeholder asked over


class Worker:
    def __init__(self, runtime_dir: str, index: int, workers: int, deadline: float, seed: int) -> None:
        import gpumem

        self.gpumem = gpumem
        self.runtime_dir = runtime_dir
        self.name = f"churn-{index}"
        self.index = index
        self.others = [f"churn-{i}" for i in range(workers) if i != index]
        self.deadline = deadline
        self.rng = random.Random(seed)
        self.serial = 0
        self.counts: dict[str, int] = {"ops": 0, "refused": 0, "collisions": 0, "failures": 0, "reads_checked": 0}
        self.by_op: dict[str, int] = {}
        self.refused_by: dict[str, int] = {}  # "op: Exception" -> count
        self.errors: list[str] = []
        self.session = self.connect()
        self.owned: dict[str, Owned] = {}
        self.attached: dict[str, Any] = {}
        self.pool: Any = None  # gpumem.KvPool
        self.pool_placeholder = False
        # Refusals churn makes legitimate: an arena released between the status that
        # listed it and the attach, the device full. Anything else is a failure.
        self.expected: dict[str, tuple[type[Exception], ...]] = {
            "commit": (gpumem.OutOfMemory,),
            "placeholder": (gpumem.OutOfMemory,),
            "attach": (gpumem.NotFound,),
            "kv_declare": (gpumem.OutOfMemory,),
            "kv_round": (gpumem.OutOfMemory,),
            "kv_grow": (gpumem.OutOfMemory,),
            "second_session": (gpumem.OutOfMemory,),
        }
        self.operations: dict[str, tuple[int, Callable[[], bool]]] = {
            "create": (8, self.op_create),
            "commit": (12, self.op_commit),
            "decommit": (10, self.op_decommit),
            "placeholder": (4, self.op_placeholder),
            "attach": (10, self.op_attach),
            "sync": (16, self.op_sync),
            "check": (8, self.op_check),
            "release": (4, self.op_release),
            "detach": (5, self.op_detach),
            "kv_declare": (3, self.op_kv_declare),
            "kv_round": (3, self.op_kv_round),
            "kv_grow": (5, self.op_kv_grow),
            "kv_shrink": (5, self.op_kv_shrink),
            "kv_release": (2, self.op_kv_release),
            "second_session": (2, self.op_second_session),
            "reconnect": (1, self.op_reconnect),
        }

    def connect(self, name: str | None = None) -> Any:
        return self.gpumem.connect(0, name=name or self.name, runtime_dir=self.runtime_dir, timeout=30.0)

    def fresh_name(self, kind: str) -> str:
        self.serial += 1
        return f"{self.name}-{os.getpid()}-{kind}{self.serial}"

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        names = list(self.operations)
        weights = [self.operations[n][0] for n in names]
        last_progress = 0.0
        while time.monotonic() < self.deadline:
            op = self.rng.choices(names, weights)[0]
            self.attempt(op, self.operations[op][1])
            now = time.monotonic()
            if now - last_progress >= PROGRESS_EVERY_S:
                print("PROGRESS " + json.dumps(self.report()), flush=True)
                last_progress = now
        self.teardown()
        return self.report()

    def attempt(self, op: str, body: Callable[[], bool]) -> None:
        gpumem = self.gpumem
        try:
            done = body()
        except gpumem.VaCollision as exc:
            self.counts["collisions"] += 1
            self.note(op, exc)
        except self.expected.get(op, ()) as exc:
            self.counts["refused"] += 1
            key = f"{op}: {type(exc).__name__}"
            self.refused_by[key] = self.refused_by.get(key, 0) + 1
        except Exception as exc:  # a failure of the library or the daemon: counted and shown
            self.counts["failures"] += 1
            self.note(op, exc)
            traceback.print_exc(file=sys.stderr)
        else:
            if done:
                self.counts["ops"] += 1
                self.by_op[op] = self.by_op.get(op, 0) + 1

    def note(self, op: str, exc: BaseException) -> None:
        if len(self.errors) < 10:
            self.errors.append(f"{op}: {type(exc).__name__}: {exc}")

    def report(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": os.getpid(),
            **self.counts,
            "by_op": dict(self.by_op),
            "refused_by": dict(self.refused_by),
            "errors": list(self.errors),
        }

    # ------------------------------------------------------------------ checks

    def write_tags(self, arena: Any, start: int, end: int) -> None:
        for offset in range(start, end, G):
            arena.write(offset, tag(arena.name))

    def check_granules(self, arena: Any, *, exact: bool, samples: int = 4) -> None:
        granules = [o for start, end in arena.committed_ranges() for o in range(start, end, G)]
        for offset in self.rng.sample(granules, min(samples, len(granules))):
            got = arena.read(offset, 8)
            if got != tag(arena.name) and (exact or got != ZEROS):
                raise Mismatch(f"arena '{arena.name}' holds {got.hex()} at offset {offset}, not its tag {tag(arena.name).hex()}")
            self.counts["reads_checked"] += 1

    def check_backing(self, arena: Any, cover: list[tuple[int, int]]) -> None:
        """Committed memory and placeholder together back exactly what was asked."""
        from gpumem.window import merge

        want = merge(arena.committed_ranges() + cover)
        if arena.backed_ranges() != want:
            raise Mismatch(f"arena '{arena.name}' is backed over {arena.backed_ranges()}, not {want}")

    # ------------------------------------------------------------------ operations: own arenas

    def op_create(self) -> bool:
        if len(self.owned) >= MAX_OWNED:
            return False
        name = self.fresh_name("a")
        arena = self.session.create_arena(name, ARENA_BYTES)
        self.owned[name] = Owned(arena)
        for other in self.others:
            arena.share(other)
        return True

    def pick_owned(self) -> Owned | None:
        return self.owned[self.rng.choice(sorted(self.owned))] if self.owned else None

    def op_commit(self) -> bool:
        own = self.pick_owned()
        if own is None or own.arena.committed >= MAX_COMMIT:
            return False
        before = own.arena.committed
        target = self.rng.randrange(before // G + 1, MAX_COMMIT // G + 1) * G
        own.arena.commit(target)
        self.write_tags(own.arena, before, target)
        self.check_granules(own.arena, exact=True)
        self.check_backing(own.arena, own.cover)
        return True

    def op_decommit(self) -> bool:
        own = self.pick_owned()
        if own is None or not own.arena.committed:
            return False
        to = 0 if self.rng.random() < 0.5 else self.rng.randrange(0, own.arena.committed // G) * G
        own.arena.decommit(to)
        self.check_granules(own.arena, exact=True)
        self.check_backing(own.arena, own.cover)
        return True

    def op_placeholder(self) -> bool:
        own = self.pick_owned()
        if own is None or own.cover:
            return False
        start = self.rng.randrange(0, ARENA_BYTES // G // 2) * G
        own.arena.placeholder(start, ARENA_BYTES - start)
        own.cover = [(start, ARENA_BYTES)]
        self.check_backing(own.arena, own.cover)
        return True

    def op_release(self) -> bool:
        own = self.pick_owned()
        if own is None:
            return False
        del self.owned[own.arena.name]
        own.arena.release()
        return True

    # ------------------------------------------------------------------ operations: others' arenas

    def op_attach(self) -> bool:
        candidates = [
            a.name
            for a in self.session.status().arenas
            if a.owner != self.name and self.name in a.shared_with and a.name not in self.attached
        ]
        if not candidates:
            return False
        name = self.rng.choice(candidates)
        self.attached[name] = self.session.attach_arena(name)
        self.check_granules(self.attached[name], exact=False)
        return True

    def op_sync(self) -> bool:
        if not self.attached:
            return False
        arena = self.attached[self.rng.choice(sorted(self.attached))]
        arena.sync()
        self.check_granules(arena, exact=False)
        return True

    def op_check(self) -> bool:
        if not self.attached:
            return False
        self.check_granules(self.attached[self.rng.choice(sorted(self.attached))], exact=False, samples=8)
        return True

    def op_detach(self) -> bool:
        if not self.attached:
            return False
        self.attached.pop(self.rng.choice(sorted(self.attached))).release()
        return True

    # ------------------------------------------------------------------ operations: a KV pool

    def op_kv_declare(self) -> bool:
        if self.pool is not None:
            return False
        buffers = [self.gpumem.KvBuffer("k", KV_ROW), self.gpumem.KvBuffer("v", KV_ROW)]
        self.pool = self.session.declare_kv_pool(self.fresh_name("kv"), buffers, max_tokens=KV_TOKENS)
        self.pool_placeholder = self.rng.random() < 0.5
        if self.pool_placeholder:
            self.pool.placeholder(16 * MiB)
        self.check_pool()
        return True

    def check_pool(self) -> None:
        pool = self.pool
        cover = [(0, pool.arena.reserved)] if self.pool_placeholder else []
        self.check_backing(pool.arena, cover)
        if pool.tokens:
            for buffer in pool.buffers.values():
                last = buffer.offset + (pool.tokens - 1) * KV_ROW
                pool.arena.write(last, tag(pool.name))
                if pool.arena.read(buffer.offset, 8) not in (tag(pool.name), ZEROS) or pool.arena.read(last, 8) != tag(pool.name):
                    raise Mismatch(f"KV pool '{pool.name}' buffer '{buffer.name}' does not keep its rows")
                pool.arena.write(buffer.offset, tag(pool.name))

    def op_kv_round(self) -> bool:
        if self.pool is None or self.pool.tokens:
            return False
        self.pool.join_round()
        self.pool.capture_done(max_tokens=self.rng.randrange(1, KV_TOKENS + 1), timeout=30.0)
        self.check_pool()
        return True

    def op_kv_grow(self) -> bool:
        if self.pool is None or self.pool.tokens >= KV_TOKENS:
            return False
        self.pool.grow(self.rng.randrange(self.pool.tokens + 1, KV_TOKENS + 1))
        self.check_pool()
        return True

    def op_kv_shrink(self) -> bool:
        if self.pool is None or not self.pool.tokens:
            return False
        self.pool.shrink(self.rng.randrange(0, self.pool.tokens))
        self.check_pool()
        return True

    def op_kv_release(self) -> bool:
        if self.pool is None:
            return False
        pool, self.pool = self.pool, None
        pool.release()
        return True

    # ------------------------------------------------------------------ operations: sessions

    def op_second_session(self) -> bool:
        """Another session of the same daemon in this process, with an arena of its own:
        it shares the address slice with the first and leaves it reserved when it closes."""
        with self.connect(f"{self.name}-extra") as extra:  # a live name belongs to one session
            arena = extra.create_arena(self.fresh_name("x"), ARENA_BYTES)
            arena.commit(4 * MiB)
            self.write_tags(arena, 0, 4 * MiB)
            self.check_granules(arena, exact=True)
        for own in self.owned.values():
            self.check_granules(own.arena, exact=True, samples=1)
        return True

    def op_reconnect(self) -> bool:
        """Everything released, the session closed (its slice freed) and a new one opened."""
        self.teardown()
        self.session = self.connect()
        return True

    def teardown(self) -> None:
        """Release every arena and pool one by one (each failure counted), then close."""
        arenas = [own.arena for own in self.owned.values()] + list(self.attached.values())
        arenas += [self.pool.arena] if self.pool is not None else []
        self.owned.clear()
        self.attached.clear()
        self.pool = None
        for arena in arenas:
            self.attempt("release at the end", functools.partial(done, arena.release))
        self.attempt("close", functools.partial(done, self.session.close))


def done(action: Callable[[], None]) -> bool:
    action()
    return True


def worker_main(runtime_dir: str, index: str, workers: str, deadline: str, seed: str) -> int:
    worker = Worker(runtime_dir, int(index), int(workers), float(deadline), int(seed))
    print("REPORT " + json.dumps(worker.run()), flush=True)
    return 0


# --------------------------------------------------------------------------- the workload


@dataclasses.dataclass
class Instance:
    """One run of a worker process."""

    index: int
    proc: subprocess.Popen[bytes]
    log: Path
    killed: bool = False

    def last(self, prefix: str) -> dict[str, Any] | None:
        found = None
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith(prefix + " "):
                try:
                    found = json.loads(line[len(prefix) + 1 :])
                except json.JSONDecodeError:  # a line cut short by the kill
                    pass
        return found


def _status(runtime_dir: Path) -> Any:
    from gpumem.control import ControlChannel
    from gpumem_shared import protocol as p
    from gpumem_shared.paths import Endpoints

    channel = ControlChannel(Endpoints(runtime_dir, 0))
    try:
        return channel.call(p.Status(), 10.0)
    finally:
        channel.close()


def churn(
    runtime_dir: Path,
    *,
    seconds: float,
    workers: int = 8,
    kill_every: float = 2.5,
    seed: int = 0,
    log_dir: Path,
    free_tolerance: int = 64 * MiB,
    settle_s: float = 20.0,
) -> dict[str, Any]:
    """Run ``workers`` worker processes for ``seconds``, SIGKILL a random one about every
    ``kill_every`` seconds (and start it again), then wait for every worker and for the
    daemon to have let go of everything. Returns the figures: operations, kills,
    collisions, failures, crashes, and the daemon's state at the end."""
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    before = _status(runtime_dir)
    daemon_pid, baseline_free = before.daemon.pid, before.device.free_bytes
    deadline = time.monotonic() + seconds
    runs = 0

    def start(index: int) -> Instance:
        nonlocal runs
        runs += 1
        log = log_dir / f"churn-{index}.{runs}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, __file__, "worker", str(runtime_dir), str(index), str(workers), repr(deadline), str(rng.randrange(1 << 30))],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            )
        return Instance(index, proc, log)

    live = [start(i) for i in range(workers)]
    ended: list[Instance] = []
    try:
        next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
        while time.monotonic() < deadline - 2.0:  # a worker started now still gets to report
            time.sleep(0.05)
            for i, inst in enumerate(live):
                if inst.proc.poll() is not None:  # died on its own: a crash; keep the load up
                    ended.append(inst)
                    live[i] = start(inst.index)
            if time.monotonic() >= next_kill:
                i = rng.randrange(len(live))
                victim = live[i]
                victim.proc.kill()
                victim.proc.wait()
                victim.killed = True
                ended.append(victim)
                live[i] = start(victim.index)
                next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
        for inst in live:
            try:
                inst.proc.wait(timeout=max(deadline - time.monotonic(), 0) + 60.0)
            except subprocess.TimeoutExpired:
                inst.proc.kill()
                inst.proc.wait()
            ended.append(inst)
        live = []
    finally:
        for inst in live:
            inst.proc.kill()
            inst.proc.wait()

    figures: dict[str, Any] = {"workers": workers, "seconds": seconds, "operations": 0, "refused": 0, "reads_checked": 0,
                               "collisions": 0, "failures": 0, "kills": 0, "crashes": 0, "unreported": 0}
    by_op: dict[str, int] = {}
    refused_by: dict[str, int] = {}
    errors: list[str] = []
    for inst in ended:
        figures["kills"] += inst.killed
        report = inst.last("REPORT")
        counts = report if report is not None else inst.last("PROGRESS")
        if counts is not None:
            for key in ("refused", "reads_checked", "collisions", "failures"):
                figures[key] += counts[key]
            figures["operations"] += counts["ops"]
            for key, n in counts["by_op"].items():
                by_op[key] = by_op.get(key, 0) + n
            for key, n in counts["refused_by"].items():
                refused_by[key] = refused_by.get(key, 0) + n
            errors += [f"churn-{inst.index} (pid {inst.proc.pid}) {e}" for e in counts["errors"]]
        if inst.killed:
            continue
        if inst.proc.returncode != 0:
            figures["crashes"] += 1
            errors.append(f"churn-{inst.index} (pid {inst.proc.pid}) exited with {inst.proc.returncode}: {_tail(inst.log)}")
        elif report is None:
            figures["unreported"] += 1
            errors.append(f"churn-{inst.index} (pid {inst.proc.pid}) exited without its report: {_tail(inst.log)}")

    # Every worker is gone: the daemon must have let go of everything, and on CUDA the
    # device's memory must be back (the workers' contexts and chunks freed).
    settle = time.monotonic() + settle_s
    while True:
        after = _status(runtime_dir)
        back = (not after.clients and not after.arenas and after.device.accounted_bytes == 0
                and (after.daemon.backend != "cuda" or after.device.free_bytes >= baseline_free - free_tolerance))
        if back or time.monotonic() > settle:
            break
        time.sleep(0.1)
    figures.update(
        daemon_alive=after.daemon.pid == daemon_pid,
        clients_left=len(after.clients),
        arenas_left=len(after.arenas),
        accounted_bytes_end=after.device.accounted_bytes,
        free_bytes_baseline=baseline_free,
        free_bytes_end=after.device.free_bytes,
        free_tolerance=free_tolerance,
    )
    figures["by_op"] = dict(sorted(by_op.items()))
    figures["refused_by"] = dict(sorted(refused_by.items()))
    figures["errors"] = errors[:20]
    return figures


def summary(backend: str, figures: dict[str, Any]) -> str:
    """The one line to quote."""
    memory = f", device free {figures['free_bytes_end'] - figures['free_bytes_baseline']:+d} bytes vs baseline" if backend == "cuda" else ""
    return (
        f"churn ({backend}): {figures['workers']} processes, {figures['seconds']:g} s: {figures['operations']} operations "
        f"({figures['refused']} refused, {figures['reads_checked']} reads checked), {figures['kills']} kill -9, "
        f"{figures['collisions']} VaCollision, {figures['failures']} failures, {figures['crashes']} crashes, "
        f"{figures['unreported']} unreported; daemon {'alive' if figures['daemon_alive'] else 'DEAD'}, "
        f"{figures['accounted_bytes_end']} bytes accounted at the end{memory}"
    )


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])


if __name__ == "__main__":
    assert sys.argv[1] == "worker", sys.argv
    sys.exit(worker_main(*sys.argv[2:]))
