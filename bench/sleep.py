#!/usr/bin/env python3
"""Sleep and wake of an arena through gpumemd, against a pinned copy and torch_memory_saver.

For each size S, in one run and process:
- gpumemd: an arena of S committed and filled with random contents (a random 64 MiB
  block repeated, every MiB stamped with its offset, so a MiB in the wrong place fails;
  written and read back through two page-locked staging buffers in 1 GiB copies,
  compared with memcmp); ``ArenaSleep.sleep(keep=True)`` (the copy to the daemon's host
  buffer, then every chunk handed back) and ``wake()`` (the chunks committed again at
  the same offsets, zeroed, mapped, the copy back), timed each; the contents checked
  whole after every wake. The first cycle (which maps and registers the host buffer:
  its pages are faulted in there) is reported apart, the rest are the figures; then
  the buffer is freed, made again ahead (``ArenaSleep.prepare``, timed) and one more
  cycle run: the first sleep of an engine that prepared.
- pinned copy: one ``cuMemcpyDtoH`` and one ``cuMemcpyHtoD`` of S between device memory
  and page-locked host memory (cuMemHostAlloc); on the host backend one memmove each way
  between two pre-faulted mappings. The bandwidth any offload is held to.
- torch_memory_saver (CUDA, optional: ``pip install torch_memory_saver``): a tensor of S
  in a region with CPU backup, ``pause`` and ``resume`` timed (torch hook mode). Skipped,
  and the JSON says why, where it is not installed or fails.
Then: waking D bytes whose contents were dropped (commit, zeroing for tenant isolation
and mapping included; D = 100 GiB on CUDA), split into the daemon's answer (ARENA_WAKE
until its reply and fds are in) and the client's import + map (``arena.apply``), beside
a plain commit of the same D into a fresh arena, both right after D was handed back and
both again after a pause (``--settle-s``: the freed memory settled in the driver, as it
has when a sleeper wakes after others used its memory; the target's figure, see
``dropped_wake``); each ``--repeats`` times, medians. On CUDA with torch, a graph
captured before a sleep of its memory (weights and graph pool kept) replayed after the
wake, checked bit for bit against its output before, with no recapture; then the engine
``--engine`` names (nano-vllm or transformers' continuous batching, each through its kit:
bench/sleep_engines.py) on the daemon, put to sleep between two passes of one batch and
woken: its sleep and wake times, the bytes it freed, and its tokens after the wake
against before. Each line says the seconds since the start.

    python bench/sleep.py --backend host                # 64 MiB, 256 MiB, 1 GiB; drop 2 GiB
    python bench/sleep.py --backend cuda [--engine transformers]  # 1, 8, 32 GiB; drop 100 GiB (each fitted to the GPU)

Last line: {"bench": "sleep", "engine", "backend", "figures", "targets", "ok"} (on the host
no engine runs: its engine says so); ok means the contents
came back identical after every wake and, on CUDA, at every size sleep and wake each
>= 0.8x the pinned copy's bandwidth that way, the settled dropped wake's median <= 100 ms, the graph's outputs
bit-identical and the engine's tokens after its wake identical. The bandwidth targets are CUDA's: on the host backend the "device" is
host memory that a chunk handed back gives to the kernel, so a wake's copy pays the page
faults of fresh pages, which the baseline's pre-faulted mappings do not.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import _common as c
import sleep_engines

BENCH = "sleep"
MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SIZES = {"cuda": "1GiB,8GiB,32GiB", "host": "64MiB,256MiB,1GiB"}
DEFAULT_DROP = {"cuda": "100GiB", "host": "2GiB"}
PIECE = 64 * MiB  # the random block's size
STAMP = MiB  # every MiB of the contents starts with its offset
STAGE = GiB  # the staging buffers' size, a multiple of PIECE
# The daemon's sleep host limit at least, on CUDA: an engine keeps its weights, graph pool and
# batch tensors in host memory while it sleeps, and one uid gets half the limit (the
# daemon's own default is half the machine's memory, 64 GiB on the GPU machine).
ENGINE_HOST = 64 * GiB


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = c.ArgumentParser(BENCH, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host", help="daemon backend (default: host)")
    ap.add_argument("--device", type=int, default=0, help="device index the daemon serves (default: 0)")
    ap.add_argument("--engine", choices=sorted(sleep_engines.CYCLES), default="nanovllm",
                    help="the engine put to sleep and woken on CUDA (default: nanovllm)")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes (default: 1GiB,8GiB,32GiB on cuda, 64MiB,256MiB,1GiB on host)")
    ap.add_argument("--drop-size", default=None, help="the dropped wake's size (default: 100GiB on cuda, 2GiB on host; 0 skips it)")
    ap.add_argument("--settle-s", type=float, default=3.0,
                    help="pause before one more commit of the dropped wake's bytes, once the driver reclaimed what was released "
                    "(default: 3; 0 skips it)")
    ap.add_argument("--repeats", type=int, default=3, help="timed cycles per size after the first (default: 3)")
    ap.add_argument("--target-ratio", type=float, default=0.8, help="ok when sleep and wake >= this x the pinned copy (default: 0.8)")
    ap.add_argument("--target-drop-ms", type=float, default=100.0, help="ok when the dropped wake takes <= this on cuda (default: 100)")
    ap.add_argument("--no-tms", action="store_true", help="skip torch_memory_saver even where installed")
    ap.add_argument("--start-timeout", type=float, default=120.0, help="seconds the daemon gets to start")
    ap.add_argument("--call-timeout", type=float, default=300.0, help="seconds one gpumem call may take")
    args = ap.parse_args(argv)
    from gpumem_shared.units import parse_size

    try:
        args.size_list = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else sorted(  # fitted: 0.4 of the free memory
            {c.fit(parse_size(s), args.backend, 0.4, "a size", args.device) for s in DEFAULT_SIZES[args.backend].split(",")})
        args.drop = parse_size(args.drop_size) if args.drop_size else c.fit(
            parse_size(DEFAULT_DROP[args.backend]), args.backend, 0.75, "the drop", args.device)
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1 or not args.size_list or min(args.size_list) <= 0 or args.drop < 0:
        ap.error("--repeats must be >= 1 and the sizes positive")
    return args


# ---------------------------------------------------------------------------
# Contents: random, checked whole
# ---------------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class Contents:
    """An arena's contents: a random block of PIECE bytes repeated, the first 8 bytes of
    every MiB its offset in the arena (little-endian), so that any MiB copied to the
    wrong place does not pass.

    Written and checked through two staging buffers of STAGE bytes, registered once with
    the session's driver (page-locked on CUDA, so every copy runs at pinned bandwidth):
    ``expected`` holds the contents of one stage of the arena (the block repeated, the
    stage's stamps written before each use) and is the source of ``fill``; ``check``
    copies each stage of the arena back into ``came`` and compares the two with memcmp
    in a few threads. A stage starts at a multiple of STAGE, itself a multiple of PIECE,
    so the block repeats at the same places in the arena and in the buffer."""

    def __init__(self, driver: Any, size_max: int) -> None:
        self.driver = driver
        self.stage = min(STAGE, -(-size_max // PIECE) * PIECE)
        self._maps: list[mmap.mmap] = []
        self._anchors: list[ctypes.c_char] = []
        self._registered: list[int] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1))
        try:
            self.expected, self.came = self._buffer(), self._buffer()
            block = os.urandom(PIECE)
            for at in range(0, self.stage, PIECE):
                ctypes.memmove(self.expected + at, block, PIECE)
            for address in (self.expected, self.came):
                driver.host_register(address, self.stage)
                self._registered.append(address)
        except BaseException:
            self.close()
            raise

    def _buffer(self) -> int:
        m = mmap.mmap(-1, self.stage)
        with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages, only slower to fault in
            m.madvise(mmap.MADV_HUGEPAGE)
        self._maps.append(m)
        self._anchors.append(ctypes.c_char.from_buffer(m))
        return ctypes.addressof(self._anchors[-1])

    def _stamp(self, at: int, n: int) -> None:
        """``expected`` as the arena's bytes [at, at + n)."""
        for offset in range(0, n - 7, STAMP):
            struct.pack_into("<Q", self._maps[0], offset, at + offset)

    def fill(self, address: int, size: int) -> None:
        for at in range(0, size, self.stage):
            n = min(self.stage, size - at)
            self._stamp(at, n)
            self.driver.copy_to_device([(address + at, self.expected, n)])

    def check(self, address: int, size: int) -> int | None:
        """None when the ``size`` bytes at ``address`` are the contents, else the offset of
        the first MiB that differs."""
        for at in range(0, size, self.stage):
            n = min(self.stage, size - at)
            self._stamp(at, n)
            self.driver.copy_to_host([(address + at, self.came, n)])
            slices = [(offset, min(PIECE, n - offset)) for offset in range(0, n, PIECE)]
            if any(self._pool.map(lambda s: self._differ(*s), slices)):
                return at + next(o for o in range(0, n, STAMP) if self._differ(o, min(STAMP, n - o)))
        return None

    def _differ(self, offset: int, n: int) -> bool:
        return bool(_libc.memcmp(self.came + offset, self.expected + offset, n))

    def close(self) -> None:
        self._pool.shutdown()
        for address in self._registered:
            self.driver.host_unregister(address)
        self._registered.clear()
        self._anchors.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()


# ---------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------


class PinnedCopy:
    """One plain copy each way of ``size`` bytes between device memory and page-locked
    host memory (CUDA), or between two pre-faulted mappings (host)."""

    def __init__(self, backend: str, ordinal: int, size: int) -> None:
        self.backend, self.size = backend, size
        if backend == "cuda":
            from cuda.bindings import driver as cu

            self.cu = cu
            self._ck(cu.cuInit(0), "cuInit")
            dev = self._ck(cu.cuDeviceGet(ordinal), "cuDeviceGet")
            self._ck(cu.cuCtxSetCurrent(self._ck(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")), "cuCtxSetCurrent")
            self.device = int(self._ck(cu.cuMemAlloc(size), "cuMemAlloc"))
            self.host = int(self._ck(cu.cuMemHostAlloc(size, 0), "cuMemHostAlloc"))
            # The host side needs no first touch: page-locked memory is resident from its allocation.
            self._ck(cu.cuMemsetD8(self.device, 0x5A, size), "cuMemsetD8")
        else:
            self._maps = [mmap.mmap(-1, size) for _ in range(2)]
            for m in self._maps:
                m.write(b"\x5a" * min(size, PIECE))  # the first piece; the rest is faulted in below
                for at in range(0, size, mmap.PAGESIZE):
                    m[at] = 1
            self._anchors = [ctypes.c_char.from_buffer(m) for m in self._maps]
            self.device, self.host = (ctypes.addressof(a) for a in self._anchors)

    def _ck(self, result: Any, what: str) -> Any:
        if result[0] != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {result[0]}")
        return result[1] if len(result) == 2 else None

    def to_host(self) -> float:
        t0 = time.perf_counter()
        if self.backend == "cuda":
            self._ck(self.cu.cuMemcpyDtoH(self.host, self.device, self.size), "cuMemcpyDtoH")
        else:
            ctypes.memmove(self.host, self.device, self.size)
        return time.perf_counter() - t0

    def to_device(self) -> float:
        t0 = time.perf_counter()
        if self.backend == "cuda":
            self._ck(self.cu.cuMemcpyHtoD(self.device, self.host, self.size), "cuMemcpyHtoD")
        else:
            ctypes.memmove(self.device, self.host, self.size)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.backend == "cuda":
            self._ck(self.cu.cuMemFree(self.device), "cuMemFree")
            self._ck(self.cu.cuMemFreeHost(self.host), "cuMemFreeHost")
        else:
            del self._anchors
            for m in self._maps:
                m.close()


def torch_memory_saver_cycle(size: int, repeats: int) -> tuple[list[float], list[float]] | str:
    """(pause seconds, resume seconds) of a tensor of ``size`` with CPU backup, or why not."""
    try:
        import torch
        from torch_memory_saver import torch_memory_saver as tms
    except ImportError as exc:
        return f"not installed ({exc.name} missing): pip install torch_memory_saver"
    try:
        if hasattr(tms, "hook_mode"):
            tms.hook_mode = "torch"
        with tms.region(tag="bench", enable_cpu_backup=True):
            t = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
        checksum = int(t[:: max(1, size // 4096)].sum())
        pauses, resumes = [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tms.pause("bench")
            torch.cuda.synchronize()
            pauses.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tms.resume("bench")
            torch.cuda.synchronize()
            resumes.append(time.perf_counter() - t0)
        if int(t[:: max(1, size // 4096)].sum()) != checksum:
            return "its contents did not come back (checksum differs)"
        del t
        torch.cuda.empty_cache()
        return pauses, resumes
    except Exception as exc:  # an optional column: its failure is reported, not fatal
        return f"failed: {type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------
# The dropped wake, part by part, beside a plain commit
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def timed_parts(arena: Any, driver_calls: tuple[str, ...] = ("map_fds",)) -> Iterator[dict[str, float]]:
    """Seconds spent, while inside, in the calls an operation on ``arena`` makes, by part:
    the daemon's answers (``channel.call``, from the request out until its reply and fds
    are in; by the request's type, e.g. "WakeArena"), the client's ``arena.apply`` and the
    session driver's ``driver_calls`` (by name: map_fds is the import + map inside apply).
    Wrapped on the instances, as bench/commit.py times map_fds, and put back on the way
    out."""
    spent: dict[str, float] = {}
    wrapped: list[tuple[Any, str]] = []

    def wrap(obj: Any, name: str, label: Callable[[tuple[Any, ...], dict[str, Any]], str] | None = None) -> None:
        real = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                part = label(args, kwargs) if label else name
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)
        wrapped.append((obj, name))

    try:
        wrap(arena.core.channel, "call", lambda args, kwargs: type(args[0] if args else kwargs.get("message")).__name__)
        wrap(arena, "apply")
        for name in driver_calls:
            wrap(arena.core.driver, name)
        yield spent
    finally:
        for obj, name in wrapped:
            delattr(obj, name)  # the class's method again


def parts_ms(spent: dict[str, float], request: str, total_s: float) -> dict[str, float]:
    answer, apply = spent.get(request, 0.0), spent.get("apply", 0.0)
    return {"ms": total_s * 1e3, "answer_ms": answer * 1e3, "apply_ms": apply * 1e3,
            "import_map_ms": spent.get("map_fds", 0.0) * 1e3, "rest_ms": (total_s - answer - apply) * 1e3}


def dropped_wake(session: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of: arena A committed and put to sleep with its contents dropped (its
    ``drop`` bytes handed back), woken at once (timed, part by part), decommitted (the
    same bytes handed back), then a plain commit of the same bytes into a second arena B
    (timed, part by part), decommitted: each timed call meets the driver right after it
    took back ``drop`` bytes. Then the same two after ``--settle-s`` (the target's
    figures): A put to sleep again, the pause, the wake; B's commit after a pause.

    Why both: on the H200 the driver's own cuMemCreate of 100 GiB takes 120-140 ms right
    after 100 GiB were released and 30-37 ms three seconds later (whatever the chunk size,
    512 MiB or 2 GiB, and from four threads alike: the probe in docs/performance.md);
    a wake right after its own sleep measures that, not gpumemd. A sleeper wakes after
    others had its memory (an RL step's training), so the settled wake is the target."""
    import gpumem

    drop = args.drop
    a = session.create_arena("sleep-drop", drop)
    b = session.create_arena("sleep-drop-commit", drop)
    sleeper = gpumem.ArenaSleep(a)
    runs: dict[str, list[dict[str, float]]] = {"wake": [], "commit": [], "wake_settled": [], "commit_settled": []}
    chunks = 0

    def wake(kind: str) -> None:
        with timed_parts(a) as spent:
            t0 = time.perf_counter()
            sleeper.wake()
            runs[kind].append(parts_ms(spent, "WakeArena", time.perf_counter() - t0))
        a.decommit(0)

    def commit(kind: str) -> None:
        with timed_parts(b) as spent:
            t0 = time.perf_counter()
            b.commit(drop)
            runs[kind].append(parts_ms(spent, "CommitArena", time.perf_counter() - t0))
        nonlocal chunks
        chunks = next((x.chunks for x in session.status().arenas if x.name == b.name), 0)
        b.decommit(0)

    for settle in (0.0, args.settle_s) if args.settle_s > 0 else (0.0,):
        suffix = "_settled" if settle else ""
        for _ in range(args.repeats):
            a.commit(drop)
            sleeper.sleep(keep=False)
            time.sleep(settle)
            wake("wake" + suffix)
            time.sleep(settle)
            commit("commit" + suffix)
    a.release()
    b.release()

    out: dict[str, Any] = {"drop_wake_bytes": drop, "drop_chunks": chunks, "settle_s": args.settle_s}
    for kind, measured in runs.items():
        if not measured:
            continue
        median = {k: c.median([m[k] for m in measured]) for k in measured[0]}
        out[f"drop_{kind}_ms"] = median["ms"]
        out[f"drop_{kind}_ms_runs"] = [m["ms"] for m in measured]
        out |= {f"drop_{kind}_{k}": v for k, v in median.items() if k != "ms"}
    out["drop_wake_vs_commit"] = c.ratio(out["drop_wake_ms"], out["drop_commit_ms"])
    if "drop_wake_settled_ms" in out:
        out["drop_wake_settled_vs_commit"] = c.ratio(out["drop_wake_settled_ms"], out["drop_commit_settled_ms"])
    return out


def say_dropped(say: Callable[[str], None], fig: dict[str, Any]) -> None:
    from gpumem_shared.units import format_size

    size = format_size(fig["drop_wake_bytes"])

    def split(kind: str) -> str:
        return (f"{fig[f'drop_{kind}_ms']:.1f} ms (runs {', '.join(f'{ms:.1f}' for ms in fig[f'drop_{kind}_ms_runs'])}) = the "
                f"daemon's answer {fig[f'drop_{kind}_answer_ms']:.1f} + the client's apply {fig[f'drop_{kind}_apply_ms']:.1f} "
                f"(import + map {fig[f'drop_{kind}_import_map_ms']:.1f}) + the rest {fig[f'drop_{kind}_rest_ms']:.1f}")

    say(f"wake of {size} whose contents were dropped ({fig['drop_chunks']} chunks), right after its sleep handed them back: {split('wake')}; "
        f"a plain commit of {size} right after handing {size} back: {split('commit')}")
    if "drop_wake_settled_ms" in fig:
        say(f"the same after a {fig['settle_s']:g} s pause (the target): wake {split('wake_settled')}; "
            f"plain commit {split('commit_settled')}; wake / commit {fig['drop_wake_settled_vs_commit']:.2f}")


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


class Cycle(NamedTuple):
    sleep_s: float
    wake_s: float
    check_s: float
    intact: bool
    sleep_parts: dict[str, float]  # seconds: the host buffer's answer, its registration, the copy, the hand-back, the rest


def cycle(sleeper: Any, size: int, contents: Contents, say: Callable[[str], None]) -> Cycle:
    """One sleep and wake of the arena of ``size`` with its contents kept, timed each (the
    sleep part by part); then the contents checked whole."""
    from gpumem_shared.units import format_size

    arena = sleeper.arena
    with timed_parts(arena, ("host_register", "copy_to_host")) as spent:
        t0 = time.perf_counter()
        sleeper.sleep(keep=True)
        t1 = time.perf_counter()
    parts = {"buffer": spent.get("SleepBuffer", 0.0), "register": spent.get("host_register", 0.0),
             "copy": spent.get("copy_to_host", 0.0), "hand_back": spent.get("SleepArena", 0.0) + spent.get("apply", 0.0)}
    parts["rest"] = t1 - t0 - sum(parts.values())
    sleeper.wake()
    t2 = time.perf_counter()
    where = contents.check(arena.address, size)
    if where is not None:
        say(f"MISMATCH after a wake: the MiB at offset {where} of arena '{arena.name}' ({format_size(size)}) differs")
    return Cycle(t1 - t0, t2 - t1, time.perf_counter() - t2, where is None, parts)


def body(args: argparse.Namespace, result: c.Result, cleanup: contextlib.ExitStack) -> None:
    from gpumem_shared.units import format_size

    started = time.monotonic()

    def say(line: str) -> None:
        c.say(f"[{time.monotonic() - started:6.1f} s] {line}")

    result.targets = {"contents_identical": True}
    if args.backend == "cuda":
        result.targets |= {"ratio_vs_pinned_min": args.target_ratio, "drop_wake_ms_max": args.target_drop_ms, "graph_identical": True,
                           "engine_tokens_identical": True}
    rdir = cleanup.enter_context(c.runtime_dir("gmb-sleep-"))
    top = max(args.size_list)
    say(f"{BENCH}: backend={args.backend} sizes={[format_size(s) for s in args.size_list]} drop={format_size(args.drop)} "
        f"repeats={args.repeats} runtime dir {rdir}")
    # On CUDA the engine keeps its weights and graphs in host memory while it sleeps too.
    daemon_args = ["--sleep-host-limit", str(max(2 * top, ENGINE_HOST if args.backend == "cuda" else 0))]
    if args.backend == "host":
        daemon_args += ["--host-capacity", str(max(8 * GiB, 2 * top, args.drop + GiB))]
    daemon = c.Daemon(rdir, args.backend, args.device, daemon_args)
    cleanup.callback(daemon.stop)
    daemon.wait_ready(args.start_timeout)

    import gpumem

    session = gpumem.connect(args.device, name="bench-sleep", runtime_dir=rdir, timeout=args.call_timeout)
    cleanup.callback(session.close)
    ordinal = session.device_ordinal or 0
    contents = Contents(session.driver, top)
    cleanup.callback(contents.close)
    figures: dict[str, Any] = {"sizes": {}}
    ok = True
    for size in args.size_list:
        arena = session.create_arena(f"sleep-{size}", size)
        arena.commit(size)
        t0 = time.perf_counter()
        contents.fill(arena.address, size)
        fill_s = time.perf_counter() - t0
        sleeper = gpumem.ArenaSleep(arena)
        first, *timed = [cycle(sleeper, size, contents, say) for _ in range(1 + args.repeats)]
        first_sleep, first_wake = first.sleep_s, first.wake_s
        sleeps, wakes = [x.sleep_s for x in timed], [x.wake_s for x in timed]
        sleeper.free_host()
        # The first sleep again, its host buffer made ahead (ArenaSleep.prepare): what an
        # engine that prepares once it is built pays at its first sleep.
        t0 = time.perf_counter()
        sleeper.prepare()
        prepare_s = time.perf_counter() - t0
        prepared = cycle(sleeper, size, contents, say)
        check_s = sum(x.check_s for x in (first, *timed, prepared))
        intact = all(x.intact for x in (first, *timed, prepared))
        sleeper.free_host()
        arena.release()

        pinned = PinnedCopy(args.backend, ordinal, size)
        try:
            outs = [pinned.to_host() for _ in range(args.repeats)]
            ins = [pinned.to_device() for _ in range(args.repeats)]
        finally:
            pinned.close()
        gib = size / GiB
        row: dict[str, Any] = {
            "gpumemd_sleep_gib_s": gib / c.median(sleeps), "gpumemd_wake_gib_s": gib / c.median(wakes),
            "gpumemd_first_sleep_s": first_sleep, "gpumemd_first_wake_s": first_wake,
            **{f"gpumemd_first_sleep_{k}_s": v for k, v in first.sleep_parts.items()},
            "gpumemd_prepare_s": prepare_s, "gpumemd_prepared_first_sleep_s": prepared.sleep_s,
            "pinned_to_host_gib_s": gib / c.median(outs), "pinned_to_device_gib_s": gib / c.median(ins),
            "contents_identical": intact, "contents_checked": 2 + args.repeats, "fill_s": fill_s, "check_s": check_s,
        }
        row["sleep_ratio"] = row["gpumemd_sleep_gib_s"] / row["pinned_to_host_gib_s"]
        row["wake_ratio"] = row["gpumemd_wake_gib_s"] / row["pinned_to_device_gib_s"]
        if args.backend == "cuda" and not args.no_tms:
            tms = torch_memory_saver_cycle(size, args.repeats)
            if isinstance(tms, str):
                row["torch_memory_saver"] = f"skipped: {tms}"
            else:
                row["tms_pause_gib_s"], row["tms_resume_gib_s"] = gib / c.median(tms[0]), gib / c.median(tms[1])
        else:
            row["torch_memory_saver"] = "skipped: " + ("--no-tms" if args.no_tms else "CUDA only")
        figures["sizes"][format_size(size)] = row
        ok &= intact
        if args.backend == "cuda":
            ok &= row["sleep_ratio"] >= args.target_ratio and row["wake_ratio"] >= args.target_ratio
        tms_text = (f"tms pause {row['tms_pause_gib_s']:.1f} resume {row['tms_resume_gib_s']:.1f} GiB/s"
                    if "tms_pause_gib_s" in row else f"tms {row['torch_memory_saver']}")
        say(f"{format_size(size):>9}: sleep {row['gpumemd_sleep_gib_s']:.1f} GiB/s ({row['sleep_ratio']:.2f}x pinned "
            f"{row['pinned_to_host_gib_s']:.1f}), wake {row['gpumemd_wake_gib_s']:.1f} GiB/s ({row['wake_ratio']:.2f}x pinned "
            f"{row['pinned_to_device_gib_s']:.1f}); first cycle {first_sleep:.3f} s (host buffer: the daemon's answer "
            f"{first.sleep_parts['buffer']:.3f} s, registration {first.sleep_parts['register']:.3f} s; copy "
            f"{first.sleep_parts['copy']:.3f} s; hand-back {first.sleep_parts['hand_back']:.3f} s) / {first_wake:.3f} s; prepared "
            f"ahead in {prepare_s:.3f} s, a first sleep takes {prepared.sleep_s:.3f} s; contents "
            f"{'identical after each' if intact else 'DIFFER after some'} of {2 + args.repeats} wakes (filled in {fill_s:.2f} s, "
            f"checked in {check_s:.2f} s); {tms_text}")

    if args.drop:
        fig = dropped_wake(session, args)
        figures |= fig
        if args.backend == "cuda":
            ok &= fig.get("drop_wake_settled_ms", fig["drop_wake_ms"]) <= args.target_drop_ms
        say_dropped(say, fig)

    if args.backend == "cuda":
        try:
            import torch  # noqa: F401
        except ImportError:
            figures["graph"] = "skipped: torch is not installed"
        else:
            graph = sleep_engines.graph_replays_after_wake(rdir, args.device, args.call_timeout)
            figures["graph"] = graph
            ok &= graph["identical"]
            say(f"captured graph after sleep ({graph['sleep_s']:.3f} s) and wake ({graph['wake_s']:.3f} s): outputs "
                f"{'bit-identical' if graph['identical'] else 'DIFFER'}, no recapture")
        engine = sleep_engines.CYCLES[args.engine](rdir)  # its own process, its own torch
        figures |= engine
        ok &= engine["engine_tokens_identical"]
        say(f"{args.engine}: slept in {engine['engine_sleep_s']:.3f} s freeing {engine['engine_freed_bytes'] / GiB:.1f} GiB, woke in "
            f"{engine['engine_wake_s']:.3f} s; its tokens after the wake {'identical' if engine['engine_tokens_identical'] else 'DIFFER'}")
    else:
        figures["graph"] = "skipped: needs CUDA and torch"
        figures["engine"] = "skipped: the engines need CUDA"
    figures["elapsed_s"] = time.monotonic() - started
    result.figures = figures
    result.ok = bool(ok)


def main(argv: list[str] | None = None) -> int:
    c.ensure_importable()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    engine = "none (host: arenas only)" if args.backend == "host" else args.engine  # as bench/engine.py's line says on the host
    return c.run(BENCH, args.backend, lambda result, cleanup: body(args, result, cleanup), labels={"engine": engine})


if __name__ == "__main__":
    sys.exit(main())
