"""torch on gpumem arenas, scenario by scenario, each in a fresh process (CUDA only).

    python tests/torch_scenarios.py SCENARIO

The daemon is found through $GPUMEMD_RUNTIME_DIR. A scenario prints "PASS <name>" and
exits 0, or fails with a traceback. Used by tests/integration/test_torch_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys

import torch

import gpumem

MiB = 1 << 20
GiB = 1 << 30


def in_arena(arena: gpumem.Arena, t: torch.Tensor) -> bool:
    return arena.address <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= arena.address + arena.reserved


def tensors_land_in_arena() -> None:
    with gpumem.connect(0, name="alloc") as s:
        arena = s.create_arena("act", 8 * GiB)
        arena.commit(1 * GiB)
        with arena.allocating():
            xs = [torch.ones(n, device="cuda") for n in (1, 1000, 1 << 20, 50 << 20)]
        assert all(in_arena(arena, x) for x in xs), [hex(x.data_ptr()) for x in xs]
        assert all(float(x.sum()) == x.numel() for x in xs)
        y = torch.ones(10, device="cuda")  # outside the block: torch's own allocator
        assert not in_arena(arena, y)
        # virtual-only layout beyond the committed part: nothing touches it
        with arena.allocating(virtual=True):
            kv = torch.empty(3 * GiB, dtype=torch.uint8, device="cuda")
        assert in_arena(arena, kv) and kv.data_ptr() - arena.address + kv.numel() > 1 * GiB  # reaches past the commit
        del xs, kv
        torch.cuda.synchronize()
    print("PASS tensors_land_in_arena")


def writer_then_reader() -> None:
    with gpumem.connect(0, name="torch-writer") as s:
        arena = s.create_arena("shared", 4 * GiB)
        arena.commit(256 * MiB)
        with arena.allocating():
            t = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
        offset = t.data_ptr() - arena.address
        torch.cuda.synchronize()
        arena.share("torch-reader")
        code = (
            "import torch, gpumem, sys\n"
            "s = gpumem.connect(0, name='torch-reader')\n"
            "a = s.attach_arena('shared')\n"
            f"t = a.tensor({offset}, ({1 << 20},), torch.int32)\n"
            "assert torch.equal(t, torch.arange(1 << 20, dtype=torch.int32, device='cuda')), 'reader saw other bytes'\n"
            "t.mul_(2); torch.cuda.synchronize(); print('READER OK')\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "READER OK" in out.stdout, out.stderr
        assert torch.equal(t, 2 * torch.arange(1 << 20, dtype=torch.int32, device="cuda")), "writer did not see reader's bytes"
    print("PASS writer_then_reader")


def placeholder_capture_commit_replay() -> None:
    with gpumem.connect(0, name="capture") as s:
        arena = s.create_arena("kv", 16 * GiB)
        kv_bytes = 8 * GiB
        kv = arena.tensor(0, (kv_bytes // 2,), torch.float16)  # virtual-only KV, outside any pool
        arena.placeholder(0, kv_bytes, 64 * MiB)
        src = torch.full((1 << 20,), 3.0, dtype=torch.float16, device="cuda")
        rows = torch.arange(0, kv_bytes // 2, (kv_bytes // 2) // 1024, device="cuda")[:1024]
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kv[: 1 << 20].copy_(src)  # warm-up on placeholder
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                kv[: 1 << 20].copy_(src)  # a memcpy node: fails to capture on unmapped space
                kv[-(1 << 20) :].fill_(5.0)  # a memset at the far end of the KV
                kv.index_fill_(0, rows, 7.0)  # a kernel scattered over every slot
        torch.cuda.synchronize()
        arena.commit(kv_bytes)  # swap: real memory at the same addresses
        assert arena.placeholder_bytes == 0 and arena.mapped_bytes == kv_bytes
        assert float(kv[:4096].float().abs().sum()) == 0.0, "fresh commit was not clean"
        g.replay()
        torch.cuda.synchronize()
        assert bool((kv[1 << 20 : (1 << 20) + 1024] == 0).all())
        assert bool((kv[-(1 << 20) :] == 5.0).all())
        assert bool((kv[rows] == 7.0).all())
        assert bool((kv[1 : 1 << 20] == 3.0).all()) and float(kv[0]) == 7.0
        del g
    print("PASS placeholder_capture_commit_replay")


def graph_pool_in_daemon_chunks() -> None:
    with gpumem.connect(0, name="graphs") as s:
        arena = s.create_arena("graphs", 8 * GiB)
        arena.commit(2 * GiB)
        x = torch.randn(1 << 20, device="cuda")
        expected = (x * 2 + 1).sum()
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(g, pool=arena.torch_pool().graph_pool, stream=stream):
                tmp = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a transient
                tmp.fill_(1)
                y = (x * 2 + 1).sum() + tmp[:0].sum()
                del tmp
        torch.cuda.synchronize()
        for _ in range(3):
            x.copy_(torch.randn(1 << 20, device="cuda"))
            expected = (x * 2 + 1).sum()
            g.replay()
            torch.cuda.synchronize()
            assert torch.allclose(y, expected, rtol=1e-4), (float(y), float(expected))
        assert in_arena(arena, y)
        segments = arena.torch_pool().segments()
        assert segments, "the graph pool has no segments"
        committed = arena.committed_ranges()
        for seg in segments:
            off = seg["address"] - arena.address
            assert any(a <= off and off + seg["total_size"] <= b for a, b in committed), (hex(seg["address"]), committed)
        inactive = sum(b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "inactive")
        assert inactive >= 64 << 20, f"the 64 MiB transient should be a free run after capture, saw {inactive}"
        # the registry: the daemon now knows the pool's extents and its free runs
        registered = arena.register_graph_pool("decode graph")
        assert registered.epoch == 1 and registered.free_runs[0].size >= 64 << 20, registered
        status = s.status()
        (entry,) = status.graph_pools
        assert entry.id == registered.id and entry.owner == "graphs" and entry.free_bytes >= 64 << 20
        assert sum(e.size for e in entry.extents) == sum(seg["total_size"] for seg in segments)
        registered.refresh(recaptured=True)
        assert registered.epoch == 2
        registered.retire()
        assert s.status().graph_pools == []
    print("PASS graph_pool_in_daemon_chunks")


def oom_names_the_arena() -> None:
    with gpumem.connect(0, name="oom") as s:
        arena = s.create_arena("small", 1 * GiB)
        arena.commit(64 * MiB)
        try:
            with arena.allocating():
                torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        except gpumem.ArenaOutOfMemory as exc:
            assert "arena 'small'" in str(exc) and "not backed" in str(exc), exc
        else:
            raise AssertionError("an allocation beyond the backed space succeeded")
        try:
            with arena.allocating(virtual=True):
                torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        except gpumem.ArenaOutOfMemory as exc:
            assert "arena 'small'" in str(exc) and "bytes are left" in str(exc), exc
        else:
            raise AssertionError("an allocation beyond the window succeeded")
        # no silent fallback: nothing landed in torch's default pool meanwhile
        assert torch.cuda.memory_reserved() < 64 * MiB, torch.cuda.memory_reserved()
    print("PASS oom_names_the_arena")


def bad_routing() -> None:
    s = gpumem.connect(0, name="bad")
    empty = s.create_arena("empty", 1 * GiB)
    try:
        _ = empty.torch_pool().graph_pool  # the property raises without backing
    except gpumem.InvalidArgument as exc:
        assert "no backing" in str(exc), exc
    else:
        raise AssertionError("capture into an unbacked arena was allowed")
    gone = s.create_arena("gone", 1 * GiB)
    gone.commit(64 * MiB)
    with gone.allocating():
        t = torch.ones(16, device="cuda")
    try:
        gone.release()
    except gpumem.InvalidArgument as exc:
        assert "live tensors" in str(exc), exc
    else:
        raise AssertionError("release with live tensors was allowed")
    del t
    gone.release()
    try:
        with gone.allocating():
            pass
    except gpumem.SessionClosed as exc:
        assert "released" in str(exc), exc
    else:
        raise AssertionError("routing into a released arena was allowed")
    s.close()
    try:
        with empty.allocating():
            pass
    except gpumem.SessionClosed:
        pass
    else:
        raise AssertionError("routing into an arena of a closed session was allowed")
    print("PASS bad_routing")


SCENARIOS = {
    f.__name__: f
    for f in (
        tensors_land_in_arena,
        writer_then_reader,
        placeholder_capture_commit_replay,
        graph_pool_in_daemon_chunks,
        oom_names_the_arena,
        bad_routing,
    )
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
