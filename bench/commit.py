#!/usr/bin/env python3
"""Commit + handout + client map of S bytes through gpumemd, against the raw driver.

A client creates an arena (reserving --reserve-factor x S), then times
``arena.commit(S)``: the daemon creates the chunks (on CUDA it also maps and scrubs
them), exports one fd per chunk and passes them over the fd channel; the client
imports and maps each at the arena's address. ``arena.decommit(0)`` (the daemon
retires the chunks, the client unmaps them and reports it) is timed separately.

Baseline, measured in the same run and process, with the same chunk sizes:
- cuda: cuMemCreate (POSIX-fd shareable, like the daemon's) + cuMemMap of each chunk
  + cuMemSetAccess over the range; release is cuMemUnmap + cuMemRelease;
- host: memfd_create + ftruncate + mmap(MAP_SHARED|MAP_FIXED) of each chunk into a
  reserved window; release maps PROT_NONE back over it and closes the memfds.
gpumemd and the baseline alternate within each repetition, so drift hits both alike.

The target's baseline is the whole path without the daemon, phase by phase, in this
process through gpumem's own driver class (the one the daemon and the client use):
create (on CUDA: create, map in a daemon-like window, set access), zero, export one fd
per chunk, import and map them in a second window. The benchmark prints each phase, the
client's own import + map inside ``arena.commit`` (timed around its driver call), and
the rest: the daemon's driver work, fd passing, the round trip and both sides' Python.

    python bench/commit.py --backend host                # S = 1 GiB
    python bench/commit.py --backend cuda                # S = 16 GiB

(or 0.4 of the device's free memory where that is less: the daemon's chunks and the
baseline's alternate, and the driver may still be reclaiming the last ones).

Last line: {"bench": "commit", "backend", "figures", "targets", "ok"}; ok means the
median commit <= 1.3x the median of the driver path (create + zero + export + import +
map) of the same chunks.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import sys
import time
from typing import Any

import _common as c

BENCH = "commit"
MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SIZE = {"cuda": 16 * GiB, "host": 1 * GiB}


def ms_since(t0: int) -> float:
    return (time.perf_counter_ns() - t0) / 1e6


# ---------------------------------------------------------------------------
# Baselines: the same chunks, made and mapped in this process without gpumemd
# ---------------------------------------------------------------------------


class HostBaseline:
    """memfd_create + ftruncate + mmap of each chunk into a PROT_NONE window."""

    PROT_NONE, PROT_RW = 0x0, 0x3
    MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000

    def __init__(self, size: int) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc = libc
        self.size = size
        self.base = self._mmap(0, size, self.PROT_NONE, self._reserve_flags)
        self._fds: list[int] = []
        self._placed: list[tuple[int, int]] = []

    _reserve_flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE

    def _mmap(self, address: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
        got = self._libc.mmap(address, size, prot, flags, fd, 0)
        if got is None or got == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}")
        return int(got)

    def commit(self, sizes: list[int]) -> None:
        offset = 0
        for size in sizes:
            fd = os.memfd_create("bench-chunk", os.MFD_CLOEXEC)
            self._fds.append(fd)
            os.ftruncate(fd, size)
            self._mmap(self.base + offset, size, self.PROT_RW, self.MAP_SHARED | self.MAP_FIXED, fd)
            self._placed.append((offset, size))
            offset += size

    def release(self) -> None:
        for offset, size in self._placed:
            self._mmap(self.base + offset, size, self.PROT_NONE, self._reserve_flags | self.MAP_FIXED)
        self._placed.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        self.release()
        self._libc.munmap(self.base, self.size)


class CudaBaseline:
    """cuMemCreate + cuMemMap + cuMemSetAccess through cuda.bindings.driver."""

    def __init__(self, ordinal: int, size: int) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self._ck(cu.cuInit(0), "cuInit")
        dev = self._ck(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self._dev = dev
        self._ctx = self._ck(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._ck(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        # Shareable as POSIX fds, as the daemon's chunks are: it can change what the
        # driver does at creation, so the baseline asks for it too.
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        gran = int(
            self._ck(
                cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity",
            )
        )
        self.size = size
        self.base = int(self._ck(cu.cuMemAddressReserve(size, gran, 0, 0), "cuMemAddressReserve"))
        self._handles: list[Any] = []
        self._placed: list[tuple[int, int]] = []

    def _ck(self, result: Any, what: str) -> Any:
        err = result[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            name = self.cu.cuGetErrorName(err)
            raise RuntimeError(f"{what} failed: {name[1].decode() if name[0] == self.cu.CUresult.CUDA_SUCCESS else err}")
        return None if len(result) == 1 else result[1]

    def commit(self, sizes: list[int], scrub: bool = False) -> None:
        cu = self.cu
        self._ck(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        offset = 0
        for size in sizes:
            handle = self._ck(cu.cuMemCreate(size, self._prop, 0), "cuMemCreate")
            self._handles.append(handle)
            self._ck(cu.cuMemMap(self.base + offset, size, 0, handle, 0), "cuMemMap")
            self._placed.append((offset, size))
            offset += size
        self._ck(cu.cuMemSetAccess(self.base, offset, self._access, 1), "cuMemSetAccess")
        if scrub:  # what the daemon adds: zero the new memory before anyone sees it
            self._ck(cu.cuMemsetD8(self.base, 0, offset), "cuMemsetD8")
        self._ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def release(self) -> None:
        cu = self.cu
        self._ck(cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        for offset, size in self._placed:
            self._ck(cu.cuMemUnmap(self.base + offset, size), "cuMemUnmap")
        self._placed.clear()
        for handle in self._handles:
            self._ck(cu.cuMemRelease(handle), "cuMemRelease")
        self._handles.clear()

    def close(self) -> None:
        try:
            self.release()
        finally:
            self.cu.cuMemAddressFree(self.base, self.size)
            self.cu.cuDevicePrimaryCtxRelease(self._dev)


class DriverPath:
    """The daemon's and the client's driver calls for the same chunks, in this process,
    without the daemon: the floor under ``arena.commit``, phase by phase."""

    PHASES = ("create", "zero", "export", "import_map")

    def __init__(self, driver: Any, size: int) -> None:
        self.driver = driver
        self.size = size
        # Below the daemons' slices (gpumem_shared.address_plan), apart from each other.
        self.made = driver.reserve(size, 0x1000_0000_0000)  # where the daemon maps its chunks to zero them
        self.mapped = driver.reserve(size, 0x1400_0000_0000)  # where a client maps them

    def cycle(self, sizes: list[int]) -> dict[str, float]:
        d = self.driver
        placements, offset = [], 0
        for size in sizes:
            placements.append((self.made + offset, size))
            offset += size
        phases: dict[str, float] = {}
        t0 = time.perf_counter_ns()
        handles = d.create_chunks(placements)
        phases["create"] = ms_since(t0)
        t0 = time.perf_counter_ns()
        d.zero(placements)
        phases["zero"] = ms_since(t0)
        t0 = time.perf_counter_ns()
        fds = d.export_fds([(a, n, h, False) for (a, n), h in zip(placements, handles)])
        phases["export"] = ms_since(t0)
        t0 = time.perf_counter_ns()
        d.map_fds(self.mapped, [(fd, a - self.made, n) for fd, (a, n) in zip(fds, placements)])
        phases["import_map"] = ms_since(t0)
        for fd in fds:
            os.close(fd)
        d.unmap_many(self.mapped, [(a - self.made, n) for a, n in placements])
        d.destroy_chunks(placements, handles)
        phases["total"] = sum(phases[k] for k in self.PHASES)
        return phases

    def close(self) -> None:
        self.driver.free_reservation(self.made, self.size)
        self.driver.free_reservation(self.mapped, self.size)


# ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = c.ArgumentParser(BENCH, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host", help="daemon backend (default: host)")
    ap.add_argument("--device", type=int, default=0, help="device index the daemon serves (default: 0)")
    ap.add_argument("--size", default=None,
                    help="bytes to commit, e.g. 16GiB (default: 16GiB on cuda, 1GiB on host, or 0.4 of the free memory where less)")
    ap.add_argument("--repeats", type=int, default=5, help="timed commit/decommit cycles (default: 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed cycles first (default: 1)")
    ap.add_argument("--reserve-factor", type=float, default=2.0, help="arena reservation = this x size (default: 2, min 1)")
    ap.add_argument("--chunk-size", default="512MiB", help="daemon's bulk chunk size (default: 512MiB, the daemon's default)")
    ap.add_argument("--host-capacity", default=None, help="host backend capacity (default: max(8GiB, size))")
    ap.add_argument("--target-ratio", type=float, default=1.3, help="ok when commit / driver path <= this (default: 1.3)")
    ap.add_argument("--no-scrub-baseline", action="store_true", help="cuda: skip the extra baseline that also zeroes the memory")
    ap.add_argument("--start-timeout", type=float, default=120.0, help="seconds the daemon gets to start")
    ap.add_argument("--call-timeout", type=float, default=120.0, help="seconds one gpumem call may take")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.reserve_factor < 1:
        ap.error("--repeats must be >= 1, --warmup >= 0, --reserve-factor >= 1")
    from gpumem_shared.units import parse_size

    try:
        args.size = parse_size(args.size) if args.size else None  # None: fitted to the device in body()
        args.host_capacity = parse_size(args.host_capacity) if args.host_capacity else None
        args.chunk_bytes = parse_size(args.chunk_size)
    except ValueError as exc:
        ap.error(str(exc))
    if (args.size is not None and args.size <= 0) or args.chunk_bytes <= 0:
        ap.error("--size and --chunk-size must be positive")
    return args


def body(args: argparse.Namespace, result: c.Result, cleanup: contextlib.ExitStack) -> None:
    from gpumem_shared.units import format_size

    size = args.size or c.fit(DEFAULT_SIZE[args.backend], args.backend, 0.4, "committed", args.device)
    host_capacity = args.host_capacity or max(8 * GiB, size)
    result.targets = {"ratio_vs_driver_path_max": args.target_ratio}
    rdir = cleanup.enter_context(c.runtime_dir("gmb-commit-"))
    c.say(f"{BENCH}: backend={args.backend} device={args.device} size={format_size(size)} repeats={args.repeats} "
          f"warmup={args.warmup} runtime dir {rdir}")

    daemon_args = ["--chunk-size", str(args.chunk_bytes)]
    if args.backend == "host":
        daemon_args += ["--host-capacity", str(host_capacity)]
    daemon = c.Daemon(rdir, args.backend, args.device, daemon_args)
    cleanup.callback(daemon.stop)
    daemon.wait_ready(args.start_timeout)

    import gpumem

    session = gpumem.connect(args.device, name="bench-commit", runtime_dir=rdir, timeout=args.call_timeout)
    cleanup.callback(session.close)
    gran = session.device.granularity
    if size % gran:
        size = (size + gran - 1) // gran * gran
        c.say(f"size rounded up to the granularity ({gran}): {size}")
    reserve = int(size * args.reserve_factor + gran - 1) // gran * gran
    c.say(f"connected: {session!r}; {session.device.name}, granularity {format_size(gran)}")
    arena = session.create_arena("bench-commit", reserve)
    c.say(f"arena reserved: {format_size(reserve)} at {arena.address:#x}")

    if args.backend == "cuda":
        # This process's CUDA ordinal for the daemon's device (CUDA_VISIBLE_DEVICES may remap it).
        ordinal = getattr(session, "device_ordinal", None)
        if ordinal is None:
            ordinal = session.driver.ordinal  # type: ignore[attr-defined]
        baseline: HostBaseline | CudaBaseline = CudaBaseline(ordinal, size)
    else:
        baseline = HostBaseline(size)
    cleanup.callback(baseline.close)
    if args.backend == "cuda":
        from gpumem_shared.driver.cuda import CudaDriver

        path = DriverPath(CudaDriver(ordinal), size)
    else:
        from gpumem_shared.driver.host import HostDriver

        path = DriverPath(HostDriver(args.device, host_capacity), size)
    cleanup.callback(path.close)

    # The client's own import + map inside arena.commit, timed around its driver call.
    client_map_ms: list[float] = []
    real_map_fds = session.driver.map_fds

    def timed_map_fds(address: int, placements: list[tuple[int, int, int]], read_only: bool = False) -> None:
        t0 = time.perf_counter_ns()
        try:
            real_map_fds(address, placements, read_only)
        finally:
            client_map_ms.append(ms_since(t0))

    session.driver.map_fds = timed_map_fds  # type: ignore[method-assign]

    sizes: list[int] = []

    def chunk_sizes() -> list[int]:
        """The daemon's chunk plan for ``size`` (the same function it uses), checked
        against the chunk count its status reports for the committed arena."""
        from gpumemd.arenas import plan_chunk_sizes

        planned = plan_chunk_sizes(size, args.chunk_bytes, gran)
        status = session.status()
        reported = next((a.chunks for a in status.arenas if a.name == arena.name), None)
        if sum(planned) != size or reported != len(planned):
            raise RuntimeError(
                f"chunk plan mismatch: planned {len(planned)} chunk(s) of {sum(planned)} bytes for {size}, "
                f"the daemon reports {reported} chunk(s)"
            )
        return planned

    def gpumem_cycle() -> tuple[float, float]:
        nonlocal sizes
        client_map_ms.clear()
        t0 = time.perf_counter_ns()
        arena.commit(size)
        commit_ms = ms_since(t0)
        runs["client_map"].append(sum(client_map_ms))
        if arena.committed != size or arena.mapped_bytes != size:
            raise RuntimeError(f"after commit({size}): committed {arena.committed}, mapped {arena.mapped_bytes}")
        if not sizes:
            # The chunk sizes the daemon chose, for the baseline; and a proof the memory is real.
            sizes = chunk_sizes()
            marker = b"gpumemd-bench-commit"
            arena.write(0, marker)
            arena.write(size - len(marker), marker)
            if arena.read(0, len(marker)) != marker or arena.read(size - len(marker), len(marker)) != marker:
                raise RuntimeError("bytes written through the mapping did not read back")
        t0 = time.perf_counter_ns()
        arena.decommit(0)
        decommit_ms = ms_since(t0)
        if arena.committed != 0 or arena.mapped_bytes != 0:
            raise RuntimeError(f"after decommit(0): committed {arena.committed}, mapped {arena.mapped_bytes}")
        return commit_ms, decommit_ms

    def baseline_cycle(scrub: bool = False) -> tuple[float, float]:
        t0 = time.perf_counter_ns()
        if scrub:
            baseline.commit(sizes, scrub=True)  # type: ignore[call-arg]
        else:
            baseline.commit(sizes)
        commit_ms = ms_since(t0)
        t0 = time.perf_counter_ns()
        baseline.release()
        return commit_ms, ms_since(t0)

    runs: dict[str, list[float]] = {
        k: [] for k in ("commit", "decommit", "base_commit", "base_release", "base_scrub", "client_map", *DriverPath.PHASES, "total")
    }
    with_scrub = args.backend == "cuda" and not args.no_scrub_baseline
    for i in range(args.warmup):
        g = gpumem_cycle()
        b = baseline_cycle()
        c.say(f"  warmup {i + 1}: gpumem commit {g[0]:8.3f} ms  decommit {g[1]:8.3f} ms | "
              f"baseline commit {b[0]:8.3f} ms  release {b[1]:8.3f} ms")
        if with_scrub:
            baseline_cycle(scrub=True)
        path.cycle(sizes)
    for values in runs.values():
        values.clear()
    for r in range(args.repeats):
        if r % 2 == 0:
            g = gpumem_cycle()
            b = baseline_cycle()
        else:
            b = baseline_cycle()
            g = gpumem_cycle()
        s = baseline_cycle(scrub=True) if with_scrub else None
        for phase, ms in path.cycle(sizes).items():
            runs[phase].append(ms)
        runs["commit"].append(g[0])
        runs["decommit"].append(g[1])
        runs["base_commit"].append(b[0])
        runs["base_release"].append(b[1])
        if s is not None:
            runs["base_scrub"].append(s[0])
        c.say(f"  rep {r + 1:2d}/{args.repeats}: gpumem commit {g[0]:8.3f} ms  decommit {g[1]:8.3f} ms | "
              f"baseline commit {b[0]:8.3f} ms  release {b[1]:8.3f} ms"
              + (f" | baseline+scrub commit {s[0]:8.3f} ms" if s is not None else ""))

    med = {k: c.median(v) for k, v in runs.items() if v}
    fig: dict[str, Any] = {
        "size_bytes": size,
        "reserve_bytes": reserve,
        "chunks": len(sizes),
        "chunk_bytes_max": max(sizes),
        "chunk_bytes_min": min(sizes),
        "repeats": args.repeats,
        "commit_median_ms": med["commit"],
        "commit_min_ms": min(runs["commit"]),
        "decommit_median_ms": med["decommit"],
        "decommit_min_ms": min(runs["decommit"]),
        "baseline_median_ms": med["base_commit"],
        "baseline_min_ms": min(runs["base_commit"]),
        "baseline_release_median_ms": med["base_release"],
        "baseline_release_min_ms": min(runs["base_release"]),
        "ratio": c.ratio(med["commit"], med["base_commit"]),
        "decommit_ratio": c.ratio(med["decommit"], med["base_release"]),
        "commit_gib_per_s": size / GiB / (med["commit"] / 1e3) if med["commit"] > 0 else None,
    }
    if "base_scrub" in med:
        fig["baseline_scrub_median_ms"] = med["base_scrub"]
        fig["ratio_vs_scrub_baseline"] = c.ratio(med["commit"], med["base_scrub"])
    for phase in DriverPath.PHASES:
        fig[f"path_{phase}_median_ms"] = med[phase]
    fig["driver_path_median_ms"] = med["total"]
    fig["client_import_map_median_ms"] = med["client_map"]
    fig["beyond_client_map_median_ms"] = med["commit"] - med["client_map"]
    fig["ratio_vs_driver_path"] = c.ratio(med["commit"], med["total"])
    result.figures = fig
    result.ok = fig["ratio_vs_driver_path"] <= args.target_ratio

    c.say("")
    c.say(f"{format_size(size)} in {len(sizes)} chunk(s) ({format_size(max(sizes))} max, {format_size(min(sizes))} min)")
    c.say(f"gpumem  commit   median {med['commit']:8.3f} ms  min {min(runs['commit']):8.3f} ms")
    c.say(f"gpumem  decommit median {med['decommit']:8.3f} ms  min {min(runs['decommit']):8.3f} ms")
    c.say(f"raw     commit   median {med['base_commit']:8.3f} ms  min {min(runs['base_commit']):8.3f} ms  "
          f"release median {med['base_release']:8.3f} ms")
    if "base_scrub" in med:
        c.say(f"raw+scrub commit median {med['base_scrub']:8.3f} ms (create+map+access+memset, what the daemon does)")
    c.say("driver path, this process, no daemon (median ms): " + ", ".join(f"{k} {med[k]:.3f}" for k in DriverPath.PHASES)
          + f"; total {med['total']:.3f}")
    c.say(f"in arena.commit: the client's import + map {med['client_map']:.3f} ms; the rest (daemon create + zero + "
          f"export, fd passing, round trip, Python on both sides) {med['commit'] - med['client_map']:.3f} ms; beyond the "
          f"driver path: {med['commit'] - med['total']:.3f} ms")
    c.say(f"ratio commit/raw create+map {fig['ratio']:.2f}, decommit/release {fig['decommit_ratio']:.2f}; commit / driver "
          f"path {fig['ratio_vs_driver_path']:.2f} (target <= {args.target_ratio:g}): {'met' if result.ok else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    c.ensure_importable()  # parse_args reads sizes with gpumem_shared.units
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return c.run(BENCH, args.backend, lambda result, cleanup: body(args, result, cleanup), args.device)


if __name__ == "__main__":
    sys.exit(main())
