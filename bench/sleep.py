#!/usr/bin/env python3
"""Sleep and wake of an arena through gpumemd, against a pinned copy and torch_memory_saver.

For each size S (random contents), in one run and process:
- gpumemd: an arena of S committed and filled; ``ArenaSleep.sleep(keep=True)`` (the
  copy to the daemon's host buffer, then every chunk handed back) and ``wake()`` (the
  chunks committed again at the same offsets, zeroed, mapped, the copy back), timed
  each; the first cycle (which maps and registers the host buffer) is reported apart,
  the rest are the figures. The contents are checked after the last wake, whole.
- pinned copy: one ``cuMemcpyDtoH`` and one ``cuMemcpyHtoD`` of S between device memory
  and page-locked host memory (cuMemHostAlloc); on the host backend one memmove each way
  between two pre-faulted mappings. The bandwidth any offload is held to.
- torch_memory_saver (CUDA, optional: ``pip install torch_memory_saver``): a tensor of S
  in a region with CPU backup, ``pause`` and ``resume`` timed (torch hook mode). Skipped,
  and the JSON says why, where it is not installed or fails.
Then: waking D bytes whose contents were dropped (commit, zeroing for tenant isolation
and mapping included; D = 100 GiB on CUDA), and on CUDA with torch a graph captured
before a sleep of its memory (weights and graph pool kept) replayed after the wake,
checked bit for bit against its output before, with no recapture.

    python bench/sleep.py --backend host                # 64 MiB, 256 MiB, 1 GiB; drop 2 GiB
    python bench/sleep.py --backend cuda                # 1, 8, 32 GiB; drop 100 GiB

Last line: {"bench": "sleep", "backend", "figures", "targets", "ok"}; ok means the contents
came back identical and, on CUDA, at every size sleep and wake each >= 0.8x the pinned
copy's bandwidth that way, the dropped wake <= 100 ms and the graph's outputs
bit-identical. The bandwidth targets are CUDA's: on the host backend the "device" is
host memory that a chunk handed back gives to the kernel, so a wake's copy pays the page
faults of fresh pages, which the baseline's pre-faulted mappings do not.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import sys
import time
from typing import Any

import _common as c

BENCH = "sleep"
MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SIZES = {"cuda": "1GiB,8GiB,32GiB", "host": "64MiB,256MiB,1GiB"}
DEFAULT_DROP = {"cuda": "100GiB", "host": "2GiB"}
PIECE = 64 * MiB


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = c.ArgumentParser(BENCH, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host", help="daemon backend (default: host)")
    ap.add_argument("--device", type=int, default=0, help="device index the daemon serves (default: 0)")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes (default: 1GiB,8GiB,32GiB on cuda, 64MiB,256MiB,1GiB on host)")
    ap.add_argument("--drop-size", default=None, help="the dropped wake's size (default: 100GiB on cuda, 2GiB on host; 0 skips it)")
    ap.add_argument("--repeats", type=int, default=3, help="timed cycles per size after the first (default: 3)")
    ap.add_argument("--target-ratio", type=float, default=0.8, help="ok when sleep and wake >= this x the pinned copy (default: 0.8)")
    ap.add_argument("--target-drop-ms", type=float, default=100.0, help="ok when the dropped wake takes <= this on cuda (default: 100)")
    ap.add_argument("--no-tms", action="store_true", help="skip torch_memory_saver even where installed")
    ap.add_argument("--start-timeout", type=float, default=120.0, help="seconds the daemon gets to start")
    ap.add_argument("--call-timeout", type=float, default=300.0, help="seconds one gpumem call may take")
    args = ap.parse_args(argv)
    from gpumem_shared.units import parse_size

    try:
        args.size_list = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES[args.backend]).split(",")]
        args.drop = parse_size(args.drop_size or DEFAULT_DROP[args.backend])
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1 or not args.size_list or min(args.size_list) <= 0 or args.drop < 0:
        ap.error("--repeats must be >= 1 and the sizes positive")
    return args


# ---------------------------------------------------------------------------
# Contents: random, checked whole
# ---------------------------------------------------------------------------


def piece_bytes(block: bytes, index: int) -> bytes:
    """The contents of piece ``index``: the random block, its first 8 bytes the index, so
    that a piece copied to the wrong place does not pass."""
    return index.to_bytes(8, "little") + block[8:]


def fill(driver: Any, address: int, size: int, block: bytes) -> None:
    for i, at in enumerate(range(0, size, PIECE)):
        driver.write(address + at, piece_bytes(block, i)[: min(PIECE, size - at)])


def same(driver: Any, address: int, size: int, block: bytes) -> bool:
    for i, at in enumerate(range(0, size, PIECE)):
        n = min(PIECE, size - at)
        if driver.read(address + at, n) != piece_bytes(block, i)[:n]:
            c.say(f"MISMATCH in the piece at offset {at}")
            return False
    return True


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
            self._ck(cu.cuMemsetD8(self.device, 0x5A, size), "cuMemsetD8")
            ctypes.memset(self.host, 0xA5, size)
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
# The captured graph
# ---------------------------------------------------------------------------


def graph_replays_after_wake(rdir: Any, device: int, timeout: float) -> dict[str, Any]:
    """A graph captured into gpumem arenas, its output kept; weights and graph pool slept
    and woken; replayed without a recapture; the outputs compared bit for bit."""
    import torch

    import gpumem

    with gpumem.EngineMemory("bench-sleep-graph", device, runtime_dir=str(rdir), timeout=timeout) as mem:
        with mem.running():
            torch.manual_seed(0)
            w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    (x @ w).relu() @ w.t()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = ((x @ w).relu() @ w.t()).softmax(-1)
            g.replay()
            torch.cuda.synchronize()
            before = y.clone()
        held = mem.model.committed + mem.graphs.committed
        t0 = time.perf_counter()
        mem.sleep("weights", "graphs")
        slept = time.perf_counter() - t0
        t0 = time.perf_counter()
        mem.wake()
        woke = time.perf_counter() - t0
        g.replay()
        torch.cuda.synchronize()
        identical = bool(torch.equal(y, before))
        return {"identical": identical, "sleep_s": slept, "wake_s": woke, "slept_bytes": held}


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def body(args: argparse.Namespace, result: c.Result, cleanup: contextlib.ExitStack) -> None:
    from gpumem_shared.units import format_size

    result.targets = {"contents_identical": True}
    if args.backend == "cuda":
        result.targets |= {"ratio_vs_pinned_min": args.target_ratio, "drop_wake_ms_max": args.target_drop_ms, "graph_identical": True}
    rdir = cleanup.enter_context(c.runtime_dir("gmb-sleep-"))
    top = max(args.size_list)
    c.say(f"{BENCH}: backend={args.backend} sizes={[format_size(s) for s in args.size_list]} drop={format_size(args.drop)} "
          f"repeats={args.repeats} runtime dir {rdir}")
    daemon_args = ["--sleep-host-limit", str(2 * top)]
    if args.backend == "host":
        daemon_args += ["--host-capacity", str(max(8 * GiB, 2 * top, args.drop + GiB))]
    daemon = c.Daemon(rdir, args.backend, args.device, daemon_args)
    cleanup.callback(daemon.stop)
    daemon.wait_ready(args.start_timeout)

    import gpumem

    session = gpumem.connect(args.device, name="bench-sleep", runtime_dir=rdir, timeout=args.call_timeout)
    cleanup.callback(session.close)
    driver = session.driver
    ordinal = session.device_ordinal or 0
    block = os.urandom(PIECE)
    figures: dict[str, Any] = {"sizes": {}}
    ok = True
    for size in args.size_list:
        name = f"sleep-{size}"
        arena = session.create_arena(name, size)
        arena.commit(size)
        fill(driver, arena.address, size, block)
        sleeper = gpumem.ArenaSleep(arena)
        t0 = time.perf_counter()
        sleeper.sleep(keep=True)
        first_sleep = time.perf_counter() - t0
        t0 = time.perf_counter()
        sleeper.wake()
        first_wake = time.perf_counter() - t0
        sleeps, wakes = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sleeper.sleep(keep=True)
            sleeps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sleeper.wake()
            wakes.append(time.perf_counter() - t0)
        intact = same(driver, arena.address, size, block)
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
            "pinned_to_host_gib_s": gib / c.median(outs), "pinned_to_device_gib_s": gib / c.median(ins),
            "contents_identical": intact,
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
        c.say(f"{format_size(size):>9}: sleep {row['gpumemd_sleep_gib_s']:.1f} GiB/s ({row['sleep_ratio']:.2f}x pinned "
              f"{row['pinned_to_host_gib_s']:.1f}), wake {row['gpumemd_wake_gib_s']:.1f} GiB/s ({row['wake_ratio']:.2f}x pinned "
              f"{row['pinned_to_device_gib_s']:.1f}); first cycle {first_sleep:.3f} s / {first_wake:.3f} s; "
              f"contents {'identical' if intact else 'DIFFER'}; {tms_text}")

    if args.drop:
        arena = session.create_arena("sleep-drop", args.drop)
        arena.commit(args.drop)
        sleeper = gpumem.ArenaSleep(arena)
        sleeper.sleep(keep=False)
        t0 = time.perf_counter()
        sleeper.wake()
        drop_ms = (time.perf_counter() - t0) * 1e3
        arena.release()
        figures["drop_wake_ms"] = drop_ms
        figures["drop_wake_bytes"] = args.drop
        if args.backend == "cuda":
            ok &= drop_ms <= args.target_drop_ms
        c.say(f"wake of {format_size(args.drop)} whose contents were dropped (commit, zeroing, mapping): {drop_ms:.1f} ms")

    if args.backend == "cuda":
        try:
            import torch  # noqa: F401
        except ImportError:
            figures["graph"] = "skipped: torch is not installed"
        else:
            graph = graph_replays_after_wake(rdir, args.device, args.call_timeout)
            figures["graph"] = graph
            ok &= graph["identical"]
            c.say(f"captured graph after sleep ({graph['sleep_s']:.3f} s) and wake ({graph['wake_s']:.3f} s): outputs "
                  f"{'bit-identical' if graph['identical'] else 'DIFFER'}, no recapture")
    else:
        figures["graph"] = "skipped: needs CUDA and torch"
    result.figures = figures
    result.ok = bool(ok)


def main(argv: list[str] | None = None) -> int:
    c.ensure_importable()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return c.run(BENCH, args.backend, lambda result, cleanup: body(args, result, cleanup))


if __name__ == "__main__":
    sys.exit(main())
