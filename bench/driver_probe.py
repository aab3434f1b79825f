#!/usr/bin/env python3
"""What the CUDA driver itself costs, with no gpumemd: the floor under a dropped wake and
under a first sleep (issue 25; docs/performance.md, "Sleep and wake").

1. Commit ``--gib`` GiB (default 100, or 0.85 of the GPU's free memory where less) the way gpumemd's daemon does (cuMemCreate with a POSIX fd
   handle, export, map, set access, zero with one memset and a sync), release it, and
   commit it again: at once, at once again, after ``--settle-s``, and at once from
   ``--threads`` threads creating in parallel; for 512 MiB and 2 GiB chunks. Each part
   is timed.
2. Register ``--register-gib`` GiB of host memory with cuMemHostRegister (pages touched
   first), as a sleep's host buffer is: a memfd (shared memory, the daemon's buffer),
   the same with MADV_HUGEPAGE, anonymous memory with and without MADV_HUGEPAGE, and a
   MFD_HUGETLB memfd (refused where no huge pages are reserved).

    python bench/driver_probe.py --backend cuda

Last line: {"bench": "driver_probe", ...}; no target (it measures the driver, not
gpumemd): ok when every step ran. ``--backend host`` has no driver to probe and says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from typing import Any

import _common as c

BENCH = "driver_probe"
MiB, GiB = 1 << 20, 1 << 30


class Driver:
    def __init__(self, ordinal: int, total: int) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.ck(cu.cuInit(0))
        self.ctx = self.ck(cu.cuDevicePrimaryCtxRetain(self.ck(cu.cuDeviceGet(ordinal))))
        self.ck(cu.cuCtxSetCurrent(self.ctx))
        self.posix = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = self.posix
        self.prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        self.total = total
        self.va = int(self.ck(cu.cuMemAddressReserve(total, 0, 0, 0)))

    def ck(self, r: Any) -> Any:
        err = r[0] if isinstance(r, tuple) else r
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {err}")
        return r[1] if isinstance(r, tuple) and len(r) > 1 else None

    def create(self, size: int) -> Any:
        self.ck(self.cu.cuCtxSetCurrent(self.ctx))
        return self.ck(self.cu.cuMemCreate(size, self.prop, 0))

    def commit(self, size: int, threads: int) -> tuple[dict[str, float], list[Any], list[int]]:
        """The daemon's commit of ``total`` bytes in chunks of ``size``, part by part (ms)."""
        cu, n, t = self.cu, self.total // size, [time.perf_counter()]
        if threads > 1:
            with ThreadPoolExecutor(threads) as pool:
                handles = list(pool.map(lambda _: self.create(size), range(n)))
        else:
            handles = [self.create(size) for _ in range(n)]
        t.append(time.perf_counter())
        fds = [int(self.ck(cu.cuMemExportToShareableHandle(h, self.posix, 0))) for h in handles]
        t.append(time.perf_counter())
        for i, h in enumerate(handles):
            self.ck(cu.cuMemMap(self.va + i * size, size, 0, h, 0))
        t.append(time.perf_counter())
        self.ck(cu.cuMemSetAccess(self.va, n * size, [self.access], 1))
        t.append(time.perf_counter())
        self.ck(cu.cuMemsetD32Async(self.va, 0, n * size // 4, 0))
        self.ck(cu.cuCtxSynchronize())
        t.append(time.perf_counter())
        parts = {name: 1e3 * (b - a) for name, a, b in zip(("create", "export", "map", "access", "zero"), t, t[1:])}
        return parts | {"total": 1e3 * (t[-1] - t[0])}, handles, fds

    def release(self, size: int, handles: list[Any], fds: list[int]) -> float:
        t0 = time.perf_counter()
        for i, h in enumerate(handles):
            self.ck(self.cu.cuMemUnmap(self.va + i * size, size))
            self.ck(self.cu.cuMemRelease(h))
        for fd in fds:
            os.close(fd)
        return 1e3 * (time.perf_counter() - t0)

    def register(self, m: mmap.mmap) -> dict[str, float]:
        """Touch every 2 MiB of ``m``, then cuMemHostRegister it (ms each)."""
        anchor = ctypes.c_char.from_buffer(m)
        address = ctypes.addressof(anchor)
        try:
            t0 = time.perf_counter()
            for offset in range(0, len(m), 2 * MiB):
                m[offset] = 1
            t1 = time.perf_counter()
            self.ck(self.cu.cuMemHostRegister(address, len(m), 0))
            t2 = time.perf_counter()
            self.ck(self.cu.cuMemHostUnregister(address))
        finally:
            del anchor
        return {"touch_ms": 1e3 * (t1 - t0), "register_ms": 1e3 * (t2 - t1)}


def host_buffers(size: int) -> Iterator[tuple[str, mmap.mmap]]:
    for label, huge in (("memfd_4k", False), ("memfd_madv_hugepage", True)):
        fd = os.memfd_create("driver-probe", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if huge:
            m.madvise(mmap.MADV_HUGEPAGE)
        yield label, m
    for label, huge in (("anonymous_4k", False), ("anonymous_madv_hugepage", True)):
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            m.madvise(mmap.MADV_HUGEPAGE)
        yield label, m


def main() -> int:
    parser = c.ArgumentParser(BENCH, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["host", "cuda"], default="cuda")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--gib", type=int, default=None,
                        help="GiB committed, released and committed again (default: 100, or 0.85 of the free memory where less)")
    parser.add_argument("--settle-s", type=float, default=3.0, help="pause before the settled commit (default: 3)")
    parser.add_argument("--threads", type=int, default=4, help="threads of the parallel create (default: 4)")
    parser.add_argument("--register-gib", type=int, default=4, help="GiB of host memory registered each way (default: 4)")
    args = parser.parse_args()

    def body(result: c.Result, cleanup: contextlib.ExitStack) -> None:
        if args.backend != "cuda":
            raise RuntimeError("the host backend has no driver to probe: run with --backend cuda")
        args.gib = args.gib or c.fit(100 * GiB, args.backend, 0.85, "committed", args.device) // GiB
        drv = Driver(args.device, args.gib * GiB)
        commits: dict[str, dict[str, float]] = {}
        for size in (512 * MiB, 2 * GiB):
            name = f"{size // MiB}MiB"
            _, handles, fds = drv.commit(size, 1)  # the first commit warms the driver
            for label, settle, threads in (("at_once", 0.0, 1), ("at_once_again", 0.0, 1), ("settled", args.settle_s, 1),
                                           (f"at_once_{args.threads}_threads", 0.0, args.threads)):
                released = drv.release(size, handles, fds)
                time.sleep(settle)
                parts, handles, fds = drv.commit(size, threads)
                commits[f"{name}_{label}"] = {k: round(v, 1) for k, v in (parts | {"release_before": released}).items()}
                c.say(f"{args.gib} GiB in {name} chunks, {label.replace('_', ' ')}: "
                      + ", ".join(f"{k} {v:.1f} ms" for k, v in commits[f'{name}_{label}'].items()))
            drv.release(size, handles, fds)
        registered: dict[str, Any] = {}
        for label, m in host_buffers(args.register_gib * GiB):
            with contextlib.closing(m):
                registered[label] = {k: round(v, 1) for k, v in drv.register(m).items()}
            c.say(f"register {args.register_gib} GiB, {label}: {registered[label]}")
        try:
            fd = os.memfd_create("driver-probe", os.MFD_CLOEXEC | os.MFD_HUGETLB)
        except OSError as exc:
            registered["memfd_hugetlb"] = f"refused: {exc.strerror}"
        else:
            with contextlib.closing(os.fdopen(fd, "rb", buffering=0)):
                try:
                    os.ftruncate(fd, args.register_gib * GiB)
                    m = mmap.mmap(fd, args.register_gib * GiB, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                except OSError as exc:
                    registered["memfd_hugetlb"] = f"refused: {exc.strerror}"
                else:
                    with contextlib.closing(m):
                        registered["memfd_hugetlb"] = {k: round(v, 1) for k, v in drv.register(m).items()}
        c.say(f"register {args.register_gib} GiB, memfd_hugetlb: {registered['memfd_hugetlb']}")
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            registered["shmem_thp"] = f.read().strip()
        result.figures = {"gib": args.gib, "settle_s": args.settle_s, "commits": commits,
                          "register_gib": args.register_gib, "register": registered}
        result.ok = True

    return c.run(BENCH, args.backend, body, args.device)


if __name__ == "__main__":
    raise SystemExit(main())
