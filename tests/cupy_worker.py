"""A CuPy process on a gpumem arena (CUDA only), for tests/integration/test_cupy_gpu.py.

    python tests/cupy_worker.py

Finds the daemon through $GPUMEMD_RUNTIME_DIR. Takes CuPy's memory from an elastic arena,
checks the bookkeeping on real CuPy, shares the arena with the client 'torch-reader' and
prints "READY <offset> <nbytes>" (where an array of arange(n) float32 lies in the arena).
On "CHECK" from stdin it verifies the reader doubled the array ("DOUBLED"), then waits
on stdin until killed.
"""

from __future__ import annotations

import sys

import cupy

import gpumem
from gpumem.integrations import cupy as gpumem_cupy

MiB = 1 << 20
N = 4 << 20  # float32s: 16 MiB


def main() -> None:
    session = gpumem.connect(0, name="cupy-worker")
    arena = session.create_arena("cupy", 1 << 30).set_elastic(step=64 * MiB)
    pool = gpumem_cupy.use_arena(arena)
    x = cupy.arange(N, dtype=cupy.float32)
    assert arena.address <= x.data.ptr and x.data.ptr + x.nbytes <= arena.address + arena.committed, (hex(x.data.ptr), arena)
    assert arena.committed >= x.nbytes and arena.usage().grows >= 1, arena.usage()
    # A temporary CuPy frees goes back to its pool, and to the slot's count once the pool lets go.
    scratch = cupy.ones(8 * MiB, dtype=cupy.uint8)
    in_use = arena.usage().in_use
    assert in_use >= x.nbytes + scratch.nbytes, arena.usage()
    del scratch
    pool.pool.free_all_blocks()
    assert arena.usage().in_use <= in_use - 8 * MiB, arena.usage()
    cupy.cuda.runtime.deviceSynchronize()
    arena.share("torch-reader")
    print(f"READY {x.data.ptr - arena.address} {x.nbytes}", flush=True)
    assert sys.stdin.readline().strip() == "CHECK"
    assert bool((x == cupy.arange(N, dtype=cupy.float32) * 2).all()), "the reader's writes are not in CuPy's array"
    print("DOUBLED", flush=True)
    sys.stdin.readline()  # until the test kills this process


if __name__ == "__main__":
    main()
