#!/usr/bin/env python3
"""Leases on a graph pool: the uncontended fast path and the handoff between processes.

1. Uncontended: ``with session.replay(pool): pass`` timed one by one (acquire +
   release through the client library: a compare-and-swap each way, no daemon) on a
   private pool, against the control round trip (``session.ping()``) measured in the
   same run.
2. Uncontended on a shared pool (registered with ``shared=True``), by its owner: each
   release also records this process's IPC event on its stream (a figure, no target).
   Then the bare native calls alone, on the private pool (``lease_try`` and
   ``lease_release``) and on the shared one (``lease_try_ordered`` and
   ``lease_release_ordered``, which records the event): the difference is what the
   event record costs inside the call.
3. Handoff: the owner shares the arena with two client processes; each attaches it,
   opens the shared pool (``session.open_graph_pool``) and they take turns holding its
   replay lease. The holder keeps it about a millisecond, longer than the waiter's first
   spin: the waiter sleeps on the slot's futex (in the pool's lease segment, which each
   of them maps) until shortly before the holder's predicted release (the slot's hold
   estimate, which every release updates), then watches the word, so it is mostly awake
   when the lease is released, and asleep when the prediction misses; the figure is from
   the release (CLOCK_MONOTONIC, shared by the processes) to the waiter holding the lease. Every handoff runs the
   cross-process path: the IPC event recorded at release and the stream wait on it at
   acquire, each in the same native call as the lease's compare-and-swap
   (``session.leasing.handoff_waits`` counts those waits; reported as a figure). Then the
   same turns through the bare native calls from Python, without events
   (``lease_acquire``, ``lease_release_recorded``) and with them (``lease_acquire_ordered``,
   ``lease_release_ordered``): the steps from the C floor to the full path. And what one
   ``cuStreamWaitEvent`` on the other process's event costs alone (CUDA). Where the time
   goes: the release call's own duration in each set of turns (``*release_call*``), and
   the ns from the native take's compare-and-swap (the slot's ``since_ns``) to the
   taker's next Python line (``*after_take*``). What waiting costs: the two clients' CPU
   time over the Lease turns per handoff (``client_cpu_per_handoff_us``; each turn a
   take, the hold, the release and the pause), which a watching waiter spends.

   Then the same turns (through ``Lease``) against a second daemon started with
   ``--lease-ordering memops``: the release queues a stream write of the releaser's next
   sequence value and the taker's stream waits for it (gpumem_shared/lease_order.py);
   ``memops_handoff_*`` figures, its ratio to the same floor, its stream waits, and its
   release call alone (``memops_release_call_p50_us``).

4. The floor under (3), in the same run: bench/futex_floor.c (compiled here with ``cc``),
   two C processes taking turns on a shared futex word with the same 1 ms hold, no
   Python and no CUDA. The handoff's target is a ratio to its p50. Then the same C turns
   with the clients' 300 us pause after each release (``futex_floor_paused``): the pause
   alone can move the wake-up (by machine), so that ratio is reported beside it (a
   figure, no target).

The pools are synthetic registrations in a committed arena (no GPU work is involved in
a lease); on the host backend events are no-ops but the same code path runs, so the
same figures come from either backend.

    python bench/lease.py --backend host
    python bench/lease.py --backend cuda

Last line: {"bench": "lease", ...}; ok means uncontended p50 (private pool) <= 2 us, at
least 40x faster than the control round trip, handoff p50 <= 1.6x the C futex handoff's
p50, and the clients waited on an IPC event at every handoff; and the same for memops
ordering (its handoff p50 <= 1.6x the floor, a stream wait at every handoff); the
target was 2x until issue 38.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as c

BENCH = "lease"
MiB = 1 << 20
OWNER = "bench-lease"
ARENA = "graphs"
SHARED_POOL = "bench-pool"
CLIENTS = ("turn-a", "turn-b")
FUTEX_FLOOR = Path(__file__).resolve().parent / "futex_floor.c"


# The handoff's target, both orderings: its p50 at most this times the C futex floor's.
HANDOFF_RATIO_MAX = 1.6

# What a handoff client sleeps after each release, so that the waiter, not the releaser,
# takes the lease next; bench/futex_floor.c takes it as an argument.
PAUSE_S = 0.0003


def futex_floor(pause_us: int = 0) -> tuple[float, float, int]:
    """bench/futex_floor.c built and run here, with ``pause_us`` after each release:
    (p50 us, p99 us, handoffs)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH: the handoff's baseline is bench/futex_floor.c, built here")
    with tempfile.TemporaryDirectory(prefix="gmb-futex-") as tmp:
        binary = Path(tmp) / "futex_floor"
        subprocess.run([compiler, "-O2", "-o", str(binary), str(FUTEX_FLOOR)], check=True, capture_output=True, timeout=60)
        out = subprocess.run([str(binary), str(pause_us)], check=True, capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"p50 ([0-9.]+) us, p99 ([0-9.]+) us over ([0-9]+)", out)
    if found is None:
        raise RuntimeError(f"bench/futex_floor.c printed {out!r}, not its p50 / p99 line")
    return float(found.group(1)), float(found.group(2)), int(found.group(3))


def turns(session: Any, pool: Any, rounds: int) -> list[tuple[int, int, int, int]]:
    """``rounds`` turns of a client in a handoff: take the pool (acquired at), hold it a
    millisecond, release it (released at, and the release call's ns), pause so that the
    other side, waiting, takes it next. And where in the take the time went:
    the slot's ``since_ns`` is the moment the native take won the compare-and-swap, so
    the turn also carries the ns from there to the Python line after the take."""
    out = []
    for _ in range(rounds):
        lease = session.replay(pool, wait=5.0)
        acquired, returned = time.monotonic_ns(), time.time_ns()
        after_take = holding(pool, returned)
        time.sleep(0.001)
        released = time.monotonic_ns()
        lease.release()
        out.append((acquired, released, time.monotonic_ns() - released, after_take))
        time.sleep(PAUSE_S)
    return out


def holding(pool: Any, returned: int) -> int:
    """ns from the native take's compare-and-swap to ``returned`` (the realtime clock read
    on the Python line after the take; -1 if the slot shows no holder), read while the
    lease is held."""
    holder = pool.segment.holder()
    return returned - holder.since_ns if holder else -1


def handoff_client(name: str, rounds: int, ordering: str) -> int:
    """Attach the owner's arena, open its shared pool, take the pool's replay lease
    ``rounds`` times holding it ~1 ms each; print the event times and the handoff waits.
    Under memops ordering only the Lease path runs (the bare calls below are the IPC
    event path's steps)."""
    import gpumem

    session = gpumem.connect(0, name=name)
    session.attach_arena(ARENA)
    pool = session.open_graph_pool(owner=OWNER, label=SHARED_POOL)
    print("READY", flush=True)
    sys.stdin.readline()
    cpu = time.process_time_ns()
    events = turns(session, pool, rounds)
    cpu = time.process_time_ns() - cpu
    waits = session.leasing.handoff_waits
    if ordering == "memops":
        report = {"events": events, "bare": [], "native": [], "stream_waits": [], "cpu_ns": cpu}
        print(json.dumps(report | {"handoff_waits": waits, "native_waits": 0}), flush=True)
        session.close()
        return 0
    # The same turns through the bare native calls on the same slot (no Lease object):
    # without events, what Python itself adds to the C floor; with them, what the event
    # record and the stream wait add inside the calls.
    from gpumem.leases import current_stream
    from gpumem_shared import _native
    from gpumem_shared.lease_table import LeaseKind, LeaseStatus

    leasing = session.leasing
    address, word = pool.segment.address, leasing.words[LeaseKind.REPLAY]
    epoch = ((pool.id & 0xFFFF) << 16 | (pool.epoch & 0xFFFF)) or 1
    context, stream = leasing.context, current_stream(leasing.device_ordinal)
    own, peers = leasing.recording[pool.id], leasing.waits_on(pool.id)
    taken = (LeaseStatus.OK, LeaseStatus.OK_ORDER, LeaseStatus.OK_WAITED)
    bare, native, native_waits = [], [], 0
    for ordered in (False, True):
        for _ in range(rounds):
            if ordered:
                status = _native.lease_acquire_ordered(address, word, epoch, 5_000_000_000, None, context, stream, peers)[0]
                native_waits += status == LeaseStatus.OK_WAITED
            else:
                status = _native.lease_acquire(address, word, epoch, 5_000_000_000, None)[0]
            if status == LeaseStatus.STALE and pool.segment.epoch() == 0 and leasing.follow(pool):
                # The pool moved to a fresh segment (a user lost its right): the bare calls
                # follow it as Lease.acquire does, and this turn is not timed.
                address = pool.segment.address
                continue
            if status not in taken:
                raise RuntimeError(f"the bare native acquire did not take the lease within 5 s (status {status})")
            acquired, returned = time.monotonic_ns(), time.time_ns()
            after_take = holding(pool, returned)
            time.sleep(0.001)
            released = time.monotonic_ns()
            if ordered:
                _native.lease_release_ordered(address, word, context, own, stream)
            else:
                _native.lease_release_recorded(address, word)
            (native if ordered else bare).append((acquired, released, time.monotonic_ns() - released, after_take))
            time.sleep(PAUSE_S)
    stream_waits = []
    for event in list(peers.values())[:1] if context else []:
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            _native.cuda_stream_wait(context, event, stream)
            stream_waits.append(time.perf_counter_ns() - t0)
    report = {"events": events, "bare": bare, "native": native, "stream_waits": stream_waits, "cpu_ns": cpu}
    print(json.dumps(report | {"handoff_waits": waits, "native_waits": native_waits}), flush=True)
    session.close()
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        return handoff_client(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cuda", "host"], default="host")
    parser.add_argument("--iterations", type=int, default=200000)
    parser.add_argument("--pings", type=int, default=5000)
    parser.add_argument("--handoffs", type=int, default=500, help="turns per process")
    args = parser.parse_args()
    c.ensure_importable()

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        result.targets = {
            "uncontended_p50_us_max": 2.0, "speedup_vs_rtt_min": 40.0, "handoff_ratio_p50_max": HANDOFF_RATIO_MAX, "memops_handoff_ratio_p50_max": HANDOFF_RATIO_MAX,
        }
        import gpumem
        from gpumem_shared import lease_table
        from gpumem_shared.lease_table import LeaseFlag, LeaseKind
        from gpumem_shared import protocol as p

        rt = cleanup.enter_context(c.runtime_dir())
        daemon = c.Daemon(rt, args.backend)
        cleanup.callback(daemon.stop)
        daemon.wait_ready(60)
        session = gpumem.connect(0, name=OWNER, runtime_dir=rt)
        cleanup.callback(session.close)
        arena = session.create_arena(ARENA, 1 << 30)
        arena.commit(64 * MiB)
        # Two synthetic pools in the committed arena: a private one (the fast path: no
        # event at release) and a shared one that the handoff clients open.
        private = arena.register_graph_pool("bench-private", extents=[p.Extent(offset=0, size=32 * MiB)], free_runs=[])
        shared = arena.register_graph_pool(SHARED_POOL, extents=[p.Extent(offset=32 * MiB, size=32 * MiB)], free_runs=[], shared=True)
        if private.shared or not shared.shared:
            raise RuntimeError(f"the daemon registered the pools as shared={private.shared}/{shared.shared}, not False/True")

        clock = time.perf_counter_ns

        def uncontended(pool: gpumem.GraphPool) -> list[int]:
            for _ in range(2000):
                with session.replay(pool):
                    pass
            samples = []
            for _ in range(args.iterations):
                t0 = clock()
                with session.replay(pool):
                    pass
                samples.append(clock() - t0)
            return samples

        samples = uncontended(private)
        shared_samples = uncontended(shared)
        me = lease_table.decode(session.leasing.words[LeaseKind.REPLAY])[1]
        if not shared.segment.flags() & LeaseFlag.SHARED or shared.segment.handoff() != me:
            raise RuntimeError(f"releases of shared pool {shared.id} did not record an IPC event: the shared path did not run")

        def native_uncontended(pool: gpumem.GraphPool) -> list[int]:
            """The native calls alone: lease_try + lease_release on a private pool, the ordered
            pair (the event recorded inside) on a shared one."""
            from gpumem.leases import current_stream
            from gpumem_shared import _native

            leasing = session.leasing
            address, word = pool.segment.address, leasing.words[LeaseKind.REPLAY]
            epoch = lease_table.lease_epoch(pool.id, pool.epoch)
            context, stream = leasing.context, current_stream(leasing.device_ordinal)
            event, peers = leasing.recording.get(pool.id, 0), leasing.waits_on(pool.id)
            out = []
            for i in range(2000 + args.iterations):
                t0 = clock()
                if pool.shared:
                    taken = _native.lease_try_ordered(address, word, epoch, b"bench", context, stream, peers)
                    released = _native.lease_release_ordered(address, word, context, event, stream)
                else:
                    taken = _native.lease_try(address, word, epoch, b"bench")
                    released = _native.lease_release(address, word)
                elapsed = clock() - t0
                if taken or released:
                    raise RuntimeError(f"an uncontended native take / release of pool {pool.id} answered {taken} / {released}")
                if i >= 2000:
                    out.append(elapsed)
            return out

        native_samples = native_uncontended(private)
        native_shared_samples = native_uncontended(shared)
        pings = []
        for _ in range(args.pings):
            t0 = clock()
            session.ping()
            pings.append(clock() - t0)
        lease_p50 = c.median(samples) / 1e3
        shared_p50 = c.median(shared_samples) / 1e3
        ping_p50 = c.median(pings) / 1e3
        c.say(f"uncontended replay lease acquire+release, private pool: p50 {lease_p50:.2f} us, p99 {c.percentile(samples, 99) / 1e3:.2f} us")
        c.say(
            f"uncontended, shared pool (IPC event recorded at each release): p50 {shared_p50:.2f} us, "
            f"p99 {c.percentile(shared_samples, 99) / 1e3:.2f} us"
        )
        c.say(f"control round trip (ping): p50 {ping_p50:.1f} us: the lease is {ping_p50 / lease_p50:.0f}x faster")
        native_p50, native_shared_p50 = c.median(native_samples) / 1e3, c.median(native_shared_samples) / 1e3
        c.say(
            f"the native calls alone: private pool (lease_try + lease_release) p50 {native_p50:.2f} us; shared pool "
            f"(lease_try_ordered + lease_release_ordered, the event recorded inside) {native_shared_p50:.2f} us"
        )

        def handoff_turns(rt: Path, daemon: c.Daemon, arena: gpumem.Arena, ordering: str) -> dict[str, Any]:
            """The handoff clients' turns on ``arena``'s shared pool, under ``ordering``."""
            for name in CLIENTS:
                arena.share(name)
            env = c.child_env(GPUMEMD_RUNTIME_DIR=str(rt))
            procs = c.spawn_clients(__file__, CLIENTS, [str(args.handoffs), ordering], env, cleanup)
            for name, proc in zip(CLIENTS, procs):
                line = proc.stdout.readline() if proc.stdout else ""
                if not line.startswith("READY"):
                    proc.wait(10)
                    raise RuntimeError(
                        f"handoff client {name} said {line!r} (exit status {proc.returncode}; its stderr is above); "
                        f"daemon log:\n{daemon.log()}"
                    )
            for proc in procs:
                assert proc.stdin
                proc.stdin.write("go\n")
                proc.stdin.flush()
            out: dict[str, Any] = {"events": [], "bare": [], "native": [], "stream_waits": [], "handoff_waits": 0, "native_waits": 0, "cpu_ns": 0}
            for index, proc in enumerate(procs):
                assert proc.stdout
                line = proc.stdout.readline()
                if not line.startswith("{"):
                    proc.wait(10)
                    raise RuntimeError(f"handoff client {CLIENTS[index]} said {line!r} (exit status {proc.returncode}; its stderr is above)")
                report = json.loads(line)
                for key in ("events", "bare", "native"):
                    out[key] += [(acquired, released, index, call, after) for acquired, released, call, after in report[key]]
                out["stream_waits"] += report["stream_waits"]
                out["handoff_waits"] += report["handoff_waits"]
                out["native_waits"] += report["native_waits"]
                out["cpu_ns"] += report["cpu_ns"]
                proc.wait(60)
            return out

        ipc = handoff_turns(rt, daemon, arena, "ipc-events")
        events, bare_events, native_events = ipc["events"], ipc["bare"], ipc["native"]
        stream_waits, handoff_waits, native_waits = ipc["stream_waits"], ipc["handoff_waits"], ipc["native_waits"]
        # The same turns under memops ordering: a second daemon (the ordering is the
        # daemon's choice), its own owner, arena and shared pool. The first daemon goes
        # first: on CUDA one gpumemd serves a device (the H200 refused the second while the
        # first ran), and both plan arenas in device 0's address slice.
        session.close()
        daemon.stop()
        memops_rt = cleanup.enter_context(c.runtime_dir())
        memops_daemon = c.Daemon(memops_rt, args.backend, args=["--lease-ordering", "memops"])
        cleanup.callback(memops_daemon.stop)
        memops_daemon.wait_ready(60)
        memops_session = gpumem.connect(0, name=OWNER, runtime_dir=memops_rt)
        cleanup.callback(memops_session.close)
        memops_arena = memops_session.create_arena(ARENA, 1 << 30)
        memops_arena.commit(64 * MiB)
        memops_arena.register_graph_pool(SHARED_POOL, extents=[p.Extent(offset=32 * MiB, size=32 * MiB)], free_runs=[], shared=True)
        memops = handoff_turns(memops_rt, memops_daemon, memops_arena, "memops")
        def handoff_times(turns: list[tuple[int, int, int, int, int]]) -> list[float]:
            turns.sort()
            return [(nxt[0] - cur[1]) / 1e3 for cur, nxt in itertools.pairwise(turns) if nxt[2] != cur[2] and nxt[0] >= cur[1]]

        def after_takes(turns: list[tuple[int, int, int, int, int]]) -> float:
            """p50 (us) from the native take's compare-and-swap to the taker's next Python
            line: the taker's share after its wake (the order's wait, the GIL, the return).
            The rest of a handoff is the releaser's call up to its wake and the wake itself."""
            return c.median([turn[4] for turn in turns if turn[4] >= 0]) / 1e3

        def release_calls(turns: list[tuple[int, int, int, int, int]]) -> float:
            """p50 of the release call alone, in a handoff (us): the releaser's share."""
            return c.median([turn[3] for turn in turns]) / 1e3

        handoffs = handoff_times(events)
        memops_handoffs = handoff_times(memops["events"])
        memops_p50 = c.median(memops_handoffs)
        c.say(
            f"under memops ordering (a stream write at release, a stream wait at take): p50 {memops_p50:.1f} us, "
            f"p99 {c.percentile(memops_handoffs, 99):.1f} us over {len(memops_handoffs)} handoffs, "
            f"{memops['handoff_waits']} stream waits on the releaser's value; the release call alone p50 "
            f"{release_calls(memops['events']):.1f} us"
        )
        bare = handoff_times(bare_events)
        native = handoff_times(native_events)
        handoff_p50 = c.median(handoffs)
        c.say(f"handoff to a waiting process: p50 {handoff_p50:.1f} us, p99 {c.percentile(handoffs, 99):.1f} us over {len(handoffs)} handoffs")
        c.say(
            f"the same turns through the native calls from Python: without events (lease_acquire / lease_release_recorded) "
            f"p50 {c.median(bare):.1f} us, p99 {c.percentile(bare, 99):.1f} us; with them (lease_acquire_ordered / "
            f"lease_release_ordered, {native_waits} waits in {len(native)} handoffs) p50 {c.median(native):.1f} us, "
            f"p99 {c.percentile(native, 99):.1f} us"
        )
        release_p50 = {"full": release_calls(events), "bare": release_calls(bare_events), "native": release_calls(native_events)}
        c.say(
            f"the release call alone, inside those handoffs: p50 {release_p50['full']:.1f} us (Lease.release), "
            f"{release_p50['bare']:.1f} us (lease_release_recorded), {release_p50['native']:.1f} us (lease_release_ordered, "
            "the event record inside)"
        )
        after_take = {
            "full": after_takes(events), "bare": after_takes(bare_events), "native": after_takes(native_events),
            "memops": after_takes(memops["events"]),
        }
        c.say(
            f"from the native take's compare-and-swap to the taker's next Python line: p50 {after_take['full']:.1f} us "
            f"(Lease, IPC events), {after_take['memops']:.1f} us (Lease, memops), {after_take['bare']:.1f} us (lease_acquire), "
            f"{after_take['native']:.1f} us (lease_acquire_ordered, the event wait inside)"
        )
        # What waiting costs the clients: their CPU time over the Lease turns (each turn a
        # take, the 1 ms hold, the release and the pause), both clients, per handoff. A
        # waiter that watches the word instead of sleeping spends it here.
        cpu_per_handoff = {"full": ipc["cpu_ns"] / max(1, len(handoffs)) / 1e3, "memops": memops["cpu_ns"] / max(1, len(memops_handoffs)) / 1e3}
        c.say(
            f"the clients' CPU time per handoff (both clients, the Lease turns): {cpu_per_handoff['full']:.1f} us (IPC events), "
            f"{cpu_per_handoff['memops']:.1f} us (memops)"
        )
        if stream_waits:
            c.say(f"one cuStreamWaitEvent on the other process's event, alone: p50 {c.median(stream_waits) / 1e3:.2f} us")
        floor_p50, floor_p99, floor_n = futex_floor()
        handoff_ratio = c.ratio(handoff_p50, floor_p50)
        memops_ratio = c.ratio(memops_p50, floor_p50)
        c.say(
            f"C futex handoff (bench/futex_floor.c, same 1 ms hold): p50 {floor_p50:.1f} us, p99 {floor_p99:.1f} us over "
            f"{floor_n}: the lease handoff is {handoff_ratio:.2f}x its p50 with IPC events, {memops_ratio:.2f}x with memops"
        )
        paused_p50, paused_p99, _ = futex_floor(round(PAUSE_S * 1e6))
        paused_ratio = c.ratio(handoff_p50, paused_p50)
        c.say(
            f"the same C turns with the clients' {PAUSE_S * 1e6:.0f} us pause after each release: p50 {paused_p50:.1f} us, "
            f"p99 {paused_p99:.1f} us: the lease handoff is {paused_ratio:.2f}x its p50"
        )
        c.say(
            f"the clients waited on the releaser's IPC event {handoff_waits} times "
            f"({'at every handoff' if handoff_waits >= len(handoffs) else 'FEWER than the handoffs: the event path did not run'})"
        )
        result.figures = {
            "uncontended_p50_us": lease_p50,
            "uncontended_p99_us": c.percentile(samples, 99) / 1e3,
            "uncontended_shared_p50_us": shared_p50,
            "uncontended_shared_p99_us": c.percentile(shared_samples, 99) / 1e3,
            "control_rtt_p50_us": ping_p50,
            "speedup_vs_rtt": c.ratio(ping_p50, lease_p50),
            "handoff_p50_us": handoff_p50,
            "handoff_p99_us": c.percentile(handoffs, 99),
            "bare_native_handoff_p50_us": c.median(bare),
            "bare_native_handoff_p99_us": c.percentile(bare, 99),
            "native_events_handoff_p50_us": c.median(native),
            "native_events_handoff_p99_us": c.percentile(native, 99),
            "native_handoff_waits": native_waits,
            "release_call_p50_us": release_p50["full"],
            "bare_release_call_p50_us": release_p50["bare"],
            "native_release_call_p50_us": release_p50["native"],
            "native_uncontended_p50_us": native_p50,
            "native_uncontended_shared_p50_us": native_shared_p50,
            "futex_floor_p50_us": floor_p50,
            "futex_floor_p99_us": floor_p99,
            "handoff_ratio_p50": handoff_ratio,
            "futex_floor_paused_p50_us": paused_p50,
            "futex_floor_paused_p99_us": paused_p99,
            "handoff_ratio_paused_p50": paused_ratio,
            "handoffs": len(handoffs),
            "handoff_waits": handoff_waits,
            "memops_handoff_p50_us": memops_p50,
            "memops_handoff_p99_us": c.percentile(memops_handoffs, 99),
            "memops_handoff_ratio_p50": memops_ratio,
            "memops_handoffs": len(memops_handoffs),
            "memops_handoff_waits": memops["handoff_waits"],
            "memops_release_call_p50_us": release_calls(memops["events"]),
            "after_take_p50_us": after_take["full"],
            "memops_after_take_p50_us": after_take["memops"],
            "bare_after_take_p50_us": after_take["bare"],
            "native_after_take_p50_us": after_take["native"],
            "client_cpu_per_handoff_us": cpu_per_handoff["full"],
            "memops_client_cpu_per_handoff_us": cpu_per_handoff["memops"],
        }
        if stream_waits:
            result.figures["stream_wait_p50_us"] = c.median(stream_waits) / 1e3
        result.ok = (
            lease_p50 <= 2.0
            and result.figures["speedup_vs_rtt"] >= 40.0
            and handoff_ratio <= HANDOFF_RATIO_MAX
            and len(handoffs) > 0
            and handoff_waits >= len(handoffs)
            and memops_ratio <= HANDOFF_RATIO_MAX
            and len(memops_handoffs) > 0
            and memops["handoff_waits"] >= len(memops_handoffs)
        )

    return c.run(BENCH, args.backend, body)


if __name__ == "__main__":
    raise SystemExit(main())
