"""The engine-facing API with torch on CUDA, scenario by scenario, each in a fresh process.

    python tests/engine_scenarios.py SCENARIO

The daemon is found through $GPUMEMD_RUNTIME_DIR. A scenario prints "PASS <name>" and
exits 0, or fails with a traceback. Used by tests/integration/test_engine_gpu.py.
"""

from __future__ import annotations

import sys

import torch

import gpumem

MiB = 1 << 20
GiB = 1 << 30


def inside(arena: gpumem.Arena, t: torch.Tensor) -> bool:
    return arena.address <= t.data_ptr() < arena.address + arena.reserved


def elastic_torch_arena() -> None:
    with gpumem.connect(0, name="elastic") as s:
        arena = s.create_arena("model", 8 * GiB).set_elastic(step=64 * MiB, cap=GiB)
        with arena.allocating():
            w = torch.ones(300 * MiB // 4, device="cuda")  # more than a step: grows to the request's end
        assert inside(arena, w) and arena.committed == 320 * MiB, arena
        assert float(w.sum()) == w.numel()
        usage = arena.usage()
        assert usage.grows == 1 and usage.peak >= 300 * MiB and usage.free == arena.committed - usage.peak, usage
        arena.commit(512 * MiB)
        assert arena.trim() == 512 * MiB - 320 * MiB
        try:
            with arena.allocating():
                torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        except gpumem.ArenaOutOfMemory as exc:
            assert "could not grow" in str(exc) and "cap" in str(exc), exc
        else:
            raise AssertionError("an allocation past the cap was served")
        del w
    print("PASS elastic_torch_arena", flush=True)


def engine_memory_end_to_end() -> None:
    with gpumem.EngineMemory("engine-a", 0) as mem:
        layers, blocks_shape = 2, (16, 4, 64)
        with mem.running():
            w1 = torch.randn(1024, 16384, device="cuda") / 32
            w2 = torch.randn(16384, 1024, device="cuda") / 128
            kv = mem.kv_cache(layers=layers, block_shape=blocks_shape, itemsize=4, max_blocks=4096)
            caches = kv.tensors(torch.float32)
            x = torch.randn(64, 1024, device="cuda")  # h below is 4 MiB: a 20 MiB segment of the graph pool
            slot = torch.zeros(1, dtype=torch.long, device="cuda")
            out = torch.zeros(64, 1024, device="cuda")
            assert inside(mem.model, w1) and inside(mem.model, x)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up, as engines do before capture
                    out.copy_(torch.relu(x @ w1) @ w2)
                with torch.cuda.graph(graph, stream=stream):  # no pool=: routed to the graphs arena
                    y = torch.relu(x @ w1) @ w2
                    out.copy_(y)
                    caches[0][0].index_copy_(0, slot, y.reshape(-1)[: 16 * 4 * 64].reshape(1, *blocks_shape))
            torch.cuda.synchronize()
            assert graph.pool() == mem.graphs.torch_pool().graph_pool
            assert mem.graphs.usage().peak > 0 and inside(mem.graphs, y)
        graphs = mem.graphs_captured({8: graph})
        assert isinstance(graphs[8], gpumem.LeasedGraph) and mem.graph_pool is not None and mem.graph_pool.free_runs
        pending = mem.start_kv_commit(headroom_bytes=256 * MiB, max_blocks=1024)
        blocks = pending.wait()
        assert blocks == kv.blocks == 1024, blocks
        slot.fill_(1000)
        graphs[8].replay()
        expected = (torch.relu(x @ w1) @ w2).reshape(-1)[: 16 * 4 * 64].reshape(*blocks_shape)
        torch.cuda.synchronize()
        assert torch.allclose(caches[0][0][1000], expected, atol=1e-3), "the replay did not write the committed block"

        def sample(logits: torch.Tensor) -> torch.Tensor:
            return torch.softmax(logits.float(), dim=-1).argmax(dim=-1)

        logits = torch.randn(8, 4096, device="cuda")
        first = mem.borrowed(sample, logits, need_bytes=4 * logits.numel())
        reserved = gpumem.memory_reserved()
        again = mem.borrowed(sample, logits, need_bytes=4 * logits.numel())
        assert gpumem.memory_reserved() == reserved, "a steady borrowed step took new memory"
        assert mem.session.borrow_pools[mem.graph_pool.id].torch_pool is not None, "the sampler did not borrow"
        assert torch.equal(first, again) and torch.equal(first, sample(logits))
        graphs[8].replay()
        torch.cuda.synchronize()
        assert torch.allclose(out, torch.relu(x @ w1) @ w2, atol=1e-3)
        del y
    print("PASS engine_memory_end_to_end", flush=True)


SCENARIOS = {
    "elastic_torch_arena": elastic_torch_arena,
    "engine_memory_end_to_end": engine_memory_end_to_end,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
