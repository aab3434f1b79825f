"""An engine process whose block manager follows its KV pool (gpumem.port.blocks over
nano-vllm's adapter on a stand-in manager, tests/nanovllm_fakes.py), for
tests/integration/test_nanovllm_follow.py.

    python tests/follow_engine.py NAME POOL BACKEND LIVE [fail]

Declares POOL (two 64 KiB-row buffers, at most 4096 blocks), joins the device's round
(two pools), reports, prints ``READY <blocks>``; then holds LIVE live blocks at the top
of its pool, each row filled with its block id, and idles: it answers the daemon's
shrink by moving those blocks down, prints ``SHRUNK <pool tokens> <manager blocks>
<highest live block> intact|CORRUPT`` (whether every moved block holds what it held) and
exits. The copy is slow on purpose (a block at a time, ``MOVING`` printed first) so that
a test can kill the process in the middle of it. With ``fail`` the copy raises after its
first block (an engine's copy failing mid-move): it prints ``FAILED <pool tokens> <manager
blocks> <highest live block> intact|CORRUPT <the error>`` and waits to be killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpumem  # noqa: E402
from gpumem.port.blocks import BlockFollower, MoveFailed  # noqa: E402
from nanovllm_fakes import Engine, Manager, Seq  # noqa: E402

ROW = 64 << 10
BLOCK_PAUSE_S = 0.2


def rows(pool: gpumem.KvPool, backend: str) -> list[Any]:
    """Each buffer as (max_tokens, ROW) bytes: NumPy over host memory, torch on CUDA."""
    out = []
    for name in sorted(pool.buffers):
        view = pool.view(name)
        if backend == "host":
            import numpy

            out.append(numpy.asarray(view).reshape(pool.max_tokens, ROW))
        else:
            import torch

            out.append(torch.from_dlpack(view).view(pool.max_tokens, ROW))
    return out


def main() -> int:
    name, pool_name, backend, live = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    fail = sys.argv[5:] == ["fail"]
    session = gpumem.connect(0, name=name, timeout=30.0)
    pool = session.declare_kv_pool(pool_name, [gpumem.KvBuffer(f"b{i}", ROW) for i in range(2)], max_tokens=4096)
    pool.join_round(expect=2)
    blocks = pool.capture_done(min_tokens=256)
    print(f"READY {blocks}", flush=True)
    buffers = rows(pool, backend)
    manager = Manager(blocks)
    seq = Seq(live * 4, [manager.take(i) for i in range(blocks - live, blocks)])
    for i in seq.block_table:
        for b in buffers:
            b[i] = i % 251

    def copy(src: list[int], dst: list[int]) -> None:
        print("MOVING", flush=True)
        for s, d in zip(src, dst):
            for b in buffers:
                b[d] = b[s]
            if backend == "cuda":
                import torch

                torch.cuda.synchronize()
            if fail:
                raise RuntimeError("the copy failed after one block (follow_engine.py fail)")
            time.sleep(BLOCK_PAUSE_S)

    follower = BlockFollower(pool, Engine(manager, running=[seq], copy=copy))
    was = list(seq.block_table)

    def state() -> str:
        kept = all(bool((b[new] == old % 251).all()) for b in buffers for old, new in zip(was, seq.block_table))
        return f"{pool.tokens} {len(manager.blocks)} {max(seq.block_table)} {'intact' if kept else 'CORRUPT'}"

    try:
        while not follower.figures.shrinks:
            follower.idle()
            time.sleep(0.005)
    except MoveFailed as exc:
        print(f"FAILED {state()} {exc}", flush=True)
        time.sleep(60)  # alive, its pool as it was, until the test has read the books and kills it
        return 1
    print(f"SHRUNK {state()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
